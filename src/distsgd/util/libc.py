"""The C library, for the few Linux calls Python has no wrapper for (``prctl``, ``setns``,
``unshare``)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys


@functools.cache
def libc() -> ctypes.CDLL:
    """This process's C library, with ``errno`` kept: ``dlopen(NULL)``, the symbols the
    interpreter has loaded already. (``ctypes.util.find_library("c")`` runs ``ldconfig -p``
    in a child process at every call: some milliseconds, several times in every task.)"""
    return ctypes.CDLL(None, use_errno=True)


PR_SET_PDEATHSIG = 1


def resolve_before_fork() -> None:
    """Look up, in a process about to fork, what :func:`die_with_parent` calls in the child: a
    symbol lookup takes the dynamic loader's lock, which another thread may hold at the fork (a
    C++ exception being unwound, a library being loaded), and the child would wait for it
    forever."""
    if sys.platform.startswith("linux"):
        libc().prctl  # noqa: B018 (ctypes keeps the function it looked up)


def die_with_parent(parent: int) -> None:
    """(In a forked child, on Linux) be killed when the thread that forked it ends (its
    process ``parent`` killed included), so nothing it started outlives it; a parent that died
    before the request was made is seen at once. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): memory freed
    in blocks below glibc's mmap threshold (which rises to 32 MB as large blocks are freed)
    otherwise stays in the process's resident set until the heap reuses it. Nothing where the C
    library has no ``malloc_trim``."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
