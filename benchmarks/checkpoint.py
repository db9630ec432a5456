"""Checkpoint save and restore throughput vs a raw sequential write of the same bytes.

A Keras MLP of `--width`^2 x `--depth` float32 weights (default 2 x 4096^2 + heads: 134 MB) with
SGD+momentum state (as much again), under tfdist.DataParallelStrategy over `--devices` simulated
CPUs. Each round times, on the same disk:

- save: `tfdist.callbacks.Checkpoint`'s path: read every variable, write the file under a temporary
  name, fsync, rename (what a crash-safe checkpoint costs),
- restore: read the file back with its CRC check and assign every variable (all replicas),
- raw write: the same number of bytes, already in memory, written sequentially and fsync'ed,
- raw read: those bytes read back (from the page cache, as the restore reads).

The figures are medians over rounds, as MB/s (10^6 bytes) and as ratios to the raw write.

    python -m benchmarks.checkpoint --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _raw_write(path: str, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a 2048-wide MLP (34 MB of weights), 3 rounds")
    parser.add_argument("--width", type=int, default=None, help="default 4096 (--quick 2048)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    args.width = args.width or (2048 if args.quick else 4096)
    args.rounds = args.rounds or (3 if args.quick else 5)

    import tfdist

    tfdist.simulate_devices(args.devices)
    import keras
    import numpy as np

    from tfdist.callbacks import _files
    from tfdist.callbacks import _state

    strategy = tfdist.DataParallelStrategy()
    with strategy.scope():
        layers = [keras.Input((args.width,))]
        layers += [keras.layers.Dense(args.width) for _ in range(args.depth)] + [keras.layers.Dense(10)]
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)

    directory = args.dir or tempfile.mkdtemp(prefix="tfdist-ckpt-bench-")
    os.makedirs(directory, exist_ok=True)
    times = {"save": [], "restore": [], "raw write": [], "raw read": []}
    size = 0
    try:
        for r in range(args.rounds):
            # New file names each round, old files deleted and memory freed outside the timings.
            path = os.path.join(directory, _files.checkpoint_name("ckpt", r))
            raw_path = os.path.join(directory, f"raw-{r}.bin")
            start = time.perf_counter()
            paths, arrays = _state.collect_state(model)
            size = _files.write_file(path, paths, arrays, {"step": r})
            times["save"].append(time.perf_counter() - start)
            del arrays
            gc.collect()

            start = time.perf_counter()
            meta, arrays = _files.read_file(path)
            _state.restore_state(model, meta, arrays, source=path)
            times["restore"].append(time.perf_counter() - start)
            del arrays
            gc.collect()

            payload = b"".join(np.asarray(a, order="C").tobytes() for a in _state.collect_state(model)[1])
            payload += b"\0" * max(0, size - len(payload))  # the same byte count as the checkpoint file
            start = time.perf_counter()
            _raw_write(raw_path, payload)
            times["raw write"].append(time.perf_counter() - start)
            del payload
            gc.collect()

            start = time.perf_counter()
            with open(raw_path, "rb") as f:
                while f.read(1 << 24):
                    pass
            times["raw read"].append(time.perf_counter() - start)
            os.remove(path)
            os.remove(raw_path)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    mb = size / 1e6
    median = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: mb / t for k, t in median.items()}
    params = sum(int(np.prod(v.shape)) for v in model.weights)
    body = (
        f"Model: MLP {args.depth}x{args.width} (+10-way head), {params / 1e6:.1f} M float32 parameters, "
        f"SGD with momentum; checkpoint file {mb:.1f} MB (weights + optimizer state) under "
        f"DataParallelStrategy over {args.devices} simulated CPUs; {args.rounds} rounds, medians; "
        f"disk: the filesystem of {directory if args.dir else tempfile.gettempdir()}.\n\n"
        "| operation | median time (s) | MB/s | ratio to raw write |\n|---|---|---|---|\n"
        + "".join(
            f"| {name} | {median[name]:.3f} | {rate[name]:.0f} | {rate[name] / rate['raw write']:.2f} |\n"
            for name in ("save", "restore", "raw write", "raw read")
        )
        + f"\n**Checkpoint save runs at {rate['save'] / rate['raw write']:.2f}x and restore at "
        f"{rate['restore'] / rate['raw write']:.2f}x the raw sequential write speed of the same bytes.** "
        "Save includes reading the variables off the devices, the zip framing, fsync and the atomic rename; "
        "restore includes the CRC check of every byte and assigning every replica's copy.\n"
    )
    print(body)
    if not args.no_write:
        from benchmarks import _results

        _results.write_section(
            "Checkpoint throughput",
            _results.command("checkpoint", argv),
            body,
            figures=[
                _results.figure(
                    f"checkpoint {op} MB/s / raw write MB/s", [w / t for t, w in zip(times[op], times["raw write"])]
                )
                for op in ("save", "restore")
            ],
        )
    return rate


if __name__ == "__main__":
    main()
