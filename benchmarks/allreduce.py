"""All-reduce bandwidth on the local devices (nccl-tests style), next to the host's memcpy bandwidth.

For each float32 message size (1 KiB to 256 MiB; `--quick`: to 16 MiB) and N = 2, 4, 8 devices,
times one all-reduce (sum) of one tensor per device, the way tfdist all-reduces gradients:
`tfdist.strategies.collectives.all_reduce_gradients` inside `strategy.run` in a `tf.function`, under a
`tfdist.DataParallelStrategy` over the first N devices. Communications compared: "auto" (on CPUs it is
"reduce_to_one", so the two columns measure one implementation twice; on GPUs TensorFlow's NCCL
collectives), "ring", "reduce_to_one", "hierarchical", "nccl" (GPUs only), and tfdist's compressed
all-reduce ("auto" with `gradient_dtype="bfloat16"`: cast, all-reduce half the bytes, cast back).
Then the data-parallel MLP step (`fit`, steps timed inside it: `benchmarks._timing`) with "auto" and
with "ring", interleaved rounds.

- algbw = message bytes / time; busbw = algbw x 2(N-1)/N (what each device sends and receives in a
  ring all-reduce, per second; the figure nccl-tests reports, comparable across N). For bfloat16 the
  message bytes are the float32 bytes it stands for (the bandwidth a user gets).
- memcpy: `np.copyto` of a 256 MiB (`--quick`: 64 MiB) float32 array, bytes copied / time, in the same
  run. On one host the devices share its memory, so this is the physical limit.

Each figure is the median over rounds (with min-max); the choices' rounds are interleaved. Simulated
devices are used unless the host has 2 or more GPUs.

    python -m benchmarks.allreduce            # full: 1 KiB - 256 MiB, 5 rounds
    python -m benchmarks.allreduce --quick    # 1 KiB - 16 MiB, 5 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KIB = 1024
MIB = 1024 * KIB
ROUND_SECONDS = 0.05  # each round times enough all-reduces to last about this long


def sizes(largest: int) -> list[int]:
    """1 KiB, 4 KiB, ... (powers of 4) up to `largest` bytes."""
    out, size = [], KIB
    while size <= largest:
        out.append(size)
        size *= 4
    return out


def label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def memcpy_bandwidth(nbytes: int, rounds: int) -> list[float]:
    """Bytes per second of np.copyto of `nbytes`, one figure per round."""
    import numpy as np

    src = np.ones(nbytes // 4, "float32")
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        np.copyto(dst, src)
        out.append(nbytes / (time.perf_counter() - start))
    return out


def time_all_reduces(strategies: dict, nbytes: int, rounds: int) -> dict:
    """Seconds per all-reduce of an `nbytes` float32 tensor per device, per strategy, one figure per round.

    The strategies' rounds are interleaved (the order rotating from round to round), so that a slow
    spell of the shared host, or the first touch of large buffers, weighs on all of them alike.
    """
    import tensorflow as tf

    from tfdist.strategies import collectives

    elements = nbytes // 4
    runs = {}
    for name, strategy in strategies.items():
        values = strategy.experimental_distribute_values_from_function(lambda _: tf.zeros([elements]))

        @tf.function
        def all_reduce(v, strategy=strategy):  # zeros stay zeros: the result can feed the next call, in order
            return strategy.run(lambda t: collectives.all_reduce_gradients(strategy, [t])[0], args=(v,))

        for _ in range(2):  # trace, then warm up
            values = all_reduce(values)
        start = time.perf_counter()
        values = all_reduce(values)
        once = time.perf_counter() - start
        runs[name] = [all_reduce, values, max(1, min(200, int(ROUND_SECONDS / max(once, 1e-6))))]
    names = list(strategies)
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            all_reduce, values, iters = runs[name]
            start = time.perf_counter()
            for _ in range(iters):
                values = all_reduce(values)
            strategies[name].experimental_local_results(values)[0].numpy()[:1]  # wait for the last one
            out[name].append((time.perf_counter() - start) / iters)
            runs[name][1] = values
    return out


MLP_WIDTH, MLP_DEPTH, MLP_BATCH, MLP_STEPS = 1024, 3, 256, 8


def mlp_step_ratios(devices, counts, *, rounds: int) -> dict:
    """Per N: the median step time with "auto" and with "ring", and per round their ratio (auto / ring)."""
    import numpy as np
    import tensorflow as tf

    import tfdist
    from benchmarks import _timing
    from benchmarks._models import mlp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(MLP_BATCH, MLP_WIDTH)).astype("float32")
    y = rng.integers(0, 10, size=(MLP_BATCH,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(MLP_BATCH).repeat()
    out = {}
    for n in counts:
        models = {
            comm: mlp(
                tfdist.DataParallelStrategy(devices=devices[:n], communication=comm), width=MLP_WIDTH, depth=MLP_DEPTH
            )
            for comm in ("auto", "ring")
        }
        times = {comm: [] for comm in models}
        for r in range(rounds):
            for comm in ("auto", "ring") if r % 2 == 0 else ("ring", "auto"):
                times[comm].append(statistics.median(_timing.fit_step_times(models[comm], data, steps=MLP_STEPS)))
        out[n] = {
            "auto": statistics.median(times["auto"]),
            "ring": statistics.median(times["ring"]),
            "ratios": [a / b for a, b in zip(times["auto"], times["ring"])],
        }
        print(f"N={n} MLP step: auto {out[n]['auto'] * 1e3:.1f} ms, ring {out[n]['ring'] * 1e3:.1f} ms", flush=True)
    return out


def plot(results, memcpy: float, path: str) -> None:
    from benchmarks import _results

    plt = _results.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    styles = {
        "auto": "-",
        "ring": "--",
        "nccl": "-.",
        "reduce_to_one": (0, (1, 1)),
        "hierarchical": (0, (5, 1)),
        "auto+bfloat16": ":",
    }
    for (n, comm), rows in sorted(results.items()):
        xs = [r["bytes"] for r in rows]
        ys = [r["busbw"] / 1e9 for r in rows]
        lo = [r["busbw_min"] / 1e9 for r in rows]
        hi = [r["busbw_max"] / 1e9 for r in rows]
        line = ax.plot(
            xs, ys, linestyle=styles.get(comm, "-"), marker="o", ms=3, color=colors.get(n), label=f"N={n} {comm}"
        )
        colors.setdefault(n, line[0].get_color())
        ax.fill_between(xs, lo, hi, color=colors[n], alpha=0.12)
    ax.axhline(memcpy / 1e9, color="black", lw=1)
    ax.text(KIB, memcpy / 1e9 * 1.08, f"memcpy {memcpy / 1e9:.1f} GB/s", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, float32)")
    ax.set_ylabel("bus bandwidth (GB/s), median and min-max")
    ax.set_title("All-reduce bus bandwidth vs memcpy (same run)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes to 16 MiB, 5 rounds (2 cores: ~1 min)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--max_bytes", type=int, default=None, help="largest message; default 256 MiB (--quick 16 MiB)")
    parser.add_argument("--devices", type=int, default=8, help="largest N; N runs over 2, 4, ... up to it")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    rounds = args.rounds or 5
    largest = args.max_bytes or (16 * MIB if args.quick else 256 * MIB)

    import tensorflow as tf

    import tfdist

    on_gpus = len(tf.config.list_physical_devices("GPU")) >= 2
    if not on_gpus:
        tfdist.simulate_devices(args.devices)
    devices = (
        [d.name for d in tf.config.list_logical_devices("GPU")] if on_gpus else tfdist.devices.default_devices()
    )[: args.devices]
    counts = [n for n in (2, 4, 8, 16) if n <= len(devices)]
    comms = ["auto", "ring", "reduce_to_one", "hierarchical"] + (["nccl"] if on_gpus else []) + ["auto+bfloat16"]

    memcpy_bytes = 64 * MIB if args.quick else 256 * MIB
    memcpy_rounds = memcpy_bandwidth(memcpy_bytes, max(rounds, 5))
    memcpy = statistics.median(memcpy_rounds)
    print(f"memcpy {label(memcpy_bytes)}: {memcpy / 1e9:.2f} GB/s")

    results = {}
    for n in counts:
        strategies = {}
        for comm in comms:
            communication, _, gdtype = comm.partition("+")
            strategies[comm] = tfdist.DataParallelStrategy(
                devices=devices[:n], communication=communication, gradient_dtype=gdtype or None
            )
            results[(n, comm)] = []
        for nbytes in sizes(largest):
            measured = time_all_reduces(strategies, nbytes, rounds)
            factor = 2 * (n - 1) / n
            for comm in comms:
                times = measured[comm]
                busbws = [nbytes / t * factor for t in times]  # in round order
                results[(n, comm)].append(
                    {
                        "bytes": nbytes,
                        "time": statistics.median(times),
                        "algbw": nbytes / statistics.median(times),
                        "busbw": statistics.median(busbws),
                        "busbw_min": min(busbws),
                        "busbw_max": max(busbws),
                        "ratios": [b / memcpy for b in busbws],
                    }
                )
                row = results[(n, comm)][-1]
                print(
                    f"N={n} {comm:14s} {label(nbytes):>8s}: {row['time'] * 1e6:10.1f} us, "
                    f"busbw {row['busbw'] / 1e9:7.3f} GB/s",
                    flush=True,
                )

    top = sizes(largest)[-1]

    def at(n, comm, nbytes=top):
        return next(r for r in results[(n, comm)] if r["bytes"] == nbytes)

    header = "| size | N | " + " | ".join(f"{c} busbw GB/s (min-max)" for c in comms) + " | auto busbw / memcpy |"
    lines = [header, "|" + "---|" * (len(comms) + 3)]
    for nbytes in sizes(largest):
        for n in counts:
            cells = [
                f"{at(n, c, nbytes)['busbw'] / 1e9:.3f} ({at(n, c, nbytes)['busbw_min'] / 1e9:.3f}-"
                f"{at(n, c, nbytes)['busbw_max'] / 1e9:.3f})"
                for c in comms
            ]
            ratio = at(n, "auto", nbytes)["busbw"] / memcpy
            lines.append(f"| {label(nbytes)} | {n} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    nmax = counts[-1]
    figures = []
    from benchmarks import _results

    for n in counts:
        figures.append(
            _results.figure(f"all-reduce busbw / memcpy, N={n}, {label(top)}, auto", at(n, "auto")["ratios"])
        )
    best = {}
    for n in counts:
        # "auto" against the best other choice measured at the largest size, round by round.
        others = [c for c in comms if c not in ("auto", "auto+bfloat16")]
        best[n] = max(others, key=lambda c: at(n, c)["busbw"])
        figures.append(
            _results.figure(
                f"all-reduce busbw auto / best ({best[n]}), N={n}, {label(top)}",
                [a / b for a, b in zip(at(n, "auto")["ratios"], at(n, best[n])["ratios"])],
                goal=">= 0.9",
            )
        )
    steps = mlp_step_ratios(devices, counts, rounds=max(rounds, 3))
    for n in counts:
        figures.append(
            _results.figure(f"data-parallel MLP step time auto / ring, N={n}", steps[n]["ratios"], goal="<= 1")
        )
    compressed = [a / b for a, b in zip(at(nmax, "auto+bfloat16")["ratios"], at(nmax, "auto")["ratios"])]
    figures.append(
        _results.figure(
            f"all-reduce busbw bfloat16 / float32, N={nmax}, {label(top)}", compressed, goal="> 1 where bytes limit"
        )
    )
    headline = figures[len(counts) - 1]
    body = (
        f"Devices: {', '.join(devices[:nmax])} ({'GPUs' if on_gpus else 'simulated CPUs sharing the host'}); "
        f"float32 messages {label(KIB)} to {label(top)}; {rounds} rounds of >= {ROUND_SECONDS * 1e3:.0f} ms per "
        f"point, the choices' rounds interleaved, medians (min-max). "
        f"memcpy ({label(memcpy_bytes)}, np.copyto): **{memcpy / 1e9:.2f} GB/s** "
        f"(min {min(memcpy_rounds) / 1e9:.2f}, max {max(memcpy_rounds) / 1e9:.2f}).\n\n"
        + "\n".join(lines)
        + f"\n\n**At {label(top)} on N={nmax}: bus bandwidth {at(nmax, 'auto')['busbw'] / 1e9:.2f} GB/s = "
        f"{headline['median']:.3f}x memcpy** (min {headline['min']:.3f}, max {headline['max']:.3f}); "
        f"tfdist's bfloat16 all-reduce moves the same float32 gradient at {figures[-1]['median']:.2f}x the "
        "float32 all-reduce's rate (it sends half the bytes but adds two casts).\n\n"
        + "\n\nData-parallel MLP step (width "
        + f"{MLP_WIDTH}, depth {MLP_DEPTH}, global batch {MLP_BATCH}, SGD; median of {MLP_STEPS} steps timed inside "
        + "`fit` per round, rounds interleaved): "
        + "; ".join(
            f"N={n}: auto {steps[n]['auto'] * 1e3:.1f} ms, ring {steps[n]['ring'] * 1e3:.1f} ms "
            f"(auto / ring {statistics.median(steps[n]['ratios']):.3f})"
            for n in counts
        )
        + ".\n\n"
        + (
            "The devices are logical CPUs of one host: every 'transfer' is a memory copy through the "
            "same RAM and the same cores, so the bus bandwidth is bounded by memcpy and small messages "
            "by per-op latency (microseconds of executor dispatch), not by a link. A ring moves each "
            "byte 2(N-1)/N times in N-1 dependent rounds of small copies; summing on one device and "
            "copying back moves it once per device, which is why 'auto' is 'reduce_to_one' on CPUs."
            if not on_gpus
            else "GPU bus bandwidth is bounded by the interconnect (NVLink/PCIe), not by host memcpy."
        )
    )
    print(body)
    path = _results.plot_path("allreduce")
    if not args.no_write:
        plot(results, memcpy, path)
        _results.write_section(
            "All-reduce bandwidth",
            _results.command("allreduce", argv),
            body,
            figures=figures,
            plot=os.path.basename(path),
        )
    return figures


if __name__ == "__main__":
    main()
