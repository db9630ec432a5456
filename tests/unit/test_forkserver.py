"""`_forkserver`: a scenario forked from a server runs as `python SCRIPT ARGS` would, and ends like a Popen."""

import json
import os
import signal
import sys
import time

import _forkserver
import _procs
import pytest

SCRIPT = '''
import json, os, sys
import numpy as np
print(json.dumps({
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "marker": os.environ.get("TFDIST_TEST_MARKER"), "tf_config": os.environ.get("TF_CONFIG"),
    "sid": os.getsid(0) == os.getpid(),
    "hash": hash("tfdist"), "numpy": float(np.random.random()),
}), flush=True)
if sys.argv[1] == "fail":
    raise SystemExit(3)
if sys.argv[1] == "sleep":
    import time
    time.sleep(600)
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scenario.py"
    path.write_text(SCRIPT)
    return str(path)


def _run(script, tmp_path, name, mode, *, slot=0, env=None, new_session=True):
    out = open(tmp_path / f"{name}.log", "wb")
    proc = _forkserver.popen([sys.executable, script, mode], env=_procs.clean_env(**(env or {})), cwd=str(tmp_path),
                             stdout=out, new_session=new_session, slot=slot)
    return proc, tmp_path / f"{name}.log"


def test_a_forked_script_runs_as_main_with_its_own_arguments_environment_session_and_exit(script, tmp_path):
    runs = {name: _run(script, tmp_path, name, mode, slot=slot, env=env) for name, mode, slot, env in [
        ("a", "ok", 0, {"TFDIST_TEST_MARKER": "a", "TF_CONFIG": "{}"}), ("b", "fail", 1, {"TFDIST_TEST_MARKER": "b"}),
        ("c", "ok", 0, {"TFDIST_TEST_MARKER": "c"}), ("d", "sleep", 1, {})]}
    codes = {name: proc.wait(timeout=120) for name, (proc, _) in runs.items() if name != "d"}
    assert codes == {"a": 0, "b": 3, "c": 0}
    seen = {name: json.loads(log.read_text().splitlines()[0]) for name, (_, log) in runs.items() if name != "d"}
    a, b, c = seen["a"], seen["b"], seen["c"]
    assert (a["name"], a["file"], a["argv"], a["path0"]) == ("__main__", script, [script, "ok"], str(tmp_path))
    assert (a["cwd"], a["marker"], a["tf_config"], b["marker"], b["tf_config"]) == (str(tmp_path), "a", "{}", "b", None)
    assert a["sid"] and b["sid"]  # each leads its own session: killpg(pid) reaches its process group
    assert a["hash"] == c["hash"] != b["hash"]  # one server per slot, each its own interpreter's hash seed
    assert len({a["numpy"], b["numpy"], c["numpy"]}) == 3  # NumPy's global state reseeded in every child
    # A signal ends it as it ends a Popen child: a negative return code.
    proc = runs["d"][0]
    deadline = time.monotonic() + 60
    while not runs["d"][1].read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
