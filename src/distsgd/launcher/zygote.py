"""The fork server ("zygote") of a local run: one process that imports torch and distsgd's
worker modules once, then forks each worker task on request.

A worker started with ``python -m distsgd.launcher.bootstrap`` spends one to two CPU-seconds
importing torch before it runs a line of its script; a run with restarts pays that for every
start. The launcher (:mod:`distsgd.launcher.forked`) starts this module as
``python -m distsgd.launcher.zygote FD``, FD being its end of an ``AF_UNIX`` socket pair
(``SOCK_SEQPACKET``: one message is one JSON object, sent and read whole). No pickle crosses it.

Messages from the launcher, each with exactly one file descriptor attached (``SCM_RIGHTS``: the
write end of the pipe the launcher relays the task's output from, which becomes the task's
stdout and stderr)::

    {"op": "fork", "id": 7, "module": "distsgd.launcher.bootstrap", "args": [...],
     "env": {...}, "cwd": "/abs/path"}

Messages to the launcher: ``{"ready": true, "pid": P}`` once the imports are done;
``{"id": 7, "pid": P}`` for a task forked, ``{"id": 7, "error": "..."}`` for a request refused;
``{"pid": P, "exit": C}`` when a task has ended (C negative: the signal that ended it, as
``Popen.returncode`` says it).

The server starts no thread and runs no torch operation (so forking it is safe); it reaps its
children itself, and ends with the launcher (parent-death signal, and a check each second).
A forked task sets itself up as the task (:func:`_become`), leaves the server's loop and runs
its module from :func:`main`, so that it ends as that interpreter would have ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import stat
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from distsgd.launcher.lifeline import FORK_SERVER_ENV, PARENT_ENV, set_death_signal
from distsgd.util.proctitle import set_title_from_env

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
"""The largest message either side reads (a task's environment, mostly)."""
FORKABLE = frozenset({"distsgd.launcher.bootstrap"})
"""The modules a forked task may run as ``__main__`` (what ``python -m MODULE`` would run)."""
REQUEST_KEYS = frozenset({"op", "id", "module", "args", "env", "cwd"})


class ProtocolError(ValueError):
    """A message that breaks the protocol (its text says which field, and why)."""


@dataclass(frozen=True, kw_only=True)
class ForkRequest:
    """One ``fork`` message, checked."""

    id: int
    """The launcher's number for the request (the reply carries it)."""
    module: str
    """The module the task runs as ``__main__`` (one of :data:`FORKABLE`)."""
    args: tuple[str, ...]
    """The task's arguments after ``-m MODULE``."""
    env: Mapping[str, str]
    """The task's whole environment."""
    cwd: str
    """The task's working folder (an absolute path)."""
    out_fd: int
    """The descriptor received with the message: the task's stdout and stderr."""


@dataclass(frozen=True, kw_only=True)
class Report:
    """One message from the server, checked: which kind is told by the fields set."""

    ready: bool = False
    """The server has imported everything and takes requests (``pid``: the server's)."""
    id: int | None = None
    """The request answered (with ``pid`` when forked, ``error`` when refused)."""
    pid: int = 0
    """The server's PID (ready), the task forked, or the task that ended (``exit`` set)."""
    error: str = ""
    """Why the request was refused."""
    exit: int | None = None
    """How the task ``pid`` ended: its exit code, or minus the signal that ended it."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One message: compact JSON and a newline."""
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def load_message(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {type(message).__name__}")
    return message


def int_field(message: Mapping[str, Any], key: str, *, low: int = 0) -> int:
    value = message.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ProtocolError(f"{key!r} must be an integer >= {low}, got {value!r}")
    return value


def text_field(value: Any, what: str) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise ProtocolError(f"{what} must be a string without NUL, got {value!r:.80}")
    return value


def parse_request(data: bytes, fds: Sequence[int]) -> ForkRequest:
    """The request in ``data`` with the descriptors ``fds`` received with it."""
    message = load_message(data)
    if set(message) != REQUEST_KEYS:
        raise ProtocolError(f"a request has the keys {sorted(REQUEST_KEYS)}, got {sorted(message)}")
    if message["op"] != "fork":
        raise ProtocolError(f"unknown op {message['op']!r}")
    module = text_field(message["module"], "module")
    if module not in FORKABLE:
        raise ProtocolError(f"module {module!r} is not one this server runs")
    args = message["args"]
    if not isinstance(args, list):
        raise ProtocolError(f"'args' must be a list, got {type(args).__name__}")
    env = message["env"]
    if not isinstance(env, dict):
        raise ProtocolError(f"'env' must be an object, got {type(env).__name__}")
    for key, value in env.items():
        if not key or "=" in key:
            raise ProtocolError(f"environment name {key!r} is empty or holds '='")
        text_field(key, "an environment name")
        text_field(value, f"environment variable {key}")
    cwd = text_field(message["cwd"], "cwd")
    if not os.path.isabs(cwd):
        raise ProtocolError(f"cwd must be an absolute path, got {cwd!r}")
    if len(fds) != 1:
        raise ProtocolError(f"a request carries one descriptor, got {len(fds)}")
    return ForkRequest(
        id=int_field(message, "id"),
        module=module,
        args=tuple(text_field(a, "each argument") for a in args),
        env=dict(env),
        cwd=cwd,
        out_fd=fds[0],
    )


def parse_report(data: bytes) -> Report:
    """The server's message in ``data``."""
    message = load_message(data)
    keys = set(message)
    if keys == {"ready", "pid"} and message["ready"] is True:
        return Report(ready=True, pid=int_field(message, "pid", low=1))
    if keys == {"id", "pid"}:
        return Report(id=int_field(message, "id"), pid=int_field(message, "pid", low=1))
    if keys == {"id", "error"}:
        error = text_field(message["error"], "error") or "?"
        return Report(id=int_field(message, "id"), error=error)
    if keys == {"pid", "exit"}:
        code = message["exit"]
        if not isinstance(code, int) or isinstance(code, bool) or not -128 < code < 256:
            raise ProtocolError(f"'exit' must be an exit code or minus a signal, got {code!r}")
        return Report(pid=int_field(message, "pid", low=1), exit=code)
    raise ProtocolError(f"unknown report with the keys {sorted(keys)}")


def _request_id(data: bytes) -> int:
    """The id of a refused request, where it has a valid one (else 0, which no request uses)."""
    with contextlib.suppress(ProtocolError):
        return int_field(load_message(data), "id")
    return 0


# -- the server ---------------------------------------------------------------------------------
PRELOAD_ENV = "DISTSGD_FORK_PRELOAD"
"""What the server imports before it serves: :data:`PRELOAD_OPTIMIZER` (the default) or
:data:`PRELOAD_TORCH` (tests of the server alone, whose tasks build none)."""
PRELOAD_OPTIMIZER = "optimizer"
PRELOAD_TORCH = "torch"


def preload() -> None:
    """Import what every worker imports (torch above all), creating no thread."""
    os.environ["OMP_NUM_THREADS"] = "1"  # libgomp reads these once, when torch loads it;
    os.environ["MKL_NUM_THREADS"] = "1"  # each task then sets its own (limit_threads)
    import torch

    if os.environ.get(PRELOAD_ENV, PRELOAD_OPTIMIZER) != PRELOAD_TORCH:
        # torch.optim imports this when a process makes its first optimizer (over a
        # CPU-second; every worker makes one: a scheme's local one, the user's own, or the
        # ServerRate a scheduler drives).
        import torch._dynamo  # noqa: F401

    import distsgd.api
    import distsgd.launcher.bootstrap  # noqa: F401
    from distsgd import schemes

    for name in schemes.names():  # the worker halves (torch), which the catalogue only names
        schemes.get(name).worker_class()


def serve(sock: socket.socket, launcher: int) -> ForkRequest | None:
    """Answer requests on ``sock`` until the launcher closes it or is gone (None). In a task
    just forked, the request it is to run (the task has left the server's loop)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select via wake_w
    children: set[int] = set()
    watch = launcher_watch(launcher)  # a server forked from a template is not its child
    private = (wake_r, wake_w) if watch is None else (wake_r, wake_w, watch)
    waits = [sock.fileno(), wake_r] if watch is None else [sock.fileno(), wake_r, watch]
    _send(sock, {"ready": True, "pid": os.getpid()})
    try:
        while watch is not None or os.getppid() == launcher:
            readable, _, _ = select.select(waits, [], [], 1.0)
            if watch is not None and watch in readable:
                break  # the launcher has ended
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            _reap(sock, children)
            if sock.fileno() not in readable:
                continue
            outcome = _handle(sock, children, private)
            if isinstance(outcome, ForkRequest):  # the forked task: not the server's children
                children.clear()
                return outcome
            if not outcome:
                break
    except OSError as exc:  # the launcher's end is gone
        log.warning("fork server: %s; stopping", exc)
    finally:
        _end(children)
    return None


def launcher_watch(launcher: int) -> int | None:
    """A descriptor that becomes readable when process ``launcher`` ends (a Linux pidfd, which
    works for a process that is not this one's parent), or None where there is none."""
    try:
        return os.pidfd_open(launcher)
    except (AttributeError, OSError):  # not Linux 5.3+, or the launcher is gone already
        return None


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(encode(message))


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report each child that has ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def _handle(
    sock: socket.socket, children: set[int], private: tuple[int, ...]
) -> ForkRequest | bool:
    """Read one request and fork its task; False once the launcher has closed its end. In the
    forked task: its request, once the task is set up."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    try:
        if not data:
            return False
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            _send(sock, {"id": _request_id(data), "error": "message too long"})
            return True
        try:
            request = parse_request(data, fds)
            _check_local(request)
        except ProtocolError as exc:
            _send(sock, {"id": _request_id(data), "error": str(exc)})
            return True
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become(request, server, sock, private)
            return request
        children.add(pid)
        _send(sock, {"id": request.id, "pid": pid})
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _check_local(request: ForkRequest) -> None:
    """What :func:`parse_request` cannot see: the folder is there, and the descriptor is the
    write end of a pipe."""
    if not os.path.isdir(request.cwd):
        raise ProtocolError(f"cwd {request.cwd} is not a folder")
    mode = os.fstat(request.out_fd).st_mode
    writable = fcntl.fcntl(request.out_fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    if not (stat.S_ISFIFO(mode) and writable):
        raise ProtocolError("the descriptor sent is not the write end of a pipe")


def _end(children: set[int]) -> None:
    """Stop the children still running (the launcher stops its tasks before it closes us)."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


# -- the forked task ----------------------------------------------------------------------------
def _become(
    request: ForkRequest, server: int, sock: socket.socket, private: tuple[int, ...]
) -> None:
    """Set this freshly forked process up as the task ``request`` describes: what a new
    interpreter started as ``python -m MODULE ARGS`` by ``Popen(start_new_session=True)``
    would have (``server``: the server's PID; ``sock``, ``private``: the server's own, closed
    here). A failure ends the process with code 1, its traceback on the task's output."""
    try:
        signal.set_wakeup_fd(-1)
        sock.close()
        for fd in private:
            os.close(fd)
        os.setsid()  # its own session and process group
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(request.out_fd, 1)
        os.dup2(request.out_fd, 2)
        os.close(null)
        _fresh_stdio(unbuffered=bool(request.env.get("PYTHONUNBUFFERED")))
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        os.environ[FORK_SERVER_ENV] = str(server)
        set_title_from_env()  # its own name (the server's otherwise: its memory is a copy)
        _reseed()
        sys.argv = ["-m", *request.args]  # run_module puts the module's file first
        sys.path[0] = request.cwd  # as ``python -m`` has it
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)


def run_task(request: ForkRequest) -> None:
    """Run the task's module as ``__main__``. What it raises ends this process as it would
    end the interpreter (from :func:`main`'s caller, with the interpreter's own finalization:
    threads joined, ``atexit`` functions, the exit code or the traceback)."""
    # The preload imported the module (for what it imports); ``python -m`` runs a module that
    # is not imported yet, and runpy warns on every task when it is (a RuntimeWarning about
    # "unpredictable behaviour"). Its imports stay loaded: only its own entry goes.
    sys.modules.pop(request.module, None)
    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


def _fresh_stdio(*, unbuffered: bool) -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` on descriptors 0, 1 and 2, buffered as a new
    interpreter would buffer them (``PYTHONUNBUFFERED``: not at all)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered: Any
        if fd == 0:
            buffered = io.BufferedReader(raw)
        elif unbuffered:
            buffered = raw
        else:
            buffered = io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=fd == 2 and not unbuffered,
            write_through=unbuffered and fd != 0,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _reseed() -> None:
    """Fresh global random state where a new process would have had its own (``random``
    reseeds itself after a fork; numpy's global generator does not)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m distsgd.launcher.zygote FD", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    text = os.environ.get(PARENT_ENV, "")
    if not text.isdigit():
        log.error("fork server: %s is not set; it is started by the launcher", PARENT_ENV)
        return 2
    launcher = int(text)
    set_death_signal()
    set_title_from_env()  # "distsgd fork-server RUN", not "python3 -m distsgd.launcher.zygote 5"
    if os.getppid() != launcher:
        return 1
    sock = socket.socket(fileno=int(args[0]))
    preload()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:  # a fork copies only the forking thread: locks others held stay held
        log.warning("fork server: %d threads after the imports; forking may hang", threads)
    request = serve(sock, launcher)
    if request is not None:  # a forked task
        run_task(request)
        return 0
    exit_now()


def exit_now() -> NoReturn:
    """End the server at once, its output flushed. It holds nothing to save, and the
    interpreter's own finalization (tearing down torch's modules) took over half a second of
    CPU: under load, longer than the launcher waits before it kills a server that hangs."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
