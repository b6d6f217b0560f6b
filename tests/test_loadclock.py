"""The tests' load-stretched waits (tests/loadclock.py): a busy machine slows the clock that
test waits count in, an idle one does not, and a hang still ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import loadclock
import pytest

HERE = Path(__file__).resolve().parent


def test_fair_time_runs_at_wall_speed_up_to_the_suites_own_load() -> None:
    assert loadclock.share(None) == 1.0
    assert loadclock.share(0) == 1.0
    assert loadclock.share(loadclock.BUSY) == 1.0
    assert loadclock.share(4 * loadclock.BUSY) == pytest.approx(0.25)


def test_the_clock_counts_each_stretch_at_the_share_it_was_sampled_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(loadclock.time, "monotonic", lambda: now[0])
    clock = loadclock.FairClock()
    clock._thread = object()  # type: ignore[assignment]  # no sampler: the test advances it
    now[0] += 10
    clock._advance(0.25)  # 10 s at the first share, 1.0
    now[0] += 8
    assert clock.now() == pytest.approx(12.0)  # then 8 s at 0.25
    clock._advance(1.0)
    now[0] += 1
    assert clock.now() == pytest.approx(13.0)


def test_a_deadline_ends_on_fair_time_or_at_its_stretch_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    fair = [0.0]
    monkeypatch.setattr(loadclock.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(loadclock.CLOCK, "now", lambda: fair[0])
    deadline = loadclock.Deadline(10)
    now[0], fair[0] = 30.0, 9.0  # busy: 30 wall seconds gave 9 fair ones
    assert not deadline.expired()
    assert deadline.left() == pytest.approx(1.0)
    fair[0] = 10.0
    assert deadline.expired()
    stuck = loadclock.Deadline(10)
    now[0] += loadclock.MAX_STRETCH * 10  # a machine so busy that no fair time passed
    assert stuck.expired()


def test_communicate_kills_a_process_past_its_wait() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        with pytest.raises(subprocess.TimeoutExpired):
            loadclock.communicate(proc, 0.5)
        assert proc.poll() is not None


def _pytest_in(tmp_path: Path, test: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """pytest with this suite's conftest.py, a 1-second per-test timeout, on one test file."""
    for name in ("conftest.py", "loadclock.py", "fork_template.py"):
        (tmp_path / name).write_text((HERE / name).read_text())
    (tmp_path / "test_one.py").write_text(test)
    pytest_args = ["-n", "0", "-q", "-p", "no:cacheprovider", "--timeout", "1"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, "--rootdir", str(tmp_path), "test_one.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "DISTSGD_TEST_TEMPLATE": "0", **env},
    )


def test_the_per_test_timeout_still_ends_a_hang(tmp_path: Path) -> None:
    done = _pytest_in(tmp_path, "import time\n\n\ndef test_hangs():\n    time.sleep(30)\n", {})
    assert done.returncode == 1, done.stdout[-2000:]
    assert "Timeout" in done.stdout, done.stdout[-2000:]


def test_the_per_test_timeout_stretches_on_a_busy_machine(tmp_path: Path) -> None:
    """At a quarter of a core per runnable thread, a 1-second limit lets 2 s of wall time
    pass (0.5 fair seconds)."""
    test = "import time\n\n\ndef test_slow():\n    time.sleep(2)\n"
    done = _pytest_in(tmp_path, test, {"LOADCLOCK_SHARE": "0.25"})
    assert done.returncode == 0, done.stdout[-2000:]
