"""Cluster discovery: which processes train together, and which one this is.

This is the only tfdist module that reads the environment. `resolve()` looks,
in order, at explicit arguments, `TF_CONFIG`, and Slurm's `SLURM_*` variables,
and returns a validated, frozen `Cluster` (or None when the process is alone).

Only the `chief` and `worker` jobs exist for multi-worker data parallelism;
the chief, when there is one, counts as worker 0.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from collections.abc import Sequence

from tfdist import _validate
from tfdist import errors

DEFAULT_SLURM_PORT = 8476
"""Port of the first task on each Slurm node; the k-th task on a node uses this + k."""

TASK_TYPES = ("chief", "worker")
_NO_PARAMETER_SERVERS = (
    "Parameter-server training (tasks 'ps', 'evaluator') is not supported, as in Keras 3 itself (keras#18624). "
    "Instead make every task a 'worker' (at most one 'chief') and train with tfdist.MultiWorkerStrategy: "
    "synchronous data parallelism on all workers; evaluate with fit(validation_data=...) or in a separate "
    "single-process job."
)

JOIN_TIMEOUT_ENV = "TFDIST_JOIN_TIMEOUT"
"""Set by `tfdist-launch`: the default `join_timeout` of `tfdist.MultiWorkerStrategy`, in seconds."""
RUN_DIR_ENV = "TFDIST_RUN_DIR"
"""Set by `tfdist-launch`: a directory every worker of the job writes its flight-recorder status to."""


ClusterError = errors.ClusterError


def _parameter_server_note(jobs) -> str:
    """What to use instead, when `jobs` name a parameter-server training task; else ''."""
    return f" {_NO_PARAMETER_SERVERS}" if {"ps", "evaluator"} & set(jobs) else ""


def _check_address(address, where: str) -> str:
    if not isinstance(address, str) or not address:
        raise ClusterError(f"Invalid worker address {address!r} in {where}. Expected 'host:port'.")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ClusterError(
            f"Invalid worker address {address!r} in {where}: no port. Expected 'host:port', "
            "e.g. '10.0.0.1:12345'."
        )
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise ClusterError(
            f"Invalid port {port!r} in worker address {address!r} in {where}. "
            "Expected an integer from 1 to 65535."
        )
    return address


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The processes of one multi-worker job and the role of this process.

    Attributes:
        workers: addresses ('host:port') of the `worker` job, in task order.
        task_index: index of this process within its job.
        task_type: 'worker' or 'chief'.
        chief: address of the `chief` job's single task, or None when worker 0
            acts as chief.

    Raises:
        ClusterError: for a bad address or port, a duplicate address, an
            unknown task type, or a task index out of range.

    Example:

    >>> c = Cluster(workers=("127.0.0.1:2222", "127.0.0.1:2223"), task_index=1)
    >>> c.num_workers, c.is_chief, c.address
    (2, False, '127.0.0.1:2223')
    >>> c.to_tf_config()
    '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}'
    """

    workers: tuple[str, ...]
    task_index: int
    task_type: str = "worker"
    chief: str | None = None

    def __post_init__(self):
        if isinstance(self.workers, str) or not isinstance(self.workers, Sequence):
            raise ClusterError(
                f"Invalid value for `workers`. Received: workers={self.workers!r}. "
                "Expected a list of 'host:port' strings."
            )
        object.__setattr__(self, "workers", tuple(self.workers))
        if self.task_type not in TASK_TYPES:
            raise ClusterError(
                f"Invalid task type {self.task_type!r}. Expected one of {TASK_TYPES}."
                + _parameter_server_note([self.task_type])
            )
        for address in self.workers:
            _check_address(address, "the worker list")
        if self.chief is not None:
            _check_address(self.chief, "the chief")
        addresses = self.addresses
        if not addresses:
            raise ClusterError("The cluster has no workers. Expected at least one 'host:port'.")
        repeated = sorted(a for a, n in collections.Counter(addresses).items() if n > 1)
        if repeated:
            raise ClusterError(f"Each worker address may appear once; repeated: {repeated}.")
        size = 1 if self.task_type == "chief" else len(self.workers)
        if self.task_type == "chief" and self.chief is None:
            raise ClusterError("task type 'chief' needs a `chief` address, but the cluster has none.")
        if not _validate.is_integer(self.task_index):
            raise ClusterError(
                f"Invalid task index {self.task_index!r}. Expected an integer from 0 to {size - 1}."
            )
        if not 0 <= self.task_index < size:
            raise ClusterError(
                f"Task index {self.task_index} is out of range for job {self.task_type!r} with "
                f"{size} task(s). Expected 0 to {size - 1}."
            )

    @property
    def addresses(self) -> tuple[str, ...]:
        """All addresses, chief first."""
        return ((self.chief,) if self.chief else ()) + self.workers

    @property
    def num_workers(self) -> int:
        """Number of training processes (the chief included)."""
        return len(self.addresses)

    @property
    def rank(self) -> int:
        """Position of this process in `addresses` (0 is the chief)."""
        if self.task_type == "chief":
            return 0
        return self.task_index + (1 if self.chief else 0)

    @property
    def address(self) -> str:
        """This process's own address."""
        return self.addresses[self.rank]

    @property
    def is_chief(self) -> bool:
        """True for the process that writes checkpoints and summaries."""
        return self.rank == 0

    def cluster_dict(self) -> dict[str, list[str]]:
        """The cluster as TensorFlow's ClusterSpec dict."""
        jobs = {"chief": [self.chief]} if self.chief else {}
        jobs["worker"] = list(self.workers)
        return jobs

    def to_tf_config(self) -> str:
        """The `TF_CONFIG` JSON that describes this process."""
        return json.dumps(
            {"cluster": self.cluster_dict(), "task": {"type": self.task_type, "index": self.task_index}}
        )

    def cluster_resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for this process."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster_dict()),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )


def from_tf_config(text: str) -> Cluster:
    """Parses a `TF_CONFIG` JSON string.

    Args:
        text: the JSON, e.g. '{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}}'.

    Returns:
        The validated `Cluster`.

    Raises:
        ClusterError: for malformed JSON, a missing `cluster` or `task`, an
            unsupported job, or any `Cluster` validation error.
    """
    try:
        config = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e}): {text!r}") from e
    if not isinstance(config, dict):
        raise ClusterError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task'; got {text!r}.")
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError(f"TF_CONFIG has no 'cluster' object: {text!r}.")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ClusterError(
            f"TF_CONFIG has no 'task' with 'type' and 'index': {text!r}. "
            'Expected e.g. "task": {"type": "worker", "index": 0}.'
        )
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(
            f"TF_CONFIG has unsupported job(s) {unknown}: {text!r}. Expected only {TASK_TYPES}."
            + _parameter_server_note(unknown)
        )
    chiefs = cluster.get("chief") or []
    if not isinstance(chiefs, list) or len(chiefs) > 1:
        raise ClusterError(f"TF_CONFIG job 'chief' must list at most one address; got {chiefs!r}.")
    workers = cluster.get("worker") or []
    if not isinstance(workers, list):
        raise ClusterError(f"TF_CONFIG job 'worker' must be a list of addresses; got {workers!r}.")
    return Cluster(
        workers=tuple(workers),
        task_index=task["index"],
        task_type=task["type"],
        chief=chiefs[0] if chiefs else None,
    )


# ASCII digits only: `str.isdigit` also accepts characters such as "²" that int() rejects.
_RANGE = re.compile(r"^([0-9]{1,18})(?:-([0-9]{1,18}))?$")
_MAX_SLURM_TASKS = 1_000_000


def _split_top_level(nodelist: str) -> list[str]:
    """The comma-separated items of a node list, commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ClusterError(f"Unbalanced brackets in Slurm node list {nodelist!r}.")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ClusterError(f"Unbalanced brackets in Slurm node list {nodelist!r}.")
    items.append(nodelist[start:])
    return items


def _ranges(part: str, nodelist: str) -> list[tuple[str, str]]:
    """The (first, last) numbers of each range in a bracket part such as "[01-04,07]"."""
    ranges = []
    for rng in part[1:-1].split(","):
        m = _RANGE.match(rng.strip())
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ClusterError(f"Bad range {rng!r} in Slurm node list {nodelist!r}. Expected e.g. '01-04' or '7'.")
        ranges.append((m.group(1), m.group(2) or m.group(1)))
    return ranges


def _parse_nodelist(nodelist: str) -> list[list]:
    """A node list's items, each a list of parts: a literal string, or a bracket's (first, last) ranges."""
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ClusterError(f"Invalid Slurm node list {nodelist!r}. Expected e.g. 'node[01-04,07]'.")
    items = []
    for item in _split_top_level(nodelist):
        parts = re.split(r"(\[[^\]]*\])", item.strip())
        items.append([_ranges(p, nodelist) if p.startswith("[") and p.endswith("]") else p for p in parts])
    return items


def _count_hosts(items: list[list]) -> int:
    """How many hosts the parsed node list names, without expanding it."""
    return sum(
        math.prod(sum(int(hi) - int(lo) + 1 for lo, hi in p) for p in parts if not isinstance(p, str))
        for parts in items
    )


def _expand(items: list[list], nodelist: str) -> list[str]:
    hosts = []
    for parts in items:
        choices = [
            [p] if isinstance(p, str) else [str(n).zfill(len(lo)) for lo, hi in p for n in range(int(lo), int(hi) + 1)]
            for p in parts
        ]
        names = ["".join(p) for p in itertools.product(*choices)]
        if not all(names):
            raise ClusterError(f"Empty host name in Slurm node list {nodelist!r}.")
        hosts += names
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm node list such as `node[01-04,07],login1`.

    Args:
        nodelist: Slurm's compressed host list (`SLURM_JOB_NODELIST`).

    Returns:
        The host names, in order.

    Raises:
        ClusterError: for unbalanced brackets or a bad range.

    Example:

    >>> expand_nodelist("node[01-03,07],gpu1")
    ['node01', 'node02', 'node03', 'node07', 'gpu1']
    """
    return _expand(_parse_nodelist(nodelist), nodelist)


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int:
    value = env.get(name)
    digits = None if value is None else re.fullmatch(r"[0-9]{1,7}", value.strip())
    if not digits or not minimum <= int(value) <= _MAX_SLURM_TASKS:
        shown = repr(value) if value is None or len(value) <= 40 else f"{value[:20]!r}... ({len(value)} characters)"
        raise ClusterError(
            f"Slurm variable {name}={shown} is missing or not an integer from {minimum} to {_MAX_SLURM_TASKS}."
        )
    return int(value)


def from_slurm(env: Mapping[str, str], port: int = DEFAULT_SLURM_PORT) -> Cluster:
    """Builds the cluster of a Slurm job step (block task distribution).

    Args:
        env: the environment, with `SLURM_PROCID`, `SLURM_NTASKS` and
            `SLURM_JOB_NODELIST` (or `SLURM_STEP_NODELIST`).
        port: port of the first task on each node; task k of a node uses
            `port + k`.

    Returns:
        The validated `Cluster`; Slurm rank r is worker r.

    Raises:
        ClusterError: for missing or non-integer variables, a bad port, more
            nodes than tasks (refused before the node list is expanded), or
            tasks not dividing evenly over the nodes.
    """
    if not _validate.is_integer(port, minimum=1, maximum=65535):
        raise ClusterError(f"Invalid Slurm base port {port!r}. Expected an integer from 1 to 65535.")
    name = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = env.get(name)
    ntasks = _env_int(env, "SLURM_NTASKS", minimum=1)
    rank = _env_int(env, "SLURM_PROCID", minimum=0)
    items = _parse_nodelist(nodelist)
    count = _count_hosts(items)
    if count > ntasks:  # refused before it is expanded: n[0-999999999] costs no memory
        raise ClusterError(
            f"{name}={nodelist!r} names {count} node(s), more than SLURM_NTASKS={ntasks}. Expected at most "
            f"{ntasks} node(s): every node runs at least one task."
        )
    hosts = _expand(items, nodelist)
    if ntasks % len(hosts):
        raise ClusterError(
            f"SLURM_NTASKS={ntasks} does not split evenly over the {len(hosts)} node(s) of {nodelist!r}. "
            "Use the same number of tasks on every node (e.g. --ntasks-per-node)."
        )
    per_node = ntasks // len(hosts)
    if port + per_node - 1 > 65535:
        raise ClusterError(f"Slurm base port {port} + {per_node} tasks per node exceeds 65535.")
    workers = tuple(f"{hosts[r // per_node]}:{port + r % per_node}" for r in range(ntasks))
    return Cluster(workers=workers, task_index=rank)


def resolve(
    workers: Sequence[str] | None = None,
    task_index: int | None = None,
    env: Mapping[str, str] | None = None,
    slurm_port: int = DEFAULT_SLURM_PORT,
) -> Cluster | None:
    """Finds the cluster this process belongs to.

    Sources, first match wins: explicit `workers` + `task_index`; `TF_CONFIG`;
    Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST`).

    Args:
        workers: explicit 'host:port' addresses, one per process.
        task_index: this process's index in `workers` (required with `workers`).
        env: the environment to read; defaults to `os.environ`.
        slurm_port: base port for Slurm tasks (see `from_slurm`).

    Returns:
        A validated `Cluster`, or None when no source describes a cluster (a
        single process).

    Raises:
        ClusterError: for any invalid description; the message quotes it.

    Example:

    >>> resolve(env={"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, '
    ...                            '"task": {"type": "worker", "index": 1}}'}).address
    'b:1'
    >>> resolve(env={"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}).workers
    ('n1:8476', 'n2:8476')
    """
    if workers is not None:
        if task_index is None:
            raise ClusterError(
                f"`workers` was given ({list(workers)!r}) but `task_index` was not. Pass the index of "
                "this process in `workers`."
            )
        return Cluster(workers=workers, task_index=task_index)
    if task_index is not None:
        raise ClusterError(f"`task_index={task_index!r}` was given without `workers`.")
    env = os.environ if env is None else env
    if env.get("TF_CONFIG", "").strip():
        return from_tf_config(env["TF_CONFIG"])
    if env.get("SLURM_JOB_NODELIST") or env.get("SLURM_STEP_NODELIST"):
        return from_slurm(env, port=slurm_port)
    return None


def join_timeout(env: Mapping[str, str] | None = None) -> float | None:
    """The start-up join timeout `tfdist-launch` passes to its workers, or None.

    Args:
        env: the environment to read; defaults to `os.environ`.

    Raises:
        ClusterError: when `TFDIST_JOIN_TIMEOUT` is not a number of seconds in (0, 1e9].

    Example:

    >>> join_timeout(env={"TFDIST_JOIN_TIMEOUT": "30"})
    30.0
    """
    env = os.environ if env is None else env
    value = env.get(JOIN_TIMEOUT_ENV)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= _validate.MAX_SECONDS:  # False for NaN and infinity too
        raise ClusterError(
            f"{JOIN_TIMEOUT_ENV}={value!r} is not a positive number of seconds. Expected a number in "
            f"(0, {_validate.MAX_SECONDS:g}]."
        )
    return seconds


def run_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The job's run directory (`TFDIST_RUN_DIR`, which `tfdist-launch` sets), or None.

    Every worker keeps its flight-recorder status there (see `tfdist.flight`),
    so the others learn its progress. Elsewhere, set it to a directory all
    workers share (the same path on every host).

    Args:
        env: the environment to read; defaults to `os.environ`.

    Raises:
        ClusterError: when `TFDIST_RUN_DIR` is set but is not a directory.

    Example:

    >>> run_dir(env={}) is None
    True
    >>> run_dir(env={"TFDIST_RUN_DIR": "/"})
    '/'
    """
    env = os.environ if env is None else env
    value = env.get(RUN_DIR_ENV)
    if not value:
        return None
    if not os.path.isdir(value):
        raise ClusterError(
            f"{RUN_DIR_ENV}={value!r} is not a directory. Expected an existing directory every worker of the job "
            "can write (tfdist-launch makes one), or leave the variable unset."
        )
    return value
