"""DynSGD: staleness-aware asynchronous SGD; a stale gradient counts for less.

Jiang, Cui, Zhang, Yu. *Heterogeneity-aware Distributed Parameter Servers.* SIGMOD 2017.

Worker i, forever (as in Hogwild)::

    w_i, v <- pull()                    # parameters and the shard version they belong to
    g      <- grad L(w_i; batch)
    push(g, base_version = v)

Server, on each push (under the shard's lock, so staleness is exact)::

    s <- version - base_version         # updates applied since the worker pulled
    w <- w - lr / (s + 1) * g
    version <- version + 1

A fresh gradient (s = 0) takes a full step; one computed 3 updates ago, a quarter step. With
one worker every gradient is fresh and DynSGD is plain SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distsgd.plan.traffic import Traffic
from distsgd.ps.rules import ACCEPTED, PushMeta, PushOutcome
from distsgd.ps.shard import Shard
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.hogwild import HogwildServer
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class DynsgdOptions:
    """DynSGD has no options of its own; --lr and --momentum set the server's SGD."""


class DynsgdServer(HogwildServer):
    locked = True  # under the shard's lock, so staleness is exact

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        staleness = max(0, shard.version - meta.base_version)
        self.sgd.step(shard.values, payload, scale=meta.lr_scale / (staleness + 1))
        shard.bump()
        return ACCEPTED


class DynsgdRules(WorkerRules):
    lr_rule = "none"
    """The server divides each gradient by its staleness + 1 (about N on N workers): the scheme
    adapts its step to N by itself. ``sqrt`` on top trained the CNN of docs/schemes/defaults.md
    better (0.9833 vs 0.9556-0.9583) but took the demo (lr 0.3 x 2) to 0.9167-0.9778 with a
    worker and a server killed (0.9806-0.9917 at the rate as given): the demo's rate alone is
    already near its limit."""
    implicit_momentum = True
    """Asynchronous as Hogwild's (stale gradients applied as they come): the servers' momentum
    is lowered by asynchrony's own, 1 - 1/N (see hogwild). At 0.9 on 2 workers the bundled
    language model's loss became NaN at step 55 (2026-12-06)."""


SPEC = SchemeSpec(
    name="dynsgd",
    summary="staleness-aware async SGD: the server scales each gradient by 1/(staleness+1)",
    options=DynsgdOptions,
    rules=DynsgdRules,
    worker="distsgd.workers.dynsgd:DynsgdWorker",
    server=DynsgdServer,
    traffic=Traffic(kind="async"),
)
