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
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
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


class EasgdWorker(WorkerScheme):
    lr_rule = "elastic"
    """N workers take 1/N of the steps (sqrt(N)), and the elastic exchanges conserve the sum of
    the N workers' variables and the center's, so their consensus moves at N / (N + 1) of each
    worker's rate: --lr x sqrt(N) x (N + 1) / N."""

    def __init__(self, options: EasgdOptions, num_workers: int) -> None:
        self.options = options
        self.alpha = options.alpha or 0.9 / num_workers

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


SPEC = SchemeSpec(
    name="easgd",
    summary="asynchronous elastic averaging: local SGD, every `tau` steps an elastic exchange",
    options=EasgdOptions,
    worker=EasgdWorker,
    server=ElasticServer,
    step_size=(
        "lr",
        "alpha",
    ),
    local_optimizer=True,
    traffic=Traffic(kind="async", period_option="tau"),
)
