"""``distsgd run/demo --hosts N``: the tasks run on emulated hosts (network namespaces,
distsgd_emulate.netns), bind their host's address, exchange bytes over shaped links, and
nothing of the hosts is left afterwards. The settings' checks are pure; the runs are slow and
skipped where namespaces cannot be made."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import loadclock
import psutil
import pytest
from conftest import SCRIPTS, distsgd_cmd, final_accuracy, netns_refusal, on_emulated_hosts

from distsgd.cluster import TaskId
from distsgd.launcher import LaunchConfig
from distsgd.launcher.config import ClusterSize, Hosting
from distsgd.launcher.emulated import host_plan
from distsgd_emulate.emulation import HOSTS_FILE
from distsgd_emulate.hosts import parse_links, plan_hosts
from distsgd_emulate.netns import EmulatedHosts

BLOBS = str(SCRIPTS / "blobs.py")
SRC = Path(__file__).resolve().parents[1] / "src"


# one at a time; the pure tests take no lock
needs_netns = on_emulated_hosts(netns_refusal(root=True))


# --------------------------------------------------------------------------- settings (pure)


def test_hosts_place_the_tasks_and_turn_the_fork_server_off() -> None:
    config = LaunchConfig(
        script=BLOBS,
        scheme="hogwild",
        size=ClusterSize(workers=3, ps=1),
        hosting=Hosting(hosts=2, links=("1gbit",)),
    )
    plan = host_plan(config)
    assert [[t.name for t in h.tasks] for h in plan.hosts] == [
        ["ps0", "worker1"],
        ["worker0", "worker2"],
    ]
    assert [h.link and h.link.rate_bits for h in plan.hosts] == [10**9, 10**9]
    assert not config.forks_workers
    assert LaunchConfig(script=BLOBS).forks_workers == Hosting().fork_server
    packed = host_plan(
        LaunchConfig(
            script=BLOBS, size=ClusterSize(workers=3), hosting=Hosting(hosts=2, placement="pack")
        )
    )
    assert [[t.name for t in h.tasks] for h in packed.hosts] == [
        ["ps0", "worker0"],
        ["worker1", "worker2"],
    ]


@pytest.mark.parametrize(
    ("knobs", "needle"),
    [
        ({"hosts": 4}, "use --hosts 3 or fewer"),
        ({"hosts": -1}, "--hosts must be 0"),
        ({"links": ("1gbit",)}, "add --hosts N"),
        ({"placement": "pack"}, "add --hosts N"),
        ({"hosts": 2, "ray": ""}, "drop --hosts or --ray"),
        ({"hosts": 2, "placement": "diagonal"}, "spread"),
        ({"hosts": 2, "links": ("worker9=1gbit",)}, "worker9"),
    ],
)
def test_bad_host_settings_are_one_line_value_errors(knobs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        LaunchConfig(script=BLOBS, size=ClusterSize(workers=2), hosting=Hosting(**knobs))
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_host_plan_needs_hosts() -> None:
    with pytest.raises(ValueError, match="--hosts N"):
        host_plan(LaunchConfig(script=BLOBS))


# --------------------------------------------------------------------------- in namespaces

LOCAL = """
import json, sys
from distsgd.transport.carriers.attach import is_local_address
print(json.dumps([is_local_address(a) for a in sys.argv[1:]]))
"""


@needs_netns
def test_an_address_another_host_owns_is_not_local() -> None:
    """Shared memory is only used between tasks of one host: in host1, host0's address (and
    the launcher's) is not local, its own is."""
    tasks = [TaskId.parse("worker0"), TaskId.parse("worker1")]
    plan = plan_hosts(count=2, tasks=tasks, links=parse_links([]))
    with EmulatedHosts(plan, management=True) as hosts:
        addresses = [f"{h.address}:5000" for h in plan.hosts] + ["198.18.0.253:5000"]
        argv = [*hosts.enter("host1"), sys.executable, "-c", LOCAL, *addresses]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        done = loadclock.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [False, True, False]


def _listening(pid: int) -> set[str]:
    """The addresses listened on in ``pid``'s network namespace (its /proc/PID/net/tcp*)."""
    out = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            if size == 4:
                out.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:  # each 32-bit word in host order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                text = socket.inet_ntop(socket.AF_INET6, words)
                out.add(text.removeprefix("::ffff:"))  # an IPv4 address, mapped
    return out


def _demo(run_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the demo on emulated hosts; what it printed, and every address a task listened on
    while it ran (sampled)."""
    argv = distsgd_cmd("demo", *args, "--quiet", "--run-dir", str(run_dir))
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                pids = json.loads((run_dir / "tasks.json").read_text()).values()
            except (OSError, ValueError):
                pids = []
            for pid in [*pids, *_host_keepers(run_dir)]:  # each task's and host's view
                seen |= _listening(pid)
            time.sleep(0.2)
        out, err = loadclock.communicate(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), seen


def _host_keepers(run_dir: Path) -> list[int]:
    """The PIDs of the keepers of the run's host namespaces (the switch's left out)."""
    try:
        keepers = json.loads((run_dir / HOSTS_FILE).read_text())["keepers"]
    except (OSError, ValueError, KeyError):
        return []
    return [pid for name, pid in keepers.items() if name != "switch"]


def _check_hosts_gone(record: dict[str, Any]) -> None:
    assert record["prefix"] not in _links_here()
    for pid in record["keepers"].values():
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@needs_netns
@pytest.mark.slow  # about 45 CPU-seconds
def test_hogwild_demo_on_three_hosts_every_pair_exchanges_bytes(tmp_path: Path) -> None:
    """The issue's demo (4 workers, 2 ps, 3 hosts, 1gbit links), one run checked for what two
    runs checked before (this and a 2-host hogwild demo): it reaches 0.95; the hosts and their
    links are as asked, ps0 on host0 at its address; each host sends and receives over its
    link, and every host sends to every other host (``pair_bytes``); nothing listens on
    loopback in any host's namespace while it runs; the hosts are gone afterwards. 20 epochs,
    not the demo's 30 (at 10, 0.944-0.956 over 3 runs; at 15, once 0.925). The allreduce demo
    on two hosts: tests/test_hosts_faults.py (its run under a partition checks the same)."""
    run_dir = tmp_path / "run"
    args = ["--scheme", "hogwild", "--workers", "4", "--ps", "2", "--hosts", "3"]
    done, listened = _demo(run_dir, *args, "--link", "1gbit", "--epochs", "20")
    assert final_accuracy(done) >= 0.95
    record = json.loads((run_dir / HOSTS_FILE).read_text())
    names = [h["name"] for h in record["hosts"]]
    assert names == ["host0", "host1", "host2"]
    assert [h["link"] for h in record["hosts"]] == ["1gbit"] * 3
    assert "ps0" in record["hosts"][0]["tasks"]
    ps = json.loads((run_dir / "cluster.json").read_text())["ps"]
    assert ps[0].startswith("198.18.0.1:")
    for name in names:
        assert record["bytes"][name]["sent"] > 1_000_000
        assert record["bytes"][name]["received"] > 1_000_000
    for sender in names:
        for receiver in names:
            if receiver != sender:
                assert record["pair_bytes"][sender][receiver] > 1_000_000, (sender, receiver)
    assert listened, "no task was seen listening"
    assert all(a.startswith("198.18.0.") for a in listened), listened
    _check_hosts_gone(record)


@needs_netns
@pytest.mark.slow  # about 8 s
def test_a_sigkilled_launcher_leaves_no_host_task_or_link(tmp_path: Path) -> None:
    """2 workers (not 4: the tasks killed mid-start are CPU-seconds no one counts), 2 ps with
    their log replicas, on 3 hosts."""
    run_dir = tmp_path / "run"
    args = ["--scheme", "hogwild", "--workers", "2", "--ps", "2", "--hosts", "3", "--quiet"]
    argv = distsgd_cmd("demo", *args, "--run-dir", str(run_dir))
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "tasks.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        tasks = json.loads((run_dir / "tasks.json").read_text())
        record = json.loads((run_dir / HOSTS_FILE).read_text())
        assert f"{record['prefix']}-m" in _links_here()
        assert {"replica0", "replica1"} <= set(tasks)  # the servers' log replicas, too
        namespaces = {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in record["keepers"].values()}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        pids = [*tasks.values(), *record["keepers"].values()]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            any(_alive(pid) for pid in pids) or record["prefix"] in _links_here()
        ):
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)]
        assert record["prefix"] not in _links_here()
        assert not _in_namespaces(namespaces), "a process is still in a namespace of the run"
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(run_dir) not in mounts  # the hosts' disks were theirs alone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _in_namespaces(inodes: set[int]) -> list[int]:
    """The live processes in any of the network namespaces ``inodes``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino in inodes and _alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _links_here() -> str:
    return loadclock.run(
        ["ip", "-br", "link"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
