"""What the flight recorder (tfdist.flight) adds to a training step.

One process, one device, a tiny MLP (a step of about a millisecond: the recorder's share is as
large as it gets). Two copies of the model train under the same `DataParallelStrategy`: one built
while no recorder runs (its Keras train function is Keras' own), one built while a recorder with
a status file in a run directory runs (each step is recorded: two ring-buffer records, each a 256-byte
copy of the status into the file's memory map; the heartbeat thread runs through both). The step time
of a `fit` is the median of the intervals between batch ends after a warm-up. A round is `--calls`
short `fit`s of each model, interleaved fit by fit (`benchmarks._timing.interleaved`), and its figure
the median of the ratios (with recorder / without) of fits that ran next to each other
(`benchmarks._timing.round_ratios`): a busy spell of the shared host weighs on both sides alike. A
multi-worker step also waits for its all-reduce, so there the recorder's share is smaller still.

    python -m benchmarks.flight --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import _timing  # noqa: E402
from benchmarks._models import mlp  # noqa: E402

WARMUP = 2


def _record_cost(recorder, n: int = 20000) -> float:
    """Seconds per recorded Keras step (its records only, no TensorFlow), median of 5 loops of `n`."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            with recorder.keras_step("train"):
                pass
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 4 calls")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (--quick 5)")
    parser.add_argument("--calls", type=int, default=None, help="fits of each model per round; default 8 (--quick 4)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per fit")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 7)
    args.calls = args.calls or (4 if args.quick else 8)

    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist import flight

    strategy = tfdist.DataParallelStrategy(devices=["CPU:0"])
    rng = np.random.default_rng(0)
    n = args.batch_size * (args.steps + WARMUP)
    x = rng.normal(size=(n, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).repeat().prefetch(2)
    with tempfile.TemporaryDirectory() as run_dir:
        addresses = ["127.0.0.1:1", "127.0.0.1:2"]
        recorder = flight.FlightRecorder(worker=0, addresses=addresses, run_dir=run_dir)
        plain = mlp(strategy, width=args.width, depth=2)
        _timing.fit_step_times(plain, dataset, steps=3, warmup=WARMUP)  # built and traced with no recorder
        flight.install(recorder)
        recorded = mlp(strategy, width=args.width, depth=2)
        _timing.fit_step_times(recorded, dataset, steps=3, warmup=WARMUP)
        before = recorder.status().seq
        models = {"without recorder": plain, "with recorder (status file)": recorded}
        times = _timing.interleaved(
            {
                name: lambda model=model: _timing.step_time(model, dataset, steps=args.steps, warmup=WARMUP)
                for name, model in models.items()
            },
            args.rounds * args.calls,
        )
        steps_recorded = recorder.status().seq - before
        per_step_file = _record_cost(recorder)
        bare = flight.FlightRecorder(worker=0, addresses=addresses)
        per_step_bare = _record_cost(bare)
        flight.install(None)
        bare.close()
    without, with_ = list(models)
    ratios = _timing.round_ratios(times[with_], times[without], per_round=args.calls)
    rounds = {name: _timing.round_medians(times[name], per_round=args.calls) for name in models}
    # Each fit of the recorded model: warm-up + timed steps, all recorded; none of the other's.
    expected = args.rounds * args.calls * (args.steps + WARMUP)
    assert steps_recorded == expected, (steps_recorded, expected)
    body = (
        f"Model: MLP 2x{args.width} (+10-way head), SGD, batch {args.batch_size}, one CPU device, "
        "tfdist.DataParallelStrategy. Step times are measured inside `fit`: the median of the "
        f"{args.steps} intervals between batch ends after {WARMUP} warm-up steps, one figure per fit; "
        f"{args.rounds} rounds of {args.calls} fits of each model, interleaved fit by fit; a round's ratio is the "
        "median of the ratios of fits that ran next to each other; medians over rounds (min-max). The recorded "
        f"model's {steps_recorded} steps were each recorded (the other's none).\n\n"
        "| model | median step time (ms) | min-max of the round medians (ms) |\n|---|---|---|\n"
        + "".join(
            f"| {name} | {1e3 * statistics.median(rounds[name]):.3f} | "
            f"{1e3 * min(rounds[name]):.3f}-{1e3 * max(rounds[name]):.3f} |\n"
            for name in models
        )
        + f"\n**Step-time ratio with / without the flight recorder: median {statistics.median(ratios):.3f}** (min "
        f"{min(ratios):.3f}, max {max(ratios):.3f}; goal <= 1.01).\n\n"
        f"The recorder's own work per Keras step, timed alone (no TensorFlow, median of 5 loops of 20000): "
        f"{1e6 * per_step_file:.1f} us with a status file, {1e6 * per_step_bare:.1f} us without one: "
        f"{100 * per_step_file / statistics.median(rounds[without]):.2f}% of the step without recorder. Where the "
        "ratio's min-max spans more than that, it cannot resolve the recorder's cost on this host.\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "Flight recorder overhead",
            _results.command("flight", argv),
            body,
            figures=[
                _results.figure("step time with / without the flight recorder (1 ms steps)", ratios, goal="<= 1.01")
            ],
        )
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
