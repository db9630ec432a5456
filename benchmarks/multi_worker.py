"""tfdist.MultiWorkerStrategy vs raw MultiWorkerMirroredStrategy + the minimal Keras 3 fix, 2 workers.

Each run starts 2 worker processes on 127.0.0.1 (TF_CONFIG, free ports) that train the same MLP
with `model.fit` and report: seconds from process start to the end of the first step, the median
step time after warm-up, and their final weights. Modes:

- raw:          tf.distribute.MultiWorkerMirroredStrategy, with only the two patches Keras 3 needs
                to run at all (symbolic build on local results, scalar reduce with axis=None).
- tfdist:       tfdist.MultiWorkerStrategy (exact uneven batches, bounded failure).
- tfdist_bf16:  tfdist.MultiWorkerStrategy(gradient_dtype="bfloat16").

Rounds alternate the modes; figures are medians over rounds.

    python -m benchmarks.multi_worker --rounds 3
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = ("raw", "tfdist", "tfdist_bf16")
WORKERS = 2


def _raw_strategy():
    """Plain MWMS plus the smallest change that lets Keras 3 fit run (keras#20585)."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    original_reduce = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):
            return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original_reduce(values, strategy, reduction)

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        for _, _, it in iterator:
            batch = tf.nest.map_structure(lambda x: strategy.experimental_local_results(x)[0], next(it))
            break
        with strategy.scope():
            self._symbolic_build(data_batch=batch)

    trainer.reduce_per_replica = reduce_per_replica
    trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    return strategy


def worker(mode: str, out: str, steps: int, global_batch: int, width: int, depth: int) -> None:
    if mode == "raw":
        strategy = _raw_strategy()
    else:
        import tfdist

        strategy = tfdist.MultiWorkerStrategy(gradient_dtype="bfloat16" if mode == "tfdist_bf16" else None)
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, width)).astype("float32")
    y = rng.integers(0, 10, size=(steps * global_batch,)).astype("int32")
    from benchmarks._models import mlp

    model = mlp(strategy, width=width, depth=depth)
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.time())

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).with_options(options)
    model.fit(data, epochs=1, verbose=0, callbacks=[Clock()])
    steady = [b - a for a, b in zip(ends[3:], ends[4:])]
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    with open(out, "w") as f:
        json.dump(
            {
                "first_step_s": ends[0] - _PROCESS_START,
                "step_s": statistics.median(steady),
                "params": params,
                "weights": [w.tolist() for w in model.get_weights()[-2:]],
            },
            f,
        )


def run_mode(mode: str, args, tmp: str) -> list[dict]:
    from tfdist import cluster as cluster_lib
    from tfdist import launch

    workers = tuple(f"127.0.0.1:{p}" for p in launch.free_ports(WORKERS))
    procs, outs = [], []
    for i in range(WORKERS):
        out = os.path.join(tmp, f"{mode}-{i}.json")
        env = {**os.environ, "TF_CONFIG": cluster_lib.Cluster(workers=workers, task_index=i).to_tf_config()}
        cmd = [sys.executable, "-m", "benchmarks.multi_worker", "--worker", mode, "--out", out]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "global_batch", "width", "depth")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        outs.append(out)
    try:
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"{mode} worker failed ({p.returncode}):\n{err.decode()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.load(open(o)) for o in outs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 15 steps")
    parser.add_argument("--rounds", type=int, default=None, help="default 3")
    parser.add_argument("--steps", type=int, default=None, help="default 30 (--quick 15)")
    parser.add_argument("--global_batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or 3
    args.steps = args.steps or (15 if args.quick else 30)
    if args.worker:
        worker(args.worker, args.out, args.steps, args.global_batch, args.width, args.depth)
        return

    import numpy as np

    results = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                results[mode].append(run_mode(mode, args, tmp))
                print(f"round {r} {mode}: {[round(w['step_s'] * 1000, 1) for w in results[mode][-1]]} ms/step")

    def per_run(mode, key):
        return [max(w[key] for w in run) for run in results[mode]]

    def median(mode, key):
        return statistics.median(per_run(mode, key))

    def spread(mode):
        values = per_run(mode, "step_s")
        return f"{median(mode, 'step_s') * 1000:.1f} ms ({min(values) * 1000:.1f}-{max(values) * 1000:.1f})"

    params = results["tfdist"][0][0]["params"]
    last = {m: [np.array(a) for a in results[m][-1][0]["weights"]] for m in MODES}
    drift = max(float(np.abs(a - b).max()) for a, b in zip(last["tfdist"], last["tfdist_bf16"]))
    same = max(float(np.abs(a - b).max()) for a, b in zip(last["tfdist"], last["raw"]))
    rows = [
        ("time to first step, raw MWMS + minimal fix", f"{median('raw', 'first_step_s'):.2f} s"),
        ("time to first step, tfdist", f"{median('tfdist', 'first_step_s'):.2f} s"),
        ("step time raw / tfdist / tfdist bf16, median (range)", " / ".join(spread(m) for m in MODES)),
        ("step time ratio tfdist / raw", f"{median('tfdist', 'step_s') / median('raw', 'step_s'):.3f}"),
        ("step time ratio tfdist bf16 / tfdist", f"{median('tfdist_bf16', 'step_s') / median('tfdist', 'step_s'):.3f}"),
        (
            "gradient bytes all-reduced per step, float32 / bfloat16",
            f"{params * 4 / 2**20:.2f} MiB / {params * 2 / 2**20:.2f} MiB",
        ),
        (f"max weight diff after {args.steps} steps, bfloat16 vs float32 all-reduce", f"{drift:.2e}"),
        (f"max weight diff after {args.steps} steps, tfdist vs raw (even batches)", f"{same:.2e}"),
    ]
    body = (
        f"MLP {args.depth} x Dense({args.width}) + Dense(10), {params} parameters, SGD, global batch "
        f"{args.global_batch}, {WORKERS} worker processes on one host (127.0.0.1), {args.rounds} rounds "
        "(medians; per run the slower worker).\n\n| figure | value |\n|---|---|\n"
        + "\n".join(f"| {k} | {v} |" for k, v in rows)
        + "\n\nBoth workers share the host's 2 cores (with other jobs on this machine: step times vary by "
        "tens of percent between rounds, see the ranges), and gRPC collectives over loopback compete with "
        "compute; tfdist adds one scalar all-reduce per step (the global example count). The bfloat16 "
        "saving in bytes shows as time only where the network is the bottleneck.\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        def ratios(mode, base, key):
            return [a / b for a, b in zip(per_run(mode, key), per_run(base, key))]

        _results.write_section(
            "multi_worker",
            f"python -m benchmarks.multi_worker --rounds {args.rounds} --steps {args.steps}",
            body,
            figures=[
                _results.figure("multi-worker step time tfdist / raw MWMS", ratios("tfdist", "raw", "step_s")),
                _results.figure("time to first step tfdist / raw MWMS", ratios("tfdist", "raw", "first_step_s")),
                _results.figure("step time bfloat16 / float32 all-reduce (2 workers)",
                                ratios("tfdist_bf16", "tfdist", "step_s")),
            ],
        )


if __name__ == "__main__":
    main()
