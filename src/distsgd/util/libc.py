"""The C library, for the few Linux calls Python has no wrapper for (``prctl``, ``setns``,
``unshare``)."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """This process's C library, with ``errno`` kept: ``dlopen(NULL)``, the symbols the
    interpreter has loaded already. (``ctypes.util.find_library("c")`` runs ``ldconfig -p``
    in a child process at every call: some milliseconds, several times in every task.)"""
    return ctypes.CDLL(None, use_errno=True)
