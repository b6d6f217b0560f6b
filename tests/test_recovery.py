"""The restart planner (:func:`distsgd.control.recovery.plan_restart`) as a pure function: no
process, no socket, no file."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from distsgd.cluster import TaskId
from distsgd.control.checkpoint.store import Checkpoint, ShardRef, WorkerStateRef
from distsgd.control.divergence import DIVERGED_EXIT_CODE
from distsgd.control.errors import SETUP_EXIT_CODE
from distsgd.control.recovery import (
    Drop,
    Restart,
    RestartAll,
    RestartBudget,
    RunTopology,
    Stop,
    TaskFailure,
    backoff,
    failure_kind,
    first_cause,
    may_follow_a_peer,
    plan_restart,
    resume_point,
)


@pytest.fixture(autouse=True)
def _no_process_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the planner started a process or opened a socket")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(socket, "socket", refuse)


@dataclass
class Store:
    """What a checkpoint store holds, as plain data; it records what was asked."""

    checkpoint: Checkpoint | None = None
    workers: dict[int, WorkerStateRef] = field(default_factory=dict)
    shards: dict[int, ShardRef] = field(default_factory=dict)
    wal: set[int] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)

    def latest(self) -> Checkpoint | None:
        self.asked.append("latest")
        return self.checkpoint

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        self.asked.append(f"worker{index}")
        return self.workers.get(index)

    def newest_shard(self, index: int) -> ShardRef | None:
        self.asked.append(f"ps{index}")
        return self.shards.get(index)

    def has_wal(self, index: int) -> bool:
        return index in self.wal


CKPT = Checkpoint(path=Path("/run/checkpoints/ckpt-00000040"), manifest={"step": 40})
STATE = WorkerStateRef(path=Path("/run/checkpoints/workers/worker1-00000050.pt"), step=50)
SHARD = ShardRef(path=Path("/run/checkpoints/ckpt-00000040/ps0.npz"), version=400)
PS_RUN = RunTopology(collective=False, workers=4, min_workers=4)
ELASTIC = RunTopology(collective=False, workers=4, min_workers=2, elastic=True)
COLLECTIVE = RunTopology(collective=True, workers=4, min_workers=4)
FRESH = RestartBudget(used=0, max_restarts=3)
SPENT = RestartBudget(used=3, max_restarts=3)


def _fail(task: str, code: int = 1, **more: Any) -> TaskFailure:
    return TaskFailure(task=TaskId.parse(task), exit_code=code, kind=failure_kind(code), **more)


def test_a_worker_with_a_state_restarts_from_it_where_its_metrics_were() -> None:
    store = Store(workers={1: STATE})
    plan = plan_restart(_fail("worker1", reached=57), PS_RUN, store, FRESH)
    assert plan == Restart(task=TaskId(job="worker", index=1), resume=STATE, continue_at=57)


def test_a_worker_without_a_state_restarts_from_the_start() -> None:
    plan = plan_restart(_fail("worker1", reached=12), PS_RUN, Store(), FRESH)
    assert isinstance(plan, Restart) and plan.resume is None and plan.continue_at == 12


def test_a_run_without_checkpoints_never_looks_for_a_worker_state() -> None:
    store = Store(workers={1: STATE})
    run = RunTopology(collective=False, workers=4, min_workers=4, checkpointing=False)
    plan = plan_restart(_fail("worker1"), run, store, FRESH)
    assert isinstance(plan, Restart) and plan.resume is None and store.asked == []


def test_a_ps_with_a_shard_file_restarts_alone_from_it() -> None:
    plan = plan_restart(_fail("ps0", -9), PS_RUN, Store(shards={0: SHARD}), FRESH)
    assert plan == Restart(task=TaskId(job="ps", index=0), resume=SHARD)


def test_a_ps_with_only_its_write_ahead_log_restarts_alone() -> None:
    plan = plan_restart(_fail("ps0", -9), PS_RUN, Store(wal={0}), FRESH)
    assert plan == Restart(task=TaskId(job="ps", index=0), resume=None)


def test_a_ps_with_neither_restarts_the_cluster_from_the_last_checkpoint() -> None:
    store = Store(checkpoint=CKPT, wal={1})
    plan = plan_restart(_fail("ps0", -9, furthest=70), PS_RUN, store, FRESH)
    assert plan == RestartAll(
        checkpoint=CKPT, lost_steps=30, why="no checkpoint to restore the shard from"
    )


def test_a_ps_with_nothing_at_all_restarts_the_cluster_from_the_start() -> None:
    plan = plan_restart(_fail("ps1", furthest=25), PS_RUN, Store(), FRESH)
    assert isinstance(plan, RestartAll) and plan.checkpoint is None and plan.lost_steps == 25


def test_a_collective_worker_restarts_every_worker() -> None:
    plan = plan_restart(_fail("worker2", furthest=41), COLLECTIVE, Store(checkpoint=CKPT), FRESH)
    assert plan == RestartAll(
        checkpoint=CKPT, lost_steps=1, why="collective schemes restart every worker"
    )


def test_out_of_restarts_stops_the_run_and_says_whether_it_can_resume() -> None:
    assert plan_restart(_fail("worker1"), PS_RUN, Store(checkpoint=CKPT), SPENT) == Stop(
        reason="out_of_restarts", used=3, resumable=True
    )
    assert plan_restart(_fail("ps0"), PS_RUN, Store(), SPENT) == Stop(
        reason="out_of_restarts", used=3, resumable=False
    )


def test_out_of_restarts_with_min_workers_drops_the_worker() -> None:
    plan = plan_restart(_fail("worker3"), ELASTIC, Store(), SPENT)
    assert plan == Drop(task=TaskId(job="worker", index=3), workers=3)


def test_a_worker_is_not_dropped_below_min_workers() -> None:
    run = RunTopology(collective=False, workers=2, min_workers=2, elastic=True)
    plan = plan_restart(_fail("worker1"), run, Store(), SPENT)
    assert isinstance(plan, Stop) and plan.reason == "out_of_restarts"


def test_the_chief_is_never_dropped() -> None:
    plan = plan_restart(_fail("worker0"), ELASTIC, Store(), SPENT)
    assert isinstance(plan, Stop) and plan.reason == "out_of_restarts"


def test_a_ps_and_a_collective_worker_are_never_dropped() -> None:
    assert isinstance(plan_restart(_fail("ps0"), ELASTIC, Store(), SPENT), Stop)
    elastic_collective = RunTopology(collective=True, workers=4, min_workers=1, elastic=True)
    assert isinstance(plan_restart(_fail("worker2"), elastic_collective, Store(), SPENT), Stop)


def test_max_restarts_zero_stops_at_the_first_failure() -> None:
    plan = plan_restart(_fail("worker1"), PS_RUN, Store(), RestartBudget(used=0, max_restarts=0))
    assert plan == Stop(reason="out_of_restarts", used=0)


def test_a_healthy_run_resets_the_count() -> None:
    budget = RestartBudget(used=3, max_restarts=3, ran_seconds=61.0, healthy_seconds=60.0)
    plan = plan_restart(_fail("worker1"), PS_RUN, Store(), budget)
    assert isinstance(plan, Restart) and plan.attempt == 1 and plan.backoff == 0.0
    short = RestartBudget(used=3, max_restarts=3, ran_seconds=59.0, healthy_seconds=60.0)
    assert isinstance(plan_restart(_fail("worker1"), PS_RUN, Store(), short), Stop)


def test_restarts_in_a_row_back_off() -> None:
    plan = plan_restart(_fail("worker1"), PS_RUN, Store(), RestartBudget(used=2, max_restarts=9))
    assert isinstance(plan, Restart) and plan.attempt == 3 and plan.backoff == 1.0
    assert [backoff(n) for n in range(7)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


def test_a_setup_error_stops_the_run_with_restarts_left() -> None:
    plan = plan_restart(_fail("worker1", SETUP_EXIT_CODE), PS_RUN, Store(), FRESH)
    assert plan == Stop(reason="setup_error")


def test_a_divergence_stops_the_run_with_restarts_left() -> None:
    plan = plan_restart(_fail("worker0", DIVERGED_EXIT_CODE), COLLECTIVE, Store(), FRESH)
    assert plan == Stop(reason="diverged")


def test_a_ps_exiting_with_those_codes_is_restarted() -> None:
    for code in (SETUP_EXIT_CODE, DIVERGED_EXIT_CODE):
        plan = plan_restart(_fail("ps0", code), PS_RUN, Store(shards={0: SHARD}), FRESH)
        assert isinstance(plan, Restart) and plan.resume == SHARD


def test_pods_restart_in_place_whatever_the_run() -> None:
    run = RunTopology(collective=True, workers=2, min_workers=2, in_place=True)
    store = Store(checkpoint=CKPT, workers={1: STATE})
    plan = plan_restart(_fail("worker1"), run, store, RestartBudget(used=5, max_restarts=6))
    assert plan == Restart(task=TaskId(job="worker", index=1), resume=STATE, attempt=6, backoff=8.0)
    spent = RestartBudget(used=6, max_restarts=6)
    assert plan_restart(_fail("worker1"), run, store, spent) == Stop(
        reason="out_of_restarts", used=6
    )


def test_a_restarted_pod_picks_its_own_newest_file() -> None:
    store = Store(workers={1: STATE}, shards={0: SHARD})
    assert resume_point(TaskId(job="worker", index=1), store).resume == STATE
    assert resume_point(TaskId(job="ps", index=0), store).resume == SHARD
    assert resume_point(TaskId(job="ps", index=1), store).resume is None
    assert resume_point(TaskId(job="worker", index=1), store, checkpointing=False).resume is None


def test_failure_kinds_from_exit_codes() -> None:
    assert failure_kind(1) == "crash" and failure_kind(None) == "crash"
    assert failure_kind(-9) == "killed"
    assert failure_kind(SETUP_EXIT_CODE) == "setup_error"
    assert failure_kind(DIVERGED_EXIT_CODE) == "diverged"


@pytest.mark.parametrize(
    ("ended", "cause"),
    [
        ({"worker0": 1, "worker1": -9}, "worker1"),  # the killed one broke the all-reduce
        ({"worker0": 1, "worker2": DIVERGED_EXIT_CODE, "worker1": -9}, "worker2"),
        ({"worker3": 1, "worker1": SETUP_EXIT_CODE, "worker0": -15}, "worker1"),
        ({"worker2": 1, "worker10": 1}, "worker2"),  # a tie: index order, not text order
        ({"worker1": -9, "ps0": -9}, "ps0"),  # a tie of kinds: servers first
        ({"worker5": 1}, "worker5"),
    ],
)
def test_the_first_cause_of_tasks_that_ended_together(ended: dict[str, int], cause: str) -> None:
    assert first_cause(ended) == cause


def test_first_cause_of_nothing_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="no task"):
        first_cause({})


@pytest.mark.parametrize(
    ("kind", "collective", "wait"),
    [
        ("crash", True, True),
        ("killed", True, False),
        ("diverged", True, False),
        ("setup_error", True, False),
        ("crash", False, False),  # a parameter-server worker's crash is its own
    ],
)
def test_only_a_collective_crash_waits_for_a_peer(kind: Any, collective: bool, wait: bool) -> None:
    run = RunTopology(collective=collective, workers=4, min_workers=4)
    assert may_follow_a_peer(kind, run) is wait
