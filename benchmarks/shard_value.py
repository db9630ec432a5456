"""What packing a host value onto a DTensor mesh costs: every variable a mesh strategy creates, every host batch.

`tfdist.strategies.model_parallel.shard_value` is how ModelParallelStrategy and ShardedDataParallelStrategy put
a host value on the mesh: each variable's initial value when it is created, and each batch of host (numpy)
input before a step. It hands each device only its own shard. This times it against packing per-device
strided slices of the value (`value[index]` for each device, its way before it split the value with one
`tf.split` per split dimension), side by side in one process, interleaved round by round, on a
{"batch": 2, "model": 4} mesh of 8 simulated CPU devices:

- a (256, 256) float32 kernel split on its output dimension over "model" (a Megatron column split);
- a (32, 64) int32 batch split over "batch";
- a (64, 256) float32 kernel split over both axes.

The figure is the median over the rounds of the per-device slices' time / shard_value's.

    python -m benchmarks.shard_value            # 30 rounds of 50 calls
    python -m benchmarks.shard_value --quick    # 10 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks import _results

SECTION = "Host values onto a mesh: shard_value"
CALLS = 50  # calls per round and way


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shard_value", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds of each way (default 30)")
    parser.add_argument("--quick", action="store_true", help="10 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 10

    import numpy as np

    import tfdist

    tfdist.simulate_devices(8)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from tfdist.placement import mesh as mesh_lib
    from tfdist.strategies.model_parallel import variables

    mesh = dtensor.create_mesh([("batch", 2), ("model", 4)], devices=[f"CPU:{i}" for i in range(8)])
    sizes = mesh_lib.mesh_axes(mesh)
    rng = np.random.default_rng(0)
    cases = {
        "(256, 256) kernel, [None, model]": (rng.normal(size=(256, 256)).astype("float32"), (None, "model")),
        "(32, 64) batch, [batch, None]": (rng.integers(0, 256, (32, 64)).astype("int32"), ("batch", None)),
        "(64, 256) kernel, [batch, model]": (rng.normal(size=(64, 256)).astype("float32"), ("batch", "model")),
    }

    def per_device_slices(value, layout):
        """shard_value's way before: a strided slice of the value for each device."""
        value = tf.convert_to_tensor(value)
        components = []
        for location in mesh.local_device_locations():
            index = [slice(None) if axis == dtensor.UNSHARDED else
                     slice(location[axis] * (value.shape[dim] // sizes[axis]),
                           (location[axis] + 1) * (value.shape[dim] // sizes[axis]))
                     for dim, axis in enumerate(layout.sharding_specs)]
            components.append(value[tuple(index)])
        return dtensor.pack(components, layout)

    rows, figures = [], []
    for name, (value, spec) in cases.items():
        layout = variables.layout_of(spec, mesh)
        ways = {"shard_value": variables.shard_value, "per-device slices": per_device_slices}
        for way in ways.values():  # the same shards both ways
            assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(
                dtensor.unpack(way(value, layout)), dtensor.unpack(variables.shard_value(value, layout))))
        seconds = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, pack in ways.items():
                started = time.perf_counter()
                for _ in range(CALLS):
                    pack(value, layout)
                seconds[way].append((time.perf_counter() - started) / CALLS)
        ratios = [a / b for a, b in zip(seconds["per-device slices"], seconds["shard_value"])]
        figures.append(_results.figure(f"{name}: per-device slices / shard_value", ratios, goal="> 1"))
        median = {way: statistics.median(s) * 1e3 for way, s in seconds.items()}
        rows.append(f"| {name} | {median['shard_value']:.2f} | {median['per-device slices']:.2f} | "
                    f"{statistics.median(ratios):.1f} |")
        print(rows[-1], flush=True)
    best = max(f["median"] for f in figures)
    body = f"""**A host value goes onto an 8-device mesh up to {best:.1f}x faster than as per-device slices.**
Median milliseconds per call over {args.rounds} interleaved rounds of {CALLS} calls, {{"batch": 2, "model": 4}}
mesh of 8 simulated CPU devices.

| value, layout | shard_value, ms | per-device slices, ms | slices / shard_value (median) |
|---|---|---|---|
""" + "\n".join(rows)
    _results.write_section(SECTION, _results.command("shard_value", argv), body, figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
