"""The worker half of :mod:`distsgd.schemes.easgd` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.easgd import EasgdRules


class EasgdWorker(EasgdRules, WorkerScheme):
    def start(self, ctx: WorkerContext) -> None:
        self.optimizer = ctx.make_optimizer("sgd")
        ctx.pull()  # x_i starts at the center

    def before_step(self, ctx: WorkerContext) -> None:
        if ctx.local_step % self.options.tau == 0 and ctx.local_step > 0:
            self.elastic_exchange(ctx)

    def elastic_exchange(self, ctx: WorkerContext) -> None:
        _, center = ctx.pull_arrays()
        local = ctx.arrays()
        alpha = self.moving_rate(ctx)
        diff = {k: alpha * (local[k] - center[k]) for k in local}
        ctx.load({k: local[k] - diff[k] for k in local})
        ctx.push(diff)

    def moving_rate(self, ctx: WorkerContext) -> float:
        """alpha: the given one, or 0.9 / workers, the live ones under ``--world-size
        dynamic`` (``ctx.live_workers``)."""
        if self.options.alpha or ctx.config.world_size == "fixed":
            return self.alpha
        return 0.9 / ctx.live_workers

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.step_optimizer(self.optimizer)

    def finish(self, ctx: WorkerContext) -> None:
        self.elastic_exchange(ctx)
