"""tfdist.cluster: discovery from arguments, TF_CONFIG and Slurm, and its errors (no processes)."""

import json
import time

import pytest

from tfdist import cluster
from tfdist.cluster import Cluster
from tfdist.cluster import ClusterError

TWO = ["10.0.0.1:2222", "10.0.0.2:2222"]


def tf_config(workers=TWO, index=0, task_type="worker", chief=None):
    jobs = {"worker": workers}
    if chief:
        jobs["chief"] = [chief]
    return json.dumps({"cluster": jobs, "task": {"type": task_type, "index": index}})


def test_explicit_workers():
    c = cluster.resolve(workers=TWO, task_index=1, env={})
    assert c == Cluster(workers=tuple(TWO), task_index=1)
    assert (c.num_workers, c.rank, c.address, c.is_chief) == (2, 1, "10.0.0.2:2222", False)
    assert cluster.resolve(workers=TWO, task_index=0, env={}).is_chief


def test_nothing_configured_is_a_single_process():
    assert cluster.resolve(env={}) is None
    assert cluster.resolve(env={"TF_CONFIG": "  "}) is None


def test_tf_config_round_trip():
    c = cluster.resolve(env={"TF_CONFIG": tf_config(index=1)})
    assert c.workers == tuple(TWO) and c.task_index == 1 and c.task_type == "worker"
    assert json.loads(c.to_tf_config()) == json.loads(tf_config(index=1))
    assert cluster.from_tf_config(c.to_tf_config()) == c


def test_tf_config_with_chief():
    c = cluster.resolve(env={"TF_CONFIG": tf_config(index=0, task_type="chief", chief="10.0.0.9:1")})
    assert c.is_chief and c.rank == 0 and c.num_workers == 3
    assert c.addresses == ("10.0.0.9:1", *TWO)
    w = cluster.resolve(env={"TF_CONFIG": tf_config(index=1, chief="10.0.0.9:1")})
    assert (w.rank, w.address, w.is_chief) == (2, "10.0.0.2:2222", False)


def test_explicit_arguments_win_over_environment():
    env = {"TF_CONFIG": tf_config(index=1), "SLURM_JOB_NODELIST": "n1"}
    assert cluster.resolve(workers=["a:1"], task_index=0, env=env).workers == ("a:1",)
    assert cluster.resolve(env=env).task_index == 1  # TF_CONFIG before Slurm


def test_cluster_resolver():
    resolver = Cluster(workers=TWO, task_index=1).cluster_resolver()
    assert resolver.cluster_spec().as_dict() == {"worker": TWO}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu1,gpu2", ["gpu1", "gpu2"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("r[1-2]-n[1-2],login", ["r1-n1", "r1-n2", "r2-n1", "r2-n2", "login"]),
        ("single", ["single"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert cluster.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-04", "node]1[", "node[4-1]", "node[a-b]", "", "node[1,]"])
def test_bad_nodelist(nodelist):
    with pytest.raises(ClusterError, match="node list|range"):
        cluster.expand_nodelist(nodelist)


def slurm(procid, ntasks, nodelist="node[01-02]"):
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist}


def test_slurm_one_task_per_node():
    c = cluster.resolve(env=slurm(1, 2))
    assert c.workers == ("node01:8476", "node02:8476") and c.task_index == 1


def test_slurm_several_tasks_per_node_and_port():
    c = cluster.resolve(env=slurm(3, 4), slurm_port=9000)
    assert c.workers == ("node01:9000", "node01:9001", "node02:9000", "node02:9001")
    assert c.address == "node02:9001"


def test_slurm_step_nodelist_wins():
    env = {**slurm(0, 1, "node[01-02]"), "SLURM_STEP_NODELIST": "node05"}
    assert cluster.resolve(env=env).workers == ("node05:8476",)


@pytest.mark.parametrize(
    "env, match",
    [
        (slurm(0, 3), r"SLURM_NTASKS=3 does not split evenly over the 2 node\(s\) of 'node\[01-02\]'"),
        (slurm(0, 1), r"SLURM_JOB_NODELIST='node\[01-02\]' names 2 node\(s\), more than SLURM_NTASKS=1"),
        (slurm(0, 2, "n[0-999999999]"), r"SLURM_JOB_NODELIST='n\[0-999999999\]' names 1000000000 node\(s\)"),
        (slurm(0, 4, "a[0-99999]b[0-99999]"), r"names 10000000000 node\(s\), more than SLURM_NTASKS=4"),
        ({**slurm(0, 2), "SLURM_STEP_NODELIST": "s[1-9]"}, r"SLURM_STEP_NODELIST='s\[1-9\]' names 9 node"),
        (slurm(0, "²"), r"SLURM_NTASKS='²' is missing or not an integer from 1 to 1000000"),
        (slurm("٣", 2), r"SLURM_PROCID='٣' is missing or not an integer from 0"),
        (slurm(0, "9" * 5000), r"SLURM_NTASKS='9{20}'\.\.\. \(5000 characters\) is missing or not an integer"),
        (slurm(0, 0), r"SLURM_NTASKS='0' is missing or not an integer from 1"),
        (slurm(0, -2), r"SLURM_NTASKS='-2'"),
        (slurm(0, 2, "n[1-" + "9" * 30 + "]"), r"Bad range '1-9{30}'"),
        (slurm(2, 2), r"Task index 2 is out of range .* 2 task\(s\)"),
        ({**slurm(0, 2), "SLURM_PROCID": "x"}, r"SLURM_PROCID='x'"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "0"}, r"SLURM_NTASKS=None"),
    ],
)
def test_slurm_errors(env, match):
    with pytest.raises(ClusterError, match=match):
        cluster.resolve(env=env)


@pytest.mark.parametrize("port", [0, 70000, "80", True])
def test_slurm_bad_port(port):
    with pytest.raises(ClusterError, match=f"Invalid Slurm base port {port!r}"):
        cluster.resolve(env=slurm(0, 2), slurm_port=port)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", r"TF_CONFIG is not valid JSON .*'\{not json'"),
        ("[1, 2]", r"must be a JSON object .*'\[1, 2\]'"),
        ('{"cluster": {"worker": ["a:1"]}}', r"no 'task' with 'type' and 'index'.*\"worker\": \[\"a:1\"\]"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}', r"no 'task' with 'type' and 'index'"),
        ('{"task": {"type": "worker", "index": 0}}', r"no 'cluster' object"),
        (tf_config(index=2), r"Task index 2 is out of range for job 'worker' with 2 task\(s\). Expected 0 to 1"),
        (tf_config(index=-1), r"Task index -1 is out of range"),
        (tf_config(index="0"), r"Invalid task index '0'"),
        (tf_config(workers=["a:1", "b:2", "a:1"]), r"repeated: \['a:1'\]"),
        (tf_config(workers=["a:1"], chief="a:1"), r"repeated: \['a:1'\]"),
        (tf_config(workers=["a:1", "b:99999"]), r"Invalid port '99999' in worker address 'b:99999'"),
        (tf_config(workers=["a:1", "b:http"]), r"Invalid port 'http' in worker address 'b:http'"),
        (tf_config(workers=["a:1", "b:²"]), r"Invalid port '²' in worker address 'b:²'"),
        (tf_config(workers=["a:1", "b:" + "1" * 5000]), r"Invalid port '1{5000}'"),
        (tf_config(workers=["a:1", "b"]), r"Invalid worker address 'b' .*no port"),
        (tf_config(workers=["a:1", 7]), r"Invalid worker address 7"),
        (tf_config(task_type="ps"), r"Invalid task type 'ps'. Expected one of \('chief', 'worker'\)"),
        (tf_config(task_type="chief"), r"task type 'chief' needs a `chief` address"),
        (
            json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", "index": 0}}),
            r"unsupported job\(s\) \['ps'\]",
        ),
        (
            json.dumps(
                {"cluster": {"worker": ["a:1"], "chief": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 0}}
            ),
            r"'chief' must list at most one address",
        ),
        (json.dumps({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}), r"no 'cluster'|no workers"),
    ],
)
def test_tf_config_errors(text, match):
    with pytest.raises(ClusterError, match=match):
        cluster.resolve(env={"TF_CONFIG": text})


def _with_job(job):
    return json.dumps({"cluster": {"worker": TWO, job: ["10.0.0.3:2222"]}, "task": {"type": "worker", "index": 0}})


@pytest.mark.parametrize(
    "text",
    [tf_config(task_type="ps"), tf_config(task_type="evaluator"), _with_job("ps"), _with_job("evaluator")],
)
def test_parameter_server_training_is_refused_naming_what_to_use(text):
    # The parameter_server_training tutorial's TF_CONFIG: Keras 3 does not support it either.
    with pytest.raises(ClusterError) as info:
        cluster.resolve(env={"TF_CONFIG": text})
    message = str(info.value)
    assert "Parameter-server training (tasks 'ps', 'evaluator') is not supported, as in Keras 3 itself" in message
    assert "make every task a 'worker' (at most one 'chief') and train with tfdist.MultiWorkerStrategy" in message


def test_other_unknown_jobs_get_no_parameter_server_note():
    with pytest.raises(ClusterError, match=r"unsupported job\(s\) \['trainer'\]") as info:
        cluster.resolve(env={"TF_CONFIG": _with_job("trainer")})
    assert "Parameter-server" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": TWO}, r"`task_index` was not"),
        ({"task_index": 0}, r"`task_index=0` was given without `workers`"),
        ({"workers": "a:1,b:1", "task_index": 0}, r"Invalid value for `workers`. Received: workers='a:1,b:1'"),
        ({"workers": [], "task_index": 0}, r"no workers"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        cluster.resolve(env={}, **kwargs)


def test_cluster_error_is_a_value_error_and_cluster_is_frozen():
    assert issubclass(ClusterError, ValueError)
    c = Cluster(workers=TWO, task_index=0)
    with pytest.raises(AttributeError):
        c.task_index = 1


def test_join_timeout_from_environment():
    assert cluster.join_timeout(env={}) is None
    assert cluster.join_timeout(env={cluster.JOIN_TIMEOUT_ENV: "12.5"}) == 12.5
    assert cluster.join_timeout(env={cluster.JOIN_TIMEOUT_ENV: "1e9"}) == 1e9
    for bad in ("0", "-3", "soon", "nan", "inf", "1e400", "1.5e9"):
        with pytest.raises(ClusterError, match=rf"TFDIST_JOIN_TIMEOUT='{bad}'.*Expected a number in \(0, 1e\+09\]"):
            cluster.join_timeout(env={cluster.JOIN_TIMEOUT_ENV: bad})


@pytest.mark.serial  # a bound of 5 s on what takes well under 1 s alone
def test_a_large_slurm_job_resolves_quickly():
    """100,000 tasks on 25,000 nodes: counting and checking stay linear (no quadratic duplicate search)."""
    start = time.perf_counter()
    c = cluster.resolve(env=slurm(99_999, 100_000, "n[00001-25000]"))
    assert (c.num_workers, c.address) == (100_000, "n25000:8479")
    assert time.perf_counter() - start < 5
