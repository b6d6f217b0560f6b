"""Start task processes, relay their output with a role prefix, and stop every one of them.

Each task runs in its own session (process group), so the launcher alone decides when it stops:
Ctrl-C reaches the launcher, which then ends each task's group by its PID, politely (SIGTERM)
and then firmly (SIGKILL). Nothing is ever killed by name.

With a fork server (``fork_server_log`` given) a worker task (``python -m
distsgd.launcher.bootstrap``) is forked by :mod:`distsgd.launcher.zygote`, which has imported
torch once for the whole run, instead of starting a new interpreter; other tasks, and every
task once the server is gone, are started as processes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from distsgd.launcher.forked import (
    READY_TIMEOUT,
    ForkedTask,
    ForkRefused,
    ForkServer,
    ForkServerGone,
    forkable,
)
from distsgd.launcher.waits import said_while_slow
from distsgd.util import open_private, private_dir

log = logging.getLogger(__name__)


class TaskHandle(Protocol):
    """What the launcher reads of a started task, local or remote (a Ray actor's)."""

    name: str
    log_path: Path
    tail: collections.deque[str]

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def terminate(self) -> None:
        """Ask the task to stop (SIGTERM to its process: a worker of an elastic run finishes
        its step, hands its work back and leaves)."""

    def interrupt(self) -> None:
        """Ask the task to stop and save (SIGINT to its process: a parameter-server worker
        with checkpoints finishes its step and push, saves its state and leaves; the chief
        then has the servers saved: the launcher's Ctrl-C)."""


class Tasks(Protocol):
    """Starts, watches and stops the tasks of one run: :class:`Supervisor` (local processes)
    or :class:`~distsgd.launcher.engines.ray.RaySupervisor` (Ray actors)."""

    @property
    def tasks(self) -> Mapping[str, TaskHandle]: ...

    @property
    def control_host(self) -> str | None:
        """The address of this machine that the tasks reach the launcher's run control at,
        where they may not share its disk (None: they do; they write the run folder)."""

    @property
    def machines(self) -> int:
        """How many machines the engine may put tasks on (1: this one)."""

    @property
    def node_host(self) -> str | None:
        """What the tasks' addresses say for their host where the engine puts each task's own
        in its place (Ray: its node's); None: the launcher's ``--host``."""

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> TaskHandle: ...

    def stop(self, names: Sequence[str] | None = None, *, grace: float = 2.0) -> None: ...

    def forget(self) -> None:
        """Drop every stopped task (before the whole cluster starts again)."""

    def prepare(self, env: Mapping[str, str]) -> None:
        """Start ahead what the workers will need (the fork server, whose imports take
        seconds, while the launcher does the rest of the start), with the workers' ``env``."""

    def close(self) -> None: ...


@dataclass
class Task:
    """One started process."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stream(self) -> IO[bytes]:
        """The read end of the task's stdout and stderr."""
        assert self.process.stdout is not None
        return self.process.stdout

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the task has ended, or None after ``timeout`` seconds."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the task (``--inject-fault kill``)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGTERM)

    def interrupt(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGINT)


class Supervisor:
    """Owns the task processes of one run."""

    def __init__(
        self,
        *,
        log_dir: Path,
        echo: Callable[[str], None],
        note: Callable[[str], None] | None = None,
        fork_server_log: Path | None = None,
        preload_optimizer: bool = True,
    ) -> None:
        self.log_dir = log_dir
        self.echo = echo
        self.note = note
        """Where the launcher's own lines go (a long wait for the fork server is said there)."""
        self.tasks: dict[str, Task | ForkedTask] = {}
        self.control_host: str | None = None
        """Its tasks share this machine's disk: no run control (emulated hosts add one)."""
        self.node_host: str | None = None
        """Its tasks bind the launcher's ``--host`` (or their emulated host's)."""
        self.machines = 1
        """Its tasks run on this machine (emulated hosts are the launcher's to count)."""
        self.preload_optimizer = preload_optimizer
        """Whether the fork server imports what torch.optim needs before forking (every
        worker builds an optimizer, its own or :class:`~distsgd.runtime.rates.ServerRate`;
        tests of the fork server itself leave it out)."""
        self.fork_server_log = fork_server_log
        """Where the fork server's own output goes; None: no fork server, every task is a
        process (it is started by :meth:`prepare` as the cluster starts, or with the first worker
        task, and this is None once it is gone)."""
        self._server: ForkServer | None = None

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], *, cwd: Path | None = None
    ) -> Task | ForkedTask:
        private_dir(self.log_dir)
        log_path = self.log_dir / f"{name}.log"
        task: Task | ForkedTask | None = self._fork(name, argv, env, cwd=cwd, log_path=log_path)
        if task is None:
            process = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            task = Task(name=name, process=process, log_path=log_path)
        task.reader = threading.Thread(
            target=self._relay, args=(task,), name=f"relay-{name}", daemon=True
        )
        task.reader.start()
        self.tasks[name] = task
        log.debug("started %s as pid %d", name, task.pid)
        return task

    def _fork(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: Path | None,
        log_path: Path,
    ) -> ForkedTask | None:
        """The task forked by the fork server, or None where it is to be a new process (no
        server, not a worker's command line, or the server is gone or refused it)."""
        server_log = self.fork_server_log
        command = forkable(argv)
        if command is None or server_log is None:
            return None
        self.prepare(env)
        if self._server is None or self.fork_server_log is None:
            return None
        if not self._server.wait_ready(0):  # its imports: a minute on a loaded machine
            what = f"the fork server to import torch before it starts {name} ({server_log})"
            with said_while_slow(self.note, what):
                self._server.wait_ready(READY_TIMEOUT)
        read_fd, write_fd = os.pipe()
        try:
            pid = self._server.fork(*command, env=env, cwd=cwd or Path.cwd(), out_fd=write_fd)
        except (ForkServerGone, ForkRefused) as exc:
            os.close(read_fd)
            if isinstance(exc, ForkServerGone):
                log.warning("%s; starting tasks as new processes from now on", exc)
                self.fork_server_log = None
                # one that is only slow must not fork this task later, beside its new process
                self._server.close()
            else:
                log.warning("the fork server refused %s (%s); starting it as a process", name, exc)
            return None
        finally:
            os.close(write_fd)
        stream = os.fdopen(read_fd, "rb")
        return ForkedTask(name=name, server=self._server, pid=pid, log_path=log_path, stream=stream)

    def prepare(self, env: Mapping[str, str]) -> None:
        """Start the fork server (it imports in the background) unless it runs already, or
        this supervisor has none; one that cannot start leaves every task a process."""
        if self._server is None and self.fork_server_log is not None:
            try:
                self._server = ForkServer.spawn(
                    env, self.fork_server_log, preload_optimizer=self.preload_optimizer
                )
            except OSError as exc:
                log.warning("could not start the fork server (%s); starting processes", exc)
                self.fork_server_log = None

    def _relay(self, task: Task | ForkedTask) -> None:
        stream = task.stream
        with os.fdopen(open_private(task.log_path, os.O_WRONLY | os.O_APPEND), "ab") as log_file:
            for raw in iter(stream.readline, b""):
                log_file.write(raw)
                log_file.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                task.tail.append(line)
                self.echo(f"[{task.name}] {line}")
        stream.close()

    def close(self) -> None:
        """Stop every task (the Ray supervisor also leaves its cluster here), then the fork
        server."""
        try:
            self.stop()
        finally:
            if self._server is not None:
                self._server.close()
                self._server = None

    def forget(self) -> None:
        self.tasks.clear()

    def stop(self, names: Sequence[str] | None = None, *, grace: float = 2.0) -> None:
        """End the named tasks (default: all): SIGTERM to each group, SIGKILL after ``grace``."""
        tasks = [self.tasks[n] for n in names] if names is not None else list(self.tasks.values())
        for task in tasks:
            if task.poll() is None:
                _signal_group(task.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for task in tasks:
            if task.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                log.warning("%s did not stop within %.0fs; killing it", task.name, grace)
        for task in tasks:
            # Also reap stragglers left in the task's own group (e.g. a data-loader child).
            _signal_group(task.pid, signal.SIGKILL)
            task.wait()
            if task.reader is not None:
                task.reader.join(timeout=2.0)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group we created for a task (its id is the task's PID)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
