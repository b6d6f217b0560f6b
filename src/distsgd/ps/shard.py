"""One parameter-server shard: its pieces, a version counter, membership, and its update rule."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from distsgd.ps.rules import PushMeta, PushOutcome, UpdateRule


class Shard:
    """Pieces of the model held by one ps task.

    ``version`` counts parameter changes (one per applied update, or per closed step under a
    synchronous rule). Readers wait on ``cond`` for a version; writers call :meth:`bump`.
    """

    def __init__(
        self,
        *,
        index: int,
        scheme: str,
        options_json: str,
        num_workers: int,
        values: Mapping[str, np.ndarray],
        rule: UpdateRule,
        run_id: str = "",
    ) -> None:
        self.index = index
        self.scheme = scheme
        self.options_json = options_json
        self.num_workers = num_workers
        self.values: dict[str, np.ndarray] = {k: np.array(v, copy=True) for k, v in values.items()}
        self.rule = rule
        self.run_id = run_id
        self.version = 0
        self.cond = threading.Condition()
        self.finished: set[int] = set()
        self.incarnations: dict[int, int] = {}
        self.pushes_accepted = 0
        self.pushes_rejected = 0

    def bump(self, steps: int = 1) -> int:
        """Advance the version and wake readers waiting for it."""
        with self.cond:
            self.version += steps
            self.cond.notify_all()
            return self.version

    def wait_for(self, min_version: int, timeout: float) -> bool:
        """Block until ``version >= min_version``; False on timeout."""
        with self.cond:
            return self.cond.wait_for(
                lambda: self.version >= min_version, timeout=max(0.0, timeout)
            )

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """A copy of the pieces and the version they belong to (consistent under locked rules)."""
        if self.rule.locked:
            with self.cond:
                return self.version, {k: v.copy() for k, v in self.values.items()}
        version = self.version
        return version, {k: v.copy() for k, v in self.values.items()}

    def see(self, worker: int, incarnation: int) -> None:
        """Record the worker's incarnation (a restarted worker shows a new one)."""
        if worker >= 0:
            self.incarnations[worker] = incarnation

    def push(self, payload: dict[str, np.ndarray], meta: PushMeta) -> tuple[PushOutcome, int]:
        """Hand a validated payload to the rule; returns the outcome and the version after it."""
        self.see(meta.worker, meta.incarnation)
        if self.rule.locked:
            with self.cond:
                outcome = self.rule.apply(self, payload, meta)
                self._count(outcome)
                return outcome, self.version
        outcome = self.rule.apply(self, payload, meta)
        with self.cond:
            self._count(outcome)
            return outcome, self.version

    def _count(self, outcome: PushOutcome) -> None:
        if outcome.accepted:
            self.pushes_accepted += 1
        else:
            self.pushes_rejected += 1

    def leave(self, worker: int) -> int:
        """Mark a worker finished and let the rule react (a sync step may now close)."""
        with self.cond:
            if worker >= 0 and worker not in self.finished:
                self.finished.add(worker)
                self.rule.on_leave(self, worker)
            return self.version

    @property
    def active_workers(self) -> int:
        return self.num_workers - len(self.finished)
