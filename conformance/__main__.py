"""Runs the conformance matrix: every family of `conformance.families` under every column's strategy.

    python3 dev.py conformance                    # the whole matrix -> CONFORMANCE.md (about an hour on 2 cores)
    python -m conformance --only mixtral resnet   # some families, printed, nothing written
    python -m conformance --columns zero3 --only llama

Each family runs in child processes of its own (`conformance.matrix`), two at a time, each killed
after --timeout seconds. A cell is "equal" (`tfdist.check` found the loss, every gradient and every
variable within tolerance at every step), "documented" (not run, or differing, for a reason the
README states) or FAIL; the exit status is 1 when any cell fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from conformance import families as families_lib
from conformance import matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "CONFORMANCE.md")
RESULTS = os.path.join(ROOT, "conformance", "results.json")


def _start(family: str, columns: list[str], out: str, log) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "conformance.matrix", out, family, *columns], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read(out: str) -> dict[str, dict]:
    if not os.path.exists(out):
        return {}
    with open(out) as f:
        return {r["column"]: r for r in map(json.loads, f)}


class _Family:
    """One family's cells, run in as many children as DTensor errors need."""

    def __init__(self, name: str, columns: list[str], directory: str):
        self.name, self.columns = name, columns
        self.out = os.path.join(directory, f"{name}.jsonl")
        self.log_path = os.path.join(directory, f"{name}.log")
        self.proc, self.started, self.failed = None, None, {}

    def remaining(self) -> list[str]:
        done = _read(self.out)
        return [c for c in self.columns if c not in done and c not in self.failed]

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        self.proc, self.started = _start(self.name, self.remaining(), self.out, self.log), time.monotonic()

    def poll(self, timeout: float) -> bool:
        """Whether the running child has ended (killed past `timeout`); records cells it left unfinished."""
        code = self.proc.poll()
        if code is None and time.monotonic() - self.started < timeout:
            return False
        if code is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            code = f"killed after {timeout:.0f} s"
        self.log.close()
        left = self.remaining()
        if left and code != 3:  # 3: a DTensor cell failed and the child stopped; the next child runs the rest
            with open(self.log_path) as f:
                tail = f.read()[-1500:]
            first = left[0]
            self.failed[first] = {"family": self.name, "column": first, "status": "FAIL",
                                  "error": f"the child ended ({code}) in this cell: ...{tail}"}
        return True

    def cells(self) -> dict[str, dict]:
        return {**_read(self.out), **self.failed}


def run(names: list[str], columns: list[str], jobs: int, timeout: float) -> dict[str, dict[str, dict]]:
    """Every (family, column) cell, running `jobs` children at a time."""
    directory = tempfile.mkdtemp(prefix="tfdist-conformance-")
    queue = [_Family(n, columns, directory) for n in names]
    running: list[_Family] = []
    done = {}
    while queue or running:
        while queue and len(running) < jobs:
            family = queue.pop(0)
            family.start()
            running.append(family)
        time.sleep(1.0)
        for family in list(running):
            if family.poll(timeout):
                running.remove(family)
                if family.remaining():
                    queue.insert(0, family)
                else:
                    done[family.name] = family.cells()
                    statuses = ", ".join(f"{c} {done[family.name][c]['status']}" for c in columns)
                    print(f"{family.name}: {statuses}", flush=True)
    return {n: done[n] for n in names}


def _figure(cell: dict) -> str:
    largest = cell.get("largest") or {}
    worst = max(largest.get("gradient", 0.0), largest.get("value", 0.0))
    ratio = cell["device_bytes"] / cell["reference_bytes"] if cell.get("reference_bytes") else None
    return f"{worst:.1e}" + (f" · {ratio:.2f}" if ratio is not None else "")


def table(results: dict[str, dict[str, dict]], columns: list[str]) -> str:
    """The matrix as Markdown: a row per family, a cell per column, then the notes the cells refer to."""
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"({notes.index(text) + 1})"

    lines = ["| family | " + " | ".join(matrix.COLUMNS[c].title for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for name, cells in results.items():
        row = []
        for column in columns:
            cell = cells[column]
            if cell["status"] == "equal":
                row.append(f"equal {_figure(cell)}")
            elif cell["status"] == "documented" and "largest" not in cell:
                row.append(f"not run {note(cell['reason'])}")
            elif cell["status"] == "documented":
                row.append(f"differs {_figure(cell)} {note(cell['reason'])}")
            else:
                what = cell.get("error") or next(t for t in cell["text"].splitlines() if t.startswith("DIFFERENT"))
                row.append(f"**FAIL** {note(f'{name}, {column}: {what}')}")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    if notes:
        lines.append("")
        lines.extend(f"{i}. {text}" for i, text in enumerate(notes, start=1))
    return "\n".join(lines)


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{git('rev-parse', '--short', 'HEAD')}{dirty}"


def write(results, columns, seconds: float) -> None:
    from benchmarks import _results

    counts = {s: sum(c["status"] == s for cells in results.values() for c in cells.values())
              for s in ("equal", "documented", "FAIL")}
    text = f"""# Conformance: KerasHub families under every tfdist strategy

Written by `python3 dev.py conformance` on {datetime.date.today().isoformat()}, commit {_commit()}, in
{seconds / 60:.0f} minutes. Machine: {_results.machine()}.

Each cell is `tfdist.check` of the family's tiny model (built from its KerasHub config: nothing downloaded;
dropout off) under the column's strategy against the same model on one device: the same initial weights,
{matrix.STEPS} training steps of {matrix.BATCH} synthetic examples (text with some padding), SGD with
momentum 0.9 at 0.1, and at every step the loss, every gradient and every variable on every device
compared. **equal** means all of them within 1e-5 of the one-device value's largest entry (`tfdist.check`'s
tolerance for SGD, plus an absolute 1e-7 for entries near zero); the figures are the largest relative
difference of a gradient or a variable over the steps (that absolute slack counted as size, so that an
all-zero one-device gradient does not read as 100% off), then the bytes of weights and optimizer state
on the fullest device as a fraction of one device's.
The data-parallel and pipeline columns use `batch_statistics="global"` (BatchNormalization's moments and MoE
load balancing over the global batch, as on one device); ZeRO columns use `min_size=16`, so that tiny
weights are split too. Columns: 8 simulated CPU devices on one host.

{counts['equal']} cells equal, {counts['documented']} not run or differing for a documented reason,
{counts['FAIL']} failing, over {len(results)} families.

{table(results, columns)}
"""
    with open(REPORT, "w") as f:
        f.write(text)
    slim = {n: {c: {k: v for k, v in cell.items() if k not in ("text", "traceback")} for c, cell in cells.items()}
            for n, cells in results.items()}
    with open(RESULTS, "w") as f:
        json.dump(slim, f, indent=1)
    print(f"wrote {REPORT}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(families_lib.FAMILIES), help="families to run")
    parser.add_argument("--columns", nargs="+", choices=list(matrix.COLUMNS), help="columns to run")
    parser.add_argument("--jobs", type=int, default=2, help="children at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds a family's child may run")
    parser.add_argument("--write", action="store_true", help="write CONFORMANCE.md (default with the whole matrix)")
    args = parser.parse_args(argv)
    names = args.only or list(families_lib.FAMILIES)
    columns = args.columns or list(matrix.COLUMNS)
    started = time.monotonic()
    results = run(names, columns, args.jobs, args.timeout)
    print(table(results, columns), flush=True)
    if args.write or not (args.only or args.columns):
        write(results, columns, time.monotonic() - started)
    return int(any(c["status"] == "FAIL" for cells in results.values() for c in cells.values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
