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
from distsgd.schemes.base import WorkerRules
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


class HogwildRules(WorkerRules):
    lr_rule = "inverse-sqrt"
    """Every gradient is applied, on parameters about N - 1 updates old: --lr / sqrt(N)."""
    implicit_momentum = True
    """... which acts as a momentum of 1 - 1/N: --momentum lowered by it (see the guide)."""


SPEC = SchemeSpec(
    name="hogwild",
    summary="asynchronous SGD: pull, gradient, push; the server applies it at once, lock-free",
    options=HogwildOptions,
    rules=HogwildRules,
    worker="distsgd.workers.hogwild:HogwildWorker",
    server=HogwildServer,
    traffic=Traffic(kind="async", overlap_option="overlap"),
)
