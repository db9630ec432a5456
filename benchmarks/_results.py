"""Writes a benchmark's section of benchmarks/RESULTS.md (replacing that section's previous run).

A section may also record its headline figures (ratios: median and min-max over rounds) in
benchmarks/results.json, keyed by section name; `python -m benchmarks` builds the summary at the
top of RESULTS.md from them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import sys

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(DIRECTORY, "RESULTS.md")
FIGURES = os.path.join(DIRECTORY, "results.json")
_HEADER = (
    "# Benchmark results\n\nEach section is written by the script it names; "
    "rerun the command to update it.\n"
)


def machine() -> str:
    """CPU model, cores, GPUs and TF/Keras versions, in one line."""
    from tfdist._native_log import native_stderr_silenced

    with native_stderr_silenced():  # TensorFlow's native start-up notices
        import keras
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, GPUs: {len(gpus) or 'none'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, Python {platform.python_version()}; "
        f"load average when written (1/5/15 min): {load}"
    )


def command(module: str, argv: list[str] | None) -> str:
    """The command line that ran benchmark `module` (e.g. "pipeline") with `argv` (None: this process's)."""
    return f"python -m benchmarks.{module} " + " ".join(argv if argv is not None else sys.argv[1:])


def figure(label: str, values, *, goal: str | None = None, unit: str = "x") -> dict:
    """One headline figure: the median and min-max of per-round `values` (ratios, unless `unit` says)."""
    values = [float(v) for v in values]
    return {
        "figure": label,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
        "goal": goal,
        "unit": unit,
    }


def plot_path(name: str) -> str:
    """Where a benchmark writes its plot `name`.png (next to RESULTS.md)."""
    return os.path.join(DIRECTORY, f"{name}.png")


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_figures() -> dict:
    """The recorded headline figures: {section: {"figures": [...], "plot": ..., ...}}."""
    if not os.path.exists(FIGURES):
        return {}
    with open(FIGURES) as f:
        return json.load(f)


def write_section(
    name: str,
    command: str,
    body: str,
    *,
    figures: list[dict] | None = None,
    plot: str | None = None,
    first: bool = False,
) -> None:
    """Replaces (or appends) the section `name` of RESULTS.md.

    `figures` (from `figure`) and `plot` (a file name next to RESULTS.md) are recorded in
    results.json for the summary, and the plot is linked from the section. A new section goes
    at the end, or right after the file's header when `first`.
    """
    text = open(RESULTS).read() if os.path.exists(RESULTS) else _HEADER
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if plot:
        body = body.strip() + f"\n\n![{name}]({plot})\n"
    section = (
        f"<!-- begin {name} -->\n## {name}\n\n"
        f"- Command: `{command}`\n- Machine: {machine()}\n- Date: {date}\n\n{body.strip()}\n"
        f"<!-- end {name} -->\n"
    )
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->\n", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    elif first and text.startswith(_HEADER):
        text = _HEADER + "\n" + section + text[len(_HEADER):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(RESULTS, "w") as f:
        f.write(text)
    if figures is not None or plot is not None:
        recorded = read_figures()
        recorded[name] = {"command": command, "date": date, "figures": figures or [], "plot": plot}
        with open(FIGURES, "w") as f:
            json.dump(recorded, f, indent=1, sort_keys=True)
            f.write("\n")
