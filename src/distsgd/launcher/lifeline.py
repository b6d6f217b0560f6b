"""Tie a task's life to its launcher: when the launcher dies, the task dies too.

Two mechanisms, because either alone has a gap: Linux's parent-death signal (immediate, but
Linux only and racy at start-up), and a watcher thread that notices being re-parented.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

PARENT_ENV = "DISTSGD_PARENT_PID"
PR_SET_PDEATHSIG = 1


def tie_to_parent(environ: dict[str, str] | None = None) -> None:
    """If started by a launcher (``DISTSGD_PARENT_PID`` set), exit when that process is gone."""
    env = os.environ if environ is None else environ
    text = env.get(PARENT_ENV)
    if not text:
        return
    parent = int(text)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:  # pragma: no cover - exotic libc
            pass
    if os.getppid() != parent:  # the launcher died before we got here
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                log.error("launcher (pid %d) is gone; exiting", parent)
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


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
