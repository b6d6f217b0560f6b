"""Waits of the tests that stretch with the machine's load, so that no verdict needs an idle
machine (issue 36, item 15).

A test's wait ("the first metrics line within 90 s", "the run ends within 240 s", pytest's
per-test timeout) was tuned on this 2-core machine running the suite alone. On a busy machine
the same work takes longer in wall time, and a fixed wall-clock wait fails a correct test. The
waits here count *fair seconds* instead: each wall second counts as the share of a core a
runnable thread could expect in it, ``min(1, BUSY / runnable)``, where ``runnable`` is the
kernel's count of runnable threads (``procs_running`` in ``/proc/stat``) sampled 4 times a
second and ``BUSY`` is what the suite itself makes runnable on an otherwise idle machine (2
per core: the test processes and the tasks they start). On an idle machine a fair second is
a wall second; at 16 runnable threads on 2 cores it takes 4 wall seconds. Every wait also ends
after :data:`MAX_STRETCH` times its nominal length in wall time, so a real hang still ends.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

MAX_STRETCH = 8.0
"""A wait ends after this many times its nominal length in wall time, however busy the
machine: a hang still fails, if late."""

INTERVAL = 0.25
"""Seconds between two samples of the runnable count."""


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


BUSY = 2 * _cpus()
"""Runnable threads that the suite itself makes on an idle machine: fair time runs at wall
speed up to this many."""


def runnable() -> int | None:
    """Threads runnable now, other than the one asking (None where the kernel does not say)."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return max(0, int(line.split()[1]) - 1)
    except OSError:
        return None
    return None


def share(running: int | None) -> float:
    """The part of a wall second that counts as a fair second with ``running`` threads
    runnable (1 where the count is unknown; ``$LOADCLOCK_SHARE`` where set, which the tests of
    this module use to play a busy machine)."""
    if os.environ.get("LOADCLOCK_SHARE"):
        return float(os.environ["LOADCLOCK_SHARE"])
    if running is None or running <= BUSY:
        return 1.0
    return BUSY / running


class FairClock:
    """Fair seconds since the clock started, accumulated by a daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fair = 0.0
        self._wall = time.monotonic()
        self._share = 1.0
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            time.sleep(INTERVAL)
            self._advance(share(runnable()))

    def _advance(self, new_share: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._fair += (now - self._wall) * self._share
            self._wall, self._share = now, new_share

    def now(self) -> float:
        """Fair seconds so far (the part since the last sample counted at its share)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fair-clock", daemon=True)
                self._thread.start()
            return self._fair + (time.monotonic() - self._wall) * self._share


CLOCK = FairClock()


class Deadline:
    """A wait of ``seconds`` fair seconds (at most :data:`MAX_STRETCH` times that in wall
    time), from now."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._fair0 = CLOCK.now()
        self._wall0 = time.monotonic()

    def expired(self) -> bool:
        fair = CLOCK.now() - self._fair0
        wall = time.monotonic() - self._wall0
        return fair >= self.seconds or wall >= MAX_STRETCH * self.seconds

    def left(self) -> float:
        """Fair seconds left (a lower bound of the wall seconds left)."""
        return max(0.0, self.seconds - (CLOCK.now() - self._fair0))


def communicate(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """``proc.communicate()`` within ``timeout`` fair seconds; past it the process is killed
    and :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` does."""
    deadline = Deadline(timeout)
    while True:
        try:
            return proc.communicate(timeout=min(2.0, max(0.05, deadline.left())))
        except subprocess.TimeoutExpired:
            if deadline.expired():
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None


def wait(proc: subprocess.Popen[str], timeout: float) -> int:
    """``proc.wait()`` within ``timeout`` fair seconds (:class:`subprocess.TimeoutExpired`
    past it; the process is left running, as ``Popen.wait`` leaves it)."""
    import psutil

    deadline = Deadline(timeout)
    while True:
        try:
            return proc.wait(timeout=min(2.0, max(0.05, deadline.left())))
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            if deadline.expired():
                raise subprocess.TimeoutExpired(proc.args, timeout) from None


def run(args: Any, *, timeout: float | None = None, check: bool = False, **kw: Any) -> Any:
    """``subprocess.run`` whose ``timeout`` counts fair seconds (``input`` not supported)."""
    if kw.pop("capture_output", False):
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with subprocess.Popen(args, **kw) as proc:
        if timeout is None:
            out, err = proc.communicate()
        else:
            out, err = communicate(proc, timeout)
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


class Stopwatch:
    """The share of wall time that counted as fair time since it started: a duration another
    process measured in wall seconds (a file's mtime against a kill's time) times this share is
    that duration in fair seconds."""

    def __init__(self) -> None:
        self._fair0 = CLOCK.now()
        self._wall0 = time.monotonic()

    def elapsed(self) -> float:
        """Fair seconds since it started: what an upper bound on a wait is held against."""
        return CLOCK.now() - self._fair0

    def share(self) -> float:
        wall = time.monotonic() - self._wall0
        return 1.0 if wall <= 0 else min(1.0, (CLOCK.now() - self._fair0) / wall)
