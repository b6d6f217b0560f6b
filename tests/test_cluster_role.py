"""A task's job is typed (:class:`~distsgd.cluster.Role`) while its text and JSON forms stay
``"ps"`` and ``"worker"``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from distsgd.cluster import JOBS, ClusterSpec, ClusterSpecError, Role, TaskId
from distsgd.control.faults import Fault
from distsgd.control.task import TaskEnv


def test_a_task_given_its_job_as_text_holds_a_role() -> None:
    task = TaskId(job="ps", index=2)  # type: ignore[arg-type]
    assert task.job is Role.PS and task == TaskId(job=Role.PS, index=2)
    assert hash(task) == hash(TaskId(job=Role.PS, index=2))
    assert TaskId.parse("worker:1").job is Role.WORKER
    assert TaskId.parse("/job:ps/task:0").job is Role.PS
    assert JOBS == (Role.PS, Role.WORKER)


def test_a_role_reads_prints_and_serialises_as_its_job_name() -> None:
    assert Role.WORKER == "worker" and Role("ps") is Role.PS
    assert str(Role.PS) == "ps" and f"{Role.WORKER}" == "worker"
    task = TaskId(job=Role.WORKER, index=1)
    assert task.name == "worker1" and task.is_chief is False
    assert json.dumps(dataclasses.asdict(task)) == '{"job": "worker", "index": 1}'
    assert TaskId(job=Role.WORKER, index=0).is_chief


def test_an_unknown_job_is_still_refused() -> None:
    with pytest.raises(ClusterSpecError, match="unknown job 'chief'"):
        TaskId(job="chief", index=0)  # type: ignore[arg-type]


def test_cluster_fault_and_task_env_hand_out_roles() -> None:
    spec = ClusterSpec(ps=("127.0.0.1:1",), worker=("127.0.0.1:2", "127.0.0.1:3"))
    assert [t.job for t in spec.tasks()] == [Role.PS, Role.WORKER, Role.WORKER]
    assert spec.task(Role.WORKER, 1).job is Role.WORKER
    assert spec.task("ps", 0).job is Role.PS  # text still accepted
    assert Fault.parse("kill:ps:0@step=5").task_id == TaskId(job=Role.PS, index=0)
    env = TaskEnv(cluster=spec.to_dict(), task_index=1, scheme="sync")
    assert env.task == TaskId(job=Role.WORKER, index=1)
    assert json.loads(env.to_json())["cluster"] == {
        "ps": ["127.0.0.1:1"],
        "worker": list(spec.worker),
    }
