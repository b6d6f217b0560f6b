"""``--inject-fault``: the specs, parsed, and the faults a worker injects into itself.

Kills, and the network faults of emulated hosts (``--hosts``), are done by the launcher (it
owns the processes and the links); what a process must do to itself is :class:`FaultInjector`.
Spec forms::

    kill:worker:1@step=50               SIGKILL worker 1 once the run reaches global step 50
    delay:worker:2=200ms                every step of worker 2 takes 200 ms longer (compute)
    delay-data:worker:2=200ms           every batch worker 2 fetches takes 200 ms longer (a
                                        slow data loader: counted as its ``data`` phase)
    delay:ps:1=20ms                     ps 1 answers every pull and push 20 ms later (a slow
                                        server: counted in its ``busy`` load)
    partition:worker:1@step=40,for=10s  from global step 40, cut worker 1 off for 10 s
                                        (also written ``@step=40+10s``)
    partition:ps:0@step=40,for=10s      the same for a parameter server (--hosts only)
    slow:ps:0@step=40=10mbit            from global step 40, ps 0's host's link is shaped to
                                        10mbit to the end of the run (--hosts only)
    slow:worker:1@step=40=10mbit,for=10s  the same for 10 s, then its own link again
    lose-host:ps:0@step=40              at global step 40, ps 0's host is lost: every process
                                        on it is killed and its disk wiped (--hosts only; the
                                        tasks start again there, on an empty disk)

Without ``--hosts`` a partition of a worker is simulated by the worker itself (its pushes are
lost, its pulls wait); with it the launcher cuts the host's link, a real partition of every
task on that host. A slow link and a partition of a server need ``--hosts``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distsgd.cluster import Role, TaskId
from distsgd.cluster.rates import parse_rate
from distsgd.control.folder import LocalFiles, RunFiles
from distsgd.util.atomic import write_atomic

log = logging.getLogger(__name__)

KINDS = ("kill", "delay", "delay-data", "partition", "slow", "lose-host")
"""The kinds of fault ``--inject-fault`` knows."""
KILL_KINDS = ("kill", "lose-host")
"""The kinds the launcher lands at a step by killing processes (workers hold still for them)."""
NETWORK_KINDS = ("partition", "slow")
"""The kinds that act on a host's link under ``--hosts``."""
DELAY_KINDS = ("delay", "delay-data")
"""The kinds that slow a process down by a duration it sleeps (``=DURATION``)."""
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_SPEC = re.compile(
    r"^(?P<kind>[a-z]+(?:-[a-z]+)?):(?P<job>ps|worker):(?P<index>\d+)"
    r"(?:@step=(?P<step>\d+))?"
    r"(?:\+(?P<plus>[^,=]*)|,for=(?P<for1>[^,=]*))?"
    r"(?:=(?P<value>[^,=]*))?"
    r"(?:,for=(?P<for2>[^,=]*))?$"
)
_USAGE = (
    "use kill:worker:1@step=50, delay:worker:2=200ms, delay-data:worker:2=200ms, "
    "delay:ps:0=20ms, partition:worker:0@step=30,for=10s "
    "slow:ps:0@step=40=10mbit[,for=10s] or lose-host:ps:0@step=40"
)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One parsed ``--inject-fault`` spec."""

    kind: str
    """kill, delay, delay-data, partition, slow or lose-host (:data:`KINDS`)."""
    job: str
    """The target's job: ps or worker."""
    index: int
    """The target's index in its job."""
    step: int | None = None
    """The global step from which it applies; None: from the start (delay)."""
    seconds: float = 0.0
    """delay: added to each step (a server's: to each pull and push it answers); delay-data:
    to each batch fetched; partition: how long it lasts; slow: how long (0: to the end)."""
    rate_bits: int | None = None
    """slow: the rate the target's host's link is shaped to, bits/s; None for other kinds."""

    @property
    def task(self) -> str:
        return f"{self.job}{self.index}"

    @property
    def task_id(self) -> TaskId:
        """The task the fault is injected into."""
        return TaskId(job=Role(self.job), index=self.index)

    @property
    def kills(self) -> bool:
        """Whether the launcher lands it by killing (kill, lose-host) at its step."""
        return self.kind in KILL_KINDS

    @property
    def network(self) -> bool:
        """Whether it acts on a link (partition, slow) rather than on a process."""
        return self.kind in NETWORK_KINDS

    @classmethod
    def parse(cls, text: str) -> Fault:
        match = _SPEC.match(text.strip())
        if not match or match["kind"] not in KINDS:
            raise ValueError(f"bad --inject-fault {text!r}; {_USAGE}")
        if match["for1"] is not None and match["for2"] is not None:
            raise ValueError(f"bad --inject-fault {text!r}: give for= once; {_USAGE}")
        kind, step, value = match["kind"], match["step"], match["value"]
        length = next((match[g] for g in ("plus", "for1", "for2") if match[g] is not None), None)
        _check_shape(text, kind, has_step=step is not None, value=value, length=length)
        seconds = _seconds(text, value if kind in DELAY_KINDS else length)
        if kind in NETWORK_KINDS and length is not None and seconds <= 0:
            raise ValueError(f"bad --inject-fault {text!r}: for= must be above 0s; {_USAGE}")
        return cls(
            kind=kind,
            job=match["job"],
            index=int(match["index"]),
            step=None if step is None else int(step),
            seconds=seconds,
            rate_bits=_rate(text, value) if kind == "slow" else None,
        )


def _check_shape(
    text: str, kind: str, *, has_step: bool, value: str | None, length: str | None
) -> None:
    """Which parts each kind takes; ValueError naming the form where they do not fit."""
    bad = f"bad --inject-fault {text!r}"
    if kind in KILL_KINDS and (not has_step or value is not None or length is not None):
        raise ValueError(f"{bad}: {kind} needs @step=N only; {_USAGE}")
    if kind in DELAY_KINDS and (value is None or has_step or length is not None):
        raise ValueError(f"{bad}: {kind} needs =DURATION only; {_USAGE}")
    if kind == "delay-data" and text.split(":")[1] != Role.WORKER:
        raise ValueError(f"{bad}: only a worker's data loading can be delayed; {_USAGE}")
    if kind == "partition" and (not has_step or length is None or value is not None):
        raise ValueError(f"{bad}: partition needs @step=N,for=DURATION; {_USAGE}")
    if kind == "slow" and (not has_step or value is None):
        raise ValueError(f"{bad}: slow needs @step=N=RATE (optionally ,for=DURATION); {_USAGE}")


def _seconds(text: str, duration: str | None) -> float:
    match = _DURATION.match("0s" if duration is None else duration)
    if not match:
        raise ValueError(
            f"bad --inject-fault {text!r}: bad duration {duration!r}; write e.g. 200ms or 10s"
        )
    value = float(match.group(1))
    return value / 1000.0 if match.group(2) == "ms" else value


def _rate(text: str, value: str | None) -> int:
    try:
        return parse_rate(value or "")
    except ValueError:
        raise ValueError(
            f"bad --inject-fault {text!r}: bad rate {value!r}; write a number and a unit "
            "(bit, kbit, mbit, gbit) of at least 1kbit, e.g. slow:ps:0@step=40=10mbit"
        ) from None


KILL_PAUSE_SECONDS = 5.0
"""Longest a worker holds still at a kill's step for the launcher to land it (then it goes on:
the launcher's own reading of the step still lands it, later)."""
_KILL_POLL = 0.005
_KILL_POLL_REMOTE = 0.05


def mark_name(fault: Fault, kind: str) -> str:
    """The name in the run folder of a kill's step: ``due`` (a worker reached the step and
    holds still; it holds the global step it saw) or ``landed`` (the launcher killed)."""
    return f"faults/{fault.kind}-{fault.job}{fault.index}-at-{fault.step or 0}.{kind}"


def kill_marker(run_dir: str | Path, fault: Fault, kind: str) -> Path:
    """The file of :func:`mark_name` in ``run_dir``."""
    return Path(run_dir) / mark_name(fault, kind)


def kill_due(run_dir: str | Path, fault: Fault) -> int | None:
    """(Launcher) the global step a worker reached a kill's step at, or None (not yet)."""
    try:
        text = kill_marker(run_dir, fault, "due").read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else fault.step or 0


def clear_kill_marks(run_dir: str | Path) -> None:
    """(Launcher, as a run starts or resumes) forget the kills' steps of an earlier launch: a
    resumed run's kills are due again."""
    shutil.rmtree(Path(run_dir) / "faults", ignore_errors=True)


def kill_landed(run_dir: str | Path, fault: Fault) -> None:
    """(Launcher) the kill is done: workers holding still at its step go on."""
    path = kill_marker(run_dir, fault, "landed")
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_atomic(path, "landed\n")


class FaultInjector:
    """Applies this worker's delay and partition faults, step by step, and holds still at the
    step of a kill (the launcher's: ``kill`` faults of any task, given with a run folder) until
    the launcher has landed it, so that a kill lands at its step, not at the launcher's next
    reading of the metrics lines (every ``--log-every`` steps)."""

    def __init__(self, faults: Sequence[Fault], files: RunFiles | None = None) -> None:
        """``files``: the run folder the launcher reads the kills' marks in (no kills
        without one)."""
        self.faults = [f for f in faults if not f.kills]
        self.kills = [f for f in faults if f.kills] if files is not None else []
        self.files = files
        self.partition_until = 0.0
        self._done: set[int] = set()

    def before_fetch(self) -> None:
        """Before the loop fetches its next batch: a ``delay-data`` fault's sleep."""
        for fault in self.faults:
            if fault.kind == "delay-data":
                time.sleep(fault.seconds)

    def before_step(self, global_step: int) -> None:
        for kill in list(self.kills):
            if global_step >= (kill.step or 0):
                self.kills.remove(kill)
                self._hold_for(kill, global_step)
        for i, fault in enumerate(self.faults):
            if fault.kind == "delay":
                time.sleep(fault.seconds)
            elif (
                fault.kind == "partition"
                and i not in self._done
                and global_step >= (fault.step or 0)
            ):
                self._done.add(i)
                self.partition_until = time.monotonic() + fault.seconds
                log.warning(
                    "fault injected: partitioned from the parameter servers for %.1fs",
                    fault.seconds,
                )

    def _hold_for(self, kill: Fault, global_step: int) -> None:
        """Say the kill's step is here (unless it landed already: a restarted target) and hold
        still until it landed, at most :data:`KILL_PAUSE_SECONDS`."""
        assert self.files is not None  # kills are kept only with a run folder
        files = self.files
        landed, due = (mark_name(kill, kind) for kind in ("landed", "due"))
        try:
            if files.get(landed) is not None:
                return
            if files.get(due) is None:
                files.put(due, f"{global_step}\n".encode())
        except (OSError, RuntimeError) as exc:  # a full disk, a launcher that does not answer:
            # the launcher's reading of the step lands it
            log.warning("cannot mark the step of kill:%s: %s", kill.task, exc)
            return
        end = time.monotonic() + KILL_PAUSE_SECONDS
        poll = _KILL_POLL if isinstance(files, LocalFiles) else _KILL_POLL_REMOTE
        while time.monotonic() < end:
            with contextlib.suppress(OSError, RuntimeError):
                if files.get(landed) is not None:
                    return
            time.sleep(poll)

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self.partition_until

    def wait_partition(self) -> None:
        remaining = self.partition_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
