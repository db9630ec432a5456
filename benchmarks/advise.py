"""tfdist.advise's predicted data-parallel speed-up against `model.fit` timed side by side.

A wide MLP (width 512, 2 hidden layers, batch 4,096) on 2 simulated CPU devices of one core each
(intra-op threads = 1, like two separate accelerators on a 2-core host, where data parallelism really
pays). Each round pairs one prediction (`tfdist.advise(..., rounds=9, min_speedup=1.0)`) with the
speed-up measured right after it: steady-state seconds per `fit` step (the median batch-end interval
after 3 warm-up steps) on one device / under DataParallelStrategy, the two alternating in turn. A slow
spell of a shared host can outlast one advise() call, so the figure is over rounds (median, min-max).

    python -m benchmarks.advise              # 5 rounds
    python -m benchmarks.advise --rounds 3 --no_write
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WIDTH, DEPTH, BATCH, STEPS = 512, 2, 4096, 12
DEVICES = ["CPU:0", "CPU:1"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="prediction + measurement pairs (default 5)")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # one core per simulated device (before TF starts)
    import tfdist

    tfdist.simulate_devices(len(DEVICES))
    import keras
    import numpy as np

    def mlp():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
            + [keras.layers.Dense(10)]
        )
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, WIDTH)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    one = mlp()
    with tfdist.DataParallelStrategy(devices=DEVICES).scope():
        dp = mlp()

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    def step_time(model):
        clock = Clock()
        model.fit(data, steps_per_epoch=STEPS, epochs=1, verbose=0, callbacks=[clock])
        return statistics.median(b - a for a, b in zip(clock.times[3:], clock.times[4:]))

    step_time(one), step_time(dp)  # trace, and warm the process up before measuring
    rows = []
    for r in range(args.rounds):
        advice = tfdist.advise(mlp(), (x, y), devices=DEVICES, rounds=9, min_speedup=1.0)
        ratios = []
        for i in range(3):
            first, second = (one, dp) if (r + i) % 2 == 0 else (dp, one)
            t = {id(first): step_time(first), id(second): step_time(second)}
            ratios.append(t[id(one)] / t[id(dp)])
        rows.append((advice.recommendation, advice.predicted_speedup, statistics.median(ratios)))
        print(f"round {r}: {rows[-1][0]}, predicted {rows[-1][1]:.2f}x, measured {rows[-1][2]:.2f}x", flush=True)

    errors = [abs(p - m) / m for _, p, m in rows]
    body = (
        "| round | recommendation | predicted speed-up | measured (fit, side by side) | relative error |\n"
        "|---|---|---|---|---|\n"
        + "".join(f"| {i} | {rec} | {p:.2f}x | {m:.2f}x | {e:.0%} |\n" for i, ((rec, p, m), e) in
                  enumerate(zip(rows, errors)))
        + f"\n**The predicted speed-up is within {statistics.median(errors):.0%} of the measured one (median over "
        f"{len(rows)} rounds; largest {max(errors):.0%}); {sum(rec == 'data parallel' for rec, _, _ in rows)} of "
        f"{len(rows)} rounds recommend data parallelism.** Width {WIDTH}, {DEPTH} hidden layers, batch {BATCH:,}, "
        "2 simulated CPU devices of one core each.\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "Advisor: predicted vs measured speed-up",
            _results.command("advise", argv),
            body,
            figures=[_results.figure("predicted / measured data-parallel speed-up", [p / m for _, p, m in rows])],
        )
    return rows


if __name__ == "__main__":
    main()
