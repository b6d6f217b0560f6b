"""The keepers of emulated hosts' network namespaces (:mod:`distsgd_emulate.netns`): a
keeper is a process forked from the creator that unshares a network namespace (and, without
root, a user namespace), asks for SIGKILL when the creating thread ends (``PR_SET_PDEATHSIG``)
and execs ``sleep infinity`` under the name :data:`KEEPER_NAME`; with it the namespace goes.
Given :class:`Mount` s (a host's private disk, :mod:`distsgd_emulate.netns_disks`), it also
unshares a mount namespace and makes those mounts in it before the exec."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from distsgd.util.libc import libc

__all__ = [
    "KEEPER_NAME",
    "NAME_PREFIX",
    "Mount",
    "NetnsError",
    "address_here",
    "end_keeper",
    "fork_keeper",
    "name_namespace",
    "stale_names",
    "unname_namespaces",
    "write_id_maps",
]

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
KEEPER_NAME = "distsgd-netns-keeper"
"""A keeper's argv[0] (what ``ps`` shows for it)."""
NETNS_DIR = Path("/run/netns")
"""Where ``ip netns`` keeps the names of network namespaces (a bind mount each)."""
NAME_PREFIX = "distsgd-"
"""The ``ip netns`` names of emulated hosts' namespaces: ``distsgd-host0``, ..."""


class NetnsError(RuntimeError):
    """A namespace, link or shaper could not be made or removed; one line: what and why."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded in the parent: a child forked from a process with threads must not load
    a library (the loader's lock may be held by a thread that is not in the child)."""
    return libc()


@dataclass(frozen=True)
class Mount:
    """One ``mount(2)`` a keeper makes in its new mount namespace, before it execs."""

    source: bytes | None
    target: bytes
    fstype: bytes | None
    flags: int
    data: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class _KeeperArgs:
    """What a keeper child needs, all prepared before the fork."""

    libc: ctypes.CDLL
    """libc, for unshare, setns and prctl."""
    sleep: str
    """The path of ``sleep``."""
    parent: int
    """The creator's PID."""
    user_ns: str | None
    """A user namespace to join first (``/proc/PID/ns/user``); None: stay in ours."""
    new_user: bool
    """Make a new user namespace along with the network namespace."""
    mounts: tuple[Mount, ...] = ()
    """Mounts to make in a new mount namespace (none: the keeper makes no mount namespace)."""


def _keeper_child(report: int, args: _KeeperArgs) -> None:
    """In the forked child: make (or join) the namespaces, tie to the parent, exec sleep.
    Writes to ``report`` only why it failed: the end of file that the exec brings, with nothing
    written, is the parent's sign of success."""
    libc = args.libc
    user_ns, new_user = args.user_ns, args.new_user
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the creator's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if user_ns is not None:
        fd = os.open(user_ns, os.O_RDONLY)
        if libc.setns(fd, CLONE_NEWUSER) != 0:
            os.write(report, f"setns(user): {os.strerror(ctypes.get_errno())}".encode())
            return
        os.close(fd)
    flags = CLONE_NEWNET | (CLONE_NEWUSER if new_user else 0)
    flags |= CLONE_NEWNS if args.mounts else 0
    if libc.unshare(flags) != 0:
        os.write(report, f"unshare: {os.strerror(ctypes.get_errno())}".encode())
        return
    for m in args.mounts:
        if libc.mount(m.source, m.target, m.fstype, ctypes.c_ulong(m.flags), m.data) != 0:
            why = os.strerror(ctypes.get_errno())
            os.write(report, f"mount {m.target.decode(errors='replace')}: {why}".encode())
            return
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent:  # the creator died before the line above
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execv(args.sleep, [KEEPER_NAME, "infinity"])  # closes ``report`` (close-on-exec)


def _read_report(fd: int, pid: int, timeout_s: float) -> str:
    """Why the keeper failed, or "" once it runs ``sleep`` in its namespace."""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 512)
        if chunk:
            chunks.append(chunk)
            continue
        if chunks:
            return b"".join(chunks).decode(errors="replace")
        done, _ = os.waitpid(pid, os.WNOHANG)
        return "it exited at once" if done else ""
    return f"no answer within {timeout_s:g} s (pid {pid})"


def fork_keeper(
    *, user_ns: str | None, new_user: bool, timeout_s: float, mounts: tuple[Mount, ...] = ()
) -> int:
    """Fork a keeper; its PID once it holds its namespace (and has made ``mounts`` in a mount
    namespace of its own), NetnsError if it could not."""
    args = _KeeperArgs(
        libc=_libc(),
        sleep=shutil.which("sleep") or "/bin/sleep",
        parent=os.getpid(),
        user_ns=user_ns,
        new_user=new_user,
        mounts=mounts,
    )
    for name in ("unshare", "setns", "prctl", "mount"):  # resolve the symbols before the fork
        getattr(args.libc, name)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child execs or exits, coverage cannot follow
        try:
            os.close(read)
            _keeper_child(write, args)
        except BaseException as e:
            with contextlib.suppress(BaseException):
                os.write(write, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(1)
    os.close(write)
    try:
        report = _read_report(read, pid, timeout_s)
    finally:
        os.close(read)
    if not report:
        return pid
    end_keeper(pid, timeout_s)
    if os.strerror(errno.EPERM) in report and not report.startswith("mount "):  # the user's
        raise ValueError(
            f"emulated hosts: no network namespace may be made here ({report}); run as root "
            "with CAP_SYS_ADMIN, or allow unprivileged user namespaces"
        )
    raise NetnsError(f"a namespace keeper could not start: {report}")


def end_keeper(pid: int, timeout_s: float) -> bool:
    """SIGKILL one keeper (ours, by PID) and reap it; False if it did not end in time."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def write_id_maps(pid: int) -> None:
    """Map the caller to root in the keeper's new user namespace (so nsenter can be root)."""
    proc = Path(f"/proc/{pid}")
    (proc / "setgroups").write_text("deny")
    (proc / "uid_map").write_text(f"0 {os.geteuid()} 1")
    (proc / "gid_map").write_text(f"0 {os.getegid()} 1")


def name_namespace(name: str, pid: int, timeout_s: float) -> None:
    """Name ``pid``'s network namespace ``name`` for ``ip netns`` (``ip netns attach``: a bind
    mount at /run/netns/NAME), so ``ip netns list`` shows it and ``ip netns exec NAME`` enters
    it; NetnsError if it could not."""
    _ip_netns(["attach", name, str(pid)], timeout_s)


def unname_namespaces(names: list[str], timeout_s: float) -> list[str]:
    """Remove the names (``ip netns delete``; a namespace goes with its last process and name);
    those that could not be removed."""
    left = []
    for name in names:
        try:
            _ip_netns(["delete", name], timeout_s)
        except NetnsError as e:
            left.append(name)
            log.warning("%s", e)
    return left


def stale_names() -> list[str]:
    """Names of emulated hosts' namespaces in /run/netns (left by a creator killed by SIGKILL,
    where no set of hosts is up)."""
    if not NETNS_DIR.is_dir():
        return []
    pattern = re.compile(rf"{re.escape(NAME_PREFIX)}host\d+")
    return sorted(p.name for p in NETNS_DIR.iterdir() if pattern.fullmatch(p.name))


def address_here(address: str, timeout_s: float) -> bool:
    """Whether an interface of the caller's network namespace has ``address``."""
    try:
        done = subprocess.run(
            ["ip", "-j", "addr", "show"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        raise NetnsError(f"could not list this namespace's addresses: {e}") from None
    return any(
        info.get("local") == address
        for link in json.loads(done.stdout)
        for info in link.get("addr_info", [])
    )


def _ip_netns(args: list[str], timeout_s: float) -> None:
    command = " ".join(["ip", "netns", *args])
    try:
        done = subprocess.run(
            ["ip", "netns", *args], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{command} took over {timeout_s:g} s; is the machine busy?") from None
    if done.returncode != 0:
        raise NetnsError(f"{command} failed (exit {done.returncode}): {done.stderr.strip()}")
