"""Asynchronous EASGD: elastic averaging against a center variable on the parameter servers.

Zhang, Choromanska, LeCun. *Deep learning with Elastic Averaging SGD.* NeurIPS 2015
(Algorithm 1, asynchronous EASGD).

Worker i keeps its own variable x_i; every ``tau`` local steps (before the gradient step)::

    c      <- pull()                    # the center variable
    diff   <- alpha * (x_i - c)
    x_i    <- x_i - diff                # pulled towards the center
    push(diff)                          # server: c <- c + diff   (center pulled towards x_i)

and every step::

    x_i <- x_i - lr * grad L(x_i; batch)

``alpha`` is the moving rate; the paper sets alpha = beta / p with beta = 0.9 and p workers,
which is the default here. The chief evaluates the center.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from distsgd.plan.traffic import Traffic
from distsgd.ps.rules import ACCEPTED, PushMeta, PushOutcome, ServerOptions, UpdateRule
from distsgd.ps.shard import Shard
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class EasgdOptions:
    tau: int = field(
        default=4, metadata={"help": "local steps between elastic exchanges (communication period)"}
    )
    alpha: float = field(
        default=0.0,
        metadata={"help": "moving rate; 0 = 0.9 / workers (beta = 0.9, as in the paper)"},
    )

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ValueError(f"tau must be at least 1, got {self.tau}")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")


@dataclass(frozen=True, kw_only=True)
class ElasticServerOptions(ServerOptions):
    """The center update has no options; the default ``server_options`` sends the run's lr and
    momentum, which it does not use."""

    ignored: ClassVar[frozenset[str]] = frozenset({"lr", "momentum"})


class ElasticServer(UpdateRule):
    """Center update: ``c <- c + diff`` for each pushed elastic difference."""

    movable = True

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = ElasticServerOptions.from_json(options)

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        for key, diff in payload.items():
            shard.values[key] += diff
        shard.bump()
        return ACCEPTED


class EasgdRules(WorkerRules):
    lr_rule = "elastic"
    """N workers take 1/N of the steps (sqrt(N)), and the elastic exchanges conserve the sum of
    the N workers' variables and the center's, so their consensus moves at N / (N + 1) of each
    worker's rate: --lr x sqrt(N) x (N + 1) / N."""

    options: EasgdOptions

    def __init__(self, options: EasgdOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.alpha = options.alpha or 0.9 / num_workers


SPEC = SchemeSpec(
    name="easgd",
    summary="asynchronous elastic averaging: local SGD, every `tau` steps an elastic exchange",
    options=EasgdOptions,
    rules=EasgdRules,
    worker="distsgd.workers.easgd:EasgdWorker",
    server=ElasticServer,
    step_size=("lr", "alpha"),
    traffic=Traffic(kind="async", period_option="tau"),
)
