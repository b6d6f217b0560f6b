"""Asynchronous DiLoCo over parameter servers: Delayed Nesterov and dynamic local updates.

Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato. *Asynchronous Local-SGD Training
for Language Modeling.* arXiv:2401.09135 (2024). The inner and outer optimizers are DiLoCo's
(Douillard et al., arXiv:2311.08105): AdamW inside, Nesterov-momentum SGD outside.

Worker i, with H_i inner steps per round (H_i = H unless ``dylu``)::

    theta_i <- pull();  start <- theta_i
    repeat H_i times:  theta_i <- AdamW(theta_i, grad L(theta_i; batch_i), inner_lr)
    push(g = start - theta_i)                        # the pseudo-gradient, as soon as it is done

Server, on each arriving g (the t-th, counted from 1), with N = ``nesterov_period`` (0: the
number of workers) and the paper's Delayed Nesterov (DN) update::

    g     <- w(tau) * g                              # staleness weight, 1 unless asked
    acc   <- acc + g
    if t % N == 0:                                   # every N arrivals: the momentum step
        m     <- beta * m + acc / N
        theta <- theta - outer_lr * (beta * m + g / N)
        acc   <- 0
    else:                                            # in between: the gradient alone
        theta <- theta - outer_lr * g / N

Over N arrivals the parameters move by ``outer_lr * (mean g + beta * m)``: one Nesterov step
on the mean pseudo-gradient, as synchronous DiLoCo takes once per round, but every worker's
change lands at once instead of waiting for the slowest. ``nesterov_period = 1`` is the naive
asynchronous form the paper starts from (a full Nesterov step per arrival: momentum built from
stale pseudo-gradients, which it shows to lag). ``tau`` is how many other arrivals the shard
applied since the worker pulled; ``staleness = "inverse"`` weights ``w = n / max(n, tau + 1)``
for n workers, which leaves a round where every worker arrives once (tau < n) at full weight
and shrinks only a straggler's change that missed more (the paper weighs none; it is an
option here).

Dynamic local updates (DyLU, ``dylu``): the paper sets each worker's H_i = H * v_i / v_max from
the workers' speeds v, so that all push at about the rate of the fastest. The speeds are not
known ahead here, so each worker measures them in its own rounds: G, the other workers'
arrivals between its pull and its push (what the servers' answers to its pushes say), against
S, the inner steps it took meanwhile. The n - 1 others then push once per (n - 1) * S / G of
its steps, and the round that ends with theirs is::

    H_i <- clamp(round((n - 1) * S / G), ceil(H / 8), H)       # H when G = 0

with S and G summed over its recent rounds (the old sums times 3/4 at each round, about four
rounds' worth), from its second round on, and H_i changed only where the new value differs by
more than 20%: one round's G is off by one arrival or so, and without the margin equal
workers' noise would walk every H_i down. A fast worker finds (n - 1) * S / G above H and stays
at H; a worker 3x slower than the others converges on H / 3. It matches the others' mean rate
rather than the fastest, which is the same once every slow worker has adjusted.

Streaming (``fragments = P > 1``, Douillard et al., arXiv:2501.18512, over the servers): the
tensors are cut into P runs of consecutive tensors (as :mod:`~distsgd.schemes.diloco` cuts
them) and fragment p is pushed and pulled alone, every H steps from step p * H / P on::

    at each step t where (t - p * H / P) % H == 0:
        push(g_p = start_p - theta_i,p);  theta_i,p <- pull(p);  start_p <- theta_i,p

so one fragment travels at a time: the bytes per round are the model's, the peak per
exchange 1/P of it. The servers count arrivals per piece (each fragment's pieces see one
push per worker per H steps, as the whole model does with P = 1), so N keeps its meaning.
Fragments come without DyLU and staleness weights (both read a shard's version, which every
fragment's push moves; refused with a message).

Overlap (``overlap``): a round's exchange (each fragment's, with fragments) runs in the
background while the next round's inner steps run, and lands as the next one starts: the
replica takes the pulled values plus the steps it took since the push was sent. One outer step
of delay, as Streaming DiLoCo's tau = H.

The inner AdamW keeps its state across rounds (DiLoCo does the same); the chief evaluates the
servers' parameters. A remainder round shorter than H_i is pushed when the worker finishes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from concurrent.futures import Future
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
    UpdateRule,
    axpy,
    bounded,
)
from distsgd.ps.shard import Shard
from distsgd.runtime.context import WorkerContext
from distsgd.runtime.scheme import WorkerScheme
from distsgd.schemes.diloco import fragment_of
from distsgd.schemes.registry import SchemeSpec
from distsgd.transport.client import PushResult

STALENESS_WEIGHTS = ("none", "inverse")
DYLU_DEADBAND = 0.2
"""H_i changes only when the new estimate differs from it by more than this fraction."""
DYLU_FLOOR = 8
"""H_i never falls below H / DYLU_FLOOR (rounded up)."""
DYLU_DECAY = 0.75
"""DyLU's sums are multiplied by this at each round (about four rounds' worth)."""


@dataclass(frozen=True, kw_only=True)
class AsyncDilocoOptions:
    inner_steps: int = field(default=10, metadata={"help": "H: inner steps between pushes"})
    inner_lr: float = field(default=5e-3, metadata={"help": "the inner AdamW's learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "the inner AdamW's weight decay"})
    outer_lr: float = field(default=0.7, metadata={"help": "the servers' outer Nesterov rate"})
    outer_momentum: float = field(
        default=0.5, metadata={"help": "the outer Nesterov momentum (beta; DiLoCo's 0.9 lags)"}
    )
    nesterov_period: int = field(
        default=0,
        metadata={
            "help": "N of Delayed Nesterov: a momentum step every N arrivals, the gradient "
            "alone between (0 = the number of workers; 1 = Nesterov on every arrival)"
        },
    )
    staleness: str = field(
        default="none",
        metadata={"help": "weight of a late pseudo-gradient: none, or inverse (n / (tau + 1))"},
    )
    dylu: bool = field(
        default=False,
        metadata={"help": "dynamic local updates: slower workers take fewer inner steps"},
    )
    overlap: bool = field(
        default=False,
        metadata={
            "help": "push and pull in the background while the next round's inner steps run "
            "(the servers' parameters arrive one round late)"
        },
    )

    fragments: int = field(
        default=1,
        metadata={
            "help": "P: Streaming DiLoCo's staggered fragments, each pushed and pulled every "
            "H inner steps at its own offset (1 = the whole model at once)"
        },
    )

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {self.inner_steps}")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(
                f"fragments must be between 1 and inner_steps ({self.inner_steps}), "
                f"got {self.fragments}"
            )
        if self.fragments > 1 and self.dylu:
            raise ValueError(
                "dylu measures a round by whole-model pushes and cannot pace fragments; "
                "drop --dylu or use --fragments 1"
            )
        if self.fragments > 1 and self.staleness != "none":
            raise ValueError(
                "staleness weights count a shard's arrivals, which fragments multiply; "
                "use --staleness none with --fragments"
            )
        for name in ("inner_lr", "outer_lr"):
            if not 0 < getattr(self, name) <= MAX_RATE:
                raise ValueError(f"{name} must be in (0, {MAX_RATE:g}], got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be 0 or more, got {self.weight_decay}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.nesterov_period < 0:
            raise ValueError(
                f"nesterov_period must be 0 (the number of workers) or more, "
                f"got {self.nesterov_period}"
            )
        if self.staleness not in STALENESS_WEIGHTS:
            raise ValueError(
                f"staleness must be one of {', '.join(STALENESS_WEIGHTS)}, got {self.staleness!r}"
            )


@dataclass(frozen=True, kw_only=True)
class DelayedNesterovOptions(ServerOptions):
    """What :meth:`AsyncDilocoWorker.server_options` sends."""

    outer_lr: float = bounded(low=0.0, low_open=True, high=MAX_RATE, doc="the outer rate")
    outer_momentum: float = bounded(0.5, low=0.0, high=0.999, doc="beta")
    nesterov_period: int = bounded(0, low=0, high=1 << 16, doc="N (0: the workers counted)")
    staleness: str = bounded("none", doc="none or inverse")

    def __post_init__(self) -> None:
        if self.staleness not in STALENESS_WEIGHTS:
            raise ValueError(
                f"option 'staleness' must be one of {', '.join(STALENESS_WEIGHTS)}, "
                f"got {self.staleness[:40]!r}"
            )


class DelayedNesterovServer(UpdateRule):
    """The outer step per arrival (the module docstring's DN update), on numpy arrays."""

    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = DelayedNesterovOptions.from_json(options)
        self.momentum: dict[str, np.ndarray] = {}
        self.buffered: dict[str, np.ndarray] = {}
        self.arrivals: dict[str, int] = {}
        """Pushes that carried each piece (fragments carry some pieces only)."""

    def period(self, shard: Shard) -> int:
        return self.options.nesterov_period or self.workers(shard)

    def weight(self, shard: Shard, meta: PushMeta) -> float:
        if self.options.staleness == "none":
            return 1.0
        n = self.workers(shard)
        tau = max(0, shard.version - meta.base_version)
        return n / max(n, tau + 1)

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        o, period = self.options, self.period(shard)
        rate = o.outer_lr  # constant, as DiLoCo's outer step (the schedule scales inner_lr)
        weight = self.weight(shard, meta)
        for key, g in payload.items():
            arrivals = self.arrivals[key] = self.arrivals.get(key, 0) + 1
            momentum_step = arrivals % period == 0
            values = shard.values[key]
            acc = self.buffered.get(key)
            if acc is None:
                acc = self.buffered[key] = np.zeros_like(values)
            axpy(acc, weight, g)
            if momentum_step:
                m = self.momentum.get(key)
                if m is None:
                    m = self.momentum[key] = np.zeros_like(values)
                m *= o.outer_momentum
                axpy(m, 1.0 / period, acc)
                axpy(values, -rate * o.outer_momentum, m)
                acc.fill(0.0)
            axpy(values, -rate * weight / period, g)
        shard.bump()
        return ACCEPTED

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"arrivals/{k}": v for k, v in self.arrivals.items()}
        out.update({f"momentum/{k}": v for k, v in self.momentum.items()})
        out.update({f"buffered/{k}": v for k, v in self.buffered.items()})
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, target in (("momentum", self.momentum), ("buffered", self.buffered)):
            target.clear()
            prefix = f"{name}/"
            for key, value in state.items():
                if key.startswith(prefix):
                    target[key[len(prefix) :]] = np.array(value, dtype=np.float32, copy=True)
        self.arrivals = {
            key[len("arrivals/") :]: int(value)
            for key, value in state.items()
            if key.startswith("arrivals/")
        }
        if "arrivals" in state:  # written before fragments: one count for every piece
            self.arrivals = dict.fromkeys(self.buffered, int(state["arrivals"]))


@dataclass
class Pace:
    """DyLU's running sums (see the module docstring); plain numbers, checkpointable."""

    steps: float = 0.0
    """This worker's inner steps over its recent rounds (decayed by :data:`DYLU_DECAY`)."""
    arrivals: float = 0.0
    """The other workers' pushes that arrived during those rounds (decayed alike)."""
    rounds: int = 0
    """Rounds measured."""

    def update(self, *, arrivals: int, steps: int) -> None:
        self.steps = DYLU_DECAY * self.steps + steps
        self.arrivals = DYLU_DECAY * self.arrivals + arrivals
        self.rounds += 1

    def next_round(self, current: int, most: int, others: int) -> int:
        """H_i for the next round: ``current`` unless the estimate moved past the deadband."""
        if self.rounds < 2 or others < 1:
            return current
        wanted = most if self.arrivals <= 0 else round(others * self.steps / self.arrivals)
        wanted = min(most, max(math.ceil(most / DYLU_FLOOR), wanted))
        if abs(wanted - current) <= DYLU_DEADBAND * current:
            return current
        return wanted


Inflight = tuple[
    Future[tuple[list[PushResult], dict[str, np.ndarray]]], dict[str, np.ndarray], list[int], int
]
"""(overlap) A fragment's background exchange: (its future, the fragment's values when it was
sent, the shard versions its push was based on, the inner steps it carries)."""


class AsyncDilocoWorker(WorkerScheme):
    lr_rule = "none"
    """``--lr`` is not its rate: the inner AdamW's is ``inner_lr``, the servers' ``outer_lr``."""
    transient = ("inflight", "replica")

    def __init__(self, options: AsyncDilocoOptions, num_workers: int) -> None:
        self.options = options
        self.round_steps = options.inner_steps
        self.pace: dict[str, Any] = {"steps": 0.0, "arrivals": 0.0, "rounds": 0}
        """:class:`Pace` as plain values (a checkpoint holds no objects)."""
        self.inflight: dict[int, Inflight] = {}
        """(overlap) Fragment -> its exchange running in the background (not state: none
        after a restart)."""

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        o = self.options
        return {
            "outer_lr": o.outer_lr,
            "outer_momentum": o.outer_momentum,
            "nesterov_period": o.nesterov_period,
            "staleness": o.staleness,
        }

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
        if self.options.dylu and results and results[0].accepted:
            self._adjust(ctx, arrivals=max(0, results[0].version - 1 - bases[0]), steps=steps)

    def _adjust(self, ctx: WorkerContext, *, arrivals: int, steps: int) -> None:
        pace = Pace(**self.pace)
        pace.update(arrivals=arrivals, steps=steps)
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


SPEC = SchemeSpec(
    name="asyncdiloco",
    summary="asynchronous DiLoCo: H inner AdamW steps, then push the pseudo-gradient; the "
    "servers take Delayed Nesterov steps as pushes arrive",
    options=AsyncDilocoOptions,
    worker=AsyncDilocoWorker,
    server=DelayedNesterovServer,
    step_size=("inner_lr", "outer_lr"),
    local_optimizer=True,
    traffic=Traffic(kind="async", period_option="inner_steps", overlap_option="overlap"),
)
