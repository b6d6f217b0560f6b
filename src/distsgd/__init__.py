"""distsgd: data-parallel training schemes for PyTorch over gRPC parameter servers and all-reduce.

Layers, lowest first (a package imports only from those before it)::

    util -> cluster -> transport -> ps -> runtime -> schemes -> api -> launcher -> cli

The user-facing API is :func:`train` (or :class:`Worker` for a loop of one's own),
:class:`TrainConfig` and :func:`task`; for data larger than memory :class:`ShardFolder`,
:func:`write_shards` and :func:`data_part`. They are imported
on first use: ``import distsgd.ps`` (a parameter-server process) must not pay for PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.util.lazy import lazy_exports

__version__ = "0.1.0"
__all__ = [
    "Callback",
    "Every",
    "SetupError",
    "ShardFolder",
    "StepInfo",
    "TaskInfo",
    "TrainConfig",
    "TrainResult",
    "Worker",
    "__version__",
    "data_part",
    "seed_everything",
    "task",
    "train",
    "write_shards",
]

_EXPORTS = {
    "train": "distsgd.api",
    "Worker": "distsgd.api",
    "Callback": "distsgd.runtime.callbacks",
    "Every": "distsgd.runtime.callbacks",
    "StepInfo": "distsgd.runtime.callbacks",
    "SetupError": "distsgd.control.errors",
    "seed_everything": "distsgd.api",
    "task": "distsgd.api",
    "TaskInfo": "distsgd.control.task",
    "TrainConfig": "distsgd.control.config",
    "TrainResult": "distsgd.runtime.result",
    "ShardFolder": "distsgd.runtime.shards",
    "write_shards": "distsgd.runtime.shards",
    "data_part": "distsgd.runtime.stream",
}

if TYPE_CHECKING:
    from distsgd.api import Worker, seed_everything, task, train
    from distsgd.control.config import TrainConfig
    from distsgd.control.errors import SetupError
    from distsgd.control.task import TaskInfo
    from distsgd.runtime.callbacks import Callback, Every, StepInfo
    from distsgd.runtime.result import TrainResult
    from distsgd.runtime.shards import ShardFolder, write_shards
    from distsgd.runtime.stream import data_part


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
