"""``--inject-fault lose-host:...`` on emulated hosts with private disks: every process of the
target's host is killed and its disk wiped; a server comes back on an empty disk from its
log's replica on another host, losing no update it acknowledged. Slow; skipped where
namespaces cannot be made (root is needed for the launcher's link to the hosts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import final_accuracy, metrics, netns_refusal, on_emulated_hosts
from test_hosts_run import _check_hosts_gone, _demo

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd_emulate.driver import replica_host
from distsgd_emulate.emulation import HOSTS_FILE
from distsgd_emulate.hosts import plan_hosts

needs_netns = on_emulated_hosts(netns_refusal(root=True))


def _plan(hosts: int, ps: int, workers: int):  # type: ignore[no-untyped-def]
    tasks = ClusterSpec.local(num_ps=ps, num_workers=workers).tasks()
    return plan_hosts(count=hosts, tasks=tasks)


def test_a_replica_goes_on_the_host_after_its_servers() -> None:
    plan = _plan(3, 2, 4)
    for ps in range(2):
        own = plan.host_of(TaskId(job=Role.PS, index=ps))
        other = replica_host(plan, ps)
        assert other is not None and other is not own
        assert other.index == (own.index + 1) % 3
    assert replica_host(_plan(1, 2, 2), 0) is None


def _mounts_under(path: Path) -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if str(path) in line]


@needs_netns
@pytest.mark.slow  # about 40 CPU-seconds
def test_a_lost_server_host_loses_no_acknowledged_update(tmp_path: Path) -> None:
    """sync, 3 workers and 2 servers on 3 hosts (spread: host1 holds ps1, worker2 and ps0's
    replica, as with 4 workers; the fourth only cost CPU). Losing host1 at step 40 kills all
    three and wipes host1's disk: ps1 comes back from its replica on host2 at the version it
    had acknowledged, replica0 starts again empty and ps0 seeds it anew, worker2 goes on; the
    run ends as a run without the fault."""
    run_dir = tmp_path / "run"
    args = ["--scheme", "sync", "--workers", "3", "--ps", "2", "--hosts", "3"]
    done, _ = _demo(run_dir, *args, "--inject-fault", "lose-host:ps:1@step=40", "--epochs", "8")
    # 8 epochs (120 steps a worker) to keep CI short: 0.950 under load; once 4 workers at
    # 10 epochs gave 0.947 under CI's load, 0.975 at the demo's default epochs
    assert final_accuracy(done) >= 0.93
    assert "fault injected: host1 lost at step 40 (replica0, ps1, worker2)" in done.stdout
    events = metrics(run_dir)
    (ps,) = [e for e in events if e.get("event") == "fault" and e["target"] == "ps1"]
    assert ps["action"] == "restart" and ps["resumed_from"] == "wal", ps
    assert ps["lost_updates"] == 0 and ps["restored_version"] >= ps["seen_version"] >= 40, ps
    assert [e["target"] for e in events if e.get("event") == "replica_restart"] == ["replica0"]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["log_replicas"]["restarts"] == 1
    record = json.loads((run_dir / HOSTS_FILE).read_text())
    _check_hosts_gone(record)
    assert not _mounts_under(run_dir)  # the hosts' disks went with their namespaces
    assert not (run_dir / "disks").exists()
