"""One timeline for a whole distributed job: every worker's profiler trace merged into one Chrome trace.

`tfdist.callbacks.ProfileSteps` (and `tfdist-train --profile_steps=START:STOP`)
runs TensorFlow's profiler on every worker for the same training steps. Each
worker writes its own trace, an XSpace protocol buffer, in the layout of
TensorBoard's profile plugin:

    <log_dir>/plugins/profile/<run>/worker-<i>.xplane.pb

`merge` turns the traces of one run into ONE file in Chrome's trace event
format (`{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`),
which ui.perfetto.dev and chrome://tracing open:

- one process (pid) per worker, named "worker <i> (<host>)", in worker order;
- in it, first a "steps" lane with one slice per profiled step ("step 10",
  from the step's start to its end on that worker), then one thread (tid) per
  device and thread the profiler recorded: the host's first, the thread that
  ran the steps (Python's) leading ("/host:CPU python",
  "/host:CPU tf_Compute/...", "/device:GPU:0 Stream #7", ...);
- times in microseconds from the earliest worker's profile start; each event is
  placed by its own host's wall clock (the start time its profiler recorded,
  plus the event's offset from it).

Clocks: workers on one host read the same clock, so their lanes line up as the
events happened. Across hosts the merge assumes the hosts' clocks agree (kept
in step by NTP or PTP); it does not correct them, and an error there shifts a
whole worker's lanes by that much. Under synchronous training a step overlaps
on every worker (each waits for the others' gradients), so when the same step
does not overlap on two workers the merge warns (`TimelineWarning`) that their
clocks differ by at least the gap.

The XSpace files are read with TensorFlow's own proto module
(`tensorflow.tsl.profiler.protobuf.xplane_pb2`, shipped with TensorFlow): no
other package is needed. They stay where they are, so TensorBoard's Profile tab
(`tensorboard --logdir <log_dir>` with the `tensorboard-plugin-profile`
package) shows the same run, one host per worker.

Example:

>>> import json, os, tempfile, warnings
>>> import keras, numpy as np, tfdist
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.compile(optimizer="sgd", loss="mse")
>>> log_dir = tempfile.mkdtemp()
>>> profile = tfdist.callbacks.ProfileSteps(steps=(2, 3), log_dir=log_dir, merge=False)
>>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[profile])
>>> sorted(os.listdir(profile.run_dir))
['worker-0.xplane.pb']
>>> path = tfdist.timeline.merge(log_dir, num_workers=1)
>>> trace = json.load(open(path))
>>> sorted(e["name"] for e in trace["traceEvents"] if e.get("cat") == "step")
['step 2', 'step 3']
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import time
import warnings

from tfdist import _validate
from tfdist import errors

__all__ = ["TimelineWarning", "merge"]

PROFILE_SUBDIR = os.path.join("plugins", "profile")
"""Where TensorBoard's profile plugin looks for runs under a log directory."""

TRACE_SUFFIX = ".xplane.pb"
"""The file name ending of a profiler trace (one XSpace)."""

MERGED_NAME = "timeline.json"
"""The merged trace's file name in the run directory (no profile plugin tool reads that name)."""

STEP_EVENT = "train"
"""The name of the profiler event that marks a step (`tf.profiler.experimental.Trace("train", step_num=N, _r=1)`)."""

_WORKER_FILE = re.compile(r"^worker-(?P<index>[0-9]+)" + re.escape(TRACE_SUFFIX) + "$")
_POLL_S = 0.2
# A stat of an event (what the profiler knows about it) becomes an arg of the trace event, except
# the profiler's own bookkeeping ("_r", "_c", "_ct", "_p", "_pt": root and flow ids).
_INTERNAL_STAT = "_"
_MAX_EXACT_JSON_INT = 2**53  # larger integers lose digits in JavaScript's numbers: they are written as strings


class TimelineWarning(UserWarning):
    """A worker's trace is missing from a merged timeline, or two workers' clocks disagree."""


def worker_file(index: int) -> str:
    """The file name of worker `index`'s trace in a run directory.

    Example:

    >>> worker_file(3)
    'worker-3.xplane.pb'
    """
    return f"worker-{index}{TRACE_SUFFIX}"


def error_file(index: int) -> str:
    """The file in which worker `index` says why it has no trace (its profiler failed, or it could not write one).

    Example:

    >>> error_file(3)
    'worker-3.error.txt'
    """
    return f"worker-{index}.error.txt"


def run_directory(log_dir: str, run: str) -> str:
    """The directory of profile run `run` under `log_dir` (TensorBoard's layout).

    Example:

    >>> run_directory("/logs", "2024_01_02_03_04_05")
    '/logs/plugins/profile/2024_01_02_03_04_05'
    """
    return os.path.join(log_dir, PROFILE_SUBDIR, run)


def run_name(unix_seconds: float) -> str:
    """A run's name from its start time, as TensorFlow's profiler names runs (they sort in time).

    Example:

    >>> import time
    >>> len(run_name(time.time()))
    19
    """
    return time.strftime("%Y_%m_%d_%H_%M_%S", time.localtime(unix_seconds))


def _xplane_pb2():
    import tensorflow as tf

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as e:
        raise errors.CompatError(
            "tfdist.timeline reads profiler traces with TensorFlow's proto module "
            f"tensorflow.tsl.profiler.protobuf.xplane_pb2, which TensorFlow {tf.__version__} does not have "
            "(tfdist is checked on TensorFlow 2.21)."
        ) from e
    return xplane_pb2


def _find_run_dir(log_dir: str, run: str | None) -> str:
    """The run directory to merge: `log_dir` itself when it holds traces, else `run` (default: the newest run)."""
    if run is None and os.path.isdir(log_dir) and any(n.endswith(TRACE_SUFFIX) for n in os.listdir(log_dir)):
        return log_dir
    profile_dir = os.path.join(log_dir, PROFILE_SUBDIR)
    if run is not None:
        return os.path.join(profile_dir, run)
    runs = sorted(n for n in os.listdir(profile_dir) if os.path.isdir(os.path.join(profile_dir, n))) if os.path.isdir(
        profile_dir
    ) else []
    if not runs:
        raise FileNotFoundError(
            f"No profile run under {log_dir!r}: expected traces (*{TRACE_SUFFIX}) in {log_dir!r} or in a run "
            f"directory {os.path.join(profile_dir, '<run>')!r}, as tfdist.callbacks.ProfileSteps and "
            "tf.profiler.experimental.start write them."
        )
    return os.path.join(profile_dir, runs[-1])


def _traces_in(run_dir: str) -> list[tuple[int | None, str]]:
    """The traces in a run directory: (worker index or None for another name, path), workers first, in order."""
    names = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
    found = []
    for name in names:
        if name.endswith(TRACE_SUFFIX):
            match = _WORKER_FILE.match(name)
            found.append((int(match.group("index")) if match else None, os.path.join(run_dir, name)))
    return sorted(found, key=lambda item: (item[0] is None, item[0] or 0, item[1]))


def wait_for_workers(run_dir: str, expected, timeout: float) -> dict[int, str]:
    """Waits up to `timeout` s until each `expected` worker wrote its trace or its error file in `run_dir`.

    Returns:
        Worker index -> why it has no trace, for each expected worker without one: the text of its error
        file, or that nothing appeared in time.
    """
    expected = list(expected)
    deadline = time.monotonic() + timeout
    while True:
        present = {index for index, _ in _traces_in(run_dir)}
        failed = {i for i in expected if i not in present and os.path.exists(os.path.join(run_dir, error_file(i)))}
        pending = [i for i in expected if i not in present and i not in failed]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
    why = {}
    for i in sorted(failed):
        try:
            with open(os.path.join(run_dir, error_file(i)), encoding="utf-8", errors="replace") as f:
                why[i] = f.read().strip() or "it captured no trace"
        except OSError as e:
            why[i] = f"it captured no trace ({e})"
    for i in pending:
        waited = f"within {timeout:g} s" if timeout else "(not waited for)"
        why[i] = f"its trace {os.path.join(run_dir, worker_file(i))!r} did not appear {waited}"
    return dict(sorted(why.items()))


def _warn_missing(why: dict[int, str]) -> None:
    if why:
        named = "; ".join(f"worker {i}: {reason}" for i, reason in why.items())
        warnings.warn(
            f"The merged timeline leaves out {len(why)} worker(s) without a trace ({named}). A worker that stopped, "
            "or could not write to the shared log directory, writes none; see its log.",
            TimelineWarning,
            stacklevel=3,
        )


@dataclasses.dataclass
class _Lane:
    name: str
    events: list  # (absolute start in ps, duration in ps, name, args)
    order: tuple = ()


@dataclasses.dataclass
class _WorkerTrace:
    label: str
    index: int | None
    path: str
    host: str
    start_ns: int
    stop_ns: int | None
    lanes: list
    steps: dict  # step number -> (absolute start in ps, duration in ps)


def _stat_value(stat, plane):
    kind = stat.WhichOneof("value")
    if kind is None or kind == "bytes_value":
        return None
    if kind == "ref_value":
        referenced = plane.stat_metadata.get(stat.ref_value)
        return referenced.name if referenced is not None else None
    value = getattr(stat, kind)
    if isinstance(value, int) and abs(value) >= _MAX_EXACT_JSON_INT:
        return str(value)
    return value


def _stats(stats, plane) -> dict:
    out = {}
    for stat in stats:
        meta = plane.stat_metadata.get(stat.metadata_id)
        if meta is None or not meta.name or meta.name.startswith(_INTERNAL_STAT):
            if meta is not None and meta.name == "_r":
                out["_r"] = True  # a root event (a step marker): kept to find steps, not written
            continue
        value = _stat_value(stat, plane)
        if value is not None:
            out[meta.name] = value
    return out


def _profile_window(space, path: str) -> tuple[int, int | None]:
    """The profile's start and stop (Unix ns) that the profiler records in its "Task Environment" plane."""
    times = {}
    for plane in space.planes:
        for stat in plane.stats:
            meta = plane.stat_metadata.get(stat.metadata_id)
            if meta is not None and meta.name in ("profile_start_time", "profile_stop_time"):
                times[meta.name] = int(getattr(stat, stat.WhichOneof("value") or "uint64_value"))
    if not times.get("profile_start_time"):
        raise ValueError(
            f"Profiler trace {path!r} records no profile start time (the profile_start_time stat of its "
            "'Task Environment' plane), so its events cannot be placed in time. Expected a trace written by "
            "TensorFlow's profiler (tf.profiler.experimental.start/stop, TensorFlow 2.21)."
        )
    return times["profile_start_time"], times.get("profile_stop_time")


def _line_order(plane_name: str, line_name: str, marks_steps: bool) -> tuple:
    """Host planes first; in a plane, the thread that marks the steps (Python's main thread) first, then by name."""
    return (not plane_name.startswith("/host:"), plane_name, not marks_steps, line_name)


def _read_trace(index: int | None, path: str) -> _WorkerTrace:
    """One worker's trace: its lanes and step markers, every time in absolute picoseconds since the Unix epoch."""
    from google.protobuf import message

    space = _xplane_pb2().XSpace()
    try:
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    except (OSError, message.DecodeError) as e:
        raise ValueError(f"Cannot read profiler trace {path!r}: {e}. Expected an XSpace written by TensorFlow's "
                         "profiler; the file may be truncated (its worker stopped while writing it).") from e
    start_ns, stop_ns = _profile_window(space, path)
    lanes, steps = [], {}
    for plane in space.planes:
        metadata_args = {}
        for line in plane.lines:
            if not line.events:
                continue
            # The profiler stores each line's start relative to the profile's start; an absolute one is kept.
            line_ns = line.timestamp_ns if line.timestamp_ns >= start_ns else start_ns + line.timestamp_ns
            line_name = line.display_name or line.name or str(line.id)
            events, marks_steps = [], False
            for event in line.events:
                if event.WhichOneof("data") != "offset_ps":
                    continue  # an aggregate (num_occurrences): no time of its own
                meta = plane.event_metadata.get(event.metadata_id)
                name, args = (meta.display_name or meta.name, {}) if meta is not None else (str(event.metadata_id), {})
                if meta is not None:
                    if meta.display_name and meta.name != meta.display_name:
                        args["long_name"] = meta.name
                    if event.metadata_id not in metadata_args:
                        metadata_args[event.metadata_id] = _stats(meta.stats, plane)
                    args.update(metadata_args[event.metadata_id])
                args.update(_stats(event.stats, plane))
                begin = line_ns * 1000 + event.offset_ps
                root = args.pop("_r", False)
                if root and meta is not None and meta.name == STEP_EVENT and isinstance(args.get("step_num"), int):
                    steps[args["step_num"]] = (begin, event.duration_ps)
                    marks_steps = True
                events.append((begin, event.duration_ps, name, args))
            order = _line_order(plane.name, line_name, marks_steps)
            lanes.append(_Lane(f"{plane.name} {line_name}".strip(), events, order))
    lanes.sort(key=lambda lane: lane.order)
    host = space.hostnames[0] if space.hostnames else ""
    label = f"worker {index}" if index is not None else os.path.basename(path)[: -len(TRACE_SUFFIX)]
    return _WorkerTrace(label, index, path, host, start_ns, stop_ns, lanes, steps)


def _check_clocks(traces: list[_WorkerTrace]) -> None:
    """Warns when a step does not overlap on two workers: under synchronous training their clocks then disagree."""
    first = traces[0]
    for other in traces[1:]:
        gaps = {}
        for step in sorted(set(first.steps) & set(other.steps)):
            (a, a_dur), (b, b_dur) = first.steps[step], other.steps[step]
            gap = max(a, b) - min(a + a_dur, b + b_dur)
            if gap > 0:
                gaps[step] = gap
        if gaps:
            hosts = f"hosts {first.host!r} and {other.host!r}" if first.host != other.host else f"host {first.host!r}"
            warnings.warn(
                f"Step(s) {sorted(gaps)} do not overlap on {first.label} and {other.label} ({hosts}): under "
                "synchronous training every worker is inside the same step at once, so their clocks differ by at "
                f"least {min(gaps.values()) / 1e9:.3f} ms in the merged timeline. Synchronize the hosts' clocks "
                "(NTP, PTP) to line their lanes up.",
                TimelineWarning,
                stacklevel=3,
            )


def _micros(ps: int) -> float:
    return ps / 1e6


def _chrome_trace(traces: list[_WorkerTrace], run_dir: str) -> dict:
    origin_ns = min(t.start_ns for t in traces)
    origin_ps = origin_ns * 1000
    meta_events, events, workers = [], [], []
    for order, trace in enumerate(traces):
        pid = order + 1
        name = f"{trace.label} ({trace.host})" if trace.host else trace.label
        if trace.index == 0:
            name += " chief"
        meta_events += [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": order}},
        ]
        lanes = [_Lane("steps", [(b, d, f"step {s}", {"step": s}) for s, (b, d) in sorted(trace.steps.items())])]
        for tid, lane in enumerate([*lanes, *trace.lanes], start=1):
            meta_events += [
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane.name}},
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}},
            ]
            step_lane = tid == 1
            for begin, duration, event_name, args in sorted(lane.events, key=lambda e: (e[0], -e[1])):
                event = {"ph": "X", "pid": pid, "tid": tid, "name": event_name,
                         "ts": _micros(begin - origin_ps), "dur": _micros(duration)}
                if step_lane:
                    event["cat"] = "step"
                if args:
                    event["args"] = args
                events.append(event)
        workers.append({
            "pid": pid,
            "worker": trace.index,
            "name": trace.label,
            "host": trace.host,
            "file": trace.path,
            "profile_start_unix_ns": trace.start_ns,
            "profile_stop_unix_ns": trace.stop_ns,
            "steps": sorted(trace.steps),
        })
    other = {
        "run_dir": run_dir,
        "origin_unix_ns": origin_ns,
        "time": "ts and dur in microseconds; ts from origin_unix_ns, the earliest profile start; each worker's "
        "events placed by its host's wall clock (hosts' clocks assumed synchronized)",
        "workers": workers,
    }
    return {"displayTimeUnit": "ns", "traceEvents": meta_events + events, "otherData": {"tfdist_timeline": other}}


def _write(trace: dict, output: str) -> None:
    from tfdist.callbacks import _files

    data = json.dumps(trace, separators=(",", ":")).encode()
    with _files._atomic_file(output) as f:
        if output.endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
                z.write(data)
        else:
            f.write(data)


def merge(log_dir, *, run: str | None = None, output=None, num_workers: int | None = None,
          timeout: float = 0.0) -> str:
    """Merges the workers' profiler traces of one run into one Chrome trace file; returns the file's path.

    See the module docstring for what the file holds and how times are aligned.

    Args:
        log_dir: the `log_dir` the traces were captured into (runs under
            `<log_dir>/plugins/profile/`), or a run directory itself.
        run: the run's name (its directory under `plugins/profile`);
            default: the newest run (runs are named by their start time).
        output: the file to write; default `<run directory>/timeline.json`.
            A name ending in ".gz" is gzip-compressed (Perfetto and
            chrome://tracing open both).
        num_workers: how many workers took part: the traces of workers 0 to
            `num_workers` - 1 are waited for (up to `timeout`), and each one
            still missing is named in a `TimelineWarning` and left out.
            Default: merge the traces that are there.
        timeout: how long to wait for missing workers' traces, in seconds
            (0: not at all).

    Returns:
        The path of the merged trace.

    Raises:
        FileNotFoundError: when there is no trace to merge, naming where it
            looked.
        ValueError: for a trace that does not parse, naming the file; for a
            bad argument.

    Example:

    >>> import tempfile
    >>> merge(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    FileNotFoundError: No profile run under '...': expected traces (*.xplane.pb) in '...' or in a run directory ...
    """
    if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
        raise _validate.invalid("log_dir", log_dir, "a directory path")
    if run is not None and (not isinstance(run, str) or not run or os.sep in run):
        raise _validate.invalid("run", run, "the name of a run directory under <log_dir>/plugins/profile, or None")
    if output is not None and (not isinstance(output, (str, os.PathLike)) or not os.fspath(output)):
        raise _validate.invalid("output", output, "a file path or None")
    _validate.integer("num_workers", num_workers, allow_none=True)
    if not _validate.is_number(timeout) or not 0 <= timeout <= _validate.MAX_SECONDS:
        raise _validate.invalid("timeout", timeout, f"a number of seconds from 0 to {_validate.MAX_SECONDS:g}")
    run_dir = _find_run_dir(os.fspath(log_dir), run)
    return merge_run(run_dir, expected=range(num_workers or 0), timeout=float(timeout), output=output)


def merge_run(run_dir: str, *, expected, timeout: float, output=None) -> str:
    """`merge` of one run directory, waiting up to `timeout` s for the traces of the `expected` worker indices."""
    _warn_missing(wait_for_workers(run_dir, expected, timeout))
    found = _traces_in(run_dir)
    if not found:
        raise FileNotFoundError(
            f"No trace (*{TRACE_SUFFIX}) in the profile run directory {run_dir!r}"
            + (f" after waiting {timeout:g} s" if timeout else "")
            + ": expected one file per worker, worker-<i>.xplane.pb, as tfdist.callbacks.ProfileSteps writes them."
        )
    traces = [_read_trace(index, path) for index, path in found]
    _check_clocks(traces)
    output = os.fspath(output) if output is not None else os.path.join(run_dir, MERGED_NAME)
    _write(_chrome_trace(traces, run_dir), output)
    return output
