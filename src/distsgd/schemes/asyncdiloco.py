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

import math
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
    UpdateRule,
    axpy,
    bounded,
)
from distsgd.ps.shard import Shard
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.diloco import check_rounds
from distsgd.schemes.registry import SchemeSpec

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
        check_rounds(self.inner_steps, self.fragments)
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


class AsyncDilocoRules(WorkerRules):
    lr_rule = "none"
    """``--lr`` is not its rate: the inner AdamW's is ``inner_lr``, the servers' ``outer_lr``."""

    options: AsyncDilocoOptions

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        o = self.options
        return {
            "outer_lr": o.outer_lr,
            "outer_momentum": o.outer_momentum,
            "nesterov_period": o.nesterov_period,
            "staleness": o.staleness,
        }


SPEC = SchemeSpec(
    name="asyncdiloco",
    summary="asynchronous DiLoCo: H inner AdamW steps, then push the pseudo-gradient; the "
    "servers take Delayed Nesterov steps as pushes arrive",
    options=AsyncDilocoOptions,
    rules=AsyncDilocoRules,
    worker="distsgd.workers.asyncdiloco:AsyncDilocoWorker",
    server=DelayedNesterovServer,
    step_size=("inner_lr", "outer_lr"),
    traffic=Traffic(kind="async", period_option="inner_steps", overlap_option="overlap"),
)
