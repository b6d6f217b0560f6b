"""Whose learning rate a step uses: distsgd's schedule, or a scheduler of the user's own.

``worker.optimizer`` is the optimizer whose ``lr`` this worker's updates follow. Under a scheme
that steps a local optimizer (allreduce, downpour, agn, sagn, easgd, localsgd, diloco's and
asyncdiloco's inner one) it is that optimizer: the user's own (``optimizer=``) or distsgd's.
Under the others the parameter servers apply every update, and it is a :class:`ServerRate`: an
optimizer that updates nothing and holds the servers' rate (``--lr`` as the scheme applies it),
so that a ``torch.optim.lr_scheduler`` over it works as over any optimizer; each push then
carries its ``lr`` over the starting one as the servers' ``lr_scale``.

distsgd sets the rate itself only for ``--lr-schedule cosine``, ``--warmup`` or an elastic run
(the rule follows the live workers); then a scheduler of the user's over ``worker.optimizer``
would fight it every step, and is refused (:func:`refuse_scheduler`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from distsgd.control.config import TrainConfig
from distsgd.control.errors import SetupError
from distsgd.ps.rules import MAX_LR_SCALE

SMALLEST_SCALE = 1e-30
"""The ``lr_scale`` a rate of 0 travels as: 0 on the wire means "unset" (1.0)."""


def distsgd_sets_rate(config: TrainConfig) -> bool:
    """Whether distsgd changes the rate during the run (a schedule, warmup, an elastic run)."""
    return config.lr_schedule != "constant" or config.warmup > 0 or config.world_size == "dynamic"


def has_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``torch.optim.lr_scheduler`` was made over ``optimizer`` (every one of them
    records each group's ``initial_lr``)."""
    return any("initial_lr" in group for group in optimizer.param_groups)


def refuse_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler of the user's over ``optimizer`` while distsgd sets the rate: refused (a
    :class:`SetupError`, which the launcher does not restart)."""
    if not has_scheduler(optimizer):
        return
    if config.lr_schedule != "constant" or config.warmup > 0:
        ours = f"--lr-schedule {config.lr_schedule} --warmup {config.warmup:g}"
        fix = "drop --lr-schedule/--warmup (constant, 0) or your scheduler"
    else:
        ours = "--world-size dynamic (the rate follows the live workers)"
        fix = "drop your scheduler or run with a fixed world size"
    raise SetupError(
        f"a learning-rate scheduler of your own over worker.optimizer and {ours} would both "
        f"set its rate at every step; {fix}"
    )


class ServerRate(torch.optim.Optimizer):
    """The rate the parameter servers apply to this worker's updates, as an optimizer over the
    model's parameters that a ``torch.optim.lr_scheduler`` can drive. :meth:`step` does
    nothing (the servers update); distsgd calls it after each step's push, as a loop calls an
    optimizer's, so the scheduler sees its optimizer stepped."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        super().__init__(list(params), {"lr": lr})
        self.base_lr = lr
        """The rate as the run applies it (``--lr`` after the scheme's rule)."""

    def step(self, closure: Any = None) -> Any:
        """Nothing to update (the servers do); a closure is called, as optimizers do."""
        return None if closure is None else closure()

    def scale(self) -> float:
        """Its ``lr`` over :attr:`base_lr`, the factor each push carries (``lr_scale``)."""
        lr = self.param_groups[0]["lr"]
        if not (isinstance(lr, float | int) and math.isfinite(lr) and lr >= 0):
            raise SetupError(f"worker.optimizer's lr must be a number 0 or more, got {lr!r}")
        ratio = float(lr) / self.base_lr
        if ratio > MAX_LR_SCALE:
            raise SetupError(
                f"worker.optimizer's lr {lr:g} is over {MAX_LR_SCALE:g} times the run's "
                f"{self.base_lr:g}, more than the servers accept; raise --lr instead"
            )
        return max(ratio, SMALLEST_SCALE)
