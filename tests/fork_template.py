"""One fork-server template per test process (:mod:`distsgd_emulate.fork_template`): every local run
a test starts gets its fork server forked from it, torch imported already, instead of starting
one (over 2 CPU-seconds a run, a few hundred runs in the suite: a third of its CPU).

``$DISTSGD_TEST_TEMPLATE=0`` turns it off; so does ``$DISTSGD_TEST_CPU`` (a run's servers and
tasks are then the template's children, not the test's, and their CPU would not be counted).
Tests of the fork server itself and of what a run leaves behind when its launcher is killed
run both ways (``tests/test_fork_template.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from distsgd.launcher.forked import TEMPLATE_ENV

START_TIMEOUT = 120.0
"""Seconds the template may take to import torch and listen (a loaded machine is slow)."""


def wanted() -> bool:
    return os.environ.get("DISTSGD_TEST_TEMPLATE", "1") != "0" and not os.environ.get(
        "DISTSGD_TEST_CPU"
    )


@contextlib.contextmanager
def running(folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A template listening in ``folder`` (made 0700 here; its socket's path is its last
    argument, set in ``$DISTSGD_FORK_TEMPLATE`` while it runs). It is ended (by its PID) on
    the way out."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / "template.sock"
    with open(folder / "template.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "distsgd_emulate.fork_template", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    previous = os.environ.get(TEMPLATE_ENV)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if path.exists():  # else runs start their own fork servers, as without it
            os.environ[TEMPLATE_ENV] = str(path)
        yield proc
    finally:
        if previous is None:
            os.environ.pop(TEMPLATE_ENV, None)
        else:
            os.environ[TEMPLATE_ENV] = previous
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
