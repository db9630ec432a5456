"""Memory per device and step time of tfdist.ModelParallelStrategy on a transformer LM.

Trains `tfdist.models.transformer_lm` with Adam under `ModelParallelStrategy` with the
`tfdist.layouts.transformer()` rules, and unsharded on one device, in one process with
simulated devices. Figures:

* bytes per device / ideal, where ideal = (parameters + optimizer state) / model-axis size;
  goal <= 1.05 (what stays replicated: LayerNorms, position embeddings, row-parallel biases);
* the loss after the timed steps on both, as a check that they trained the same model;
* step time on the mesh / step time on one device (simulated CPU devices share the host's
  cores, so this measures overhead, not a speed-up);
* with `--jax_python`: the same model, mesh and placement under Keras' own
  `keras.distribution.ModelParallel` on the JAX backend (benchmarks/_model_parallel_jax.py, a
  process of that Python that runs one round when asked): step time and bytes per device
  tfdist / JAX, and whether every variable got the same sharding spec in both.

Step times are measured inside `fit`, on both backends alike: each round runs one `fit` epoch per
variant (one device, the mesh, JAX-Keras) over the same batches, the order changing from round to
round (`benchmarks._timing.interleaved`: each first, and right after each other, equally often),
and its figure is the median of the intervals between batch ends after a warm-up of 2 steps
(`benchmarks._timing`; a `fit()` call's wall time on TensorFlow includes up to seconds of tf.data
work after the last step). The ratios are taken round by round; median and min-max over
rounds.

    python -m benchmarks.model_parallel --mesh batch=2,model=4 --rounds 5
    # JAX side, in an environment of its own:
    python3 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install "jax[cpu]" "keras==3.15.1"
    python -m benchmarks.model_parallel --jax_python /tmp/jaxenv/bin/python --write
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import statistics
import subprocess
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import _timing  # noqa: E402

WARMUP = 2  # steps of each round's fit epoch before the timed ones
JAX_TIMEOUT = 1200  # seconds the JAX side may take to start, or to run one round


def parse_mesh(text: str) -> dict[str, int]:
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        axes[name.strip()] = int(size)
    return axes


def build(args):
    import keras

    from tfdist import models

    keras.utils.set_random_seed(0)
    model = models.transformer_lm(
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def loss_keeper():
    """A Keras callback keeping the last epoch's loss (`.loss`)."""
    import keras

    class LastLoss(keras.callbacks.Callback):
        loss = None

        def on_epoch_end(self, epoch, logs=None):
            self.loss = float(logs["loss"])

    return LastLoss()


class JaxSide:
    """benchmarks/_model_parallel_jax.py in `python`: it builds the model, then runs one timed round per `round()`.

    It waits for the next request between rounds (idle, so it does not compete with the TensorFlow
    rounds for the cores); `finish()` returns the bytes on its device 0 and the variables' specs.
    """

    def __init__(self, python: str, config: dict):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        script = os.path.join(repo, "benchmarks", "_model_parallel_jax.py")
        env = {**os.environ, "PYTHONPATH": repo}
        self._proc = subprocess.Popen(
            [python, script, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self._lines = queue.Queue()
        self._err = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self._proc.stderr), daemon=True).start()
        self._reply()  # built, compiled and warmed up

    def _read(self):
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the process closed its output: it exited

    def _reply(self) -> dict:
        """The next "@json ..." line the JAX side prints (other output, e.g. a library's notice, is skipped)."""
        while True:
            try:
                line = self._lines.get(timeout=JAX_TIMEOUT)
            except queue.Empty:
                line = why = f"no answer in {JAX_TIMEOUT} s"
            else:
                why = f"exit status {self._proc.wait()}" if line is None else None
            if why:
                self.close()
                raise RuntimeError(f"the JAX side failed ({why}):\n{''.join(self._err)[-4000:]}")
            if line.startswith("@json "):
                return json.loads(line[len("@json ") :])

    def _ask(self, request: str) -> dict:
        self._proc.stdin.write(request + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def round(self) -> dict:
        """One `fit` epoch: {"step_time": median seconds per step, "loss": the epoch's loss}."""
        return self._ask("round")

    def finish(self) -> dict:
        """{"bytes_device0": ..., "specs": {variable path: spec}}; the process then exits."""
        out = self._ask("finish")
        self._proc.wait(timeout=60)
        return out

    def close(self):
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    parser.add_argument("--mesh", default="batch=2,model=4")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="default 10 (--quick 4)")
    parser.add_argument("--global_batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--jax_python", help="a Python with jax and the same Keras, for the JAX comparison")
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (4 if args.quick else 10)
    mesh = parse_mesh(args.mesh)

    import tfdist
    from benchmarks import _results

    tfdist.simulate_devices(math.prod(mesh.values()))
    import numpy as np

    from tfdist import layouts
    from tfdist.strategies.model_parallel import ModelParallelStrategy

    rng = np.random.default_rng(0)
    n = args.global_batch_size * (WARMUP + args.steps)
    x = rng.integers(0, args.vocab_size, (n, args.seq_len)).astype("int32")
    y = rng.integers(0, args.vocab_size, (n, args.seq_len)).astype("int32")

    single = build(args)
    strategy = ModelParallelStrategy(mesh=mesh, rules=layouts.transformer())
    with strategy.scope():
        sharded = build(args)
    for model in (single, sharded):  # trace and build the optimizer
        model.fit(
            x[: args.global_batch_size], y[: args.global_batch_size], batch_size=args.global_batch_size, verbose=0
        )

    report = strategy.placement_report(sharded, print_fn=None)
    per_device = next(iter(report.bytes_per_device.values()))
    model_axis = mesh.get("model", 1)
    ideal = report.bytes_total / model_axis
    losses = {name: loss_keeper() for name in ("single", "mesh")}

    def tf_round(name, model):
        def run():
            return _timing.step_time(
                model, x, y, steps=args.steps, warmup=WARMUP, batch_size=args.global_batch_size,
                callbacks=[losses[name]],
            )

        return run

    variants = {"single": tf_round("single", single), "mesh": tf_round("mesh", sharded)}
    jax_side = jax_losses = None
    if args.jax_python:
        config = {
            "mesh": mesh,
            "warmup": WARMUP,
            **{k: getattr(args, k) for k in ("steps", "global_batch_size", "seq_len", "vocab_size")},
            **{k: getattr(args, k) for k in ("d_model", "num_heads", "num_layers")},
        }
        jax_side, jax_losses = JaxSide(args.jax_python, config), []

        def jax_round():
            reply = jax_side.round()
            jax_losses.append(reply["loss"])
            return reply["step_time"]

        variants["JAX-Keras"] = jax_round
    try:
        times = _timing.interleaved(variants, args.rounds)
        jax = jax_side.finish() if jax_side else None
    finally:
        if jax_side:
            jax_side.close()
    for r in range(args.rounds):
        print(f"round {r}: " + ", ".join(f"{name} {t[r] * 1e3:.1f} ms/step" for name, t in times.items()), flush=True)
    mesh_times = times["mesh"]
    ratios = [m / s for m, s in zip(mesh_times, times["single"])]
    losses = {name: keeper.loss for name, keeper in losses.items()}

    rows = []
    figures = [
        _results.figure(f"model-parallel bytes per device / ideal (mesh {mesh})", [per_device / ideal], goal="<= 1.05"),
        _results.figure("model-parallel step time mesh / one device (simulated CPUs: overhead)", ratios),
    ]
    if jax is not None:
        jax_ratios = [t / j for t, j in zip(mesh_times, times["JAX-Keras"])]
        tfdist_step, jax_step = statistics.median(mesh_times), statistics.median(times["JAX-Keras"])
        tfdist_specs = {re.sub(r"^adam(_\d+)?/", "adam/", v.path): list(v.spec) for v in report.variables}
        differ = sorted(p for p in set(tfdist_specs) | set(jax["specs"]) if tfdist_specs.get(p) != jax["specs"].get(p))
        rows = [
            f"| step time on the mesh: tfdist {tfdist_step * 1e3:.1f} ms, JAX-Keras {jax_step * 1e3:.1f} ms | |",
            f"| step time tfdist / JAX-Keras (median of per-round ratios, min-max) | "
            f"{statistics.median(jax_ratios):.2f} ({min(jax_ratios):.2f}-{max(jax_ratios):.2f}) |",
            f"| bytes per device tfdist / JAX-Keras | {per_device / jax['bytes_device0']:.3f} |",
            f"| last loss JAX-Keras (same data; initial weights differ by backend RNG) | {jax_losses[-1]:.5f} |",
            f"| variables placed differently tfdist vs JAX-Keras | {len(differ)} of {len(tfdist_specs)} {differ[:3]} |",
        ]
        figures += [
            _results.figure("model-parallel step time tfdist / JAX-Keras ModelParallel", jax_ratios),
            _results.figure("model-parallel bytes per device tfdist / JAX-Keras", [per_device / jax["bytes_device0"]]),
        ]
    body = "\n".join(
        [
            f"transformer_lm(seq_len={args.seq_len}, vocab_size={args.vocab_size}, d_model={args.d_model}, "
            f"num_heads={args.num_heads}, num_layers={args.num_layers}), Adam, global batch "
            f"{args.global_batch_size}, mesh {mesh}, rules tfdist.layouts.transformer(). Step times are measured "
            f"inside `fit`: the median of the {args.steps} intervals between batch ends after {WARMUP} warm-up steps, "
            f"one figure per variant and round; {args.rounds} rounds, the variants ({', '.join(times)}) interleaved "
            "(each first, and right after each other, equally often), ratios taken round by round; medians over "
            "rounds (min-max).",
            "",
            "| figure | value |",
            "|---|---|",
            f"| parameters + optimizer state, one device | {report.bytes_total / 2**20:.2f} MiB |",
            f"| on each mesh device | {per_device / 2**20:.2f} MiB |",
            f"| bytes per device / ideal (total / {model_axis}) | {per_device / ideal:.3f} (goal <= 1.05) |",
            f"| step time: one device {statistics.median(times['single']) * 1e3:.1f} ms, mesh "
            f"{statistics.median(mesh_times) * 1e3:.1f} ms | |",
            f"| step time mesh / one device (median of per-round ratios, min-max) | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |",
            f"| last loss, one device vs mesh (same steps) | {losses['single']:.5f} vs {losses['mesh']:.5f} |",
            *rows,
            "",
            "Simulated CPU devices share the host's cores: the step-time ratio is DTensor's overhead "
            "(collectives, SPMD expansion), not a speed-up; measure on accelerators for that.",
        ]
    )
    print(body)
    if args.write:
        command = _results.command("model_parallel", argv)
        _results.write_section("model_parallel", command, body, figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
