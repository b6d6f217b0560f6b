"""Tie a task's life to its launcher: when the launcher dies, the task dies too.

Two mechanisms, because either alone has a gap: Linux's parent-death signal (immediate, but
Linux only and racy at start-up), and a watcher thread that notices being re-parented.

A task forked by the launcher's fork server (:mod:`distsgd.launcher.zygote`) has that server as
its parent, which ends with the launcher; such a task also checks that the launcher itself is
there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

from distsgd.util.libc import libc
from distsgd.util.proctitle import set_title_from_env

log = logging.getLogger(__name__)

PARENT_ENV = "DISTSGD_PARENT_PID"
FORK_SERVER_ENV = "DISTSGD_FORK_SERVER_PID"
"""Set by the fork server in each task it forks: the server's PID (the task's parent)."""
PR_SET_PDEATHSIG = 1


def set_death_signal() -> None:
    """Linux: SIGTERM to this process when its parent ends (elsewhere: nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # an exotic libc
            libc().prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def alive(pid: int, *, others: bool = False) -> bool:
    """Whether process ``pid`` is there: ours to signal, or (``others``) anyone's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process (or a PID reused by one)
        return others
    return True


def tie_to_parent(environ: dict[str, str] | None = None) -> None:
    """If started by a launcher (``DISTSGD_PARENT_PID`` set), exit when that process is gone
    (or, for a task of the fork server, when the server or the launcher is)."""
    env = os.environ if environ is None else environ
    set_title_from_env(env)  # "distsgd worker1 RUN" in ps and top, where the launcher named it
    text = env.get(PARENT_ENV)
    if not text:
        return
    launcher = int(text)
    parents = {launcher}
    if env.get(FORK_SERVER_ENV):
        parents.add(int(env[FORK_SERVER_ENV]))
    set_death_signal()
    parent = os.getppid()
    if parent not in parents:  # the launcher (or server) died before we got here
        os._exit(1)

    def gone() -> bool:
        return os.getppid() != parent or (parent != launcher and not alive(launcher))

    if gone():
        os._exit(1)

    def watch() -> None:
        while True:
            if gone():
                log.error("launcher (pid %d) is gone; exiting", launcher)
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def shared_cores(workers: int, servers: int) -> int:
    """Each of ``workers`` torch threads on one machine: the cores left after one per server
    (a parameter server is mostly one thread), shared out, at least one."""
    return max(1, ((os.cpu_count() or 1) - servers) // max(1, workers))


def thread_env(threads: int) -> dict[str, str]:
    """A task's thread budget as its environment says it: distsgd's, OpenMP's and MKL's."""
    return {
        name: str(threads) for name in ("DISTSGD_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }


def limit_threads(environ: dict[str, str] | None = None) -> None:
    """Apply the launcher's per-task thread budget (``DISTSGD_THREADS``) to torch."""
    env = os.environ if environ is None else environ
    text = env.get("DISTSGD_THREADS")
    if not text:
        return
    import torch

    torch.set_num_threads(int(text))
    with contextlib.suppress(RuntimeError):  # already set, or parallel work has started
        torch.set_num_interop_threads(1)
