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
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
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


class DownpourWorker(WorkerScheme):
    lr_rule = "sqrt"
    """N workers take 1/N of the steps; the servers move by the mean of their windows (server_lr
    1/N): --lr x sqrt(N), as for sync's mean of N gradients."""
    transient = ("inflight", "replica")

    def __init__(self, options: DownpourOptions, num_workers: int) -> None:
        self.options = options
        self.server_lr = options.server_lr or 1.0 / num_workers
        self.pending = 0

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        if config.world_size == "dynamic" and not self.options.server_lr:
            return {"server_lr": self.server_lr, "per_worker": True}
        return {"server_lr": self.server_lr}

    def start(self, ctx: WorkerContext) -> None:
        self.optimizer = ctx.make_optimizer(self.options.local_optimizer)
        ctx.pull()
        self.window_start = ctx.arrays()
        self.replica = ctx.params
        """The replica's exchanged parameters (not state: a resumed worker's own)."""

    def state_dict(self) -> dict[str, Any]:
        """The default's, without the window's start between windows: it is the replica's
        parameters then (the exchange copied them), which the worker state holds already."""
        if self.pending:
            return super().state_dict()
        start = self.__dict__.pop("window_start")
        try:
            return super().state_dict()
        finally:
            self.window_start = start

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(After the replica is loaded) the default's; a window's start left out of the state
        is the replica's parameters."""
        super().load_state_dict(state)
        if "window_start" not in state and not self.pending:
            replica = self.replica.items()
            self.window_start = {k: p.detach().cpu().numpy().copy() for k, p in replica}

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.step_optimizer(self.optimizer)
        self.pending += 1
        if self.pending == self.options.window:
            self._exchange(ctx)

    def finish(self, ctx: WorkerContext) -> None:
        if self.pending:
            self._exchange(ctx)
        self._land(ctx, keep_progress=False)

    def accumulated_update(
        self, start: np.ndarray, now: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """What one parameter's window pushes: DOWNPOUR sends the whole accumulated update,
        ``start - now`` (into ``out`` when given)."""
        return np.subtract(start, now, out=out)

    def send(self, ctx: WorkerContext, update: dict[str, np.ndarray]) -> None:
        """Push a window's update and pull the servers' parameters (at once: asynchronous)."""
        ctx.push(update)
        ctx.pull()

    def _exchange(self, ctx: WorkerContext) -> None:
        if getattr(self.options, "overlap", False):
            now = ctx.arrays()
            update = {k: self.accumulated_update(self.window_start[k], now[k]) for k in now}
            self._land(ctx, keep_progress=True)
            sent_at = ctx.arrays()

            def exchange() -> dict[str, np.ndarray]:
                ctx.push(update)
                return ctx.pull_arrays()[1]

            self.inflight = (ctx.background(exchange), sent_at)
            self.window_start = ctx.arrays()
        else:
            # The update is written straight into the servers' push areas where there are
            # some (shared memory), and the window's start copied into the arrays it had:
            # the exchange allocates nothing and copies the model once each way.
            now, out = ctx.views(), ctx.push_buffers()
            update = {
                k: self.accumulated_update(
                    self.window_start[k], now[k], None if out is None else out[k]
                )
                for k in now
            }
            self.send(ctx, update)
            for k, values in ctx.views().items():
                np.copyto(self.window_start[k], values)
        self.pending = 0

    def _land(self, ctx: WorkerContext, *, keep_progress: bool) -> None:
        """(Overlap) take the parameters the background exchange fetched, plus the progress made
        since it was sent (``keep_progress``), or exactly them (at the end)."""
        inflight = self.__dict__.pop("inflight", None)
        if inflight is None:
            return
        future, sent_at = inflight
        pulled = ctx.wait_for(future)
        if keep_progress:
            now = ctx.arrays()
            pulled = {k: pulled[k] + (now[k] - sent_at[k]) for k in pulled}
        ctx.load(pulled)


SPEC = SchemeSpec(
    name="downpour",
    summary="DOWNPOUR: `window` local SGD (or Adagrad) steps, then push the accumulated update",
    options=DownpourOptions,
    worker=DownpourWorker,
    server=DownpourServer,
    step_size=(
        "lr",
        "server_lr",
    ),
    local_optimizer=True,
    traffic=Traffic(kind="async", period_option="window", overlap_option="overlap"),
)
