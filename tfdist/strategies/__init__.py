"""tf.distribute strategies built by tfdist."""

from tfdist.strategies.data_parallel import DataParallelStrategy

__all__ = ["DataParallelStrategy"]
