"""The flight recorder: each worker's last steps and collectives, and one summary when the job fails or hangs.

Every process of a multi-worker job (`tfdist.MultiWorkerStrategy`, or a
`tfdist.ModelParallelStrategy` across processes) records what it does in a
small ring buffer: each call of a Keras train/test/predict function (phase
"step", numbered per kind), each other distributed call: an eagerly called
traced function with collectives, an eager all-reduce such as Keras' metric
results at an epoch's end ("collective"), tfdist's checkpoint saves
("checkpoint"), the strategy's start-up join ("barrier"), and any phase a
program marks itself with `phase()` (e.g. "input" for host-side batch
preparation in a custom loop: Keras' own input pipeline runs inside its
step). A record costs a few microseconds: two clock reads, a ring-buffer
append, and a 256-byte copy of the worker's status into a shared memory map
of its status file.

The status files are how peers learn each other's progress without a
collective, which a stopped peer could not answer: when the job has a run
directory (`tfdist-launch` makes one and passes it as `TFDIST_RUN_DIR`, read
by `tfdist.cluster.run_dir`), worker i keeps its latest record, its last
completed step and a heartbeat (rewritten every 0.25 s by a small thread) in
`<run_dir>/worker-i.status`. Workers run the same distributed calls in the
same order (otherwise their collectives would never meet), so the records'
sequence numbers say who is behind.

When a distributed call fails (a dead or stopped peer: TensorFlow's
`UnavailableError` and kin), a step outlives the strategy's `timeout`, or
`tfdist-launch` stops the job after another worker failed, each surviving
worker prints one summary to stderr: its last completed step, what it waits
in and for how long, which peers are missing (index and address) and what
each last reported. A peer is missing when its heartbeat is stale or (on
the same host) its process is stopped or gone, or, when no peer is, when it
is behind this worker; without a run directory, when TensorFlow's error
names it. The whole ring
buffer is written next to the status file (`worker-i.flight.txt`).

Example (one process standing for worker 0 of two; no peer has written a status):

>>> import io, tempfile
>>> out, run_dir = io.StringIO(), tempfile.TemporaryDirectory()
>>> recorder = FlightRecorder(worker=0, addresses=["127.0.0.1:2222", "127.0.0.1:2223"],
...                           run_dir=run_dir.name, stream=out)
>>> for _ in range(3):
...     with recorder.keras_step("train"):
...         pass
>>> [r.label for r in recorder.records()]
['train step 1', 'train step 2', 'train step 3']
>>> with recorder.phase("checkpoint", "step 3"):
...     recorder.report("a test")
True
>>> print(out.getvalue())  # doctest: +ELLIPSIS
tfdist flight recorder: worker 0 (127.0.0.1:2222): a test
  last completed: train step 3 (... ms), ended ... ago
  waiting in: checkpoint step 3, for ...
  missing: worker 1 (127.0.0.1:2223): no status yet (it has not started its strategy, or cannot write ...)
  recent: train step 1 ... | train step 2 ... | train step 3 ... | checkpoint step 3 ...
<BLANKLINE>
>>> read_status(status_path(run_dir.name, 0)).reported
True
>>> recorder.close(); run_dir.cleanup()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import os
import re
import socket
import struct
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from collections.abc import Sequence

from tfdist import _validate
from tfdist import cluster as cluster_lib

PHASES = ("input", "step", "collective", "checkpoint", "barrier")
"""What a record can be: host input, a Keras step, another distributed call, a checkpoint save, a barrier."""
KERAS_STEPS = ("train", "test", "predict")
STATE_OPEN, STATE_DONE, STATE_FAILED = "open", "done", "failed"
DEFAULT_CAPACITY = 64
STATUS_INTERVAL = 0.25
"""Seconds between two heartbeats of a worker's status file (and two looks for the launcher's stop request)."""
STALE_AFTER = 2.0
"""A peer whose status heartbeat is older than this many seconds counts as not responding."""
STOP_FILE = "stop"
"""Written into the run directory by `tfdist-launch` when it stops the job; holds the reason."""
SUMMARY_HEAD = "tfdist flight recorder: "
_MAX_MISSING_LINES = 4
_RECENT = 4
# TensorFlow errors of a distributed call that a lost, stopped or stuck peer causes.
_DISTRIBUTED_ERRORS = frozenset(
    {"UnavailableError", "AbortedError", "DeadlineExceededError", "CancelledError", "InternalError"}
)
_PF_EXITING = 0x4
_TASK = re.compile(r"/job:(chief|worker)/(?:replica:\d+/)?task:(\d+)")
_FUNCTION_NAME = re.compile(r"^(?:__inference_|__forward_|__backward_)?(.*?)(?:_\d+)?$")


def status_path(run_dir: str, worker: int) -> str:
    """The status file of `worker` in `run_dir`.

    Example:

    >>> status_path("/run", 2)
    '/run/worker-2.status'
    """
    return os.path.join(run_dir, f"worker-{worker}.status")


def ring_path(run_dir: str, worker: int) -> str:
    """Where `worker` writes its whole ring buffer when it reports."""
    return os.path.join(run_dir, f"worker-{worker}.flight.txt")


class Record:
    """One entry of the ring buffer: a phase this worker was (or still is) in.

    Attributes:
        seq: its position in this process' sequence of records (1, 2, ...).
        phase: one of `PHASES`.
        name: the Keras step's kind ("train"), the function's or the phase's own name, or "".
        step: the step's number within its kind (1, 2, ...), or None.
        start, end: wall-clock times (`time.time()`); `end` is None while it runs.
        state: "open", "done" or "failed".

    Example:

    >>> Record(3, "step", "train", 12, start=100.0).describe(now=100.5)
    'train step 12 (open for 500.0 ms)'
    """

    __slots__ = ("end", "name", "phase", "seq", "start", "state", "step")

    def __init__(self, seq: int, phase: str, name: str, step: int | None, start: float):
        self.seq, self.phase, self.name, self.step, self.start = seq, phase, name, step, start
        self.end: float | None = None
        self.state = STATE_OPEN

    @property
    def label(self) -> str:
        """What it is, in words: "train step 12", "checkpoint step 50", "collective train_step"."""
        return _label(self.phase, self.name, self.step)

    def describe(self, now: float) -> str:
        """The label with its duration, or how long it has been open: "train step 12 (3.1 ms)"."""
        if self.end is None:
            return f"{self.label} (open for {_seconds(now - self.start)})"
        return f"{self.label} ({_seconds(self.end - self.start)}{', failed' if self.state == STATE_FAILED else ''})"

    def __repr__(self):
        return f"Record({self.seq}, {self.label!r}, {self.state})"


def _label(phase: str, name: str, step: int | None) -> str:
    if phase == "step" and step is not None:
        return f"{name} step {step}"
    return " ".join(p for p in (phase, name) if p)


def _seconds(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


# ------------------------------------------------------------------ status files
# magic, write count, pid, worker, written at, seq, phase, state, reported, name, step, start, end,
# last step's kind, number and end, host, write count again (a reader that sees two counts differ read a
# write half done, and reads again).
_STATUS = struct.Struct("<4sIIId Q BBB 32s q dd 8s qd 64s I")
_MAGIC = b"TFFR"
_NO_PHASE = 255
_STATES = (STATE_OPEN, STATE_DONE, STATE_FAILED)
_STATE_CODES = {s: i for i, s in enumerate(_STATES)}
_PHASE_CODES = {p: i for i, p in enumerate(PHASES)}


@dataclasses.dataclass(frozen=True)
class Status:
    """What a worker's status file says: its latest record, its last completed step, its heartbeat.

    Attributes:
        worker: the worker's index in the cluster.
        pid, host: its process and host name.
        written: when it last wrote the file (its heartbeat), wall-clock seconds.
        seq: how many records it began (in step with every other worker's).
        phase, name, step, start, end, state: its record in progress (the
            innermost open one), else the one that ended last; `phase` is None
            before the first record.
        last_step: (kind, number, end time) of its last completed Keras step, or None.
        reported: whether it printed its failure summary.
    """

    worker: int
    pid: int
    host: str
    written: float
    seq: int = 0
    phase: str | None = None
    name: str = ""
    step: int | None = None
    start: float = 0.0
    end: float | None = None
    state: str = STATE_DONE
    last_step: tuple[str, int, float] | None = None
    reported: bool = False

    @property
    def label(self) -> str:
        """The latest record in words, e.g. "train step 12"; "nothing yet" before the first."""
        return "nothing yet" if self.phase is None else _label(self.phase, self.name, self.step)

    def describe(self, now: float) -> str:
        """The latest record, its state and age, and the last completed step when that is another record.

        Example:

        >>> Status(worker=1, pid=1, host="h", written=0, seq=9, phase="step", name="train", step=12,
        ...        start=90.0, state="open", last_step=("train", 11, 89.5)).describe(now=100.0)
        'train step 12 (began 10.0 s ago, not finished)'
        """
        if self.phase is None:
            return "nothing yet"
        if self.state == STATE_OPEN:
            text = f"{self.label} (began {_seconds(now - self.start)} ago, not finished)"
        else:
            text = f"{self.label} ({self.state} {_seconds(now - (self.end or self.start))} ago)"
        if self.last_step is not None and self.phase != "step":
            kind, number, _ = self.last_step
            text += f", after {kind} step {number}"
        return text


def _encode(text: str, size: int) -> bytes:
    return text.encode("utf-8", "replace")[:size]


def _decode(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _unpack(raw: bytes) -> Status | None:
    """The status in `raw` (a status file's bytes); None when it is not one, or a write was half done."""
    if len(raw) < _STATUS.size:
        return None
    (magic, count, pid, worker, written, seq, phase, state, reported, name, step, start, end, kind,
     number, step_end, host, count_again) = _STATUS.unpack(raw[: _STATUS.size])  # fmt: skip
    if magic != _MAGIC or count != count_again:
        return None
    return Status(
        worker=worker,
        pid=pid,
        host=_decode(host),
        written=written,
        seq=seq,
        phase=None if phase == _NO_PHASE else PHASES[phase],
        name=_decode(name),
        step=None if step < 0 else step,
        start=start,
        end=None if state == 0 else end,
        state=_STATES[state],
        last_step=None if number < 0 else (_decode(kind), number, step_end),
        reported=bool(reported),
    )


def read_status(path: str) -> Status | None:
    """The status in the file at `path`, or None when it is missing or unreadable.

    A read that meets a write half done (the two write counts of the record
    differ) is tried again.

    Example:

    >>> read_status("/nonexistent/worker-0.status") is None
    True
    """
    for _ in range(5):
        try:
            with open(path, "rb") as f:
                raw = f.read(_STATUS.size)
        except OSError:
            return None
        status = _unpack(raw)
        if status is not None or len(raw) < _STATUS.size or raw[:4] != _MAGIC:
            return status
        time.sleep(0.001)
    return None


def process_state(pid: int) -> str:
    """"running", "stopped" (by a signal or a tracer) or "gone" (ended, or a zombie), from /proc.

    Example:

    >>> process_state(os.getpid())
    'running'
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return "gone"
    # Exiting (PF_EXITING): a killed process closes its sockets, which its peers see at once, before it is a zombie.
    if state in ("Z", "X", "x") or flags & _PF_EXITING:
        return "gone"
    return "stopped" if state in ("T", "t") else "running"


# ------------------------------------------------------------------ the recorder
class _Span:
    """The context manager of one record."""

    __slots__ = ("_args", "_record", "_recorder")

    def __init__(self, recorder, *args):
        self._recorder, self._args = recorder, args

    def __enter__(self):
        self._record = self._recorder._begin(*self._args)
        return self._record

    def __exit__(self, kind, error, traceback):
        self._recorder._end(self._record, error)
        return False


class FlightRecorder:
    """One worker's ring buffer of its last phases, its status file, and its failure summary.

    The strategies make one per process of a multi-worker job (see the
    module docstring); the hooks find it with `current()`. A recorder made by
    hand records only what it is told.

    Args:
        worker: this worker's index in `addresses`.
        addresses: every worker's address ('host:port'), by index.
        run_dir: the job's run directory shared by the workers, or None (no
            status file: peers' progress is unknown).
        capacity: how many records the ring buffer keeps.
        stream: where the summary goes; defaults to `sys.stderr`.

    Raises:
        ValueError: for a `worker` that is not an index of `addresses`, a
            `capacity` below 1, or a `run_dir` that is not a directory.

    Example:

    >>> recorder = FlightRecorder(worker=0, addresses=["a:1", "b:1"], capacity=2)
    >>> for _ in range(3):
    ...     with recorder.keras_step("train"):
    ...         pass
    >>> recorder.records()
    [Record(2, 'train step 2', done), Record(3, 'train step 3', done)]
    >>> recorder.close()
    """

    def __init__(
        self,
        *,
        worker: int,
        addresses: Sequence[str],
        run_dir: str | None = None,
        capacity: int = DEFAULT_CAPACITY,
        stream=None,
    ):
        if isinstance(addresses, str) or not isinstance(addresses, Sequence) or not addresses:
            raise _validate.invalid("addresses", addresses, "a non-empty list of 'host:port' worker addresses")
        self.addresses = tuple(addresses)
        self.worker = _validate.integer("worker", worker, minimum=0, maximum=len(self.addresses) - 1)
        self.capacity = _validate.integer("capacity", capacity)
        if run_dir is not None and not os.path.isdir(run_dir):
            raise _validate.invalid("run_dir", run_dir, "an existing directory every worker can write, or None")
        self.run_dir = run_dir
        self._stream = stream
        self._ring: collections.deque[Record] = collections.deque(maxlen=self.capacity)
        self._open: list[Record] = []
        self._seq = 0
        self._counts = dict.fromkeys(KERAS_STEPS, 0)
        self._last_step: Record | None = None
        self._latest: Record | None = None  # what the status shows when no record is open: the one that ended last
        self._lock = threading.Lock()
        self._writes = 0
        self._reported = False
        self._report_lock = threading.Lock()
        self._pid, self._host = os.getpid(), socket.gethostname()
        self._host_bytes = _encode(self._host, 64)
        self._names: dict = {}
        self._encoded: dict = {}
        self._map = None
        self._closed = threading.Event()
        self._thread = None
        if run_dir is not None:
            # The status lives in a shared memory map of its file: a write is a memory copy, no system call,
            # and readers see it at once through the page cache. Its block is written first (a write to
            # an unallocated page of a full file system would be a SIGBUS).
            path = status_path(run_dir, self.worker)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    with self._lock:
                        os.write(fd, self._pack_locked())
                        self._map = mmap.mmap(fd, _STATUS.size)
                finally:
                    os.close(fd)
            except OSError as e:  # training goes on; only the peers' view of this worker is lost
                warnings.warn(
                    f"tfdist flight recorder: {self.who} cannot keep its status in {path} ({e.strerror}); the "
                    "other workers will not see its progress.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self._map is not None:
            self._thread = threading.Thread(target=self._heartbeat, name="tfdist-flight-recorder", daemon=True)
            self._thread.start()

    @property
    def who(self) -> str:
        """This worker, in words: "worker 0 (127.0.0.1:2222)"."""
        return f"worker {self.worker} ({self.addresses[self.worker]})"

    # ------------------------------------------------------------------ recording
    def phase(self, phase: str, name: str = "", *, step: int | None = None):
        """A context manager recording one phase (one of `PHASES`) while its body runs.

        Raises:
            ValueError: for a phase not in `PHASES`.
        """
        _validate.one_of("phase", phase, PHASES)
        return _Span(self, phase, name, step)

    def keras_step(self, kind: str):
        """A context manager recording one call of a Keras train/test/predict function (numbered per kind)."""
        return _Span(self, "step", kind, None)

    def collective(self, name) -> contextlib.AbstractContextManager:
        """A context manager recording one distributed call of the traced function `name` (str or bytes).

        Inside a step or another distributed call it records nothing: that
        record already covers it.
        """
        if self._open and self._open[-1].phase in ("step", "collective"):
            return contextlib.nullcontext()
        short = self._names.get(name)
        if short is None:
            text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            short = self._names[name] = _FUNCTION_NAME.match(text).group(1)
        return _Span(self, "collective", short, None)

    def _begin(self, phase: str, name: str, step: int | None) -> Record:
        with self._lock:
            if phase == "step" and step is None:
                step = self._counts[name] = self._counts.get(name, 0) + 1
            self._seq += 1
            record = Record(self._seq, phase, name, step, time.time())
            self._ring.append(record)
            self._open.append(record)
            self._latest = record
            self._write_locked()
        return record

    def _end(self, record: Record, error) -> None:
        if error is not None and type(error).__name__ in _DISTRIBUTED_ERRORS and self._open[-1:] == [record]:
            self.report(f"a distributed call failed: {type(error).__name__}: {error_line(error)}", error=error)
        with self._lock:
            record.end = time.time()
            record.state = STATE_DONE if error is None else STATE_FAILED
            if self._open and self._open[-1] is record:
                self._open.pop()
            elif record in self._open:
                self._open.remove(record)
            if record.phase == "step" and error is None:
                self._last_step = record
            self._latest = record
            self._write_locked()

    def records(self) -> list[Record]:
        """The ring buffer, oldest first (open records included)."""
        return list(self._ring)

    # ------------------------------------------------------------------ status
    def status(self) -> Status:
        """This worker's status, as its status file holds it."""
        with self._lock:
            return _unpack(self._pack_locked())

    def _pack_locked(self) -> bytes:
        """The status record: the innermost open record, else the one that ended last; its last completed step."""
        latest = self._open[-1] if self._open else self._latest
        last = self._last_step
        self._writes = count = (self._writes + 1) & 0xFFFFFFFF
        if latest is None:
            phase, state, name, step, start, end = _NO_PHASE, _STATE_CODES[STATE_DONE], b"", -1, 0.0, 0.0
        else:
            name = self._encoded.get(latest.name)
            if name is None:
                name = self._encoded[latest.name] = _encode(latest.name, 32)
            phase, state = _PHASE_CODES[latest.phase], _STATE_CODES[latest.state]
            step, start, end = -1 if latest.step is None else latest.step, latest.start, latest.end or 0.0
        return _STATUS.pack(
            _MAGIC, count, self._pid, self.worker, time.time(), self._seq, phase, state, self._reported, name, step,
            start, end, self._encoded_kind(last.name) if last else b"", last.step if last else -1,
            last.end if last else 0.0,
            self._host_bytes, count,
        )

    def _encoded_kind(self, kind: str) -> bytes:
        key = ("kind", kind)
        encoded = self._encoded.get(key)
        if encoded is None:
            encoded = self._encoded[key] = _encode(kind, 8)
        return encoded

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._map is not None:
            self._map[:] = self._pack_locked()

    def _heartbeat(self) -> None:
        stop = os.path.join(self.run_dir, STOP_FILE)
        while not self._closed.wait(STATUS_INTERVAL):
            self._write()
            if not self._reported and os.path.exists(stop):
                try:
                    with open(stop) as f:
                        why = f.read().strip()
                except OSError:
                    why = ""
                self.report(f"tfdist-launch is stopping the job{': ' + why if why else ''}")

    def peers(self) -> dict[int, Status | None]:
        """Every other worker's status (None: no readable status file, or no run directory)."""
        return {
            i: read_status(status_path(self.run_dir, i)) if self.run_dir else None
            for i in range(len(self.addresses))
            if i != self.worker
        }

    # ------------------------------------------------------------------ the summary
    def summary(self, reason: str, *, error=None) -> str:
        """The failure summary: this worker's last step, what it waits in, the missing peers and theirs.

        `error`: the TensorFlow error, whose message may name the lost peers.
        """
        now = time.time()
        named = workers_named(getattr(error, "message", "") or "", len(self.addresses))
        states = {}
        peers = self.peers()
        for i, peer in peers.items():
            if peer is not None and peer.host == self._host:
                states[i] = process_state(peer.pid)
        return format_summary(
            who=self.who,
            reason=reason,
            records=self.records(),
            open_records=list(self._open),
            last_step=self._last_step,
            addresses=self.addresses,
            peers=peers,
            states=states,
            named=named,
            has_run_dir=self.run_dir is not None,
            now=now,
        )

    def report(self, reason: str, *, error=None) -> bool:
        """Prints the summary once per process (later calls do nothing); True when this call printed it."""
        with self._report_lock:
            if self._reported:
                return False
            text = self.summary(reason, error=error)
            stream = self._stream if self._stream is not None else sys.stderr
            with contextlib.suppress(OSError, ValueError):
                stream.write(text)
                stream.flush()
            self._reported = True
        if self.run_dir is not None:
            now = time.time()
            with contextlib.suppress(OSError):
                with open(ring_path(self.run_dir, self.worker), "w") as f:
                    f.write(text + "".join(f"{r.seq} {r.describe(now)} at {r.start:.3f}\n" for r in self.records()))
        self._write()
        return True

    def close(self) -> None:
        """Stops the heartbeat thread and closes the status file (it stays on disk)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None


def error_line(error) -> str:
    """The informative part of a TensorFlow error's message, on one line (at most 200 characters).

    Example:

    >>> class E(Exception):
    ...     message = "Graph execution error:\\n\\nCollective ops is aborted by: Socket closed\\nmore"
    >>> error_line(E())
    'Socket closed'
    """
    message = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "aborted by: " in line:
            text = line.rsplit("aborted by: ", 1)[1]
            break
    else:
        skip = ("Graph execution error", "Detected at node", "File ")
        text = next((line for line in lines if not line.startswith(skip)), lines[0] if lines else "")
    return text if len(text) <= 200 else text[:197] + "..."


def workers_named(message: str, num_workers: int) -> list[int]:
    """The worker indices that TensorFlow task names in `message` refer to (a chief counts as worker 0).

    Example:

    >>> workers_named("remote target /job:worker/replica:0/task:1 while calling", 3)
    [1]
    >>> workers_named("Error reported from /job:worker/task:2: The following tasks are unhealthy", 3)
    [2]
    """
    has_chief = "/job:chief/" in message
    found = set()
    for job, task in _TASK.findall(message):
        index = 0 if job == "chief" else int(task) + has_chief
        if index < num_workers:
            found.add(index)
    return sorted(found)


def format_summary(
    *,
    who: str,
    reason: str,
    records: Sequence[Record],
    open_records: Sequence[Record],
    last_step: Record | None,
    addresses: Sequence[str],
    peers: Mapping[int, Status | None],
    states: Mapping[int, str],
    named: Sequence[int],
    has_run_dir: bool,
    now: float,
) -> str:
    """The summary text (see `FlightRecorder.summary`), from what the recorder knows; a few lines.

    A peer is missing when its heartbeat is older than `STALE_AFTER`, its
    process (`states`, same host only) is stopped or gone, or, with no
    status for it, TensorFlow's error names it; when no peer is, a peer
    behind this worker (an earlier record, or the same one still open after
    this worker finished it) is. When one is, the peers only behind are
    listed apart ("also behind": alive, failing after it).

    Example:

    >>> mine = Record(8, "step", "train", 4, 95.0)
    >>> peer = Status(worker=1, pid=9, host="h", written=94.0, seq=7, phase="step", name="train", step=3,
    ...               start=94.0, end=94.1, state="done", last_step=("train", 3, 94.1))
    >>> print(format_summary(who="worker 0 (a:1)", reason="a test", records=[mine], open_records=[mine],
    ...                      last_step=None, addresses=["a:1", "b:1"], peers={1: peer}, states={1: "stopped"},
    ...                      named=[], has_run_dir=True, now=100.0))
    tfdist flight recorder: worker 0 (a:1): a test
      last completed: no step yet
      waiting in: train step 4, for 5.0 s
      missing: worker 1 (b:1): last reported train step 3 (done 5.9 s ago); no heartbeat for 6.0 s; process stopped
      recent: train step 4 (open for 5.0 s)
    <BLANKLINE>
    """
    lines = [f"{SUMMARY_HEAD}{who}: {reason}"]
    if last_step is None:
        lines.append("  last completed: no step yet")
    else:
        lines.append(
            f"  last completed: {last_step.label} ({_seconds(last_step.end - last_step.start)}), "
            f"ended {_seconds(now - last_step.end)} ago"
        )
    current = open_records[-1] if open_records else None
    if current is not None:
        outer = f" (inside {open_records[0].label})" if len(open_records) > 1 else ""
        lines.append(f"  waiting in: {current.label}{outer}, for {_seconds(now - current.start)}")
    else:
        ended = max((r for r in records if r.end is not None), key=lambda r: r.end, default=None)
        since = f" since {ended.label} ended {_seconds(now - ended.end)} ago" if ended else ""
        lines.append(f"  waiting in: no distributed call (in the program's own code){since}")
    # Progress, comparable between workers: how many records each began, and whether one is still open.
    mine_seq, mine_open = (records[-1].seq if records else 0), current is not None
    missing, lagging = [], []
    for i in sorted(peers):
        peer, state = peers[i], states.get(i)
        where = f"worker {i} ({addresses[i]})"
        if peer is None:
            if i in named or (has_run_dir and current is not None):
                why = "named in TensorFlow's error" if i in named else "no status yet"
                detail = (
                    " (it has not started its strategy, or cannot write the run directory)"
                    if has_run_dir
                    else " (no run directory: peers' progress is unknown; tfdist-launch gives one, elsewhere set "
                    "TFDIST_RUN_DIR to a directory every worker can write)"
                )
                missing.append(f"{where}: {why}{detail}")
            continue
        problems = []
        age = now - peer.written
        if age > STALE_AFTER:
            problems.append(f"no heartbeat for {_seconds(age)}")
        if state in ("stopped", "gone"):
            problems.append(f"process {state}")
        behind = peer.seq < mine_seq or (peer.seq == mine_seq and not mine_open and peer.state == STATE_OPEN)
        if peer.state == STATE_FAILED or peer.reported:
            continue  # it failed too, and says so itself
        if problems:
            missing.append(f"{where}: last reported {peer.describe(now)}" + "".join(f"; {p}" for p in problems))
        elif behind:
            lagging.append(f"{where}: last reported {peer.describe(now)}")
    # A peer only behind, alive and heartbeating, is sync training's skew (it has not yet written the end of
    # the step this worker finished, and is failing with this worker) when another peer is gone, stopped or
    # silent: that one is missing, the others are said apart. With no such peer, being behind is the
    # evidence (a peer hung in its own code keeps its heartbeat).
    also = []
    if not missing:
        missing = lagging
    else:
        also = lagging
    if missing:
        shown = missing[:_MAX_MISSING_LINES]
        lines += [f"  missing: {m}" for m in shown]
        if len(missing) > len(shown):
            lines.append(f"  missing: and {len(missing) - len(shown)} more")
        shown = also[:_MAX_MISSING_LINES]
        lines += [f"  also behind: {m}; alive, its heartbeat current: failing after the missing one" for m in shown]
        if len(also) > len(shown):
            lines.append(f"  also behind: and {len(also) - len(shown)} more")
    elif has_run_dir:
        lines.append("  missing: none found (every peer's status is current and not behind this worker)")
    else:
        lines.append(
            "  missing: unknown (no run directory: tfdist-launch gives one, elsewhere set TFDIST_RUN_DIR to a "
            "directory every worker can write)"
        )
    if records:
        lines.append("  recent: " + " | ".join(r.describe(now) for r in records[-_RECENT:]))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the process' recorder
_current: FlightRecorder | None = None
_NOTHING = contextlib.nullcontext()


def install(recorder: FlightRecorder | None) -> None:
    """Makes `recorder` the one this process' hooks record into (None: none); closes the one before.

    Example:

    >>> recorder = FlightRecorder(worker=0, addresses=["a:1", "b:1"])
    >>> install(recorder)
    >>> with phase("barrier", "before eval"):
    ...     pass
    >>> current() is recorder, recorder.records()
    (True, [Record(1, 'barrier before eval', done)])
    >>> install(None)
    """
    global _current
    previous, _current = _current, recorder
    if previous is not None and previous is not recorder:
        previous.close()


def start(cluster: cluster_lib.Cluster) -> FlightRecorder:
    """Makes and installs the recorder of this process of `cluster`, in the run directory `tfdist.cluster.run_dir()`.

    Raises:
        tfdist.cluster.ClusterError: when `TFDIST_RUN_DIR` is set but is not a directory.

    Example (outside tfdist-launch: no run directory):

    >>> recorder = start(cluster_lib.Cluster(workers=("127.0.0.1:2222", "127.0.0.1:2223"), task_index=1))
    >>> recorder.who, recorder.run_dir, current() is recorder
    ('worker 1 (127.0.0.1:2223)', None, True)
    >>> install(None)
    """
    recorder = FlightRecorder(worker=cluster.rank, addresses=cluster.addresses, run_dir=cluster_lib.run_dir())
    install(recorder)
    return recorder


def current() -> FlightRecorder | None:
    """The recorder this process' hooks record into, or None."""
    return _current


def phase(phase: str, name: str = "", *, step: int | None = None):
    """`current().phase(...)`, or a context manager doing nothing when no recorder runs.

    Example:

    >>> with phase("barrier", "before eval"):
    ...     pass
    """
    recorder = _current
    if recorder is None:
        _validate.one_of("phase", phase, PHASES)
        return _NOTHING
    return recorder.phase(phase, name, step=step)


def keras_step(kind: str):
    """`current().keras_step(kind)`, or a context manager doing nothing when no recorder runs."""
    recorder = _current
    return _NOTHING if recorder is None else recorder.keras_step(kind)


def collective(name):
    """`current().collective(name)`, or a context manager doing nothing when no recorder runs."""
    recorder = _current
    return _NOTHING if recorder is None else recorder.collective(name)
