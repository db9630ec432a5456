"""Step time with tfdist.callbacks.StepStats at its default interval / without it.

The same model trains with and without the callback, alternating epoch by epoch in ONE `fit`: a
harness callback (`_harness`) runs StepStats, through its public callback methods, in one epoch of
each pair (the first or the second in turn, `benchmarks._timing.orders(2)`), so that both variants
share the traced train functions, the input pipeline and every spell of a busy host. Each epoch
runs 2 warm-up + `--steps` steps (default 100: one report at the default `every=100`; short epochs,
so that the variants alternate often); its step time is the MEAN of the batch-end intervals after
the warm-up, so the step that carries a report (reading each replica's rows, the all-gather across
workers, the statistics) counts with its real weight. Beside it: the same intervals in this
process' CPU time (`time.process_time()`, all its threads). The ratio is taken pair by pair;
figures are medians over pairs (min-max).

- DataParallelStrategy over `--devices` simulated CPUs (GPUs when present), in this process: a small
  MLP (the timestamps weigh most on short steps) and the MLP of benchmarks/overhead.py.
- MultiWorkerStrategy, 2 worker processes on 127.0.0.1, the small MLP: both workers alternate in the
  same order (worker 0's figures are reported).

    python -m benchmarks.step_stats              # 40 pairs of epochs per setup
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import _timing  # noqa: E402
from benchmarks._models import mlp  # noqa: E402

WARMUP = 2  # steps of each fit epoch before the timed ones
VARIANTS = ("without StepStats", "with StepStats (every=100)")
SMALL = {"width": 64, "depth": 2, "batch": 64}
LARGE = {"width": 512, "depth": 3, "batch": 256}


def _dataset(size: dict):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(size["batch"] * 8, size["width"])).astype("float32")
    y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(size["batch"]).repeat().prefetch(2)


def _harness(stats):
    """(alternate, clock): Keras callbacks that run `stats` in every other epoch and record the batch ends."""
    import keras

    class Alternate(keras.callbacks.Callback):
        """Runs `stats` in the epochs listed in `on`, as if each were a `fit` of its own."""

        def __init__(self):
            super().__init__()
            self.on: set[int] = set()
            self.running = False

        def on_epoch_begin(self, epoch, logs=None):
            self.running = epoch in self.on
            if self.running:
                stats.set_model(self.model)  # puts its train function in place, as `fit` would
                stats.on_train_begin()

        def on_train_batch_begin(self, batch, logs=None):
            if self.running:
                stats.on_train_batch_begin(batch, logs)

        def on_train_batch_end(self, batch, logs=None):
            if self.running:
                stats.on_train_batch_end(batch, logs)

        def on_epoch_end(self, epoch, logs=None):
            if self.running:
                stats.on_epoch_end(epoch, logs)
                stats.on_train_end()

    class Clock(keras.callbacks.Callback):
        """(wall, process CPU) seconds at every batch end, per epoch."""

        def __init__(self):
            super().__init__()
            self.ends: dict[int, list[tuple[float, float]]] = {}

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.ends[epoch] = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends[self.epoch].append((time.perf_counter(), time.process_time()))

    return Alternate(), Clock()


def _rounds(strategy, size: dict, steps: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) mean seconds per step of each variant's epochs after the warm-up, one pair per round.

    One `fit` of 2 * (rounds + 1) epochs; the first pair (tracing both train functions) is left out.
    """
    import tfdist

    model = mlp(strategy, width=size["width"], depth=size["depth"])
    stats = tfdist.callbacks.StepStats()  # the defaults: a report every 100 steps
    alternate, clock = _harness(stats)
    epochs = {VARIANTS[0]: [], VARIANTS[1]: []}
    for r in range(rounds + 1):
        for i, variant in enumerate(_timing.orders(2)[r % 2]):
            epochs[VARIANTS[variant]].append(2 * r + i)
    alternate.on = set(epochs[VARIANTS[1]])
    model.fit(
        _dataset(size), epochs=2 * (rounds + 1), steps_per_epoch=WARMUP + steps, shuffle=False, verbose=0,
        callbacks=[alternate, clock],
    )
    if len(stats.history) != (rounds + 1) * ((WARMUP + steps) // stats.every):
        raise RuntimeError(f"StepStats reported {len(stats.history)} times; its epochs did not run as planned")

    def per_step(epoch):
        wall, cpu = zip(*clock.ends[epoch])
        return tuple(statistics.fmean(_timing.intervals(list(t), WARMUP)) for t in (wall, cpu))

    return {variant: [per_step(e) for e in numbers[1:]] for variant, numbers in epochs.items()}


def _ratios(times: dict, which: int) -> list[float]:
    return [on[which] / off[which] for off, on in zip(times[VARIANTS[0]], times[VARIANTS[1]])]


def worker(out: str, steps: int, rounds: int) -> None:
    """One MultiWorkerStrategy worker (TF_CONFIG from the parent): writes its times to `out` (worker 0)."""
    import tfdist

    strategy = tfdist.MultiWorkerStrategy(sharding="off")
    times = _rounds(strategy, SMALL, steps, rounds)
    if strategy.cluster.rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def _multi_worker(steps: int, rounds: int) -> dict:
    from tfdist import cluster as cluster_lib
    from tfdist import launch

    addresses = tuple(f"127.0.0.1:{p}" for p in launch.free_ports(2))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        procs = []
        for i in range(2):
            env = dict(os.environ, PYTHONPATH=repo)
            env["TF_CONFIG"] = cluster_lib.Cluster(workers=addresses, task_index=i).to_tf_config()
            command = [sys.executable, "-m", "benchmarks.step_stats", "--worker", out]
            command += ["--steps", str(steps), "--rounds", str(rounds)]
            procs.append(subprocess.Popen(command, env=env, cwd=repo))
        try:
            codes = [p.wait(timeout=1200) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0, 0]:
            raise RuntimeError(f"the multi-worker benchmark's workers exited with {codes}")
        with open(out) as f:
            return json.load(f)


def _rows(name: str, times: dict) -> str:
    wall, cpu = _ratios(times, 0), _ratios(times, 1)
    step = {v: 1e3 * statistics.median(t[0] for t in times[v]) for v in VARIANTS}
    return (
        f"| {name} | {step[VARIANTS[0]]:.2f} | {step[VARIANTS[1]]:.2f} | **{statistics.median(wall):.3f}** "
        f"({min(wall):.3f}-{max(wall):.3f}) | {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) |\n"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 pairs, no multi-worker run")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="pairs of epochs; default 40 (--quick 8)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per epoch")
    parser.add_argument("--no_multi_worker", action="store_true", help="skip the 2-process run")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 40)
    if args.worker:
        return worker(args.worker, args.steps, args.rounds)

    import tfdist

    tfdist.simulate_devices(args.devices)  # logical CPUs; GPUs, when present, are used instead
    devices = tfdist.devices.default_devices()[: args.devices]
    strategy = tfdist.DataParallelStrategy(devices=devices)
    results = {}
    for label, size in (("small MLP", SMALL), ("overhead.py's MLP", LARGE)):
        name = f"DataParallelStrategy, {len(devices)} devices, {label} {size['depth']}x{size['width']}"
        results[name + f", batch {size['batch']}"] = _rounds(strategy, size, args.steps, args.rounds)
    if not (args.quick or args.no_multi_worker):
        name = f"MultiWorkerStrategy, 2 processes, small MLP {SMALL['depth']}x{SMALL['width']}"
        results[name + f", batch {SMALL['batch']} per worker"] = _multi_worker(args.steps, args.rounds)

    body = (
        f"One `fit` per setup; its epochs alternate with and without StepStats (the order swapping from pair to "
        f"pair), {WARMUP} + {args.steps} steps each, {args.rounds} pairs after a first pair that traces. Step "
        "time: the mean of an epoch's batch-end intervals after the warm-up (the steps that carry a report, "
        "one in 100, included), median over pairs; the ratio with / without is taken pair by pair (median, "
        "min-max), in wall time and in the process' CPU time. Devices: " + ", ".join(devices) + ".\n\n"
        "| setup | step time without (ms) | with (ms) | ratio, wall time (goal <= 1.02) "
        "| ratio, CPU time |\n|---|---|---|---|---|\n"
        + "".join(_rows(name, times) for name, times in results.items())
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "StepStats overhead",
            _results.command("step_stats", argv),
            body,
            figures=[
                _results.figure(f"step time with / without StepStats (every=100), {name}", _ratios(times, 0),
                                goal="<= 1.02")
                for name, times in results.items()
            ]
            + [
                _results.figure(f"CPU time per step with / without StepStats (every=100), {name}", _ratios(times, 1))
                for name, times in results.items()
            ],
        )
    return {name: statistics.median(_ratios(times, 0)) for name, times in results.items()}


if __name__ == "__main__":
    main()
