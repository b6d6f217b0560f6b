"""``distsgd run``: a whole cluster on this machine, supervised from start to stop.

Order of events: parameter servers start on port 0; for collective schemes the launcher hosts
the rendezvous store; workers start at once and read each server's real address from its
address file; the cluster spec with the real addresses is written to the run folder; the
launcher relays the tasks' logs and shows progress until every worker has exited. A task that
dies is restarted (``--max-restarts``) from the last checkpoint; faults can be injected on
purpose (``--inject-fault``). Whatever happens (success, a failed task, Ctrl-C,
SIGTERM) every task is stopped in a ``finally`` before the launcher returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd import schemes
from distsgd.cluster import Role, TaskId
from distsgd.control.checkpoint.store import latest_checkpoint
from distsgd.control.faults import Fault, clear_kill_marks, kill_due, kill_landed
from distsgd.control.folder import CONFIG_FILE, METRICS_FILE, RESULT_FILE
from distsgd.control.outcome import RunOutcome, RunStatus
from distsgd.control.recovery import (
    PEER_SETTLE,
    failure_kind,
    first_cause,
    may_follow_a_peer,
    restart_all,
)
from distsgd.control.rollback import rollbacks_in
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.durability import disk_full, disk_full_line
from distsgd.launcher.emulated import close_hosts, link_faults, link_sampler, start_hosts
from distsgd.launcher.engines import engine_for
from distsgd.launcher.errors import Interrupted, RunDiverged, RunFailed
from distsgd.launcher.progress import Console
from distsgd.launcher.replicas import is_replica
from distsgd.launcher.restart import Restarts
from distsgd.launcher.scale import LAUNCHER_FILE, read_scale_request
from distsgd.launcher.supervisor import Tasks
from distsgd.launcher.tasks import write_tasks as _write_tasks
from distsgd.launcher.waits import Reminder
from distsgd.transport import shm
from distsgd.util import private_dir, write_atomic
from distsgd.util.signals import setter

if TYPE_CHECKING:
    from distsgd.launcher.emulated import EmulatedHosts

log = logging.getLogger(__name__)

LAUNCHER_LOG = "launcher.log"
"""What the launcher said (its notes, progress, results and errors), in the run folder."""
"""The fork server's own output (what its imports print), in the run folder."""
POLL_SECONDS = 0.25
"""How often the launcher reads the tasks' progress and exit codes."""
KILL_POLL_SECONDS = 0.05
"""The same while an injected kill waits for its step (``--inject-fault kill:...``)."""
LEAVE_GRACE_SECONDS = 30.0
"""How long a worker asked to leave (distsgd scale) may take before it is SIGKILLed."""
SAVE_ON_STOP_SECONDS = 30.0
"""How long the first Ctrl-C (or SIGTERM) waits for the workers to stop and save."""


DIVERGED_PREFIX = "distsgd: the run diverged: "
"""How the launcher's line about a diverged run begins (then the reason and the fix)."""
STALLED_PREFIX = "distsgd: the run did not learn: "
"""The same for a run that ended at chance while its parameters barely moved (``"stalled"``)."""
AT_CHANCE_PREFIX = "distsgd: the run ended at chance: "
"""The same for a run at chance that may have blown up or not got going (``"unclear"``)."""


def _divergence_line(exc: RunDiverged, spec: schemes.SchemeSpec) -> str:
    """The launcher's one line for a failed run: the verdict, then the scheme's fix."""
    if exc.stalled:
        return f"{STALLED_PREFIX}{exc}; {spec.stall_fix()}"
    if exc.unclear:
        return f"{AT_CHANCE_PREFIX}{exc}; {spec.unclear_fix()}"
    return f"{DIVERGED_PREFIX}{exc}; {spec.divergence_fix()}"


def _fresh_folder(config: LaunchConfig) -> Path:
    """The run folder, made (0700); ValueError where a new run would reuse an earlier one's."""
    run_dir = config.resolved_run_dir()
    if not config.resume and (run_dir / CONFIG_FILE).exists():
        raise ValueError(
            f"run folder {run_dir} holds an earlier run; give another --run-dir, "
            f"or continue that run with --resume {run_dir}"
        )
    if not config.resume and (run_dir / "secret").exists():
        raise ValueError(
            f"run folder {run_dir} already holds a secret file that a new run would trust; "
            "give a new --run-dir (a fresh run makes its own secret)"
        )
    private_dir(run_dir)
    return run_dir


def _start(
    config: LaunchConfig, console: Console, run_dir: Path, stop: threading.Event
) -> LocalRun:
    """The emulated hosts, the engine and the run's launcher (its run control among them);
    what started goes again when the rest fails."""
    hosts = start_hosts(config, run_dir)  # before any task; gone again if it fails
    try:
        supervisor = engine_for(config).start(config, run_dir, console)
        try:
            return LocalRun(config, console, run_dir, supervisor, stop, hosts=hosts)
        except BaseException:
            supervisor.close()
            raise
    except BaseException:
        if hosts is not None:
            hosts.close(check=False)
        raise


def launch(config: LaunchConfig, console: Console | None = None) -> RunOutcome:
    """Run ``config`` to the end; returns how it ended (its ``exit_code``: 0, 1 failed,
    3 diverged, 130 interrupted by Ctrl-C, 143 by SIGTERM). A settings mistake found before the
    start raises ValueError.

    Without a ``console`` it makes its own, and keeps a copy of what it says (not the tasks'
    lines, which have their own logs) in the run folder's ``launcher.log``."""
    keep = console is None
    console = console or Console(quiet=config.quiet)
    run_dir = _fresh_folder(config)
    if keep:
        console.keep(run_dir / LAUNCHER_LOG)
    stop = threading.Event()
    try:
        local = _start(config, console, run_dir, stop)
    except BaseException:
        if keep:
            console.close()
        raise
    supervisor = local.supervisor
    previous: dict[signal.Signals, Any] = {}
    caught: list[int] = []  # the signals that stopped the run, first first

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, setter(stop, before=partial(caught.append, sig)))
    launcher_file = run_dir / LAUNCHER_FILE
    try:
        write_atomic(launcher_file, f"{os.getpid()}\n")  # distsgd scale checks it is running
        return _run(local)
    except Interrupted:
        saved = "" if local.saved_step is None else f" (saved at step {local.saved_step})"
        console.final(f"distsgd: interrupted; stopping {len(supervisor.tasks)} tasks{saved}")
        finished = (run_dir / RESULT_FILE).exists()  # --resume refuses a finished run
        if not finished and latest_checkpoint(local.ckpt_root)[0] is not None:
            console.final(f"distsgd: continue it with: distsgd run --resume {run_dir}")
        return interrupted_outcome(run_dir, caught)
    except RunFailed as exc:
        console.error(f"distsgd: error: {exc}")
        return RunOutcome(
            status=exc.status, run_dir=run_dir, reason=exc.reason, log_tail=exc.log_tail
        )
    except RunDiverged as exc:
        console.error(_divergence_line(exc, schemes.get(config.scheme)))
        result_path = run_dir / RESULT_FILE
        return RunOutcome(
            status=RunStatus.STALLED if exc.stalled else RunStatus.DIVERGED,
            run_dir=run_dir,
            reason=str(exc),
            result_path=result_path if result_path.exists() else None,
            result=_read_result(result_path),
        )
    finally:
        launcher_file.unlink(missing_ok=True)
        local.tear_down()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _write_tasks(run_dir, supervisor)
        if keep:
            console.close()


def _run(local: LocalRun) -> RunOutcome:
    """``local.run()``; a write of the launcher that found no room (the run folder's disk is
    full) ends it in one line that names the disk and the command that resumes it."""
    try:
        return local.run()
    except OSError as exc:
        if not disk_full(exc):
            raise
        resumable = latest_checkpoint(local.ckpt_root)[0] is not None
        line = disk_full_line(local.run_dir, exc, resumable=resumable)
        raise RunFailed(line, reason="the disk is full") from None


def interrupted_outcome(run_dir: Path, caught: list[int]) -> RunOutcome:
    """A run stopped by the first of the signals ``caught``: SIGTERM exits 143 (128 + 15, as
    the shell has it), Ctrl-C (SIGINT, or none recorded) 130."""
    terminated = bool(caught) and caught[0] == signal.SIGTERM
    return RunOutcome(
        status=RunStatus.INTERRUPTED, run_dir=run_dir, reason="interrupted", terminated=terminated
    )


def _read_result(path: Path) -> dict[str, Any] | None:
    """The chief's ``result.json``, or None where there is none (or it is unreadable)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def earlier_rollbacks(run_dir: Path) -> tuple[dict[str, object], ...]:
    """The rollbacks ``run_dir``'s run took before (its ``metrics.jsonl``): a ``--resume``
    keeps counting them, as it keeps their ``lr_cut``."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return ()
    with path.open(encoding="utf-8", errors="replace") as lines:
        return rollbacks_in(lines)


class LocalRun(Restarts):
    """One run of ``distsgd run``: its tasks, restarts and injected kills."""

    def __init__(
        self,
        config: LaunchConfig,
        console: Console,
        run_dir: Path,
        supervisor: Tasks,
        stop: threading.Event,
        *,
        hosts: EmulatedHosts | None = None,
    ) -> None:
        super().__init__(config, console, run_dir, supervisor, stop, hosts=hosts)
        self.leaving: dict[str, float] = {}
        """Workers asked to leave (SIGTERM), by name: when they are SIGKILLed if still there."""
        self.scale_seen = 0
        """The ``seq`` of the last scale request handled."""
        self.faults = [Fault.parse(f) for f in config.faults]
        self.kills_pending = [f for f in self.faults if f.kills]
        clear_kill_marks(run_dir)  # a resumed run's kills are due again
        self.link_faults = link_faults(
            self.faults, hosts, events=self.events, note=console.note, run_dir=run_dir
        )
        """Partitions and slow links of emulated hosts (distsgd_emulate/link_faults.py)."""
        self.link_sampler = link_sampler(hosts, run_dir)
        """The emulated hosts' bytes over time, from the run's start (``links.jsonl``)."""
        self.saved_step: int | None = None
        """The step of the checkpoint the workers saved when the run was stopped (None:
        none; a resume goes back to the last periodic checkpoint)."""

    def tear_down(self) -> None:
        """Once the run ended, however: stop every task, then the run control and the
        emulated hosts; remove what only this launch reads."""
        self.supervisor.close()
        self.close_control()
        self.close_hosts()  # heal, count, take down (and their disks)
        shutil.rmtree(self.wal_root, ignore_errors=True)  # only a restart in this launch reads it
        # Segments are unlinked once a worker maps them; a server killed before that leaves a
        # name behind, which it recorded in its checkpoint folder before creating it.
        records = self.ckpt_root.glob("ps*.segments")
        shm.remove_leftovers(records, shm.run_prefix(self.run_id))
        self.store = None
        self.events.close()

    def close_hosts(self) -> None:
        """Undo the network faults still in effect, stop sampling, record the bytes, and take
        the emulated hosts down (after the tasks have ended; nothing without hosts)."""
        faults = self.link_faults.restore(self.progress.step)
        close_hosts(self.hosts, self.run_dir, faults, self.link_sampler.stop())

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        checkpoint = None
        if self.config.resume:
            checkpoint = self.latest()
            if checkpoint is None:
                raise RunFailed(
                    f"no complete checkpoint in {self.ckpt_root}; "
                    "start a new run instead of --resume"
                )
            self.console.note(
                f"[distsgd] resuming {self.run_dir} from {checkpoint.path.name} "
                f"(step {checkpoint.step})"
            )
            self.events.log(step=checkpoint.step, event="resume", checkpoint=checkpoint.path.name)
            # --max-rollbacks is the run's budget, not each call's (lr_cut is kept too)
            self.rollbacks = earlier_rollbacks(self.run_dir)
        rule, factor = self.config.lr_rule
        # said first: what follows may take a minute on a loaded machine (torch's imports)
        self.console.note(
            f"[distsgd] run {self.run_dir}: scheme {self.config.scheme}, "
            f"{self.config.workers} workers, "
            f"{self.num_ps} ps, {self.threads} threads per worker, "
            f"lr x {factor:.4g} (--lr-rule {rule})"
        )
        self.write_config()
        self.link_sampler.start()
        self.start_cluster(checkpoint, fresh_ports=True)
        self.supervise()
        return self.finish()

    def supervise(self) -> None:
        last_plain = 0.0
        first = Reminder(self.console.note)  # the workers start (imports, data, rendezvous)
        while True:
            # a kill set for a step lands within a poll of it: poll faster while one waits
            if self.stop.wait(KILL_POLL_SECONDS if self.kills_pending else POLL_SECONDS):
                self._save_on_stop()
                raise Interrupted
            self.progress.poll()
            self._poll_versions()
            self._inject_kills()
            if self.replicas is not None:
                self.replicas.restart_dead(self.progress.step)
            self.link_faults.poll(self.progress.step)
            if self.config.elastic:
                self._poll_scale()
                self._reap_leaving()
            ended = self._poll_tasks()
            if ended:
                ended = self._settle(ended)
                name = first_cause(ended)
                self._handle_failure(self.supervisor.tasks[name], ended[name])
            first.check(self._first_step_wait())
            now = time.monotonic()
            if (self.console.tty or now - last_plain >= 10.0) and self.progress.samples:
                self.console.status(self.progress.render())
                last_plain = now
            if not self.leaving and all(f"worker{i}" in self.done for i in self.active):
                return

    def _save_on_stop(self) -> None:
        """(First Ctrl-C or SIGTERM) ask the workers of a parameter-server run with
        checkpoints to stop and save (:meth:`TaskHandle.interrupt`): each finishes its step
        and push, saves its state and leaves, then the chief has the servers saved and writes
        the manifest. Up to :data:`SAVE_ON_STOP_SECONDS`; a second signal stops at once."""
        config = self.config
        workers = [
            task
            for name, task in self.supervisor.tasks.items()
            if not is_replica(name)
            and TaskId.parse(name).job == Role.WORKER
            and task.poll() is None
        ]
        saves = config.checkpoint_every or config.checkpoint_seconds
        if self.collective or not workers or not saves:
            return
        self.stop.clear()
        self.console.final(
            f"distsgd: stopping: the workers finish their step and save (up to "
            f"{SAVE_ON_STOP_SECONDS:.0f}s; Ctrl-C again to stop at once)"
        )
        asked = time.time()
        for task in workers:
            task.interrupt()
        deadline = time.monotonic() + SAVE_ON_STOP_SECONDS
        while any(task.poll() is None for task in workers):
            if self.stop.wait(POLL_SECONDS) or time.monotonic() > deadline:
                break
        saved = latest_checkpoint(self.ckpt_root)[0]
        if saved is not None and saved.manifest.get("stopped") and saved.manifest["time"] >= asked:
            self.saved_step = saved.step
            self.events.log(step=self.progress.step, event="saved", checkpoint=saved.path.name)
            return
        alive = any(task.poll() is None for task in workers)
        why = "not saved in time" if alive else "the workers ended without saving"
        why = "stopped at once" if self.stop.is_set() else why
        last = "none" if saved is None else f"{saved.path.name}, step {saved.step}"
        self.console.final(f"distsgd: {why}; the last periodic checkpoint stands ({last})")

    def _first_step_wait(self) -> str | None:
        """What the run waits for before its first metrics line (None: it has one)."""
        if self.progress.samples:
            return None
        names = ", ".join(f"worker{i}" for i in sorted(self.active))
        joining = ", joining the all-reduce rendezvous" if self.collective else ""
        return (
            f"the first step of {names} (importing, loading data{joining}; "
            f"their logs: {self.run_dir / 'logs'})"
        )

    def _poll_tasks(self) -> dict[str, int]:
        """Note the tasks that ended well or were asked to leave; the others that ended (name
        -> exit code) are failures."""
        failed: dict[str, int] = {}
        for task in list(self.supervisor.tasks.values()):
            code = task.poll()
            if code is None or task.name in self.done or is_replica(task.name):
                continue  # a replica is started again by itself (launcher/replicas.py)
            if task.name in self.leaving:  # asked to leave: gone, whatever its code
                del self.leaving[task.name]
                self.done.add(task.name)
                self.events.log(
                    step=self.progress.step, event="worker_left", target=task.name, code=code
                )
                continue
            if code == 0 and TaskId.parse(task.name).job == Role.WORKER:
                self.mark_done(task.name)
                continue
            failed[task.name] = code
        return failed

    def _settle(self, failed: dict[str, int]) -> dict[str, int]:
        """``failed`` and the peers that end within :data:`PEER_SETTLE` seconds, while every
        failure may be the echo of a peer's (see :func:`may_follow_a_peer`): the planner is
        then given the cause, not its first echo."""
        run = self.topology()
        deadline = time.monotonic() + PEER_SETTLE
        while all(may_follow_a_peer(failure_kind(c), run) for c in failed.values()):
            if time.monotonic() >= deadline or self.stop.wait(0.1):
                break
            for task in list(self.supervisor.tasks.values()):
                code = task.poll()
                if code and task.name not in self.done and not is_replica(task.name):
                    failed.setdefault(task.name, code)
        return failed

    def _inject_kills(self) -> None:
        for fault in list(self.kills_pending):
            due = kill_due(self.run_dir, fault)  # a worker holds still at the step
            if due is not None or self.progress.step >= (fault.step or 0):
                self.kills_pending.remove(fault)
                self._kill(fault, max(self.progress.step, due or 0))

    def _kill(self, fault: Fault, step: int) -> None:
        """SIGKILL the target of ``fault`` at global ``step``; the workers holding still at
        the step then go on."""
        try:
            self._kill_now(fault, step)
        finally:
            with contextlib.suppress(OSError):
                kill_landed(self.run_dir, fault)

    def _kill_now(self, fault: Fault, step: int) -> None:
        if fault.kind == "lose-host":
            self._lose_host(fault, step)
            return
        task = self.supervisor.tasks.get(fault.task)
        if task is None or task.poll() is not None:
            return
        target = TaskId.parse(fault.task)
        if target.job == Role.PS:
            self._read_version(target.index)
        self.console.note(
            f"[distsgd] fault injected: SIGKILL {fault.task} (pid {task.pid}) at step {step}"
        )
        self.events.log(step=step, event="fault_injected", fault="kill", target=fault.task)
        task.kill()

    def _lose_host(self, fault: Fault, step: int) -> None:
        """``lose-host:``: SIGKILL every task on the target's host, then wipe its disk. The
        versions of its servers are read first (what they had acknowledged at least)."""
        assert self.hosts is not None  # the config refuses lose-host without --hosts
        host = self.hosts.plan.host_of(fault.task_id)
        victims = [t for t in self.supervisor.tasks.values() if self.host_of(t.name) is host]
        victims = [t for t in victims if t.poll() is None]
        for task in victims:
            if task.name.startswith("ps"):
                self._read_version(TaskId.parse(task.name).index)
        names = ", ".join(t.name for t in victims) or "no task"
        self.console.note(f"[distsgd] fault injected: {host.name} lost at step {step} ({names})")
        self.events.log(
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
        self.wipe_disk(host)

    # -- elastic runs ---------------------------------------------------------------------------
    def _poll_scale(self) -> None:
        """Act on a new request of ``distsgd scale`` (``scale.json`` in the run folder)."""
        request = read_scale_request(self.run_dir)
        if request is None or request.seq == self.scale_seen:
            return
        self.scale_seen = request.seq
        low, high = self.config.lowest_workers, self.config.highest_workers
        if not low <= request.workers <= high:
            self.console.note(
                f"[distsgd] scale to {request.workers} workers refused: this run was started "
                f"with --min-workers {low} --max-workers {high}"
            )
            self.events.log(step=self.progress.step, event="scale_refused", workers=request.workers)
            return
        before = len(self.active)
        if self.collective:
            self._scale_collective(request.workers)
        else:
            self._scale_ps(request.workers)
        self.console.note(f"[distsgd] scaled from {before} to {len(self.active)} workers")
        self.events.log(
            step=self.progress.step,
            event="scale",
            seq=request.seq,
            workers_before=before,
            workers=len(self.active),
        )
        _write_tasks(self.run_dir, self.supervisor)

    def _scale_ps(self, workers: int) -> None:
        """Start workers at the lowest free indexes, or ask the highest ones (never the chief)
        to leave: each finishes its step, hands its work units back and leaves the servers."""
        while len(self.active) < workers:
            index = min(
                i
                for i in range(self.config.highest_workers)
                if i not in self.active and f"worker{i}" not in self.leaving
            )
            self.active.add(index)
            self.start_worker(index, resume=None)
        for index in sorted(self.active, reverse=True)[: max(0, len(self.active) - workers)]:
            if index == 0:
                break
            name = f"worker{index}"
            self.active.discard(index)
            task = self.supervisor.tasks.get(name)
            if task is None or task.poll() is not None:
                continue
            self.leaving[name] = time.monotonic() + LEAVE_GRACE_SECONDS
            task.terminate()

    def _scale_collective(self, workers: int) -> None:
        """A collective run changes size by a whole restart from its last checkpoint (see
        docs/elastic.md): a process group has a fixed size."""
        self.active = set(range(workers))
        why = f"the run changes size to {workers} workers"
        furthest = max(self.progress.local_steps.values(), default=0)
        self._restart_all(
            "launcher", 0, self.progress.step, restart_all(self, why, furthest=furthest)
        )

    def _reap_leaving(self) -> None:
        """SIGKILL a worker asked to leave that is still there after its grace period."""
        now = time.monotonic()
        for name, deadline in list(self.leaving.items()):
            task = self.supervisor.tasks.get(name)
            if task is not None and task.poll() is None and now > deadline:
                self.console.note(
                    f"[distsgd] {name} did not leave within {LEAVE_GRACE_SECONDS:.0f}s; killing it"
                )
                task.kill()
                self.leaving[name] = now + LEAVE_GRACE_SECONDS  # noted once per grace period

    def _rebalance_summary(self) -> dict[str, Any] | None:
        """(``--rebalance auto``) the moves made and each piece's updates over the run, summed
        over the servers (a moved piece's count moves with it): equal for every piece when
        no update was lost."""
        rebalancer = self.rebalancer
        if rebalancer is None:
            return None
        rebalancer.join()
        applies: dict[str, int] = {}
        for index in range(self.num_ps):
            reply = self._read_version(index)
            if reply is None:
                continue
            held = {t.key for t in reply.tensors}
            for piece in reply.load.pieces:
                if piece.key in held:
                    applies[piece.key] = applies.get(piece.key, 0) + piece.applies
        counts = list(applies.values()) or [0]
        return {
            "moves": rebalancer.moves,
            "failed": rebalancer.failed,
            "applies_min": min(counts),
            "applies_max": max(counts),
        }

    def finish(self) -> RunOutcome:
        self.progress.poll()
        self.console.clear_status()
        moved = self._rebalance_summary()  # read while the servers still answer
        self.supervisor.stop()  # the parameter servers; their last words come before the result
        result_path = self.run_dir / RESULT_FILE
        if not result_path.exists():
            raise RunFailed(
                f"the workers finished but the chief wrote no {RESULT_FILE} in {self.run_dir}"
            )
        result = json.loads(result_path.read_text())
        restarts = sum(self.restarts.values())
        extra = f", {restarts} restarts" if restarts else ""
        self.console.final(
            f"[distsgd] done in {self.progress.elapsed:.0f}s: {result['global_step']} updates, "
            f"{result['local_steps']} steps on worker0{extra}; run folder {self.run_dir}"
        )
        for fault in self.kills_pending:  # the run ended before the step it was set for
            self.console.error(
                f"distsgd: warning: --inject-fault kill:{fault.job}:{fault.index}@step="
                f"{fault.step} was never injected: the run ended at global step "
                f"{self.progress.step}; give an earlier step"
            )
        split = self.progress.split_summary()
        if split:
            self.console.final(f"[distsgd] {split}")
            result["time_split"] = {k: round(v, 4) for k, v in self.progress.total_split().items()}
        if self.progress.staleness:
            result["staleness"] = dict(sorted(self.progress.staleness.items()))
        durability = self.durability.summary()
        if durability is not None:
            result["durability"] = durability
        if self.replicas is not None:
            result["log_replicas"] = self.replicas.summary()
        if moved is not None:
            result["rebalance"] = moved
            self.console.final(
                f"[distsgd] rebalance: {moved['moves']} move(s), {moved['failed']} failed; "
                f"updates per piece {moved['applies_min']}..{moved['applies_max']}"
            )
        if self.rollbacks:
            result["rollbacks"] = list(self.rollbacks)
            self.console.final(
                f"[distsgd] rolled back {len(self.rollbacks)} time(s) after a divergence; "
                f"every rate at {self.config.overrides.get('lr_cut', 1.0):g}x since"
            )
        if (
            split
            or self.progress.staleness
            or moved
            or durability
            or self.rollbacks
            or (self.replicas is not None)
        ):
            write_atomic(result_path, json.dumps(result, indent=2) + "\n")
        if result.get("test_accuracy") is not None:
            self.console.final(f"test accuracy: {result['test_accuracy']:.4f}")
        elif result.get("test_loss") is not None:
            self.console.final(f"test loss: {result['test_loss']:.4f}")
        reason = result.get("divergence") or self.progress.divergence
        if reason and not result.get("diverged"):  # another worker's loss ended above its start
            result.update(diverged=True, divergence=reason)
            write_atomic(result_path, json.dumps(result, indent=2) + "\n")
        failed = self.script_failed(result)  # a script's own error after training: exit 1
        if failed is not None:
            raise failed
        if result.get("diverged"):
            # unclear, unless another worker's loss ended above its start (its own event)
            unclear = bool(result.get("unclear")) and self.progress.divergence in (None, reason)
            raise RunDiverged(str(reason), stalled=bool(result.get("stalled")), unclear=unclear)
        return RunOutcome(
            status=RunStatus.OK, run_dir=self.run_dir, result_path=result_path, result=result
        )
