"""distsgd: data-parallel training schemes for PyTorch over gRPC parameter servers and all-reduce.

Layers, lowest first (a package imports only from those before it)::

    util -> cluster -> transport -> ps -> runtime -> schemes -> api -> launcher -> cli

The user-facing API is :func:`train` and :class:`TrainConfig`.
"""

from distsgd.api import seed_everything, train
from distsgd.runtime import TrainConfig, TrainResult

__version__ = "0.1.0"
__all__ = ["TrainConfig", "TrainResult", "__version__", "seed_everything", "train"]
