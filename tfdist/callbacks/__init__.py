"""Keras callbacks for distributed training: checkpoints, exact resume, sync checks, throughput, stragglers,
profiling.

Every callback here works under `tfdist.DataParallelStrategy`,
`tfdist.MultiWorkerStrategy`, `tfdist.ModelParallelStrategy`,
`tfdist.PipelineStrategy` and any other `tf.distribute` strategy: they learn
this process' worker index, the number of workers and the data-parallel size
from `tfdist.strategies.topology.of(strategy)` only. Callbacks that
communicate between workers (`SyncCheck`, `MetricAverage`, `StepStats`, `ProfileSteps`, and
`BackupAndRestore` under a multi-worker strategy) run their collectives on
every worker at the same point; give every worker the same callback list, in
the same order.
"""

from tfdist.callbacks.checkpoint import BackupAndRestore
from tfdist.callbacks.checkpoint import Checkpoint
from tfdist.callbacks.checkpoint import CheckpointCorruptWarning
from tfdist.callbacks.checkpoint import CheckpointMismatchError
from tfdist.callbacks.checkpoint import CheckpointWriteError
from tfdist.callbacks.checkpoint import latest_checkpoint
from tfdist.callbacks.checkpoint import restore_checkpoint
from tfdist.callbacks.profile import ProfileSteps
from tfdist.callbacks.schedules import LearningRateWarmup
from tfdist.callbacks.schedules import WarmupSchedule
from tfdist.callbacks.step_stats import StepReport
from tfdist.callbacks.step_stats import StepStats
from tfdist.callbacks.step_stats import StragglerWarning
from tfdist.callbacks.sync import MetricAverage
from tfdist.callbacks.sync import SyncCheck
from tfdist.callbacks.sync import SyncError
from tfdist.callbacks.throughput import Throughput

__all__ = [
    "BackupAndRestore",
    "Checkpoint",
    "CheckpointCorruptWarning",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "LearningRateWarmup",
    "MetricAverage",
    "ProfileSteps",
    "StepReport",
    "StepStats",
    "StragglerWarning",
    "SyncCheck",
    "SyncError",
    "Throughput",
    "WarmupSchedule",
    "latest_checkpoint",
    "restore_checkpoint",
]
