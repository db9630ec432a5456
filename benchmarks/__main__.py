"""Runs every benchmark and writes benchmarks/RESULTS.md with a summary of their headline ratios.

Each benchmark runs as a subprocess of its own (each sets up its own devices), with a timeout;
a failure is reported and the others still run, and the exit status is then 1. Afterwards the
"Summary" section at the top of RESULTS.md lists each section's headline figures (from
benchmarks/results.json, else the section's first bold line) with links to the plots, and
benchmarks/summary.png plots every ratio with its min-max.

    python -m benchmarks --quick        # 2 CPU cores: under 10 minutes
    python -m benchmarks                # the full rounds and sizes
    python -m benchmarks --only allreduce scaling
    python -m benchmarks --jax_python /path/to/jax-venv/bin/python   # + tfdist vs JAX-Keras
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time

from benchmarks import _results

REPO = os.path.dirname(_results.DIRECTORY)
# name -> (extra arguments, timeout in seconds quick / full)
BENCHMARKS = {
    "overhead": ([], (150, 1200)),
    "allreduce": ([], (420, 1800)),
    "scaling": ([], (240, 1800)),
    "multi_worker": ([], (180, 1200)),
    "flight": ([], (120, 600)),
    "model_parallel": (["--write"], (240, 2400)),
    "model_parallel_processes": ([], (300, 1500)),
    "sharded_data_parallel": ([], (720, 1500)),
    "checkpoint": ([], (120, 900)),
    "pipeline": ([], (240, 1800)),
    "xla": ([], (300, 1200)),
    "step_stats": ([], (240, 1200)),
    "advise": ([], (300, 900)),
    "check": ([], (400, 900)),
    "epoch_start": ([], (180, 600)),
    "shard_value": ([], (120, 300)),
}


def _summary_rows() -> tuple[list[str], list[dict]]:
    """Table rows of every section's headline figures, and the figures that are ratios."""
    recorded = _results.read_figures()
    text = open(_results.RESULTS).read() if os.path.exists(_results.RESULTS) else ""
    sections = re.findall(r"<!-- begin (.+?) -->(.*?)<!-- end \1 -->", text, re.S)
    rows, ratios = [], []
    for name, section in sections:
        if name == "Summary":
            continue
        anchor = re.sub(r"[^a-z0-9 _-]", "", name.lower()).replace(" ", "-")
        entry = recorded.get(name)
        plot = f" [plot]({entry['plot']})" if entry and entry.get("plot") else ""
        if entry and entry["figures"]:
            for f in entry["figures"]:
                spread = f"{f['min']:.3g}-{f['max']:.3g}" if f["rounds"] > 1 else "one value"
                rows.append(
                    f"| [{name}](#{anchor}) | {f['figure']} | **{f['median']:.3g}** | {spread} ({f['rounds']}) "
                    f"| {f['goal'] or ''} |{plot} |"
                )
                ratios.append(f)
        else:
            bold = re.search(r"\*\*(.+?)\*\*", section)
            headline = bold.group(1) if bold else "see the section"
            rows.append(f"| [{name}](#{anchor}) | {headline} | | | |{plot} |")
    return rows, ratios


def _plot_summary(ratios: list[dict], path: str) -> None:
    plt = _results.pyplot()
    fig, ax = plt.subplots(figsize=(12.5, 0.38 * len(ratios) + 1.2))
    ys = range(len(ratios))
    med = [f["median"] for f in ratios]
    ax.errorbar(
        med, ys, xerr=[[m - f["min"] for m, f in zip(med, ratios)], [f["max"] - m for m, f in zip(med, ratios)]],
        fmt="o", capsize=3,
    )
    ax.axvline(1.0, color="gray", lw=1, ls="--")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f["figure"] for f in ratios], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ratio (median, min-max over rounds; log scale)")
    ax.set_title("tfdist benchmark ratios (one run, side by side)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(command: str, outcomes: dict[str, str]) -> None:
    """Writes the Summary section and summary.png from what the sections recorded."""
    rows, ratios = _summary_rows()
    plot = None
    if ratios:
        plot = os.path.basename(_results.plot_path("summary"))
        _plot_summary(ratios, _results.plot_path("summary"))
    body = (
        "Headline figures of the sections below, each a ratio measured side by side in one run: median over "
        "rounds, min-max and the number of rounds in brackets.\n\n"
        "| section | figure | median | min-max (rounds) | goal | plot |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nThis run: " + "; ".join(f"{name} {outcome}" for name, outcome in outcomes.items()) + ".\n"
    )
    _results.write_section("Summary", command, body, plot=plot, first=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and sizes (2 CPU cores: < 10 min)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--jax_python", help="a Python with jax and Keras 3.15 for model_parallel's JAX comparison")
    args = parser.parse_args(argv)

    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    outcomes, failed = {}, []
    start_all = time.perf_counter()
    for name, (extra, timeouts) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if importlib.util.find_spec(f"benchmarks.{name}") is None:
            print(f"== {name}: skipped (benchmarks/{name}.py does not exist)", flush=True)
            outcomes[name] = "skipped (no module)"
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *extra] + (["--quick"] if args.quick else [])
        if name == "model_parallel":
            if args.jax_python:
                cmd += ["--jax_python", args.jax_python]
            else:
                print("== model_parallel: the tfdist vs JAX-Keras comparison is skipped: no --jax_python given "
                      "(a Python with jax and keras 3.15; see benchmarks/model_parallel.py)", flush=True)
        timeout = timeouts[0] if args.quick else timeouts[1]
        print(f"== {name}: {' '.join(cmd[1:])} (timeout {timeout} s)", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
            code = proc.returncode
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            code, tail = "timeout", f"timed out after {timeout} s\n{(e.stdout or b'')[-2000:]!r}"
        seconds = time.perf_counter() - start
        if code == 0:
            outcomes[name] = f"ok ({seconds:.0f} s)"
            print(f"   ok in {seconds:.0f} s", flush=True)
        else:
            outcomes[name] = f"FAILED ({code}, {seconds:.0f} s)"
            failed.append(name)
            print(f"   FAILED ({code}) after {seconds:.0f} s; last output:\n{tail}", flush=True)
    total = time.perf_counter() - start_all
    outcomes["total"] = f"{total:.0f} s"
    command = "python -m benchmarks" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(args.only)}" if args.only else "") + (" --jax_python PATH" if args.jax_python else "")
    write_summary(command, outcomes)
    print(f"== wrote {_results.RESULTS} in {total:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
