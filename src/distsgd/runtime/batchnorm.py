"""BatchNorm's running statistics on the model the chief evaluates.

A model's buffers (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) are
never exchanged: each worker's replica keeps its own, computed by its own forward passes at
the parameters it held then. The model the chief evaluates is often not that replica: under
a parameter-server scheme it is the servers' parameters (which other workers' pushes moved
since the chief's last forward; under DOWNPOUR, AGN, EASGD or AsyncDiLoCo a center its replica
only approaches), under DiLoCo the outer step's result. Statistics measured at other
parameters mis-normalize every layer after the first.

So before each evaluation the chief re-estimates them at the parameters it evaluates
(:func:`recalibrate`): the statistics reset, then a cumulative average over the chief's most
recent training batches (:class:`RecentInputs`), forward in training mode, no gradient: the
"BatchNorm update" of stochastic weight averaging (Izmailov et al. 2018, *Averaging Weights
Leads to Wider Optima and Better Generalization*; ``torch.optim.swa_utils.update_bn``).
The same rule for every scheme, with no communication. A model without BatchNorm (no
``_NormBase`` module tracking running statistics) is left alone, and nothing is recorded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.nn.modules.batchnorm import _NormBase

log = logging.getLogger(__name__)

RECENT_BATCHES = 16
"""Most training batches kept for :func:`recalibrate` (the SWA update uses an epoch; 16
batches of 32 re-estimate the digits CNN's statistics as well as the whole training set)."""
RECENT_SAMPLES = 512
"""Most samples kept: fewer batches than :data:`RECENT_BATCHES` when batches are large (the
kept inputs are references to the loop's own batches, held until newer ones replace them)."""
RECENT_BYTES = 64 << 20
"""Most bytes of inputs kept (at least the newest batch): 512 images of 224 x 224 x 3 floats
would hold 300 MB alive."""


def running_stats_modules(model: nn.Module) -> list[_NormBase]:
    """The BatchNorm-like modules of ``model`` that track running statistics (BatchNorm1d/2d/3d,
    SyncBatchNorm, the lazy ones, InstanceNorm with ``track_running_stats=True``)."""
    norm = torch.nn.modules.batchnorm._NormBase  # looked up here: a server never loads torch
    return [m for m in model.modules() if isinstance(m, norm) and m.track_running_stats]


def _samples(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """The batch's size (the first dimension of its first tensor; 1 if it has none) and the
    bytes of its tensors."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    size = next((int(t.shape[0]) for t in tensors if t.dim() > 0), 1)
    return size, sum(t.nelement() * t.element_size() for t in tensors)


class RecentInputs:
    """The inputs of the model's most recent forward passes in training mode (at most
    :data:`RECENT_BATCHES` batches and :data:`RECENT_SAMPLES` samples, the newest kept), as a
    forward pre-hook on the model records them: what :func:`recalibrate` replays."""

    def __init__(self, model: nn.Module) -> None:
        self.batches: deque[tuple[tuple[Any, ...], dict[str, Any], int, int]] = deque()
        self.samples = 0
        self.nbytes = 0
        self.paused = False
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.paused or not module.training:
            return
        n, nbytes = _samples(args, kwargs)
        self.batches.append((args, kwargs, n, nbytes))
        self.samples += n
        self.nbytes += nbytes
        while len(self.batches) > 1 and (
            len(self.batches) > RECENT_BATCHES
            or self.samples > RECENT_SAMPLES
            or self.nbytes > RECENT_BYTES
        ):
            _, _, n, nbytes = self.batches.popleft()
            self.samples -= n
            self.nbytes -= nbytes

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Record nothing meanwhile (the replays of :func:`recalibrate` on the model itself)."""
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def remove(self) -> None:
        self._handle.remove()
        self.batches.clear()
        self.samples = self.nbytes = 0


def recalibrate(model: nn.Module, recent: RecentInputs) -> int:
    """Re-estimate ``model``'s running statistics at its current parameters over ``recent``'s
    batches: each module's statistics reset and averaged over the batches with equal weight
    (``momentum=None``), forward in training mode without gradients. Its mode, each module's
    ``momentum`` and ``num_batches_tracked`` (the count of training batches) are put back.
    Returns the batches replayed (0: no BatchNorm, or no batch recorded: left as it was)."""
    modules = running_stats_modules(model)
    if not modules or not recent.batches:
        return 0
    kept = [(m.momentum, m.num_batches_tracked.clone()) for m in modules]  # type: ignore[union-attr]
    training = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad(), recent.pause():
            for m in modules:
                m.reset_running_stats()
                m.momentum = None
            model.train()
            for args, kwargs, _, _ in recent.batches:
                model(*args, **kwargs)
    finally:
        for m, (momentum, count) in zip(modules, kept, strict=True):
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)  # type: ignore[union-attr]
        for module, mode in training:
            module.training = mode
    return len(recent.batches)
