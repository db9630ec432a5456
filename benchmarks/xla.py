"""Step time with XLA (`jit_compile=True`) against without, per strategy, next to one device's.

Each configuration trains the same model twice in one process, compiled with and without XLA:
on one device, under DataParallelStrategy (each replica's step compiled on its device) and under
PipelineStrategy (each stage's layers compiled on the stage's device). Step times are medians of
in-fit step times (batch-end intervals after a warm-up, `benchmarks._timing`); the rounds
interleave every model, so a slow spell of a shared host weighs on all of them alike. The
figures are per-round ratios: XLA / no XLA for each strategy.

    python -m benchmarks.xla --rounds 5 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _lm(strategy, jit_compile, args):
    import keras

    import tfdist

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tfdist.models.transformer_lm(
            seq_len=args.seq_len, vocab_size=256, d_model=args.width, num_heads=4, num_layers=args.depth
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 steps")
    parser.add_argument("--devices", type=int, default=2, help="data-parallel replicas / pipeline stages")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="default 20 (--quick 8)")
    parser.add_argument("--global_batch_size", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (8 if args.quick else 20)

    import tfdist

    tfdist.simulate_devices(args.devices)
    import numpy as np
    import tensorflow as tf

    from benchmarks import _timing

    devices = tfdist.devices.default_devices()[: args.devices]
    strategies = {
        "one device": lambda: tf.distribute.get_strategy(),
        f"DataParallelStrategy ({len(devices)} replicas)": lambda: tfdist.DataParallelStrategy(devices=devices),
        f"PipelineStrategy ({len(devices)} stages, 2 micro-batches)": lambda: tfdist.PipelineStrategy(
            stages=len(devices), microbatches=2, devices=devices
        ),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(args.global_batch_size * 4, args.seq_len + 1)).astype("int32")
    dataset = (
        tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:]))
        .batch(args.global_batch_size, drop_remainder=True)
        .cache()
        .repeat()
    )
    models = {}
    for name, make in strategies.items():
        for jit in (False, True):
            models[(name, jit)] = model = _lm(make(), jit, args)
            _timing.fit_step_times(model, dataset, steps=2, warmup=2)  # trace, compile, warm up

    times = {key: [] for key in models}
    keys = list(models)
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            times[key].append(statistics.median(_timing.fit_step_times(models[key], dataset, steps=args.steps)))

    rows, figures = [], []
    one = statistics.median(times[("one device", False)])
    for name in strategies:
        off, on = times[(name, False)], times[(name, True)]
        ratios = [a / b for a, b in zip(on, off)]
        rows.append(
            f"| {name} | {1e3 * statistics.median(off):.1f} | {1e3 * statistics.median(on):.1f} | "
            f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{statistics.median(on) / one:.3f} |"
        )
        figures.append(f"step time XLA / no XLA, {name}")
        figures.append(ratios)
    body = (
        f"Model: transformer_lm(seq_len={args.seq_len}, vocab_size=256, d_model={args.width}, num_heads=4, "
        f"num_layers={args.depth}), Adam, global batch {args.global_batch_size}; devices {', '.join(devices)}. "
        f"{args.rounds} rounds interleaving all {len(models)} models; each round's figure is the median of "
        f"{args.steps} in-fit step times (batch-end intervals after a warm-up).\n\n"
        "| strategy | step ms, no XLA | step ms, XLA | XLA / no XLA: median (min-max) | XLA step / one device "
        "without XLA |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Simulated CPU devices share the host's cores: what XLA saves here is per-op overhead and fusion on "
        "the CPU; the strategies' ratios show that each replica's (each stage's) step is compiled, not ignored.\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "XLA",
            _results.command("xla", argv),
            body,
            figures=[_results.figure(label, values) for label, values in zip(figures[::2], figures[1::2])],
        )
    return figures


if __name__ == "__main__":
    main()
