"""ModelParallelStrategy on one mesh of 8 devices: 1 process x 8 devices vs 2 processes x 4 (same host).

The same `tfdist.models.transformer_lm` and mesh trains with `model.fit` in one process of 8 simulated
CPUs, and in 2 processes of 4 (TF_CONFIG on 127.0.0.1, DTensor's collectives over gRPC). Each run
reports the median step time after warm-up (batch-end intervals inside fit), the seconds from
process start to the end of the first step, and the bytes its first device holds (weights and Adam
slots, from the variables' layouts). Two layouts:

- hybrid {"batch": 2, "model": 4}: over 2 processes the model is split within each, the batch across.
- across {"batch": 1, "model": 8}: over 2 processes the model itself is split across them.

Rounds alternate the order of the two runs; ratios are taken within a round (2 x 4 / 1 x 8).

    python -m benchmarks.model_parallel_processes --rounds 3
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

LAYOUTS = {"hybrid": {"batch": 2, "model": 4}, "across": {"batch": 1, "model": 8}}
DEVICES = 8


def worker(layout: str, local: int, out: str, args) -> None:
    import tfdist

    tfdist.simulate_devices(local)
    strategy = tfdist.ModelParallelStrategy(mesh=LAYOUTS[layout], rules=tfdist.layouts.transformer(), sharding="data")
    import keras
    import numpy as np
    from tensorflow.experimental import dtensor

    from benchmarks import _timing

    rng = np.random.default_rng(0)
    n = (args.steps + args.warmup) * args.global_batch
    x = rng.integers(0, 256, (n, args.seq_len)).astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tfdist.models.transformer_lm(
            seq_len=args.seq_len, d_model=args.d_model, num_heads=8, num_layers=args.num_layers
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    clock = _timing.step_clock()
    model.fit(x, np.roll(x, -1, axis=1), batch_size=args.global_batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[clock])
    ends = clock.ends
    steady = _timing.intervals(ends, args.warmup)
    report = strategy.placement_report(model, print_fn=None)
    local_bytes, total, sharded, replicated = 0, 0, 0, 0
    for v in list(model.weights) + list(model.optimizer.variables):
        backing = getattr(v, "value", v)
        whole = math.prod(int(d) for d in v.shape) * backing.dtype.size
        shard = dtensor.unpack(backing.read_value())[0]
        local_bytes += math.prod(int(d) for d in shard.shape) * backing.dtype.size
        total += whole
        if backing.layout.is_fully_replicated():
            replicated += whole
        else:
            sharded += whole
    with open(out, "w") as f:
        json.dump(
            {
                "first_step_s": ends[0] - _PROCESS_START,
                "step_s": statistics.median(steady),
                "bytes_per_device": local_bytes,
                "report_bytes_per_device": max(report.bytes_per_device.values()),
                "total_bytes": total,
                "sharded_bytes": sharded,
                "replicated_bytes": replicated,
                "params": model.count_params(),
            },
            f,
        )


def run(layout: str, processes: int, args, tmp: str) -> list[dict]:
    from tfdist import cluster as cluster_lib
    from tfdist import launch

    workers = tuple(f"127.0.0.1:{p}" for p in launch.free_ports(processes))
    procs, outs = [], []
    for i in range(processes):
        out = os.path.join(tmp, f"{layout}-{processes}-{i}.json")
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        if processes > 1:
            env["TF_CONFIG"] = cluster_lib.Cluster(workers=workers, task_index=i).to_tf_config()
        cmd = [sys.executable, "-m", "benchmarks.model_parallel_processes", "--worker", layout, "--out", out,
               f"--local={DEVICES // processes}"]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "global_batch", "seq_len", "d_model",
                                                      "num_layers")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        outs.append(out)
    try:
        for p in procs:
            _, err = p.communicate(timeout=900)
            if p.returncode:
                raise RuntimeError(f"{layout} x{processes} worker failed ({p.returncode}):\n{err.decode()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.load(open(o)) for o in outs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 steps, the hybrid layout only")
    parser.add_argument("--rounds", type=int, default=None, help="default 3")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run, default 15 (--quick 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=None)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.steps = args.steps or (8 if args.quick else 15)
    layouts = args.layouts or (["hybrid"] if args.quick else ["hybrid", "across"])
    if args.worker:
        worker(args.worker, args.local, args.out, args)
        return

    results = {(layout, p): [] for layout in layouts for p in (1, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for layout in layouts:
                for p in (1, 2) if r % 2 == 0 else (2, 1):
                    results[(layout, p)].append(run(layout, p, args, tmp))
                    print(f"round {r} {layout} x{p}: "
                          f"{[round(w['step_s'] * 1000, 1) for w in results[(layout, p)][-1]]} ms/step", flush=True)

    def per_run(key, layout, p):
        return [max(w[key] for w in run) for run in results[(layout, p)]]

    rows, figures = [], []
    for layout in layouts:
        steps = {p: per_run("step_s", layout, p) for p in (1, 2)}
        firsts = {p: per_run("first_step_s", layout, p) for p in (1, 2)}
        ratio = [b / a for a, b in zip(steps[1], steps[2])]
        first_ratio = [b / a for a, b in zip(firsts[1], firsts[2])]
        w = results[(layout, 2)][0][0]
        model_axis = LAYOUTS[layout]["model"]
        formula = w["sharded_bytes"] / model_axis + w["replicated_bytes"]
        ideal = w["total_bytes"] / model_axis
        measured = {p: max(x["bytes_per_device"] for x in results[(layout, p)][0]) for p in (1, 2)}

        def ms(values):
            return f"{statistics.median(values) * 1000:.1f} ms ({min(values) * 1000:.1f}-{max(values) * 1000:.1f})"

        mesh = ",".join(f"{k}:{v}" for k, v in LAYOUTS[layout].items())
        rows += [
            (f"{layout} ({mesh}): step time, 1 x 8 / 2 x 4 processes", f"{ms(steps[1])} / {ms(steps[2])}"),
            (f"{layout}: step-time ratio 2 x 4 / 1 x 8, median (range)",
             f"**{statistics.median(ratio):.2f}** ({min(ratio):.2f}-{max(ratio):.2f})"),
            (f"{layout}: time to first step, 1 x 8 / 2 x 4",
             f"{statistics.median(firsts[1]):.1f} s / {statistics.median(firsts[2]):.1f} s"),
            (f"{layout}: bytes per device (weights + Adam slots), 1 x 8 / 2 x 4",
             f"{measured[1] / 2**20:.3f} / {measured[2] / 2**20:.3f} MiB"),
            (f"{layout}: layout formula (split / {model_axis} + replicated) / ideal (all / {model_axis})",
             f"{formula / 2**20:.3f} / {ideal / 2**20:.3f} MiB (measured = {measured[2] / formula:.3f} x formula, "
             f"{measured[2] / ideal:.2f} x ideal)"),
        ]
        figures += [
            _figure(f"model parallel {layout}: step time 2 processes x 4 / 1 x 8", ratio),
            _figure(f"model parallel {layout}: time to first step 2 x 4 / 1 x 8", first_ratio),
        ]
    w = next(iter(results.values()))[0][0]
    body = (
        f"`tfdist.models.transformer_lm(seq_len={args.seq_len}, d_model={args.d_model}, num_heads=8, "
        f"num_layers={args.num_layers})`, {w['params']:,} parameters, Adam, `tfdist.layouts.transformer()`, global "
        f"batch {args.global_batch}, {args.steps} timed steps after {args.warmup} (median of batch-end intervals "
        f"inside fit; per run the slower process), {args.rounds} rounds in alternating order.\n\n"
        "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n\n"
        "Both cases run on the same 2-core host, so the 2-process case measures what crossing a process boundary "
        "costs (gRPC over loopback instead of in-process copies, two runtimes sharing the cores, and a wait for "
        "each step's outputs inside the bounded call), not a second machine's compute. The bytes per device are "
        "those of the first device of each process, from the variables' layouts: the same on 1 x 8 and 2 x 4. "
        "The ideal splits every variable over the model axis; the formula is what the preset's rules give "
        "(LayerNorms, position embedding and the biases the rules leave whole stay replicated).\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "model_parallel_processes",
            _results.command("model_parallel_processes", argv),
            body,
            figures=figures,
        )


def _figure(label, values):
    from benchmarks import _results

    return _results.figure(label, values)


if __name__ == "__main__":
    main()
