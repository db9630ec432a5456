"""tfdist: distributed training for Keras 3 on TensorFlow.

Importing tfdist does not start TensorFlow's runtime, so `simulate_devices`
may follow it.
"""

from tfdist import cluster, devices
from tfdist.devices import simulate_devices
from tfdist.strategies import DataParallelStrategy, MultiWorkerStrategy

__version__ = "0.1.0"

__all__ = ["DataParallelStrategy", "MultiWorkerStrategy", "cluster", "devices", "simulate_devices", "__version__"]
