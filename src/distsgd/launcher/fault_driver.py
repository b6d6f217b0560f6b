"""A local run's injected kills (``--inject-fault kill:...`` and ``lose-host:...``), each at
its step (:class:`FaultDriver`); the network faults of emulated hosts are their driver's
(:class:`~distsgd.launcher.emulated.Hosts`). A collaborator of
:class:`~distsgd.launcher.run.LocalRun`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from distsgd.cluster import Role, TaskId
from distsgd.control.faults import Fault, clear_kill_marks, kill_due, kill_landed
from distsgd.launcher.emulated import Hosts
from distsgd.launcher.run_state import RunState
from distsgd.launcher.server_watch import ServerWatch


class FaultDriver:
    """Lands each injected kill of one local run when its step comes."""

    def __init__(
        self, state: RunState, watch: ServerWatch, hosts: Hosts, faults: Sequence[Fault]
    ) -> None:
        self.state = state
        self.watch = watch
        self.hosts = hosts
        self.kills_pending = [f for f in faults if f.kills]
        """The kills not landed yet (a kill's step may never come)."""
        clear_kill_marks(state.run_dir)  # a resumed run's kills are due again

    def poll(self) -> None:
        """Land each kill whose step has come (or that a worker holds still for)."""
        step = self.state.progress.step
        for fault in list(self.kills_pending):
            due = kill_due(self.state.run_dir, fault)  # a worker holds still at the step
            if due is not None or step >= (fault.step or 0):
                self.kills_pending.remove(fault)
                self._kill(fault, max(self.state.progress.step, due or 0))

    def never_injected(self) -> list[str]:
        """A warning for each kill the run ended before (it was set for a later step)."""
        return [
            f"distsgd: warning: --inject-fault kill:{fault.job}:{fault.index}@step="
            f"{fault.step} was never injected: the run ended at global step "
            f"{self.state.progress.step}; give an earlier step"
            for fault in self.kills_pending
        ]

    def _kill(self, fault: Fault, step: int) -> None:
        """SIGKILL the target of ``fault`` at global ``step``; the workers holding still at
        the step then go on."""
        try:
            self._kill_now(fault, step)
        finally:
            with contextlib.suppress(OSError):
                kill_landed(self.state.run_dir, fault)

    def _kill_now(self, fault: Fault, step: int) -> None:
        if fault.kind == "lose-host":
            self._lose_host(fault, step)
            return
        state = self.state
        task = state.supervisor.tasks.get(fault.task)
        if task is None or task.poll() is not None:
            return
        target = TaskId.parse(fault.task)
        if target.job == Role.PS:
            self.watch.read_version(target.index)
        state.console.note(
            f"[distsgd] fault injected: SIGKILL {fault.task} (pid {task.pid}) at step {step}"
        )
        state.events.log(step=step, event="fault_injected", fault="kill", target=fault.task)
        task.kill()

    def _lose_host(self, fault: Fault, step: int) -> None:
        """``lose-host:``: SIGKILL every task on the target's host, then wipe its disk. The
        versions of its servers are read first (what they had acknowledged at least)."""
        state = self.state
        host = self.hosts.lost(fault.task_id)
        victims = [t for t in state.supervisor.tasks.values() if self.hosts.host_of(t.name) is host]
        victims = [t for t in victims if t.poll() is None]
        for task in victims:
            if task.name.startswith("ps"):
                self.watch.read_version(TaskId.parse(task.name).index)
        names = ", ".join(t.name for t in victims) or "no task"
        state.console.note(f"[distsgd] fault injected: {host.name} lost at step {step} ({names})")
        state.events.log(
            step=step,
            event="fault_injected",
            fault="lose-host",
            target=fault.task,
            host=host.name,
            tasks=[t.name for t in victims],
        )
        for task in victims:
            task.kill()
        deadline = time.monotonic() + 10.0
        while any(t.poll() is None for t in victims) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.hosts.wipe(host)
