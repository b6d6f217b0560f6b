"""The worker half of :mod:`distsgd.schemes.allreduce` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.allreduce import AllreduceRules

if TYPE_CHECKING:
    from torch import nn


class AllreduceWorker(AllreduceRules, WorkerScheme):
    evaluate_on = "local"

    def start(self, ctx: WorkerContext) -> None:
        self.optimizer = ctx.make_optimizer("sgd")
        # No broadcast here: DistributedDataParallel broadcasts worker 0's replica as it is built.

    def wrap_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        return ctx.data_parallel(
            model,
            powersgd_start=self.options.powersgd_start,
            static_graph=not self.options.dynamic_graph,
        )

    def explain(self, exc: Exception) -> str | None:
        if self.alone or self.options.dynamic_graph:
            return None
        return (
            "if the parameters forward uses change from step to step, run allreduce with "
            "--dynamic-graph (DDP assumed the same ones at every step)"
        )

    def after_backward(self, ctx: WorkerContext) -> None:
        # DDP's hooks left the mean over the workers in every param.grad during backward.
        ctx.step_optimizer(self.optimizer)
