"""A process's title as ``ps`` and ``top`` show it: ``distsgd worker1 RUN`` rather than the
``python3 -m distsgd.launcher.zygote 5`` that every forked task would otherwise show.

Linux only (elsewhere: nothing), without a compiled dependency: the short name (``comm``, 15
bytes, what ``top`` shows and ``pgrep`` matches) is set with ``prctl(PR_SET_NAME)``, and the
command line (``/proc/PID/cmdline``, what ``ps`` shows) by writing the title over the process's
original argument strings, whose address the kernel gives in ``/proc/self/stat``; it is cut to
their length (the interpreter's path, ``-m`` and the module name: some 50 bytes and more).
Python's own ``sys.argv`` is a copy, and is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Mapping

from distsgd.util.libc import libc

log = logging.getLogger(__name__)

TITLE_ENV = "DISTSGD_TITLE"
"""The title a task of the launcher gives itself (``distsgd worker1 RUN``), set by the launcher."""
COMM_BYTES = 15
"""The longest short name the kernel keeps (``TASK_COMM_LEN`` less its NUL)."""
PR_SET_NAME = 15
_ARG_START_FIELD = 48
"""``arg_start`` in ``/proc/PID/stat`` (1-based, as proc(5) counts; ``arg_end`` follows)."""


def task_title(name: str, run: str) -> str:
    """The title of task ``name`` (``worker1``, ``ps0``, ``fork-server``) of run ``run``."""
    return f"distsgd {name} {run}"


def short_name(title: str) -> str:
    """The 15-byte ``comm`` for ``title``: ``distsgd-worker1`` where it fits, else the task's
    name alone (``worker12``, ``fork-server``)."""
    words = title.split()
    if len(words) >= 2 and words[0] == "distsgd":
        joined = f"distsgd-{words[1]}"
        return joined if len(joined) <= COMM_BYTES else words[1][:COMM_BYTES]
    return title[:COMM_BYTES]


def set_title(title: str) -> None:
    """Show this process as ``title`` in ``ps`` and ``top`` (as far as it can: never raises)."""
    if not sys.platform.startswith("linux") or not title:
        return
    try:
        libc().prctl(PR_SET_NAME, ctypes.c_char_p(short_name(title).encode()), 0, 0, 0)
    except OSError as exc:  # pragma: no cover - exotic libc
        log.debug("no short process name: %s", exc)
    with contextlib.suppress(OSError, ValueError, IndexError):
        _write_arguments(title.encode(errors="replace"))


def set_title_from_env(environ: Mapping[str, str] | None = None) -> None:
    """:func:`set_title` with :data:`TITLE_ENV`'s value, where it is set."""
    title = (os.environ if environ is None else environ).get(TITLE_ENV, "")
    if title:
        set_title(title)


def argument_area(stat: str) -> tuple[int, int]:
    """``(arg_start, arg_end)`` from the text of ``/proc/self/stat`` (the command name, field
    2, may hold spaces and parentheses: the fields are counted after its last ``)``)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    first = _ARG_START_FIELD - 3  # the fields after the name start at field 3
    return int(fields[first]), int(fields[first + 1])


def _write_arguments(title: bytes) -> None:
    with open("/proc/self/stat") as f:
        start, end = argument_area(f.read())
    size = end - start
    if start <= 0 or size < 2:
        return
    text = title[: size - 1]
    # NULs after the title: the kernel then shows exactly the title (a last byte that is not
    # NUL would make it read on into the environment)
    ctypes.memmove(start, text + b"\0" * (size - len(text)), size)
