"""A :class:`~distsgd.control.run_view.RunView` in Prometheus's text exposition format 0.0.4:
what ``GET /metrics`` of the launcher's metrics endpoint answers
(``launcher/metrics_endpoint.py``).

Every sample carries ``run`` (the run folder's name); a task's carry ``task`` too. Names say
their unit (``_seconds``, ``_bytes``) and a counter ends in ``_total``. The one to alert on is
``distsgd_last_step_timestamp_seconds``, the wall time of each worker's last step line: a rule
``time() - distsgd_last_step_timestamp_seconds > 60`` fires for a worker stuck for a minute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from distsgd.control.run_view import RunView, TaskState
from distsgd.control.timing import PHASES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of the exposition format this module writes."""

Labels = Mapping[str, str]


@dataclass
class Family:
    """One metric family: its name, type, help and samples (labels, value)."""

    name: str
    kind: str
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)

    def lines(self) -> Iterable[str]:
        yield f"# HELP {self.name} {escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in self.samples:
            yield f"{self.name}{format_labels(labels)} {format_value(value)}"


def escape_help(text: str) -> str:
    """A HELP text: backslash and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label(value: str) -> str:
    """A label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{escape_label(str(value))}"' for key, value in labels.items())
    return "{" + inner + "}"


def format_value(value: float) -> str:
    """A sample's value as the format writes it: ``NaN``, ``+Inf``, ``-Inf``, or Python's
    shortest repr (integers without a fraction)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


TASK_GAUGES: tuple[tuple[str, str, Callable[[TaskState], float | None]], ...] = (
    (
        "distsgd_last_step_timestamp_seconds",
        "Wall time (Unix seconds) of the worker's last step line; "
        "time() - this > N finds a stuck worker.",
        lambda t: t.last_step_time,
    ),
    ("distsgd_task_up", "1 while the worker runs, 0 once it finished or left.", lambda t: t.alive),
    ("distsgd_step", "The global step at the worker's last line.", lambda t: t.step),
    ("distsgd_local_step", "The worker's own steps so far.", lambda t: t.local_step),
    (
        "distsgd_samples_per_second",
        "The worker's samples per second over its recent window (30 s).",
        lambda t: t.samples_per_second,
    ),
    ("distsgd_loss", "The training loss of the worker's last step line.", lambda t: t.loss),
    (
        "distsgd_mean_staleness",
        "Mean staleness (updates) of the worker's pushes, where reported.",
        lambda t: t.mean_staleness,
    ),
)
TASK_COUNTERS: tuple[tuple[str, str, Callable[[TaskState], float | None]], ...] = (
    ("distsgd_samples_total", "Samples the worker trained on.", lambda t: t.samples),
    ("distsgd_sent_bytes_total", "Bytes the worker sent.", lambda t: t.bytes_sent),
    ("distsgd_received_bytes_total", "Bytes the worker received.", lambda t: t.bytes_received),
    ("distsgd_task_faults_total", "Times the launcher saw the worker die.", lambda t: t.faults),
)
SERVER_GAUGES = (
    ("distsgd_ps_pushes_per_second", "Pushes per second the server applied.", "pushes_per_s", 1),
    ("distsgd_ps_pulls_per_second", "Pulls per second the server answered.", "pulls_per_s", 1),
    ("distsgd_ps_push_bytes_per_second", "Push bytes per second.", "push_mb_per_s", 1e6),
    ("distsgd_ps_pull_bytes_per_second", "Pull bytes per second.", "pull_mb_per_s", 1e6),
    (
        "distsgd_ps_busy_ratio",
        "Share of the interval the server's pushes kept it working (over 1: overlapping).",
        "busy",
        1,
    ),
)
"""(name, help, ``shard_load`` field, factor) of each parameter-server gauge."""


def render(view: RunView) -> str:
    """The exposition of ``view``: every family, HELP and TYPE first, one sample a line."""
    run = {"run": view.run}
    families = [*_run_families(view, run), *_task_families(view, run)]
    families += _server_families(view, run)
    if view.stragglers is not None:
        families.append(_straggler_family(view, run))
    return "".join(line + "\n" for family in families for line in family.lines())


def _run_families(view: RunView, run: Labels) -> list[Family]:
    counts = view.counts()
    tasks = Family("distsgd_tasks", "gauge", "Workers by state (running, finished, left).")
    tasks.samples = [({**run, "state": state}, n) for state, n in counts.items()]
    events = Family("distsgd_events_total", "counter", "Events in metrics.jsonl, by name.")
    events.samples = [({**run, "event": e}, n) for e, n in sorted(view.events.items())]
    last = Family(
        "distsgd_last_record_timestamp_seconds", "gauge", "Wall time of the newest metrics line."
    )
    if view.last_time is not None:
        last.samples.append((run, view.last_time))
    return [
        Family("distsgd_up", "gauge", "1: the run's launcher answers.", [(run, 1)]),
        Family(
            "distsgd_run_diverged",
            "gauge",
            "1 once the run diverged.",
            [(run, view.divergence is not None)],
        ),
        Family("distsgd_global_step", "gauge", "The run's global step.", [(run, view.global_step)]),
        tasks,
        events,
        last,
    ]


def _task_families(view: RunView, run: Labels) -> list[Family]:
    workers = view.workers()
    families = []
    for kind, table in (("gauge", TASK_GAUGES), ("counter", TASK_COUNTERS)):
        for name, text, read in table:
            family = Family(name, kind, text)
            for task in workers:
                value = read(task)
                if value is not None:
                    family.samples.append(({**run, "task": task.task}, float(value)))
            families.append(family)
    phases = Family(
        "distsgd_phase_seconds_total", "counter", "The worker's seconds in each phase so far."
    )
    recent = Family(
        "distsgd_phase_ratio", "gauge", "Each phase's share of the worker's recent window."
    )
    for task in workers:
        labels = {**run, "task": task.task}
        phases.samples += [
            ({**labels, "phase": p}, task.phases[p]) for p in PHASES if p in task.phases
        ]
        recent.samples += [({**labels, "phase": p}, r) for p, r in task.recent_split.items()]
    return [*families, phases, recent]


def _server_families(view: RunView, run: Labels) -> list[Family]:
    families = []
    servers = sorted(view.servers.values(), key=lambda s: s.ps)
    for name, text, key, factor in SERVER_GAUGES:
        family = Family(name, "gauge", text + " (the launcher's last reading, every 5 s)")
        for load in servers:
            if key in load.rates:
                family.samples.append(({**run, "ps": f"ps{load.ps}"}, load.rates[key] * factor))
        families.append(family)
    return families


def _straggler_family(view: RunView, run: Labels) -> Family:
    family = Family(
        "distsgd_straggler_score",
        "gauge",
        "How much slower than its peers a straggler detector finds a task, with the cause it "
        "names and whether it is chronic.",
    )
    for s in view.stragglers or ():
        labels = {**run, "task": s.task, "cause": s.cause, "chronic": str(s.chronic).lower()}
        family.samples.append((labels, s.score))
    return family
