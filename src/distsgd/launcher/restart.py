"""What the local launcher does when a task dies: it asks the restart planner
(:func:`distsgd.control.recovery.plan_restart`) and carries out its plan (:class:`Restarts`)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from distsgd.cluster import Role, TaskId
from distsgd.control.checkpoint.errors import CheckpointError
from distsgd.control.checkpoint.store import (
    Checkpoint,
    DiskStore,
    ShardRef,
    WorkerStateRef,
    complete_checkpoints,
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
    RunTopology,
    Stop,
    TaskFailure,
    failure_kind,
    plan_restart,
    restart_all,
)
from distsgd.control.rollback import RollBack, plan_rollback
from distsgd.launcher.errors import Interrupted, RunDiverged, RunFailed
from distsgd.launcher.servers import read_info, tell_finished
from distsgd.launcher.supervisor import TaskHandle
from distsgd.launcher.tasks import LocalTasks, write_tasks
from distsgd.ps.sequence import steps_applied
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.util import write_atomic


class Restarts(LocalTasks):
    """A local run's restarts, drops and stops, as the planner decides them; the checkpoint
    store as the planner sees it (:class:`~distsgd.control.recovery.StoreView`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_training: dict[str, str] = {}
        """Workers whose script failed after their training finished, with its error (the
        run fails with it once the other workers are done)."""

    # -- the store, as the planner sees it ------------------------------------------------------
    def _disk(self) -> DiskStore:
        return DiskStore(self.ckpt_root, self.wal_root if self.config.wal else None)

    def newest_worker(self, index: int) -> WorkerStateRef | None:
        return self._disk().newest_worker(index)

    def newest_shard(self, index: int) -> ShardRef | None:
        return self._disk().newest_shard(index)

    def has_wal(self, index: int) -> bool:
        """Whether ps ``index`` can come back from its log: its replica's copy, or its own
        folder (on its host's disk under ``--hosts``)."""
        if self.replicas is not None and self.replicas.holds_state(index):
            return self.config.wal
        host = self.host_of(f"ps{index}")
        if host is None or self.hosts is None:
            return self._disk().has_wal(index)
        return self.config.wal and DiskStore(self.ckpt_root, self.hosts.disk_of(host)).has_wal(
            index
        )

    def topology(self) -> RunTopology:
        return RunTopology(
            collective=self.collective,
            workers=len(self.active),
            min_workers=self.config.lowest_workers,
            elastic=self.config.elastic,
            checkpointing=self.checkpointing,
        )

    # -- a failure ------------------------------------------------------------------------------
    def _handle_failure(self, task: TaskHandle, code: int) -> None:
        steps = self.progress.local_steps
        failure = TaskFailure(
            task=TaskId.parse(task.name),
            exit_code=code,
            kind=failure_kind(code),
            reached=steps.get(task.name, 0),
            furthest=max(steps.values(), default=0),
        )
        budget = RestartBudget(
            used=self.restarts.get(task.name, 0),
            max_restarts=self.config.max_restarts,
            ran_seconds=time.monotonic() - self.started_at.get(task.name, 0.0),
            healthy_seconds=self.config.healthy_seconds,
        )
        try:
            recorded = (self.run_dir / RESULT_FILE).exists()  # training is over: no restarts
            run = dataclasses.replace(self.topology(), result_recorded=recorded)
            plan = plan_restart(failure, run, self, budget)
            self.restarts[task.name] = budget.in_a_row  # 0 once it ran healthy: a new fault
            self.execute(plan, task, code)
        except CheckpointError as exc:  # e.g. a checkpoint file that holds code
            raise RunFailed(f"{task.name} cannot be restarted: {exc}") from None

    def execute(self, plan: RestartPlan, task: TaskHandle, code: int) -> None:
        """Carry out ``plan`` for ``task``, which exited with ``code``."""
        step = self.progress.step
        if isinstance(plan, Stop):
            self._stop(plan, task, code, step)
        elif isinstance(plan, Finished):
            self._finished(plan, task.name, code, step)
        elif isinstance(plan, Drop):
            self._drop(plan, task.name, code, step)
        else:
            self.restarts[task.name] = plan.attempt
            self.console.note(
                f"[distsgd] {task.name} died (exit code {code}); "
                f"restart {plan.attempt} of {self.config.max_restarts} in {plan.backoff:.1f}s"
            )
            if self.stop.wait(plan.backoff):
                raise Interrupted
            if isinstance(plan, RestartAll):
                self._restart_all(task.name, code, step, plan)
            elif plan.task.job == Role.PS:
                self._restart_ps(plan, code, step)
            else:
                self._restart_worker(plan, code, step)
            write_tasks(self.run_dir, self.supervisor)

    def _stop(self, plan: Stop, task: TaskHandle, code: int, step: int) -> None:
        if plan.reason == "diverged":
            self.progress.poll()
            reason = self.progress.divergence or f"{task.name} stopped on a non-finite loss"
            rollback = plan_rollback(
                why=reason,
                good_until=self.progress.good_until,
                furthest=max(self.progress.local_steps.values(), default=0),
                checkpoints=complete_checkpoints(self.ckpt_root),
                done=len(self.rollbacks),
                max_rollbacks=self.config.max_rollbacks,
                lr_cut=float(self.config.overrides.get("lr_cut", 1.0)),
            )
            if rollback is not None:
                self._roll_back(rollback, task.name, code, step)
                return
            self._fault(task.name, code, step, "stop", diverged=True)
            record = {"scheme": self.config.scheme, "diverged": True, "divergence": reason}
            if self.rollbacks:
                record["rollbacks"] = list(self.rollbacks)
            write_atomic(self.run_dir / RESULT_FILE, json.dumps(record, indent=2) + "\n")
            raise RunDiverged(reason)
        self._fault(task.name, code, step, "stop")
        if plan.reason == "setup_error":
            said = SetupErrorRecord.load(self.run_dir, TaskId.parse(task.name))
            cause = said.message if said is not None else "see its log"
            raise RunFailed(f"{task.name}: {cause}", status=RunStatus.SETUP_ERROR)
        tail = "\n".join(f"    {line}" for line in task.tail)
        how = "" if self.config.max_restarts == 0 else f" and has used its {plan.used} restarts"
        resume = f"\nresume with: distsgd run --resume {self.run_dir}" if plan.resumable else ""
        head = f"task {task.name} failed (exit code {code}){how}"
        said = SetupErrorRecord.load(self.run_dir, TaskId.parse(task.name))
        error = f": {said.message}" if said is not None and said.kind == "crash" else ""
        raise RunFailed(
            f"{head}{error}; its last log lines:\n{tail}\nfull logs: {self.run_dir / 'logs'}"
            f"{resume}",
            reason=head + error,  # the script's error in one line, not its log's last line
            log_tail=() if error else tuple(task.tail),
        )

    def _finished(self, plan: Finished, name: str, code: int, step: int) -> None:
        """Its training was over: done, not restarted. A script's error after training fails
        the run at its end (:meth:`script_failed`); the chief's record stays as it is."""
        self._fault(name, code, step, "none", after_training=plan.after_training)
        self.mark_done(name)
        said = SetupErrorRecord.load(self.run_dir, plan.task) if plan.after_training else None
        if plan.after_training:
            message = said.message if said is not None else "see its log"
            self.after_training[name] = message
        else:
            self.console.note(
                f"[distsgd] {name} ended (exit code {code}) after the run's result was "
                "recorded; not restarted"
            )

    def mark_done(self, name: str) -> None:
        """``name`` has ended its part of the run; a worker's restored servers are told it
        left (it may have left a process that died since)."""
        self.done.add(name)
        finished = TaskId.parse(name)
        if finished.job != Role.WORKER:
            return
        for index in sorted(self.restored_ps):
            server = self.supervisor.tasks.get(f"ps{index}")
            if server is not None and server.poll() is None:  # else: told on restart
                self._tell_finished(index, [finished.index])

    def script_failed(self, result: Mapping[str, Any]) -> RunFailed | None:
        """The run's failure when a worker's script failed after its training finished (the
        first such worker's error, in one line, with where the chief's ``result`` is and its
        verdict); None when none did."""
        if not self.after_training:
            return None
        name = min(self.after_training, key=lambda n: TaskId.parse(n).index)
        verdict = f" (diverged: {result.get('divergence')})" if result.get("diverged") else ""
        kept = f"; the run's result stands in {self.run_dir / RESULT_FILE}{verdict}"
        return RunFailed(f"{name}: {self.after_training[name]}{kept}")

    def _drop(self, plan: Drop, name: str, code: int, step: int) -> None:
        self._fault(name, code, step, "drop", workers=plan.workers)
        index = plan.task.index
        self.active.discard(index)
        self.done.add(name)
        for shard in range(self.num_ps):  # it cannot leave itself: its work goes back now
            self._tell_finished(shard, [index])
        self.console.note(
            f"[distsgd] {name} failed (exit code {code}) with no restarts left; the "
            f"run goes on with {len(self.active)} workers (--min-workers "
            f"{self.config.lowest_workers})"
        )

    def _fault(self, target: str, code: int, step: int, action: str, **cost: Any) -> None:
        """One ``metrics.jsonl`` record per fault: which task, when, what was done, what it cost."""
        self.events.log(
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
            continued_at=max(continued, self._steps_applied(plan.task.index)),
            lost_steps=0,
        )
        path = None if resume is None else resume.path
        self.start_worker(plan.task.index, resume=path, continue_at=plan.continue_at)

    def _steps_applied(self, worker: int) -> int:
        """The steps of ``worker`` whose pushes every server applied (what the worker reads
        as it starts again, :meth:`ParameterClient.steps_applied`); 0 for a collective run
        or where a server does not answer (the metrics line's step stands then)."""
        if self.collective or self.num_ps == 0:
            return 0
        applied = []
        for index in range(self.num_ps):
            address = self.spec.address(self.spec.task(Role.PS, index))
            reply = read_info(
                address, run_id=self.run_id, secret=self.secret, tls=self.config.tls, worker=worker
            )
            if reply is None or not reply.registered:
                return 0
            applied.append(steps_applied(reply.applied_sequence))
        return min(applied)

    def _restart_ps(self, plan: Restart, code: int, step: int) -> None:
        """Restart a ps from its write-ahead log or its newest shard file (the server takes the
        newer); the whole cluster when it cannot come back. The fault record compares the
        version it comes back at with the one last read from the dead server."""
        index, shard = plan.task.index, plan.resume
        assert shard is None or isinstance(shard, ShardRef)
        seen = self.seen_versions.pop(index, None)  # the dead server's, read before it died
        address = before = self.spec.address(self.spec.task(Role.PS, index))
        if self.supervisor.node_host is not None:  # it may land on another node: same port
            address = f"{self.supervisor.node_host}:{address.rpartition(':')[2]}"
        try:
            self.start_ps(index, address=address, restore=None if shard is None else shard.path)
        except RunFailed as exc:  # e.g. its old port was taken meanwhile, or an unreadable log
            why = f"ps{index} could not come back: {exc}"
            furthest = max(self.progress.local_steps.values(), default=0)
            self._restart_all(f"ps{index}", code, step, restart_all(self, why, furthest=furthest))
            return
        filed = -1 if shard is None else shard.version
        info = self._read_version(index)
        restored = filed if info is None else int(info.restored_version)
        source = "wal" if shard is None or restored > filed else shard.path.parent.name
        self._fault(
            f"ps{index}",
            code,
            step,
            "restart",
            resumed_from=source,
            restored_version=restored,
            seen_version=seen,
            lost_updates=max(0, (step if seen is None else seen) - restored),
        )
        self.durability.lost_updates(index, (step if seen is None else seen) - restored)
        self.seen_versions[index] = restored
        self.restored_ps.add(index)
        self._tell_finished(index, sorted(TaskId.parse(name).index for name in self.done))
        moved = self.spec.address(self.spec.task(Role.PS, index))
        if moved != before:
            self._moved(index, before, moved, step)

    def _moved(self, index: int, before: str, now: str, step: int) -> None:
        """ps ``index`` came back at another address (its node was lost): the workers know the
        old one, so each is ended and restarted by the planner with the new one, continuing
        at the step its pushes reached."""
        workers = [
            task
            for name, task in self.supervisor.tasks.items()
            if name.startswith("worker") and name not in self.done and task.poll() is None
        ]
        self.console.note(
            f"[distsgd] ps{index} came back at {now} (was {before}): restarting "
            f"{len(workers)} workers with its new address"
        )
        self.events.log(step=step, event="ps_moved", target=f"ps{index}", before=before, now=now)
        for task in workers:
            task.kill()

    def _restart_all(self, name: str, code: int, step: int, plan: RestartAll) -> None:
        checkpoint = plan.checkpoint
        self.console.note(
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
        at = "the start" if plan.checkpoint is None else plan.checkpoint.path.name
        self.console.note(
            f"[distsgd] {plan.why}; rolling back to {at} at {plan.lr_cut:g}x the rate "
            f"(rollback {plan.number} of {self.config.max_rollbacks})"
        )
        self._fault(name, code, step, "rollback", **plan.record())
        self.rollbacks = (*self.rollbacks, plan.record())
        self.supervisor.stop()  # before its files move: no worker still writes one
        at_step = 0 if plan.checkpoint is None else plan.checkpoint.step
        set_aside(self.ckpt_root, plan.newer, after_step=at_step)
        overrides = {**self.config.overrides, "lr_cut": plan.lr_cut}
        self.config = dataclasses.replace(self.config, overrides=overrides)
        self.write_config()
        self.progress.forget_divergence()
        self._start_over(plan.checkpoint)

    def _start_over(self, checkpoint: Checkpoint | None) -> None:
        """Stop every task and start the whole cluster from ``checkpoint`` (None: the start)."""
        self.supervisor.stop()
        self.supervisor.forget()
        self.done.clear()
        self.restored_ps.clear()
        self.start_cluster(checkpoint, fresh_ports=True)

    # -- the servers ----------------------------------------------------------------------------
    def _poll_versions(self) -> None:
        """About once a second: each live server's version (see :attr:`seen_versions`)."""
        if self.collective or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + 1.0
        hosts = self.hosts
        for index in range(self.num_ps):
            task = TaskId(job=Role.PS, index=index)
            if hosts is not None and hosts.plan.host_of(task).name in hosts.cut_off:
                continue  # its host is cut off (partition:): it would keep us waiting 2 s
            self._read_version(index)
        if self.rebalancer is not None:
            self.rebalancer.poll(time.monotonic(), self.progress.step)

    def _read_version(self, index: int) -> pb.InfoResponse | None:
        """ps ``index``'s Info (None if it does not answer at once), its version remembered."""
        task = self.supervisor.tasks.get(f"ps{index}")
        if task is None or task.poll() is not None:
            return None
        address = self.spec.address(self.spec.task(Role.PS, index))
        reply = read_info(address, run_id=self.run_id, secret=self.secret, tls=self.config.tls)
        if reply is not None and reply.registered:
            self.seen_versions[index] = max(self.seen_versions.get(index, 0), reply.version)
            self.shard_loads.see(index, reply, time.monotonic(), self.progress.step)
            self.durability.see(index, reply, self.progress.step)
            if self.rebalancer is not None:
                self.rebalancer.see(index, reply)
        return reply

    def _tell_finished(self, index: int, finished: list[int]) -> None:
        """A restored shard remembers the workers that had left when its file was saved; tell
        it about those that have finished since (their processes are gone and cannot): the
        ones done now, and each one that exits later (it may have left the dead process just
        before the kill, or the restored one while the launcher was restarting it)."""
        address = self.spec.address(self.spec.task(Role.PS, index))
        failed = tell_finished(
            address, finished, run_id=self.run_id, secret=self.secret, tls=self.config.tls
        )
        for worker, exc in failed:
            self.console.note(f"[distsgd] could not tell ps{index} that worker{worker} left: {exc}")
