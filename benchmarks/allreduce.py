"""All-reduce bandwidth on the local devices (nccl-tests style), next to the host's memcpy bandwidth.

For each float32 message size (1 KiB to 256 MiB, powers of 4; `--quick`: 1 KiB, 16 KiB, ... 64 MiB)
and N = 2, 4, 8 devices,
times one all-reduce (sum) of one tensor per device, the way tfdist all-reduces gradients:
`tfdist.strategies.collectives.all_reduce_gradients` inside `strategy.run` in a `tf.function`, under a
`tfdist.DataParallelStrategy` over the first N devices. Communications compared: "auto" (on CPUs it is
"reduce_to_one", so the two columns measure one implementation twice; on GPUs TensorFlow's NCCL
collectives), "ring", "reduce_to_one", "hierarchical", "nccl" (GPUs only: not measured on CPUs),
and tfdist's compressed all-reduce ("auto" with `gradient_dtype="bfloat16"`: cast, all-reduce half
the bytes, cast back). Then the data-parallel MLP step with "auto" and with "ring": step times
measured inside `fit` (the median of the intervals between batch ends after a warm-up of 2 steps,
`benchmarks._timing`; not a `fit()` call's wall time), rounds interleaved.

Headline figures, at 64 MiB for every N (the issue's acceptance size): busbw of "auto" / busbw of
the best other exact choice measured in the same rounds (goal >= 0.9), and "auto"'s busbw / memcpy.

- algbw = message bytes / time; busbw = algbw x 2(N-1)/N (what each device sends and receives in a
  ring all-reduce, per second; the figure nccl-tests reports, comparable across N). For bfloat16 the
  message bytes are the float32 bytes it stands for (the bandwidth a user gets).
- memcpy: `np.copyto` of a float32 array of the message's size, bytes copied / time, timed in the
  same rounds as the all-reduces. On one host the devices share its memory, so this is the physical
  limit.

Per size and N, the choices' all-reduces (and the memcpys) are interleaved call by call, the order
changing from turn to turn so that each runs first, and right after each other one, equally often
(`benchmarks._timing.interleaved`); a round is as many calls of each as last about 50 ms
per choice (200 ms at the headline size, which also gets at least 7 rounds), and its figure is the
median of each one's call times; a ratio (auto / best, busbw / memcpy) is the median over the
round of the ratios of calls that ran side by side. Each figure is the median over rounds (with
min-max). Simulated devices are used unless the host has 2 or more GPUs.

    python -m benchmarks.allreduce            # full: 1 KiB - 256 MiB, 5 rounds
    python -m benchmarks.allreduce --quick    # 1 KiB - 64 MiB (powers of 16), 5 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import _timing  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
HEADLINE = 64 * MIB  # the size of the headline figures
ROUND_SECONDS = 0.05  # each round times enough all-reduces to last about this long
HEADLINE_ROUND_SECONDS = 0.2  # ... at the headline size
HEADLINE_ROUNDS = 7  # at least this many rounds at the headline size


def sizes(largest: int, step: int = 4) -> list[int]:
    """1 KiB, 4 KiB, ... (powers of `step`) up to `largest` bytes."""
    out, size = [], KIB
    while size <= largest:
        out.append(size)
        size *= step
    return out


def label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def memcpy_call(nbytes: int):
    """A function timing one `np.copyto` of `nbytes` (float32): seconds."""
    import numpy as np

    src = np.ones(nbytes // 4, "float32")
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages

    def one():
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    return one


def time_all_reduces(
    strategies: dict, nbytes: int, rounds: int, round_seconds: float = ROUND_SECONDS
) -> tuple[dict[str, list[float]], int]:
    """Seconds of every all-reduce of an `nbytes` float32 tensor per device, per strategy, and the calls per round.

    Also "memcpy": seconds per `np.copyto` of the same bytes. The calls are interleaved one by one
    (in a balanced order that changes from turn to turn, `benchmarks._timing.interleaved`), so that a slow spell
    of the shared host, or the first touch of large buffers, weighs on all of them alike, and call k
    of one can be set against call k of another (`benchmarks._timing.round_ratios`); a round is as
    many calls of each as last about `round_seconds` per strategy. (A `tf.function` call runs
    synchronously: it returns once its outputs are computed.)
    """
    import tensorflow as tf

    from tfdist.strategies import collectives

    elements = nbytes // 4
    calls = {}
    for name, strategy in strategies.items():
        values = strategy.experimental_distribute_values_from_function(lambda _: tf.zeros([elements]))

        @tf.function
        def all_reduce(v, strategy=strategy):  # zeros stay zeros: the result can feed the next call, in order
            return strategy.run(lambda t: collectives.all_reduce_gradients(strategy, [t])[0], args=(v,))

        for _ in range(2):  # trace, then warm up
            values = all_reduce(values)
        state = {"values": values}

        def one(all_reduce=all_reduce, state=state):
            start = time.perf_counter()
            state["values"] = all_reduce(state["values"])
            return time.perf_counter() - start

        calls[name] = one
    calls["memcpy"] = memcpy_call(nbytes)
    once = sum(min(call(), call()) for call in calls.values())  # (warms up the memcpy too)
    per_round = max(1, min(200, int(round_seconds * len(calls) / max(once, 1e-6))))
    return _timing.interleaved(calls, rounds * per_round), per_round


MLP_WIDTH, MLP_DEPTH, MLP_BATCH, MLP_STEPS = 1024, 3, 256, 8


def mlp_step_ratios(devices, counts, *, rounds: int) -> dict:
    """Per N: the median step time with "auto" and with "ring", and per round their ratio (auto / ring)."""
    import numpy as np
    import tensorflow as tf

    import tfdist
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
        for model in models.values():  # trace and warm up
            _timing.fit_step_times(model, data, steps=1)
        times = _timing.interleaved(
            {comm: lambda m=model: _timing.step_time(m, data, steps=MLP_STEPS) for comm, model in models.items()},
            rounds,
        )
        out[n] = {
            "auto": statistics.median(times["auto"]),
            "ring": statistics.median(times["ring"]),
            "ratios": [a / b for a, b in zip(times["auto"], times["ring"])],
        }
        print(f"N={n} MLP step: auto {out[n]['auto'] * 1e3:.1f} ms, ring {out[n]['ring'] * 1e3:.1f} ms", flush=True)
    return out


def plot(results, memcpy: dict, path: str) -> None:
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
    sizes_ = sorted(memcpy)
    ax.plot(sizes_, [memcpy[b] / 1e9 for b in sizes_], color="black", lw=1, label="memcpy (same rounds)")
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
    parser.add_argument("--quick", action="store_true", help="sizes 1 KiB, 16 KiB, ... 64 MiB, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help=f"default 5 ({HEADLINE_ROUNDS} at the headline size)")
    parser.add_argument("--max_bytes", type=int, default=None, help="largest message; default 256 MiB (--quick 64 MiB)")
    parser.add_argument("--devices", type=int, default=8, help="largest N; N runs over 2, 4, ... up to it")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    rounds = args.rounds or 5
    largest = args.max_bytes or (64 * MIB if args.quick else 256 * MIB)

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
    exact = [c for c in comms if c not in ("auto", "auto+bfloat16")]  # what "auto" is set against
    all_sizes = sizes(largest, 16 if args.quick else 4)
    top = HEADLINE if HEADLINE in all_sizes else all_sizes[-1]  # the headline size

    results, memcpy = {}, {}  # (n, comm) -> rows by size; (n, bytes) -> memcpy bytes/s per round
    for n in counts:
        strategies = {}
        for comm in comms:
            communication, _, gdtype = comm.partition("+")
            strategies[comm] = tfdist.DataParallelStrategy(
                devices=devices[:n], communication=communication, gradient_dtype=gdtype or None
            )
            results[(n, comm)] = []
        for nbytes in all_sizes:
            headline = nbytes == top
            calls, per_round = time_all_reduces(
                strategies,
                nbytes,
                max(rounds, HEADLINE_ROUNDS) if headline else rounds,
                HEADLINE_ROUND_SECONDS if headline else ROUND_SECONDS,
            )
            copies = [nbytes / t for t in _timing.round_medians(calls["memcpy"], per_round)]
            memcpy[(n, nbytes)] = copies
            factor = 2 * (n - 1) / n
            for comm in comms:
                times = _timing.round_medians(calls[comm], per_round)  # median call per round
                busbws = [nbytes / t * factor for t in times]  # in round order
                results[(n, comm)].append(
                    {
                        "bytes": nbytes,
                        "time": statistics.median(times),
                        "algbw": nbytes / statistics.median(times),
                        "busbw": statistics.median(busbws),
                        "busbw_min": min(busbws),
                        "busbw_max": max(busbws),
                        "calls": calls[comm],
                        "per_round": per_round,
                        # busbw / memcpy bandwidth, call by call: factor x memcpy time / all-reduce time
                        "ratios": [factor * r for r in _timing.round_ratios(calls["memcpy"], calls[comm], per_round)],
                    }
                )
                row = results[(n, comm)][-1]
                print(
                    f"N={n} {comm:14s} {label(nbytes):>8s}: {row['time'] * 1e6:10.1f} us, "
                    f"busbw {row['busbw'] / 1e9:7.3f} GB/s",
                    flush=True,
                )
            print(f"N={n} {'memcpy':14s} {label(nbytes):>8s}: {statistics.median(copies) / 1e9:7.3f} GB/s", flush=True)

    def at(n, comm, nbytes=top):
        return next(r for r in results[(n, comm)] if r["bytes"] == nbytes)

    def busbw_ratios(n, a, b):  # busbw of a / busbw of b per round at the headline size, call by call
        return _timing.round_ratios(at(n, b)["calls"], at(n, a)["calls"], at(n, a)["per_round"])

    header = (
        "| size | N | " + " | ".join(f"{c} busbw GB/s (min-max)" for c in comms)
        + " | memcpy GB/s | auto busbw / memcpy |"
    )
    lines = [header, "|" + "---|" * (len(comms) + 4)]
    for nbytes in all_sizes:
        for n in counts:
            cells = [
                f"{at(n, c, nbytes)['busbw'] / 1e9:.3f} ({at(n, c, nbytes)['busbw_min'] / 1e9:.3f}-"
                f"{at(n, c, nbytes)['busbw_max'] / 1e9:.3f})"
                for c in comms
            ]
            copy = statistics.median(memcpy[(n, nbytes)]) / 1e9
            ratio = statistics.median(at(n, "auto", nbytes)["ratios"])
            lines.append(f"| {label(nbytes)} | {n} | " + " | ".join(cells) + f" | {copy:.2f} | {ratio:.3f} |")
    nmax = counts[-1]
    from benchmarks import _results

    best, figures = {}, []
    for n in counts:
        # "auto" against the best other exact choice (by median busbw at the headline size), round by round.
        best[n] = max(exact, key=lambda c: at(n, c)["busbw"])
        figures.append(
            _results.figure(
                f"all-reduce busbw auto / best ({best[n]}), N={n}, {label(top)}",
                busbw_ratios(n, "auto", best[n]),
                goal=">= 0.9",
            )
        )
    for n in counts:
        figures.append(
            _results.figure(f"all-reduce busbw / memcpy, N={n}, {label(top)}, auto", at(n, "auto")["ratios"])
        )
    steps = mlp_step_ratios(devices, counts, rounds=max(rounds, 3))
    for n in counts:
        figures.append(
            _results.figure(f"data-parallel MLP step time auto / ring, N={n}", steps[n]["ratios"], goal="<= 1")
        )
    compressed = busbw_ratios(nmax, "auto+bfloat16", "auto")
    figures.append(
        _results.figure(
            f"all-reduce busbw bfloat16 / float32, N={nmax}, {label(top)}", compressed, goal="> 1 where bytes limit"
        )
    )
    head_rounds = len(at(nmax, "auto")["ratios"])
    body = (
        f"Devices: {', '.join(devices[:nmax])} ({'GPUs' if on_gpus else 'simulated CPUs sharing the host'}); "
        f"float32 messages {label(KIB)} to {label(all_sizes[-1])}. Per size and N, every choice and a memcpy of the "
        f"same bytes (np.copyto) are timed call by call, interleaved (each first, and right after each other, equally "
        f"often); {rounds} rounds "
        f"of >= {ROUND_SECONDS * 1e3:.0f} ms per point ({head_rounds} rounds of >= "
        f"{HEADLINE_ROUND_SECONDS * 1e3:.0f} ms at {label(top)}); busbw from each round's median call; ratios "
        "from the calls that ran side by side (median per round); medians over rounds (min-max)."
        + ("" if on_gpus else " nccl: GPUs only, not measured on CPUs.")
        + "\n\n"
        + "\n".join(lines)
        + f"\n\n**At {label(top)}: busbw of auto / best other choice "
        + ", ".join(
            f"N={n} {figures[i]['median']:.3f} ({best[n]}; min {figures[i]['min']:.3f}, max {figures[i]['max']:.3f})"
            for i, n in enumerate(counts)
        )
        + " (goal >= 0.9); auto busbw / memcpy "
        + ", ".join(
            f"N={n} {figures[len(counts) + i]['median']:.3f} "
            f"({at(n, 'auto')['busbw'] / 1e9:.2f} GB/s vs {statistics.median(memcpy[(n, top)]) / 1e9:.2f})"
            for i, n in enumerate(counts)
        )
        + f".** tfdist's bfloat16 all-reduce moves the same float32 gradient at {figures[-1]['median']:.2f}x the "
        f"float32 all-reduce's rate (N={nmax}; it sends half the bytes but adds two casts).\n\n"
        + "Data-parallel MLP step (width "
        + f"{MLP_WIDTH}, depth {MLP_DEPTH}, global batch {MLP_BATCH}, SGD): step times measured inside `fit`, the "
        + f"median of {MLP_STEPS} intervals between batch ends after 2 warm-up steps per round, {max(rounds, 3)} "
        + "rounds, auto and ring interleaved (the order alternating), ratios taken round by round: "
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
            "copying back moves it once per device, which is why 'auto' is 'reduce_to_one' on CPUs "
            "(so on CPUs the auto / best ratio sets one implementation against itself, or against "
            "'hierarchical', and shows the noise of the measurement)."
            if not on_gpus
            else "GPU bus bandwidth is bounded by the interconnect (NVLink/PCIe), not by host memcpy."
        )
    )
    print(body)
    path = _results.plot_path("allreduce")
    if not args.no_write:
        plot(results, {b: statistics.median(memcpy[(nmax, b)]) for b in all_sizes}, path)
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
