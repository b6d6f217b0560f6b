"""A local run's emulated hosts (``--hosts``) as its collaborators need them
(:class:`HostsDriver`): where each task runs and what address it binds, the command line that
enters its host, the hosts' disks, their network faults and link samples. The one part of the
local run that reaches the emulators (through their seam, :mod:`distsgd.launcher.emulated`);
without hosts each answer is this machine's (or None: the caller's default)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distsgd.cluster import TaskId
from distsgd.cluster.hosts import MANAGEMENT_ADDRESS, Host
from distsgd.control.faults import Fault
from distsgd.control.metrics import MetricsWriter
from distsgd.launcher.emulated import close_hosts, link_faults, link_sampler, start_hosts
from distsgd.launcher.replicas import PREFIX as REPLICA_PREFIX
from distsgd.launcher.replicas import Place, is_replica, on_hosts, replica_host

if TYPE_CHECKING:
    from distsgd.launcher.emulated import EmulatedHosts

__all__ = ["HostsDriver", "start_hosts"]


class HostsDriver:
    """The emulated hosts of one local run (none: every task on this machine)."""

    def __init__(
        self,
        hosts: EmulatedHosts | None,
        run_dir: Path,
        faults: Sequence[Fault],
        *,
        events: MetricsWriter,
        note: Callable[[str], None],
    ) -> None:
        self.hosts = hosts
        """The emulated hosts the tasks run on; None: this machine's namespace."""
        self.run_dir = run_dir
        self.link_faults = link_faults(faults, hosts, events=events, note=note, run_dir=run_dir)
        """Partitions and slow links of emulated hosts."""
        self.link_sampler = link_sampler(hosts, run_dir)
        """The emulated hosts' bytes over time, from the run's start (``links.jsonl``)."""

    @property
    def emulated(self) -> bool:
        """Whether the run's tasks run on emulated hosts."""
        return self.hosts is not None

    def control_host(self, engine: str | None) -> str | None:
        """Where tasks reach the launcher: the management address on emulated hosts, else
        the engine's ``engine`` (None: they share this machine)."""
        return MANAGEMENT_ADDRESS if self.hosts is not None else engine

    def machines(self, engine: int) -> int:
        """The machines the tasks run on: the emulated hosts, else the engine's ``engine``."""
        return engine if self.hosts is None else len(self.hosts.plan.hosts)

    def task_host(self, task: TaskId) -> str | None:
        """The address ``task`` binds on its emulated host (None: no hosts)."""
        return None if self.hosts is None else self.hosts.plan.host_of(task).address

    def host_of(self, name: str) -> Host | None:
        """The emulated host task ``name`` (a server, worker or log replica) runs on."""
        if self.hosts is None:
            return None
        if is_replica(name):
            return replica_host(self.hosts.plan, int(name[len(REPLICA_PREFIX) :]))
        return self.hosts.plan.host_of(TaskId.parse(name))

    def enter(self, name: str, host: Host | None = None) -> list[str]:
        """What runs task ``name``'s command line in its host's (or ``host``'s) network
        namespace; nothing without hosts."""
        if self.hosts is None:
            return []
        where = host or self.host_of(name)
        assert where is not None
        return self.hosts.enter(where)

    def lost(self, task: TaskId) -> Host:
        """``lose-host:``'s host: the one ``task`` runs on (the config refuses lose-host
        without ``--hosts``)."""
        assert self.hosts is not None
        return self.hosts.plan.host_of(task)

    def wipe(self, host: Host) -> None:
        """``host`` lost its disk: everything its tasks kept there is gone."""
        assert self.hosts is not None
        self.hosts.wipe(host)

    def wipe_all(self) -> bool:
        """Wipe every host's disk (an earlier cluster's logs); False without hosts."""
        if self.hosts is None:
            return False
        for host in self.hosts.plan.hosts:
            self.hosts.wipe(host)
        return True

    def disk_of(self, name: str) -> Path | None:
        """The folder task ``name`` keeps its files in on its host's own disk (None: no
        hosts, its files are in the run folder)."""
        host = self.host_of(name)
        if host is None or self.hosts is None:
            return None
        return self.hosts.disk_of(host)

    def cut_off(self, task: TaskId) -> bool:
        """Whether ``task``'s host is cut off now (``partition:``)."""
        hosts = self.hosts
        return hosts is not None and hosts.plan.host_of(task).name in hosts.cut_off

    def replica_place(self) -> Place | None:
        """Where each server's log replica goes on the hosts (None: no hosts)."""
        return None if self.hosts is None else on_hosts(self.hosts.plan)

    def replica_holds(self, ps: int) -> bool:
        """Whether ps ``ps``'s replica holds a snapshot on its emulated host's disk."""
        assert self.hosts is not None
        host = replica_host(self.hosts.plan, ps)
        return host is not None and any(
            (self.hosts.disk_of(host) / f"{REPLICA_PREFIX}{ps}").glob("snapshot-*.npz")
        )

    def close(self, step: int) -> None:
        """Undo the network faults still in effect, stop sampling, record the bytes, and take
        the emulated hosts down (after the tasks have ended; nothing without hosts)."""
        faults = self.link_faults.restore(step)
        close_hosts(self.hosts, self.run_dir, faults, self.link_sampler.stop())
