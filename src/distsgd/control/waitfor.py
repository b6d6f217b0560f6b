"""Who waits on whom in a run, and who holds it up: the pure half of ``distsgd doctor``.

The doctor (:mod:`distsgd.launcher.doctor`) asks every task of a run for its report
(:mod:`distsgd.util.probe`) and hands them here, with what ``/proc`` says of the tasks that did
not answer. :func:`diagnose` builds the wait-for graph and names the culprit:

- **Edges.** A worker waits on parameter server ``psN`` for each call to it in flight longer
  than :data:`SLOW_CALL_S` (a Pull for a version, a Push, ... with its attempts and last
  error); a server waits on worker ``k`` while a synchronous step is open and ``k`` has not
  pushed for it; a worker of a collective scheme that has not stepped for the stall time waits
  on every other worker (an all-reduce needs them all).
- **Culprit**, in this order, among the tasks the stuck workers reach through the graph (every
  task where none is reached):
  1. a task that does not answer: stopped (``SIGSTOP``: ``/proc`` state ``T``), gone, or
     holding the interpreter (state ``R``/``D``/``S`` without an answer);
  2. a worker whose calls to a server do not arrive while other workers' do: they fail
     (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``), or a Pull or Push is in flight that the
     server, which answers the doctor, does not list among the calls it serves (the call
     never reached it): its host is cut off (a partition, a dead link); where no worker's
     call reaches one server, that server;
  3. a stuck worker that waits on no one: it is blocked in its own code (a lock, a data
     loader, a sleep), at the frame named;
  4. else the task the most waits lead to.
- **Frame**: the innermost frame of the culprit's main thread outside the standard library
  and distsgd (the user's line), else its innermost frame; for a task that did not answer,
  the stack a sampler read from outside where one was available (py-spy), else none.

Nothing here does I/O: the reports in, a :class:`Diagnosis` out.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SLOW_CALL_S = 1.0
"""A call in flight longer than this is a wait (seconds)."""
STALL_S = 5.0
"""A worker that has not stepped for this long is stuck (seconds; :func:`diagnose` takes
another)."""
NETWORK_ERRORS = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
DOWN = ("stopped", "gone", "zombie")
"""What ``/proc`` says of a task that cannot be running: no stall time is waited for."""
TRACKED = ("Pull", "Push")
"""The calls a server lists while it answers them (``serving``, ``waiting_pulls``)."""
"""The status codes of a call that did not reach its server."""
_OTHERS = (
    "<",  # frozen modules, <string>
    sysconfig.get_paths()["stdlib"],
    sysconfig.get_paths()["purelib"],  # torch, grpc, ...
    sysconfig.get_paths()["platlib"],
)
"""Where frames are neither the user's nor distsgd's."""
_DISTSGD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True, kw_only=True)
class TaskSeen:
    """One task as the doctor found it: its report, or why there is none."""

    task: str
    pid: int
    report: Mapping[str, Any] | None = None
    """Its probe's answer (None: it did not answer)."""
    process: str = ""
    """What ``/proc`` says of it when it did not answer: ``stopped``, ``gone``, ``running``,
    ``sleeping``, ``disk``, ``zombie``."""
    sampled: Sequence[Mapping[str, Any]] = ()
    """Its stack as a sampler read it from outside (frames, innermost last), where it did
    not answer and one was available."""
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class Wait:
    """``task`` waits on ``on``: ``what`` it waits for, for ``seconds``."""

    task: str
    on: str
    what: str
    seconds: float
    failing: str = ""
    """The last error of a call that keeps failing ('' when none failed)."""
    method: str = ""
    """The RPC of a worker's wait on a server ('' for other waits)."""


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """What :func:`diagnose` found."""

    stuck: tuple[str, ...]
    """The workers that have not stepped for the stall time or do not answer, and any task
    stopped or gone (it holds the run up from the moment it stops, not the stall time after)."""
    culprit: str | None
    cause: str
    """Why the culprit holds the run up, in a few words."""
    frame: str
    """The culprit's blocking frame (``file:line in function: code``), or why there is none."""
    waits: tuple[Wait, ...] = ()
    blocked: dict[str, str] = field(default_factory=dict)
    """Each task that waits: its own blocking frame."""

    def lines(self) -> list[str]:
        """The few lines the doctor prints."""
        if self.culprit is None:
            return [f"no culprit: {self.cause}"]
        out = [f"culprit: {self.culprit}: {self.cause}", f"  frame: {self.frame}"]
        on_it = [w for w in self.waits if w.on == self.culprit]
        for wait in on_it[:4]:
            out.append(f"  {wait.task} waits on it: {wait.what} ({wait.seconds:.1f} s)")
        if len(on_it) > 4:
            out.append(f"  ... and {len(on_it) - 4} more waits on it")
        return out


def diagnose(seen: Sequence[TaskSeen], *, stall_s: float = STALL_S) -> Diagnosis:
    """The wait-for graph of the tasks ``seen`` and its culprit (see the module docstring)."""
    by_name = {t.task: t for t in seen}
    waits = _waits(seen, stall_s)
    down = {t.task for t in seen if t.report is None and t.process in DOWN}
    stuck = tuple(sorted({t.task for t in seen if _stuck(t, stall_s)} | down))
    blocked = {w.task: _frame(by_name[w.task], own=False) for w in waits if w.task in by_name}
    if not stuck:
        return Diagnosis(stuck=(), culprit=None, cause="every worker is stepping", frame="")
    reached = _reached(stuck, waits)
    stuck_waits = [w for w in waits if w.task in stuck or not w.task.startswith("worker")]
    for pick in (_silent, _network, _own_code):
        found = pick([by_name[n] for n in sorted(reached) if n in by_name], stuck_waits, stall_s)
        if found is not None:
            culprit, cause = found
            frame = _frame(by_name[culprit])
            return Diagnosis(
                stuck=stuck, culprit=culprit, cause=cause, frame=frame, waits=waits, blocked=blocked
            )
    counts: dict[str, int] = {}
    for wait in waits:
        counts[wait.on] = counts.get(wait.on, 0) + 1
    culprit = max(counts, key=lambda n: (counts[n], n)) if counts else stuck[0]
    cause = f"{counts.get(culprit, 0)} wait(s) lead to it"
    return Diagnosis(
        stuck=stuck,
        culprit=culprit,
        cause=cause,
        frame=_frame(by_name[culprit]) if culprit in by_name else "unknown",
        waits=waits,
        blocked=blocked,
    )


def _state(task: TaskSeen, role: str) -> Mapping[str, Any]:
    state = (task.report or {}).get("state", {}).get(role)
    return state if isinstance(state, Mapping) else {}


def _stuck(task: TaskSeen, stall_s: float) -> bool:
    if not task.task.startswith("worker"):
        return False
    if task.report is None:
        return True
    worker = _state(task, "worker")
    return float(worker.get("since_step_s") or 0.0) >= stall_s


def _servers(seen: Sequence[TaskSeen]) -> dict[str, str]:
    """Each parameter server's address as workers name it, and its task name."""
    names: dict[str, str] = {}
    for task in seen:
        for index, address in enumerate(_state(task, "worker").get("servers", [])):
            names.setdefault(str(address), f"ps{index}")
        address = _state(task, "server").get("address")
        if address:
            names[str(address)] = task.task
    return names


def _waits(seen: Sequence[TaskSeen], stall_s: float) -> tuple[Wait, ...]:
    servers = _servers(seen)
    workers = [t.task for t in seen if t.task.startswith("worker")]
    out: list[Wait] = []
    for task in seen:
        worker = _state(task, "worker")
        for call in worker.get("calls", []):
            age = float(call.get("age_s", 0.0))
            if age < SLOW_CALL_S:
                continue
            on = servers.get(str(call.get("address")), str(call.get("address")))
            tries = int(call.get("attempts", 1))
            what = f"{call.get('method')} in flight" + (f", attempt {tries}" if tries > 1 else "")
            failing = str(call.get("last_error") or "")
            out.append(
                Wait(
                    task=task.task,
                    on=on,
                    what=what,
                    seconds=age,
                    failing=failing,
                    method=str(call.get("method")),
                )
            )
        if worker.get("collective") and _stuck(task, stall_s):
            since = float(worker.get("since_step_s") or 0.0)
            phase = worker.get("phase", "compute")
            for peer in workers:
                if peer != task.task:
                    what = f"the collective step {worker.get('step')} ({phase})"
                    out.append(Wait(task=task.task, on=peer, what=what, seconds=since))
        server = _state(task, "server")
        held = server.get("waits_for") or {}
        if held.get("pushed") and held.get("open_s") is not None:
            for missing in held.get("missing", []):
                what = f"its push for sync step {held.get('step')}"
                out.append(
                    Wait(
                        task=task.task,
                        on=f"worker{missing}",
                        what=what,
                        seconds=float(held["open_s"]),
                    )
                )
    return tuple(out)


def _reached(stuck: Sequence[str], waits: Sequence[Wait]) -> set[str]:
    """The tasks the stuck workers reach through the waits (themselves included)."""
    reached = set(stuck)
    frontier = list(stuck)
    while frontier:
        here = frontier.pop()
        for wait in waits:
            if wait.task == here and wait.on not in reached:
                reached.add(wait.on)
                frontier.append(wait.on)
    return reached


def _silent(
    tasks: Sequence[TaskSeen], waits: Sequence[Wait], stall_s: float
) -> tuple[str, str] | None:
    silent = [t for t in tasks if t.report is None]
    if not silent:
        return None
    order = {"stopped": 0, "gone": 1, "zombie": 1}
    task = min(silent, key=lambda t: (order.get(t.process, 2), t.task))
    causes = {
        "stopped": "stopped (SIGSTOP: /proc state T); it cannot answer or run",
        "gone": "its process is gone",
        "zombie": "its process exited (a zombie not yet reaped)",
    }
    cause = causes.get(task.process, f"does not answer ({task.process or 'state unknown'})")
    return task.task, f"{cause}{_waited_on(task.task, waits)}"


def _network(
    tasks: Sequence[TaskSeen], waits: Sequence[Wait], stall_s: float
) -> tuple[str, str] | None:
    """Calls that do not reach their server: failing with a network error, else in flight
    while the server, which answers, does not list them (a Pull or Push it never got)."""
    failing = [w for w in waits if w.failing in NETWORK_ERRORS]
    found = _blame(failing, waits, lambda w: f"fails ({w.failing}, {w.what})")
    if found is None:
        found = _blame(
            _unseen(tasks, waits),
            waits,
            lambda w: (
                f"has been in flight {w.seconds:.1f} s and {w.on}, which answers, has not seen it"
            ),
        )
    return found


def _blame(
    bad: Sequence[Wait], waits: Sequence[Wait], why: Callable[[Wait], str]
) -> tuple[str, str] | None:
    """The worker whose calls to a server do not arrive (its host is cut off), or the server
    where none of its callers' calls arrive."""
    for server in sorted({w.on for w in bad}):
        mine = [w for w in bad if w.on == server]
        wait = max(mine, key=lambda w: w.seconds)
        callers = {w.task for w in waits if w.on == server and w.task.startswith("worker")}
        culprits = {w.task for w in mine}
        if len(callers) > 1 and culprits >= callers:
            return server, f"no worker's call reaches it ({', '.join(sorted(culprits))})"
        return wait.task, (
            f"its {wait.method or 'call'} to {server} {why(wait)}: the network drops its calls "
            f"(its host is cut off from {server}){_waited_on(wait.task, waits)}"
        )
    return None


def _unseen(tasks: Sequence[TaskSeen], waits: Sequence[Wait]) -> list[Wait]:
    """Each worker's Pull or Push in flight that its server, which answered, does not list."""
    servers = {t.task: _state(t, "server") for t in tasks if t.task.startswith("ps") and t.report}
    lost = []
    for wait in waits:
        state = servers.get(wait.on)
        if state is None or wait.method not in TRACKED or not wait.task.startswith("worker"):
            continue
        worker = int(wait.task[len("worker") :])
        seen = [*state.get("serving", []), *state.get("waiting_pulls", [])]
        if not any(int(c.get("worker", -1)) == worker for c in seen):
            lost.append(wait)
    return lost


def _own_code(
    tasks: Sequence[TaskSeen], waits: Sequence[Wait], stall_s: float
) -> tuple[str, str] | None:
    waiting = {w.task for w in waits}
    for task in tasks:
        if task.report is None or not _stuck(task, stall_s) or task.task in waiting:
            continue
        worker = _state(task, "worker")
        since = float(worker.get("since_step_s") or 0.0)
        phase = worker.get("phase", "compute")
        where = "its own code" if phase == "compute" else f"its {phase} phase"
        return task.task, (
            f"blocked in {where} for {since:.1f} s, waiting on no other task"
            f"{_waited_on(task.task, waits)}"
        )
    return None


def _waited_on(task: str, waits: Sequence[Wait]) -> str:
    others = sorted({w.task for w in waits if w.on == task})
    return f"; {', '.join(others)} wait(s) on it" if others else ""


def _frame(task: TaskSeen, *, own: bool = True) -> str:
    """The task's blocking frame (see the module docstring): the innermost of the user's
    (``own``), else of distsgd's, else the innermost."""
    frames: Sequence[Mapping[str, Any]]
    if task.report is not None:
        threads = task.report.get("threads", [])
        main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
        frames = main.get("frames", []) if main else []
    else:
        frames = task.sampled
        if not frames:
            why = "it is stopped" if task.process == "stopped" else "it did not answer"
            return f"none read ({why}; install py-spy to read it from outside)"
    if not frames:
        return "none (no Python frame)"
    files = [str(f.get("file", "")) for f in frames]
    ours = [f for f, name in zip(frames, files, strict=True) if not name.startswith(_OTHERS)]
    users = [f for f in ours if not str(f.get("file", "")).startswith(_DISTSGD)] if own else []
    return show_frame((users or ours or frames)[-1])


def show_frame(frame: Mapping[str, Any]) -> str:
    """``file:line in function: code``."""
    code = str(frame.get("code") or "").strip()
    head = f"{frame.get('file')}:{frame.get('line')} in {frame.get('function')}"
    return f"{head}: {code}" if code else head
