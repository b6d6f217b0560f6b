"""A live view of a run, folded from its ``metrics.jsonl``: what the metrics endpoint
(``launcher/metrics_endpoint.py``, Prometheus's text format: :mod:`distsgd.control.prometheus`)
and ``distsgd top``'s table (:mod:`distsgd.control.run_top`) show.

Every task appends to the same file (control/metrics.py). A *step line* is a worker's record
without an ``event`` that has ``samples`` (an evaluation's line has none): its ``time``
(wall), global ``step``, ``local_step``, ``loss``, cumulative ``samples``, cumulative
``<phase>_s`` seconds (control/timing.py) and, through parameter servers, ``mean_staleness``.
Events (``event`` set) are counted by name; some change a task's state: ``finished_steps``
(the worker is done), ``worker_left`` (its ``target`` was scaled down), ``fault`` (its
``target`` died), ``diverged`` (the run's loss went non-finite or up), ``shard_load`` (the
launcher's reading of server ``ps``'s load).

Nothing here runs by itself: a :class:`MetricsFollower` reads the bytes appended since its last
call when someone asks (a scrape, a redraw), and :meth:`RunView.fold` takes its records.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from distsgd.control.stragglers import StragglerDetector
from distsgd.control.timing import PHASES, as_number, split_from_metrics

WINDOW_SECONDS = 30.0
"""How far back a task's recent rate and phase split look (wall seconds before its last line)."""
WINDOW_LINES = 512
"""The most step lines a task's window keeps (a fast run's window spans fewer seconds)."""
READ_LIMIT = 64 << 20
"""The most bytes one :meth:`MetricsFollower.poll` reads (the rest waits for the next call)."""
LOAD_FIELDS = (
    "pushes_per_s",
    "pulls_per_s",
    "push_mb_per_s",
    "pull_mb_per_s",
    "busy",
    "pull_busy",
)
"""The rates of a ``shard_load`` event (launcher/shard_load.py's ``RATES``)."""


class MetricsFollower:
    """Reads the records appended to ``path`` since the last :meth:`poll` (the live view and
    the launcher's progress line follow ``metrics.jsonl`` so); a line not yet ended is kept for
    the next call; a line that does not parse as a JSON object is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(READ_LIMIT)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        records = []
        for raw in lines:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """One task a straggler detector found slow: its ``score`` (how many times slower than its
    peers, say), the ``cause`` it names (``compute``, ``pull``, a host) and whether it is
    ``chronic`` (slow for a long time) rather than a passing blip."""

    task: str
    score: float
    cause: str
    chronic: bool = False


class _Mark(NamedTuple):
    """One step line in a task's window."""

    time: float
    samples: int
    phases: Mapping[str, float]


@dataclass(kw_only=True)
class TaskState:
    """What one task's lines say so far."""

    task: str
    step: int = 0
    """The global step of its last line."""
    local_step: int = 0
    last_step_time: float | None = None
    """Wall time of its last step line (None: none yet)."""
    samples: int = 0
    loss: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Cumulative seconds per phase, as its last line says."""
    mean_staleness: float | None = None
    """The mean staleness of its pushes, where it reports one (parameter servers)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    state: str = "running"
    """running, finished (its steps ended), or left (scaled down)."""
    faults: int = 0
    """How often the launcher saw it die."""
    window: deque[_Mark] = field(default_factory=lambda: deque(maxlen=WINDOW_LINES))

    @property
    def alive(self) -> bool:
        return self.state == "running"

    def see_step(self, record: Mapping[str, Any], when: float) -> None:
        samples = int(as_number(record.get("samples")) or 0)
        phases = split_from_metrics(record)
        if self.window and (
            samples < self.window[-1].samples
            or any(s < self.window[-1].phases.get(p, 0.0) for p, s in phases.items())
        ):
            self.window.clear()  # restarted from an older state: its counts went back
        self.window.append(_Mark(when, samples, phases))
        while len(self.window) > 2 and self.window[1].time <= when - WINDOW_SECONDS:
            self.window.popleft()
        self.last_step_time, self.samples, self.state = when, samples, "running"
        self.local_step = int(as_number(record.get("local_step")) or 0)
        self.phases = phases
        loss, staleness = as_number(record.get("loss")), as_number(record.get("mean_staleness"))
        self.loss = self.loss if loss is None else loss
        self.mean_staleness = self.mean_staleness if staleness is None else staleness
        self.bytes_sent = int(as_number(record.get("bytes_sent")) or self.bytes_sent)
        self.bytes_received = int(as_number(record.get("bytes_received")) or self.bytes_received)

    @property
    def samples_per_second(self) -> float | None:
        """Samples per second over the window (None before two lines a moment apart)."""
        if len(self.window) < 2 or self.window[-1].time <= self.window[0].time:
            return None
        first, last = self.window[0], self.window[-1]
        return (last.samples - first.samples) / (last.time - first.time)

    @property
    def recent_split(self) -> dict[str, float]:
        """Each phase's share of the time the window's lines account for ({}: none yet)."""
        if len(self.window) < 2:
            return {}
        first, last = self.window[0], self.window[-1]
        spent = {p: max(0.0, s - first.phases.get(p, 0.0)) for p, s in last.phases.items()}
        total = sum(spent.values())
        if total <= 0:
            return {}
        return {p: spent[p] / total for p in PHASES if p in spent}


@dataclass(kw_only=True)
class ServerLoad:
    """A parameter server's load, from the launcher's last ``shard_load`` event for it."""

    ps: int
    time: float
    rates: dict[str, float]


@dataclass(kw_only=True)
class RunView:
    """The run as its metrics say so far; :meth:`fold` takes more records."""

    run: str = ""
    """The run's name in labels (its folder's name)."""
    tasks: dict[str, TaskState] = field(default_factory=dict)
    servers: dict[int, ServerLoad] = field(default_factory=dict)
    events: Counter[str] = field(default_factory=Counter)
    global_step: int = 0
    last_time: float | None = None
    """Wall time of the newest record."""
    divergence: str | None = None
    """The first ``diverged`` event's reason (None: none)."""
    stragglers: list[Straggler] | None = None
    """The slot a straggler detector fills (None: no detector has looked; []: it found none).
    :class:`LiveView` fills it (:mod:`distsgd.control.stragglers`); the renderers show it where
    it is not None."""

    def fold(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self._fold_one(record)

    def task(self, name: str) -> TaskState:
        if name not in self.tasks:
            self.tasks[name] = TaskState(task=name)
        return self.tasks[name]

    def _fold_one(self, record: Mapping[str, Any]) -> None:
        when = as_number(record.get("time"))
        if when is not None:
            self.last_time = when if self.last_time is None else max(self.last_time, when)
        step = as_number(record.get("step"))
        if step is not None:
            self.global_step = max(self.global_step, int(step))
        name = str(record.get("task", ""))
        event = record.get("event")
        if event is None:
            if "samples" in record and when is not None and name.startswith("worker"):
                state = self.task(name)
                state.step = int(step or 0)
                state.see_step(record, when)
            return
        self.events[str(event)] += 1
        self._see_event(str(event), name, record, when)

    def _see_event(
        self, event: str, name: str, record: Mapping[str, Any], when: float | None
    ) -> None:
        target = str(record.get("target", ""))
        if event == "finished_steps" and name.startswith("worker"):
            state = self.task(name)
            state.state = "finished"
            state.phases = split_from_metrics(record) or state.phases
        elif event == "worker_left" and target in self.tasks:
            self.tasks[target].state = "left"
        elif event == "fault" and target.startswith("worker"):
            self.task(target).faults += 1
        elif event == "diverged" and self.divergence is None:
            self.divergence = str(record.get("reason", "training diverged"))
        elif event == "shard_load" and isinstance(record.get("ps"), int) and when is not None:
            rates = {k: as_number(record.get(k)) for k in LOAD_FIELDS}
            known = {k: v for k, v in rates.items() if v is not None}
            self.servers[int(record["ps"])] = ServerLoad(
                ps=int(record["ps"]), time=when, rates=known
            )

    def workers(self) -> list[TaskState]:
        """The tasks in name order, worker10 after worker9."""
        return sorted(self.tasks.values(), key=lambda t: (len(t.task), t.task))

    def counts(self) -> dict[str, int]:
        """How many tasks are running, finished, left."""
        found = Counter(t.state for t in self.tasks.values())
        return {state: found.get(state, 0) for state in ("running", "finished", "left")}


class LiveView:
    """A :class:`RunView` of one ``metrics.jsonl`` brought up to date on each
    :meth:`refresh` (a scrape, a redraw), never in between.

    Its :attr:`RunView.stragglers` are those of its own
    :class:`~distsgd.control.stragglers.StragglerDetector`, fed the same records: the rule the
    launcher's progress line and ``straggler`` events follow, so a run started by hand (no
    launcher) has them too; its windows end at the refreshes, not at the launcher's polls, so
    the two may name a straggler a window apart."""

    def __init__(self, path: Path, run: str = "") -> None:
        self.follower = MetricsFollower(path)
        self.view = RunView(run=run)
        self.detector = StragglerDetector()

    def refresh(self) -> RunView:
        records = self.follower.poll()
        self.view.fold(records)
        self.detector.see_all(records)
        self.detector.update()
        self.view.stragglers = [
            Straggler(task=f.task, score=round(f.score, 2), cause=f.cause, chronic=f.chronic)
            for f in self.detector.named
        ]
        return self.view
