"""tfdist: distributed training for Keras 3 on TensorFlow.

Importing tfdist is cheap and loads nothing of TensorFlow: each public name is
imported on first use. A binary can therefore set TensorFlow's environment
(log level, DTensor options) after `import tfdist`, and `simulate_devices` may
follow the import.
"""

import importlib
import os
from typing import TYPE_CHECKING

# DTensor's all-reduce combining pass silently corrupts Adam updates (TF 2.21); DTensor reads this
# when it compiles a program. ModelParallelStrategy also enforces it at construction.
os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")

__version__ = "0.1.0"

# Public name -> module that defines it; loaded on first attribute access.
_PUBLIC = {
    "simulate_devices": "tfdist.devices",
    "DataParallelStrategy": "tfdist.strategies.data_parallel",
    "MultiWorkerStrategy": "tfdist.strategies.multi_worker",
    "ModelParallelStrategy": "tfdist.strategies.model_parallel",
    "PipelineStrategy": "tfdist.strategies.pipeline",
    "ShardedDataParallelStrategy": "tfdist.strategies.sharded_data_parallel",
    "advise": "tfdist.advisor",
    "check": "tfdist.divergence",
    "use_keras_distribution": "tfdist.keras_distribution",
    "CompatError": "tfdist.errors",
    "ClusterError": "tfdist.errors",
    "DataShardingWarning": "tfdist.errors",
}
_SUBMODULES = (
    "callbacks", "cluster", "data", "devices", "errors", "flight", "layouts", "models", "placement", "timeline",
)

__all__ = sorted([*_PUBLIC, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # IDEs and type checkers see the names (`x as x`: re-exported); at run time each loads on first use
    from tfdist import callbacks as callbacks
    from tfdist import cluster as cluster
    from tfdist import data as data
    from tfdist import devices as devices
    from tfdist import errors as errors
    from tfdist import flight as flight
    from tfdist import layouts as layouts
    from tfdist import models as models
    from tfdist import placement as placement
    from tfdist import timeline as timeline
    from tfdist.advisor import advise as advise
    from tfdist.devices import simulate_devices as simulate_devices
    from tfdist.divergence import check as check
    from tfdist.errors import ClusterError as ClusterError
    from tfdist.errors import CompatError as CompatError
    from tfdist.errors import DataShardingWarning as DataShardingWarning
    from tfdist.keras_distribution import use_keras_distribution as use_keras_distribution
    from tfdist.strategies.data_parallel import DataParallelStrategy as DataParallelStrategy
    from tfdist.strategies.model_parallel import ModelParallelStrategy as ModelParallelStrategy
    from tfdist.strategies.multi_worker import MultiWorkerStrategy as MultiWorkerStrategy
    from tfdist.strategies.pipeline import PipelineStrategy as PipelineStrategy
    from tfdist.strategies.sharded_data_parallel import ShardedDataParallelStrategy as ShardedDataParallelStrategy


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfdist.{name}")
    else:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}; public names: {__all__}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
