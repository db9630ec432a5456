"""One DTensor mesh over several processes: DTensor's environment and runtime, derived from a `tfdist.cluster.Cluster`.

DTensor's multi-client mode runs one process ("client") per host; every process
runs the same SPMD program on its own devices and DTensor's collectives cross
processes over gRPC. tfdist sets it up from the cluster the way
`MultiWorkerStrategy` does: the `DTENSOR_*` variables DTensor reads come from
the cluster (variables set by hand must agree with it), TensorFlow's
coordination service gets tfdist's bounds (a heartbeat that declares a dead
peer, a start-up join timeout), and the global mesh puts the devices of process
`r` at global device ids `[r * L, (r + 1) * L)` (L local devices each): the
first mesh axis varies slowest, so on 2 processes x 4 devices
`{"batch": 2, "model": 4}` keeps each model-parallel group in one process and
`{"batch": 1, "model": 8}` splits the model over both.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping

import numpy as np
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.core.protobuf import cluster_pb2
from tensorflow.core.protobuf import tensorflow_server_pb2
from tensorflow.dtensor.python import accelerator_util
from tensorflow.dtensor.python import layout as layout_lib
from tensorflow.python.eager import context
from tensorflow.python.framework import device as tf_device

from tfdist import cluster as cluster_lib

JOB_NAME = "worker"
ENV_NAMES = ("DTENSOR_CLIENT_ID", "DTENSOR_NUM_CLIENTS", "DTENSOR_JOB_NAME", "DTENSOR_JOBS")
WHO = "tfdist.ModelParallelStrategy"


def dtensor_environment(cluster: cluster_lib.Cluster) -> dict[str, str]:
    """The `DTENSOR_*` variables that describe `cluster` to DTensor (this process is `cluster.rank`)."""
    return {
        "DTENSOR_CLIENT_ID": str(cluster.rank),
        "DTENSOR_NUM_CLIENTS": str(cluster.num_workers),
        "DTENSOR_JOB_NAME": JOB_NAME,
        "DTENSOR_JOBS": ",".join(cluster.addresses),
    }


def check_environment(cluster: cluster_lib.Cluster, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The DTensor environment of `cluster`, after checking the variables already set agree with it.

    Raises:
        tfdist.cluster.ClusterError: naming each variable that disagrees, its
            value and the value the cluster gives.
    """
    env = os.environ if env is None else env
    wanted = dtensor_environment(cluster)
    wrong = [(k, env[k], v) for k, v in wanted.items() if env.get(k) not in (None, v)]
    if wrong:
        lines = "; ".join(f"{k}={have!r} (the cluster gives {want!r})" for k, have, want in wrong)
        raise cluster_lib.ClusterError(
            f"{WHO}: DTensor environment variables set by hand disagree with the cluster {list(cluster.addresses)} "
            f"(this process: worker {cluster.rank}, {cluster.address}): {lines}. tfdist derives them from the "
            "cluster (TF_CONFIG, Slurm or explicit workers): unset them, or make the cluster agree."
        )
    return wanted


def initialize(
    cluster: cluster_lib.Cluster, *, heartbeat_timeout: float, join_timeout: float, device_type: str, bounded_join
) -> None:
    """Starts this process' part of the multi-process DTensor runtime (once, before any TensorFlow op).

    Args:
        cluster: the cluster; this process is `cluster.rank`.
        heartbeat_timeout: seconds without a heartbeat after which a peer counts as dead.
        join_timeout: seconds to wait at start-up for every process to join.
        device_type: "CPU" or "GPU", the type of the mesh's devices.
        bounded_join: a context manager factory `(cluster, join_timeout, who)` that turns a failed or
            endless start-up rendezvous into a clear error.

    Raises:
        RuntimeError: if TensorFlow's runtime is already initialized (a tensor,
            model or other strategy was created first) or a multi-process
            DTensor runtime was started before in this process.
        tfdist.cluster.ClusterError: for DTensor variables that disagree with the cluster.
    """
    env = check_environment(cluster)
    ctx = context.context()
    if accelerator_util.is_initialized():
        raise RuntimeError(
            f"{WHO}: DTensor's runtime is already initialized in this process (by an earlier "
            "ModelParallelStrategy across processes or dtensor.initialize_accelerator_system); it cannot be "
            "initialized twice. Build one ModelParallelStrategy per process and reuse it."
        )
    if ctx._context_handle is not None:  # noqa: SLF001 - the only way to ask whether the runtime started
        raise RuntimeError(
            f"{WHO}: TensorFlow's runtime is already initialized in worker {cluster.rank} ({cluster.address}), so "
            "this process can no longer join a multi-process mesh. Construct ModelParallelStrategy first thing, "
            "before any TensorFlow op, tensor, model or other strategy (tfdist.simulate_devices may come before "
            "it)."
        )
    os.environ.update(env)
    leader = f"/job:{JOB_NAME}/replica:0/task:0"
    ctx.configure_collective_ops(collective_leader=leader)
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=leader,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=JOB_NAME, num_tasks=cluster.num_workers)],
        heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
        cluster_register_timeout_in_ms=int(join_timeout * 1000),
        shutdown_barrier_timeout_in_ms=int(heartbeat_timeout * 1000),
    )
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name=JOB_NAME, tasks=dict(enumerate(cluster.addresses)))
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=cluster_def,
        default_session_config=context.get_config(),
        job_name=JOB_NAME,
        task_index=cluster.rank,
        protocol="grpc",
    )
    server_def.default_session_config.rpc_options.num_channels_per_target = 4
    server_def.default_session_config.experimental.recv_buf_max_chunk = -1
    with bounded_join(cluster, join_timeout, WHO):
        ctx.enable_collective_ops(server_def)
        context.ensure_initialized()
    accelerator_util.set_initialized(device_type)  # lets dtensor.create_distributed_mesh & co. work in user code


def check_blocks(axes: Mapping[str, int], local: int, num_processes: int) -> None:
    """Checks that each process' `local` consecutive devices form a block of the mesh (whole rows).

    Process r holds global device ids [r * local, (r + 1) * local): a block
    when, for some axis k, the product of the axes after k divides `local` and
    `local` divides the product of axes k and after. Otherwise a process would
    hold part of one batch row and part of another, which the mesh's batch
    rows (and DTensor's input packing) do not allow.

    Raises:
        ValueError: naming the mesh, the devices per process and the axis sizes that would work.
    """
    sizes = list(axes.values())
    for k in range(len(sizes) + 1):
        inner = math.prod(sizes[k:])
        after = math.prod(sizes[k + 1 :]) if k < len(sizes) else 1
        if inner % local == 0 and local % after == 0:
            return
    raise ValueError(
        f"{WHO}: the mesh {dict(axes)!r} over {num_processes} processes x {local} devices gives a process devices "
        f"from parts of several rows of the mesh: the {local} devices of a process must fill whole rows of the "
        "last axes (the product of the last axes must divide or be a multiple of the devices per process). "
        f"For example, make the last axis {local}, a divisor of {local} or a multiple of it."
    )


def planned_local_devices(devices) -> int:
    """How many devices this process will put in the mesh, found without starting TensorFlow's runtime."""
    import tensorflow as tf

    if devices is not None:
        if isinstance(devices, str) or not list(devices):
            raise ValueError(
                f"Invalid `devices`: {devices!r}. Expected a non-empty list of device names such as ['CPU:0']."
            )
        return len(list(devices))
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return len(gpus)
    cpu = tf.config.list_physical_devices("CPU")[0]
    return len(tf.config.get_logical_device_configuration(cpu) or [None])


def check_mesh(axes: Mapping[str, int], local: int, cluster: cluster_lib.Cluster) -> None:
    """Checks the mesh against the cluster's device count and this process' block of devices (see `check_blocks`).

    Raises:
        ValueError: if the mesh size is not the total device count, or the
            local devices do not form a block of the mesh.
    """
    n = cluster.num_workers
    size = math.prod(axes.values())
    if size != local * n:
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ValueError(
            f"{WHO}: the mesh {dict(axes)!r} ({shape}) needs {size} devices, but the {n} processes of the cluster "
            f"{list(cluster.addresses)} have {local} each (worker {cluster.rank} here): {n * local} in all. Choose "
            f"axis sizes whose product is {n * local} (every process contributes the same number of devices)."
        )
    check_blocks(axes, local, n)


def make_mesh(axes: Mapping[str, int], local_devices: list[str], cluster: cluster_lib.Cluster) -> layout_lib.Mesh:
    """The global mesh over every process' devices; this process holds `local_devices` (short names, one type).

    Raises:
        ValueError: as `check_mesh`.
    """
    local = len(local_devices)
    check_mesh(axes, local, cluster)
    size = math.prod(axes.values())
    spec = tf_device.DeviceSpec(job=JOB_NAME, replica=0, task=cluster.rank)
    specs = [spec.make_merged_spec(tf_device.DeviceSpec.from_string(d)) for d in local_devices]
    ids = np.arange(size).reshape(list(axes.values()))
    flat = np.ravel(ids).tolist()
    return layout_lib.Mesh(
        dim_names=list(axes),
        global_device_ids=ids,
        local_device_ids=flat[cluster.rank * local : (cluster.rank + 1) * local],
        local_devices=specs,
    )


def local_devices(devices, cluster: cluster_lib.Cluster) -> list[str]:
    """This process' devices as short names ("CPU:0"): `devices`, else all local GPUs, else all logical CPUs.

    Raises:
        ValueError: for a device this process does not have, or one given twice.
    """
    import tensorflow as tf

    def is_local(spec):
        return spec.job in (None, "localhost") or (spec.job == JOB_NAME and spec.task == cluster.rank)

    have = {}
    for d in tf.config.list_logical_devices():
        spec = tf_device.DeviceSpec.from_string(d.name)
        if is_local(spec) and spec.device_type in ("CPU", "GPU"):
            have.setdefault(f"{spec.device_type}:{spec.device_index}", spec)
    if devices is None:
        kind = "GPU" if any(k.startswith("GPU:") for k in have) else "CPU"
        return sorted((k for k in have if k.startswith(kind + ":")), key=lambda k: int(k.split(":")[1]))
    if isinstance(devices, str) or not list(devices):
        raise ValueError(f"Invalid `devices`: {devices!r}. Expected a non-empty list of names such as ['CPU:0'].")
    names = []
    for d in devices:
        spec = tf_device.DeviceSpec.from_string(d if d.startswith("/") else "/device:" + d)
        name = f"{(spec.device_type or '').upper()}:{spec.device_index or 0}"
        if name not in have:
            raise ValueError(f"Device {d!r} does not exist in worker {cluster.rank}. Its devices: {sorted(have)}.")
        names.append(name)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"Each device may appear once in `devices`; repeated: {repeated}.")
    return names


_WATCHDOG = r"""
import os, select, signal, socket, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid, timeout, heartbeat, notice = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
me, peers = sys.argv[5], sys.argv[6:]
fd = sys.stdin.fileno()
depth, since = 0, None
seen = {p: time.monotonic() for p in peers}
def stop(reason, advice):
    # The process first gets up to 2 s to print its flight-recorder summary: it answers b"r" on the pipe.
    os.write(notice, reason.encode() + b"\n")
    end = time.monotonic() + 2.0
    while time.monotonic() < end and select.select([fd], [], [], max(end - time.monotonic(), 0))[0]:
        data = os.read(fd, 4096)
        if not data or b"r" in data:
            break
    sys.stderr.write(f"tfdist.ModelParallelStrategy: {me}: {reason}{advice} Ending this process.\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
    sys.exit(0)
while True:
    if select.select([fd], [], [], 1.0)[0]:
        data = os.read(fd, 4096)
        if not data:
            sys.exit(0)  # the process closed the pipe or ended
        for c in data:
            if c in b"be":
                depth += 1 if c == 98 else -1  # b"b": a distributed call begins; b"e": it ends
        since = (since or time.monotonic()) if depth > 0 else None
    now = time.monotonic()
    for peer in peers:
        index, address = peer.split("@", 1)
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            seen[peer] = now
        except OSError:
            pass
        if depth > 0 and now - seen[peer] > heartbeat + 10:  # TensorFlow's own heartbeat error comes first
            stop(f"worker {index} ({address}) is lost: it has not answered for {now - seen[peer]:.0f}s "
                 f"(heartbeat_timeout={heartbeat:g}s) while this process waits for it in a distributed step", ".")
    if timeout > 0 and since is not None and now - since > timeout:
        stop(f"a distributed step has run for more than timeout={timeout:g}s", "; every peer still answers, so one "
             "of them is stuck (or the step is slower than the timeout: raise `timeout`).")
"""


class ProcessWatchdog:
    """Ends this process when a peer is lost or a distributed step overruns, even while TensorFlow holds the GIL.

    A multi-process DTensor step blocks inside TensorFlow's C++ runtime: a
    dead or stuck peer would leave it waiting forever, and a Python thread
    cannot run to notice. A small watchdog process is told (through a pipe)
    when each distributed call begins and ends; while one runs, it checks every
    second that each peer's server still accepts connections. A peer that
    does not for `heartbeat_timeout` seconds, or a call longer than `timeout`,
    makes it print which worker was lost (or that a step overran) and kill this
    process, so the job ends with an error in bounded time.

    Before it kills, it tells this process why (`on_stop`, e.g. the flight
    recorder's report, runs in a thread of this process) and waits up to 2 s
    for it.

    Args:
        cluster: the cluster; this process is `cluster.rank`.
        timeout: seconds a distributed call may run; None: unbounded.
        heartbeat_timeout: seconds a peer may go unanswered during a call.
        on_stop: called with the reason (a sentence) just before the watchdog
            kills this process, or None.
    """

    def __init__(
        self, cluster: cluster_lib.Cluster, *, timeout: float | None, heartbeat_timeout: float, on_stop=None
    ):
        import subprocess
        import sys
        import threading

        peers = [f"{i}@{a}" for i, a in enumerate(cluster.addresses) if i != cluster.rank]
        me = f"worker {cluster.rank} ({cluster.address})"
        notice, self._notice_w = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), str(timeout or 0), str(heartbeat_timeout),
                 str(self._notice_w), me, *peers],
                stdin=subprocess.PIPE,
                pass_fds=(self._notice_w,),
            )  # fmt: skip
        finally:
            os.close(self._notice_w)
        self._fd = self._process.stdin.fileno()
        self._cluster = cluster
        self._me = me
        self._on_stop = on_stop
        threading.Thread(target=self._hear, args=(notice,), name="tfdist-watchdog-notice", daemon=True).start()

    def _hear(self, notice: int) -> None:
        """Waits for the watchdog's notice that it is about to kill this process; answers once `on_stop` ran."""
        with os.fdopen(notice, "rb") as pipe:
            reason = pipe.readline().decode(errors="replace").strip()
        if not reason:  # the watchdog ended without killing
            return
        if self._on_stop is not None:
            self._on_stop(reason)
        with contextlib.suppress(OSError):
            os.write(self._fd, b"r")

    def running(self):
        """A context manager around one distributed call; a peer's failure in it is re-raised naming the peer."""
        return _Running(self._fd, self._explain)

    def _explain(self, error):
        """`error` (a TensorFlow error of a distributed call) with the lost workers named, or None to keep it."""
        from tensorflow.python.framework import errors

        if not isinstance(
            error, (errors.UnavailableError, errors.AbortedError, errors.InternalError, errors.CancelledError)
        ):
            return None
        tasks = {int(t) for t in re.findall(rf"/job:{JOB_NAME}/(?:replica:\d+/)?task:(\d+)", error.message)}
        tasks = {t for t in tasks if t < self._cluster.num_workers and t != self._cluster.rank}
        if not tasks:
            # A later call poisoned by a peer's earlier failure ("Function was cancelled before it was started")
            # names no task: the peers whose servers no longer accept connections are the lost ones.
            tasks = {t for t, a in enumerate(self._cluster.addresses) if t != self._cluster.rank and not _reachable(a)}
        lost = [f"worker {t} ({self._cluster.addresses[t]})" for t in sorted(tasks)]
        if not lost:
            return None
        first = error.message.strip().splitlines()[0]
        message = (
            f"{WHO}: {self._me} lost {', '.join(lost)} during a distributed step (the process ended or its "
            f"machine is unreachable; see its log). TensorFlow: {first}"
        )
        return type(error)(error.node_def, error.op, message)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait()


def _reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a TensorFlow server listens at `address` ("host:port")."""
    import socket

    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError:
        return False
    return True


class _Running:
    __slots__ = ("_explain", "_fd")

    def __init__(self, fd, explain):
        self._fd = fd
        self._explain = explain

    def __enter__(self):
        os.write(self._fd, b"b")

    def __exit__(self, kind, error, traceback):
        os.write(self._fd, b"e")
        explained = self._explain(error) if error is not None else None
        if explained is not None:
            raise explained from error
