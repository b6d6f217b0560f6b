"""The worker half of :mod:`distsgd.schemes.localsgd` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.localsgd import LocalsgdRules


class LocalsgdWorker(LocalsgdRules, WorkerScheme):
    evaluate_on = "local"

    def start(self, ctx: WorkerContext) -> None:
        self.optimizer = ctx.make_optimizer("sgd")
        ctx.broadcast(list(ctx.params.values()))

    def after_backward(self, ctx: WorkerContext) -> None:
        step = ctx.local_step  # the step being taken (counted after this hook)
        if step < self.options.switch_step:
            ctx.allreduce_mean([p.grad for p in ctx.params.values() if p.grad is not None])
            ctx.gradients_averaged()  # a scaled loss: inf on any worker skips on every one
            ctx.step_optimizer(self.optimizer)
            return
        ctx.step_optimizer(self.optimizer)
        if (step + 1) % self.options.period == 0:
            ctx.allreduce_mean([p.data for p in ctx.params.values()])

    def finish(self, ctx: WorkerContext) -> None:
        ctx.allreduce_mean([p.data for p in ctx.params.values()])  # every replica ends equal
