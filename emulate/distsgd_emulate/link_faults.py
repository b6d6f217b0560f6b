"""Network faults of a run on emulated hosts (``--hosts``): ``--inject-fault
partition:JOB:I@step=N,for=D`` cuts the target's host off the switch, ``slow:JOB:I@step=N=RATE``
shapes its link to RATE (to the end of the run, or for ``,for=D``). The launcher applies each
once the run reaches its step (as it does a kill), undoes it after ``for=``, and undoes whatever
is still in effect when the run ends, whatever the end. A host holds every task placed on it:
cutting a worker's host cuts off every task there (the placement is in ``hosts.json``).

Each change is a ``metrics.jsonl`` line of the launcher (``fault_injected``, then
``fault_healed``, so in TensorBoard too) and a note on the console; ``hosts.json`` lists the
faults with when they were applied and undone (:meth:`LinkFaults.records`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distsgd.control.faults import Fault
from distsgd.control.metrics import MetricsWriter
from distsgd.launcher.errors import RunFailed
from distsgd_emulate.emulation import record_faults
from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_keeper import NetnsError

__all__ = ["AppliedLinkFault", "LinkFaults"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AppliedLinkFault:
    """One network fault as it was applied to an emulated host."""

    kind: str
    """partition or slow."""
    target: str
    """The task named in the spec (``worker1``)."""
    host: str
    """The host it acted on (the target's)."""
    tasks: tuple[str, ...]
    """Every task on that host (all of them were cut off, or slowed)."""
    rate_bits: int | None
    """slow: the rate the link was shaped to, bits/s; None for a partition."""
    seconds: float
    """How long it was to last (``for=``); 0: to the end of the run."""
    step: int
    """The global step the run had reached when it was applied."""
    applied_at: float
    """When it was applied (Unix time, as ``metrics.jsonl``'s ``time``)."""
    healed_at: float | None = None
    """When it was undone (Unix time); None while in effect."""
    healed_step: int | None = None
    """The global step the run had reached when it was undone."""

    def to_dict(self) -> dict[str, Any]:
        """As written to ``hosts.json``."""
        lasted = None if self.healed_at is None else round(self.healed_at - self.applied_at, 3)
        return {
            "kind": self.kind,
            "target": self.target,
            "host": self.host,
            "tasks": list(self.tasks),
            "rate_bits": self.rate_bits,
            "for_s": self.seconds or None,
            "step": self.step,
            "applied_at": round(self.applied_at, 3),
            "healed_at": None if self.healed_at is None else round(self.healed_at, 3),
            "healed_step": self.healed_step,
            "lasted_s": lasted,
        }


class LinkFaults:
    """The run's partition and slow faults: applied at their step, undone after ``for=``.

    Without emulated hosts there are none (a partition is then the worker's own, simulated,
    and the settings refuse ``slow:`` and a server's partition)."""

    def __init__(
        self,
        faults: Sequence[Fault],
        hosts: EmulatedHosts | None,
        *,
        events: MetricsWriter,
        note: Callable[[str], None],
        run_dir: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.hosts = hosts
        self.pending = [f for f in faults if f.network] if hosts is not None else []
        """Faults whose step has not come yet."""
        self.applied: list[AppliedLinkFault] = []
        """Faults applied, in the order they were; healed ones have ``healed_at``."""
        self._events, self._note, self._run_dir, self._clock = events, note, run_dir, clock

    def records(self) -> list[dict[str, Any]]:
        """The faults applied so far, as ``hosts.json`` lists them."""
        return [fault.to_dict() for fault in self.applied]

    def poll(self, step: int) -> None:
        """Apply the faults due at ``step``, undo those whose ``for=`` is over; RunFailed
        where a link cannot be changed (the run's ``finally`` then undoes what it can)."""
        if self.hosts is None:
            return
        now = self._clock()
        changed = False
        try:
            for i, fault in enumerate(self.applied):
                due = fault.seconds and now >= fault.applied_at + fault.seconds
                if fault.healed_at is None and due:
                    self.applied[i] = self._undo(fault, step)
                    changed = True
            for pending in list(self.pending):
                if step >= (pending.step or 0):
                    self.pending.remove(pending)
                    self.applied.append(self._apply(pending, step))
                    changed = True
        except NetnsError as e:
            raise RunFailed(f"a network fault could not be applied or undone: {e}") from e
        finally:
            if changed:
                self._record()

    def restore(self, step: int) -> list[dict[str, Any]]:
        """Undo every fault still in effect (the run's end; failures are logged, not raised);
        :meth:`records` then."""
        if self.hosts is None:
            return []
        self.pending = []
        changed = False
        for i, fault in enumerate(self.applied):
            if fault.healed_at is None:
                try:
                    self.applied[i] = self._undo(fault, step, note=False)
                    changed = True
                except (NetnsError, ValueError) as e:  # the hosts go down next anyway
                    log.warning("could not undo %s of %s: %s", fault.kind, fault.host, e)
        if changed:
            self._record()
        return self.records()

    def _apply(self, fault: Fault, step: int) -> AppliedLinkFault:
        hosts = self.hosts
        assert hosts is not None
        host = hosts.plan.host_of(fault.task_id)
        if fault.kind == "partition":
            hosts.cut(host)
            what = f"{host.name} cut off"
        else:
            assert fault.rate_bits is not None
            hosts.set_rate(host, fault.rate_bits)
            what = f"{host.name}'s link slowed to {fault.rate_bits / 1e6:g} Mbit/s"
        applied = AppliedLinkFault(
            kind=fault.kind,
            target=fault.task,
            host=host.name,
            tasks=tuple(task.name for task in host.tasks),
            rate_bits=fault.rate_bits,
            seconds=fault.seconds,
            step=step,
            applied_at=self._clock(),
        )
        lasting = f"for {fault.seconds:g}s" if fault.seconds else "to the end of the run"
        self._note(
            f"[distsgd] fault injected: {what} ({', '.join(applied.tasks)}) {lasting} "
            f"at step {step}"
        )
        self._events.log(
            step=step,
            event="fault_injected",
            fault=fault.kind,
            target=fault.task,
            host=host.name,
            tasks=list(applied.tasks),
            rate_bits=fault.rate_bits,
            seconds=fault.seconds,
        )
        return applied

    def _undo(self, fault: AppliedLinkFault, step: int, *, note: bool = True) -> AppliedLinkFault:
        """Heal a cut, or put the host's own link back; with ``note`` say so on the console
        (not at the run's end: the result is the console's last line)."""
        hosts = self.hosts
        assert hosts is not None
        if fault.kind == "partition":
            hosts.heal(fault.host)
        else:
            hosts.set_rate(fault.host, None)
        healed = replace(fault, healed_at=self._clock(), healed_step=step)
        lasted = healed.to_dict()["lasted_s"]
        if note:
            self._note(
                f"[distsgd] fault healed: {fault.kind} of {fault.host} ended after {lasted:g}s, "
                f"at step {step}"
            )
        log.info("undid %s of %s after %ss at step %d", fault.kind, fault.host, lasted, step)
        self._events.log(
            step=step,
            event="fault_healed",
            fault=fault.kind,
            target=fault.target,
            host=fault.host,
            lasted_s=lasted,
        )
        return healed

    def _record(self) -> None:
        hosts = self.hosts
        assert hosts is not None
        try:
            record_faults(self._run_dir, hosts, self.records())
        except OSError as e:
            log.warning("could not record the link faults in hosts.json: %s", e)
