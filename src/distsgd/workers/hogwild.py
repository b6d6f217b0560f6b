"""The worker half of :mod:`distsgd.schemes.hogwild` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import numpy as np

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.hogwild import HogwildOptions, HogwildRules


class HogwildWorker(HogwildRules, WorkerScheme):
    replica_from_servers = True  # it pulls before every step
    transient = ("inflight", "fetched", "base")
    """An exchange in flight is not state: its push reaches the servers anyway."""
    options: HogwildOptions

    def before_step(self, ctx: WorkerContext) -> None:
        if not self.options.overlap:
            ctx.pull()
            return
        fetched = self.__dict__.pop("fetched", None)
        if fetched is not None:
            self.base, arrays = fetched
            ctx.load(arrays)
        elif "inflight" not in self.__dict__:
            ctx.pull()  # the first step: nothing fetched yet
            self.base = ctx.versions

    def after_backward(self, ctx: WorkerContext) -> None:
        if ctx.skip_update:  # the gradient is not finite (a scaled loss overflowed): not sent
            return
        if not self.options.overlap:
            ctx.push_grads(in_place=True)  # backward then writes into the push area: no copy
            return
        self._land(ctx)
        grads = {k: v.copy() for k, v in ctx.grads().items()}  # the next backward reuses them
        base = list(self.base)  # the versions this gradient was computed on

        def exchange() -> tuple[list[int], dict[str, np.ndarray]]:
            ctx.push(grads, base_version=base)
            arrays = ctx.pull_arrays()[1]
            return ctx.versions, arrays

        self.inflight = ctx.background(exchange)

    def _land(self, ctx: WorkerContext) -> None:
        inflight = self.__dict__.pop("inflight", None)
        if inflight is not None:
            self.fetched = ctx.wait_for(inflight)

    def finish(self, ctx: WorkerContext) -> None:
        self._land(ctx)
        self.__dict__.pop("fetched", None)
