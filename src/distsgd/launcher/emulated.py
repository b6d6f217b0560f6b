"""The core's one way to the emulators: the package :mod:`distsgd_emulate` (emulated hosts as
network namespaces, their plan, link faults and samples, the link probe), shipped beside
``distsgd`` but no part of it. No other module of ``distsgd`` imports it
(tests/test_import_graph.py), and this one only when it is needed: a run with ``--hosts``
(checked, then started) and ``distsgd plan --link``'s probe. A run without emulated hosts never
loads it: its collaborators see :class:`NoHosts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from distsgd.util.optional import installed

if TYPE_CHECKING:
    from distsgd.cluster import TaskId
    from distsgd.control.faults import Fault
    from distsgd.control.metrics import MetricsWriter
    from distsgd.launcher.config import LaunchConfig
    from distsgd.launcher.replicas import Place
    from distsgd_emulate.hosts import HostPlan
    from distsgd_emulate.link_probe import LinkProbe

__all__ = [
    "Host",
    "Hosts",
    "LinkProbe",
    "NoHosts",
    "check_hosts",
    "host_plan",
    "probe_link",
    "start_hosts",
]

PACKAGE = "distsgd_emulate"
"""The emulators' package (``emulate/distsgd_emulate`` in a checkout)."""


class Host(Protocol):
    """One emulated host, as the launcher passes it around (``distsgd_emulate.hosts.Host``)."""

    @property
    def name(self) -> str:
        """``host0``, ``host1``, ..."""
        ...


class Hosts(Protocol):
    """A local run's emulated hosts as its collaborators need them: where each task runs and
    what address it binds, the command line that enters its host, the hosts' disks, their
    network faults and link samples (``distsgd_emulate.driver.HostsDriver``; without hosts
    :class:`NoHosts`: each answer is this machine's, or None: the caller's default)."""

    @property
    def emulated(self) -> bool:
        """Whether the run's tasks run on emulated hosts."""
        ...

    def arm(
        self, faults: Sequence[Fault], *, events: MetricsWriter, note: Callable[[str], None]
    ) -> None:
        """Take on the run's network faults (partitions and slow links), applied by
        :meth:`poll_faults`."""

    def start_sampling(self) -> None:
        """Start recording the hosts' bytes over time (``links.jsonl``)."""

    def poll_faults(self, step: int) -> None:
        """Apply the network faults due at ``step``, undo those that are over."""

    def control_host(self, engine: str | None) -> str | None:
        """Where tasks reach the launcher (else the engine's ``engine``)."""
        ...

    def machines(self, engine: int) -> int:
        """The machines the tasks run on (else the engine's ``engine``)."""
        ...

    def task_host(self, task: TaskId) -> str | None:
        """The address ``task`` binds on its host (None: no hosts)."""
        ...

    def host_of(self, name: str) -> Host | None:
        """The host task ``name`` (a server, worker or log replica) runs on."""
        ...

    def enter(self, name: str, host: Host | None = None) -> list[str]:
        """What runs task ``name``'s command line on its host (or ``host``)."""
        ...

    def lost(self, task: TaskId) -> Host:
        """``lose-host:``'s host: the one ``task`` runs on."""
        ...

    def wipe(self, host: Host) -> None:
        """``host`` lost its disk: everything its tasks kept there is gone."""

    def wipe_all(self) -> bool:
        """Wipe every host's disk (an earlier cluster's logs); False without hosts."""
        ...

    def disk_of(self, name: str) -> Path | None:
        """The folder task ``name`` keeps its files in on its host's disk (None: the run
        folder)."""
        ...

    def cut_off(self, task: TaskId) -> bool:
        """Whether ``task``'s host is cut off now (``partition:``)."""
        ...

    def replica_place(self) -> Place | None:
        """Where each server's log replica goes on the hosts (None: no hosts)."""
        ...

    def replica_holds(self, ps: int) -> bool:
        """Whether ps ``ps``'s replica holds a snapshot on its host's disk."""
        ...

    def link_delays(self, worker: int, servers: int) -> list[list[float]]:
        """Worker ``worker``'s ``TaskEnv.ps_link_delays``: per server, the [round trip,
        jitter] of the links between their hosts (none where no link gives a delay)."""
        ...

    def close(self, step: int) -> None:
        """Undo the network faults, stop sampling, record the bytes, take the hosts down
        (after the tasks have ended)."""

    def abandon(self) -> None:
        """Take the hosts down before the run started (its start failed)."""


class NoHosts:
    """The :class:`Hosts` of a run without emulated hosts: every task on this machine."""

    emulated = False

    def arm(
        self, faults: Sequence[Fault], *, events: MetricsWriter, note: Callable[[str], None]
    ) -> None:
        """No network fault: a partition is then the worker's own, simulated."""

    def start_sampling(self) -> None:
        """No link to sample."""

    def poll_faults(self, step: int) -> None:
        """No network fault to apply."""

    def control_host(self, engine: str | None) -> str | None:
        return engine

    def machines(self, engine: int) -> int:
        return engine

    def task_host(self, task: TaskId) -> str | None:
        return None

    def host_of(self, name: str) -> Host | None:
        return None

    def enter(self, name: str, host: Host | None = None) -> list[str]:
        return []

    def lost(self, task: TaskId) -> Host:
        raise AssertionError("the config refuses lose-host without --hosts")

    def wipe(self, host: Host) -> None:
        raise AssertionError("no emulated host to wipe")

    def wipe_all(self) -> bool:
        return False

    def disk_of(self, name: str) -> Path | None:
        return None

    def cut_off(self, task: TaskId) -> bool:
        return False

    def replica_place(self) -> Place | None:
        return None

    def replica_holds(self, ps: int) -> bool:
        raise AssertionError("no emulated host holds a replica")

    def link_delays(self, worker: int, servers: int) -> list[list[float]]:
        return []

    def close(self, step: int) -> None:
        """Nothing to take down."""

    def abandon(self) -> None:
        """Nothing to take down."""


def host_plan(config: LaunchConfig) -> HostPlan:
    """The emulated hosts of ``--hosts``, ``--link`` and ``--placement``
    (``distsgd_emulate.hosts.plan_hosts``); ValueError where there are none (``hosts`` 0). The
    one place that reads the config's hosts for the emulators."""
    hosting = config.hosting
    if not hosting.hosts:
        raise ValueError("this run has no emulated hosts; use --hosts N")
    with installed(PACKAGE, "emulated hosts"):
        from distsgd_emulate.hosts import parse_links, plan_hosts
    count, links = hosting.hosts, parse_links(hosting.links)
    return plan_hosts(count=count, tasks=config.tasks, policy=hosting.placement, links=links)


def check_hosts(config: LaunchConfig) -> None:
    """``--hosts N``'s plan made once, to check ``--link`` and ``--placement``, and that a
    ``--tls`` certificate names every server's host; ValueError (one line) where not."""
    from distsgd.transport.security import check_certificate_names

    plan = host_plan(config)
    tls = config.hosting.tls
    if tls is not None:  # a name missing would show only as servers that never start
        where = "the servers on the emulated hosts"
        check_certificate_names(tls, plan.server_addresses(), where=where)


def start_hosts(config: LaunchConfig, run_dir: Path) -> Hosts:
    """The run's emulated hosts, started (``distsgd_emulate.driver.HostsDriver``);
    :class:`NoHosts` without ``--hosts``. Call from the thread that will close them."""
    if not config.hosting.hosts:
        return NoHosts()
    plan = host_plan(config)
    from distsgd_emulate.driver import HostsDriver  # loaded: host_plan found the package

    return HostsDriver.start(plan, run_dir)


def probe_link(rate: str, nbytes: int, *, workers: int) -> LinkProbe:
    """A link of ``rate`` measured on emulated hosts (``distsgd_emulate.link_probe``);
    ValueError (one line) where they cannot be made here."""
    with installed(PACKAGE, "emulated hosts"):
        from distsgd_emulate.link_probe import probe_link as probe
    return probe(rate, nbytes, workers=workers)
