"""DOWNPOUR: workers take a window of local steps, then push the accumulated update.

Dean, Corrado, Monga, Chen, Devin, Le, Mao, Ranzato, Senior, Tucker, Yang, Ng. *Large Scale
Distributed Deep Networks.* NeurIPS 2012 (Downpour SGD, with n_fetch = n_push = window).

Worker i::

    w_i <- pull();  w_start <- w_i
    repeat window times:  w_i <- w_i - lr * grad L(w_i; batch)     # local optimizer
    delta <- w_start - w_i                                         # the accumulated update
    push(delta)

The local optimizer is plain SGD (the seed's "DOWNPOUR-Easy") or Adagrad (``--local-optimizer
adagrad``, as in the paper's Downpour and the seed's "DOWNPOUR"): per-coordinate rates
lr / sqrt(sum of squared gradients), whose accumulators stay on the worker across windows.

Server, on each push, at once::

    w <- w - server_lr * delta

``server_lr`` defaults to 1/N for N workers: N deltas from one round of windows then move the
server by their mean, as model averaging would; 1.0 adds them up as in the paper's sum of
accumulated gradients (try it: it overshoots sooner with more workers). A remainder window
shorter than ``window`` is pushed when the worker finishes.

``--overlap`` (off by default: the paper's Downpour fetches before it computes on) sends a
window's update and fetches the servers' parameters in the background while the next window
computes. At the next exchange the worker continues from those parameters plus its own progress
since it sent (which it now sends)::

    P_k   <- push(delta_k), then pull()                  # in the background during window k+1
    w_i   <- P_k + (w_i - w_start)                       # at the end of window k+1
    delta_{k+1} <- w_start - w_i_before;  w_start <- w_i

The parameters a window starts from are then one window staler (the other workers' updates
arrive a window later); the exchange's time hides behind a window of compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.ps.rules import (
    ACCEPTED,
    MAX_RATE,
    PushMeta,
    PushOutcome,
    ServerOptions,
    ServerSGD,
    UpdateRule,
    bounded,
)
from distsgd.ps.shard import Shard
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec


@dataclass(frozen=True, kw_only=True)
class DownpourOptions:
    window: int = field(
        default=5, metadata={"help": "local steps between pushes (n_push = n_fetch)"}
    )
    server_lr: float = field(
        default=0.0,
        metadata={"help": "rate at which the server applies a pushed update; 0 = 1 / workers"},
    )

    local_optimizer: str = field(
        default="sgd", metadata={"help": "the worker's optimizer between pushes: sgd or adagrad"}
    )
    overlap: bool = field(
        default=False,
        metadata={
            "help": "exchange each window in the background while the next one computes "
            "(parameters one window staler; see the guide)"
        },
    )

    def __post_init__(self) -> None:
        if self.local_optimizer not in ("sgd", "adagrad"):
            raise ValueError(
                f"local_optimizer must be sgd or adagrad, got {self.local_optimizer!r}"
            )
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if self.server_lr < 0:
            raise ValueError(
                f"server_lr must be positive (or 0 for 1 / workers), got {self.server_lr}"
            )


@dataclass(frozen=True, kw_only=True)
class DownpourServerOptions(ServerOptions):
    """What ``DownpourWorker.server_options`` sends: the rate on each pushed update."""

    server_lr: float = bounded(low=0.0, low_open=True, high=MAX_RATE, doc="rate on each update")
    per_worker: bool = bounded(
        False, doc="server_lr is the default 1 / workers: under world_size dynamic, 1 / members"
    )


class DownpourServer(UpdateRule):
    movable = True

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = DownpourServerOptions.from_json(options)
        self.sgd = ServerSGD(lr=self.options.server_lr)

    def on_membership(self, shard: Shard, members: list[int]) -> None:
        """(world_size dynamic, default rate) the rate follows the live members: 1 / members."""
        if self.dynamic and self.options.per_worker:
            self.sgd.lr = 1.0 / self.workers(shard)

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        self.sgd.step(shard.values, payload)
        shard.bump()
        return ACCEPTED


class DownpourRules(WorkerRules):
    lr_rule = "sqrt"
    """N workers take 1/N of the steps; the servers move by the mean of their windows (server_lr
    1/N): --lr x sqrt(N), as for sync's mean of N gradients."""

    options: DownpourOptions

    def __init__(self, options: DownpourOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.server_lr = options.server_lr or 1.0 / num_workers

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        if config.world_size == "dynamic" and not self.options.server_lr:
            return {"server_lr": self.server_lr, "per_worker": True}
        return {"server_lr": self.server_lr}


SPEC = SchemeSpec(
    name="downpour",
    summary="DOWNPOUR: `window` local SGD (or Adagrad) steps, then push the accumulated update",
    options=DownpourOptions,
    rules=DownpourRules,
    worker="distsgd.workers.downpour:DownpourWorker",
    server=DownpourServer,
    step_size=("lr", "server_lr"),
    traffic=Traffic(kind="async", period_option="window", overlap_option="overlap"),
)
