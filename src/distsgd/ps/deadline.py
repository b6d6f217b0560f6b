"""An adaptive straggler deadline for synchronous rounds (``--step-timeout auto``).

Chen et al. (*Revisiting Distributed Synchronous SGD*, 2016) close each step without the k
slowest workers ("backup workers"), k fixed in advance. With ``--step-timeout auto`` the sync
and SAGN servers instead close a round at a deadline learned from the rounds before it:

    lag_i    = arrival of push i - arrival of the round's first push     (pushes in time only)
    period_t = close of round t - close of round t - 1
    deadline = first push + min(timeout, max(K * median(lag), F * median(period)))

over the last :data:`WINDOW` lags and periods, with ``K = 3`` and ``F = 1/4``. A worker whose
gradient arrives after the deadline has it refused as stale, as a backup worker's is, and goes
on with the next round. Until :data:`WARMUP` lags are known, and where the rule is fixed, the
deadline is the step timeout (the time allowed a dead worker). What a round closed early cost
is counted (``early_closes``) and logged.

Why these: a worker that is as fast as the others arrives within a few times the typical lag of
the others, while a straggler arrives a compute step or more later; the floor of a quarter of a
round's period keeps a deadline from shrinking to the noise of the lags themselves (the lags of
the workers that made it are all that is measured once a straggler is cut off).
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 64
"""Lags and periods remembered (the last ones)."""
WARMUP = 16
"""Lags needed before the deadline is learned; the step timeout holds until then."""
LAG_FACTOR = 3.0
PERIOD_FACTOR = 0.25
AUTO = "auto"
"""The value of ``--step-timeout`` that turns the learned deadline on."""


def parse_step_timeout(value: object, default: float = 60.0) -> tuple[float, bool]:
    """``--step-timeout``'s value as (seconds, adaptive): a positive number of seconds, or
    ``auto`` (the learned deadline, with ``default`` seconds for a dead worker)."""
    text = str(value).strip().lower()
    if text == AUTO:
        return default, True
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"step_timeout must be a number of seconds or 'auto', got {value!r}"
        ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"step_timeout must be positive, got {value!r}")
    return seconds, False


class StepDeadline:
    """The deadline of the open round, fixed (``adaptive=False``) or learned."""

    def __init__(self, timeout: float, adaptive: bool) -> None:
        self.timeout = timeout
        self.adaptive = adaptive
        self.lags: deque[float] = deque(maxlen=WINDOW)
        self.periods: deque[float] = deque(maxlen=WINDOW)
        self.last_close: float | None = None
        self.early_closes = 0
        """Rounds closed at the learned deadline with gradients missing."""

    def arrived(self, lag: float) -> None:
        """A push arrived ``lag`` seconds after the round's first (not the first itself)."""
        self.lags.append(max(0.0, lag))

    def closed(self, now: float) -> None:
        if self.last_close is not None:
            self.periods.append(max(0.0, now - self.last_close))
        self.last_close = now

    def allowed(self) -> float:
        """Seconds after the round's first push that the round may wait."""
        if not self.adaptive or len(self.lags) < WARMUP:
            return self.timeout
        learned = LAG_FACTOR * statistics.median(self.lags)
        if self.periods:
            learned = max(learned, PERIOD_FACTOR * statistics.median(self.periods))
        return min(self.timeout, learned)

    def learned(self) -> bool:
        """Whether the deadline now is the learned one (not the step timeout)."""
        return self.adaptive and len(self.lags) >= WARMUP and self.allowed() < self.timeout
