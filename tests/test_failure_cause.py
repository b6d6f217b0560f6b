"""The launcher names the cause of a collective run's failure, not its first echo: when a
worker is killed, its peers' all-reduce fails and they exit too, and on Ray (or a loaded
machine) a peer's exit code can arrive first. ``LocalRun._settle`` waits for the cause; the
choice itself is :func:`distsgd.control.recovery.first_cause` (tests/test_recovery.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import loadclock

from distsgd.control.recovery import PEER_SETTLE, first_cause
from distsgd.launcher.restart import PlanExecutor
from distsgd.launcher.run import LocalRun
from distsgd.launcher.run_state import RunState


class _Task:
    """A task whose exit code shows up ``after`` seconds from now (None: never)."""

    def __init__(self, name: str, code: int | None, after: float = 0.0) -> None:
        self.name, self.code, self.at = name, code, time.monotonic() + after

    def poll(self) -> int | None:
        return self.code if time.monotonic() >= self.at else None


def _run(tasks: list[_Task], *, collective: bool) -> LocalRun:
    run = LocalRun.__new__(LocalRun)  # only what _poll_tasks and _settle read
    config = SimpleNamespace(
        size=SimpleNamespace(lowest_workers=4, elastic=False),
        durability=SimpleNamespace(checkpoint_every=1),
        collective=collective,
    )
    run.state = RunState(
        config=config,  # type: ignore[arg-type]
        console=None,  # type: ignore[arg-type]
        run_dir=Path("unused"),
        supervisor=SimpleNamespace(tasks={t.name: t for t in tasks}),  # type: ignore[arg-type]
        stop=threading.Event(),
        run_id="",
        secret=None,
        progress=None,  # type: ignore[arg-type]
        events=None,  # type: ignore[arg-type]
        active={0, 1, 2, 3},
    )
    run.scaler = SimpleNamespace(leaving={})  # type: ignore[assignment]
    run.executor = PlanExecutor(run.state, None, None, None)  # type: ignore[arg-type]
    return run


def _cause(run: LocalRun) -> tuple[str, dict[str, int]]:
    ended = run._poll_tasks()
    ended = run._settle(ended)
    return first_cause(ended), ended


def test_a_killed_worker_reported_after_its_peer_is_named_the_cause() -> None:
    tasks = [
        _Task("worker0", 1),
        _Task("worker1", -9, after=0.4),
        _Task("worker2", None),
        _Task("worker3", None),
    ]
    watch = loadclock.Stopwatch()
    cause, ended = _cause(_run(tasks, collective=True))
    assert cause == "worker1"
    assert ended == {"worker0": 1, "worker1": -9}
    assert watch.elapsed() < PEER_SETTLE  # it stops waiting once the cause shows


def test_a_crash_with_no_telling_peer_waits_the_settle_time_then_is_its_own_cause() -> None:
    tasks = [_Task("worker0", None), _Task("worker1", 1), _Task("worker2", None)]
    began = time.monotonic()
    cause, ended = _cause(_run(tasks, collective=True))
    assert (cause, ended) == ("worker1", {"worker1": 1})
    assert time.monotonic() - began >= PEER_SETTLE


def test_a_parameter_server_run_does_not_wait() -> None:
    tasks = [_Task("worker0", 1), _Task("worker1", -9, after=0.5), _Task("ps0", None)]
    watch = loadclock.Stopwatch()
    cause, ended = _cause(_run(tasks, collective=False))
    assert (cause, ended) == ("worker0", {"worker0": 1})
    assert watch.elapsed() < 0.3


def test_a_finished_worker_is_done_not_failed() -> None:
    run = _run([_Task("worker0", 0), _Task("worker1", -9)], collective=True)
    assert run._poll_tasks() == {"worker1": -9}
    assert run.state.done == {"worker0"}


def test_an_interrupt_ends_the_wait() -> None:
    run = _run([_Task("worker0", 1), _Task("worker1", None)], collective=True)
    threading.Timer(0.2, run.state.stop.set).start()
    watch = loadclock.Stopwatch()
    assert run._settle({"worker0": 1}) == {"worker0": 1}
    assert watch.elapsed() < PEER_SETTLE / 2
