"""How long `tfdist-check` takes on tfdist-train's default transformer_lm, on 8 simulated CPU devices.

`tfdist.check`'s promise is a verdict in about a minute. Each strategy column runs the binary as a user does
(`python -m tfdist.check_main --strategy=... --num_devices=8`, tfdist-train's default model and batch: seq_len
64, d_model 128, 4 heads, 2 layers, global batch 32; 3 steps, AdamW), in a process of its own, one at a time;
the figure is the wall-clock seconds of the whole command (TensorFlow's start-up, both models' builds and
traces, 3 steps on each, every comparison) and of the check alone (`CheckReport.seconds`, printed in its
report). Each command must say EQUAL (exit status 0).

    python -m benchmarks.check              # 2 rounds
    python -m benchmarks.check --quick      # 1 round
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from benchmarks import _results

SECTION = "tfdist-check time"
GOAL_S = 60.0
COLUMNS = {
    "DataParallel, 8 replicas": ["--strategy=data"],
    "ModelParallel {batch 2, model 4}": ["--strategy=model_parallel", "--mesh=batch:2,model:4"],
    "ShardedDataParallel ZeRO-1": ["--strategy=sharded_data_parallel", "--shard=optimizer"],
    "ShardedDataParallel ZeRO-3": ["--strategy=sharded_data_parallel", "--shard=weights"],
    "Pipeline, 2 stages x 4 micro-batches": ["--strategy=pipeline", "--stages=2", "--microbatches=4"],
}


def run_one(flags: list[str]) -> tuple[float, float]:
    """(wall seconds of the command, seconds the check itself reported) for one `tfdist-check` run."""
    command = [sys.executable, "-m", "tfdist.check_main", "--num_devices=8", *flags]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(_results.DIRECTORY),
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    found = re.search(r"step\(s\), ([0-9.]+) s", done.stdout)
    if found is None:
        raise RuntimeError(f"no 'step(s), N s' in the report of {' '.join(command)}:\n{done.stdout[-2000:]}")
    return wall, float(found.group(1))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each column (default 2)")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    rows, figures = [], []
    for name, flags in COLUMNS.items():
        walls, checks = [], []
        for _ in range(args.rounds):
            wall, check = run_one(flags)
            walls.append(wall)
            checks.append(check)
            print(f"{name}: {wall:.1f} s in all, the check {check:.1f} s", flush=True)
        figures.append(_results.figure(f"tfdist-check seconds, {name}", walls, goal=f"< {GOAL_S:.0f} s", unit="s"))
        rows.append(f"| {name} | {min(walls):.1f}-{max(walls):.1f} | {min(checks):.1f}-{max(checks):.1f} | "
                    f"{'yes' if max(walls) < GOAL_S else '**no**'} |")
    worst = max(f["max"] for f in figures)
    body = f"""**The slowest column took {worst:.0f} s, command and all ({'within' if worst < GOAL_S else 'over'} the
{GOAL_S:.0f} s goal).** tfdist-train's default model (transformer_lm: seq_len 64, d_model 128, 4 heads, 2 layers;
global batch 32, AdamW), 3 steps, 8 simulated CPU devices, one command at a time ({args.rounds} rounds, min-max).

| strategy | whole command, s | the check alone (`CheckReport.seconds`), s | under {GOAL_S:.0f} s |
|---|---|---|---|
""" + "\n".join(rows)
    _results.write_section(SECTION, _results.command("check", argv), body, figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
