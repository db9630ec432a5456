"""Multi-worker data parallelism: one process per machine, collectives between them."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import warnings

import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import collective_all_reduce_strategy as collective_lib
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

from tfdist import _compat
from tfdist import _validate
from tfdist import cluster as cluster_lib
from tfdist import errors
from tfdist import flight
from tfdist._compat import step_deadline
from tfdist.strategies import _deadline
from tfdist.strategies import _exact
from tfdist.strategies import _mirrored
from tfdist.strategies import topology as topology_lib

COMMUNICATION_CHOICES = ("auto", "ring", "nccl")
SHARDING_CHOICES = ("auto", "file", "data", "off")
GRADIENT_DTYPES = _exact.GRADIENT_DTYPES
_SHARD_POLICIES = {
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}
# tf.data source ops that read files: a dataset built on them can be sharded by file.
_FILE_READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "TextLineDatasetV2",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
    }
)
DEFAULT_TIMEOUT = 300.0
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_JOIN_TIMEOUT = 300.0
_JOIN_GRACE = 10.0


def _positive(name: str, value, *, allow_none: bool = False) -> float | None:
    return _validate.positive_number(name, value, allow_none=allow_none, unit="seconds")


DataShardingWarning = errors.DataShardingWarning


def reads_files(dataset: tf.data.Dataset) -> bool:
    """True when `dataset` reads TFRecord / text / fixed-length record files (can be sharded by file)."""
    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    return bool(ops & _FILE_READER_OPS)


def shard_dataset(dataset: tf.data.Dataset, sharding: str, num_workers: int) -> tf.data.Dataset:
    """Sets the dataset's auto-shard policy explicitly (TF's AUTO silently falls back to DATA).

    A policy the dataset already carries (other than AUTO) is kept. With
    `sharding="auto"`, a dataset reading files is sharded by FILE (each worker
    reads 1/num_workers of the files; needs at least num_workers files);
    any other dataset by DATA, with a `DataShardingWarning`: each worker then
    reads every element and keeps its part of each global batch, which is
    exact but reads num_workers times the data.
    """
    current = dataset.options().experimental_distribute.auto_shard_policy
    if current != tf.data.experimental.AutoShardPolicy.AUTO:
        return dataset
    if sharding == "auto":
        sharding = "file" if reads_files(dataset) else "data"
        if sharding == "data":
            warnings.warn(
                f"tfdist.MultiWorkerStrategy: the dataset reads no files, so each of the {num_workers} workers "
                "reads all of it and keeps its share of every global batch (DATA sharding; exact, but "
                f"{num_workers}x the input work). For large data, read TFRecord/text files (sharded by file), "
                "or pass sharding='data' to silence this warning.",
                DataShardingWarning,
                stacklevel=3,
            )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = _SHARD_POLICIES[sharding]
    return dataset.with_options(options)


class _MultiWorkerExtended(_exact.ExactReplicas, collective_lib.CollectiveAllReduceExtended):
    """CollectiveAllReduceExtended with tfdist's exact loss weighting across workers.

    Args:
        container_strategy, cluster_resolver, communication_options: as CollectiveAllReduceExtended's.
        sharding: one of `SHARDING_CHOICES`, how `tf.data.Dataset`s are split over workers.
        gradient_dtype: see `tfdist.strategies._exact.ExactReplicas`.
    """

    def __init__(self, container_strategy, *, cluster_resolver, communication_options, sharding, gradient_dtype):
        self._tfdist_sharding = sharding
        super().__init__(
            container_strategy,
            cluster_resolver=cluster_resolver,
            communication_options=communication_options,
            gradient_dtype=gradient_dtype,
        )

    def _experimental_distribute_dataset(self, dataset, options):
        if self._num_workers > 1 and isinstance(dataset, tf.data.Dataset):
            dataset = shard_dataset(dataset, self._tfdist_sharding, self._num_workers)
        return super()._experimental_distribute_dataset(dataset, options)

    def _tfdist_global_count(self, local_count):
        if self._num_workers == 1:
            return local_count
        total = self._host_cross_device_ops.reduce(
            tf.distribute.ReduceOp.SUM, local_count, destinations=self._worker_device
        )
        return self._local_results(total)[0]


def _configure_coordination(cluster_resolver, heartbeat_timeout: float, join_timeout: float) -> None:
    """Sets up TF's coordination service with our bounds (MWMS would use unbounded defaults)."""
    spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    if not spec.as_dict() or context.context().coordination_service is not None:
        return
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
        cluster_register_timeout_in_ms=int(join_timeout * 1000),
        shutdown_barrier_timeout_in_ms=int(heartbeat_timeout * 1000),
    )


_WATCHDOG = """
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    sys.stderr.write(message)
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
"""


@contextlib.contextmanager
def _bounded_join(cluster: cluster_lib.Cluster | None, join_timeout: float, who: str = "tfdist.MultiWorkerStrategy"):
    """Bounds TensorFlow's start-up rendezvous.

    A non-leader worker fails with DeadlineExceeded once `join_timeout` passes;
    this turns that into a clear error. The leader (worker 0) blocks inside
    TensorFlow's C++ runtime, holding the GIL, with no deadline while peers are
    missing: a watchdog process reports the problem and kills it.
    """
    if cluster is None:
        yield
        return
    what = (
        f"worker {cluster.rank} ({cluster.address}) of a {cluster.num_workers}-worker cluster "
        f"{list(cluster.addresses)}"
    )
    deadline = join_timeout + _JOIN_GRACE
    message = (
        f"{who}: {what}: not every worker joined within {deadline:g}s "
        f"(join_timeout={join_timeout:g}s + {_JOIN_GRACE:g}s). Start all workers, check the addresses, "
        "or raise join_timeout. Killing this process.\n"
    )
    watchdog = subprocess.Popen(
        [sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), str(deadline), message],
        stdin=subprocess.PIPE,
    )
    try:
        yield
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in e.message:
            raise
        port = cluster.address.rsplit(":", 1)[-1]
        raise cluster_lib.ClusterError(
            f"{who}: {what}: cannot listen on port {port} of its address "
            f"{cluster.address!r}: the port is in use by another process (TensorFlow listens on "
            f"0.0.0.0:{port}). Stop that process or give this worker another port."
        ) from e
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
        raise RuntimeError(
            f"{who}: {what} could not join the cluster within "
            f"join_timeout={join_timeout:g}s: {e.message.splitlines()[0]}. Start all workers, check the "
            "addresses, or raise join_timeout."
        ) from e
    finally:
        watchdog.stdin.close()
        watchdog.wait()


_EXIT_BARRIER = "tfdist_exit"


def _leave_together(cluster: cluster_lib.Cluster, heartbeat_timeout: float, who: str) -> None:
    """Registers an exit hook that keeps this process until every worker of `cluster` is at its end too.

    A collective can finish in one process while a peer is still receiving the
    last of it from that process (ring and DTensor transfers are pulled by the
    receiver; DTensor's eager ops also run asynchronously). A worker that
    exits at once (worker 0 saving the model and printing its summary first,
    say) takes its server down under a peer's last collective, and the peer
    fails with "Collective ops is aborted ... failed to connect" at the very
    end of a good run (tensorflow#58434). At interpreter exit each worker
    therefore finishes its pending ops and waits at a coordination-service
    barrier for the others, for at most 2 x `heartbeat_timeout` seconds.

    Not after an uncaught exception (the process is failing: it leaves at
    once). When a peer does not arrive in time (still working, or stopped
    by a signal), this process says so on stderr and leaves.
    """
    atexit.register(_wait_for_peers_at_exit, cluster, 2 * heartbeat_timeout, who)


def _wait_for_peers_at_exit(cluster: cluster_lib.Cluster, wait: float, who: str) -> None:
    if getattr(sys, "last_value", None) is not None:  # set by Python for an uncaught exception
        return
    if _terminated_by is not None:
        # Stopped by a signal (a scheduler or tfdist-launch stops every worker): a peer may be inside a step
        # that waits for this process and will not reach the barrier until this process is gone.
        return
    try:
        context.async_wait()  # this process' own ops first: a failed one means it is failing
    except tf.errors.OpError:
        return
    error = None
    with flight.phase("barrier", "exit"):  # a failure here is no failure of the job: no flight report
        try:
            context.context().wait_at_barrier(_EXIT_BARRIER, int(wait * 1000))
        except tf.errors.OpError as e:
            error = e
    # Unavailable: the coordination service (worker 0) is gone, after the barrier or failing; FailedPrecondition:
    # it is in error, because a peer failed or gave up waiting first (and said so). Either way: leave quietly.
    if error is None or isinstance(error, (tf.errors.UnavailableError, tf.errors.FailedPreconditionError)):
        return
    sys.stderr.write(
        f"{who}: worker {cluster.rank} ({cluster.address}) leaves before every peer reached its end: it waited "
        f"{wait:g}s (2 x heartbeat_timeout) at exit. A peer still receiving a collective from it may fail. "
        f"TensorFlow: {flight.error_line(error)}\n"
    )
    sys.stderr.flush()


@contextlib.contextmanager
def _keep_sigterm_handler():
    """Puts back the process' SIGTERM handler after TensorFlow's runtime replaced it.

    Enabling collectives starts TensorFlow's preemption notifier, which installs a C-level
    SIGTERM handler that only records the signal: the process no longer ends on SIGTERM, and
    Python-level handlers (BackupAndRestore's preemption save, a binary's cleanup) never run.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        # A Python handler runs only between bytecodes: the default action (ending the process at once, even
        # inside a step) stays the default action.
        signal.signal(signal.SIGTERM, _NotingHandler(previous) if callable(previous) else previous or signal.SIG_DFL)


_terminated_by: int | None = None  # the signal that is ending this process, seen by _NotingHandler


class _NotingHandler:
    """A SIGTERM handler that notes the signal (the exit then skips the peers' barrier) and runs `previous`."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        global _terminated_by
        _terminated_by = signum
        return self.previous(signum, frame)


class MultiWorkerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism over processes that matches single-device training.

    A `tf.distribute.MultiWorkerMirroredStrategy` with which Keras 3 `fit`,
    `evaluate` and `predict` work (plain MWMS fails in Keras 3's trainer), each
    example of the global batch weighs the same even when the batch splits
    unevenly over workers, and failures are bounded: a dead peer is detected by
    the coordination-service heartbeat, a stuck peer by the collective
    `timeout`, and absent peers at start-up by `join_timeout`. In a job of
    several workers each keeps a flight recorder (`tfdist.flight`): when a
    peer is lost or stuck, or `tfdist-launch` stops the job, every surviving
    worker prints one summary of where it and the missing peers were.

    Construct it first thing in the program, before any TensorFlow op. The
    SIGTERM handler in place then stays in place (TensorFlow's runtime would
    swallow the signal), so a SIGTERM ends the worker or reaches
    `tfdist.callbacks.BackupAndRestore`'s preemption save.

    Args:
        cluster: a `tfdist.cluster.Cluster`; defaults to `tfdist.cluster.resolve()`
            (TF_CONFIG, then Slurm). Without any, trains in this process alone.
        communication: collective implementation: "auto", "ring" or "nccl".
        timeout: seconds a distributed step (one call of a traced function
            with collectives: a Keras train/test/predict step, a custom
            loop's `tf.function`) may run before its collectives are aborted
            and it fails with DeadlineExceeded (a stuck peer); None waits
            forever. One watchdog thread enforces it (TensorFlow's own
            collective timeout starts a thread per collective and exhausts
            the process' threads in long runs).
        heartbeat_timeout: seconds without a heartbeat after which a peer
            counts as dead and every worker fails. At exit each worker also
            waits up to twice this for the others to reach their end, so that
            none takes its server down under a peer's last collective.
        join_timeout: seconds to wait at start-up for all workers to join;
            defaults to what `tfdist-launch --join_timeout` set, else 300. A
            worker then raises RuntimeError; worker 0, which TensorFlow blocks
            in C++, is killed (SIGKILL) with a message on stderr 10 s later.
        sharding: how `fit`/`experimental_distribute_dataset` split a
            `tf.data.Dataset` over workers: "auto" (by file when the dataset
            reads TFRecord/text files, else by data with a
            `DataShardingWarning`), "file", "data", or "off" (each worker
            gets its own input already). A policy set on the dataset's
            options wins.
        gradient_dtype: None (all-reduce gradients in their own dtype), or
            "bfloat16" / "float16": wider float gradients are cast to it for
            the all-reduce (half the bytes on the wire) and back afterwards;
            weights drift slightly from a float32 all-reduce.
        batch_statistics: "replica" (default: BatchNormalization and MoE
            load-balancing losses compute from each worker's replica's part
            of the global batch; `fit` warns once) or "global" (from the
            global batch, as on one device). See
            `tfdist.DataParallelStrategy`.

    Raises:
        ValueError: for an unknown `communication`, `sharding`,
            `gradient_dtype` or `batch_statistics`, or a non-positive timeout.
        RuntimeError: when the peers do not join within `join_timeout`.
        tfdist.cluster.ClusterError: for an invalid cluster description.

    Example (each of two processes, e.g. under `tfdist-launch -n 2`):

    >>> import tfdist  # doctest: +SKIP
    >>> strategy = tfdist.MultiWorkerStrategy(timeout=120)  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(x, y, batch_size=64)  # global batch, split over workers  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        cluster: cluster_lib.Cluster | None = None,
        communication: str = "auto",
        timeout: float | None = DEFAULT_TIMEOUT,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        join_timeout: float | None = None,
        sharding: str = "auto",
        gradient_dtype: str | None = None,
        batch_statistics: str = "replica",
    ):
        _validate.one_of("communication", communication, COMMUNICATION_CHOICES)
        if communication == "nccl" and not tf.config.list_physical_devices("GPU"):
            raise ValueError(
                "communication='nccl' needs GPUs, and this machine has none. Use communication='auto' or 'ring'."
            )
        _validate.one_of("sharding", sharding, SHARDING_CHOICES)
        _validate.one_of("gradient_dtype", gradient_dtype, GRADIENT_DTYPES)
        _validate.one_of("batch_statistics", batch_statistics, _exact.BATCH_STATISTICS)
        timeout = _positive("timeout", timeout, allow_none=True)
        heartbeat_timeout = _positive("heartbeat_timeout", heartbeat_timeout)
        if join_timeout is None:
            join_timeout = cluster_lib.join_timeout() or DEFAULT_JOIN_TIMEOUT
        join_timeout = _positive("join_timeout", join_timeout)
        if cluster is None:
            cluster = cluster_lib.resolve()
        elif not isinstance(cluster, cluster_lib.Cluster):
            raise _validate.invalid("cluster", cluster, "a tfdist.cluster.Cluster (see tfdist.cluster.resolve) or None")
        _compat.install("multi_worker")
        self._cluster = cluster
        self._communication = communication
        self._timeout = timeout
        resolver = (
            cluster.cluster_resolver()
            if cluster is not None
            else tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
        )
        _configure_coordination(resolver, heartbeat_timeout, join_timeout)
        # No `timeout_seconds` here: TensorFlow would start one sleeping thread per collective executed
        # (see _deadline.py); the step deadline below bounds stuck peers instead.
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=getattr(tf.distribute.experimental.CommunicationImplementation, communication.upper()),
        )
        recorder = flight.start(cluster) if cluster is not None and cluster.num_workers > 1 else None
        with _bounded_join(cluster, join_timeout), _keep_sigterm_handler(), flight.phase("barrier", "join"):
            extended = _MultiWorkerExtended(
                self,
                cluster_resolver=resolver,
                communication_options=options,
                sharding=sharding,
                gradient_dtype=gradient_dtype,
            )
        if timeout is not None and recorder is not None:
            step_deadline.set_step_deadline(
                _deadline.StepDeadline(
                    timeout=timeout,
                    what=f"worker {cluster.rank} ({cluster.address})",
                    on_expire=lambda _: recorder.report(f"a distributed step ran for more than timeout={timeout:g}s"),
                )
            )
        if recorder is not None:
            _leave_together(cluster, heartbeat_timeout, "tfdist.MultiWorkerStrategy")
        self._gradient_dtype = gradient_dtype
        extended._tfdist_batch_statistics = batch_statistics
        _mirrored.init_strategy(self, extended, "MultiWorkerMirroredStrategy")

    @property
    def cluster(self) -> cluster_lib.Cluster | None:
        """The cluster this strategy spans (None for a single process)."""
        return self._cluster

    @property
    def topology(self) -> topology_lib.Topology:
        """This worker's index, the number of workers and of replicas in sync."""
        cluster = self._cluster
        return topology_lib.Topology(
            worker_index=cluster.rank if cluster else 0,
            num_workers=cluster.num_workers if cluster else 1,
            data_parallel_size=self.num_replicas_in_sync,
        )

    @property
    def communication(self) -> str:
        """The collective implementation this strategy was built with."""
        return self._communication

    def __repr__(self):
        workers = self._cluster.num_workers if self._cluster else 1
        return (
            f"MultiWorkerStrategy(workers={workers}, communication={self._communication!r}, "
            f"timeout={self._timeout!r}, gradient_dtype={self._gradient_dtype!r})"
        )
