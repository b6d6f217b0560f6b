"""Faults a worker injects into itself (``--inject-fault``): delays and network partitions.

Kills are done by the launcher (it owns the processes); what a process must do to itself is
here. Spec forms handled in the worker::

    delay:worker:2=200ms            every step of worker 2 takes 200 ms longer
    partition:worker:0@step=30+10s  from global step 30, worker 0 cannot reach the parameter
                                    servers for 10 s: its pushes are lost, its pulls wait
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from distsgd.cluster import Role, TaskId

log = logging.getLogger(__name__)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")
_SPEC = re.compile(
    r"^(?P<kind>kill|delay|partition):(?P<job>ps|worker):(?P<index>\d+)"
    r"(?:@step=(?P<step>\d+))?(?:\+(?P<duration>[\d.]+(?:ms|s)))?(?:=(?P<value>[\d.]+(?:ms|s)))?$"
)


def parse_duration(text: str) -> float:
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"bad duration {text!r}; write e.g. 200ms or 10s")
    value = float(match.group(1))
    return value / 1000.0 if match.group(2) == "ms" else value


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One parsed ``--inject-fault`` spec."""

    kind: str
    job: str
    index: int
    step: int | None = None
    seconds: float = 0.0

    @property
    def task(self) -> str:
        return f"{self.job}{self.index}"

    @property
    def task_id(self) -> TaskId:
        """The task the fault is injected into."""
        return TaskId(job=Role(self.job), index=self.index)

    @classmethod
    def parse(cls, text: str) -> Fault:
        match = _SPEC.match(text.strip())
        usage = "use kill:worker:1@step=50, delay:worker:2=200ms or partition:worker:0@step=30+10s"
        if not match:
            raise ValueError(f"bad --inject-fault {text!r}; {usage}")
        kind, step = match["kind"], match["step"]
        fault = cls(
            kind=kind,
            job=match["job"],
            index=int(match["index"]),
            step=None if step is None else int(step),
            seconds=parse_duration(match["value"] or match["duration"] or "0s"),
        )
        if kind == "kill" and (fault.step is None or match["value"] or match["duration"]):
            raise ValueError(f"bad --inject-fault {text!r}: kill needs @step=N only; {usage}")
        if kind == "delay" and (not match["value"] or fault.step is not None):
            raise ValueError(f"bad --inject-fault {text!r}: delay needs =DURATION only; {usage}")
        if kind == "partition" and (fault.step is None or not match["duration"]):
            raise ValueError(
                f"bad --inject-fault {text!r}: partition needs @step=N+DURATION; {usage}"
            )
        if kind != "kill" and fault.job != Role.WORKER:
            raise ValueError(
                f"bad --inject-fault {text!r}: only workers can be delayed or partitioned"
            )
        return fault


class FaultInjector:
    """Applies this worker's delay and partition faults, step by step."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = list(faults)
        self.partition_until = 0.0
        self._done: set[int] = set()

    def before_step(self, global_step: int) -> None:
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

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self.partition_until

    def wait_partition(self) -> None:
        remaining = self.partition_until - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
