"""An elastic local run's changes of size (:class:`Scaler`): it acts on
``distsgd elastic scale``'s requests (:mod:`distsgd.launcher.scale`), starting workers or asking
some to leave, and ends those that do not leave in time; a collaborator of
:class:`~distsgd.launcher.run.LocalRun`."""

from __future__ import annotations

import time

from distsgd.control.recovery import restart_all
from distsgd.launcher.restart import PlanExecutor, RunStore
from distsgd.launcher.run_state import RunState
from distsgd.launcher.scale import read_scale_request
from distsgd.launcher.tasks import TaskStarter, write_tasks

LEAVE_GRACE_SECONDS = 30.0
"""How long a worker asked to leave (distsgd elastic scale) may take before it is SIGKILLed."""


class Scaler:
    """Resizes one elastic local run."""

    def __init__(
        self, state: RunState, starter: TaskStarter, executor: PlanExecutor, store: RunStore
    ) -> None:
        self.state = state
        self.starter = starter
        self.executor = executor
        self.store = store
        self.leaving: dict[str, float] = {}
        """Workers asked to leave (SIGTERM), by name: when they are SIGKILLed if still there."""
        self.scale_seen = 0
        """The ``seq`` of the last scale request handled."""

    def poll(self) -> None:
        """Act on a new request of ``distsgd elastic scale`` (``scale.json`` in the run folder)."""
        state = self.state
        request = read_scale_request(state.run_dir)
        if request is None or request.seq == self.scale_seen:
            return
        self.scale_seen = request.seq
        low, high = state.config.size.lowest_workers, state.config.size.highest_workers
        if not low <= request.workers <= high:
            state.console.note(
                f"[distsgd] scale to {request.workers} workers refused: this run was started "
                f"with --min-workers {low} --max-workers {high}"
            )
            state.events.log(
                step=state.progress.step, event="scale_refused", workers=request.workers
            )
            return
        before = len(state.active)
        if state.config.collective:
            self._scale_collective(request.workers)
        else:
            self._scale_ps(request.workers)
        state.console.note(f"[distsgd] scaled from {before} to {len(state.active)} workers")
        state.events.log(
            step=state.progress.step,
            event="scale",
            seq=request.seq,
            workers_before=before,
            workers=len(state.active),
        )
        write_tasks(state.run_dir, state.supervisor)

    def _scale_ps(self, workers: int) -> None:
        """Start workers at the lowest free indexes, or ask the highest ones (never the chief)
        to leave: each finishes its step, hands its work units back and leaves the servers."""
        active = self.state.active
        while len(active) < workers:
            index = min(
                i
                for i in range(self.state.config.size.highest_workers)
                if i not in active and f"worker{i}" not in self.leaving
            )
            active.add(index)
            self.starter.start_worker(index, resume=None)
        for index in sorted(active, reverse=True)[: max(0, len(active) - workers)]:
            if index == 0:
                break
            name = f"worker{index}"
            active.discard(index)
            task = self.state.supervisor.tasks.get(name)
            if task is None or task.poll() is not None:
                continue
            self.leaving[name] = time.monotonic() + LEAVE_GRACE_SECONDS
            task.terminate()

    def _scale_collective(self, workers: int) -> None:
        """A collective run changes size by a whole restart from its last checkpoint (see
        docs/elastic.md): a process group has a fixed size."""
        state = self.state
        state.active = set(range(workers))
        why = f"the run changes size to {workers} workers"
        furthest = max(state.progress.local_steps.values(), default=0)
        plan = restart_all(self.store, why, furthest=furthest)
        self.executor.restart_all("launcher", 0, state.progress.step, plan)

    def reap_leaving(self) -> None:
        """SIGKILL a worker asked to leave that is still there after its grace period."""
        now = time.monotonic()
        for name, deadline in list(self.leaving.items()):
            task = self.state.supervisor.tasks.get(name)
            if task is not None and task.poll() is None and now > deadline:
                self.state.console.note(
                    f"[distsgd] {name} did not leave within {LEAVE_GRACE_SECONDS:.0f}s; killing it"
                )
                task.kill()
                self.leaving[name] = now + LEAVE_GRACE_SECONDS  # noted once per grace period
