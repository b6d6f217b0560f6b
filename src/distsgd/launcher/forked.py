"""The launcher's end of the fork server (:mod:`distsgd.launcher.zygote`): :class:`ForkServer`
starts it and asks it for tasks, :class:`ForkedTask` is one task it forked (a
:class:`~distsgd.launcher.supervisor.TaskHandle`, like a Popen'd
:class:`~distsgd.launcher.supervisor.Task`)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from distsgd.control.task import ENV_VAR as TASK_ENV
from distsgd.launcher.lifeline import PARENT_ENV, alive
from distsgd.launcher.zygote import (
    FORKABLE,
    MAX_MESSAGE,
    PRELOAD_ENV,
    PRELOAD_OPTIMIZER,
    PRELOAD_TORCH,
    ProtocolError,
    Report,
    encode,
    int_field,
    launcher_watch,
    load_message,
    parse_report,
)
from distsgd.transport.security import SECRET_ENV
from distsgd.util import open_private
from distsgd.util.proctitle import TITLE_ENV, task_title

log = logging.getLogger(__name__)

READY_TIMEOUT = 300.0
"""Seconds the launcher waits for the server's imports (a loaded machine is slow)."""
REPLY_TIMEOUT = 120.0
"""Seconds it waits for the answer to one request (a fork takes milliseconds; past this the
server counts as gone, and is ended)."""
SERVER_ENV_DROP = (TASK_ENV, SECRET_ENV, "DISTSGD_THREADS", "CUDA_VISIBLE_DEVICES")
"""Task settings the server itself is started without (each task gets its whole environment)."""
TEMPLATE_ENV = "DISTSGD_FORK_TEMPLATE"
"""The path of a fork-server template's socket (:mod:`distsgd_emulate.fork_template`), for
launchers to find it by (unset: none is used)."""
ASK_TIMEOUT = 10.0
"""Seconds a launcher waits for the template's answer (a fork takes milliseconds)."""


def ask(path: str, launcher: int, title: str, server_fd: int, out_fd: int) -> int:
    """(In the launcher) have the template at ``path`` fork a fork server for ``launcher``
    that talks on ``server_fd`` and writes to ``out_fd``; its PID. :class:`OSError` where
    the template cannot be reached or refuses (the launcher then starts a server itself)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(ASK_TIMEOUT)
        conn.connect(path)
        message = encode({"launcher": launcher, "title": title})
        socket.send_fds(conn, [message], [server_fd, out_fd])
        answer = load_message(conn.recv(MAX_MESSAGE))
    if set(answer) == {"pid"}:
        return int_field(answer, "pid", low=1)
    raise OSError(f"the fork-server template at {path} refused: {answer.get('error', answer)}")


class ForkServerGone(RuntimeError):
    """The fork server is not there (it ended, or never became ready): start processes."""


class ForkRefused(RuntimeError):
    """The fork server refused a request (its reason as the text)."""


def forkable(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` where ``argv`` is ``python -m MODULE ARGS`` for a module the server
    runs (the worker bootstrap), else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in FORKABLE:
        return argv[2], list(argv[3:])
    return None


class ForkServer:
    """One fork server, started by :meth:`spawn`; safe to use from several threads."""

    def __init__(self, process: subprocess.Popen[bytes] | Adopted, sock: socket.socket) -> None:
        self.process = process
        self._sock = sock
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ready = False
        self._gone = False
        self._next_id = 0
        self._replies: dict[int, Report] = {}
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(
        cls, env: Mapping[str, str], log_path: Path, *, preload_optimizer: bool = True
    ) -> ForkServer:
        """Start a server (it imports in the background) with the environment ``env`` less
        each task's own settings, its output going to ``log_path``; ``preload_optimizer``:
        it imports what torch.optim needs too (:data:`~distsgd.launcher.zygote.PRELOAD_ENV`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = {k: v for k, v in env.items() if k not in SERVER_ENV_DROP}
        server_env.update({PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
        server_env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        server_env[PRELOAD_ENV] = PRELOAD_OPTIMIZER if preload_optimizer else PRELOAD_TORCH
        server_env[TITLE_ENV] = task_title("fork-server", log_path.parent.name)
        with theirs, os.fdopen(open_private(log_path, os.O_WRONLY | os.O_APPEND), "ab") as out:
            path = env.get(TEMPLATE_ENV)
            if path:  # one forked, its imports done, from a template (if it answers)
                try:
                    title = server_env[TITLE_ENV]
                    pid = ask(path, os.getpid(), title, theirs.fileno(), out.fileno())
                    log.debug("fork server pid %d forked from the template at %s", pid, path)
                    return cls(Adopted(pid), ours)
                except OSError as exc:
                    log.debug("fork-server template at %s: %s; starting a server", path, exc)
            process = subprocess.Popen(
                [sys.executable, "-m", "distsgd.launcher.zygote", str(theirs.fileno())],
                env=server_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        log.debug("fork server started as pid %d", process.pid)
        return cls(process, ours)

    # -- reading the server's reports -------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                break
            if not data:
                break
            try:
                report = parse_report(data)
            except ProtocolError as exc:
                log.warning("fork server sent a bad report (%s); not using it any more", exc)
                break
            with self._cond:
                self._apply(report)
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def _apply(self, report: Report) -> None:
        if report.ready:
            self._ready = True
        elif report.id is not None:
            self._replies[report.id] = report
        elif report.exit is not None:
            self._exits[report.pid] = report.exit

    def wait_ready(self, timeout: float | None) -> bool:
        """Whether the server has done its imports and takes requests, waiting up to
        ``timeout`` seconds for it (False: not yet, or it has ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._gone, timeout)
            return self._ready and not self._gone

    # -- asking for a task ------------------------------------------------------------------------
    def fork(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        out_fd: int,
        ready_timeout: float = READY_TIMEOUT,
    ) -> int:
        """Fork a task running ``python -m module args`` in ``cwd`` with the whole environment
        ``env``, its stdout and stderr on ``out_fd``; its PID. Raises :class:`ForkServerGone`
        or :class:`ForkRefused`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._gone, ready_timeout):
                raise ForkServerGone(f"the fork server was not ready within {ready_timeout:.0f}s")
            if self._gone:
                raise ForkServerGone("the fork server has ended")
            self._next_id += 1
            request_id = self._next_id
        message = encode(
            {
                "op": "fork",
                "id": request_id,
                "module": module,
                "args": list(args),
                "env": dict(env),
                "cwd": str(Path(cwd).resolve()),
            }
        )
        if len(message) > MAX_MESSAGE:
            raise ForkRefused(f"the request is {len(message)} bytes, over {MAX_MESSAGE}")
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [message], [out_fd])
        except OSError as exc:
            raise ForkServerGone(f"could not reach the fork server: {exc}") from None
        with self._cond:
            done = self._cond.wait_for(
                lambda: request_id in self._replies or self._gone, REPLY_TIMEOUT
            )
            reply = self._replies.pop(request_id, None)
        if reply is None:
            raise ForkServerGone("the fork server did not answer" if done else "no answer in time")
        if reply.error:
            raise ForkRefused(reply.error)
        return reply.pid

    # -- the tasks' ends --------------------------------------------------------------------------
    @property
    def gone(self) -> bool:
        """Whether the server has ended (or its end of the socket is closed)."""
        return self._gone

    def exit_code(self, pid: int) -> int | None:
        """How task ``pid`` ended, or None while it runs. A task the server can no longer
        report on (it ended first) counts as ended with code 1 once its process is gone."""
        with self._cond:
            code = self._exits.get(pid)
            if code is not None or not self._gone:
                return code
        return None if alive(pid) else 1

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """Task ``pid``'s exit code once it has ended, or None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)
        while True:
            code = self.exit_code(pid)
            if code is not None or (deadline is not None and time.monotonic() >= deadline):
                return code
            time.sleep(0.05)

    def close(self, grace: float = 5.0) -> None:
        """End the server: it stops any task still running, then exits."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=grace)
        self._sock.close()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("fork server (pid %d) did not exit; killing it", self.process.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Adopted:
    """A fork server forked from a template (:mod:`distsgd_emulate.fork_template`): not this
    process's child, so its end is watched through a pidfd (its exit code is the template's
    to collect; it reports its tasks' own)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._watch = launcher_watch(pid)

    def wait(self, timeout: float | None = None) -> int:
        """0 once the server has ended; :class:`subprocess.TimeoutExpired` after ``timeout``."""
        if self.poll(timeout) is None:
            raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
        return 0

    def poll(self, timeout: float | None = 0.0) -> int | None:
        """0 once the server has ended, else None (waiting up to ``timeout`` seconds)."""
        if self._watch is not None:
            if not select.select([self._watch], [], [], timeout)[0]:
                return None
            os.close(self._watch)
            self._watch = None
        return 0


@dataclass
class ForkedTask:
    """One task forked by the fork server."""

    name: str
    server: ForkServer
    pid: int
    log_path: Path
    stream: IO[bytes]
    """The read end of the task's stdout and stderr."""
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    reader: threading.Thread | None = None

    def poll(self) -> int | None:
        return self.server.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the task has ended, or None after ``timeout`` seconds."""
        return self.server.wait(self.pid, timeout)

    def kill(self) -> None:
        """SIGKILL the task (``--inject-fault kill``)."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def interrupt(self) -> None:
        self._signal(signal.SIGINT)

    def _signal(self, signum: signal.Signals) -> None:
        if self.poll() is None:  # not a PID the server has reaped (and may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)
