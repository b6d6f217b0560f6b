"""A worker's state file written in the background, from a consistent snapshot.

The training loop only forks (:class:`BackgroundWrite`): the child process sees the worker's
memory as it was at that instant (copy-on-write: the pages the loop changes while the child
writes are copied, and only those), writes the state file atomically (a temporary file,
fsync, rename: a crash, of either process, leaves the previous file) and exits; a thread of the
worker waits for it and reports the outcome. The loop goes on training meanwhile.

The child runs nothing but ``torch.save`` into the file: no logging, no gRPC, no torch
operator (tensors off the CPU are copied to host memory before the fork, by the caller), and
it leaves by ``os._exit``. It ignores SIGINT and SIGTERM, so a run asked to stop still gets the
file it is writing; it dies with the worker's thread that forked it (``PR_SET_PDEATHSIG``), so a
killed worker leaves no writer behind. Where ``os.fork`` does not exist the caller writes in
the loop.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from distsgd.util import write_stream_atomic
from distsgd.util.libc import die_with_parent, resolve_before_fork

CAN_FORK = hasattr(os, "fork")
"""Whether state files can be written by a forked process here (POSIX)."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class WriteOutcome(enum.Enum):
    WRITTEN = "written"
    NO_SPACE = "no space"
    """The disk (or the user's quota) was full: the previous file stays the newest."""
    FAILED = "failed"
    """Anything else (the child's traceback is in this worker's log)."""
    HUNG = "hung"
    """The child made no end within its patience and was killed (:meth:`BackgroundWrite.abandon`):
    the previous file stays the newest."""


PATIENCE_SECONDS = 60.0
"""How long a state file's writer may take, plus :data:`PATIENCE_BYTES_PER_SECOND`'s share."""
PATIENCE_BYTES_PER_SECOND = 10e6
"""The slowest disk a writer is waited for: a 1.2 GB state may take 120 s more than that."""


ABANDON_WAIT_SECONDS = 5.0
"""How long :meth:`BackgroundWrite.abandon` waits for the killed writer to be gone."""


def patience(state: Any) -> float:
    """Seconds after which the writer of ``state`` counts as hung: :data:`PATIENCE_SECONDS`
    plus its tensors' and arrays' bytes at :data:`PATIENCE_BYTES_PER_SECOND`."""
    return PATIENCE_SECONDS + _nbytes(state) / PATIENCE_BYTES_PER_SECOND


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.numel()
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return int(getattr(obj, "nbytes", 0) or 0)


def write_state_file(path: Path, state: Mapping[str, Any]) -> None:
    """``torch.save`` ``state`` into ``path`` atomically, as it is made (the state is never
    whole in memory a second time)."""
    write_stream_atomic(path, lambda f: torch.save(state, f))


def outcome_of(exc: OSError) -> WriteOutcome:
    return WriteOutcome.NO_SPACE if exc.errno in _NO_SPACE else WriteOutcome.FAILED


def _child(path: Path, state: Mapping[str, Any], parent: int) -> NoReturn:
    """(The forked process) write the file and leave: exit 0, an errno of :data:`_NO_SPACE`,
    or 1 with the traceback on stderr."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        die_with_parent(parent)  # a worker killed takes its writer along (the older file stays)
        write_state_file(path, state)
        code = 0
    except OSError as exc:
        code = exc.errno if exc.errno in _NO_SPACE else 1
        os.write(2, f"writing {path} failed: {exc}\n".encode())
    except BaseException:
        os.write(2, f"writing {path} failed:\n{traceback.format_exc()}".encode())
    finally:
        os._exit(code)


class BackgroundWrite:
    """One worker state file being written by a forked process; ``on_done`` is called (on a
    thread of this process) with this write once the child has exited and :attr:`outcome`
    says how it went."""

    def __init__(
        self,
        path: Path,
        state: Mapping[str, Any],
        on_done: Callable[[BackgroundWrite], None],
    ) -> None:
        self.path = path
        self.started = time.monotonic()
        self.outcome: WriteOutcome | None = None
        self.exit_code: int | None = None
        self._on_done = on_done
        self.abandoned = False
        self.patience = patience(state)
        """Seconds after :attr:`started` past which the write counts as hung."""
        parent = os.getpid()
        resolve_before_fork()  # the child looks nothing up (see its docstring)
        pid = os.fork()
        if pid == 0:
            _child(path, state, parent)
        self.pid = pid
        self._pidfd = _pidfd(pid)  # signals reach this child even once it has been reaped
        self._thread = threading.Thread(target=self._wait, name="state-writer", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        self.exit_code = os.waitstatus_to_exitcode(status)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        by_code = {0: WriteOutcome.WRITTEN, **dict.fromkeys(_NO_SPACE, WriteOutcome.NO_SPACE)}
        failed = WriteOutcome.FAILED
        self.outcome = WriteOutcome.HUNG if self.abandoned else by_code.get(self.exit_code, failed)
        self._on_done(self)

    @property
    def done(self) -> bool:
        """Whether the child has exited and ``on_done`` has run."""
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the write (and ``on_done``); whether it is done."""
        self._thread.join(timeout)
        return self.done

    def abandon(self) -> None:
        """Kill a writer that has hung (this process forked it: by its pidfd, or by its PID
        while it is not reaped) and wait a little for ``on_done``; its outcome is
        :attr:`WriteOutcome.HUNG`.
        A child forked from a process with other threads can wait forever on a lock one of them
        held at the fork; the loop must not wait with it."""
        self.abandoned = True
        with contextlib.suppress(OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self.exit_code is None:
                os.kill(self.pid, signal.SIGKILL)
        # A child in an uninterruptible wait (an fsync behind other writeback) dies only when
        # it ends: the loop goes on meanwhile, and on_done counts the write when it comes.
        self._thread.join(ABANDON_WAIT_SECONDS)


def _pidfd(pid: int) -> int:
    """A descriptor of the child ``pid`` (-1 where the system has none)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1
