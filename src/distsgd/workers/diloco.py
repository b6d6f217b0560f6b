"""The worker half of :mod:`distsgd.schemes.diloco` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.diloco import DilocoRules, few_steps, fragment_of

if TYPE_CHECKING:
    from distsgd.runtime.collective import PendingMean

log = logging.getLogger(__name__)


class DilocoWorker(DilocoRules, WorkerScheme):
    evaluate_on = "local"
    transient = ("travelling",)

    def start(self, ctx: WorkerContext) -> None:
        o = self.options
        ctx.broadcast(list(ctx.params.values()))
        self.inner = ctx.make_optimizer("adamw", lr=o.inner_lr, weight_decay=o.weight_decay)
        self.theta = [p.detach().clone() for p in ctx.params.values()]
        self.outer = torch.optim.SGD(
            self.theta, lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.outer_momentum > 0
        )
        parts = min(o.fragments, len(self.theta))
        self.fragment = fragment_of(len(self.theta), parts)
        self.offsets = [p * o.inner_steps // parts for p in range(parts)]
        self.outer_steps = 0
        self.arrived: dict[int, list[torch.Tensor]] = {}
        """(overlap) Fragment -> its mean pseudo-gradient, landed or travelling."""
        self.land_at: dict[int, int] = {}
        """(overlap) Fragment -> the inner step count at which its mean lands."""
        self.travelling: dict[int, PendingMean] = {}

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.step_optimizer(self.inner)
        done = ctx.local_step + 1  # inner steps taken, this one included
        for part, at in list(self.land_at.items()):
            if at == done:
                self.land(ctx, part)
        for part, offset in enumerate(self.offsets):
            if done >= offset and (done - offset) % self.options.inner_steps == 0:
                self.outer_step(ctx, part, land_at=done + self.options.overlap_steps)

    def finish(self, ctx: WorkerContext) -> None:
        if ctx.local_step < self.options.inner_steps:  # a loop that decided its own length
            log.warning("%s", few_steps(ctx.local_step, self.options.inner_steps, took=True))
        for part in list(self.land_at):
            self.land(ctx, part)
        for part in range(len(self.offsets)):
            self.outer_step(ctx, part, land_at=None)

    def outer_step(self, ctx: WorkerContext, part: int, *, land_at: int | None) -> None:
        """Start this fragment's mean pseudo-gradient; apply it now (``land_at`` None or the
        current step), or leave it travelling until step ``land_at``."""
        params = list(ctx.params.values())
        with torch.no_grad():
            delta = [self.theta[i] - params[i].detach() for i in self._chosen(part)]
            pending = ctx.start_mean(delta, key=f"fragment{part}", compressed=True)
        self.arrived[part] = delta
        if land_at is None or land_at <= ctx.local_step + 1:
            ctx.wait_mean(pending)
            self._apply(ctx, part, merge=0.0)
        else:
            self.travelling[part], self.land_at[part] = pending, land_at

    def land(self, ctx: WorkerContext, part: int) -> None:
        """(overlap) Wait for a fragment's travelling mean, apply it, merge the replica."""
        pending = self.travelling.pop(part, None)
        if pending is not None:
            ctx.wait_mean(pending)
        del self.land_at[part]
        self._apply(ctx, part, merge=self.options.merge)

    def _chosen(self, part: int) -> list[int]:
        return [i for i, p in enumerate(self.fragment) if p == part]

    def _apply(self, ctx: WorkerContext, part: int, *, merge: float) -> None:
        """The outer Nesterov step of a fragment on its arrived mean; the replica's fragment
        becomes ``merge`` of itself plus ``1 - merge`` of theta."""
        with torch.no_grad():  # not a decorator: torch stays unloaded at import
            chosen, delta = self._chosen(part), self.arrived.pop(part)
            self.outer.zero_grad(set_to_none=True)
            for i, d in zip(chosen, delta, strict=True):
                self.theta[i].grad = d  # the outer pseudo-gradient
            self.outer.step()  # steps only the tensors that have a gradient: this fragment
            self.outer.zero_grad(set_to_none=True)
            params = list(ctx.params.values())
            for i in chosen:
                params[i].mul_(merge).add_(self.theta[i], alpha=1.0 - merge)
            self.outer_steps += 1

    def stats(self) -> dict[str, float]:
        return {"outer_steps": self.outer_steps}

    def state_dict(self) -> dict[str, Any]:
        for part in list(self.travelling):  # a travelling mean is waited for, then saved
            self.travelling.pop(part).wait()
        state = super().state_dict()
        state["theta"] = [t.detach().clone() for t in self.theta]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theta = state.pop("theta")
        super().load_state_dict(state)
        with torch.no_grad():  # in place: the outer optimizer holds these very tensors
            for mine, saved in zip(self.theta, theta, strict=True):
                mine.copy_(saved)
