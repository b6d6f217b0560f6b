"""The worker half of :mod:`distsgd.schemes.downpour` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

from typing import Any

import numpy as np

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.downpour import DownpourOptions, DownpourRules


class DownpourWorker(DownpourRules, WorkerScheme):
    transient = ("inflight", "replica")

    def __init__(self, options: DownpourOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.pending = 0

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
