"""Step time of tfdist.DataParallelStrategy vs raw tf.distribute.MirroredStrategy.

The strategies train the same model on the same devices in one process: raw MirroredStrategy
with its default all-reduce (on CPUs: ring collectives), DataParallelStrategy with the same
all-reduce (`communication="ring"`: what tfdist itself adds, goal <= 1.02), and
DataParallelStrategy with its default (`"auto"`: what a user gets). Each round runs one `fit`
epoch per strategy, in a balanced order (`benchmarks._timing.interleaved`), and takes its step
time inside `fit`: the median of the intervals between batch ends after a warm-up of 2 steps (a
`fit()` call's wall time includes seconds of tf.data and iterator work after the last step).
Each figure is the median over rounds of (tfdist step time / raw step time) in the same round,
with its min-max.

    python -m benchmarks.overhead --devices 4 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import _timing  # noqa: E402
from benchmarks._models import mlp  # noqa: E402

WARMUP = 2  # steps of each round's fit epoch before the timed ones


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 15 steps")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (--quick 5)")
    parser.add_argument("--steps", type=int, default=None, help="default 40 (--quick 15)")
    parser.add_argument("--global_batch_size", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 7)
    args.steps = args.steps or (15 if args.quick else 40)

    import tfdist

    tfdist.simulate_devices(args.devices)  # logical CPUs; GPUs, when present, are used instead
    import numpy as np
    import tensorflow as tf

    devices = tfdist.devices.default_devices()[: args.devices]
    strategies = {
        "raw MirroredStrategy (default all-reduce)": tf.distribute.MirroredStrategy(devices),
        'tfdist DataParallelStrategy, communication="ring"': tfdist.DataParallelStrategy(
            devices=devices, communication="ring"
        ),
        'tfdist DataParallelStrategy, communication="auto" (default)': tfdist.DataParallelStrategy(devices=devices),
    }
    ours = strategies[list(strategies)[-1]]
    raw_ops = type(strategies[list(strategies)[0]].extended._cross_device_ops).__name__
    rng = np.random.default_rng(0)
    n = args.global_batch_size * args.steps
    x = rng.normal(size=(n, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch_size).repeat().prefetch(2)
    models = {name: mlp(s, width=args.width, depth=args.depth) for name, s in strategies.items()}
    for model in models.values():  # trace and warm up
        _timing.fit_step_times(model, dataset, steps=3, warmup=WARMUP)

    names = list(models)
    times = _timing.interleaved(
        {
            name: lambda model=model: _timing.step_time(model, dataset, steps=args.steps, warmup=WARMUP)
            for name, model in models.items()
        },
        args.rounds,
    )
    raw, ring, auto = names
    ratios = {name: [t / b for t, b in zip(times[name], times[raw])] for name in (ring, auto)}
    median = statistics.median(ratios[ring])
    body = (
        f"Model: MLP {args.depth}x{args.width} (+10-way head), SGD; global batch {args.global_batch_size} "
        f"over {len(devices)} devices ({', '.join(devices)}). Step times are measured inside `fit`: the median "
        f"of the {args.steps} intervals between batch ends after {WARMUP} warm-up steps, one figure per round; "
        f"{args.rounds} rounds, the strategies interleaved in a balanced order, medians over rounds (min-max); "
        "the ratio is taken round by round.\n\n"
        "| strategy | median step time (ms) | min-max over rounds (ms) |\n|---|---|---|\n"
        + "".join(
            f"| {name} | {1e3 * statistics.median(times[name]):.2f} | "
            f"{1e3 * min(times[name]):.2f}-{1e3 * max(times[name]):.2f} |\n"
            for name in names
        )
        + f"\n**Step-time ratio tfdist / raw, same all-reduce (ring): median {median:.3f}** (min "
        f"{min(ratios[ring]):.3f}, max {max(ratios[ring]):.3f}; goal <= 1.02): what tfdist adds to a step.\n\n"
        f"**Step-time ratio tfdist default / raw default: median {statistics.median(ratios[auto]):.3f}** (min "
        f"{min(ratios[auto]):.3f}, max {max(ratios[auto]):.3f}): raw MirroredStrategy all-reduces with "
        f"{raw_ops} here, tfdist's \"auto\" with \"{ours.resolved_communication}\".\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "DataParallelStrategy overhead",
            _results.command("overhead", argv),
            body,
            figures=[
                _results.figure(
                    "step time tfdist DataParallelStrategy / raw MirroredStrategy, same all-reduce (ring)",
                    ratios[ring],
                    goal="<= 1.02",
                ),
                _results.figure(
                    "step time tfdist DataParallelStrategy / raw MirroredStrategy, each its default all-reduce",
                    ratios[auto],
                ),
            ],
        )
    return median


if __name__ == "__main__":
    main()
