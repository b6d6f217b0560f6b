"""The worker half of :mod:`distsgd.schemes.asyncdiloco` (its math, paper and options are there):
the PyTorch hooks its workers run around each step."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import numpy as np

from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.asyncdiloco import AsyncDilocoOptions, AsyncDilocoRules, Pace
from distsgd.schemes.diloco import fragment_of
from distsgd.transport.client import PushResult

Inflight = tuple[
    Future[tuple[list[PushResult], dict[str, np.ndarray]]], dict[str, np.ndarray], list[int], int
]
"""(overlap) A fragment's background exchange: (its future, the fragment's values when it was
sent, the shard versions its push was based on, the inner steps it carries)."""


class AsyncDilocoWorker(AsyncDilocoRules, WorkerScheme):
    transient = ("inflight", "replica")

    def __init__(self, options: AsyncDilocoOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.round_steps = options.inner_steps
        self.pace: dict[str, Any] = {"steps": 0.0, "arrivals": 0.0, "rounds": 0}
        """:class:`Pace` as plain values (a checkpoint holds no objects)."""
        self.inflight: dict[int, Inflight] = {}
        """(overlap) Fragment -> its exchange running in the background (not state: none
        after a restart)."""

    def start(self, ctx: WorkerContext) -> None:
        o = self.options
        self.inner = ctx.make_optimizer("adamw", lr=o.inner_lr, weight_decay=o.weight_decay)
        ctx.pull(release=not o.overlap)
        self.round_start: dict[str, np.ndarray] = {}
        self.replica = ctx.params
        """The replica's exchanged parameters (not state: a resumed worker's own)."""
        names = list(ctx.views())
        self._start_in_push_area(ctx, names)
        count = min(o.fragments, len(names))
        owner = fragment_of(len(names), count)
        self.parts = [
            [n for n, q in zip(names, owner, strict=True) if q == p] for p in range(count)
        ]
        """Each fragment's parameter names (one fragment: the whole model)."""
        self.pending = [0] * count
        """Inner steps since each fragment's last exchange."""
        self.lead = [
            (o.inner_steps - p * o.inner_steps // count) % o.inner_steps for p in range(count)
        ]
        """Steps each fragment's first round counts as taken: fragment p first travels after
        p * H / P steps (Streaming DiLoCo's stagger); 0 once it has travelled."""

    def after_backward(self, ctx: WorkerContext) -> None:
        ctx.step_optimizer(self.inner)
        for p in range(len(self.pending)):
            self.pending[p] += 1
            if self.pending[p] + self.lead[p] >= self.round_steps:
                self.exchange(ctx, p)

    def finish(self, ctx: WorkerContext) -> None:
        for p, steps in enumerate(self.pending):
            if steps:
                self.exchange(ctx, p)
        for p in range(len(self.parts)):
            self._land(ctx, p, keep_progress=False)

    def exchange(self, ctx: WorkerContext, part: int = 0) -> None:
        """Push a fragment's pseudo-gradient, pull its servers' parameters, start its new round
        (overlap: land its previous exchange and start this one in the background)."""
        names = self.parts[part]
        some = names if len(self.parts) > 1 else None  # None: the whole model
        now = ctx.views()
        # Without overlap the pseudo-gradient is written straight into the servers' push areas
        # where there are some (shared memory): the push copies nothing, and no whole-model
        # temporary is made. (A push running in the background must not see them change.)
        out = None if self.options.overlap else ctx.push_buffers()
        pseudo = {
            k: np.subtract(self.round_start[k], now[k], out=None if out is None else out[k])
            for k in names
        }
        steps = self.pending[part]
        if self.options.overlap:
            self._land(ctx, part, keep_progress=True)
            bases = ctx.versions  # the landed pull's: no exchange of this fragment runs now

            def exchange() -> tuple[list[PushResult], dict[str, np.ndarray]]:
                results = ctx.push(pseudo)
                return results, ctx.pull_arrays(names=some)[1]

            landed = ctx.views()  # after the land (views are copies off the CPU)
            sent_at = {k: np.array(landed[k]) for k in names}
            self.inflight[part] = (ctx.background(exchange), sent_at, bases, steps)
        else:
            # The model-sized buffers an exchange needs come out of what a round no longer
            # does: the gradients (the next backward makes them again) and, once the pulled
            # values are in the replica, the pull area (a pull writes it again).
            ctx.release_grads()
            bases = ctx.versions
            results = ctx.push(pseudo)
            ctx.pull(names=some, release=True)
            self._pace(ctx, results, bases, steps)
        self._start_in_push_area(ctx, names)
        self.pending[part] = self.lead[part] = 0

    def _start_in_push_area(self, ctx: WorkerContext, names: list[str]) -> None:
        """The new round's start: the parameters now, kept where the next pseudo-gradient will
        be written (the servers' push areas, when there are some and no exchange runs in the
        background), so that the start costs no copy of the model in this worker's memory:
        ``start - theta`` is computed in place. Elsewhere a copy of its own."""
        now = ctx.views()
        areas = None if self.options.overlap else ctx.push_buffers()
        for k in names:
            if areas is not None:
                self.round_start[k] = areas[k]
            elif k not in self.round_start:
                self.round_start[k] = np.empty_like(now[k])
            np.copyto(self.round_start[k], now[k])

    def _land(self, ctx: WorkerContext, part: int, *, keep_progress: bool) -> None:
        """(overlap) Take the fragment's parameters its background exchange pulled, plus the
        progress made since it was sent (``keep_progress``: the round that is being pushed
        now), or exactly them (at the end)."""
        inflight = self.inflight.pop(part, None)
        if inflight is None:
            return
        future, sent_at, bases, steps = inflight
        results, pulled = ctx.wait_for(future)
        if keep_progress:
            now = ctx.views()
            pulled = {k: pulled[k] + (now[k] - sent_at[k]) for k in sent_at}
        ctx.load(pulled, partial=True)
        self._pace(ctx, results, bases, steps)

    def _pace(
        self, ctx: WorkerContext, results: list[PushResult], bases: list[int], steps: int
    ) -> None:
        """(DyLU) the next round's H_i from a push's results (the arrivals since ``bases``)."""
        if not (self.options.dylu and results and results[0].accepted):
            return
        pace = Pace(**self.pace)
        pace.update(arrivals=max(0, results[0].version - 1 - bases[0]), steps=steps)
        self.round_steps = pace.next_round(
            self.round_steps, self.options.inner_steps, ctx.live_workers - 1
        )
        self.pace = dataclasses.asdict(pace)

    def state_dict(self) -> dict[str, Any]:
        """The default's, but the round's start only of the fragments that took an inner step
        since their exchange: the others' is the replica's parameters (the exchange copied
        them), which the worker state holds already."""
        started = {k for p, names in enumerate(self.parts) if self.pending[p] for k in names}
        round_start = self.round_start
        self.round_start = {k: v for k, v in round_start.items() if k in started}
        try:
            return super().state_dict()
        finally:
            self.round_start = round_start

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(After the replica is loaded) the default's; the round's start left out of the
        state is the replica's parameters."""
        saved = dict(state.pop("round_start", {}))
        super().load_state_dict(state)
        if isinstance(self.pending, int):  # a checkpoint written before fragments
            self.pending = [self.pending]
        for k, start in self.round_start.items():
            np.copyto(start, saved[k] if k in saved else self.replica[k].detach().cpu().numpy())

    def stats(self) -> dict[str, float]:
        return {"inner_steps": float(self.round_steps)}
