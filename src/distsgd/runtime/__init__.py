"""Worker runtime: the model replica, its data shard, and the one training loop (PyTorch).

Names are imported on first use, so that a module below (``control.config``, ``runtime.scheme``)
can be imported without the whole loop, and a parameter-server process without PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.util.lazy import lazy_exports

__all__ = [
    "ENV_VAR",
    "TaskEnv",
    "TrainConfig",
    "TrainResult",
    "WorkerContext",
    "WorkerScheme",
    "run_worker",
]

_EXPORTS = {
    "ENV_VAR": "distsgd.control.task",
    "TaskEnv": "distsgd.control.task",
    "TrainConfig": "distsgd.control.config",
    "TrainResult": "distsgd.runtime.result",
    "WorkerContext": "distsgd.runtime.context",
    "WorkerScheme": "distsgd.runtime.scheme",
    "run_worker": "distsgd.runtime.loop",
}

if TYPE_CHECKING:
    from distsgd.control.config import TrainConfig
    from distsgd.control.task import ENV_VAR, TaskEnv
    from distsgd.runtime.context import WorkerContext
    from distsgd.runtime.loop import run_worker
    from distsgd.runtime.result import TrainResult
    from distsgd.runtime.scheme import WorkerScheme


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
