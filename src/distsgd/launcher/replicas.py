"""The replicas of the servers' write-ahead logs on emulated hosts (:mod:`distsgd.ps.replica`).

Under ``--hosts`` (two or more) with the log on (``--wal on``, the default), the launcher
starts, for each parameter server ``psI``, a task ``replicaI`` (``distsgd server --job
replica``) on the next host in the plan's order, so that a server and its replica never share
a host; ``psI`` is started with ``--replica`` at the replica's address. The replica keeps its
files in ``RUN_DIR/wal/replicaI`` as its host sees it (a host's own disk where the hosts have
private disks). A replica starts before its server, which needs its address.

A replica that dies (its host lost, say) is started again at the same address on the same
host, empty: its server's log goes down meanwhile (pushes wait) and the server's ticker seeds
it again with a new generation's snapshot once it answers. Replicas are not in the restart
planner's view (it plans servers and workers): they hold nothing a restart would need that
their server does not also hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from distsgd.cluster import Role, TaskId
from distsgd.cluster.hosts import Host, HostPlan
from distsgd.launcher.supervisor import TaskHandle

PREFIX = "replica"
"""Every replica task's name starts with it (``replica0``)."""

StartTask = Callable[[str, list[str], Host], TaskHandle]
"""How a task is started on a host: (name, argv, host) -> its handle."""
WaitAddress = Callable[[TaskHandle, Path], str]
"""How the address a task reports is awaited: (task, its address file) -> the address."""


def is_replica(name: str) -> bool:
    """Whether task ``name`` is a log replica."""
    return name.startswith(PREFIX)


def replica_host(plan: HostPlan, ps: int) -> Host | None:
    """Where ps ``ps``'s replica goes: the host after its server's (None on one host)."""
    if len(plan.hosts) < 2:
        return None
    own = plan.host_of(TaskId(job=Role.PS, index=ps))
    return plan.hosts[(own.index + 1) % len(plan.hosts)]


@dataclass
class Replicas:
    """The log replicas of one run on emulated hosts, and how they are (re)started."""

    plan: HostPlan
    run_dir: Path
    run_id: str
    python: list[str]
    """The interpreter's argv (``[sys.executable, "-m", "distsgd"]``)."""
    start_task: StartTask
    wait_address: WaitAddress
    disk_of: Callable[[Host], Path]
    """Where a host's disk is, as the launcher sees it (what its tasks see at RUN_DIR/wal)."""
    note: Callable[[str], None]
    event: Callable[..., None]

    def __post_init__(self) -> None:
        self.addresses: dict[int, str] = {}
        """Each replica's address, by its server's index (kept across restarts)."""
        self.tasks: dict[int, TaskHandle] = {}
        self.restarts = 0

    def folder(self, ps: int) -> Path:
        return self.run_dir / "wal" / f"{PREFIX}{ps}"

    def _address_file(self, ps: int) -> Path:
        return self.run_dir / f"{PREFIX}{ps}.address"

    def _argv(self, ps: int, address: str) -> list[str]:
        return [
            *self.python,
            *("server", "--job", "replica", "--task", str(ps), "--run-id", self.run_id),
            *("--address", address, "--address-file", str(self._address_file(ps))),
            *("--wal-dir", str(self.folder(ps))),
        ]

    def spawn(self, ps: int) -> TaskHandle | None:
        """Start ps ``ps``'s replica (at its earlier address, if it had one); None on one host."""
        host = replica_host(self.plan, ps)
        if host is None:
            return None
        address = self.addresses.get(ps, f"{host.address}:0")
        self._address_file(ps).unlink(missing_ok=True)
        task = self.start_task(f"{PREFIX}{ps}", self._argv(ps, address), host)
        self.tasks[ps] = task
        return task

    def start(self, servers: int) -> None:
        """Start a replica for each server and wait until each listens."""
        started = {ps: self.spawn(ps) for ps in range(servers)}
        for ps, task in started.items():
            if task is not None:
                self.addresses[ps] = self.wait_address(task, self._address_file(ps))

    def holds_state(self, ps: int) -> bool:
        """Whether ps ``ps``'s replica holds a snapshot to recover from (on its host's disk,
        as the launcher sees it): one started again empty holds none until it is seeded."""
        host = replica_host(self.plan, ps)
        if host is None or ps not in self.addresses:
            return False
        return any((self.disk_of(host) / f"{PREFIX}{ps}").glob("snapshot-*.npz"))

    def address(self, ps: int) -> str | None:
        """Where ps ``ps``'s server mirrors its log (None: no replica)."""
        return self.addresses.get(ps)

    def restart_dead(self, step: int) -> None:
        """Start again, at its address, each replica that ended (its server re-seeds it)."""
        for ps, task in list(self.tasks.items()):
            code = task.poll()
            if code is None:
                continue
            self.restarts += 1
            self.note(
                f"[distsgd] {task.name} ended (exit code {code}); starting it again at "
                f"{self.addresses.get(ps)} (ps{ps} sends it a new snapshot)"
            )
            self.event(step=step, event="replica_restart", target=task.name, code=code)
            started = time.monotonic()
            new = self.spawn(ps)
            if new is not None:
                self.wait_address(new, self._address_file(ps))
                self.event(
                    step=step,
                    event="replica_up",
                    target=new.name,
                    seconds=round(time.monotonic() - started, 3),
                )

    def summary(self) -> Mapping[str, object]:
        """``result.json``'s ``replicas``."""
        return {"replicas": dict(sorted(self.addresses.items())), "restarts": self.restarts}
