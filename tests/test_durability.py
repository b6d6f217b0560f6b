"""What the launcher says when a server's write-ahead log goes down and comes back
(launcher/durability.py), and a full disk under the metrics lines and checkpoints."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from distsgd.control.metrics import MetricsWriter
from distsgd.launcher.durability import DurabilityWatch
from distsgd.launcher.errors import RunFailed
from distsgd.transport.proto import distsgd_pb2 as pb


def _info(*, down: bool, outages: int, seconds: float, incarnation: int = 5) -> pb.InfoResponse:
    wal = pb.WalStatus(
        down=down,
        outages=outages,
        down_seconds=seconds,
        error="No space left on device",
        folder="/runs/r/wal/ps0",
        generation=3,
    )
    return pb.InfoResponse(registered=True, server_incarnation=incarnation, wal=wal)


def _watch(tmp_path: Path) -> tuple[DurabilityWatch, list[str], list[dict[str, Any]]]:
    notes: list[str] = []
    events: list[dict[str, Any]] = []
    watch = DurabilityWatch(
        note=notes.append, event=lambda **f: events.append(f), run_dir=tmp_path, give_up=120.0
    )
    return watch, notes, events


def test_the_console_hears_durability_lost_and_regained_as_it_happens(tmp_path: Path) -> None:
    watch, notes, events = _watch(tmp_path)
    watch.see(0, _info(down=False, outages=0, seconds=0.0), 10)
    assert not notes and watch.summary() is None
    watch.see(0, _info(down=True, outages=1, seconds=0.5), 11)
    assert len(notes) == 1 and "ps0: durability lost" in notes[0]
    assert "No space left on device" in notes[0] and "/runs/r/wal/ps0" in notes[0]
    watch.see(0, _info(down=True, outages=1, seconds=20.0), 11)
    assert len(notes) == 1  # said once
    watch.see(0, _info(down=False, outages=1, seconds=40.2), 12)
    assert len(notes) == 2 and "ps0: durability regained" in notes[1] and "40.2s" in notes[1]
    assert [e["event"] for e in events] == ["durability_lost", "durability_regained"]
    summary = watch.summary()
    assert summary is not None and summary["ps0"]["outages"] == 1
    assert summary["ps0"]["down_seconds"] == pytest.approx(40.2)


def test_an_outage_between_two_reads_is_still_said(tmp_path: Path) -> None:
    watch, notes, _ = _watch(tmp_path)
    watch.see(1, _info(down=False, outages=0, seconds=0.0), 1)
    watch.see(1, _info(down=False, outages=1, seconds=0.3), 2)
    assert ["lost" in notes[0], "regained" in notes[1]] == [True, True]


def test_a_log_down_too_long_stops_the_run_in_one_line(tmp_path: Path) -> None:
    watch, _, _ = _watch(tmp_path)
    with pytest.raises(RunFailed) as failed:
        watch.see(0, _info(down=True, outages=1, seconds=121.0), 5)
    line = str(failed.value)
    assert "\n" not in line and "/runs/r/wal/ps0" in line
    assert f"distsgd run --resume {tmp_path}" in line


def test_lost_updates_at_a_restart_are_said_on_the_console(tmp_path: Path) -> None:
    watch, notes, _ = _watch(tmp_path)
    watch.lost_updates(0, 0)
    assert not notes
    watch.lost_updates(0, 1581)
    assert "1581 updates" in notes[0] and "lost" in notes[0]
    summary = watch.summary()
    assert summary is not None and summary["ps0"]["lost_updates"] == 1581


def test_a_full_disk_drops_metrics_lines_instead_of_ending_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, "worker0")
    real = os.write
    full = {"on": False, "torn": False}

    def write(fd: int, data: bytes) -> int:
        if full["torn"]:  # the disk takes part of a line, then nothing
            full["torn"] = False
            return real(fd, data[:7])
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    writer.log(step=1)
    full["torn"] = full["on"] = True
    writer.log(step=2)
    writer.log(step=3)
    full["on"] = False
    writer.log(step=4)
    writer.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1 and json.loads(lines[-1])["step"] == 4
    assert writer.dropped == 2


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_skips_a_worker_checkpoint_with_a_warning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    background: bool,
) -> None:
    from distsgd.runtime import checkpoint, state_writer

    def full(path: Path, state: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(state_writer, "write_state_file", full)  # the forked writer's too
    where: dict[str, Any] = {"run_dir": tmp_path, "rank": 1, "num_workers": 2, "wait": 1.0}
    saver = checkpoint.Checkpointer(**where, every_steps=5, every_seconds=0, background=background)
    state = {"worker": 1, "local_step": 5, "global_step": 9, "steps": 10, "position": None}
    state |= {"model": {}, "scheme": {}, "scheme_name": "hogwild"}
    saver.maybe_save_worker(5, 0, lambda: state)  # no raw errno: training goes on
    saver.close()
    assert saver.skipped == 1 and saver.count == 0
    assert (saver.due_step is None) is not background  # a background write fails later
    assert "checkpoint at step 5 skipped: no space left" in caplog.text
    assert not list((tmp_path / "checkpoints" / "workers").glob("*"))


def test_a_launcher_write_that_finds_no_room_stops_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distsgd.launcher import run as launcher_run
    from distsgd.launcher.tasks import write_tasks

    class Local:
        class state:  # stands in for LocalRun.state (a RunState)
            run_dir = tmp_path
            ckpt_root = tmp_path / "checkpoints"

        def run(self) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.json"))

    with pytest.raises(RunFailed) as failed:
        launcher_run._run(Local())  # type: ignore[arg-type]
    line = str(failed.value)
    assert "\n" not in line and "Errno" not in line
    assert f"the disk that holds {tmp_path} is full (No space left on device" in line

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("distsgd.launcher.tasks.write_atomic", full)

    class Supervisor:
        tasks: dict[str, Any] = {}

    write_tasks(tmp_path, Supervisor())  # type: ignore[arg-type]  # diagnostics: no raise
