"""The launcher's side of ``distsgd doctor``: its own probe (its stacks and the tasks it holds),
and the doctor run by itself when the run makes no progress (:class:`StallWatch`); a
collaborator of :class:`~distsgd.launcher.run.LocalRun`.

The watch reads only what the launcher's loop already has (the global step of
``metrics.jsonl``): nothing is asked of the tasks until the step has stood still for
``--doctor-after`` seconds (from the first step on: a run still starting is the start-up
wait's to judge). Then the doctor asks every task once, on a thread of its own so the loop
never waits on it, prints its few lines, writes its report and logs a ``doctor`` event; it
asks again only after the run has moved.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from distsgd.launcher.doctor import examine
from distsgd.launcher.run_state import RunState
from distsgd.util.probe import FOLDER, start_probe

log = logging.getLogger(__name__)


class StallWatch:
    """The launcher's probe, and the doctor after ``state.config.durability.doctor_after``
    seconds without progress (0: never by itself)."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.after = state.config.durability.doctor_after
        self.probe = start_probe("launcher", state.run_dir / FOLDER)
        if self.probe is not None:
            self.probe.add("launcher", self._state)
        self._step = 0
        self._moved = time.monotonic()
        self._asked_at: int | None = None  # the step the doctor last ran at
        self._thread: threading.Thread | None = None

    def _state(self) -> dict[str, Any]:
        """What ``distsgd doctor`` reads of the launcher: its tasks and the run's step."""
        tasks = {}
        for name, task in list(self.state.supervisor.tasks.items()):
            code = task.poll()
            tasks[name] = {"pid": task.pid, "exit": code}
        return {
            "step": self.state.progress.step,
            "since_progress_s": round(time.monotonic() - self._moved, 3),
            "tasks": tasks,
        }

    def poll(self) -> None:
        """From the launcher's loop: the step, and the doctor once it stood still too long."""
        step = self.state.progress.step
        now = time.monotonic()
        if step != self._step:
            self._step, self._moved = step, now
            return
        if not self.after or step == 0 or now - self._moved < self.after:
            return
        if self._asked_at == step or (self._thread is not None and self._thread.is_alive()):
            return
        self._asked_at = step
        self._thread = threading.Thread(
            target=self._examine, args=(step, now - self._moved), name="doctor", daemon=True
        )
        self._thread.start()

    def _examine(self, step: int, stood: float) -> None:
        state = self.state
        try:
            found = examine(state.run_dir, stall_s=min(self.after, stood))
        except (OSError, ValueError) as exc:
            log.warning("the doctor could not examine the run: %s", exc)
            return
        state.console.note(f"[distsgd] no progress for {stood:.0f}s at step {step}; the doctor:")
        for line in found.diagnosis.lines():
            state.console.note(f"[distsgd]   {line}")
        if found.report_path is not None:
            state.console.note(f"[distsgd]   full report: {found.report_path}")
        diagnosis = found.diagnosis
        state.events.log(
            step=step,
            event="doctor",
            culprit=diagnosis.culprit,
            cause=diagnosis.cause,
            frame=diagnosis.frame,
            report=str(found.report_path or ""),
        )

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self.probe is not None:
            self.probe.close()
