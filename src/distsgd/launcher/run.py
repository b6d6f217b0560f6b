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
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from distsgd import schemes
from distsgd.cluster import ClusterSpec, TaskId
from distsgd.control.divergence import DIVERGED_EXIT_CODE
from distsgd.control.errors import SETUP_ERROR_PREFIX, SETUP_EXIT_CODE
from distsgd.control.faults import Fault
from distsgd.control.folder import METRICS_FILE, RESULT_FILE
from distsgd.control.metrics import MetricsWriter
from distsgd.control.outcome import RunOutcome, RunStatus
from distsgd.control.task import ENV_VAR, TaskEnv
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.keras_env import keras_environment
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.progress import Console, Progress
from distsgd.launcher.scale import LAUNCHER_FILE, read_scale_request
from distsgd.launcher.supervisor import Supervisor, TaskHandle, Tasks
from distsgd.ps import wal
from distsgd.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    IncompleteCheckpoint,
    latest_checkpoint,
    newest_shard_file,
    newest_worker_state,
    read_shard_header,
    worker_state_step,
)
from distsgd.transport import shm
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.security import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    load_secret,
    write_secret_file,
)
from distsgd.util import private_dir, write_atomic
from distsgd.util.signals import setter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
LAUNCHER_LOG = "launcher.log"
"""What the launcher said (its notes, progress, results and errors), in the run folder."""
LEAVE_GRACE_SECONDS = 30.0
"""How long a worker asked to leave (distsgd scale) may take before it is SIGKILLed."""


DIVERGED_PREFIX = "distsgd: the run diverged: "
"""How the launcher's line about a diverged run begins (then the reason and the fix)."""
STALLED_PREFIX = "distsgd: the run did not learn: "
"""The same for a run that ended at chance while its parameters barely moved (``"stalled"``)."""


class RunFailed(RuntimeError):
    """A task failed or the run could not start; the message says which and why (for people),
    ``reason`` the same in one line, ``log_tail`` the failed task's last log lines."""

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        log_tail: tuple[str, ...] = (),
        status: RunStatus = RunStatus.FAILED,
    ) -> None:
        super().__init__(message)
        self.reason = reason or message.split("\n", 1)[0]
        self.log_tail = log_tail
        self.status = status


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the launcher."""


class Diverged(RuntimeError):
    """Training diverged (a non-finite loss, or a result no better than chance); ``stalled``:
    it ended at chance while its parameters barely moved (it did not learn)."""

    def __init__(self, reason: str, *, stalled: bool = False) -> None:
        super().__init__(reason)
        self.stalled = stalled


def launch(config: LaunchConfig, console: Console | None = None) -> RunOutcome:
    """Run ``config`` to the end; returns how it ended (its ``exit_code``: 0, 1 failed,
    3 diverged, 130 interrupted). A settings mistake found before the start raises ValueError.

    Without a ``console`` it makes its own, and keeps a copy of what it says (not the tasks'
    lines, which have their own logs) in the run folder's ``launcher.log``."""
    keep = console is None
    console = console or Console(quiet=config.quiet)
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
    if keep:
        console.keep(run_dir / LAUNCHER_LOG)
    stop = threading.Event()
    supervisor = _supervisor(config, run_dir, console)
    local = LocalRun(config, console, run_dir, supervisor, stop)
    previous: dict[signal.Signals, Any] = {}

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, setter(stop))
    launcher_file = run_dir / LAUNCHER_FILE
    try:
        write_atomic(launcher_file, f"{os.getpid()}\n")  # distsgd scale checks it is running
        return local.run()
    except Interrupted:
        console.final(f"distsgd: interrupted; stopping {len(supervisor.tasks)} tasks")
        if latest_checkpoint(local.ckpt_root)[0] is not None:
            console.final(f"distsgd: continue it with: distsgd run --resume {run_dir}")
        return RunOutcome(status=RunStatus.INTERRUPTED, run_dir=run_dir, reason="interrupted")
    except RunFailed as exc:
        console.error(f"distsgd: error: {exc}")
        return RunOutcome(
            status=exc.status, run_dir=run_dir, reason=exc.reason, log_tail=exc.log_tail
        )
    except Diverged as exc:
        spec = schemes.get(config.scheme)
        if exc.stalled:
            console.error(f"{STALLED_PREFIX}{exc}; {spec.stall_fix()}")
        else:
            console.error(f"{DIVERGED_PREFIX}{exc}; {spec.divergence_fix()}")
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
        supervisor.close()
        shutil.rmtree(local.wal_root, ignore_errors=True)  # only a restart in this launch reads it
        # Segments are unlinked once a worker maps them; a server killed before that leaves a
        # name behind, which it recorded in its checkpoint folder before creating it.
        records = local.ckpt_root.glob("ps*.segments")
        shm.remove_leftovers(records, shm.run_prefix(local.run_id))
        local.store = None
        local.events.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _write_tasks(run_dir, supervisor)
        if keep:
            console.close()


def _read_result(path: Path) -> dict[str, Any] | None:
    """The chief's ``result.json``, or None where there is none (or it is unreadable)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _supervisor(config: LaunchConfig, run_dir: Path, console: Console) -> Tasks:
    """Local processes, or (``config.ray``) Ray actors, one bundle of resources per task."""
    if config.ray is None:
        return Supervisor(log_dir=run_dir / "logs", echo=console.line)
    from distsgd.launcher.ray_tasks import RaySupervisor

    bundles = {f"ps{i}": {"CPU": 1.0} for i in range(config.num_ps)}
    worker: dict[str, float] = {"CPU": float(config.threads_per_worker)}
    if config.device.startswith("cuda"):  # auto: a GPU only where Ray gives one anyway
        worker["GPU"] = 1.0
    # an elastic run reserves its largest size: scaling up then needs no new reservation
    bundles.update({f"worker{i}": dict(worker) for i in range(config.highest_workers)})
    where = config.ray or "a local Ray instance (127.0.0.1)"
    console.note(f"[distsgd] tasks as Ray actors on {where}")
    return RaySupervisor(
        log_dir=run_dir / "logs", echo=console.line, address=config.ray, bundles=bundles
    )


def worker_gpus(device: str, environ: Mapping[str, str]) -> list[str]:
    """The GPUs the local launcher hands out to its workers, one each in turn, as values of
    ``CUDA_VISIBLE_DEVICES``: for ``--device auto`` or ``cuda`` every GPU this process sees
    (its own ``CUDA_VISIBLE_DEVICES`` when set), none otherwise. ``--device cuda`` on a machine
    without one is an error; ``cuda:N`` picks the same GPU for every worker (none handed out)."""
    if device not in ("auto", "cuda"):
        return []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch

        ids = (
            [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        )
    if not ids and device == "cuda":
        raise ValueError(
            "--device cuda: this machine shows no GPU to distsgd; use --device auto (GPUs "
            "where there are some) or cpu"
        )
    return ids


def _write_tasks(run_dir: Path, supervisor: Tasks) -> None:
    """``tasks.json``: the PID of every task, for diagnostics and for tests that check cleanup."""
    pids = {t.name: t.pid for t in supervisor.tasks.values()}
    write_atomic(run_dir / "tasks.json", json.dumps(pids) + "\n")


class LocalRun:
    """One run of ``distsgd run``: its tasks, restarts and injected kills."""

    def __init__(
        self,
        config: LaunchConfig,
        console: Console,
        run_dir: Path,
        supervisor: Tasks,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.console = console
        self.run_dir = run_dir
        self.supervisor = supervisor
        self.stop = stop
        self.num_ps = config.num_ps
        self.threads = config.threads_per_worker
        self.collective = self.num_ps == 0
        self.ckpt_root = run_dir / "checkpoints"
        self.wal_root = run_dir / "wal"
        self.seen_versions: dict[int, int] = {}
        """Each server's version as the launcher last read it (Info, about once a second and
        just before an injected kill): what a dead one had applied at least."""
        self._next_poll = 0.0
        self.checkpointing = bool(config.checkpoint_every or config.checkpoint_seconds)
        self.run_id = config.run_id or secrets.token_hex(8)
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        env.pop(SECRET_ENV, None)
        secret_file = run_dir / "secret"
        if config.resume:  # kept on --resume: the restored shards know the run
            self.secret = load_secret({SECRET_FILE_ENV: str(secret_file)})
        else:
            self.secret = write_secret_file(secret_file)
        env.update(
            {
                PARENT_ENV: str(os.getpid()),
                "PYTHONUNBUFFERED": "1",
                SECRET_FILE_ENV: str(secret_file.resolve()),
            }
        )
        self.worker_env = {
            **env,
            "DISTSGD_THREADS": str(self.threads),
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
        }
        self.ps_env = {
            **env,
            "DISTSGD_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",  # parameter servers stay on CPU (and import no torch)
        }
        self.gpus = (
            worker_gpus(config.device, os.environ) if config.ray is None else []
        )  # under Ray, Ray hands out the GPUs it reserved
        self.spec = ClusterSpec.local(
            num_workers=config.highest_workers, num_ps=self.num_ps, host=config.host
        )
        self.active: set[int] = set(range(config.workers))
        """The worker indexes meant to run now (``distsgd scale`` changes them)."""
        self.leaving: dict[str, float] = {}
        """Workers asked to leave (SIGTERM), by name: when they are SIGKILLed if still there."""
        self.scale_seen = 0
        """The ``seq`` of the last scale request handled."""
        self.store: Any = None
        self.rendezvous = ""
        self.restarts: dict[str, int] = {}
        """Restarts of each task in a row (reset once it runs healthy_seconds)."""
        self.started_at: dict[str, float] = {}
        """When each task was last started (monotonic seconds)."""
        self.restored_ps: set[int] = set()
        """Parameter servers restored from a file in this cluster's life (told who finished)."""
        self.done: set[str] = set()
        self.faults = [Fault.parse(f) for f in config.faults]
        self.kills_pending = [f for f in self.faults if f.kind == "kill"]
        self.progress = Progress(run_dir / METRICS_FILE)
        self.events = MetricsWriter(run_dir / METRICS_FILE, "launcher")

    # -- starting tasks -------------------------------------------------------------------------
    def _write_config(self) -> None:
        c = self.config
        data = {
            "script": str(Path(c.script).resolve()),
            "script_args": list(c.script_args),
            "scheme": c.scheme,
            "scheme_options": c.scheme_options,
            "overrides": c.overrides,
            "workers": c.workers,
            "ps": self.num_ps,
            "threads_per_worker": self.threads,
            "run_id": self.run_id,
            "checkpoint_every": c.checkpoint_every,
            "checkpoint_seconds": c.checkpoint_seconds,
            "min_workers": c.lowest_workers,
            "max_workers": c.highest_workers,
        }
        write_atomic(self.run_dir / CONFIG_FILE, json.dumps(data, indent=2) + "\n")

    def start_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` and wait until it reports the address it bound."""
        task = self.spawn_ps(index, address=address, restore=restore)
        self.await_ps(index, task)
        return task

    def await_ps(self, index: int, task: TaskHandle) -> None:
        bound = _wait_for_address(task, self.ps_address_file(index), 60.0)
        self.spec = self.spec.with_address(self.spec.task("ps", index), bound)

    def ps_address_file(self, index: int) -> Path:
        return self.run_dir / f"ps{index}.address"

    def spawn_ps(self, index: int, *, address: str, restore: Path | None) -> TaskHandle:
        """Start ps ``index`` on ``address`` (port 0: any); it writes its real address to
        :meth:`ps_address_file` once it listens."""
        init = self.run_dir / "cluster-init.json"
        write_atomic(
            init,
            json.dumps(
                ClusterSpec.local(
                    num_workers=self.config.highest_workers,
                    num_ps=self.num_ps,
                    host=self.config.host,
                ).to_dict()
            )
            + "\n",
        )
        addr_file = self.ps_address_file(index)
        addr_file.unlink(missing_ok=True)
        self.spec = self.spec.with_address(self.spec.task("ps", index), address)
        argv = [
            sys.executable,
            "-m",
            "distsgd",
            "server",
            "--job",
            "ps",
            "--task",
            str(index),
            "--cluster",
            str(init),
            "--address",
            address,
            "--address-file",
            str(addr_file),
            "--checkpoint-dir",
            str(self.ckpt_root),
            *(["--wal-dir", str(self.wal_root / f"ps{index}")] if self.config.wal else []),
            *([] if self.config.wal else ["--wal", "off"]),
        ]
        if restore is not None:
            argv += ["--restore", str(restore)]
        if self.config.elastic:
            argv += ["--max-workers", str(self.config.highest_workers)]
        if self.config.evict_after:
            argv += ["--evict-after", f"{self.config.evict_after:g}"]
        if self.config.tls is not None:
            tls = self.config.tls
            argv += [
                "--tls-cert",
                str(tls.cert),
                "--tls-key",
                str(tls.key),
                "--tls-ca",
                str(tls.ca),
            ]
        return self._start(f"ps{index}", argv, self.ps_env)

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> TaskHandle:
        self.started_at[name] = time.monotonic()
        return self.supervisor.start(name, argv, env)

    def start_worker(
        self, index: int, *, resume: Path | None, continue_at: int = 0, reshard: bool = False
    ) -> TaskHandle:
        c = self.config
        task_env = TaskEnv(
            cluster=self.spec.to_dict(),
            task_index=index,
            scheme=c.scheme,
            scheme_options=c.scheme_options,
            overrides=c.overrides,
            run_dir=str(self.run_dir.resolve()),
            run_id=self.run_id,
            rendezvous=self.rendezvous,
            startup_timeout=c.startup_timeout,
            wait_timeout=c.wait_timeout,
            checkpoint_every=c.checkpoint_every,
            checkpoint_seconds=c.checkpoint_seconds,
            resume="" if resume is None else str(resume),
            continue_at=continue_at,
            tls=[] if c.tls is None else [str(c.tls.cert), str(c.tls.key), str(c.tls.ca)],
            ps_address_files=[str(self.ps_address_file(i)) for i in range(self.num_ps)],
            faults=[
                f
                for f in c.faults
                if Fault.parse(f).task == f"worker{index}" and not f.startswith("kill")
            ],
            # an elastic cluster lists --max-workers workers: a collective one trains with those
            # started now (a process group's size), a parameter-server one registers --workers
            registered_workers=(len(self.active) if self.collective else c.workers)
            if c.elastic
            else 0,
            reshard=reshard,
        )
        argv = [sys.executable, "-m", "distsgd.launcher.bootstrap", c.script, *c.script_args]
        self.done.discard(f"worker{index}")
        env = {**self.worker_env, ENV_VAR: task_env.to_json()}
        if self.gpus:  # each worker its own GPU (in turn, when there are more workers)
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[index % len(self.gpus)]
        # Keras 3 scripts: KERAS_BACKEND=torch, KERAS_TORCH_DEVICE where it trains (unless set)
        env.update(
            keras_environment(c.device, gpu=bool(self.gpus) if c.ray is None else None, environ=env)
        )
        return self._start(f"worker{index}", argv, env)

    def _new_rendezvous(self) -> None:
        if self.collective and self.config.workers > 1:
            from distsgd.runtime.collective import host_store

            self.store, port = host_store(
                self.config.host, timedelta(seconds=self.config.wait_timeout)
            )
            self.rendezvous = f"{self.config.host}:{port}"

    def start_cluster(self, checkpoint: Checkpoint | None, *, fresh_ports: bool) -> None:
        """Start every task. The workers start while the servers do (both take seconds to
        import); a worker reads each server's real address from its address file. They start
        from the checkpoint: logs of an earlier cluster are removed."""
        shutil.rmtree(self.wal_root, ignore_errors=True)
        self.seen_versions.clear()
        if self.config.wal and self.num_ps:
            wal.make_private_dir(self.wal_root)
        servers = []
        for i in range(self.num_ps):
            address = (
                f"{self.config.host}:0"
                if fresh_ports
                else self.spec.address(self.spec.task("ps", i))
            )
            restore = None if checkpoint is None else checkpoint.shard_file(i)
            servers.append(self.spawn_ps(i, address=address, restore=restore))
        self._new_rendezvous()
        saved = 0 if checkpoint is None else len(checkpoint.manifest["workers"])
        # saved at another size (distsgd scale): every worker continues from worker 0's state
        reshard = checkpoint is not None and saved != len(self.active)
        for i in sorted(self.active):
            resume = None if checkpoint is None else checkpoint.worker_file(0 if reshard else i)
            self.start_worker(i, resume=resume, reshard=reshard)
        for i, task in enumerate(servers):
            self.await_ps(i, task)
        write_atomic(
            self.run_dir / "cluster.json", json.dumps(self.spec.to_dict(), indent=2) + "\n"
        )
        _write_tasks(self.run_dir, self.supervisor)

    def latest(self) -> Checkpoint | None:
        checkpoint, problems = latest_checkpoint(self.ckpt_root)
        pending = [p for p in problems if isinstance(p, IncompleteCheckpoint)]
        for problem in problems:
            if not isinstance(problem, IncompleteCheckpoint):
                self.console.note(f"[distsgd] unusable checkpoint: {problem}")
        if pending:
            self.console.note(
                f"[distsgd] skipping {len(pending)} newer checkpoint(s) without a manifest "
                "(still being completed, or interrupted)"
            )
        if checkpoint is not None and len(problems) > len(pending):
            self.console.note(
                f"[distsgd] using the previous complete checkpoint {checkpoint.path.name}"
            )
        return checkpoint

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
        self._write_config()
        self.start_cluster(checkpoint, fresh_ports=True)
        rule, factor = self.config.lr_rule
        self.console.note(
            f"[distsgd] run {self.run_dir}: scheme {self.config.scheme}, "
            f"{self.config.workers} workers, "
            f"{self.num_ps} ps, {self.threads} threads per worker, "
            f"lr x {factor:.4g} (--lr-rule {rule})"
        )
        self.supervise()
        return self.finish()

    def supervise(self) -> None:
        last_plain = 0.0
        while True:
            if self.stop.wait(0.25):
                raise Interrupted
            self.progress.poll()
            self._poll_versions()
            self._inject_kills()
            if self.config.elastic:
                self._poll_scale()
                self._reap_leaving()
            for task in list(self.supervisor.tasks.values()):
                code = task.poll()
                if code is None or task.name in self.done:
                    continue
                if self.supervisor.tasks.get(task.name) is not task:
                    continue  # replaced by a restart in this pass
                if task.name in self.leaving:  # asked to leave: gone, whatever its code
                    del self.leaving[task.name]
                    self.done.add(task.name)
                    self.events.log(
                        step=self.progress.step, event="worker_left", target=task.name, code=code
                    )
                    continue
                if code == 0 and task.name.startswith("worker"):
                    self.done.add(task.name)
                    for index in sorted(self.restored_ps):  # it may have left a dead process
                        server = self.supervisor.tasks.get(f"ps{index}")
                        if server is not None and server.poll() is None:  # else: told on restart
                            self._tell_finished(index, [TaskId.parse(task.name).index])
                    continue
                self._handle_failure(task, code)
                break  # a restart may have replaced other tasks: look again
            now = time.monotonic()
            if (self.console.tty or now - last_plain >= 10.0) and self.progress.samples:
                self.console.status(self.progress.render())
                last_plain = now
            if not self.leaving and all(f"worker{i}" in self.done for i in self.active):
                return

    def _inject_kills(self) -> None:
        for fault in list(self.kills_pending):
            if self.progress.step >= (fault.step or 0):
                self.kills_pending.remove(fault)
                task = self.supervisor.tasks.get(fault.task)
                if task is not None and task.poll() is None:
                    target = TaskId.parse(fault.task)
                    if target.job == "ps":
                        self._read_version(target.index)
                    self.console.note(
                        f"[distsgd] fault injected: SIGKILL {fault.task} (pid {task.pid}) "
                        f"at step {self.progress.step}"
                    )
                    self.events.log(
                        step=self.progress.step,
                        event="fault_injected",
                        fault="kill",
                        target=fault.task,
                    )
                    task.kill()

    def _handle_failure(self, task: TaskHandle, code: int) -> None:
        step = self.progress.step
        if code == DIVERGED_EXIT_CODE and task.name.startswith("worker"):
            self._fault(task.name, code, step, "stop", diverged=True)
            self.progress.poll()
            reason = self.progress.divergence or f"{task.name} stopped on a non-finite loss"
            record = {"scheme": self.config.scheme, "diverged": True, "divergence": reason}
            write_atomic(self.run_dir / RESULT_FILE, json.dumps(record, indent=2) + "\n")
            raise Diverged(reason)
        if code == SETUP_EXIT_CODE and task.name.startswith("worker"):
            self._fault(task.name, code, step, "stop")
            said = [line for line in task.tail if SETUP_ERROR_PREFIX in line]
            cause = said[-1].split(SETUP_ERROR_PREFIX, 1)[1] if said else "see its log"
            raise RunFailed(f"{task.name}: {cause}", status=RunStatus.SETUP_ERROR)
        if time.monotonic() - self.started_at.get(task.name, 0.0) >= self.config.healthy_seconds:
            self.restarts[task.name] = 0  # it ran healthy since its last restart: a new fault
        used = self.restarts.get(task.name, 0)
        if used >= self.config.max_restarts and self._can_drop(task.name):
            self._fault(task.name, code, step, "drop", workers=len(self.active) - 1)
            index = TaskId.parse(task.name).index
            self.active.discard(index)
            self.done.add(task.name)
            for shard in range(self.num_ps):  # it cannot leave itself: its work goes back now
                self._tell_finished(shard, [index])
            self.console.note(
                f"[distsgd] {task.name} failed (exit code {code}) with no restarts left; the "
                f"run goes on with {len(self.active)} workers (--min-workers "
                f"{self.config.lowest_workers})"
            )
            return
        if used >= self.config.max_restarts:
            tail = "\n".join(f"    {line}" for line in task.tail)
            self._fault(task.name, code, step, "stop")
            how = "" if self.config.max_restarts == 0 else f" and has used its {used} restarts"
            resume = ""
            if self.latest() is not None:
                resume = f"\nresume with: distsgd run --resume {self.run_dir}"
            head = f"task {task.name} failed (exit code {code}){how}"
            raise RunFailed(
                f"{head}; its last log lines:\n{tail}\nfull logs: {self.run_dir / 'logs'}{resume}",
                reason=head,
                log_tail=tuple(task.tail),
            )
        self.restarts[task.name] = used + 1
        backoff = 0.0 if used == 0 else min(0.5 * 2 ** (used - 1), 10.0)
        self.console.note(
            f"[distsgd] {task.name} died (exit code {code}); "
            f"restart {used + 1} of {self.config.max_restarts} in {backoff:.1f}s"
        )
        if self.stop.wait(backoff):
            raise Interrupted
        restart = TaskId.parse(task.name)
        try:
            if restart.job == "ps":
                self._restart_ps(restart.index, code, step)
            elif self.collective:
                self._restart_all(task.name, code, step, "collective schemes restart every worker")
            else:
                self._restart_worker(restart.index, code, step)
        except CheckpointError as exc:  # e.g. a checkpoint file that holds code
            raise RunFailed(f"{task.name} cannot be restarted: {exc}") from None
        _write_tasks(self.run_dir, self.supervisor)

    # -- elastic runs ---------------------------------------------------------------------------
    def _can_drop(self, name: str) -> bool:
        """(Elastic parameter-server run) whether a worker out of restarts may be left out:
        not the chief, and enough workers left."""
        task = TaskId.parse(name)
        return (
            self.config.elastic
            and not self.collective
            and task.job == "worker"
            and task.index != 0
            and len(self.active) - 1 >= self.config.lowest_workers
        )

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
        self._restart_all(
            "launcher", 0, self.progress.step, f"the run changes size to {workers} workers"
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

    def _fault(self, target: str, code: int, step: int, action: str, **cost: Any) -> None:
        """One ``metrics.jsonl`` record per fault: which task, when, what was done, what it cost."""
        self.events.log(
            step=step, event="fault", target=target, exit_code=code, action=action, **cost
        )

    def _restart_worker(self, index: int, code: int, step: int) -> None:
        name = f"worker{index}"
        resume = newest_worker_state(self.ckpt_root, index) if self.checkpointing else None
        # Its last metrics line says how far it got: every step up to there was pushed to the
        # servers, so the restarted worker continues there instead of redoing them (only the
        # steps after that line, fewer than log_every, are done again).
        reached = self.progress.local_steps.get(name, 0)
        resumed_at = 0 if resume is None else worker_state_step(resume)
        self._fault(
            name,
            code,
            step,
            "restart",
            resumed_from=None if resume is None else str(resume),
            continued_at=max(reached, resumed_at),
            lost_steps=0,
        )
        self.start_worker(index, resume=resume, continue_at=reached)

    def _poll_versions(self) -> None:
        """About once a second: each live server's version (see :attr:`seen_versions`)."""
        if self.collective or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + 1.0
        for index in range(self.num_ps):
            self._read_version(index)

    def _read_version(self, index: int) -> pb.InfoResponse | None:
        """ps ``index``'s Info (None if it does not answer at once), its version remembered."""
        task = self.supervisor.tasks.get(f"ps{index}")
        if task is None or task.poll() is not None:
            return None
        try:
            with ShardClient(
                self.spec.address(self.spec.task("ps", index)),
                run_id=self.run_id,
                timeout=2.0,
                retry_seconds=0.0,
                secret=self.secret,
                tls=self.config.tls,
            ) as client:
                reply = client.info(retry=False)
        except RemoteError:
            return None
        if reply.registered:
            self.seen_versions[index] = max(self.seen_versions.get(index, 0), reply.version)
        return reply

    def _restart_ps(self, index: int, code: int, step: int) -> None:
        """Restart ps ``index`` from its write-ahead log or its newest shard file (the server
        takes the newer); the whole cluster when it has neither. The fault record compares the
        version it comes back at with the one last read from the dead server."""
        shard_file = newest_shard_file(self.ckpt_root, index)
        logged = self.config.wal and wal.has_state(self.wal_root / f"ps{index}")
        if shard_file is None and not logged:
            self._restart_all(f"ps{index}", code, step, "no checkpoint to restore the shard from")
            return
        seen = self.seen_versions.pop(index, None)  # the dead server's, read before it died
        address = self.spec.address(self.spec.task("ps", index))
        try:
            self.start_ps(index, address=address, restore=shard_file)
        except RunFailed as exc:  # e.g. its old port was taken meanwhile, or an unreadable log
            self._restart_all(f"ps{index}", code, step, f"ps{index} could not come back: {exc}")
            return
        filed = -1 if shard_file is None else int(read_shard_header(shard_file)["version"])
        info = self._read_version(index)
        restored = filed if info is None else int(info.restored_version)
        source = "wal" if shard_file is None or restored > filed else shard_file.parent.name
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
        self.seen_versions[index] = restored
        self.restored_ps.add(index)
        self._tell_finished(index, sorted(TaskId.parse(name).index for name in self.done))

    def _tell_finished(self, index: int, finished: list[int]) -> None:
        """A restored shard remembers the workers that had left when its file was saved; tell
        it about those that have finished since (their processes are gone and cannot): the
        ones done now, and each one that exits later (it may have left the dead process just
        before the kill, or the restored one while the launcher was restarting it)."""
        address = self.spec.address(self.spec.task("ps", index))
        for worker in finished:
            try:
                with ShardClient(
                    address,
                    worker=worker,
                    run_id=self.run_id,
                    timeout=10.0,
                    retry_seconds=10.0,
                    secret=self.secret,
                    tls=self.config.tls,
                ) as client:
                    client.leave()
            except RemoteError as exc:
                self.console.note(
                    f"[distsgd] could not tell ps{index} that worker{worker} left: {exc}"
                )

    def _restart_all(self, name: str, code: int, step: int, why: str) -> None:
        checkpoint = self.latest()
        self.console.note(
            f"[distsgd] restarting the whole cluster ({why}) "
            f"from {checkpoint.path.name if checkpoint else 'the start'}"
        )
        self.supervisor.stop()
        self.supervisor.forget()
        self.done.clear()
        self.restored_ps.clear()
        at = 0 if checkpoint is None else checkpoint.step
        self._fault(
            name,
            code,
            step,
            "restart_all",
            resumed_from=None if checkpoint is None else checkpoint.path.name,
            lost_steps=max(0, max(self.progress.local_steps.values(), default=0) - at),
        )
        self.start_cluster(checkpoint, fresh_ports=True)

    def finish(self) -> RunOutcome:
        self.progress.poll()
        self.console.clear_status()
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
        split = self.progress.split_summary()
        if split:
            self.console.final(f"[distsgd] {split}")
            result["time_split"] = {k: round(v, 4) for k, v in self.progress.total_split().items()}
            write_atomic(result_path, json.dumps(result, indent=2) + "\n")
        if result.get("test_accuracy") is not None:
            self.console.final(f"test accuracy: {result['test_accuracy']:.4f}")
        elif result.get("test_loss") is not None:
            self.console.final(f"test loss: {result['test_loss']:.4f}")
        reason = result.get("divergence") or self.progress.divergence
        if result.get("diverged") or reason:
            if not result.get("diverged"):  # another worker's loss ended above its start
                result.update(diverged=True, divergence=reason)
                write_atomic(result_path, json.dumps(result, indent=2) + "\n")
            raise Diverged(str(reason), stalled=bool(result.get("stalled")))
        return RunOutcome(
            status=RunStatus.OK, run_dir=self.run_dir, result_path=result_path, result=result
        )


def _wait_for_address(task: TaskHandle, path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if task.poll() is not None:
            last = tuple(task.tail)[-5:]
            tail = "\n".join(f"    {line}" for line in last)
            head = f"{task.name} exited with code {task.poll()} before it was listening"
            raise RunFailed(
                f"{head}; its last log lines:\n{tail}\nfull log: {task.log_path}",
                reason=head,
                log_tail=last,
            )
        time.sleep(0.02)
    raise RunFailed(f"{task.name} did not report its address within {timeout:.0f}s")


def load_run_config(run_dir: Path) -> dict[str, Any]:
    """The saved ``config.json`` of a run folder (for ``--resume``)."""
    path = run_dir / CONFIG_FILE
    try:
        saved = dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(
            f"{run_dir} is not a distsgd run folder (no {CONFIG_FILE}); "
            "give the folder of an earlier run"
        ) from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: damaged ({exc})") from None
    needed = (
        "script",
        "script_args",
        "scheme",
        "scheme_options",
        "overrides",
        "workers",
        "ps",
        "run_id",
    )
    missing = [key for key in needed if key not in saved]
    if missing:
        raise ValueError(f"{path}: damaged (no {', '.join(missing)}); it cannot be resumed")
    return saved
