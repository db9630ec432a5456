"""Step time of tfdist.DataParallelStrategy vs raw tf.distribute.MirroredStrategy.

Both strategies train the same model on the same devices in one process; rounds alternate
which strategy goes first, and each round times a block of steps per strategy. The figure is
the median over rounds of (tfdist step time / raw step time); goal <= 1.02.

    python -m benchmarks.overhead --devices 4 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks._models import mlp  # noqa: E402


def time_steps(model, dataset, steps):
    """Seconds per step for `steps` steps (one epoch of fit, the model already traced)."""
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    return (time.perf_counter() - start) / steps


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
        "raw MirroredStrategy": tf.distribute.MirroredStrategy(devices),
        "tfdist DataParallelStrategy": tfdist.DataParallelStrategy(devices=devices),
    }
    rng = np.random.default_rng(0)
    n = args.global_batch_size * args.steps
    x = rng.normal(size=(n, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch_size).repeat().prefetch(2)
    models = {name: mlp(s, width=args.width, depth=args.depth) for name, s in strategies.items()}
    for model in models.values():  # trace and warm up
        time_steps(model, dataset, 5)

    names = list(models)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(time_steps(models[name], dataset, args.steps))
    raw, ours = names
    ratios = [t / b for t, b in zip(times[ours], times[raw])]
    median = statistics.median(ratios)
    body = (
        f"Model: MLP {args.depth}x{args.width} (+10-way head), SGD; global batch {args.global_batch_size} "
        f"over {len(devices)} devices ({', '.join(devices)}); {args.rounds} rounds of {args.steps} steps, "
        "order alternating.\n\n"
        "| strategy | median step time (ms) | min-max (ms) |\n|---|---|---|\n"
        + "".join(
            f"| {name} | {1e3 * statistics.median(times[name]):.2f} | "
            f"{1e3 * min(times[name]):.2f}-{1e3 * max(times[name]):.2f} |\n"
            for name in names
        )
        + f"\n**Step-time ratio tfdist / raw: median {median:.3f}** (min {min(ratios):.3f}, max "
        f"{max(ratios):.3f}; goal <= 1.02).\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "DataParallelStrategy overhead",
            _results.command("overhead", argv),
            body,
            figures=[_results.figure("step time tfdist DataParallelStrategy / raw MirroredStrategy", ratios,
                                     goal="<= 1.02")],
        )
    return median


if __name__ == "__main__":
    main()
