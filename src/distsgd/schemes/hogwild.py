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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from distsgd.ps.rules import ACCEPTED, PushMeta, PushOutcome, SgdServerOptions, UpdateRule
from distsgd.ps.shard import Shard
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class HogwildOptions:
    """Hogwild has no options of its own; --lr and --momentum set the server's SGD."""


class HogwildServer(UpdateRule):
    locked = False

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = SgdServerOptions.from_json(options)
        self.sgd = self.options.sgd()

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        self.sgd.step(shard.values, payload, scale=meta.lr_scale)
        shard.bump()
        return ACCEPTED


class HogwildWorker(WorkerScheme):
    def __init__(self, options: HogwildOptions, num_workers: int) -> None:
        self.options = options

    def before_step(self, ctx: WorkerContext) -> None:
        ctx.pull()

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.push_grads()


SPEC = SchemeSpec(
    name="hogwild",
    summary="asynchronous SGD: pull, gradient, push; the server applies it at once, lock-free",
    options=HogwildOptions,
    worker=HogwildWorker,
    server=HogwildServer,
)
