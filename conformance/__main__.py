"""Runs the conformance matrix: every family of `conformance.families` under every column's strategy.

    python3 dev.py conformance                    # the matrix and the MoE grid -> CONFORMANCE.md (33 minutes)
    python -m conformance --only mixtral resnet   # some families, printed, nothing written
    python -m conformance --columns zero3 --only llama
    python -m conformance --grid moe              # only the MoE grid: Adam, load-balancing loss off

The matrix's rows are every family with SGD; the MoE grid's (`matrix.moe_rows`) are the MoE families with
Adam and with their load-balancing loss off. Each row runs in child processes of its own
(`conformance.matrix`), two at a time, each killed after --timeout seconds. A cell is "equal"
(`tfdist.check` found the loss, every gradient and every variable within tolerance at every step),
"documented" (not run, or differing, for a reason the README states) or FAIL; the exit status is 1 when any cell fails.
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


def _start(row: matrix.Row, columns: list[str], out: str, log) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "conformance.matrix", out, row.family, *columns, *row.args()]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read(out: str) -> dict[str, dict]:
    if not os.path.exists(out):
        return {}
    with open(out) as f:
        return {r["column"]: r for r in map(json.loads, f)}


class _Row:
    """One row's cells, run in as many children as DTensor errors need."""

    def __init__(self, row: matrix.Row, columns: list[str], directory: str):
        self.row, self.name, self.columns = row, row.key, columns
        self.out = os.path.join(directory, f"{row.key}.jsonl")
        self.log_path = os.path.join(directory, f"{row.key}.log")
        self.proc, self.started, self.failed = None, None, {}

    def remaining(self) -> list[str]:
        done = _read(self.out)
        return [c for c in self.columns if c not in done and c not in self.failed]

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        self.proc, self.started = _start(self.row, self.remaining(), self.out, self.log), time.monotonic()

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
            self.failed[first] = {"family": self.row.family, "row": self.name, "column": first, "status": "FAIL",
                                  "error": f"the child ended ({code}) in this cell: ...{tail}"}
        return True

    def cells(self) -> dict[str, dict]:
        return {**_read(self.out), **self.failed}


def run(rows: list[matrix.Row], columns: list[str], jobs: int, timeout: float) -> dict[str, dict[str, dict]]:
    """Every (row, column) cell, by row key, running `jobs` children at a time."""
    directory = tempfile.mkdtemp(prefix="tfdist-conformance-")
    queue = [_Row(r, columns, directory) for r in rows]
    running: list[_Row] = []
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
    return {r.key: done[r.key] for r in rows}


def _figure(cell: dict) -> str:
    largest = cell.get("largest") or {}
    worst = max(largest.get("gradient", 0.0), largest.get("value", 0.0))
    ratio = cell["device_bytes"] / cell["reference_bytes"] if cell.get("reference_bytes") else None
    return f"{worst:.1e}" + (f" · {ratio:.2f}" if ratio is not None else "")


def table(results: dict[str, dict[str, dict]], rows: list[matrix.Row], columns: list[str],
          notes: list[str] | None = None) -> str:
    """`rows` of `results` as Markdown: a cell per column, then the notes the cells refer to (numbered in `notes`)."""
    notes = [] if notes is None else notes
    first = len(notes)

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"({notes.index(text) + 1})"

    lines = ["| family | " + " | ".join(matrix.COLUMNS[c].title for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for r in rows:
        name, cells, row = r.title, results[r.key], []
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
    if len(notes) > first:
        lines.append("")
        lines.extend(f"{i}. {text}" for i, text in enumerate(notes[first:], start=first + 1))
    return "\n".join(lines)


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{git('rev-parse', '--short', 'HEAD')}{dirty}"


def _counts(results, rows) -> str:
    counts = {s: sum(c["status"] == s for r in rows for c in results[r.key].values())
              for s in ("equal", "documented", "FAIL")}
    return (f"{counts['equal']} cells equal, {counts['documented']} not run or differing for a documented reason, "
            f"{counts['FAIL']} failing")


def write(results, rows: list[matrix.Row], moe: list[matrix.Row], columns, seconds: float) -> None:
    """CONFORMANCE.md (the matrix's `rows`, then the MoE grid's `moe`) and conformance/results.json."""
    from benchmarks import _results

    notes: list[str] = []
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

{_counts(results, rows)}, over {len(rows)} families.

{table(results, rows, columns, notes)}
"""
    if moe:
        text += f"""
## MoE: Adam, and the load-balancing loss off

The MoE families again, each row another optimizer or with the router's load-balancing loss scaled by 0
(the rows above train with it on, at KerasHub's default coefficient). Adam (at 1e-2) is compared at
`tfdist.check`'s tolerance for adaptive optimizers: the loss and every gradient within 1e-4 of the
one-device value's largest entry, every variable within 1e-3 (Adam divides by a running gradient norm,
which turns float32 rounding of a near-zero gradient entry into a difference of up to the learning rate in
its update, under TensorFlow's own MirroredStrategy too). GPT-OSS has no load-balancing loss.

{_counts(results, moe)}, over {len(moe)} rows.

{table(results, moe, columns, notes)}
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
    parser.add_argument("--grid", choices=("all", "matrix", "moe"), default="all",
                        help="the matrix (SGD), the MoE grid (Adam, load-balancing loss off) or both (default)")
    parser.add_argument("--jobs", type=int, default=2, help="children at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds a row's child may run")
    parser.add_argument("--write", action="store_true", help="write CONFORMANCE.md (default with the whole matrix)")
    args = parser.parse_args(argv)
    names = args.only or list(families_lib.FAMILIES)
    columns = args.columns or list(matrix.COLUMNS)
    rows = [matrix.Row(n) for n in names] if args.grid != "moe" else []
    moe = [r for r in matrix.moe_rows(families_lib.FAMILIES) if r.family in names] if args.grid != "matrix" else []
    started = time.monotonic()
    results = run(rows + moe, columns, args.jobs, args.timeout)
    notes: list[str] = []
    for part in (rows, moe):
        if part:
            print(table(results, part, columns, notes), flush=True)
    if args.write or not (args.only or args.columns or args.grid != "all"):
        write(results, rows, moe, columns, time.monotonic() - started)
    return int(any(c["status"] == "FAIL" for cells in results.values() for c in cells.values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
