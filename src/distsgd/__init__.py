"""distsgd: data-parallel training schemes for PyTorch over gRPC parameter servers and all-reduce.

Layers, lowest first (a package imports only from those before it)::

    util -> cluster -> transport -> ps -> runtime -> schemes -> api -> launcher -> cli

The user-facing API is :func:`train` and :class:`TrainConfig`. They are imported on first use:
``import distsgd.ps`` (a parameter-server process) must not pay for PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["TrainConfig", "TrainResult", "__version__", "seed_everything", "train"]

_EXPORTS = {
    "train": "distsgd.api",
    "seed_everything": "distsgd.api",
    "TrainConfig": "distsgd.runtime.config",
    "TrainResult": "distsgd.runtime.loop",
}

if TYPE_CHECKING:
    from distsgd.api import seed_everything, train
    from distsgd.runtime.config import TrainConfig
    from distsgd.runtime.loop import TrainResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
