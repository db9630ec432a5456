"""Writes a benchmark's section of benchmarks/RESULTS.md (replacing that section's previous run)."""

from __future__ import annotations

import datetime
import os
import platform
import re

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
_HEADER = (
    "# Benchmark results\n\nEach section is written by the script it names; "
    "rerun the command to update it.\n"
)


def machine() -> str:
    """CPU model, cores, GPUs and TF/Keras versions, in one line."""
    import keras
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpus = tf.config.list_physical_devices("GPU")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, GPUs: {len(gpus) or 'none'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, Python {platform.python_version()}; "
        f"load average when written (1/5/15 min): {load}"
    )


def write_section(name: str, command: str, body: str) -> None:
    """Replaces (or appends) the section `name` of RESULTS.md."""
    text = open(RESULTS).read() if os.path.exists(RESULTS) else _HEADER
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"<!-- begin {name} -->\n## {name}\n\n"
        f"- Command: `{command}`\n- Machine: {machine()}\n- Date: {date}\n\n{body.strip()}\n"
        f"<!-- end {name} -->\n"
    )
    pattern = re.compile(rf"<!-- begin {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->\n", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(RESULTS, "w") as f:
        f.write(text)
