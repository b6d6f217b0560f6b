"""``distsgd top``'s view of a live run: :func:`render_top`, a table of the run's workers (rate,
phase split, staleness, age of the last step), its servers' load and, where a detector filled
them, its stragglers, from a :class:`~distsgd.control.run_view.RunView`; and :func:`watch`,
which redraws it from a run folder's ``metrics.jsonl`` every ``interval`` seconds.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import TextIO

from distsgd.control.folder import METRICS_FILE
from distsgd.control.run_view import LiveView, RunView, TaskState

SHORT = {
    "compute": "cmp",
    "pull": "pull",
    "push": "push",
    "wait": "wait",
    "allreduce": "ar",
    "checkpoint": "ckpt",
    "eval": "eval",
}
"""Each phase's name in the split column."""
CLEAR = "\x1b[H\x1b[2J"
"""Cursor home, clear the screen: how :func:`watch` redraws on a terminal."""
WORKER_HEADER = (
    f"{'task':<10} {'state':<8} {'step':>8} {'local':>7} {'samples/s':>10} {'loss':>9} "
    f"{'stale':>6} {'age':>6}  split (recent)"
)
SERVER_HEADER = (
    f"{'server':<10} {'push/s':>8} {'pull/s':>8} {'in MB/s':>8} {'out MB/s':>8} {'busy':>6}"
)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _split(task: TaskState) -> str:
    shares = task.recent_split
    return " ".join(f"{SHORT[p]} {100 * r:.0f}%" for p, r in shares.items() if r >= 0.005)


def _age(task: TaskState, now: float) -> str:
    if task.last_step_time is None:
        return "-"
    return f"{max(0.0, now - task.last_step_time):.0f}s"


def _worker_line(task: TaskState, now: float) -> str:
    return (
        f"{task.task:<10} {task.state:<8} {task.step:>8} {task.local_step:>7} "
        f"{_number(task.samples_per_second, '.0f'):>10} {_number(task.loss, '.4f'):>9} "
        f"{_number(task.mean_staleness, '.2f'):>6} {_age(task, now):>6}  {_split(task)}"
    )


def render_top(view: RunView, width: int = 100, now: float | None = None) -> str:
    """The table: a head line (run, global step, workers by state, events), one line per
    worker, one per server with a load reading, and the stragglers where a detector filled
    them; each line cut at ``width`` characters. ``now``: the wall time the ages count to."""
    now = time.time() if now is None else now
    counts = ", ".join(f"{n} {state}" for state, n in view.counts().items() if n)
    rate = sum(t.samples_per_second or 0.0 for t in view.tasks.values() if t.alive)
    lines = [
        f"distsgd top  run {view.run or '?'}  step {view.global_step}  "
        f"workers: {counts or 'none yet'}  {rate:.0f} samples/s",
    ]
    if view.divergence is not None:
        lines.append(f"diverged: {view.divergence}")
    lines += ["", WORKER_HEADER, *(_worker_line(t, now) for t in view.workers())]
    if view.servers:
        lines += ["", SERVER_HEADER]
        for load in sorted(view.servers.values(), key=lambda s: s.ps):
            r = load.rates
            lines.append(
                f"{'ps' + str(load.ps):<10} {_number(r.get('pushes_per_s'), '.1f'):>8} "
                f"{_number(r.get('pulls_per_s'), '.1f'):>8} "
                f"{_number(r.get('push_mb_per_s'), '.2f'):>8} "
                f"{_number(r.get('pull_mb_per_s'), '.2f'):>8} {_number(r.get('busy'), '.2f'):>6}"
            )
    if view.stragglers:
        lines += ["", "stragglers:"]
        for s in view.stragglers:
            kind = "chronic" if s.chronic else "passing"
            lines.append(f"  {s.task:<10} score {s.score:.2f}  cause {s.cause}  ({kind})")
    if view.events:
        lines += ["", "events: " + ", ".join(f"{e} {n}" for e, n in sorted(view.events.items()))]
    return "\n".join(line[:width] for line in lines) + "\n"


def watch(
    run_dir: Path,
    out: TextIO,
    interval: float = 1.0,
    stop_event: threading.Event | None = None,
) -> None:
    """Redraw :func:`render_top` of ``run_dir``'s metrics every ``interval`` seconds until
    ``stop_event`` is set (never, without one): on a terminal in place (the screen cleared,
    as wide as the terminal), elsewhere one table after another, 100 wide."""
    stop = stop_event or threading.Event()
    live = LiveView(Path(run_dir) / METRICS_FILE, run=Path(run_dir).resolve().name)
    tty = out.isatty()
    while True:
        view = live.refresh()
        width = shutil.get_terminal_size().columns if tty else 100
        text = render_top(view, width)
        out.write(CLEAR + text if tty else text + "\n")
        out.flush()
        if stop.wait(interval):
            return
