"""A diverged run rolled back: one pure decision, :func:`plan_rollback`.

When a worker's loss spikes or becomes NaN (:mod:`distsgd.control.divergence`), restarting it
as it was would only diverge again, and ending the run throws away what it learned before.
Large-model practice does neither: PaLM (Chowdhery et al. 2022, section 5.1) restarted from a
checkpoint about 100 steps before a spike and skipped the batches around it; OPT-175B (Zhang
et al. 2022, its logbook) went back to the last good checkpoint and lowered the learning rate.
distsgd does the latter, for every scheme alike:

* the whole run goes back to its newest complete checkpoint taken at or before the last step
  the worker's loss was still good (``good_until``: the end of its best window for a spike,
  :data:`~distsgd.control.divergence.WINDOW` steps before a NaN), or to the start when there is
  none (newer checkpoints hold the spiked state and are set aside);
* every rate is multiplied by :data:`LR_CUT` more (``TrainConfig.lr_cut``: 0.5 after the first
  rollback, 0.25 after the second): the workers' local optimizers and the servers' updates;
* after ``--max-rollbacks`` (:data:`MAX_ROLLBACKS`) the next divergence ends the run with exit
  code 3, as one without rollbacks does.

Each rollback is a ``rollback`` record in ``metrics.jsonl``, a line on the console and an entry
of ``result.json``'s ``rollbacks``. Torch-free: the launcher carries the plan out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from distsgd.control.checkpoint.store import Checkpoint

MAX_ROLLBACKS = 2
"""Rollbacks a run takes by default (``--max-rollbacks``) before a divergence ends it."""

LR_CUT = 0.5
"""Each rollback multiplies every rate by this."""


@dataclass(frozen=True, kw_only=True)
class RollBack:
    """Start the whole run again from a good state at a lower rate."""

    checkpoint: Checkpoint | None
    """The newest complete checkpoint at or before the last good step (None: the start)."""
    newer: tuple[Checkpoint, ...]
    """Complete checkpoints after it: they hold the spiked state, and are set aside."""
    lr_cut: float
    """``TrainConfig.lr_cut`` from now on: the factor on every rate."""
    number: int
    """This rollback's number (1 for the first)."""
    lost_steps: int
    """Local steps of the furthest worker that are done again."""
    why: str
    """The divergence, in words."""

    def record(self) -> dict[str, object]:
        """Its entry in ``result.json``'s ``rollbacks`` (and its metrics record's fields)."""
        return {
            "rollback": self.number,
            "why": self.why,
            "to_step": 0 if self.checkpoint is None else self.checkpoint.step,
            "from_checkpoint": None if self.checkpoint is None else self.checkpoint.path.name,
            "lr_cut": self.lr_cut,
            "lost_steps": self.lost_steps,
        }


RECORD_FIELDS = ("rollback", "why", "to_step", "from_checkpoint", "lr_cut", "lost_steps")
"""The fields of :meth:`RollBack.record`."""


def rollbacks_in(lines: Iterable[str]) -> tuple[dict[str, object], ...]:
    """The rollbacks a run took, from its ``metrics.jsonl`` lines (the launcher's ``fault``
    records of action ``rollback``), as :meth:`RollBack.record` gave them: what a resumed run
    counts against ``--max-rollbacks`` and lists in ``result.json``. Lines that are not JSON
    objects (a line cut short by a crash) are passed over."""
    found = []
    for line in lines:
        if '"rollback"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and record.get("event") == "fault"
            and record.get("action") == "rollback"
        ):
            found.append({k: record.get(k) for k in RECORD_FIELDS})
    return tuple(found)


def plan_rollback(
    *,
    why: str,
    good_until: int | None,
    furthest: int,
    checkpoints: Sequence[Checkpoint],
    done: int,
    max_rollbacks: int,
    lr_cut: float,
) -> RollBack | None:
    """The rollback for a divergence (``why``) whose last good local step is ``good_until``,
    the furthest worker at local step ``furthest``; None when the run should stop instead: no
    rollbacks left (``done`` of ``max_rollbacks``), or a divergence a rollback would not help
    (``good_until`` None). ``checkpoints``: the complete ones, oldest first; ``lr_cut``: the
    factor the run applies now."""
    if good_until is None or done >= max_rollbacks:
        return None
    good = [c for c in checkpoints if c.step <= good_until]
    chosen = good[-1] if good else None
    at = 0 if chosen is None else chosen.step
    return RollBack(
        checkpoint=chosen,
        newer=tuple(c for c in checkpoints if c.step > at),
        lr_cut=lr_cut * LR_CUT,
        number=done + 1,
        lost_steps=max(0, furthest - at),
        why=why,
    )
