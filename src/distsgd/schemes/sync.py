"""Synchronous SGD through parameter servers, with backup workers.

Chen, Pan, Monga, Bengio, Jozefowicz. *Revisiting Distributed Synchronous SGD.* ICLR 2016
workshop (arXiv:1604.00981); TensorFlow's ``SyncReplicasOptimizer``.

Worker i, at step t::

    w_t  <- pull(min_version = t)       # waits until step t-1 is applied
    g_i  <- grad L(w_t; batch_i)
    push(g_i, base_version = t)

Server, for step t::

    accept g_i only if base_version == t (else: stale, dropped)
    once R = replicas_to_aggregate gradients are in:
        w_{t+1} <- w_t - lr * (1/R) * sum_i g_i      # momentum if --momentum > 0
        t <- t + 1                                   # late gradients for t are now stale

``worker_lrs`` gives each worker its own learning rate (the seed's
"Synchronous-SGD-different-learning-rates"): worker i pushes g_i * lr_i / lr, so a step applies
``w <- w - (1/R) * sum_i lr_i * g_i``.

R defaults to N - backup_workers. With R = N this equals single-process SGD on a batch N times
larger. A worker that finishes leaves; from then on a step closes with min(R, workers left).
Under ``--world-size dynamic`` a step needs the pushes of the shard's live members less the
backups (R - N + members), and closes as soon as a leave or an eviction makes it complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distsgd.control.config import TrainConfig
from distsgd.plan.traffic import Traffic
from distsgd.ps.deadline import StepDeadline, parse_step_timeout
from distsgd.ps.rules import (
    ACCEPTED,
    MAX_WORKERS,
    PushMeta,
    PushOutcome,
    SgdServerOptions,
    UpdateRule,
    bounded,
)
from distsgd.ps.shard import Shard
from distsgd.schemes.base import WorkerRules
from distsgd.schemes.registry import SchemeSpec
from distsgd.transport.errors import PushReject

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    replicas_to_aggregate: int = field(
        default=0, metadata={"help": "gradients averaged per step (0 = workers - backup_workers)"}
    )
    backup_workers: int = field(
        default=0,
        metadata={
            "help": "close each step without the k slowest workers; their gradients are dropped"
        },
    )

    step_timeout: str = field(
        default="60",
        metadata={
            "help": "seconds a step waits for missing (dead) workers, then closes without them; "
            "auto: a deadline learned from the rounds before (stragglers' gradients dropped)"
        },
    )

    worker_lrs: str = field(
        default="",
        metadata={"help": "comma-separated learning rate of each worker (default: all --lr)"},
    )

    def __post_init__(self) -> None:
        self.rates(None)
        if self.replicas_to_aggregate < 0 or self.backup_workers < 0:
            raise ValueError("replicas_to_aggregate and backup_workers must be 0 or more")
        parse_step_timeout(self.step_timeout)

    def rates(self, num_workers: int | None) -> list[float]:
        """``worker_lrs`` as numbers (empty when not given); ValueError if malformed."""
        if not self.worker_lrs:
            return []
        try:
            rates = [float(x) for x in self.worker_lrs.split(",")]
        except ValueError:
            raise ValueError(
                f"worker_lrs must be comma-separated numbers like 0.1,0.2, got {self.worker_lrs!r}"
            ) from None
        if not all(r > 0 for r in rates):
            raise ValueError(f"worker_lrs must all be positive, got {self.worker_lrs!r}")
        if num_workers is not None and len(rates) != num_workers:
            raise ValueError(
                f"worker_lrs has {len(rates)} rates for {num_workers} workers; give one per worker"
            )
        return rates

    def required(self, num_workers: int) -> int:
        """R: gradients that close a step; ValueError when it cannot work with this many workers."""
        if self.backup_workers >= num_workers:
            raise ValueError(
                f"backup_workers={self.backup_workers} leaves no worker to wait for with "
                f"{num_workers} workers; "
                f"use at most {num_workers - 1}"
            )
        r = self.replicas_to_aggregate or num_workers - self.backup_workers
        if (
            self.replicas_to_aggregate
            and self.backup_workers
            and r != num_workers - self.backup_workers
        ):
            raise ValueError(
                f"replicas_to_aggregate={r} contradicts backup_workers={self.backup_workers} with "
                f"{num_workers} workers; give only one of them"
            )
        if r > num_workers:
            raise ValueError(
                f"replicas_to_aggregate={r} exceeds the {num_workers} workers; "
                f"use at most {num_workers}"
            )
        return r


@dataclass(frozen=True, kw_only=True)
class SyncServerOptions(SgdServerOptions):
    """What ``SyncWorker.server_options`` (and SAGN's) sends: the SGD step, R, the timeout."""

    required: int = bounded(low=1, high=MAX_WORKERS, doc="R: pushes that close a step")
    step_timeout: float = bounded(
        60.0, low=0.0, low_open=True, high=86400.0, doc="seconds a step waits for dead workers"
    )
    adaptive_deadline: bool = False
    """``--step-timeout auto``: close a round at a deadline learned from the rounds before."""


def step_timeout_options(value: str) -> dict[str, Any]:
    """The server options of a ``--step-timeout`` value (seconds, or ``auto``)."""
    seconds, adaptive = parse_step_timeout(value)
    return {"step_timeout": seconds, "adaptive_deadline": adaptive}


class SyncServer(UpdateRule):
    def __init__(self, options: Mapping[str, Any], num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.options = SyncServerOptions.from_json(options)
        if self.options.required > num_workers:
            raise ValueError(
                f"option 'required' is {self.options.required}, more than the {num_workers} "
                f"workers; use at most {num_workers}"
            )
        self.required = self.options.required
        self.sgd = self.options.sgd()
        self.deadline = StepDeadline(self.options.step_timeout, self.options.adaptive_deadline)
        self.sums: dict[str, np.ndarray] = {}
        self.contributors: set[int] = set()
        self.opened = time.monotonic()
        self.lr_scales: list[float] = []

    def apply(self, shard: Shard, payload: dict[str, np.ndarray], meta: PushMeta) -> PushOutcome:
        if meta.base_version != shard.version:
            return PushOutcome.refused(
                PushReject.STALE,
                f"computed on version {meta.base_version}, step {shard.version} is open",
            )
        if meta.worker in self.contributors:
            return PushOutcome.refused(
                PushReject.DUPLICATE,
                f"worker {meta.worker} already pushed for step {shard.version}",
            )
        for key, grad in payload.items():
            if key in self.sums:
                self.sums[key] += grad
            else:
                self.sums[key] = np.array(grad, copy=True)
        now = time.monotonic()
        if not self.contributors:
            self.opened = now
        else:
            self.deadline.arrived(now - self.opened)
        self.contributors.add(meta.worker)
        self.lr_scales.append(meta.lr_scale)
        self._maybe_close(shard)
        return ACCEPTED

    def on_leave(self, shard: Shard, worker: int) -> None:
        self._maybe_close(shard)

    def on_membership(self, shard: Shard, members: list[int]) -> None:
        """(world_size dynamic) a member left or was evicted: the open step may now close
        without it, instead of waiting ``step_timeout`` for it."""
        if self.dynamic:
            self._maybe_close(shard)

    def waiting_for(self, shard: Shard) -> dict[str, Any]:
        """The step open on this shard: who pushed for it, who it still waits for (the members,
        or every registered worker, less those that pushed or finished)."""
        everyone = shard.membership.members if self.dynamic else range(self.num_workers)
        return {
            "step": shard.version,
            "open_s": round(time.monotonic() - self.opened, 3) if self.contributors else None,
            "pushed": sorted(self.contributors),
            "missing": sorted(set(everyone) - self.contributors - shard.finished),
        }

    def deadline_at(self) -> float | None:
        """When the open step closes without the workers still missing (None: none open)."""
        return self.opened + self.deadline.allowed() if self.contributors else None

    def tick(self, shard: Shard, now: float) -> None:
        """Close a step that waited its deadline: the step timeout for a dead or stuck worker,
        or under ``--step-timeout auto`` the deadline learned for stragglers."""
        if not self.contributors or now - self.opened < self.deadline.allowed():
            return
        everyone = shard.membership.members if self.dynamic else range(self.num_workers)
        missing = sorted(set(everyone) - self.contributors - shard.finished)
        if self.deadline.learned():
            self.deadline.early_closes += 1
            log.debug(
                "shard %d: step %d closed at its learned deadline (%.3fs) without worker(s) %s",
                shard.index,
                shard.version,
                self.deadline.allowed(),
                missing,
            )
        else:
            log.warning(
                "shard %d: step %d closed after %.0fs with %d of %d gradients; no gradient from "
                "worker(s) %s",
                shard.index,
                shard.version,
                now - self.opened,
                len(self.contributors),
                self.required,
                missing,
            )
        self._close(shard)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({f"sums/{k}": v for k, v in self.sums.items()})
        state["contributors"] = sorted(self.contributors)
        state["lr_scales"] = list(self.lr_scales)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.sums = {
            k[5:]: np.array(v, copy=True) for k, v in state.items() if k.startswith("sums/")
        }
        self.contributors = {int(w) for w in state.get("contributors", [])}
        self.lr_scales = [float(x) for x in state.get("lr_scales", [])]

    def _maybe_close(self, shard: Shard) -> None:
        count = len(self.contributors)
        if self.dynamic:
            # The live members, and those that pushed for this step and then went: R is the
            # registered R less as many workers as the run has fewer (the backups stay backups).
            expected = len(self.contributors | set(shard.membership.members))
            need = max(1, expected - (self.num_workers - self.required))
            if count and count >= need:
                self._close(shard)
            return
        # Workers that pushed for this step and then left still count as expected: their
        # leaving must not close the step before the others' gradients for it arrive.
        expected = shard.active_workers + len(self.contributors & shard.finished)
        if count == 0 or count < min(self.required, max(1, expected)):
            return
        self._close(shard)

    def step_scale(self) -> float:
        """The factor on the summed pushes when a step closes: the mean, at the mean schedule."""
        lr_scale = sum(self.lr_scales) / len(self.lr_scales) if self.lr_scales else 1.0
        return lr_scale / len(self.contributors)

    def _close(self, shard: Shard) -> None:
        self.deadline.closed(time.monotonic())
        self.sgd.step(shard.values, self.sums, scale=self.step_scale())
        self.sums = {}
        self.contributors = set()
        self.lr_scales = []
        shard.bump()


class SyncRules(WorkerRules):
    lr_rule = "sqrt"
    """N workers take 1/N of the steps, each on the mean of N batches: --lr x sqrt(N)."""

    options: SyncOptions

    def __init__(self, options: SyncOptions, num_workers: int) -> None:
        super().__init__(options, num_workers)
        self.required = options.required(num_workers)
        self.rates = options.rates(num_workers)

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        return {
            **super().server_options(config),
            "required": self.required,
            **step_timeout_options(self.options.step_timeout),
        }


SPEC = SchemeSpec(
    name="sync",
    summary="synchronous SGD: each step applies the mean of R fresh gradients, drops stale ones",
    options=SyncOptions,
    rules=SyncRules,
    worker="distsgd.workers.sync:SyncWorker",
    server=SyncServer,
    traffic=Traffic(kind="sync"),
)
