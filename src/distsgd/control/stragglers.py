"""Stragglers named, with their cause: which worker or server holds a run back, and why.

Pure and torch-free: :class:`StragglerDetector` takes ``metrics.jsonl`` records (what the
launcher's progress line and the live view read anyway) and, once per window, says which tasks
are stragglers. Nothing polls; nothing runs between two calls.

**What it reads.** A worker's step lines carry its cumulative ``<phase>_s`` seconds
(:mod:`distsgd.control.timing`: compute, data, pull, push, wait, allreduce, ...) and, through
parameter servers, ``server_s``: per server, the cumulative seconds of its pulls and of its
pushes to it. The launcher's ``shard_load`` events carry each server's ``busy`` share.

**Per window** (every :data:`WINDOW_SECONDS` of record time), for each worker, between its
newest line and its newest line at least a window older (its first line, start-up, is
skipped): ``d`` steps taken, and per step the seconds of each phase ``p[ph]`` and of the calls
to each server ``c[s]``. Its *own* time per step is what it did itself::

    own = sum(p) - p[wait] - p[allreduce]

(waiting for others: a synchronous step's fast workers wait for the slow one, so the slow one
has the least wait and the most of the phase that makes it slow). Then::

    score      = own / median(own of the other workers)
    vs_fastest = own / min(own of the other workers)
    vs_best    = step time / this worker's best window's step time

A window is *slow* for a worker when ``score >= NAME_SCORE`` (1.5) and
``own - median >= MIN_EXCESS_S`` (10 ms a step). A worker is named when two consecutive windows
are slow (``chronic``) or one window has ``score >= STALL_SCORE`` (3: a one-off stall, not
chronic, until a second slow window makes it chronic); it is cleared by a window with
``score < CLEAR_SCORE`` (1.25: hysteresis) or when it stops reporting for three windows, finishes
or dies. A worker that finished keeps its last window among the others' (the slow worker left
alone still holds the run's end back).

**Cause** of a worker: the phase (of compute, data, pull, push, checkpoint, eval) whose
seconds per step exceed the other workers' median the most: ``compute`` and ``data`` as they
are; ``pull`` or ``push`` is its ``link`` (its exchanges are slow, and the servers are not:
the same server slow for every worker is that server's, below, and names no worker).

**Servers**: per server ``s`` and method (pull, push), ``m[s]`` = the workers' median of
``c[s]``; its score is ``m[s] / median(m of the other servers, same method)``, slow and named
as a worker's (with the same thresholds, two windows). A server slow on its pulls is judged by
its pulls; one slow on its pushes only, by its pushes, unless another server is slow on its
pulls or a worker slow on its exchanges (score over 1.25, cause link): a server's pushes wait
for its write-ahead log's replica on another host, and a slow host slows the pushes of the
server whose replica it holds too. Pulls through shared memory never
reach the server (a worker on its host reads them from the segment), so a slow server on the
workers' own host shows in its pushes only. The cause is ``server`` when its busy share of
those calls (its last ``shard_load``: ``pull_busy``, the time its pulls kept it working before
their bytes went out; ``busy``, its pushes') is at least twice the others' median and 0.1
above it (it works slowly: an overloaded or throttled process), else ``link`` (it waits on its
network).

No straggler is named with fewer than two workers reporting (nothing to compare with), and a
collective scheme's slow link cannot be told from its peers' (the all-reduce's time is each
worker's wait for the slowest): its straggler is named by compute or data only.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distsgd.control.timing import as_number, split_from_metrics

WINDOW_SECONDS = 6.0
"""Seconds of record time between two decisions (a window)."""
NAME_SCORE = 1.5
"""A window is slow for a task at this many times its peers' median time per step."""
STALL_SCORE = 3.0
"""One window this slow names a task at once (a one-off stall)."""
CLEAR_SCORE = 1.25
"""A named task is cleared by a window below this score."""
MIN_EXCESS_S = 0.01
"""And only when it is this many seconds a step slower than the median (no noise of a fast
step named)."""
SERVER_BUSY_RATIO = 2.0
"""A slow server whose pull_busy share is this many times the others' is slow itself
(``server``)."""
SERVER_BUSY_MARGIN = 0.1
"""... and this much above it."""
CAUSE_PHASES = ("compute", "data", "pull", "push", "checkpoint", "eval")
"""The phases a worker's cause is chosen from (wait and allreduce are time waiting on others)."""
MAX_SCORE = 99.0
"""Scores are capped here (a peer that spent no time at all)."""
_WAITING = ("wait", "allreduce")
_MARKS = 64


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One straggler named: a worker (``worker2``) or a server (``ps1``)."""

    task: str
    """The task named."""
    score: float
    """Its time per step over its peers' median (see the module's docstring)."""
    vs_fastest: float
    """Its time per step over its fastest peer's."""
    vs_best: float
    """Its step time over its own best window's (1: as fast as it ever was)."""
    cause: str
    """compute, data, link or server."""
    chronic: bool
    """Slow in two windows in a row or more (False: a one-off stall so far)."""

    def fields(self) -> dict[str, Any]:
        """The ``straggler`` event's fields (besides ``state``)."""
        return {
            "target": self.task,
            "score": round(self.score, 2),
            "vs_fastest": round(self.vs_fastest, 2),
            "vs_best": round(self.vs_best, 2),
            "cause": self.cause,
            "chronic": self.chronic,
        }

    def label(self) -> str:
        """``worker2 (data, 1.8x)``: for the progress line."""
        return f"{self.task} ({self.cause}, {self.score:.1f}x)"


@dataclass(frozen=True, kw_only=True)
class Change:
    """What a window changed: ``finding`` was ``named`` (or became ``chronic``) or
    ``cleared``."""

    state: str
    """named, chronic or cleared."""
    finding: Finding
    """The straggler (when cleared: as it was last named)."""


@dataclass(frozen=True, kw_only=True)
class _Mark:
    time: float
    step: int
    phases: Mapping[str, float]
    servers: Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class _Rate:
    """One worker's window: seconds per step, in all and per phase and per server."""

    step_s: float
    phases: Mapping[str, float]
    servers: Mapping[str, float]

    @property
    def own(self) -> float:
        return sum(s for p, s in self.phases.items() if p not in _WAITING)


@dataclass(kw_only=True)
class _Track:
    """What the detector keeps of one task between windows."""

    marks: deque[_Mark] = field(default_factory=lambda: deque(maxlen=_MARKS))
    lines: int = 0
    streak: int = 0
    best_step_s: float | None = None
    rate: _Rate | None = None
    """Its last window (None: none yet)."""
    named: Finding | None = None


class StragglerDetector:
    """Follows metrics records (:meth:`see`); :meth:`update` decides once per window."""

    def __init__(self, *, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._workers: dict[str, _Track] = {}
        self._servers: dict[str, _Track] = {}
        self._busy: dict[tuple[str, str], float] = {}
        """Per (server, pull or push), its last busy share of those calls."""
        self._finished: dict[str, _Rate] = {}
        """The last window of each worker that stopped reporting."""
        self._pending: list[Change] = []
        self._slow_links = False
        """Whether a worker's exchanges were slow (cause link, over 1.25) this window."""
        self._now: float | None = None
        self._decided: float | None = None

    @property
    def named(self) -> list[Finding]:
        """The stragglers named now, workers then servers."""
        tracks = [*self._workers.values(), *self._servers.values()]
        return [t.named for t in tracks if t.named is not None]

    def see(self, record: Mapping[str, Any]) -> None:
        """Take one metrics record (any: the ones it does not use are skipped)."""
        when = as_number(record.get("time"))
        if when is None:
            return
        self._now = when if self._now is None else max(self._now, when)
        task, event = str(record.get("task", "")), record.get("event")
        if event is None and task.startswith("worker") and "samples" in record:
            self._see_step(task, record, when)
        elif event in ("finished_steps", "worker_left", "fault"):
            self._gone(task if event == "finished_steps" else str(record.get("target", "")))
        elif event == "shard_load" and isinstance(record.get("ps"), int):
            for method, key in (("pull", "pull_busy"), ("push", "busy")):
                if (busy := as_number(record.get(key))) is not None:
                    self._busy[(f"ps{record['ps']}", method)] = busy

    def _gone(self, task: str) -> None:
        """``task`` stopped reporting (finished, left, died): its last window stays a peer's
        (a worker that finished early still shows how fast a step can be), and it is cleared."""
        track = self._workers.pop(task, None)
        if track is None:
            return
        rate = self._window(track) or track.rate
        if rate is not None:
            self._finished[task] = rate
        if track.named is not None:
            self._pending.append(Change(state="cleared", finding=track.named))

    def see_all(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.see(record)

    def _see_step(self, task: str, record: Mapping[str, Any], when: float) -> None:
        track = self._workers.setdefault(task, _Track())
        step = int(as_number(record.get("local_step")) or 0)
        mark = _Mark(
            time=when, step=step, phases=split_from_metrics(record), servers=_calls(record)
        )
        self._finished.pop(task, None)  # back (restarted): judged again
        if track.marks and step < track.marks[-1].step:
            track.marks.clear()  # restarted from an older state
            track.lines = 0
        track.lines += 1
        if track.lines > 1:  # the first line's counts hold the start-up
            track.marks.append(mark)

    def update(self, now: float | None = None) -> list[Change]:
        """Decide, if a window passed since the last decision (``now``: record time, default
        the newest record's); the changes it made (named, chronic, cleared)."""
        now = self._now if now is None else now
        changes, self._pending = self._pending, []  # cleared as they finished: said at once
        if now is None or (self._decided is not None and now < self._decided + self.window):
            return changes
        self._decided = now
        rates = self._rates(now)
        changes += self._judge_workers(rates)
        changes += self._judge_servers(rates)
        return changes

    def _rates(self, now: float) -> dict[str, _Rate]:
        """Each reporting worker's window (those silent for three windows left out)."""
        rates = {}
        for task, track in self._workers.items():
            if track.marks and track.marks[-1].time >= now - 3 * self.window:
                rate = self._window(track)
                if rate is not None:
                    rates[task] = track.rate = rate
        return rates

    def _window(self, track: _Track) -> _Rate | None:
        """The track's newest window: from its newest line back a window (or its oldest)."""
        if len(track.marks) < 2:
            return None
        end = track.marks[-1]
        start = next(
            (m for m in reversed(track.marks) if m.time <= end.time - self.window),
            track.marks[0],
        )
        steps = end.step - start.step
        if steps < 1 or end.time <= start.time:
            return None
        return _Rate(
            step_s=(end.time - start.time) / steps,
            phases=_per_step(start.phases, end.phases, steps),
            servers=_per_step(start.servers, end.servers, steps),
        )

    def _judge_workers(self, rates: Mapping[str, _Rate]) -> list[Change]:
        changes: list[Change] = []
        self._slow_links = False
        for task, track in self._workers.items():
            rate = rates.get(task)
            if rate is not None:
                track.best_step_s = min(track.best_step_s or rate.step_s, rate.step_s)
            others = [r for t, r in rates.items() if t != task] + list(self._finished.values())
            finding = None
            if rate is not None and others:
                finding = _worker_finding(task, rate, others, track.best_step_s or rate.step_s)
                self._slow_links |= finding.cause == "link" and finding.score >= CLEAR_SCORE
            changes += _judge(track, finding, quiet=rate is None or not others)
        return changes

    def _judge_servers(self, rates: Mapping[str, _Rate]) -> list[Change]:
        calls: dict[str, float] = {}  # "ps0/pull": the workers' median seconds per step
        for key in sorted({k for r in rates.values() for k in r.servers}):
            calls[key] = statistics.median(
                r.servers[key] for r in rates.values() if key in r.servers
            )
        found = {
            server: {m: self._server_method(server, m, calls) for m in ("pull", "push")}
            for server in sorted({key.split("/")[0] for key in calls})
        }
        slow_pulls = {s for s, by in found.items() if _slow(by["pull"])}
        changes = []
        for server, by in found.items():
            track = self._servers.setdefault(server, _Track())
            pull, push = by["pull"], by["push"]
            finding = pull if server in slow_pulls or not _slow(push) else push
            if finding is push and (slow_pulls - {server} or self._slow_links):
                finding = pull  # its pushes wait for a log replica on the slow host
            if len(rates) < 2:
                finding = None
            changes += _judge(track, finding, quiet=finding is None)
        return changes

    def _server_method(
        self, server: str, method: str, calls: Mapping[str, float]
    ) -> Finding | None:
        """The server's calls of ``method`` against the other servers' (None: no other
        server, or no such calls)."""
        mine = calls.get(f"{server}/{method}")
        rest = [
            v for k, v in calls.items() if k.endswith(f"/{method}") and k.split("/")[0] != server
        ]
        if mine is None or not rest:
            return None
        median = statistics.median(rest)
        finding = Finding(
            task=server,
            score=_ratio(mine, median),
            vs_fastest=_ratio(mine, min(rest)),
            vs_best=1.0,
            cause=self._server_cause(server, method),
            chronic=False,
        )
        return finding if mine - median >= MIN_EXCESS_S else _calm(finding)

    def _server_cause(self, server: str, method: str) -> str:
        """``server`` where the server's own work on these calls is slow (its busy share of
        them, from its last ``shard_load``, twice the others'), else ``link``."""
        busy = self._busy.get((server, method))
        rest = [b for (s, m), b in self._busy.items() if s != server and m == method]
        if busy is None or not rest:
            return "link"
        median = statistics.median(rest)
        slow = busy >= SERVER_BUSY_RATIO * median and busy - median >= SERVER_BUSY_MARGIN
        return "server" if slow else "link"


def _slow(finding: Finding | None) -> bool:
    return finding is not None and finding.score >= NAME_SCORE


def _calls(record: Mapping[str, Any]) -> dict[str, float]:
    """A step line's ``server_s`` flattened: ``{"ps0/pull": 1.2, "ps0/push": 3.4, ...}``."""
    servers = record.get("server_s")
    out = {}
    for server, methods in servers.items() if isinstance(servers, Mapping) else ():
        for method, value in methods.items() if isinstance(methods, Mapping) else ():
            if (seconds := as_number(value)) is not None:
                out[f"{server}/{method}"] = seconds
    return out


def _worker_finding(task: str, rate: _Rate, others: list[_Rate], best: float) -> Finding:
    """The worker's window judged against the others' (its score, its cause)."""
    own = [r.own for r in others]
    median = statistics.median(own)
    excess = {
        phase: rate.phases.get(phase, 0.0)
        - statistics.median(r.phases.get(phase, 0.0) for r in others)
        for phase in CAUSE_PHASES
    }
    phase = max(excess, key=lambda p: excess[p])
    finding = Finding(
        task=task,
        score=_ratio(rate.own, median),
        vs_fastest=_ratio(rate.own, min(own)),
        vs_best=_ratio(rate.step_s, best),
        cause="link" if phase in ("pull", "push") else phase,
        chronic=False,
    )
    return finding if rate.own - median >= MIN_EXCESS_S else _calm(finding)


def _calm(finding: Finding) -> Finding:
    """The finding with a score that names nothing (the excess is too small to matter)."""
    return Finding(**{**finding.__dict__, "score": min(finding.score, 1.0)})


def _judge(track: _Track, finding: Finding | None, *, quiet: bool) -> list[Change]:
    """One window's verdict on a task: the streak of slow windows, and what changed."""
    if quiet or finding is None:
        track.streak = 0
        if track.named is not None and quiet:
            cleared, track.named = track.named, None
            return [Change(state="cleared", finding=cleared)]
        return []
    slow = finding.score >= NAME_SCORE
    track.streak = track.streak + 1 if slow else 0
    chronic = track.streak >= 2
    named = Finding(**{**finding.__dict__, "chronic": chronic})
    if track.named is None:
        if chronic or finding.score >= STALL_SCORE:
            track.named = named
            return [Change(state="named", finding=named)]
        return []
    if finding.score < CLEAR_SCORE:
        cleared, track.named = track.named, None
        return [Change(state="cleared", finding=cleared)]
    was_chronic, track.named = track.named.chronic, (named if slow else track.named)
    if chronic and not was_chronic:
        return [Change(state="chronic", finding=named)]
    return []


def _per_step(
    before: Mapping[str, float], after: Mapping[str, float], steps: int
) -> dict[str, float]:
    """Seconds per step of each key between two cumulative readings (a reading that went back,
    a restarted counter, counts from 0)."""
    out = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        out[key] = (value if delta < 0 else delta) / steps
    return out


def _ratio(value: float, base: float) -> float:
    """``value / base``, at most :data:`MAX_SCORE` (a base of 0 included)."""
    if base <= 1e-9:
        return 1.0 if value <= 1e-9 else MAX_SCORE
    return min(MAX_SCORE, value / base)


def progress_note(findings: Iterable[Finding]) -> str:
    """``straggler worker2 (data, 1.8x)``: the progress line's part ("" with none)."""
    shown = [f.label() for f in findings]
    if not shown:
        return ""
    return f"straggler{'s' if len(shown) > 1 else ''} {', '.join(shown)}"
