"""Workers leave together: at exit each waits (up to 2 x heartbeat_timeout) for the others to reach their end.

Without it, a worker done first (the chief writing the model and leaving, say) takes its server down while a peer
still receives its last collective, and the peer fails at the end of a good run (tensorflow#58434). Real processes
on 127.0.0.1 (`tests/scenarios/two_process_exit_together.py`), times from the same clock: the child writes when its
own cleanup ends, this process sees when each child exits (within 0.1 s).
"""

import json
import re
import sys
from pathlib import Path

import _procs
import pytest

CHILD = str(Path(_procs.REPO) / "tests" / "scenarios" / "two_process_exit_together.py")


def _job(procs, tmp_path, kind, *, heartbeat, linger=(0, 0), fail=(0, 0)):
    """Starts both workers; returns their indices in `procs` and the files they write their times to."""
    from tfdist import cluster as cluster_lib

    addresses = _procs.workers(2)
    indices, outs = [], []
    for i in range(2):
        tf_config = cluster_lib.Cluster(workers=addresses, task_index=i).to_tf_config()
        out = tmp_path / f"{kind}{i}.json"
        cmd = [sys.executable, CHILD, kind, str(out), f"heartbeat={heartbeat}", f"linger={linger[i]}",
               f"fail={fail[i]}"]
        indices.append(procs.start(cmd, _procs.clean_env(TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="3")))
        outs.append(out)
    return indices, outs


@pytest.mark.parametrize("kind", ["mp", "mw"])
def test_worker_0_stays_until_a_slower_peer_is_done(procs, tmp_path, kind):
    """Worker 1's own cleanup takes 4 s after the last collective: worker 0 leaves only after it."""
    indices, outs = _job(procs, tmp_path, kind, heartbeat=5, linger=(0, 4))
    assert procs.wait(indices, timeout=180) == [0, 0], [procs.log(i)[-3000:] for i in indices]
    peer = json.loads(outs[1].read_text())
    assert peer["ended"] - peer["began"] >= 4
    assert procs.ended[indices[0]] >= peer["ended"], (procs.ended[indices[0]], peer)
    for i in indices:
        assert "leaves before every peer reached its end" not in procs.log(i), procs.log(i)[-3000:]


def test_a_peer_later_than_the_wait_is_named_and_the_run_still_succeeds(procs, tmp_path):
    """heartbeat_timeout=2: worker 0 waits 4 s for a peer whose cleanup takes 12 s, says so, and exits 0."""
    indices, outs = _job(procs, tmp_path, "mp", heartbeat=2, linger=(0, 12))
    assert procs.wait(indices, timeout=180) == [0, 0], [procs.log(i)[-3000:] for i in indices]
    peer = json.loads(outs[1].read_text())
    mine = json.loads(outs[0].read_text())
    waited = procs.ended[indices[0]] - mine["ended"]
    assert 3.5 <= waited < 15, waited
    assert procs.ended[indices[0]] < peer["ended"]  # it did not wait for the whole 12 s
    log = procs.log(indices[0])
    assert re.search(r"tfdist.ModelParallelStrategy: worker 0 \(127.0.0.1:\d+\) leaves before every peer reached its "
                     r"end: it waited 4s \(2 x heartbeat_timeout\) at exit", log), log[-3000:]
    assert "tfdist flight recorder" not in log  # no failure report: the job did not fail
    assert "leaves before every peer" not in procs.log(indices[1])  # worker 0 said it


@pytest.mark.serial  # bounds how long the failing worker takes to leave
def test_a_failing_worker_leaves_at_once(procs, tmp_path):
    """An uncaught error ends worker 1 without the wait (heartbeat_timeout=6: it would wait up to 12 s)."""
    indices, outs = _job(procs, tmp_path, "mp", heartbeat=6, fail=(0, 1))
    codes = procs.wait(indices, timeout=180)
    assert codes[1] == 1 and codes[0] == 0, [procs.log(i)[-3000:] for i in indices]
    failed = json.loads(outs[1].read_text())
    assert procs.ended[indices[1]] - failed["ended"] < 8, procs.log(indices[1])[-3000:]
    assert "this worker fails on purpose" in procs.log(indices[1])
