"""What the local launcher does when a task dies: it asks the restart planner
(:func:`distsgd.control.recovery.plan_restart`) and carries out its plan (:class:`PlanExecutor`),
with the checkpoint store as the planner sees it (:class:`RunStore`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from distsgd.cluster import Role, TaskId
from distsgd.control.checkpoint.errors import CheckpointError, IncompleteCheckpoint
from distsgd.control.checkpoint.store import (
    Checkpoint,
    DiskStore,
    ShardRef,
    WorkerStateRef,
    complete_checkpoints,
    latest_checkpoint,
    set_aside,
)
from distsgd.control.errors import SetupErrorRecord
from distsgd.control.folder import RESULT_FILE
from distsgd.control.outcome import RunStatus
from distsgd.control.recovery import (
    Drop,
    Finished,
    Restart,
    RestartAll,
    RestartBudget,
    RestartPlan,
    Stop,
    TaskFailure,
    failure_kind,
    plan_restart,
    restart_all,
)
from distsgd.control.rollback import RollBack, plan_rollback
from distsgd.launcher.emulated import Hosts
from distsgd.launcher.errors import Interrupted, RunDiverged, RunFailed
from distsgd.launcher.replicas import Replicas
from distsgd.launcher.run_state import RunState
from distsgd.launcher.server_watch import ServerWatch
from distsgd.launcher.supervisor import TaskHandle
from distsgd.launcher.tasks import TaskStarter, write_tasks
from distsgd.util import write_atomic


class RunStore:
    """A local run's checkpoints and logs as the planner sees them
    (:class:`~distsgd.control.recovery.StoreView`)."""

    def __init__(self, state: RunState, hosts: Hosts, replicas: Replicas | None) -> None:
        self.state = state
        self.hosts = hosts
        self.replicas = replicas

    def _disk(self) -> DiskStore:
        state = self.state
        return DiskStore(state.ckpt_root, state.wal_root if state.config.durability.wal else None)

    def latest(self) -> Checkpoint | None:
        note = self.state.console.note
        checkpoint, problems = latest_checkpoint(self.state.ckpt_root)
        pending = [p for p in problems if isinstance(p, IncompleteCheckpoint)]
        for problem in problems:
            if not isinstance(problem, IncompleteCheckpoint):
                note(f"[distsgd] unusable checkpoint: {problem}")
        if pending:
            note(
                f"[distsgd] skipping {len(pending)} newer checkpoint(s) without a manifest "
                "(still being completed, or interrupted)"
            )
        if checkpoint is not None and len(problems) > len(pending):
            note(f"[distsgd] using the previous complete checkpoint {checkpoint.path.name}")
        return checkpoint

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        return self._disk().newest_worker(index)

    def newest_shard(self, index: int) -> ShardRef | None:
        return self._disk().newest_shard(index)

    def has_wal(self, index: int) -> bool:
        """Whether ps ``index`` can come back from its log: its replica's copy, or its own
        folder (on its host's disk under ``--hosts``)."""
        wal = self.state.config.durability.wal
        if self.replicas is not None and self.replicas.holds_state(index):
            return wal
        disk = self.hosts.disk_of(f"ps{index}")
        if disk is None:
            return self._disk().has_wal(index)
        return wal and DiskStore(self.state.ckpt_root, disk).has_wal(index)


class PlanExecutor:
    """A local run's restarts, drops, stops and rollbacks, as the planner decides them."""

    def __init__(
        self, state: RunState, starter: TaskStarter, watch: ServerWatch, store: RunStore
    ) -> None:
        self.state = state
        self.starter = starter
        self.watch = watch
        self.store = store
        self.after_training: dict[str, str] = {}
        """Workers whose script failed after their training finished, with its error (the
        run fails with it once the other workers are done)."""

    # -- a failure ------------------------------------------------------------------------------
    def handle_failure(self, task: TaskHandle, code: int) -> None:
        state = self.state
        steps = state.progress.local_steps
        failure = TaskFailure(
            task=TaskId.parse(task.name),
            exit_code=code,
            kind=failure_kind(code),
            reached=steps.get(task.name, 0),
            furthest=max(steps.values(), default=0),
        )
        budget = RestartBudget(
            used=state.restarts.get(task.name, 0),
            max_restarts=state.config.durability.max_restarts,
            ran_seconds=time.monotonic() - state.started_at.get(task.name, 0.0),
            healthy_seconds=state.config.durability.healthy_seconds,
        )
        try:
            recorded = (state.run_dir / RESULT_FILE).exists()  # training is over: no restarts
            run = dataclasses.replace(state.topology(), result_recorded=recorded)
            plan = plan_restart(failure, run, self.store, budget)
            state.restarts[task.name] = budget.in_a_row  # 0 once it ran healthy: a new fault
            self.execute(plan, task, code)
        except CheckpointError as exc:  # e.g. a checkpoint file that holds code
            raise RunFailed(f"{task.name} cannot be restarted: {exc}") from None

    def execute(self, plan: RestartPlan, task: TaskHandle, code: int) -> None:
        """Carry out ``plan`` for ``task``, which exited with ``code``."""
        state = self.state
        step = state.progress.step
        if isinstance(plan, Stop):
            self._stop(plan, task, code, step)
        elif isinstance(plan, Finished):
            self._finished(plan, task.name, code, step)
        elif isinstance(plan, Drop):
            self._drop(plan, task.name, code, step)
        else:
            state.restarts[task.name] = plan.attempt
            state.console.note(
                f"[distsgd] {task.name} died (exit code {code}); restart {plan.attempt} of "
                f"{state.config.durability.max_restarts} in {plan.backoff:.1f}s"
            )
            if state.stop.wait(plan.backoff):
                raise Interrupted
            if isinstance(plan, RestartAll):
                self.restart_all(task.name, code, step, plan)
            elif plan.task.job == Role.PS:
                self._restart_ps(plan, code, step)
            else:
                self._restart_worker(plan, code, step)
            write_tasks(state.run_dir, state.supervisor)

    def _stop(self, plan: Stop, task: TaskHandle, code: int, step: int) -> None:
        state = self.state
        if plan.reason == "diverged":
            self._diverged(task, code, step)
            return
        self._fault(task.name, code, step, "stop")
        said = SetupErrorRecord.load(state.run_dir, TaskId.parse(task.name))
        if plan.reason == "setup_error":
            cause = said.message if said is not None else "see its log"
            raise RunFailed(f"{task.name}: {cause}", status=RunStatus.SETUP_ERROR)
        tail = "\n".join(f"    {line}" for line in task.tail)
        how = (
            ""
            if state.config.durability.max_restarts == 0
            else f" and has used its {plan.used} restarts"
        )
        resume = f"\nresume with: distsgd run --resume {state.run_dir}" if plan.resumable else ""
        head = f"task {task.name} failed (exit code {code}){how}"
        error = f": {said.message}" if said is not None and said.kind == "crash" else ""
        raise RunFailed(
            f"{head}{error}; its last log lines:\n{tail}\nfull logs: {state.run_dir / 'logs'}"
            f"{resume}",
            reason=head + error,  # the script's error in one line, not its log's last line
            log_tail=() if error else tuple(task.tail),
        )

    def _diverged(self, task: TaskHandle, code: int, step: int) -> None:
        """A worker stopped on a non-finite loss: a rollback where one is left, else the run
        ends diverged (its record in ``result.json``)."""
        state = self.state
        progress = state.progress
        progress.poll()
        reason = progress.divergence or f"{task.name} stopped on a non-finite loss"
        rollback = plan_rollback(
            why=reason,
            good_until=progress.good_until,
            furthest=max(progress.local_steps.values(), default=0),
            checkpoints=complete_checkpoints(state.ckpt_root),
            done=len(state.rollbacks),
            max_rollbacks=state.config.durability.max_rollbacks,
            lr_cut=float(state.config.overrides.get("lr_cut", 1.0)),
        )
        if rollback is not None:
            self._roll_back(rollback, task.name, code, step)
            return
        self._fault(task.name, code, step, "stop", diverged=True)
        record = {"scheme": state.config.scheme, "diverged": True, "divergence": reason}
        if state.rollbacks:
            record["rollbacks"] = list(state.rollbacks)
        write_atomic(state.run_dir / RESULT_FILE, json.dumps(record, indent=2) + "\n")
        raise RunDiverged(reason)

    def _finished(self, plan: Finished, name: str, code: int, step: int) -> None:
        """Its training was over: done, not restarted. A script's error after training fails
        the run at its end (:meth:`script_failed`); the chief's record stays as it is."""
        self._fault(name, code, step, "none", after_training=plan.after_training)
        self.mark_done(name)
        if plan.after_training:
            said = SetupErrorRecord.load(self.state.run_dir, plan.task)
            self.after_training[name] = said.message if said is not None else "see its log"
        else:
            self.state.console.note(
                f"[distsgd] {name} ended (exit code {code}) after the run's result was "
                "recorded; not restarted"
            )

    def mark_done(self, name: str) -> None:
        """``name`` has ended its part of the run; a worker's restored servers are told it
        left (it may have left a process that died since)."""
        state = self.state
        state.done.add(name)
        finished = TaskId.parse(name)
        if finished.job != Role.WORKER:
            return
        for index in sorted(state.restored_ps):
            server = state.supervisor.tasks.get(f"ps{index}")
            if server is not None and server.poll() is None:  # else: told on restart
                self.watch.tell_finished(index, [finished.index])

    def script_failed(self, result: Mapping[str, Any]) -> RunFailed | None:
        """The run's failure when a worker's script failed after its training finished (the
        first such worker's error, in one line, with where the chief's ``result`` is and its
        verdict); None when none did."""
        if not self.after_training:
            return None
        name = min(self.after_training, key=lambda n: TaskId.parse(n).index)
        verdict = f" (diverged: {result.get('divergence')})" if result.get("diverged") else ""
        kept = f"; the run's result stands in {self.state.run_dir / RESULT_FILE}{verdict}"
        return RunFailed(f"{name}: {self.after_training[name]}{kept}")

    def _drop(self, plan: Drop, name: str, code: int, step: int) -> None:
        state = self.state
        self._fault(name, code, step, "drop", workers=plan.workers)
        index = plan.task.index
        state.active.discard(index)
        state.done.add(name)
        for shard in range(state.config.num_ps):  # it cannot leave itself: its work goes back now
            self.watch.tell_finished(shard, [index])
        state.console.note(
            f"[distsgd] {name} failed (exit code {code}) with no restarts left; the "
            f"run goes on with {len(state.active)} workers (--min-workers "
            f"{state.config.size.lowest_workers})"
        )

    def _fault(self, target: str, code: int, step: int, action: str, **cost: Any) -> None:
        """One ``metrics.jsonl`` record per fault: which task, when, what was done, what it cost."""
        self.state.events.log(
            step=step, event="fault", target=target, exit_code=code, action=action, **cost
        )

    # -- restarts -------------------------------------------------------------------------------
    def _restart_worker(self, plan: Restart, code: int, step: int) -> None:
        # Its last metrics line says how far it got at least; the servers say exactly (the
        # steps whose pushes every shard applied), and the restarted worker continues there.
        resume = plan.resume
        assert resume is None or isinstance(resume, WorkerStateRef)
        continued = max(plan.continue_at, 0 if resume is None else resume.step)
        self._fault(
            plan.task.name,
            code,
            step,
            "restart",
            resumed_from=None if resume is None else str(resume.path),
            continued_at=max(continued, self.watch.steps_applied(plan.task.index)),
            lost_steps=0,
        )
        path = None if resume is None else resume.path
        self.starter.start_worker(plan.task.index, resume=path, continue_at=plan.continue_at)

    def _restart_ps(self, plan: Restart, code: int, step: int) -> None:
        """Restart a ps from its write-ahead log or its newest shard file (the server takes the
        newer); the whole cluster when it cannot come back. The fault record compares the
        version it comes back at with the one last read from the dead server."""
        state, watch = self.state, self.watch
        index, shard = plan.task.index, plan.resume
        assert shard is None or isinstance(shard, ShardRef)
        seen = watch.seen_versions.pop(index, None)  # the dead server's, read before it died
        address = before = self.starter.ps_address(index)
        node = state.supervisor.node_host
        if node is not None:  # it may land on another node: same port
            address = f"{node}:{address.rpartition(':')[2]}"
        try:
            restore = None if shard is None else shard.path
            self.starter.start_ps(index, address=address, restore=restore)
        except RunFailed as exc:  # e.g. its old port was taken meanwhile, or an unreadable log
            why = f"ps{index} could not come back: {exc}"
            furthest = max(state.progress.local_steps.values(), default=0)
            plan_all = restart_all(self.store, why, furthest=furthest)
            self.restart_all(f"ps{index}", code, step, plan_all)
            return
        filed = -1 if shard is None else shard.version
        info = watch.read_version(index)
        restored = filed if info is None else int(info.restored_version)
        lost = (step if seen is None else seen) - restored
        source = "wal" if shard is None or restored > filed else shard.path.parent.name
        self._fault(
            f"ps{index}",
            code,
            step,
            "restart",
            resumed_from=source,
            restored_version=restored,
            seen_version=seen,
            lost_updates=max(0, lost),
        )
        watch.durability.lost_updates(index, lost)
        watch.seen_versions[index] = restored
        state.restored_ps.add(index)
        watch.tell_finished(index, sorted(TaskId.parse(name).index for name in state.done))
        moved = self.starter.ps_address(index)
        if moved != before:
            self._moved(index, before, moved, step)

    def _moved(self, index: int, before: str, now: str, step: int) -> None:
        """ps ``index`` came back at another address (its node was lost): the workers know the
        old one, so each is ended and restarted by the planner with the new one, continuing
        at the step its pushes reached."""
        state = self.state
        workers = [
            task
            for name, task in state.supervisor.tasks.items()
            if name.startswith("worker") and name not in state.done and task.poll() is None
        ]
        state.console.note(
            f"[distsgd] ps{index} came back at {now} (was {before}): restarting "
            f"{len(workers)} workers with its new address"
        )
        state.events.log(step=step, event="ps_moved", target=f"ps{index}", before=before, now=now)
        for task in workers:
            task.kill()

    def restart_all(self, name: str, code: int, step: int, plan: RestartAll) -> None:
        """Carry out ``plan``: the whole cluster again from its checkpoint."""
        checkpoint = plan.checkpoint
        self.state.console.note(
            f"[distsgd] restarting the whole cluster ({plan.why}) "
            f"from {checkpoint.path.name if checkpoint else 'the start'}"
        )
        self._fault(
            name,
            code,
            step,
            "restart_all",
            resumed_from=None if checkpoint is None else checkpoint.path.name,
            lost_steps=plan.lost_steps,
        )
        self._start_over(checkpoint)

    def _roll_back(self, plan: RollBack, name: str, code: int, step: int) -> None:
        """Carry out ``plan``: every task again from its checkpoint (or the start), every rate
        times its ``lr_cut`` (saved in ``config.json``: a ``--resume`` keeps it); the newer
        checkpoints, which hold the diverged state, set aside in ``checkpoints/diverged/``."""
        state = self.state
        at = "the start" if plan.checkpoint is None else plan.checkpoint.path.name
        state.console.note(
            f"[distsgd] {plan.why}; rolling back to {at} at {plan.lr_cut:g}x the rate "
            f"(rollback {plan.number} of {state.config.durability.max_rollbacks})"
        )
        self._fault(name, code, step, "rollback", **plan.record())
        state.rollbacks = (*state.rollbacks, plan.record())
        state.supervisor.stop()  # before its files move: no worker still writes one
        at_step = 0 if plan.checkpoint is None else plan.checkpoint.step
        set_aside(state.ckpt_root, plan.newer, after_step=at_step)
        overrides = {**state.config.overrides, "lr_cut": plan.lr_cut}
        state.config = dataclasses.replace(state.config, overrides=overrides)
        self.starter.write_config()
        state.progress.forget_divergence()
        self._start_over(plan.checkpoint)

    def _start_over(self, checkpoint: Checkpoint | None) -> None:
        """Stop every task and start the whole cluster from ``checkpoint`` (None: the start)."""
        state = self.state
        state.supervisor.stop()
        state.supervisor.forget()
        state.done.clear()
        state.restored_ps.clear()
        self.watch.seen_versions.clear()  # an earlier cluster's servers
        self.starter.start_cluster(checkpoint, fresh_ports=True)
