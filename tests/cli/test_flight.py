"""The flight recorder (tfdist.flight) and tfdist-launch's failure report.

Unit tests of the ring buffer, the status files, the summary and the report's formatting run in
this process (tfdist.flight needs no TensorFlow). The job tests run real processes on 127.0.0.1
under tfdist-launch, each bounded in time, every process killed by PID on the way out: three
MultiWorkerStrategy workers training a tiny model, one of them stopped (SIGSTOP) or killed
(SIGKILL) mid-run; and plain Python workers (no TensorFlow) for the launcher asking the survivors
for their summary before it stops them.
"""

import io
import os
import re
import signal
import sys
import textwrap
import time

import _procs
import pytest
from _launchers import descendants
from _launchers import kill
from _launchers import wait_gone

from tfdist import cluster as cluster_lib
from tfdist import flight
from tfdist import launch

ADDRESSES = ["127.0.0.1:2222", "127.0.0.1:2223", "127.0.0.1:2224"]


class UnavailableError(Exception):
    """Stands for TensorFlow's error of the same name (the recorder goes by the class name)."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


def recorder(tmp_path=None, worker=0, **kwargs):
    out = io.StringIO()
    run_dir = None if tmp_path is None else str(tmp_path)
    return flight.FlightRecorder(worker=worker, addresses=ADDRESSES, run_dir=run_dir, stream=out, **kwargs), out


# ------------------------------------------------------------------ the ring buffer
def test_ring_buffer_keeps_the_last_records_in_order_numbered_per_kind():
    r, _ = recorder(capacity=4)
    for _ in range(3):
        with r.keras_step("train"):
            with r.collective(b"__inference_multi_step_on_iterator_641"):  # inside a step: no record of its own
                pass
    with r.keras_step("test"):
        pass
    with r.collective(b"__inference_train_step_77"):
        pass
    with r.phase("checkpoint", "step 3"):
        with r.collective("gather variable"):  # inside a phase: recorded
            pass
    records = r.records()
    assert [(x.seq, x.label) for x in records] == [  # in the order they began; the first 3 train steps left
        (4, "test step 1"),
        (5, "collective train_step"),
        (6, "checkpoint step 3"),
        (7, "collective gather variable"),
    ]
    assert all(x.state == "done" and x.end >= x.start for x in records)
    status = r.status()  # the record that ended last, and how many began
    assert (status.seq, status.label, status.state) == (7, "checkpoint step 3", "done")
    assert status.last_step[:2] == ("test", 1)
    r.close()


def test_a_failed_record_is_marked_failed_and_is_not_the_last_completed_step():
    r, out = recorder()
    with r.keras_step("train"):
        pass
    with pytest.raises(ValueError), r.keras_step("train"):
        raise ValueError("not a distributed failure")
    assert [(x.label, x.state) for x in r.records()] == [("train step 1", "done"), ("train step 2", "failed")]
    assert r.status().last_step[:2] == ("train", 1)
    assert out.getvalue() == ""  # a user's error is no reason for a summary
    r.close()


def test_a_distributed_error_prints_one_summary_naming_the_peers_tensorflow_names():
    r, out = recorder()  # no run directory: the error is all it knows of its peers
    with r.keras_step("train"):
        pass
    error = UnavailableError(
        "Graph execution error:\n\nCollective ops is aborted by: Socket closed\nAdditional GRPC error information "
        "from remote target /job:worker/replica:0/task:2 while calling /tensorflow.WorkerService/RecvBuf:"
    )
    for _ in range(2):
        with pytest.raises(UnavailableError), r.keras_step("train"):
            raise error
    text = out.getvalue()
    assert text.count(flight.SUMMARY_HEAD) == 1, text
    lines = text.splitlines()
    assert lines[0] == f"{flight.SUMMARY_HEAD}worker 0 (127.0.0.1:2222): a distributed call failed: " \
        "UnavailableError: Socket closed", lines
    assert lines[1].startswith("  last completed: train step 1 (")
    assert lines[2].startswith("  waiting in: train step 2, for ")
    assert lines[3].startswith("  missing: worker 2 (127.0.0.1:2224): named in TensorFlow's error (no run directory")
    assert len(lines) == 5 and lines[4].startswith("  recent: train step 1 (")
    r.close()


# ------------------------------------------------------------------ status files
def test_status_file_holds_the_latest_record_heartbeat_and_report(tmp_path):
    r, _ = recorder(tmp_path, worker=1)
    path = flight.status_path(str(tmp_path), 1)
    empty = flight.read_status(path)
    assert (empty.worker, empty.pid, empty.phase, empty.label) == (1, os.getpid(), None, "nothing yet")
    with r.keras_step("train"):
        pass
    with r.phase("checkpoint", "step 1"):
        inside = flight.read_status(path)
        time.sleep(3 * flight.STATUS_INTERVAL)
        later = flight.read_status(path)
        r.report("a test")
    assert (inside.seq, inside.label, inside.state, inside.end) == (2, "checkpoint step 1", "open", None)
    assert inside.last_step[:2] == ("train", 1) and not inside.reported
    assert later.written > inside.written and later.seq == 2  # the heartbeat rewrites it meanwhile
    done = flight.read_status(path)
    assert done.reported and done.state == "done" and done.end >= done.start
    assert done.describe(done.end + 2.0) == "checkpoint step 1 (done 2.0 s ago), after train step 1"
    ring = (tmp_path / "worker-1.flight.txt").read_text()
    assert ring.startswith(flight.SUMMARY_HEAD) and "1 train step 1 (" in ring and "2 checkpoint step 1 (" in ring
    r.close()


def test_a_half_written_status_reads_as_none_not_as_garbage(tmp_path):
    r, _ = recorder(tmp_path)
    r.close()
    path = flight.status_path(str(tmp_path), 0)
    raw = bytearray(open(path, "rb").read())
    raw[-4:] = b"\xff\xff\xff\xff"  # the closing write count differs from the opening one
    open(path, "wb").write(bytes(raw))
    assert flight.read_status(path) is None
    open(path, "wb").write(b"TFFR" + b"\0" * 10)  # too short
    assert flight.read_status(path) is None


def test_summary_tells_missing_peers_from_those_waiting_too(tmp_path):
    """Peer 1 is behind (an earlier record) and stopped; peer 2 waits in the same step with a fresh heartbeat."""
    r, out = recorder(tmp_path)
    now = time.time()
    peers = {
        1: flight.Status(worker=1, pid=1, host="h", written=now - 9, seq=4, phase="step", name="train", step=3,
                         start=now - 9.5, end=now - 9, state="done", last_step=("train", 3, now - 9)),
        2: flight.Status(worker=2, pid=2, host="h", written=now, seq=5, phase="step", name="train", step=4,
                         start=now - 9, state="open", last_step=("train", 3, now - 9)),
    }  # fmt: skip
    mine = flight.Record(5, "step", "train", 4, now - 9)
    text = flight.format_summary(
        who=r.who, reason="a test", records=[mine], open_records=[mine], last_step=None, addresses=ADDRESSES,
        peers=peers, states={1: "stopped", 2: "running"}, named=[], has_run_dir=True, now=now,
    )  # fmt: skip
    missing = [line for line in text.splitlines() if line.startswith("  missing: ")]
    assert missing == [
        "  missing: worker 1 (127.0.0.1:2223): last reported train step 3 (done 9.0 s ago); no heartbeat for "
        "9.0 s; process stopped"
    ], text
    # Nobody behind, every heartbeat fresh: none missing.
    peers[1] = peers[2]
    text = flight.format_summary(
        who=r.who, reason="a test", records=[mine], open_records=[mine], last_step=None, addresses=ADDRESSES,
        peers=peers, states={}, named=[1], has_run_dir=True, now=now,
    )  # fmt: skip
    assert "  missing: none found" in text, text
    r.close()


def test_a_peer_only_behind_is_missing_unless_another_is_gone(tmp_path):
    """Sync training's skew: peer 2 has not yet written the end of the step this worker finished."""
    r, out = recorder(tmp_path)
    now = time.time()
    open_step = dict(phase="step", name="train", step=10, state="open", last_step=("train", 9, now - 0.1))
    peers = {
        1: flight.Status(worker=1, pid=1, host="h", written=now - 0.06, seq=10, start=now - 0.06, **open_step),
        2: flight.Status(worker=2, pid=2, host="h", written=now - 0.05, seq=10, start=now - 0.05, **open_step),
    }  # fmt: skip
    mine = flight.Record(11, "step", "train", 11, now - 0.04)

    def missing(states):
        text = flight.format_summary(
            who=r.who, reason="a test", records=[mine], open_records=[mine], last_step=None, addresses=ADDRESSES,
            peers=peers, states=states, named=[], has_run_dir=True, now=now,
        )  # fmt: skip
        return [line.split(":")[:2] for line in text.splitlines() if line.startswith(("  missing: ", "  also"))]

    assert missing({1: "gone", 2: "running"}) == [["  missing", " worker 1 (127.0.0.1"],
                                                  ["  also behind", " worker 2 (127.0.0.1"]]
    assert missing({1: "running", 2: "running"}) == [["  missing", " worker 1 (127.0.0.1"],
                                                     ["  missing", " worker 2 (127.0.0.1"]]
    r.close()


def test_the_launchers_stop_request_makes_the_recorder_report(tmp_path):
    r, out = recorder(tmp_path)
    with r.keras_step("train"):
        (tmp_path / flight.STOP_FILE).write_text("worker 1 (127.0.0.1:2223) killed by SIGKILL")
        deadline = time.monotonic() + 10
        while not out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    text = out.getvalue()
    assert text.startswith(
        f"{flight.SUMMARY_HEAD}worker 0 (127.0.0.1:2222): tfdist-launch is stopping the job: worker 1 "
        "(127.0.0.1:2223) killed by SIGKILL\n"
    ), text
    assert "  waiting in: train step 1, for " in text
    # Peers 1 and 2 never wrote a status: they are missing from the step this worker waits in.
    assert "  missing: worker 1 (127.0.0.1:2223): no status yet" in text
    assert flight.read_status(flight.status_path(str(tmp_path), 0)).reported
    r.close()


def test_bad_input_names_the_argument_and_the_valid_choices(tmp_path):
    with pytest.raises(ValueError, match=r"`worker`. Received: worker=3. Expected an integer from 0 to 2"):
        flight.FlightRecorder(worker=3, addresses=ADDRESSES)
    with pytest.raises(ValueError, match=r"`capacity`. Received: capacity=0"):
        flight.FlightRecorder(worker=0, addresses=ADDRESSES, capacity=0)
    with pytest.raises(ValueError, match=r"`addresses`. Received: addresses='a:1'"):
        flight.FlightRecorder(worker=0, addresses="a:1")
    with pytest.raises(ValueError, match=r"`run_dir`. Received: run_dir='/nonexistent'"):
        flight.FlightRecorder(worker=0, addresses=ADDRESSES, run_dir="/nonexistent")
    r, _ = recorder()
    with pytest.raises(ValueError, match=r"phase='idle'. Expected one of \('input', 'step', 'collective'"):
        r.phase("idle")
    with pytest.raises(ValueError, match=r"phase='idle'"):
        flight.phase("idle")  # checked without a recorder too
    r.close()
    with pytest.raises(cluster_lib.ClusterError, match="TFDIST_RUN_DIR='/nonexistent' is not a directory"):
        cluster_lib.run_dir(env={"TFDIST_RUN_DIR": "/nonexistent"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"`run_dir`. Received: run_dir="):
        launch.Launcher(command=[sys.executable], num_workers=1, run_dir=str(tmp_path / "file"))


# ------------------------------------------------------------------ the launcher's report
def test_report_names_the_first_failure_its_output_and_every_worker():
    outcomes = [
        launch.WorkerOutcome(0, "127.0.0.1:2222", 100, "running", "stopped by tfdist-launch (SIGTERM)",
                             "last reported train step 9 (began 6.0 s ago, not finished)"),
        launch.WorkerOutcome(1, "127.0.0.1:2223", 101, "stopped by SIGSTOP", "stopped by tfdist-launch (SIGTERM)",
                             "last reported train step 8 (done 6.1 s ago)"),
        launch.WorkerOutcome(2, "127.0.0.1:2224", 102, "exited with code 1", "exited with code 1", ""),
    ]  # fmt: skip
    text = launch.format_report(outcomes, 1, ["Epoch 1/3", "x" * 200], note="6.0 s before worker 2 exited")
    assert text.splitlines() == [
        "job failed: worker 1 (127.0.0.1:2223, pid 101) failed first: stopped by SIGSTOP (6.0 s before worker 2 "
        "exited)",
        "its last output:",
        "  | Epoch 1/3",
        "  | " + "x" * 157 + "...",
        "workers (state when it failed -> how it ended; last reported step):",
        "  worker 0 (127.0.0.1:2222): running -> stopped by tfdist-launch (SIGTERM); last reported train step 9 "
        "(began 6.0 s ago, not finished)",
        "  worker 1 (127.0.0.1:2223): stopped by SIGSTOP -> stopped by tfdist-launch (SIGTERM); last reported "
        "train step 8 (done 6.1 s ago)",
        "  worker 2 (127.0.0.1:2224): exited with code 1; no flight-recorder status",
    ]
    assert launch.describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert launch.describe_exit(128 + signal.SIGTERM) == "exited with code 143 (128 + SIGTERM)"


def test_report_of_many_workers_fits_one_screen_and_keeps_the_unusual_ones():
    outcomes = [launch.WorkerOutcome(i, f"127.0.0.1:{3000 + i}", i, "running", "stopped by tfdist-launch (SIGTERM)",
                                     "last reported train step 5 (began 1.0 s ago, not finished)")
                for i in range(64)]  # fmt: skip
    outcomes[40] = launch.WorkerOutcome(40, "127.0.0.1:3040", 40, "killed by SIGKILL", "killed by SIGKILL", "")
    outcomes[50] = launch.WorkerOutcome(50, "127.0.0.1:3050", 50, "exited with code 1", "exited with code 1", "")
    lines = launch.format_report(outcomes, 40, []).splitlines()
    assert len(lines) <= 24, lines
    assert lines[0].startswith("job failed: worker 40 (127.0.0.1:3040, pid 40) failed first: killed by SIGKILL")
    assert lines[1] == "its last output: none"
    assert any(line.startswith("  worker 50 ") for line in lines) and lines[-1] == "  ... and 49 more workers"


# ------------------------------------------------------------------ jobs under tfdist-launch
def _start_job(procs, tmp_path, num_workers, command, grace=5):
    run_dir = tmp_path / "run"
    cmd = [*_launch_cmd(num_workers, grace, run_dir), *command]
    return procs.start(cmd, _procs.clean_env()), run_dir


def _launch_cmd(num_workers, grace, run_dir):
    return [sys.executable, "-m", "tfdist.launch", "-n", str(num_workers), "--grace", str(grace),
            "--run_dir", str(run_dir), "--"]  # fmt: skip


def _statuses(run_dir, n):
    return [flight.read_status(flight.status_path(str(run_dir), i)) for i in range(n)]


def _worker_lines(log, i):
    prefix = f"[worker {i}] "
    return [line[len(prefix) :] for line in log.splitlines() if line.startswith(prefix)]


def _summary(log, i):
    """Worker i's summary lines (asserting it printed exactly one)."""
    lines = _worker_lines(log, i)
    heads = [k for k, line in enumerate(lines) if line.startswith(flight.SUMMARY_HEAD)]
    assert len(heads) == 1, (i, log[-6000:])
    block = [lines[heads[0]]]
    for line in lines[heads[0] + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


def _report(log):
    lines = [line[len("[tfdist-launch] ") :] for line in log.splitlines() if line.startswith("[tfdist-launch] ")]
    start = next(k for k, line in enumerate(lines) if line.startswith("job failed: "))
    return lines[start:]


def _signal_a_training_worker(procs, tmp_path, sig, victim, **opts):
    """3 workers train; `victim` gets `sig` at step >= 5. Returns the log, the victim's status then, the times."""
    # _procs.WORKER: tests/scenarios/multi_worker_fit.py
    worker = [sys.executable, _procs.WORKER, str(tmp_path / "w.npz"), "multi", "epochs=100000", "n=600",
              *[f"{k}={v}" for k, v in opts.items()]]  # fmt: skip
    job, run_dir = _start_job(procs, tmp_path, 3, worker)
    launcher = procs.procs[job]
    tree = set()
    try:
        deadline = time.monotonic() + 240
        while True:
            statuses = _statuses(run_dir, 3) if run_dir.is_dir() else [None] * 3
            if all(s is not None and s.last_step and s.last_step[1] >= 5 for s in statuses):
                break
            assert launcher.poll() is None and time.monotonic() < deadline, procs.log(job)[-5000:]
            time.sleep(0.1)
        tree = descendants(launcher.pid)
        os.kill(statuses[victim].pid, sig)
        signalled = time.monotonic()
        time.sleep(0.5)  # stopped or dead by now: its status file no longer changes
        frozen = flight.read_status(flight.status_path(str(run_dir), victim))
        summaries = {}
        while len(summaries) < 2 and time.monotonic() - signalled < 60:
            log = procs.log(job)
            for i in range(3):
                if i != victim and i not in summaries and f"[worker {i}] {flight.SUMMARY_HEAD}" in log:
                    summaries[i] = time.monotonic() - signalled
            time.sleep(0.1)
        code = procs.wait([job], timeout=90)[0]
        assert code not in (None, 0), procs.log(job)[-5000:]
        left, _ = wait_gone(tree, timeout=15)
        assert not left, f"still alive after the job ended: {left}"
        return procs.log(job), frozen, summaries, run_dir
    finally:
        kill(tree | descendants(launcher.pid))


def _check_survivors(log, frozen, victim):
    """Each survivor's one summary names the victim, its address and the step it stalled at."""
    report = _report(log)
    addresses = dict(re.findall(r"^  worker (\d+) \((127\.0\.0\.1:\d+)\)", "\n".join(report), re.MULTILINE))
    assert len(addresses) == 3, report
    stalled = frozen.step if frozen.phase == "step" else frozen.last_step[1]
    for i in range(3):
        if i == victim:
            continue
        block = _summary(log, i)
        missing = [line for line in block if line.startswith("  missing: ")]
        assert len(missing) == 1, block
        assert missing[0].startswith(
            f"  missing: worker {victim} ({addresses[str(victim)]}): last reported {frozen.label} ("
        ), (block, frozen)
        waiting = re.search(r"^  waiting in: train step (\d+),", "\n".join(block), re.MULTILINE)
        if waiting:  # in sync training the victim stalled in the survivor's step or the one before
            assert int(waiting.group(1)) - 1 <= stalled <= int(waiting.group(1)), (block, frozen)
    return report, addresses


@pytest.mark.serial  # a collective timeout, bounded
def test_a_stopped_worker_is_named_by_every_survivor_within_the_collective_timeout(procs, tmp_path):
    """SIGSTOP: the step deadline (timeout=6 s, before TensorFlow's 10-s heartbeat) ends the survivors' wait."""
    log, frozen, summaries, _ = _signal_a_training_worker(
        procs, tmp_path, signal.SIGSTOP, victim=1, timeout=6, heartbeat=10
    )
    report, addresses = _check_survivors(log, frozen, victim=1)
    for i in (0, 2):
        block = _summary(log, i)
        assert "a distributed step ran for more than timeout=6s" in block[0], block
        assert "process stopped" in next(line for line in block if line.startswith("  missing: ")), block
        # The summary comes with the timeout: 6 s after its wait began (a little before or after the signal).
        assert 4 < summaries[i] < 6 + 20, summaries
    assert report[0].startswith(
        f"job failed: worker 1 ({addresses['1']}, pid {frozen.pid}) failed first: stopped by SIGSTOP ("
    ), report
    # Resumed (SIGCONT) right after the launcher's SIGTERM, it ended on that, not on SIGKILL after --grace.
    assert any(line.startswith(f"  worker 1 ({addresses['1']}): stopped by SIGSTOP -> stopped by tfdist-launch "
                               "(SIGTERM); ") for line in report), report  # fmt: skip
    assert "killing them" not in log
    assert all(f"last reported {frozen.label} (" in line for line in report if line.startswith("  worker 1 ")), report


@pytest.mark.serial  # bounds when each survivor reports
def test_a_killed_worker_is_named_by_every_survivor_and_the_report_gives_its_signal(procs, tmp_path):
    """SIGKILL of worker 0 (TensorFlow's coordination leader): the survivors' collectives fail at once."""
    log, frozen, summaries, run_dir = _signal_a_training_worker(
        procs, tmp_path, signal.SIGKILL, victim=0, timeout=60, heartbeat=10
    )
    report, addresses = _check_survivors(log, frozen, victim=0)
    for i in (1, 2):
        block = _summary(log, i)
        assert "UnavailableError" in block[0] or "tfdist-launch is stopping the job" in block[0], block
        assert "process gone" in next(line for line in block if line.startswith("  missing: ")), block
        assert summaries[i] < 30, summaries
    assert report[0] == f"job failed: worker 0 ({addresses['0']}, pid {frozen.pid}) failed first: killed by SIGKILL"
    assert report[1] == "its last output:"
    rows = [line for line in report if line.startswith("  worker ")]
    assert len(rows) == 3 and rows[0].startswith(f"  worker 0 ({addresses['0']}): killed by SIGKILL; last reported")
    assert all("last reported train step " in row for row in rows), rows
    # The survivors' whole ring buffers are kept in the run directory.
    for i in (1, 2):
        assert (run_dir / f"worker-{i}.flight.txt").read_text().startswith(flight.SUMMARY_HEAD)


# Plain Python workers (no TensorFlow): each records a step, then waits in a checkpoint; worker 1 exits 3
# once every worker has written its status.
RECORDING_WORKER = textwrap.dedent(
    r"""
    import sys, time
    from tfdist import cluster, flight
    c = cluster.resolve()
    recorder = flight.start(c)
    with recorder.keras_step("train"):
        pass
    if c.rank == 1:
        while any(flight.read_status(flight.status_path(recorder.run_dir, i)) is None for i in range(3)):
            time.sleep(0.05)
        print("worker 1 fails now", flush=True)
        sys.exit(3)
    with recorder.phase("checkpoint", "step 1"):
        time.sleep(120)
    """
)


@pytest.mark.serial  # the report must come before the launcher's stop
def test_the_launcher_has_the_survivors_report_before_it_stops_them(procs, tmp_path):
    job, run_dir = _start_job(procs, tmp_path, 3, [sys.executable, "-c", RECORDING_WORKER], grace=30)
    launcher = procs.procs[job]
    try:
        code = procs.wait([job], timeout=120)[0]
        log = procs.log(job)
        assert code == 3, log[-3000:]
    finally:
        kill(descendants(launcher.pid))
    launcher_lines = [line for line in log.splitlines() if line.startswith("[tfdist-launch] ")]
    failed = log.index("[tfdist-launch] worker 1 failed with exit status 3; stopping workers [0, 2]")
    report = _report(log)
    address = dict(re.findall(r"^  worker (\d+) \((127\.0\.0\.1:\d+)\)", "\n".join(report), re.MULTILINE))
    for i in (0, 2):
        block = _summary(log, i)
        assert log.index(f"[worker {i}] {flight.SUMMARY_HEAD}") > failed  # asked by the launcher, after the failure
        assert block[:4] == [
            f"{flight.SUMMARY_HEAD}worker {i} ({address[str(i)]}): tfdist-launch is stopping the job: worker 1 "
            f"({address['1']}) exited with code 3",
            block[1],
            block[2],
            f"  missing: worker 1 ({address['1']}): last reported train step 1 ({block[3].split(' (', 2)[2]}",
        ], block
        assert block[1].startswith("  last completed: train step 1 (") and block[2].startswith(
            "  waiting in: checkpoint step 1, for "
        ), block
        assert block[3].endswith("; process gone"), block
    assert report[0] == f"job failed: worker 1 ({address['1']}, pid " + report[0].split(", pid ")[1]
    assert report[0].endswith(" failed first: exited with code 3"), report
    assert report[1:3] == ["its last output:", "  | worker 1 fails now"], report
    rows = report[report.index("workers (state when it failed -> how it ended; last reported step):") + 1 :]
    assert rows[0].startswith(f"  worker 0 ({address['0']}): running -> stopped by tfdist-launch (SIGTERM); last "
                              "reported checkpoint step 1 (began "), rows  # fmt: skip
    assert rows[0].endswith("not finished), after train step 1"), rows
    assert rows[1].startswith(f"  worker 1 ({address['1']}): exited with code 3; last reported train step 1 (done")
    assert len(rows) == 3 and launcher_lines[-1] == "[tfdist-launch] " + rows[2].rstrip()
    assert sorted(os.listdir(run_dir)) == [
        "stop", "worker-0.flight.txt", "worker-0.status", "worker-1.status", "worker-2.flight.txt", "worker-2.status"
    ]  # fmt: skip
