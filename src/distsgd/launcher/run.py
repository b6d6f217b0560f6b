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

import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.cluster import Role, TaskId
from distsgd.control.checkpoint.store import latest_checkpoint
from distsgd.control.faults import Fault
from distsgd.control.folder import CONFIG_FILE, METRICS_FILE, RESULT_FILE
from distsgd.control.outcome import RunOutcome, RunStatus
from distsgd.control.recovery import PEER_SETTLE, failure_kind, first_cause, may_follow_a_peer
from distsgd.control.rollback import rollbacks_in
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.durability import disk_full, disk_full_line
from distsgd.launcher.emulated import Hosts, NoHosts, start_hosts
from distsgd.launcher.engines import engine_for
from distsgd.launcher.errors import Interrupted, RunDiverged, RunFailed
from distsgd.launcher.fault_driver import FaultDriver
from distsgd.launcher.metrics_endpoint import start_endpoint
from distsgd.launcher.progress import Console
from distsgd.launcher.replicas import is_replica
from distsgd.launcher.restart import PlanExecutor, RunStore
from distsgd.launcher.run_state import RunState, run_identity
from distsgd.launcher.scale import LAUNCHER_FILE
from distsgd.launcher.scaler import Scaler
from distsgd.launcher.server_watch import ServerWatch
from distsgd.launcher.stall_watch import StallWatch
from distsgd.launcher.supervisor import Tasks
from distsgd.launcher.tasks import TaskStarter, task_envs, worker_gpus
from distsgd.launcher.tasks import write_tasks as _write_tasks
from distsgd.launcher.waits import Reminder
from distsgd.transport import shm
from distsgd.util import private_dir, write_atomic
from distsgd.util.signals import stopping

log = logging.getLogger(__name__)

LAUNCHER_LOG = "launcher.log"
"""What the launcher said (its notes, progress, results and errors), in the run folder."""
"""The fork server's own output (what its imports print), in the run folder."""
POLL_SECONDS = 0.25
"""How often the launcher reads the tasks' progress and exit codes."""
KILL_POLL_SECONDS = 0.05
"""The same while an injected kill waits for its step (``--inject-fault kill:...``)."""
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
        hosts.abandon()
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
    supervisor = local.state.supervisor
    caught: list[int] = []  # the signals that stopped the run, first first
    launcher_file = run_dir / LAUNCHER_FILE
    with stopping(stop, caught):
        try:
            write_atomic(launcher_file, f"{os.getpid()}\n")  # distsgd elastic scale checks it runs
            return _run(local)
        except Interrupted:
            saved = "" if local.saved_step is None else f" (saved at step {local.saved_step})"
            console.final(f"distsgd: interrupted; stopping {len(supervisor.tasks)} tasks{saved}")
            finished = (run_dir / RESULT_FILE).exists()  # --resume refuses a finished run
            if not finished and latest_checkpoint(local.state.ckpt_root)[0] is not None:
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
        resumable = latest_checkpoint(local.state.ckpt_root)[0] is not None
        line = disk_full_line(local.state.run_dir, exc, resumable=resumable)
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


class LocalRun:
    """One run of ``distsgd run``: the collaborators that start its tasks
    (:class:`TaskStarter`), read its servers (:class:`ServerWatch`), carry out the restart
    planner's decisions (:class:`PlanExecutor`), resize it (:class:`Scaler`), inject its
    faults (:class:`FaultDriver`) and drive its emulated hosts
    (:class:`~distsgd.launcher.emulated.Hosts`), and the loop that supervises them until the
    workers are done."""

    def __init__(
        self,
        config: LaunchConfig,
        console: Console,
        run_dir: Path,
        supervisor: Tasks,
        stop: threading.Event,
        *,
        hosts: Hosts | None = None,
    ) -> None:
        run_id, secret = run_identity(config, run_dir)
        worker_env, ps_env = task_envs(run_dir, config.threads_per_worker)
        hands_out = engine_for(config).assigns_devices  # Ray: the GPUs its bundles reserved
        gpus = [] if hands_out else worker_gpus(config.device, os.environ)
        state = RunState.open(
            config, console, run_dir, supervisor, stop, run_id=run_id, secret=secret
        )
        self.state = state
        faults = [Fault.parse(f) for f in config.faults]
        self.hosts = hosts if hosts is not None else NoHosts()
        self.hosts.arm(faults, events=state.events, note=console.note)
        self.starter = TaskStarter(
            state, self.hosts, worker_env=worker_env, ps_env=ps_env, gpus=gpus
        )
        self.watch = ServerWatch(state, self.hosts, self.starter.ps_address)
        self.store = RunStore(state, self.hosts, self.starter.replicas)
        self.executor = PlanExecutor(state, self.starter, self.watch, self.store)
        self.scaler = Scaler(state, self.starter, self.executor, self.store)
        self.faults = FaultDriver(state, self.watch, self.hosts, faults)
        self.stall = StallWatch(state)  # the launcher's probe; the doctor when nothing moves
        self.metrics = start_endpoint(run_dir, config.hosting.metrics_address, console.note)
        self.saved_step: int | None = None
        """The step of the checkpoint the workers saved when the run was stopped (None:
        none; a resume goes back to the last periodic checkpoint)."""

    def tear_down(self) -> None:
        """Once the run ended, however: stop every task, then the run control and the
        emulated hosts; remove what only this launch reads."""
        state = self.state
        self.stall.close()
        state.supervisor.close()
        if self.metrics is not None:  # the metrics endpoint (GET /metrics)
            self.metrics.close()
        self.starter.close_control()
        self.hosts.close(state.progress.step)  # heal, count, take down (and their disks)
        shutil.rmtree(state.wal_root, ignore_errors=True)  # only a restart in this launch reads it
        # Segments are unlinked once a worker maps them; a server killed before that leaves a
        # name behind, which it recorded in its checkpoint folder before creating it.
        records = state.ckpt_root.glob("ps*.segments")
        shm.remove_leftovers(records, shm.run_prefix(state.run_id))
        self.starter.store = None
        state.events.close()

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        state = self.state
        config = state.config
        checkpoint = None
        if config.resume:
            checkpoint = self.store.latest()
            if checkpoint is None:
                raise RunFailed(
                    f"no complete checkpoint in {state.ckpt_root}; "
                    "start a new run instead of --resume"
                )
            state.console.note(
                f"[distsgd] resuming {state.run_dir} from {checkpoint.path.name} "
                f"(step {checkpoint.step})"
            )
            state.events.log(step=checkpoint.step, event="resume", checkpoint=checkpoint.path.name)
            # --max-rollbacks is the run's budget, not each call's (lr_cut is kept too)
            state.rollbacks = earlier_rollbacks(state.run_dir)
        rule, factor = config.lr_rule
        # said first: what follows may take a minute on a loaded machine (torch's imports)
        state.console.note(
            f"[distsgd] run {state.run_dir}: scheme {config.scheme}, "
            f"{config.size.workers} workers, "
            f"{config.num_ps} ps, {config.threads_per_worker} threads per worker, "
            f"lr x {factor:.4g} (--lr-rule {rule})"
        )
        self.starter.write_config()
        self.hosts.start_sampling()
        self.starter.start_cluster(checkpoint, fresh_ports=True)
        self.supervise()
        return self.finish()

    def supervise(self) -> None:
        state = self.state
        last_plain = 0.0
        first = Reminder(state.console.note)  # the workers start (imports, data, rendezvous)
        while True:
            # a kill set for a step lands within a poll of it: poll faster while one waits
            if state.stop.wait(KILL_POLL_SECONDS if self.faults.kills_pending else POLL_SECONDS):
                self._save_on_stop()
                raise Interrupted
            state.progress.poll()
            self._say_stragglers()
            self.watch.poll()
            self.stall.poll()
            self.faults.poll()
            if self.starter.replicas is not None:
                self.starter.replicas.restart_dead(state.progress.step)
            self.hosts.poll_faults(state.progress.step)
            if state.config.size.elastic:
                self.scaler.poll()
                self.scaler.reap_leaving()
            ended = self._poll_tasks()
            if ended:
                ended = self._settle(ended)
                name = first_cause(ended)
                self.executor.handle_failure(state.supervisor.tasks[name], ended[name])
            first.check(self._first_step_wait())
            now = time.monotonic()
            if (state.console.tty or now - last_plain >= 10.0) and state.progress.samples:
                state.console.status(state.progress.render())
                last_plain = now
            if not self.scaler.leaving and all(f"worker{i}" in state.done for i in state.active):
                return

    def _say_stragglers(self) -> None:
        """The straggler detector's verdicts on the lines just read (once a window): a
        ``straggler`` event each time one is named, turns chronic or clears."""
        progress = self.state.progress
        for change in progress.stragglers.update():
            fields = change.finding.fields()
            self.state.events.log(
                step=progress.step, event="straggler", state=change.state, **fields
            )

    def _save_on_stop(self) -> None:
        """(First Ctrl-C or SIGTERM) ask the workers of a parameter-server run with
        checkpoints to stop and save (:meth:`TaskHandle.interrupt`): each finishes its step
        and push, saves its state and leaves, then the chief has the servers saved and writes
        the manifest. Up to :data:`SAVE_ON_STOP_SECONDS`; a second signal stops at once."""
        state = self.state
        config = state.config
        workers = [
            task
            for name, task in state.supervisor.tasks.items()
            if not is_replica(name)
            and TaskId.parse(name).job == Role.WORKER
            and task.poll() is None
        ]
        saves = config.durability.checkpoint_every or config.durability.checkpoint_seconds
        if config.collective or not workers or not saves:
            return
        state.stop.clear()
        state.console.final(
            f"distsgd: stopping: the workers finish their step and save (up to "
            f"{SAVE_ON_STOP_SECONDS:.0f}s; Ctrl-C again to stop at once)"
        )
        asked = time.time()
        for task in workers:
            task.interrupt()
        deadline = time.monotonic() + SAVE_ON_STOP_SECONDS
        while any(task.poll() is None for task in workers):
            if state.stop.wait(POLL_SECONDS) or time.monotonic() > deadline:
                break
        saved = latest_checkpoint(state.ckpt_root)[0]
        if saved is not None and saved.manifest.get("stopped") and saved.manifest["time"] >= asked:
            self.saved_step = saved.step
            state.events.log(step=state.progress.step, event="saved", checkpoint=saved.path.name)
            return
        alive = any(task.poll() is None for task in workers)
        why = "not saved in time" if alive else "the workers ended without saving"
        why = "stopped at once" if state.stop.is_set() else why
        last = "none" if saved is None else f"{saved.path.name}, step {saved.step}"
        state.console.final(f"distsgd: {why}; the last periodic checkpoint stands ({last})")

    def _first_step_wait(self) -> str | None:
        """What the run waits for before its first metrics line (None: it has one)."""
        state = self.state
        if state.progress.samples:
            return None
        names = ", ".join(f"worker{i}" for i in sorted(state.active))
        joining = ", joining the all-reduce rendezvous" if state.config.collective else ""
        return (
            f"the first step of {names} (importing, loading data{joining}; "
            f"their logs: {state.run_dir / 'logs'})"
        )

    def _poll_tasks(self) -> dict[str, int]:
        """Note the tasks that ended well or were asked to leave; the others that ended (name
        -> exit code) are failures."""
        state, leaving = self.state, self.scaler.leaving
        failed: dict[str, int] = {}
        for task in list(state.supervisor.tasks.values()):
            code = task.poll()
            if code is None or task.name in state.done or is_replica(task.name):
                continue  # a replica is started again by itself (launcher/replicas.py)
            if task.name in leaving:  # asked to leave: gone, whatever its code
                del leaving[task.name]
                state.done.add(task.name)
                state.events.log(
                    step=state.progress.step, event="worker_left", target=task.name, code=code
                )
                continue
            if code == 0 and TaskId.parse(task.name).job == Role.WORKER:
                self.executor.mark_done(task.name)
                continue
            failed[task.name] = code
        return failed

    def _settle(self, failed: dict[str, int]) -> dict[str, int]:
        """``failed`` and the peers that end within :data:`PEER_SETTLE` seconds, while every
        failure may be the echo of a peer's (see :func:`may_follow_a_peer`): the planner is
        then given the cause, not its first echo."""
        state = self.state
        run = state.topology()
        deadline = time.monotonic() + PEER_SETTLE
        while all(may_follow_a_peer(failure_kind(c), run) for c in failed.values()):
            if time.monotonic() >= deadline or state.stop.wait(0.1):
                break
            for task in list(state.supervisor.tasks.values()):
                code = task.poll()
                if code and task.name not in state.done and not is_replica(task.name):
                    failed.setdefault(task.name, code)
        return failed

    def finish(self) -> RunOutcome:
        state = self.state
        progress, console = state.progress, state.console
        progress.poll()
        console.clear_status()
        moved = self.watch.rebalance_summary()  # read while the servers still answer
        state.supervisor.stop()  # the parameter servers; their last words come before the result
        result_path = state.run_dir / RESULT_FILE
        if not result_path.exists():
            raise RunFailed(
                f"the workers finished but the chief wrote no {RESULT_FILE} in {state.run_dir}"
            )
        result = json.loads(result_path.read_text())
        restarts = sum(state.restarts.values())
        extra = f", {restarts} restarts" if restarts else ""
        console.final(
            f"[distsgd] done in {progress.elapsed:.0f}s: {result['global_step']} updates, "
            f"{result['local_steps']} steps on worker0{extra}; run folder {state.run_dir}"
        )
        for warning in self.faults.never_injected():  # the run ended before their step
            console.error(warning)
        if self._add_summaries(result, moved):
            write_atomic(result_path, json.dumps(result, indent=2) + "\n")
        if result.get("test_accuracy") is not None:
            console.final(f"test accuracy: {result['test_accuracy']:.4f}")
        elif result.get("test_loss") is not None:
            console.final(f"test loss: {result['test_loss']:.4f}")
        reason = result.get("divergence") or progress.divergence
        if reason and not result.get("diverged"):  # another worker's loss ended above its start
            result.update(diverged=True, divergence=reason)
            write_atomic(result_path, json.dumps(result, indent=2) + "\n")
        failed = self.executor.script_failed(result)  # a script's own error after training
        if failed is not None:
            raise failed
        if result.get("diverged"):
            # unclear, unless another worker's loss ended above its start (its own event)
            unclear = bool(result.get("unclear")) and progress.divergence in (None, reason)
            raise RunDiverged(str(reason), stalled=bool(result.get("stalled")), unclear=unclear)
        return RunOutcome(
            status=RunStatus.OK, run_dir=state.run_dir, result_path=result_path, result=result
        )

    def _add_summaries(self, result: dict[str, Any], moved: dict[str, Any] | None) -> bool:
        """Add the launcher's summaries to the chief's ``result`` (the time split, staleness,
        durability, log replicas, rebalancing, rollbacks) and say them; whether any was."""
        state = self.state
        progress, console = state.progress, state.console
        split = progress.split_summary()
        if split:
            console.final(f"[distsgd] {split}")
            result["time_split"] = {k: round(v, 4) for k, v in progress.total_split().items()}
        if progress.staleness:
            result["staleness"] = dict(sorted(progress.staleness.items()))
        durability = self.watch.durability.summary()
        if durability is not None:
            result["durability"] = durability
        replicas = self.starter.replicas
        if replicas is not None:
            result["log_replicas"] = replicas.summary()
        if moved is not None:
            result["rebalance"] = moved
            console.final(
                f"[distsgd] rebalance: {moved['moves']} move(s), {moved['failed']} failed; "
                f"updates per piece {moved['applies_min']}..{moved['applies_max']}"
            )
        if state.rollbacks:
            result["rollbacks"] = list(state.rollbacks)
            console.final(
                f"[distsgd] rolled back {len(state.rollbacks)} time(s) after a divergence; "
                f"every rate at {state.config.overrides.get('lr_cut', 1.0):g}x since"
            )
        return bool(
            split
            or progress.staleness
            or moved
            or durability
            or state.rollbacks
            or (replicas is not None)
        )
