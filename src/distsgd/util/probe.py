"""A task's answer to ``distsgd doctor``: its Python stacks and its distsgd state, on request.

Every task of a run (launcher, parameter servers, workers) holds a :class:`Probe`: one daemon
thread blocked in ``accept`` on a Unix socket. It costs nothing until asked: no timer, no
polling, nothing on the training path. Asked, it answers one JSON object: the process, each
thread's stack (``sys._current_frames``: file, line, function, the source line), and what the
task's providers say of its state (the calls it has in flight, the synchronous step a server
holds open and whom it waits for, the phase a worker is in ...; :meth:`Probe.add`).

**Where.** The socket sits in a folder of this user's own (mode 0700) under the system's
temporary folder, as a Unix socket's path has at most 107 bytes; a pointer file
``<folder>/<task>.json`` (the run folder's ``doctor/``: :data:`FOLDER`) names it, with the PID.
A Unix socket is a file: emulated hosts (network namespaces) share it with the machine, so the
doctor reaches a task on a host cut off from the network.

**Safety.** Only a peer with this process's user id is answered (``SO_PEERCRED``); a request is
one line of at most :data:`MAX_REQUEST` bytes, read with a timeout, and asks for nothing but
the report: nothing in it runs or changes anything. No pickle crosses the socket.

A task that cannot answer (stopped by SIGSTOP, or a thread holding the interpreter's lock in
C code) is told apart by the doctor from outside (``/proc``), not here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import linecache
import logging
import os
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from distsgd.util.atomic import private_dir, write_atomic

log = logging.getLogger(__name__)

FOLDER = "doctor"
"""The run folder's subfolder that holds the tasks' pointer files (and the doctor's reports)."""
DIR_ENV = "DISTSGD_DOCTOR_DIR"
"""The folder a task's pointer file goes to, where no run folder says it (a task started by
hand, a parameter server): the launcher sets it for every task it starts."""
MAX_REQUEST = 1024
"""Bytes of the longest request line a probe reads."""
ANSWER_TIMEOUT = 2.0
"""Seconds a probe gives a peer to send its request and read the answer."""
MAX_FRAMES = 64
"""Frames of one thread's stack in a report (the innermost ones)."""
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_dir() -> Path:
    """This user's folder of probe sockets (made 0700), short enough for any socket name;
    :class:`PermissionError` where one already there is not a folder of this user's alone
    (another user made it first: its sockets could be swapped)."""
    folder = private_dir(Path(tempfile.gettempdir()) / f"distsgd-doctor-{os.getuid()}")
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a folder of this user's alone (mode 0700)")
    return folder


def stacks() -> list[dict[str, Any]]:
    """Every thread's stack, innermost frame last, the main thread first."""
    names = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        out.append(
            {
                "thread": thread.name if thread is not None else f"thread-{ident}",
                "main": ident == main,
                "daemon": bool(thread is not None and thread.daemon),
                "frames": _frames(frame),
            }
        )
    out.sort(key=lambda t: (not t["main"], t["thread"]))
    return out


def _frames(frame: FrameType | None) -> list[dict[str, Any]]:
    chain: list[dict[str, Any]] = []
    while frame is not None and len(chain) < MAX_FRAMES:
        code = frame.f_code
        line = frame.f_lineno or 0
        chain.append(
            {
                "file": code.co_filename,
                "line": line,
                "function": code.co_name,
                "code": linecache.getline(code.co_filename, line).strip()[:200],
            }
        )
        frame = frame.f_back
    chain.reverse()
    return chain


class Probe:
    """A task's probe (see the module docstring): ``task`` its name (``worker0``, ``ps1``,
    ``launcher``), ``folder`` where its pointer file goes."""

    def __init__(self, task: str, folder: Path) -> None:
        self.task = task
        self.folder = private_dir(folder)
        self._providers: dict[str, Callable[[], Any]] = {}
        self.started = time.time()
        digest = hashlib.sha256(f"{folder.resolve()}/{task}".encode()).hexdigest()[:16]
        self.path = socket_dir() / f"{digest}.sock"
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a stale one of an earlier process with the same name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._listener.listen(4)
        self.pointer = self.folder / f"{task}.json"
        pointer = {"task": task, "pid": os.getpid(), "socket": str(self.path)}
        write_atomic(self.pointer, json.dumps({**pointer, "started": self.started}) + "\n")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"probe-{task}", daemon=True)
        self._thread.start()

    def add(self, name: str, provider: Callable[[], Any]) -> None:
        """``provider()`` (JSON-able) goes into every report as ``state[name]``."""
        self._providers[name] = provider

    def report(self) -> dict[str, Any]:
        """What the probe answers: the process, its threads' stacks and its providers' state
        (a provider that fails says so in its place; the others still answer)."""
        state: dict[str, Any] = {}
        for name, provider in list(self._providers.items()):
            try:
                state[name] = provider()
            except Exception as exc:  # a report must come back whatever one part does
                state[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return {
            "task": self.task,
            "pid": os.getpid(),
            "time": time.time(),
            "uptime_s": round(time.time() - self.started, 3),
            "threads": stacks(),
            "state": state,
        }

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ValueError) as exc:
                    log.debug("probe %s: a request failed: %s", self.task, exc)

    def _answer(self, conn: socket.socket) -> None:
        _, uid, _ = _CREDENTIALS.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        if uid != os.getuid():
            raise ValueError(f"a peer of uid {uid} asked; only uid {os.getuid()} is answered")
        conn.settimeout(ANSWER_TIMEOUT)
        request = _read_line(conn)
        if json.loads(request) != {"ask": "report"}:
            raise ValueError(f"not a request: {request[:80]!r}")
        conn.sendall(json.dumps(self.report(), default=str).encode() + b"\n")

    def close(self) -> None:
        """Stop answering; the socket and the pointer file go."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for path in (self.path, self.pointer):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(MAX_REQUEST + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError(f"a request is one line of at most {MAX_REQUEST} bytes")
    return data.split(b"\n", 1)[0]


def ask(path: str, timeout: float = ANSWER_TIMEOUT, limit: int = 64 << 20) -> dict[str, Any]:
    """The report of the probe listening at ``path`` (:class:`OSError` where it does not
    answer within ``timeout`` seconds; ``ValueError`` where the answer is not a report)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        conn.sendall(json.dumps({"ask": "report"}).encode() + b"\n")
        deadline = time.monotonic() + timeout
        chunks = []
        size = 0
        while True:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ValueError(f"a report over {limit} bytes")
    answer = json.loads(b"".join(chunks))
    if not isinstance(answer, dict) or "task" not in answer:
        raise ValueError("the answer is not a probe's report")
    return answer


def start_probe(task: str, folder: Path | None = None) -> Probe | None:
    """A probe for ``task`` with its pointer in ``folder`` (else ``$DISTSGD_DOCTOR_DIR``);
    None where neither names one, or the socket cannot be made (logged: a task runs without)."""
    where = folder if folder is not None else os.environ.get(DIR_ENV)
    if not where:
        return None
    try:
        return Probe(task, Path(where))
    except OSError as exc:
        log.warning("no doctor probe for %s (%s); distsgd doctor will not reach it", task, exc)
        return None
