"""tfdist's public errors and warnings, in one place; each is also reachable as `tfdist.<Name>`.

Example:

>>> import tfdist
>>> issubclass(tfdist.ClusterError, ValueError), issubclass(tfdist.CompatError, RuntimeError)
(True, True)
"""


class CompatError(RuntimeError):
    """A TensorFlow/Keras internal that tfdist hooks no longer looks as expected (another version installed)."""


class ClusterError(ValueError):
    """A cluster description (TF_CONFIG, Slurm variables or arguments) is invalid."""


class DataShardingWarning(UserWarning):
    """Every worker reads the whole dataset (DATA sharding) because it has no files to split."""
