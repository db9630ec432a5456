"""tf.distribute strategies built by tfdist."""

from tfdist.strategies.data_parallel import DataParallelStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy

__all__ = ["DataParallelStrategy", "MultiWorkerStrategy"]
