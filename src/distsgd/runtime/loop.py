"""The training loop of ``distsgd.train``: this worker's batches, forward, loss, backward.

Everything around those four lines (connections, the scheme's hooks, checkpoints, metrics,
evaluation, faults, the end of the run) is the :class:`~distsgd.runtime.session.WorkerSession`,
which a loop of the user's own (``distsgd.Worker``) drives in the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from torch import nn
from torch.utils.data import Dataset

from distsgd.control.config import TrainConfig
from distsgd.control.task import TaskEnv
from distsgd.runtime.callbacks import Callback
from distsgd.runtime.data import BatchFn, split_batch
from distsgd.runtime.evaluate import LossFn, MetricFns
from distsgd.runtime.result import TrainResult
from distsgd.runtime.scheme import WorkerScheme
from distsgd.runtime.session import WorkerSession

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ["TrainResult", "run_worker"]


class _Task(TypedDict):
    model: nn.Module
    train_set: Dataset[Any]
    test_set: Dataset[Any] | None
    config: TrainConfig
    env: TaskEnv
    scheme: WorkerScheme


class WorkerArgs(_Task, total=False):
    """What :func:`run_worker` passes on to its :class:`WorkerSession` (with ``loss_fn`` and
    ``batch_fn``, which its loop calls too)."""

    stop: threading.Event | None
    callbacks: Sequence[Callback]
    metric_fns: MetricFns | None


def run_worker(
    *, loss_fn: LossFn, batch_fn: BatchFn | None = None, **args: Unpack[WorkerArgs]
) -> TrainResult:
    """Train this worker's part of the run under ``scheme``.

    ``stop`` (``--world-size dynamic``): once set, the worker finishes its step, pushes what
    its scheme holds, reports its work units, leaves and returns (``TrainResult.left``). In the
    main thread of an elastic run SIGTERM sets it (the launcher shrinks a run so)."""
    session = WorkerSession(loss_fn=loss_fn, batch_fn=batch_fn, **args)
    try:
        session.open()
        for raw in session.batches():
            batch = split_batch(raw, batch_fn).to(session.device)
            with session.forward_backward():
                loss = loss_fn(batch.forward(session.module), batch.target)
                loss.backward()
            session.end_step(loss)
        return session.finish()
    except BaseException as exc:
        session.failed(exc)
        raise
    finally:
        session.close()
