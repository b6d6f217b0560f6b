"""The live progress line: global step, loss and throughput, read from ``metrics.jsonl``, and
the stragglers the detector names from the same lines (:mod:`distsgd.control.stragglers`)."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from distsgd.control.progress import Rate, format_progress
from distsgd.control.run_view import MetricsFollower
from distsgd.control.stragglers import StragglerDetector, progress_note
from distsgd.control.timing import split_from_metrics, split_line
from distsgd.util import open_private

KEPT_STATUS_SECONDS = 10.0
"""How often the progress line goes into the kept copy of the console (``launcher.log``)."""


class Console:
    """Serialises task output and one live status line on a terminal (a plain log elsewhere)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        quiet: bool = False,
        errors: TextIO | None = None,
    ) -> None:
        self._kept: TextIO | None = None
        self._kept_status_at = 0.0
        self.stream = stream or sys.stdout
        self.errors = errors or (sys.stderr if stream is None else stream)
        """Where :meth:`error` writes: standard error, or ``stream`` when one was given."""
        self.quiet = quiet
        self.tty = self.stream.isatty()
        self._lock = threading.Lock()
        self._status = ""

    def keep(self, path: Path) -> None:
        """Also append what the launcher says (its notes, results, errors, and the progress
        line every :data:`KEPT_STATUS_SECONDS`) to ``path``; task lines have their own logs."""
        fd = open_private(path, os.O_WRONLY | os.O_APPEND)
        self._kept = os.fdopen(fd, "a", encoding="utf-8")

    def close(self) -> None:
        """Close the kept copy (the console itself stays usable)."""
        with self._lock:
            if self._kept is not None:
                self._kept.close()
                self._kept = None

    def _keep(self, text: str) -> None:
        """Append ``text`` to the kept copy; a full disk loses the copy's line, never the
        console's (the run goes on and says so there)."""
        if self._kept is not None:
            try:
                self._kept.write(text + "\n")
                self._kept.flush()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise

    def line(self, text: str) -> None:
        """Print a task's log line (above the status line); hidden when quiet."""
        if not self.quiet:
            self._show(text)

    def note(self, text: str) -> None:
        """The launcher's own line (faults, restarts, the run folder): shown even when quiet."""
        self._show(text, keep=True)

    def _show(self, text: str, *, keep: bool = False) -> None:
        with self._lock:
            if self.tty and self._status:
                self.stream.write("\r\x1b[K")
            self.stream.write(text + "\n")
            if self.tty and self._status:
                self.stream.write(self._status)
            self.stream.flush()
            if keep:
                self._keep(text)

    def status(self, text: str) -> None:
        """Replace the status line (terminal), or print it as a log line (pipe, file)."""
        with self._lock:
            if self.tty:
                self._status = text
                self.stream.write("\r\x1b[K" + text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
            now = time.monotonic()
            if now - self._kept_status_at >= KEPT_STATUS_SECONDS:
                self._kept_status_at = now
                self._keep(text)

    def clear_status(self) -> None:
        with self._lock:
            if self.tty and self._status:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self._status = ""

    def error(self, text: str) -> None:
        """An error line (why the run stopped), on standard error even when quiet."""
        self.clear_status()
        with self._lock:
            self.stream.flush()
            self.errors.write(text + "\n")
            self.errors.flush()
            self._keep(text)

    def final(self, text: str) -> None:
        """Print a line even when quiet (results and errors)."""
        self.clear_status()
        self._show(text, keep=True)


class Progress:
    """Follows ``metrics.jsonl`` as tasks append to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._follower = MetricsFollower(path)
        self.step = 0
        self.loss: float | None = None
        self.accuracy: float | None = None
        self.samples: dict[str, int] = {}
        self.time_split: dict[str, dict[str, float]] = {}
        """Per worker, its seconds per phase when it finished its steps."""
        self.local_steps: dict[str, int] = {}
        self.staleness: dict[str, dict[str, int]] = {}
        """Per worker, the staleness histogram of its ``finished_steps`` line (if it pushed)."""
        self.fractions: dict[str, tuple[float, float]] = {}
        """Per worker, (wall time, fraction of the run done) of its last metrics line."""
        self.started = time.time()
        self.stragglers = StragglerDetector()
        """Fed every record read; the launcher asks it for its verdicts after each poll."""
        self.divergence: str | None = None
        """The first 'diverged' event's reason (a worker's loss went non-finite or up)."""
        self.good_until: int | None = None
        """That event's last good local step (None: none given, a rollback would not help)."""
        self.rates: dict[str, Rate] = {}
        """Per worker, its samples per second since its first metrics line."""
        self.first_record: float | None = None
        """Wall time of the first metrics line: throughput counts from there, not from start-up."""

    def poll(self) -> None:
        for record in self._follower.poll():
            self.stragglers.see(record)
            if self.first_record is None and "time" in record:
                self.first_record = float(record["time"])
            self.step = max(self.step, int(record.get("step", 0)))
            if "loss" in record:
                self.loss = float(record["loss"])
            if record.get("accuracy") is not None:
                self.accuracy = float(record["accuracy"])
            if "samples" in record:
                self.samples[str(record.get("task"))] = int(record["samples"])
                if "time" in record:
                    rate = self.rates.setdefault(str(record.get("task")), Rate())
                    rate.see(float(record["time"]), int(record["samples"]))
            if "local_step" in record:
                self.local_steps[str(record.get("task"))] = int(record["local_step"])
            if isinstance(record.get("progress"), (int, float)) and "time" in record:
                fraction = min(1.0, max(0.0, float(record["progress"])))
                self.fractions[str(record.get("task"))] = (float(record["time"]), fraction)
            if record.get("event") == "finished_steps":
                self.time_split[str(record.get("task"))] = split_from_metrics(record)
                histogram = record.get("staleness")
                if isinstance(histogram, dict):
                    self.staleness[str(record.get("task"))] = histogram
            if record.get("event") == "worker_left":  # scaled down: its last report is stale
                self.fractions.pop(str(record.get("target")), None)
                self.rates.pop(str(record.get("target")), None)
            if record.get("event") == "diverged" and self.divergence is None:
                self.divergence = str(record.get("reason", "training diverged"))
                good = record.get("good_until")
                self.good_until = good if type(good) is int and good >= 0 else None

    def forget_divergence(self) -> None:
        """The run was rolled back: its divergence is behind it."""
        self.divergence = self.good_until = None

    def total_split(self) -> dict[str, float]:
        """Seconds per phase summed over the workers that finished."""
        total: dict[str, float] = {}
        for split in self.time_split.values():
            for phase, seconds in split.items():
                total[phase] = total.get(phase, 0.0) + seconds
        return total

    def split_summary(self) -> str:
        """``time split (2 workers): compute 31% · pull 28% · ...``, or "" before any finished."""
        line = split_line(self.total_split())
        if not line:
            return ""
        n = len(self.time_split)
        return f"time split ({n} worker{'s' if n != 1 else ''}): {line}"

    @property
    def elapsed(self) -> float:
        """Seconds since the launcher started."""
        return time.time() - self.started

    @property
    def samples_per_second(self) -> float | None:
        """Sum over the workers of their rate since their first metrics line (None before
        any worker's second line)."""
        rates = [r.per_second for r in self.rates.values()]
        known = [r for r in rates if r is not None]
        return sum(known) if known else None

    @property
    def fraction(self) -> float | None:
        """How much of the run is done: the least of the workers' last reports (the run ends
        with its slowest worker), or None before any."""
        if not self.fractions:
            return None
        return min(fraction for _, fraction in self.fractions.values())

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the pace since the first metrics line, or None (no pace yet)."""
        fraction = self.fraction
        if fraction is None or fraction <= 0 or self.first_record is None:
            return None
        spent = (time.time() if now is None else now) - self.first_record
        return max(0.0, spent * (1 - fraction) / fraction)

    def render(self) -> str:
        line = format_progress(
            step=self.step,
            fraction=self.fraction,
            loss=self.loss,
            accuracy=self.accuracy,
            samples_per_second=self.samples_per_second,
            elapsed=self.elapsed,
            eta=self.eta(),
        )
        note = progress_note(self.stragglers.named)  # e.g. straggler worker2 (data, 1.8x)
        return f"{line} | {note}" if note else line
