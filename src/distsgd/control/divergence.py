"""Divergence is never silent: the rules that mark a run diverged, and how a task reports it.

A run has diverged when

* a worker's training loss becomes NaN or infinite (the worker stops at once), or
* the training loss ends clearly above where it started: the mean of a worker's last
  :data:`WINDOW` losses exceeds the mean of its first :data:`WINDOW` by more than
  :data:`SIGMAS` standard errors of the difference (a loss that merely wobbles on a plateau
  is not flagged; a worker resumed from a checkpoint is judged only on a run from step 0, and
  a worker that left an elastic run before its end not at all: its last steps are not the
  run's end, which the other workers and the chief's accuracy judge), or
* the chief's final test accuracy is at or below chance: the share of the test set's most
  frequent class, which a model that always answers that class scores (with a margin of
  :data:`CHANCE_MARGIN` for the noise of a collapsed model's answers).

A run at chance whose parameters barely moved from where training started (less than
:data:`STALL_MOVEMENT` of their size) did not blow up: it *stalled*, its steps too small or too
few to learn (``TrainResult.stalled``; still a failed run, ``diverged`` too), and the fix is the
opposite one: raise the step size or train longer, not lower it. Its loss tells nothing apart:
a model that blew up and collapsed to one answer ends at the same loss as an untrained one.
Between :data:`STALL_MOVEMENT` and :data:`BLOWUP_MOVEMENT` the run is *unclear*
(``TrainResult.unclear``): the launcher names both fixes.

A worker that diverges raises :class:`Diverged`; the bootstrap turns it into the task exit code
:data:`DIVERGED_EXIT_CODE`, which the launcher never restarts (the same settings would diverge
again) and reports as the run's own exit code 3 with the fix. A run that ends diverged by the
last two rules finishes normally, and its ``result.json`` says ``"diverged": true``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

WINDOW = 10
"""Losses averaged at each end of a worker's run."""

SIGMAS = 3.0
"""How many standard errors above its start the loss must end to count as diverged."""

CHANCE_MARGIN = 0.02
"""Final accuracy up to this much above chance still counts as chance."""

BLOWUP_MOVEMENT = 1.0
"""A run at chance whose parameters moved at least this share of their norm blew up
(diverged); between :data:`STALL_MOVEMENT` and this it is *unclear*: it may have blown up and
collapsed, or not got going (``TrainResult.unclear``), and the launcher names both fixes."""

STALL_MOVEMENT = 0.1
"""A run at chance stalled when its parameters moved less than this share of their norm
(:func:`relative_movement`). Measured on the demo: 0.00 at lr 1e-4 and 0.02 at lr 0.03 on 8
workers (both at chance), 0.69 for a run that learned, 1.2 to 2.7 for runs that diverged to
chance."""

MOVEMENT_SAMPLE = 4096
"""Elements of each parameter tensor kept (evenly strided) to measure the movement."""

DIVERGED_EXIT_CODE = 86
"""Exit code of a worker task whose training diverged (the launcher does not restart it)."""


class Diverged(FloatingPointError):
    """Training diverged; the message says where and how."""


class DivergenceMonitor:
    """Follows one worker's training loss; :meth:`observe` raises on a non-finite loss."""

    def __init__(self, name: str, window: int = WINDOW, *, from_start: bool = True) -> None:
        self.name = name
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=window)
        self.window = window
        self.seen = 0
        self.from_start = from_start
        """False for a worker resumed mid-run: its first losses are not the run's start."""

    def observe(self, loss: float, step: int) -> None:
        if not math.isfinite(loss):
            raise Diverged(f"{self.name}: the training loss became {loss} at step {step}")
        self.seen += 1
        if len(self.first) < self.window:
            self.first.append(loss)
        self.last.append(loss)

    @property
    def start_loss(self) -> float | None:
        return sum(self.first) / len(self.first) if self.first else None

    @property
    def end_loss(self) -> float | None:
        return sum(self.last) / len(self.last) if self.last else None

    def loss_verdict(self, *, left: bool = False) -> str | None:
        """Why the run counts as diverged by its loss, or None. Needs two full windows, and a
        worker that trained until the run's end (``left``: it left mid-run, scaled down)."""
        start, end = self.start_loss, self.end_loss
        if start is None or end is None or not self.from_start or left:
            return None
        if self.seen < 2 * self.window:
            return None
        spread = math.sqrt(
            (statistics.variance(self.first) + statistics.variance(self.last)) / self.window
        )
        if end > start + SIGMAS * spread:
            return (
                f"{self.name}: the training loss ended at {end:.4g}, above where it started "
                f"({start:.4g}; means of the first and last {self.window} steps)"
            )
        return None


def accuracy_verdict(accuracy: float | None, chance: float | None) -> str | None:
    """Why a final accuracy counts as diverged (at or below chance), or None."""
    if accuracy is None or chance is None:
        return None
    if accuracy <= chance + CHANCE_MARGIN:
        return (
            f"the final test accuracy {accuracy:.4f} is no better than chance ({chance:.4f}, "
            "always answering the most frequent class)"
        )
    return None


def relative_movement(start: Sequence[np.ndarray], end: Sequence[np.ndarray]) -> float:
    """||end - start|| / ||start|| over parameter samples taken alike (inf from all zeros)."""
    moved = math.sqrt(sum(float(np.sum((e - s) ** 2)) for s, e in zip(start, end, strict=True)))
    size = math.sqrt(sum(float(np.sum(s**2)) for s in start))
    if size == 0.0:
        return math.inf if moved else 0.0
    return moved / size


def unclear_verdict(verdict: str, movement: float) -> str:
    """``verdict`` (a final accuracy at chance) for a run whose parameters moved between
    :data:`STALL_MOVEMENT` and :data:`BLOWUP_MOVEMENT` of their size."""
    return (
        f"{verdict}, and the parameters moved {movement:.0%} of their size: too much for a "
        "run that never got going, too little to be sure it blew up"
    )


def stalled_verdict(verdict: str, movement: float) -> str:
    """``verdict`` (a final accuracy at chance) for a run whose parameters barely moved."""
    return (
        f"{verdict}, and the parameters moved only {movement:.2%} of their size from where "
        "training started"
    )
