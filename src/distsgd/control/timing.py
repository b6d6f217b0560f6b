"""Where a worker's time goes: compute, data, pull, push, wait, all-reduce, checkpoints, evaluation.

Every exchange a scheme makes goes through ``WorkerContext`` (runtime/context.py),
which times it into a :class:`PhaseClock`; the loop times checkpoints and mid-run evaluation.
Compute is what is left of the loop's wall time: forward, backward, local optimizer steps.
``data`` is the time ``WorkerSession.batches()`` spent fetching the next batch (a loop over its
own data counts its loading into compute); metrics written before it existed have no ``data_s``
(read as 0).

``wait`` is time a worker spent blocked on other workers rather than moving bytes: the part of
a pull the server spent waiting for a version (a synchronous step closing), as the server
reports it in ``PullHeader.waited_seconds``. Time inside an all-reduce is ``allreduce`` (its
waiting for the slowest peer cannot be told apart from its transfer).

Metrics lines carry the cumulative seconds of each phase as ``<phase>_s`` (``compute_s``,
``pull_s`` ...); :func:`split_line` renders shares such as ``compute 31% · pull 28% · ...``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

PHASES = ("compute", "data", "pull", "push", "wait", "allreduce", "checkpoint", "eval")
"""Every phase, in the order summaries list them."""

COMM_PHASES = ("pull", "push", "wait", "allreduce")
"""The phases that are communication (the rest of a step is compute)."""


class PhaseClock:
    """Cumulative seconds per phase; ``compute`` is derived from the loop's wall time.

    Only the thread that made the clock (the training loop's) counts: an exchange a scheme runs
    in the background (``WorkerContext.background``) overlaps compute, and what it costs the
    loop is the time the loop then waits for it.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._owner = threading.get_ident()
        self._loop_started: float | None = None
        self._loop_seconds = 0.0
        self.doing: tuple[str, float] | None = None
        """The phase the loop's thread is in now and since when (``time.monotonic()``); None
        between exchanges (computing). Read by ``distsgd doctor``, never by the loop."""

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` (clamped at 0) to ``phase``."""
        assert phase in PHASES and phase != "compute", phase
        if threading.get_ident() != self._owner:
            return
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Time the block into ``phase``."""
        started = time.perf_counter()
        try:
            with self.within(phase):
                yield
        finally:
            self.add(phase, time.perf_counter() - started)

    @contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """Within: the loop's thread is in ``phase`` (:attr:`doing`; other threads: no
        change). Two attribute writes: nothing is timed or logged here."""
        if threading.get_ident() != self._owner:
            yield
            return
        before = self.doing
        self.doing = (phase, time.monotonic())
        try:
            yield
        finally:
            self.doing = before

    def start_loop(self) -> None:
        """The training loop starts now: compute is counted from here."""
        self._loop_started = time.perf_counter()

    def stop_loop(self) -> None:
        """The loop ended: its wall time is frozen (later exchanges count to their phase)."""
        if self._loop_started is not None:
            self._loop_seconds += time.perf_counter() - self._loop_started
            self._loop_started = None

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far, compute included (phases never entered are left out)."""
        running = 0.0 if self._loop_started is None else time.perf_counter() - self._loop_started
        loop = self._loop_seconds + running
        out = {"compute": max(0.0, loop - sum(self.seconds.values())), **self.seconds}
        return {phase: out[phase] for phase in PHASES if phase in out}

    def metrics(self) -> dict[str, float]:
        """The totals as metrics fields: ``{"compute_s": ..., "pull_s": ...}`` (4 decimals)."""
        return {f"{phase}_s": round(s, 4) for phase, s in self.totals().items()}


def as_number(value: object) -> float | None:
    """A metrics field's number as a float; None for anything else (a bool included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def split_from_metrics(record: Mapping[str, object]) -> dict[str, float]:
    """The phase seconds a metrics record carries (``<phase>_s`` fields), by phase."""
    split = {phase: as_number(record.get(f"{phase}_s")) for phase in PHASES}
    return {phase: seconds for phase, seconds in split.items() if seconds is not None}


def split_line(seconds: Mapping[str, float]) -> str:
    """``compute 31% · pull 28% · push 33% · wait 8%``: each phase's share of the total
    (phases under 0.5% are left out; "" when nothing was measured)."""
    total = sum(seconds.values())
    if total <= 0:
        return ""
    parts = [
        f"{phase} {100 * seconds[phase] / total:.0f}%"
        for phase in PHASES
        if seconds.get(phase, 0.0) / total >= 0.005
    ]
    return " · ".join(parts)
