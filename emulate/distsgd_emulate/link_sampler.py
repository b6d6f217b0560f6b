"""Bytes over time on emulated hosts (``--hosts``): while the run lasts, a thread reads every
host's link counters (:meth:`EmulatedHosts.counters`, one ``ip`` in the switch namespace per
sample) every :data:`SAMPLE_S` and appends them to the run folder's ``links.jsonl``; at the end
each host's busiest window (:func:`busiest_rates`) goes into ``hosts.json``.

A ``links.jsonl`` line: ``{"time": UNIX, "t": SECONDS_SINCE_START, "sent": {HOST: BYTES},
"received": {HOST: BYTES}}``, bytes since the hosts were made (frames with headers, as the
shaper counts them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_keeper import NetnsError

__all__ = ["LINKS_FILE", "SAMPLE_S", "WINDOW_S", "LinkSample", "LinkSampler", "busiest_rates"]

log = logging.getLogger(__name__)

LINKS_FILE = "links.jsonl"
"""The bytes over time of a run on emulated hosts, in its folder."""
SAMPLE_S = 0.5
"""Seconds between two samples."""
WINDOW_S = 1.0
"""The window of :func:`busiest_rates`, seconds."""


@dataclass(frozen=True, kw_only=True)
class LinkSample:
    """Every host's link counters at one moment."""

    t: float
    """Seconds since the first sample's clock reading (the sampler's start)."""
    sent: dict[str, int]
    """Bytes each host has sent over its link so far, by host name."""
    received: dict[str, int]
    """Bytes each host has received over its link so far, by host name."""


def busiest_rates(
    samples: Sequence[LinkSample], window_s: float = WINDOW_S
) -> dict[str, dict[str, float]]:
    """Each host's highest rate each way over any ``window_s`` of the samples, bits/s:
    ``{host: {"sent_bits": R, "received_bits": R}}``. A window runs from one sample to the
    first at least ``window_s`` later (over the whole span where it is shorter); no two
    samples: no hosts."""
    if len(samples) < 2:
        return {}
    pairs = []
    end = 0  # the first sample a window from ``first`` reaches: it only moves forward
    for i, first in enumerate(samples[:-1]):
        end = max(end, i + 1)
        while end < len(samples) and samples[end].t - first.t < window_s:
            end += 1
        if end < len(samples):
            pairs.append((first, samples[end]))
        elif not pairs:
            pairs.append((first, samples[-1]))
    out: dict[str, dict[str, float]] = {}
    for host in samples[0].sent:
        for way in ("sent", "received"):
            best = max(
                (getattr(b, way)[host] - getattr(a, way)[host]) * 8 / (b.t - a.t)
                for a, b in pairs
                if b.t > a.t
            )
            out.setdefault(host, {})[f"{way}_bits"] = round(best)
    return out


class LinkSampler:
    """The thread that samples the links of ``hosts`` (None: no hosts, nothing sampled) into
    ``run_dir``'s ``links.jsonl`` from :meth:`start` to :meth:`stop`."""

    def __init__(
        self,
        hosts: EmulatedHosts | None,
        run_dir: Path,
        *,
        every_s: float = SAMPLE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.hosts = hosts
        self.path = run_dir / LINKS_FILE
        """Where the samples go."""
        self.samples: list[LinkSample] = []
        """The samples taken so far."""
        self._every_s, self._clock = every_s, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start: float | None = None
        self._failed = False

    def start(self) -> None:
        """Take a first sample and start the thread (nothing without hosts)."""
        if self.hosts is None:
            return
        self._thread = threading.Thread(target=self._loop, name="link-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, dict[str, float]]:
        """End the thread, take a last sample; each host's :func:`busiest_rates`."""
        if self._thread is None:
            return {}
        self._stop.set()
        self._thread.join(timeout=10)
        with self.path.open("a") as out:
            self._sample(out)
        self._thread = None
        return busiest_rates(self.samples)

    def _loop(self) -> None:
        with self.path.open("a") as out:
            self._sample(out)
            while not self._stop.wait(self._every_s):
                self._sample(out)

    def _sample(self, out: IO[str]) -> None:
        hosts = self.hosts
        assert hosts is not None
        before = self._clock()
        try:
            counted = hosts.counters()
        except (NetnsError, ValueError) as e:
            if not self._failed:  # once: the run goes on without its series
                log.warning("could not sample the hosts' links: %s", e)
            self._failed = True
            return
        now = (before + self._clock()) / 2
        if self._start is None:
            self._start = now
        sample = LinkSample(
            t=round(now - self._start, 3),
            sent={name: link.sent for name, link in counted.items()},
            received={name: link.received for name, link in counted.items()},
        )
        self.samples.append(sample)
        line = {"time": round(now, 3), "t": sample.t, "sent": sample.sent}
        out.write(json.dumps({**line, "received": sample.received}) + "\n")
        out.flush()
