"""Worker runtime: the model replica, its data shard, and the one training loop (PyTorch)."""

from distsgd.runtime.config import TrainConfig
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.loop import TrainResult, run_worker
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.task import ENV_VAR, TaskEnv

__all__ = [
    "ENV_VAR",
    "TaskEnv",
    "TrainConfig",
    "TrainResult",
    "WorkerContext",
    "WorkerScheme",
    "run_worker",
]
