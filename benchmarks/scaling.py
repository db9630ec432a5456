"""Data-parallel scaling: examples/s and scaling efficiency on 1..N devices, LM and MLP.

Weak scaling, as Horovod reports it: each device keeps the same per-device batch, so N devices
train a global batch N times larger. Each model is trained with `model.fit` under
`tfdist.DataParallelStrategy` over the first 1, 2, 4, ... devices (GPUs when the host has any,
else simulated CPUs), in one process. Every round runs one `fit` epoch on each N, the order
changing from round to round (`benchmarks._timing.interleaved`), and takes its step time inside `fit`: the median of the
intervals between batch ends after a warm-up of 2 steps (`benchmarks._timing`; not a `fit()`
call's wall time, which includes seconds of tf.data work after the last step). examples/s =
global batch / step time; efficiency(N) = examples/s on N / (N x examples/s on 1), both from the
same round; the figures are medians over rounds with min-max.

Models: `tfdist.models.transformer_lm` (seq_len 64, d_model 128, 2 layers, Adam) and the
benchmarks' MLP (3 x Dense(512), SGD).

    python -m benchmarks.scaling              # N = 1, 2, 4, 8; 5 rounds
    python -m benchmarks.scaling --quick      # N = 1, 2, 4;    5 rounds of fewer steps
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import _timing  # noqa: E402

WARMUP = 2  # steps of each round's fit epoch before the timed ones
LM = {"seq_len": 64, "vocab_size": 256, "d_model": 128, "num_heads": 4, "num_layers": 2}
MLP = {"width": 512, "depth": 3}


def build(kind: str, strategy):
    import keras

    from benchmarks._models import mlp
    from tfdist import models

    if kind == "MLP":
        return mlp(strategy, **MLP)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.transformer_lm(**LM)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def dataset(kind: str, global_batch: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = global_batch * 4
    if kind == "MLP":
        x = rng.normal(size=(n, MLP["width"])).astype("float32")
        y = rng.integers(0, 10, size=(n,)).astype("int32")
    else:
        x = rng.integers(0, LM["vocab_size"], size=(n, LM["seq_len"])).astype("int32")
        y = rng.integers(0, LM["vocab_size"], size=(n, LM["seq_len"])).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat().prefetch(2)


def plot(curves: dict, path: str) -> None:
    from benchmarks import _results

    plt = _results.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, points in curves.items():
        ns = sorted(points)
        rate = [statistics.median(points[n]["rate"]) for n in ns]
        eff = [statistics.median(points[n]["eff"]) for n in ns]
        lo = [min(points[n]["eff"]) for n in ns]
        hi = [max(points[n]["eff"]) for n in ns]
        left.plot(ns, rate, marker="o", label=kind)
        right.errorbar(ns, eff, yerr=[[e - a for e, a in zip(eff, lo)], [b - e for e, b in zip(eff, hi)]],
                       marker="o", capsize=3, label=kind)
    right.axhline(1.0, color="black", lw=1, ls="--")
    right.axhline(0.9, color="gray", lw=1, ls=":", label="Horovod's published 90%")
    left.set(xscale="log", yscale="log", xlabel="devices", ylabel="examples/s (median)", title="Throughput")
    right.set(xscale="log", xlabel="devices", ylabel="efficiency (median, min-max)", title="Scaling efficiency")
    for ax in (left, right):
        ax.set_xticks(sorted(next(iter(curves.values()))))
        ax.set_xticklabels([str(n) for n in sorted(next(iter(curves.values())))])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 4, 5 rounds of 8 steps")
    parser.add_argument("--devices", type=int, default=None, help="largest N (default 8; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block (default 20; --quick 8)")
    parser.add_argument("--mlp_batch", type=int, default=64, help="per-device batch of the MLP")
    parser.add_argument("--lm_batch", type=int, default=8, help="per-device batch of the LM (sequences)")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    largest = args.devices or (4 if args.quick else 8)
    rounds = args.rounds or 5
    steps = args.steps or (8 if args.quick else 20)

    import tensorflow as tf

    import tfdist

    on_gpus = bool(tf.config.list_physical_devices("GPU"))
    if not on_gpus:
        tfdist.simulate_devices(largest)
    devices = tfdist.devices.default_devices()[:largest]
    counts = [n for n in (1, 2, 4, 8, 16, 32) if n <= len(devices)]
    per_device = {"LM": args.lm_batch, "MLP": args.mlp_batch}

    curves = {}
    for kind in ("LM", "MLP"):
        runs = {}
        for n in counts:
            strategy = tfdist.DataParallelStrategy(devices=devices[:n])
            model = build(kind, strategy)
            data = dataset(kind, per_device[kind] * n)
            _timing.fit_step_times(model, data, steps=1, warmup=WARMUP)  # trace and warm up
            runs[n] = (model, data)
        times = _timing.interleaved(
            {n: lambda run=run: _timing.step_time(*run, steps=steps, warmup=WARMUP) for n, run in runs.items()},
            rounds,
        )
        points = {n: {"rate": [], "eff": []} for n in counts}
        for r in range(rounds):
            rates = {n: per_device[kind] * n / times[n][r] for n in counts}
            for n in counts:
                points[n]["rate"].append(rates[n])
                points[n]["eff"].append(rates[n] / (n * rates[1]))
            print(f"{kind} round {r}: " + ", ".join(f"N={n} {rates[n]:.0f} ex/s" for n in counts), flush=True)
        curves[kind] = points

    from benchmarks import _results

    rows = []
    figures = []
    for kind, points in curves.items():
        for n in counts:
            rate, eff = points[n]["rate"], points[n]["eff"]
            rows.append(
                f"| {kind} | {n} | {per_device[kind] * n} | {statistics.median(rate):.0f} "
                f"({min(rate):.0f}-{max(rate):.0f}) | {statistics.median(eff):.3f} ({min(eff):.3f}-{max(eff):.3f}) |"
            )
        top = counts[-1]
        figures.append(
            _results.figure(f"scaling efficiency, {kind}, N={top}", points[top]["eff"], goal=">= 0.9 (Horovod)")
        )
    kinds = ", ".join(f"{f['figure'].split(', ')[1]} {f['median']:.2f}" for f in figures)
    where = (
        f"{len(devices)} GPUs ({', '.join(devices)})"
        if on_gpus
        else f"{len(devices)} simulated CPU devices on {os.cpu_count()} cores"
    )
    body = (
        f"Weak scaling over {where}: per-device batch LM {per_device['LM']} sequences of {LM['seq_len']} tokens "
        f"(transformer_lm d_model {LM['d_model']}, {LM['num_layers']} layers, Adam), MLP {per_device['MLP']} examples "
        f"(3 x Dense(512), SGD). Step times are measured inside `fit`: the median of the {steps} intervals between "
        f"batch ends after {WARMUP} warm-up steps, one figure per N and round; {rounds} rounds, the N interleaved "
        "(each first, and right after each other, equally often), efficiency taken round by round; medians over "
        "rounds (min-max).\n\n"
        "| model | devices | global batch | examples/s | efficiency |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\n**Scaling efficiency at N={counts[-1]}: {kinds}** (1.0 = linear; Horovod publishes ~0.9 on GPUs).\n\n"
        + (
            "These are real GPUs: the figure to compare with Horovod's."
            if on_gpus
            else "Simulated CPU devices share the host's cores: one device already runs its ops on all of them "
            "(intra-op threads), so N devices do N times the work with the same cores, and efficiency near 1/N "
            "is what this host can show. It measures tfdist's overhead per device, not real scaling; run the "
            "same command on a multi-GPU machine for that."
        )
    )
    print(body)
    path = _results.plot_path("scaling")
    if not args.no_write:
        plot(curves, path)
        _results.write_section(
            "Data-parallel scaling",
            _results.command("scaling", argv),
            body,
            figures=figures,
            plot=os.path.basename(path),
        )
    return figures


if __name__ == "__main__":
    main()
