"""A local run's emulated hosts (``--hosts``) as its collaborators need them
(:class:`HostsDriver`, the :class:`distsgd.launcher.emulated.Hosts` the launcher's seam hands
out): where each task runs and what address it binds, the command line that enters its host,
the hosts' disks, their network faults and link samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distsgd.cluster import Role, TaskId
from distsgd.control.faults import Fault
from distsgd.control.metrics import MetricsWriter
from distsgd.launcher.replicas import PREFIX as REPLICA_PREFIX
from distsgd.launcher.replicas import is_replica
from distsgd_emulate import emulation
from distsgd_emulate.hosts import MANAGEMENT_ADDRESS, Host, HostPlan, link_delays
from distsgd_emulate.link_faults import LinkFaults
from distsgd_emulate.link_sampler import LinkSampler
from distsgd_emulate.netns import EmulatedHosts

if TYPE_CHECKING:
    from distsgd.launcher.emulated import Host as AnyHost
    from distsgd.launcher.replicas import Place

__all__ = ["HostsDriver", "on_hosts", "replica_host"]


def replica_host(plan: HostPlan, ps: int) -> Host | None:
    """Where ps ``ps``'s log replica goes: the host after its server's (None on one host)."""
    if len(plan.hosts) < 2:
        return None
    own = plan.host_of(TaskId(job=Role.PS, index=ps))
    return plan.hosts[(own.index + 1) % len(plan.hosts)]


def on_hosts(plan: HostPlan) -> Place:
    """:data:`~distsgd.launcher.replicas.Place` on emulated hosts: the host after the
    server's."""

    def place(ps: int) -> tuple[str, Host | None] | None:
        host = replica_host(plan, ps)
        return None if host is None else (host.address, host)

    return place


class HostsDriver:
    """The emulated hosts of one local run."""

    emulated = True
    """The run's tasks run on emulated hosts."""

    def __init__(self, hosts: EmulatedHosts, run_dir: Path) -> None:
        self.hosts = hosts
        """The emulated hosts the tasks run on."""
        self.run_dir = run_dir
        self.link_faults: LinkFaults | None = None
        """Partitions and slow links of emulated hosts (once :meth:`arm` gave them)."""
        self.link_sampler = LinkSampler(hosts, run_dir)
        """The emulated hosts' bytes over time, from the run's start (``links.jsonl``)."""

    @classmethod
    def start(cls, plan: HostPlan, run_dir: Path) -> HostsDriver:
        """The hosts of ``plan``, started (:func:`distsgd_emulate.emulation.start_hosts`)."""
        return cls(emulation.start_hosts(plan, run_dir), run_dir)

    def arm(
        self, faults: Sequence[Fault], *, events: MetricsWriter, note: Callable[[str], None]
    ) -> None:
        """Take on the run's partitions and slow links."""
        run_dir = self.run_dir
        self.link_faults = LinkFaults(faults, self.hosts, events=events, note=note, run_dir=run_dir)

    def start_sampling(self) -> None:
        """Start sampling the links (``links.jsonl``)."""
        self.link_sampler.start()

    def poll_faults(self, step: int) -> None:
        """Apply the network faults due at ``step``, undo those whose ``for=`` is over."""
        if self.link_faults is not None:
            self.link_faults.poll(step)

    def control_host(self, engine: str | None) -> str | None:
        """Where tasks reach the launcher: the management address."""
        return MANAGEMENT_ADDRESS

    def machines(self, engine: int) -> int:
        """The machines the tasks run on: the emulated hosts."""
        return len(self.hosts.plan.hosts)

    def task_host(self, task: TaskId) -> str | None:
        """The address ``task`` binds on its emulated host."""
        return self.hosts.plan.host_of(task).address

    def host_of(self, name: str) -> Host | None:
        """The emulated host task ``name`` (a server, worker or log replica) runs on."""
        if is_replica(name):
            return replica_host(self.hosts.plan, int(name[len(REPLICA_PREFIX) :]))
        return self.hosts.plan.host_of(TaskId.parse(name))

    def enter(self, name: str, host: AnyHost | None = None) -> list[str]:
        """What runs task ``name``'s command line in its host's (or ``host``'s) network
        namespace."""
        where = host or self.host_of(name)
        assert isinstance(where, Host)
        return self.hosts.enter(where)

    def lost(self, task: TaskId) -> Host:
        """``lose-host:``'s host: the one ``task`` runs on."""
        return self.hosts.plan.host_of(task)

    def wipe(self, host: AnyHost) -> None:
        """``host`` lost its disk: everything its tasks kept there is gone."""
        assert isinstance(host, Host)
        self.hosts.wipe(host)

    def wipe_all(self) -> bool:
        """Wipe every host's disk (an earlier cluster's logs)."""
        for host in self.hosts.plan.hosts:
            self.hosts.wipe(host)
        return True

    def disk_of(self, name: str) -> Path | None:
        """The folder task ``name`` keeps its files in on its host's own disk."""
        host = self.host_of(name)
        return None if host is None else self.hosts.disk_of(host)

    def cut_off(self, task: TaskId) -> bool:
        """Whether ``task``'s host is cut off now (``partition:``)."""
        return self.hosts.plan.host_of(task).name in self.hosts.cut_off

    def replica_place(self) -> Place | None:
        """Where each server's log replica goes on the hosts."""
        return on_hosts(self.hosts.plan)

    def replica_holds(self, ps: int) -> bool:
        """Whether ps ``ps``'s replica holds a snapshot on its emulated host's disk."""
        host = replica_host(self.hosts.plan, ps)
        return host is not None and any(
            (self.hosts.disk_of(host) / f"{REPLICA_PREFIX}{ps}").glob("snapshot-*.npz")
        )

    def link_delays(self, worker: int, servers: int) -> list[list[float]]:
        """Per server, the [round trip, jitter] between worker ``worker``'s host and the
        server's, where a ``--link`` gives a delay (:func:`distsgd_emulate.hosts.link_delays`)."""
        return link_delays(self.hosts.plan, worker, servers)

    def close(self, step: int) -> None:
        """Undo the network faults still in effect, stop sampling, record the bytes, and take
        the emulated hosts down (after the tasks have ended)."""
        faults = [] if self.link_faults is None else self.link_faults.restore(step)
        emulation.close_hosts(self.hosts, self.run_dir, faults, self.link_sampler.stop())

    def abandon(self) -> None:
        """Take the hosts down unrecorded (the run's start failed)."""
        self.hosts.close(check=False)
