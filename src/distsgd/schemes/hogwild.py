"""Hogwild: asynchronous SGD through parameter servers, with no lock across workers.

Niu, Recht, Ré, Wright. *HOGWILD!: A Lock-Free Approach to Parallelizing Stochastic Gradient
Descent.* NeurIPS 2011. Over a network this is the asynchronous SGD of Dean et al. (2012)
with one step per exchange.

Worker i, forever::

    w_i  <- pull()                      # the servers' current parameters
    g    <- grad L(w_i; batch)
    push(g)

Server, on each push, at once and without a lock::

    w <- w - lr * g                     # (heavy-ball momentum if --momentum > 0)

Gradients are applied however stale they are; that is the point and the risk.

``--overlap`` (off by default) sends each gradient, and fetches the servers' parameters, in the
background while the next batch computes::

    step k:   w_i <- P_{k-2}  (fetched after push k-2)    g_k <- grad L(w_i; batch)
              wait for exchange k-1;  start exchange k: push(g_k), then P_k <- pull()

so a gradient is computed on parameters that lack this worker's own previous gradient: one
step staler than plain Hogwild, and the exchange leaves the critical path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distsgd.plan.traffic import Traffic
from distsgd.ps.rules import ACCEPTED, PushMeta, PushOutcome, SgdServerOptions, UpdateRule
from distsgd.ps.shard import Shard
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class HogwildOptions:
    """--lr and --momentum set the server's SGD."""

    overlap: bool = field(
        default=False,
        metadata={
            "help": "push each gradient in the background while the next batch computes "
            "(gradients one step staler; see the guide)"
        },
    )


class HogwildServer(UpdateRule):
    locked = False
    movable = True

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = SgdServerOptions.from_json(options)
        self.sgd = self.options.sgd()

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        self.sgd.step(shard.values, payload, scale=meta.lr_scale)
        shard.bump()
        return ACCEPTED


class HogwildWorker(WorkerScheme):
    replica_from_servers = True  # it pulls before every step
    lr_rule = "inverse-sqrt"
    """Every gradient is applied, on parameters about N - 1 updates old: --lr / sqrt(N)."""
    implicit_momentum = True
    """... which acts as a momentum of 1 - 1/N: --momentum lowered by it (see the guide)."""

    def __init__(self, options: HogwildOptions, num_workers: int) -> None:
        self.options = options

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

    def state_dict(self) -> dict[str, Any]:
        saved: dict[str, Any] = {
            k: self.__dict__.pop(k) for k in ("inflight", "fetched", "base") if k in self.__dict__
        }
        try:  # an exchange in flight is not state: its push reaches the servers anyway
            return super().state_dict()
        finally:
            self.__dict__.update(saved)


SPEC = SchemeSpec(
    name="hogwild",
    summary="asynchronous SGD: pull, gradient, push; the server applies it at once, lock-free",
    options=HogwildOptions,
    worker=HogwildWorker,
    server=HogwildServer,
    traffic=Traffic(kind="async", overlap_option="overlap"),
)
