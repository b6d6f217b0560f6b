"""``distsgd run``: a whole cluster on this machine, supervised from start to stop.

Order of events: parameter servers start on port 0 and report their real addresses; the cluster
spec is written to the run folder; for collective schemes the launcher hosts the rendezvous
store; workers start; the launcher relays their logs and shows progress until every worker has
exited. Whatever happens (success, a failed task, Ctrl-C, SIGTERM) every task is stopped in a
``finally`` before the launcher returns.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from distsgd.cluster import ClusterSpec
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.progress import Console, Progress
from distsgd.launcher.supervisor import Supervisor, Task
from distsgd.runtime.loop import METRICS_FILE, RESULT_FILE
from distsgd.runtime.task import ENV_VAR, TaskEnv
from distsgd.util import write_atomic

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class RunFailed(RuntimeError):
    """A task failed or the run could not start; the message says which and why."""


def _task_env(config: LaunchConfig, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            PARENT_ENV: str(os.getpid()),
            "DISTSGD_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop(ENV_VAR, None)
    return env


def _wait_for_address(task: Task, path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if task.poll() is not None:
            raise RunFailed(f"{task.name} exited with code {task.poll()} before it was listening")
        time.sleep(0.02)
    raise RunFailed(f"{task.name} did not report its address within {timeout:.0f}s")


def launch(config: LaunchConfig, console: Console | None = None) -> int:
    """Run ``config`` to the end; returns the exit code (0, 1 failed, 130 interrupted)."""
    console = console or Console(quiet=config.quiet)
    run_dir = config.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    supervisor = Supervisor(log_dir=run_dir / "logs", echo=console.line)
    store_holder: list[Any] = []  # keeps the rendezvous store alive for the run
    try:
        return _run(config, console, run_dir, supervisor, stop, store_holder)
    except RunFailed as exc:
        console.final(f"distsgd: error: {exc}")
        return EXIT_FAILED
    finally:
        supervisor.stop()
        store_holder.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _write_tasks(run_dir, supervisor)


def _write_tasks(run_dir: Path, supervisor: Supervisor) -> None:
    """``tasks.json``: the PID of every task, for diagnostics and for tests that check cleanup."""
    pids = {t.name: t.pid for t in supervisor.tasks.values()}
    write_atomic(run_dir / "tasks.json", json.dumps(pids) + "\n")


def _run(
    config: LaunchConfig,
    console: Console,
    run_dir: Path,
    supervisor: Supervisor,
    stop: threading.Event,
    store_holder: list[Any],
) -> int:
    num_ps, threads = config.num_ps, config.threads_per_worker
    env = _task_env(config, threads)
    ps_env = {**env, "DISTSGD_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run_id = secrets.token_hex(8)
    write_atomic(
        run_dir / "config.json",
        json.dumps(
            {
                "script": config.script,
                "script_args": list(config.script_args),
                "scheme": config.scheme,
                "scheme_options": config.scheme_options,
                "overrides": config.overrides,
                "workers": config.workers,
                "ps": num_ps,
                "threads_per_worker": threads,
                "run_id": run_id,
            },
            indent=2,
        )
        + "\n",
    )
    # 1. Parameter servers on port 0; each reports the address it really bound.
    init_spec = ClusterSpec.local(num_workers=config.workers, num_ps=num_ps, host=config.host)
    write_atomic(run_dir / "cluster-init.json", json.dumps(init_spec.to_dict()) + "\n")
    ps_tasks = []
    for i in range(num_ps):
        addr_file = run_dir / f"ps{i}.address"
        addr_file.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "distsgd",
            "server",
            "--job",
            "ps",
            "--task",
            str(i),
            "--cluster",
            str(run_dir / "cluster-init.json"),
            "--address-file",
            str(addr_file),
        ]
        ps_tasks.append((supervisor.start(f"ps{i}", argv, ps_env), addr_file))
    spec = init_spec
    for i, (task, addr_file) in enumerate(ps_tasks):
        spec = spec.with_address(spec.task("ps", i), _wait_for_address(task, addr_file, 60.0))
    # 2. Rendezvous store for collective schemes, hosted here so no worker needs a fixed port.
    rendezvous = ""
    if num_ps == 0 and config.workers > 1:
        from torch.distributed import TCPStore

        store = TCPStore(
            config.host,
            0,
            None,
            True,
            timedelta(seconds=config.wait_timeout),
            wait_for_workers=False,
        )
        store_holder.append(store)
        rendezvous = f"{config.host}:{store.port}"
    write_atomic(run_dir / "cluster.json", json.dumps(spec.to_dict(), indent=2) + "\n")
    # 3. Workers.
    workers = []
    for i in range(config.workers):
        task_env = TaskEnv(
            cluster=spec.to_dict(),
            task_index=i,
            scheme=config.scheme,
            scheme_options=config.scheme_options,
            overrides=config.overrides,
            run_dir=str(run_dir.resolve()),
            run_id=run_id,
            rendezvous=rendezvous,
            wait_timeout=config.wait_timeout,
        )
        argv = [
            sys.executable,
            "-m",
            "distsgd.launcher.bootstrap",
            config.script,
            *config.script_args,
        ]
        workers.append(supervisor.start(f"worker{i}", argv, {**env, ENV_VAR: task_env.to_json()}))
    _write_tasks(run_dir, supervisor)
    console.line(
        f"[distsgd] run {run_dir}: scheme {config.scheme}, {config.workers} workers, {num_ps} ps, "
        f"{threads} threads per worker"
    )
    # 4. Supervise until every worker is done.
    progress = Progress(run_dir / METRICS_FILE)
    last_plain = 0.0
    while True:
        if stop.wait(0.25):
            console.final(f"distsgd: interrupted; stopping {len(supervisor.tasks)} tasks")
            return EXIT_INTERRUPTED
        failed = supervisor.failed()
        if failed is None:
            for task, _ in ps_tasks:
                if task.poll() is not None:
                    failed = task
        if failed is not None:
            supervisor.stop()
            tail = "\n".join(f"    {line}" for line in failed.tail)
            raise RunFailed(
                f"task {failed.name} failed (exit code {failed.poll()}); "
                f"its last log lines:\n{tail}\n"
                f"full logs: {run_dir / 'logs'}"
            )
        progress.poll()
        now = time.monotonic()
        if console.tty or now - last_plain >= 10.0:
            if progress.samples:
                console.status(progress.render())
            last_plain = now
        if all(task.poll() == 0 for task in workers):
            break
    progress.poll()
    console.clear_status()
    supervisor.stop()  # the parameter servers; their last words come before the result
    result_path = run_dir / RESULT_FILE
    if not result_path.exists():
        raise RunFailed(f"the workers finished but the chief wrote no {RESULT_FILE} in {run_dir}")
    result = json.loads(result_path.read_text())
    console.final(
        f"[distsgd] done in {progress.elapsed:.0f}s: {result['global_step']} updates, "
        f"{result['local_steps']} steps on worker0; run folder {run_dir}"
    )
    if result.get("test_accuracy") is not None:
        console.final(f"test accuracy: {result['test_accuracy']:.4f}")
    elif result.get("test_loss") is not None:
        console.final(f"test loss: {result['test_loss']:.4f}")
    return EXIT_OK
