"""Sharded data parallelism (ZeRO-1 / ZeRO-3): bytes per device and step time vs plain data parallelism.

Trains `tfdist.models.transformer_lm` with Adam (float32) on N = 2, 4, 8 simulated CPU devices,
one process per N (each sets up its own devices; each bounded by a timeout), under three
strategies over the same N devices, built with the same seed and trained on the same batches:

* `tfdist.DataParallelStrategy()`: plain data parallelism, every device holds the weights and both
  Adam moments: 12 bytes per parameter.
* `tfdist.ShardedDataParallelStrategy(shard="optimizer")` (ZeRO-1): weights whole, moments split:
  4 + 8/N bytes per parameter.
* `tfdist.ShardedDataParallelStrategy(shard="weights")` (ZeRO-3 / FSDP): weights and moments
  split, each weight gathered for its use: 12/N bytes per parameter.

Bytes per device are counted from the tensors each device holds after training (every variable of
`model.weights` and `model.optimizer.variables`: the per-replica copies of the mirrored variables,
the DTensor components of the sharded ones), the largest over the devices, and set against those
formulas (parameters from `model.count_params()`); for the sharded modes they are checked against
`placement_report(...).bytes_per_device`, whose notes say why each variable that stays replicated
does (below `min_size` elements, no divisible dimension).

Step times are measured inside `fit`: each round runs one `fit` epoch per strategy over the same
batches, the order changing from round to round (`benchmarks._timing.interleaved`: each first, and
right after each other, equally often), and its figure is the median of the intervals between batch
ends after a warm-up of 2 steps. The ratios sharded / data-parallel are taken round by round; median
and min-max over rounds. Simulated devices share the host's cores, so these ratios show what the
gathers and reduce-scatters cost on this host, not what an accelerator interconnect would do.

    python -m benchmarks.sharded_data_parallel             # N = 2, 4, 8; 3 rounds of 6 steps
    python -m benchmarks.sharded_data_parallel --quick     # N = 2, 4, 8; 2 rounds of 4 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import _timing  # noqa: E402

WARMUP = 2  # steps of each round's fit epoch before the timed ones
COUNTS = (2, 4, 8)
MODES = ("DP", "optimizer", "weights")  # DataParallelStrategy, then ShardedDataParallelStrategy(shard=...)
CHILD_TIMEOUT = {"quick": 240, "full": 480}  # seconds one N's process may take
SECTION = "Sharded data parallelism (ZeRO-1 / ZeRO-3)"


def formula_bytes(mode: str, params: int, n: int) -> float:
    """Bytes per device of float32 weights + two Adam moments under `mode` on `n` devices (the ideal split).

    Example:

    >>> [formula_bytes(m, 1000, 4) for m in MODES]
    [12000, 6000.0, 3000.0]
    """
    return {"DP": 12 * params, "optimizer": (4 + 8 / n) * params, "weights": 12 * params / n}[mode]


def _variables(model) -> list:
    out, seen = [], set()
    for v in list(model.weights) + list(model.optimizer.variables):
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def held_bytes(model, components) -> dict[str, int]:
    """Device -> bytes of the tensors it holds of `model`'s variables; `components(tf_variable)` lists them."""
    held = {}
    for v in _variables(model):
        for part in components(getattr(v, "value", v)):
            held[part.device] = held.get(part.device, 0) + math.prod(int(d) for d in part.shape) * part.dtype.size
    return held


def build(strategy, args):
    import keras

    from tfdist import models

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.transformer_lm(
            seq_len=args.seq_len, vocab_size=args.vocab_size, d_model=args.d_model, num_heads=args.num_heads,
            num_layers=args.num_layers,
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def last_loss():
    """A Keras callback keeping the last epoch's loss (`.loss`)."""
    import keras

    class LastLoss(keras.callbacks.Callback):
        loss = None

        def on_epoch_end(self, epoch, logs=None):
            self.loss = float(logs["loss"])

    return LastLoss()


def exit_with_parent() -> None:
    """Ends this process as soon as the one that started it is gone (killed on its timeout, say)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def child(n: int, out: str, args) -> None:
    """One N: builds the three models on n simulated devices, times them interleaved, writes a JSON to `out`."""
    exit_with_parent()
    import tfdist

    names = tfdist.simulate_devices(n)
    import numpy as np
    from tensorflow.experimental import dtensor

    strategies = {
        "DP": tfdist.DataParallelStrategy(devices=names),
        **{m: tfdist.ShardedDataParallelStrategy(shard=m, devices=names) for m in MODES[1:]},
    }
    rng = np.random.default_rng(0)
    rows = args.global_batch * (WARMUP + args.steps)
    x = rng.integers(0, args.vocab_size, (rows, args.seq_len)).astype("int32")
    y = np.roll(x, -1, axis=1)
    models = {m: build(s, args) for m, s in strategies.items()}
    losses = {m: last_loss() for m in MODES}
    for model in models.values():  # trace the step and build the optimizer's variables
        _timing.fit_step_times(model, x, y, steps=1, warmup=WARMUP, batch_size=args.global_batch)

    def timed(m):
        return lambda: _timing.step_time(
            models[m], x, y, steps=args.steps, warmup=WARMUP, batch_size=args.global_batch, callbacks=[losses[m]]
        )

    times = _timing.interleaved({m: timed(m) for m in MODES}, args.rounds)

    result = {"n": n, "params": models["DP"].count_params(), "times": times, "modes": {}}
    for m, model in models.items():
        if m == "DP":
            held = held_bytes(model, strategies[m].experimental_local_results)
            entry = {"replicated": []}
        else:
            held = held_bytes(model, lambda v: dtensor.unpack(v.read_value()))
            report = strategies[m].placement_report(model, print_fn=None)
            weights = {w.path for w in model.weights}
            entry = {
                "report_bytes_per_device": max(report.bytes_per_device.values()),
                "replicated": [
                    {"path": p.path, "shape": list(p.shape), "bytes": p.bytes_total, "note": p.note,
                     "weight": p.path in weights}
                    for p in report.variables
                    if p.note.startswith("replicated over") or (not any(p.spec) and not p.note)
                ],
            }
        result["modes"][m] = {**entry, "bytes_per_device": max(held.values()), "devices": len(held),
                              "loss": losses[m].loss}
    with open(out, "w") as f:
        json.dump(result, f)


def run_child(n: int, args, tmp: str, timeout: int) -> dict:
    """The result of `child(n)` in a process of its own (killed after `timeout` s)."""
    out = os.path.join(tmp, f"n{n}.json")
    cmd = [sys.executable, "-m", "benchmarks.sharded_data_parallel", "--child", str(n), "--out", out]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("rounds", "steps", "global_batch", "seq_len", "vocab_size",
                                                  "d_model", "num_heads", "num_layers")]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:  # subprocess.run kills and reaps the child on a timeout
        proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"N={n}: no result in {timeout} s:\n{(e.stderr or b'').decode()[-3000:]}") from None
    if proc.returncode:
        raise RuntimeError(f"N={n} failed ({proc.returncode}):\n{proc.stderr.decode()[-4000:]}")
    with open(out) as f:
        return json.load(f)


def plot(results: dict, path: str) -> None:
    from benchmarks import _results

    plt = _results.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ns = sorted(results)
    params = results[ns[0]]["params"]
    fine = [2 ** (k / 8) for k in range(8, 8 * int(math.log2(ns[-1])) + 1)]
    labels = {"DP": "DataParallelStrategy", "optimizer": 'shard="optimizer" (ZeRO-1)', "weights": 'shard="weights"'}
    for i, m in enumerate(MODES):
        color = f"C{i}"
        left.plot(fine, [formula_bytes(m, params, n) / 2**20 for n in fine], color=color, ls="--", lw=1)
        left.plot(ns, [results[n]["modes"][m]["bytes_per_device"] / 2**20 for n in ns], "o", color=color,
                  label=f"{labels[m]}: measured (formula dashed)")
        if m == "DP":
            continue
        ratios = [step_ratios(results[n], m) for n in ns]
        med = [statistics.median(r) for r in ratios]
        right.errorbar(ns, med, yerr=[[a - min(r) for a, r in zip(med, ratios)], [max(r) - a for a, r in
                                                                                  zip(med, ratios)]],
                       marker="o", capsize=3, color=color, label=labels[m])
    right.axhline(1.0, color="gray", lw=1, ls=":")
    left.set(xscale="log", ylim=(0, None), xlabel="devices N", ylabel="MiB per device (weights + Adam slots)",
             title="Bytes per device")
    right.set(xscale="log", xlabel="devices N", ylabel="step time / DataParallelStrategy (median, min-max)",
              title="Step time (simulated CPUs sharing 2 cores)")
    for ax in (left, right):
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_ratios(result: dict, mode: str) -> list[float]:
    """Per round: step time of `mode` / step time of DataParallelStrategy in the same round."""
    return [a / b for a, b in zip(result["times"][mode], result["times"]["DP"])]


def replicated_excess(mode: str, n: int, replicated: list[dict]) -> float:
    """Bytes per device above `formula_bytes` that the variables left replicated over the data axis account for.

    Each holds all its bytes on every device where the formula counts 1/n of them, except a weight under
    "optimizer" (the formula counts weights whole there), and a scalar of the optimizer's own (its step count,
    learning rate: no parameter or moment, the formula counts none of it).

    Example:

    >>> v = [{"weight": True, "shape": [8], "bytes": 32}, {"weight": False, "shape": [], "bytes": 8}]
    >>> replicated_excess("weights", 4, v), replicated_excess("optimizer", 4, v)
    (32.0, 8)
    """
    excess = 0
    for v in replicated:
        if v["weight"] and mode == "optimizer":
            continue
        excess += v["bytes"] if not v["weight"] and not v["shape"] else v["bytes"] * (1 - 1 / n)
    return excess


def _compact(paths: list[str]) -> str:
    """Paths with each layer's index folded: "`block_*/mlp_out/bias` x2, `logits/bias`"."""
    counts = {}
    for p in paths:
        key = re.sub(r"block_\d+", "block_*", p)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"`{k}`" + (f" x{c}" if c > 1 else "") for k, c in counts.items())


def replicated_rows(results: dict) -> list[str]:
    """Table rows: per sharded mode and note, the variables it leaves replicated over the data axis."""
    groups = {}  # (mode, note) -> {N: [variables]}
    for n in COUNTS:
        for m in MODES[1:]:
            for v in results[n]["modes"][m]["replicated"]:
                groups.setdefault((m, v["note"]), {}).setdefault(n, []).append(v)
    rows = []
    for (m, note), by_n in groups.items():
        variables = next(iter(by_n.values()))
        weights = [v["path"] for v in variables if v["weight"]]
        slot_names = {re.sub(r"[/]", "_", w) + suffix for w in weights for suffix in ("_momentum", "_velocity")}
        others = [v["path"] for v in variables if not v["weight"]]
        slots = [p for p in others if re.sub(r"^[^/]*/", "", p) in slot_names]
        rest = [p for p in others if p not in slots]
        optimizer = ", ".join(filter(None, [f"the {len(slots)} Adam moments of these weights" if slots else "",
                                            _compact(rest)]))
        sizes = " / ".join(f"{sum(v['bytes'] for v in by_n[n]):,}" if n in by_n else "-" for n in COUNTS)
        rows.append(f"| {m} | {note} | {len(weights)}: {_compact(weights) or '-'} | {optimizer or '-'} | {sizes} |")
    return rows


def report(results: dict, args) -> tuple[str, list[dict]]:
    """The RESULTS.md section's body and its headline figures."""
    from benchmarks import _results

    params = results[COUNTS[0]]["params"]
    byte_rows, time_rows, figures, problems = [], [], [], []
    for n in COUNTS:
        r = results[n]
        for m in MODES:
            entry = r["modes"][m]
            measured, formula = entry["bytes_per_device"], formula_bytes(m, params, n)
            if entry.get("report_bytes_per_device", measured) != measured:
                problems.append(f"N={n} {m}: placement_report says {entry['report_bytes_per_device']:,} bytes per "
                                f"device, the tensors hold {measured:,}")
            explained = "-" if m == "DP" else f"{replicated_excess(m, n, entry['replicated']):,.0f}"
            byte_rows.append(
                f"| {n} | {m} | {measured / 2**20:.3f} | {formula / 2**20:.3f} | **{measured / formula:.4f}** | "
                f"{measured / params:.3f} | {measured - formula:,.0f} | {explained} |"
            )
            if m != "DP" and n >= 4:
                figures.append(_results.figure(f"sharded DP bytes per device measured / formula, shard={m}, N={n}",
                                               [measured / formula], goal="<= 1.05"))
        cells = []
        for m in MODES[1:]:
            ratios = step_ratios(r, m)
            cells.append(f"{statistics.median(r['times'][m]) * 1e3:.1f} ms | **{statistics.median(ratios):.2f}** "
                         f"({min(ratios):.2f}-{max(ratios):.2f})")
            figures.append(_results.figure(f"sharded DP step time shard={m} / DataParallelStrategy, N={n} "
                                           "(simulated CPUs: gather overhead)", ratios))
        losses = " / ".join(f"{r['modes'][m]['loss']:.5f}" for m in MODES)
        time_rows.append(f"| {n} | {statistics.median(r['times']['DP']) * 1e3:.1f} ms | " + " | ".join(cells)
                         + f" | {losses} |")
    a = args
    body = "\n".join([
        f"`tfdist.models.transformer_lm(seq_len={a.seq_len}, vocab_size={a.vocab_size}, d_model={a.d_model}, "
        f"num_heads={a.num_heads}, num_layers={a.num_layers})`, {params:,} parameters, Adam (float32), global "
        f"batch {a.global_batch}, on N simulated CPU devices sharing {os.cpu_count()} cores, one process per N; "
        "`ShardedDataParallelStrategy` with its defaults (`min_size=1024` elements).",
        "",
        "Bytes per device: the tensors each device holds of `model.weights` + `model.optimizer.variables` after "
        "training (the per-replica copies of DataParallelStrategy's mirrored variables; the DTensor components of "
        "the sharded ones), the largest over the N devices, against the formula: 12, 4 + 8/N and 12/N bytes per "
        "parameter. "
        + ("For both sharded modes they equal `placement_report(model).bytes_per_device`." if not problems
           else "**Mismatch with `placement_report`:** " + "; ".join(problems) + ".")
        + " \"Replicated excess\" is what the variables below account for (each whole on every device where the "
        "formula counts 1/N of it; the optimizer's step count and learning rate, 12 bytes, are in no formula).",
        "",
        "| N | mode | MiB per device | formula MiB | measured / formula | bytes per parameter | measured - formula "
        "(bytes) | replicated excess (bytes) |",
        "|---|---|---|---|---|---|---|---|",
        *byte_rows,
        "",
        "What the sharded modes leave replicated over the data axis, and why (the `note` of each "
        "`VariablePlacement`). Under \"optimizer\" every weight is whole by design; what counts there is that these "
        "weights' Adam moments stay whole too.",
        "",
        f"| mode | note | model weights | optimizer variables | bytes (N={' / '.join(map(str, COUNTS))}) |",
        "|---|---|---|---|---|",
        *replicated_rows(results),
        "",
        f"Step times inside `fit`: the median of the {a.steps} intervals between batch ends after {WARMUP} warm-up "
        f"steps, one figure per strategy and round; {a.rounds} rounds, the three strategies interleaved (each "
        "first, and right after each other, equally often); ratios to DataParallelStrategy taken round by round, "
        "median (min-max) over rounds. The last loss is each model's after the same batches from the same initial "
        "weights.",
        "",
        "| N | DataParallelStrategy | shard=\"optimizer\" | / DP | shard=\"weights\" | / DP | last loss DP / optimizer "
        "/ weights |",
        "|---|---|---|---|---|---|---|",
        *time_rows,
        "",
        "**The N simulated CPU devices share this host's cores, and a gather or reduce-scatter between them is a "
        "copy in memory: these step-time ratios say nothing about a GPU cluster's interconnect.** They show the "
        "overhead of the gathers (with the reduce-scatters and DTensor's SPMD program) against plain data "
        "parallelism's all-reduce on this host, where the N devices' compute already runs on the same cores.",
    ])
    return body, figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 steps")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round, default 6 (--quick 4)")
    parser.add_argument("--global_batch", type=int, default=16, help="sequences per step (all N divide it)")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.steps = args.steps or (4 if args.quick else 6)
    if args.child:
        child(args.child, args.out, args)
        return 0

    timeout = CHILD_TIMEOUT["quick" if args.quick else "full"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in COUNTS:
            results[n] = run_child(n, args, tmp, timeout)
            times = results[n]["times"]
            print(f"N={n}: " + ", ".join(f"{m} {statistics.median(times[m]) * 1e3:.1f} ms/step" for m in MODES),
                  flush=True)

    from benchmarks import _results

    body, figures = report(results, args)
    print(body)
    if not args.no_write:
        path = _results.plot_path("sharded_data_parallel")
        plot(results, path)
        _results.write_section(SECTION, _results.command("sharded_data_parallel", argv), body, figures=figures,
                               plot=os.path.basename(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
