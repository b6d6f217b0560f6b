"""The progress line: ``[distsgd] step 120 | 40% | loss 0.4213 | 2561 samples/s | 12s, about
18s left``. The launcher renders it from ``metrics.jsonl``; a script run alone renders its own
(:class:`AloneProgress`), so both look the same.

Throughput counts from each worker's first metrics line, never from start-up: the samples a
worker reports after its first line, over the time since that line.
"""

from __future__ import annotations

import logging
import sys
import time

PROGRESS_LOGGER = "distsgd.progress"
"""The logger a script run alone writes its progress lines to."""


def format_progress(
    *,
    step: int,
    fraction: float | None,
    loss: float | None,
    accuracy: float | None,
    samples_per_second: float | None,
    elapsed: float,
    eta: float | None,
) -> str:
    """The progress line from its figures (None: not known yet, left out)."""
    parts = [f"step {step}"]
    if fraction is not None:
        parts.append(f"{100 * fraction:.0f}%")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if accuracy is not None:
        parts.append(f"acc {accuracy:.4f}")
    if samples_per_second is not None:
        parts.append(f"{samples_per_second:.0f} samples/s")
    parts.append(f"{elapsed:.0f}s" + ("" if eta is None else f", about {eta:.0f}s left"))
    return "[distsgd] " + " | ".join(parts)


class Rate:
    """Samples per second of one worker from its metrics lines: what it reported after its
    first line, over the time since that line (None before a second line). A worker whose
    count goes back (restarted from an older state) starts over."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None

    def see(self, when: float, samples: int) -> None:
        if self.first is None or (self.last is not None and samples < self.last[1]):
            self.first = (when, samples)
        self.last = (when, samples)

    @property
    def per_second(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


class AloneProgress:
    """(A script run alone) a progress line on stderr every ``every`` seconds of training and
    at the last step, through the :data:`PROGRESS_LOGGER` logger; it gets a handler of its own
    unless the script configured logging."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.rate = Rate()
        self.started = time.monotonic()
        self.shown_at: float | None = None
        self.log = logging.getLogger(PROGRESS_LOGGER)
        if not logging.getLogger().handlers and not self.log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.log.addHandler(handler)
            self.log.setLevel(logging.INFO)
            self.log.propagate = False

    def update(
        self,
        *,
        step: int,
        fraction: float | None,
        loss: float | None,
        samples: int,
        accuracy: float | None = None,
        last: bool = False,
    ) -> None:
        now = time.monotonic()
        self.rate.see(now, samples)
        since = self.started if self.shown_at is None else self.shown_at
        if not last and now - since < self.every:
            return
        self.shown_at = now
        elapsed = now - self.started
        eta = None
        if fraction is not None and 0 < fraction < 1:
            eta = elapsed * (1 - fraction) / fraction
        self.log.info(
            format_progress(
                step=step,
                fraction=fraction,
                loss=loss,
                accuracy=accuracy,
                samples_per_second=self.rate.per_second,
                elapsed=elapsed,
                eta=eta,
            )
        )
