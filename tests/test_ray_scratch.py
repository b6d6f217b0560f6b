"""The local Ray instance's folder (launcher/engines/ray.py) leaves nothing behind when a start
fails or is interrupted: Ctrl-C while Ray is imported or its instance starts, or an instance
that does not come up. (tests/test_ray.py checks a whole run's folder and another user.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_for

from distsgd.launcher.engines import ray as ray_tasks
from distsgd.launcher.engines.ray import LOOPBACK_ENV, LocalRay, RaySupervisor

pytest.importorskip("ray")


def test_ctrl_c_while_ray_is_imported_closes_the_local_instance(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``import ray`` takes seconds under load: a Ctrl-C then used to leave the instance that
    had just started, and its folder with the token, in /tmp."""
    closed: list[bool] = []

    class Started:
        def __init__(self, **_: Any) -> None:
            self.address, self.auth = "127.0.0.1:1", {}

        def close(self) -> None:
            closed.append(True)

    def interrupted() -> Any:
        raise KeyboardInterrupt

    monkeypatch.setenv(LOOPBACK_ENV, "restored after the test")
    monkeypatch.setattr(ray_tasks, "LocalRay", Started)
    monkeypatch.setattr(ray_tasks, "import_ray", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RaySupervisor(
            log_dir=tmp_path / "logs", echo=print, address="", bundles={"ps0": {"CPU": 1.0}}
        )
    assert closed == [True]


def test_an_instance_that_does_not_start_leaves_nothing(tmp_path: Path) -> None:
    log = tmp_path / "ray-start.log"
    with pytest.raises(ValueError, match="did not start within") as refused:
        LocalRay(cpus=1, gpus=0, log=log, timeout=0.0)
    assert str(log) in str(refused.value) and "\n" not in str(refused.value)
    scratch = Path(log.read_text().splitlines()[0].rsplit(" in ", 1)[1])
    assert scratch.name.startswith("dray-") and not scratch.exists()
    assert wait_for(lambda: not _mentioning(scratch), 15), _mentioning(scratch)


def test_an_interrupted_start_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[Path] = []
    real = LocalRay._start

    def start(self: LocalRay, cpus: int, gpus: int) -> None:
        made.append(self.scratch)
        real(self, cpus, gpus)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalRay, "_start", start)
    with pytest.raises(KeyboardInterrupt):
        LocalRay(cpus=1, gpus=0, log=tmp_path / "ray-start.log")
    assert made and not made[0].exists()
    assert wait_for(lambda: not _mentioning(made[0]), 15), _mentioning(made[0])


def _mentioning(scratch: Path) -> list[int]:
    """PIDs of live processes whose command line names ``scratch``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and str(scratch) in " ".join(
                proc.info["cmdline"] or []
            ):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return [pid for pid in found if pid != os.getpid()]
