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
:data:`DIVERGED_EXIT_CODE`. The launcher does not restart the task as it is (the same settings
would diverge again): it rolls the whole run back to its last good checkpoint at half the rate
(:mod:`distsgd.control.rollback`), up to ``--max-rollbacks`` times, and then reports the run's own
exit code 3 with the fix. A run that ends diverged by the last two rules finishes normally, and
its ``result.json`` says ``"diverged": true``.

A *loss spike* is the second rule caught while a rollback can still save the run: a worker's
loss, over :data:`WINDOW` steps, back above where it started by more than :data:`SIGMAS`
standard errors, for :data:`WINDOW` steps in a row, after it had come :data:`SPIKE_ARMED` of the
way down (all its progress undone; a worker's loss that climbs only part of the way back can
recover alone: measured on the demo under AGN with slow peers, the chief's own loss went from
1.06 back to 2.05 of 2.31 while the servers' model ended at 0.96 accuracy). A worker watches for
spikes only when the launcher can roll the run back (:class:`LossSpiked`); alone, or with no
rollbacks left, a spike is judged at the end by the second rule.
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

SPIKE_ARMED = 0.2
"""Spikes are watched for once the best window is this share of the start's size below it:
before that, a loss that wobbles as it sets off (common under asynchronous schemes, measured
on the demo: from 2.3 down to 2.0 and back within 40 steps) has made no progress to undo, and
the end's verdict judges it."""

DIVERGED_EXIT_CODE = 86
"""Exit code of a worker task whose training diverged (the launcher does not restart it as it
was: it rolls the run back at a lower rate, or stops it)."""


class Diverged(FloatingPointError):
    """Training diverged; the message says where and how. ``good_until``: the last local step
    whose state was still good, where a rollback may go back to (None: a rollback would not
    help, e.g. the servers refused a non-finite push under ``--nonfinite stop``)."""

    def __init__(self, message: str, *, good_until: int | None = None) -> None:
        super().__init__(message)
        self.good_until = good_until


class LossSpiked(Diverged):
    """The loss spiked (see the module's docstring): the run is rolled back."""


class DivergenceMonitor:
    """Follows one worker's training loss; :meth:`observe` raises on a non-finite loss."""

    def __init__(
        self, name: str, window: int = WINDOW, *, from_start: bool = True, spikes: bool = False
    ) -> None:
        self.name = name
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=window)
        self.window = window
        self.seen = 0
        self.from_start = from_start
        """False for a worker resumed mid-run: its first losses are not the run's start."""
        self.spikes = spikes
        """Whether a loss spike raises :class:`LossSpiked` (the launcher can roll back)."""
        self.best: float | None = None
        """The lowest mean of :attr:`window` losses in a row so far."""
        self.best_step = 0
        """The local step at the end of that window."""
        self.above = 0
        """Steps in a row whose window was above the spike's threshold."""
        self._first_variance: float | None = None

    def observe(self, loss: float, step: int) -> None:
        """One step's loss; :class:`Diverged` when it is not finite, :class:`LossSpiked` on a
        spike (when watched for)."""
        if not math.isfinite(loss):
            raise Diverged(
                f"{self.name}: the training loss became {loss} at step {step}",
                good_until=max(0, step - self.window),
            )
        self.seen += 1
        if len(self.first) < self.window:
            self.first.append(loss)
        self.last.append(loss)
        if len(self.last) < self.window:
            return
        now = sum(self.last) / self.window
        if self.best is None or now <= self.best:
            self.best, self.best_step, self.above = now, step, 0
        elif self.spikes and len(self.first) == self.window:
            self._check_spike(now, step)

    def _check_spike(self, now: float, step: int) -> None:
        """Raise :class:`LossSpiked` if the windows ending at ``step`` (mean ``now``) and the
        :attr:`window` before it were above where the loss started, by :data:`SIGMAS`
        standard errors of the two windows' difference, after it had come down."""
        start, best = sum(self.first) / self.window, self.best
        assert best is not None
        if start - best < SPIKE_ARMED * abs(start):
            return
        # the spread only where the loss is above its start (statistics.variance costs about
        # 45 us: not on every step of a run that is going well)
        if now <= start or now <= start + SIGMAS * self._spread():
            self.above = 0
            return
        self.above += 1
        if self.above >= self.window:  # it stayed up: no passing wobble that recovers alone
            raise LossSpiked(
                f"{self.name}: the training loss spiked back to {now:.4g} at step {step}, above "
                f"where it started ({start:.4g}; it was down to {best:.4g} at step "
                f"{self.best_step}; means of {self.window} steps)",
                good_until=self.best_step,
            )

    def _spread(self) -> float:
        """The standard error of the difference of the first and the last window's means."""
        if self._first_variance is None:  # the first window is full and fixed by now
            self._first_variance = statistics.variance(self.first)
        return math.sqrt((self._first_variance + statistics.variance(self.last)) / self.window)

    def loss_verdict(self, *, left: bool = False) -> str | None:
        """Why the run counts as diverged by its loss, or None. Needs two full windows, and a
        worker that trained until the run's end (``left``: it left mid-run, scaled down)."""
        if not self.from_start or left or self.seen < 2 * self.window:
            return None
        start, end = sum(self.first) / self.window, sum(self.last) / self.window
        if end > start + SIGMAS * self._spread():
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
