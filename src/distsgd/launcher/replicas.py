"""The replicas of the servers' write-ahead logs on other machines (:mod:`distsgd.ps.replica`).

With the log on (``--wal on``, the default) and two or more machines (``--hosts``, or the nodes
of a Ray cluster), the launcher starts, for each parameter server ``psI``, a task ``replicaI``
(``distsgd server --job replica``) on another machine than its server's: on emulated hosts the
next host in the plan's order; on Ray a node other than the one its server's bundle holds (the
engine places it). ``psI`` is started with ``--replica`` at the replica's address. The replica
keeps its files in ``RUN_DIR/wal/replicaI`` as its machine sees it (its own disk). A replica
starts before its server, which needs its address.

A replica that dies (its host lost, say) is started again, empty: on an emulated host at the
same address on the same host; on Ray on a node alive now, at a new address it reports to the
run control, where its server looks it up before it connects again. Its server's log goes down
meanwhile (pushes wait) and the server's ticker seeds it again with a new generation's snapshot
once it answers. Replicas are not in the restart planner's view (it plans servers and workers):
they hold nothing a restart would need that their server does not also hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from distsgd.launcher.supervisor import TaskHandle

if TYPE_CHECKING:
    from distsgd.launcher.emulated import Host

PREFIX = "replica"
"""Every replica task's name starts with it (``replica0``)."""

StartTask = Callable[[str, list[str], "Host | None"], TaskHandle]
"""How a task is started on a host: (name, argv, emulated host or None) -> its handle."""
Place = Callable[[int], "tuple[str, Host | None] | None"]
"""Where ps I's replica goes: (the host its address names, its emulated host or None where the
engine places it), or None: no replica (one machine)."""
WaitAddress = Callable[[TaskHandle, Path], str]
"""How the address a task reports is awaited: (task, its address file) -> the address."""


def is_replica(name: str) -> bool:
    """Whether task ``name`` is a log replica."""
    return name.startswith(PREFIX)


@dataclass
class Replicas:
    """The log replicas of one run, and how they are (re)started."""

    place: Place
    run_dir: Path
    run_id: str
    python: list[str]
    """The interpreter's argv (``[sys.executable, "-m", "distsgd"]``)."""
    start_task: StartTask
    wait_address: WaitAddress
    holds: Callable[[int], bool] | None
    """Whether ps I's replica holds a snapshot, as the launcher can see its disk (None: it
    cannot; a replica that is up is taken to hold one: its server seeds it at once)."""
    note: Callable[[str], None]
    event: Callable[..., None]
    control: str = ""
    """The run control the replicas report their addresses to ("": address files)."""

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
        report = ("--control", self.control)
        if not self.control:
            report = ("--address-file", str(self._address_file(ps)))
        return [
            *self.python,
            *("server", "--job", "replica", "--task", str(ps), "--run-id", self.run_id),
            *("--address", address, *report, "--wal-dir", str(self.folder(ps))),
        ]

    def spawn(self, ps: int) -> TaskHandle | None:
        """Start ps ``ps``'s replica (at its earlier address on an emulated host, if it had
        one); None on one machine."""
        where = self.place(ps)
        if where is None:
            return None
        bind, host = where
        address = self.addresses.get(ps, f"{bind}:0") if host is not None else f"{bind}:0"
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
        if ps not in self.addresses:
            return False
        if self.holds is not None:
            return self.holds(ps)
        task = self.tasks.get(ps)
        return task is not None and task.poll() is None

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
                self.addresses[ps] = self.wait_address(new, self._address_file(ps))
                self.event(
                    step=step,
                    event="replica_up",
                    target=new.name,
                    seconds=round(time.monotonic() - started, 3),
                )

    def summary(self) -> Mapping[str, object]:
        """``result.json``'s ``replicas``."""
        return {"replicas": dict(sorted(self.addresses.items())), "restarts": self.restarts}
