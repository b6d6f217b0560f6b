"""The worker half of :mod:`distsgd.schemes.eamsgd` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import torch

from distsgd.runtime.context import WorkerContext
from distsgd.schemes.eamsgd import EamsgdOptions, EamsgdRules
from distsgd.workers.easgd import EasgdWorker


class EamsgdWorker(EamsgdRules, EasgdWorker):
    def __init__(self, options: EamsgdOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.velocity: list[torch.Tensor] = []

    def start(self, ctx: WorkerContext) -> None:
        ctx.pull()  # x_i starts at the center, v_i at zero
        self.velocity = [torch.zeros_like(p) for p in ctx.params.values()]

    def before_step(self, ctx: WorkerContext) -> None:
        with torch.no_grad():
            super().before_step(ctx)  # the elastic exchange, on x_i
            self.x = [p.detach().clone() for p in ctx.params.values()]
            for p, v in zip(ctx.params.values(), self.velocity, strict=True):
                p.add_(v, alpha=self.delta)  # the replica holds the look-ahead point for backward

    def after_backward(self, ctx: WorkerContext) -> None:
        lr = ctx.config.lr * ctx.lr_scale
        with torch.no_grad():
            for p, x, v in zip(ctx.params.values(), self.x, self.velocity, strict=True):
                if ctx.skip_update:  # the gradient is not finite: back to x_i, velocity as it was
                    p.copy_(x)
                    continue
                v.mul_(self.delta)
                if p.grad is not None:
                    v.add_(p.grad, alpha=-lr)
                p.copy_(x + v)
        self.x = []
