"""Memory per device and step time of tfdist.ModelParallelStrategy on a transformer LM.

Trains `tfdist.models.transformer_lm` with Adam under `ModelParallelStrategy` with the
`tfdist.layouts.transformer()` rules, and unsharded on one device, in one process with
simulated devices. Figures:

* bytes per device / ideal, where ideal = (parameters + optimizer state) / model-axis size;
  goal <= 1.05 (what stays replicated: LayerNorms, position embeddings, row-parallel biases);
* the loss after the timed steps on both, as a check that they trained the same model;
* step time on the mesh / step time on one device (median over rounds; simulated CPU devices
  share the host's cores, so this measures overhead, not a speed-up);
* with `--jax_python`: the same model, mesh and placement under Keras' own
  `keras.distribution.ModelParallel` on the JAX backend (benchmarks/_model_parallel_jax.py, run
  in that Python after the TensorFlow rounds): step time and bytes per device tfdist / JAX, and
  whether every variable got the same sharding spec in both.

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
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


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


def time_steps(model, x, y, batch, steps):
    start = time.perf_counter()
    history = model.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return (time.perf_counter() - start) / steps, history.history["loss"][-1]


def run_jax(args, mesh) -> dict:
    """Runs the JAX side in `args.jax_python` and returns its JSON result."""
    config = {
        "mesh": mesh,
        **{k: getattr(args, k) for k in ("rounds", "steps", "global_batch_size", "seq_len", "vocab_size")},
        **{k: getattr(args, k) for k in ("d_model", "num_heads", "num_layers")},
    }
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(repo, "benchmarks", "_model_parallel_jax.py")
    env = {**os.environ, "PYTHONPATH": repo}
    proc = subprocess.run(
        [args.jax_python, script, json.dumps(config)], capture_output=True, text=True, env=env, timeout=1200
    )
    if proc.returncode:
        raise RuntimeError(f"the JAX side failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    n = args.global_batch_size * args.steps
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
    ratios, losses, mesh_times = [], {}, []
    for r in range(args.rounds):
        times = {}
        for name in ("single", "mesh") if r % 2 == 0 else ("mesh", "single"):
            model = single if name == "single" else sharded
            times[name], losses[name] = time_steps(model, x, y, args.global_batch_size, args.steps)
        ratios.append(times["mesh"] / times["single"])
        mesh_times.append(times["mesh"])
        print(f"round {r}: one device {times['single'] * 1e3:.1f} ms/step, mesh {times['mesh'] * 1e3:.1f} ms/step")

    rows = []
    figures = [
        _results.figure(f"model-parallel bytes per device / ideal (mesh {mesh})", [per_device / ideal], goal="<= 1.05"),
        _results.figure("model-parallel step time mesh / one device (simulated CPUs: overhead)", ratios),
    ]
    if args.jax_python:
        jax = run_jax(args, mesh)
        tfdist_step, jax_step = statistics.median(mesh_times), statistics.median(jax["step_times"])
        tfdist_specs = {re.sub(r"^adam(_\d+)?/", "adam/", v.path): list(v.spec) for v in report.variables}
        differ = sorted(p for p in set(tfdist_specs) | set(jax["specs"]) if tfdist_specs.get(p) != jax["specs"].get(p))
        rows = [
            f"| step time on the mesh: tfdist {tfdist_step * 1e3:.1f} ms, JAX-Keras {jax_step * 1e3:.1f} ms | |",
            f"| step time tfdist / JAX-Keras | {tfdist_step / jax_step:.2f} |",
            f"| bytes per device tfdist / JAX-Keras | {per_device / jax['bytes_device0']:.3f} |",
            f"| last loss JAX-Keras (same data; initial weights differ by backend RNG) | {jax['loss']:.5f} |",
            f"| variables placed differently tfdist vs JAX-Keras | {len(differ)} of {len(tfdist_specs)} {differ[:3]} |",
        ]
        figures += [
            _results.figure("model-parallel step time tfdist / JAX-Keras ModelParallel",
                            [t / statistics.median(jax["step_times"]) for t in mesh_times]),
            _results.figure("model-parallel bytes per device tfdist / JAX-Keras", [per_device / jax["bytes_device0"]]),
        ]
    body = "\n".join(
        [
            f"transformer_lm(seq_len={args.seq_len}, vocab_size={args.vocab_size}, d_model={args.d_model}, "
            f"num_heads={args.num_heads}, num_layers={args.num_layers}), Adam, global batch "
            f"{args.global_batch_size}, mesh {mesh}, rules tfdist.layouts.transformer().",
            "",
            "| figure | value |",
            "|---|---|",
            f"| parameters + optimizer state, one device | {report.bytes_total / 2**20:.2f} MiB |",
            f"| on each mesh device | {per_device / 2**20:.2f} MiB |",
            f"| bytes per device / ideal (total / {model_axis}) | {per_device / ideal:.3f} (goal <= 1.05) |",
            f"| step time mesh / one device (median of {args.rounds} rounds) | {statistics.median(ratios):.2f} |",
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
