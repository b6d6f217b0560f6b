"""A fork-server template: one process that has done a fork server's imports once, and forks a
ready fork server for each launcher that asks.

A local run's fork server (:mod:`distsgd.launcher.zygote`) spends one to three CPU-seconds
importing torch (and what ``torch.optim`` needs) before it forks its first worker; a machine
that starts many runs one after another (a test suite, a script of runs) pays that for every
run. A template, started once as ``python -m distsgd_emulate.fork_template PATH``, does those
imports and listens on the Unix socket PATH, in a folder of its user's own (mode 0700). A
launcher that finds PATH in ``$DISTSGD_FORK_TEMPLATE``
(:data:`distsgd.launcher.forked.TEMPLATE_ENV`) asks it (:func:`distsgd.launcher.forked.ask`) for its
fork server instead of starting one: the server forked from the template serves that launcher
alone, through the socket pair the launcher made, and ends with it, as one it started would
(it watches the launcher's PID through a pidfd, as it is not the launcher's child). Where the
template cannot be reached, the launcher starts its own server (and says so in its debug log).

The protocol: one ``SOCK_SEQPACKET`` connection per launcher, one message from it, a JSON
object ``{"launcher": PID, "title": TITLE}`` with two descriptors attached (``SCM_RIGHTS``: the
server's end of the launcher's socket pair, and the file the server's output goes to); one
answer, ``{"pid": P}`` (the server forked) or ``{"error": "..."}``. No pickle crosses it. Only
a peer with the template's own user id is answered (``SO_PEERCRED``): the server it forks runs
what its launcher asks, as that user. The template ends with its parent, and removes PATH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import stat
import struct
import sys
from collections.abc import Sequence
from typing import Any

from distsgd.launcher import zygote
from distsgd.launcher.forked import ASK_TIMEOUT
from distsgd.launcher.lifeline import set_death_signal
from distsgd.util.proctitle import set_title

log = logging.getLogger(__name__)

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _listen(path: str) -> socket.socket:
    """The template's socket at ``path``, in a folder of this user's own that no one else may
    enter (else :class:`PermissionError`, naming it)."""
    folder = os.path.dirname(os.path.abspath(path))
    info = os.stat(folder)
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(
            f"{folder}: a fork-server template's folder must be this user's and mode 0700"
        )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(16)
    return listener


def _answer(conn: socket.socket) -> tuple[int, str, list[int]] | None:
    """One launcher's request, checked: ``(launcher, title, [server_fd, out_fd])``; None (the
    connection answered with an error, descriptors closed) for a bad one or another user."""
    pid, uid, _ = _CREDENTIALS.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    )
    data, fds, flags, _ = socket.recv_fds(conn, zygote.MAX_MESSAGE, 3)
    try:
        if uid != os.getuid():
            raise zygote.ProtocolError(f"pid {pid} is another user's (uid {uid})")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 2:
            raise zygote.ProtocolError("a request is one message with two descriptors")
        message = zygote.load_message(data)
        if set(message) != {"launcher", "title"}:
            raise zygote.ProtocolError(f"a request has the keys launcher and title: {message}")
        launcher = zygote.int_field(message, "launcher", low=1)
        return launcher, zygote.text_field(message["title"], "title"), list(fds)
    except zygote.ProtocolError as exc:
        log.warning("fork-server template: refused a request: %s", exc)
        with contextlib.suppress(OSError):
            conn.send(zygote.encode({"error": str(exc)}))
        for fd in fds:
            os.close(fd)
        return None


def serve(listener: socket.socket, parent: int) -> tuple[socket.socket, int] | None:
    """Fork a server for each request, until the parent is gone (None). In a server just
    forked: its socket and its launcher's PID (the template's loop is left)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select via wake_w
    signal.signal(signal.SIGTERM, _stop)
    while os.getppid() == parent:
        readable, _, _ = select.select([listener.fileno(), wake_r], [], [], 1.0)
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 4096)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass  # its servers report to their launchers, not to it
        if listener.fileno() not in readable:
            continue
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(ASK_TIMEOUT)
            request = _answer(conn)
            if request is None:
                continue
            launcher, title, (server_fd, out_fd) = request
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                listener.close()  # this process's copy: the template listens on
                return _become_server(launcher, title, server_fd, out_fd), launcher
            os.close(server_fd)
            os.close(out_fd)
            with contextlib.suppress(OSError):
                conn.send(zygote.encode({"pid": pid}))
    return None


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM: leave the loop (the socket is removed on the way out, and the process ends by
    :func:`~distsgd.launcher.zygote.exit_now`: finalizing torch's modules took 6-10 s of a
    loaded machine at the end of every test process)."""
    raise SystemExit(0)


def _become_server(launcher: int, title: str, server_fd: int, out_fd: int) -> socket.socket:
    """Set this freshly forked process up as the launcher's fork server: its own session, its
    output to ``out_fd``, its title."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    set_title(title)
    log.info("fork server for launcher %d, forked from a template", launcher)
    return socket.socket(fileno=server_fd)


def main(argv: Sequence[str] | None = None) -> Any:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m distsgd_emulate.fork_template SOCKET_PATH", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parent = os.getppid()
    set_death_signal()
    set_title("distsgd fork-server-template")
    try:
        listener = _listen(args[0])
    except OSError as exc:
        print(f"fork-server template: {exc}", file=sys.stderr)
        return 2
    zygote.preload()
    template = os.getpid()
    try:
        made = serve(listener, parent)
    except SystemExit:  # SIGTERM (_stop): out at once, as below, not through finalization
        made = None
    finally:
        if os.getpid() == template:  # not in a server forked from it
            with contextlib.suppress(OSError):
                os.unlink(args[0])
    if made is None:
        zygote.exit_now()
    request = zygote.serve(*made)
    if request is not None:  # a forked task
        zygote.run_task(request)
        return 0
    zygote.exit_now()


if __name__ == "__main__":
    sys.exit(main())
