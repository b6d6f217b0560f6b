"""A loss scaled by the user's ``torch.amp.GradScaler`` (``distsgd.Worker(grad_scaler=...)``).

Mixed precision in float16 needs its loss scaled so that small gradients survive; the scaled
gradients must be divided back before anything uses them, and a step whose gradients overflowed
(inf or NaN) must not update anything. In a plain loop ``scaler.step(optimizer)`` does both.
Under distsgd the scheme makes the update (a push to the servers, or a step of its local
optimizer), so the session does it around the scheme's ``after_backward``::

    scaler.scale(loss).backward()          (the loop)
    unscale                                gradients / scale, on every worker; under allreduce
                                           after DDP averaged them (the same scale everywhere)
    ctx.skip_update = not all finite       the scheme sends nothing and steps nothing then
    scheme.after_backward(ctx)             (ctx.step_optimizer skips; pushes are not made)
    scaler.update()                        the scale backs off after a skip, grows after a run
                                           of good steps, as in a plain loop

A skipped step still counts as a step (its batch is used, the step number moves on), so the
collective schemes' workers stay in step with each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from distsgd.runtime.context import WorkerContext


def all_finite_grads(params: Iterable[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` is finite (no inf, no NaN); one sync."""
    checks = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(checks).all()) if checks else True


def check_grad_scaler(scaler: object) -> torch.amp.GradScaler:
    """``grad_scaler=`` as given, once it is a ``torch.amp.GradScaler``."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(
            f"grad_scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}; make one "
            "with torch.amp.GradScaler('cuda') (or 'cpu')"
        )
    return scaler


class ScaledGradients:
    """The session's use of the loop's ``GradScaler`` (see the module docstring)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.skipped = 0
        """Steps whose update was skipped: their gradients were not finite."""

    @classmethod
    def of(cls, scaler: torch.amp.GradScaler | None) -> ScaledGradients | None:
        """The session's use of ``scaler``; None when the loop scales no loss."""
        return None if scaler is None else cls(scaler)

    def unscale(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale (unless the loop did, with
        ``scaler.unscale_(worker.optimizer)``, to clip them) and decide the step's skip."""
        if not self.scaler.is_enabled():
            return
        try:
            self.scaler.unscale_(optimizer)
        except RuntimeError as exc:
            if "already been called" not in str(exc):
                raise
        ctx.skip_update = not all_finite_grads(ctx.params.values())

    def update(self, ctx: WorkerContext) -> None:
        """After the scheme's update: the scale's next value; the skip is over."""
        if self.scaler.is_enabled():
            self.scaler.update()
        self.skipped += ctx.skip_update
        ctx.skip_update = False

    def fields(self) -> dict[str, float]:
        """For the metrics lines: the scale now and the steps skipped so far."""
        return {"grad_scale": float(self.scaler.get_scale()), "skipped_steps": self.skipped}
