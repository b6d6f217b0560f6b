"""A worker's setup error reaches the launcher as a typed record in the run folder
(:class:`~distsgd.control.errors.SetupErrorRecord`), not as text scanned from its log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from distsgd.cluster import TaskId
from distsgd.control.errors import SETUP_EXIT_CODE, SetupError, SetupErrorRecord
from distsgd.control.folder import LocalFiles
from distsgd.control.task import ENV_VAR, TaskEnv
from distsgd.launcher.bootstrap import record_setup_error, run_script

WORKER1 = TaskId(job="worker", index=1)


def _env(run_dir: Path, index: int = 1) -> str:
    return TaskEnv(
        cluster={"ps": [], "worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        task_index=index,
        scheme="allreduce",
        run_dir=str(run_dir),
    ).to_json()


def test_a_record_round_trips_and_is_cleared(tmp_path: Path) -> None:
    assert SetupErrorRecord.load(tmp_path, WORKER1) is None
    record = SetupErrorRecord(task=WORKER1, message="no data; give train_data")
    record.save(LocalFiles(tmp_path))
    assert SetupErrorRecord.path(tmp_path, WORKER1).name == "worker1.setup-error.json"
    assert SetupErrorRecord.load(tmp_path, WORKER1) == record
    assert SetupErrorRecord.load(tmp_path, TaskId(job="worker", index=0)) is None
    SetupErrorRecord.clear(tmp_path, WORKER1)
    SetupErrorRecord.clear(tmp_path, WORKER1)  # none left: no error
    assert SetupErrorRecord.load(tmp_path, WORKER1) is None


def test_a_damaged_record_reads_as_none(tmp_path: Path) -> None:
    SetupErrorRecord.path(tmp_path, WORKER1).write_text('{"task": "worker1"')
    assert SetupErrorRecord.load(tmp_path, WORKER1) is None


def test_the_worker_records_its_setup_error_where_its_task_says(tmp_path: Path) -> None:
    record_setup_error(SetupError("bad; fix it"), {ENV_VAR: _env(tmp_path)})
    assert SetupErrorRecord.load(tmp_path, WORKER1) == SetupErrorRecord(
        task=WORKER1, message="bad; fix it"
    )
    record_setup_error(SetupError("alone"), {})  # a script run alone: nothing to write to
    record_setup_error(SetupError("damaged"), {ENV_VAR: "not json"})
    assert SetupErrorRecord.load(tmp_path, WORKER1) is not None


def test_the_bootstrap_exits_with_the_setup_code_and_leaves_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "refuses.py"
    script.write_text(
        "import distsgd\nraise distsgd.SetupError('no train_data; pass train_data=...')\n"
    )
    monkeypatch.setenv(ENV_VAR, _env(tmp_path, index=0))
    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    assert run_script(str(script), []) == SETUP_EXIT_CODE
    assert "distsgd: error: no train_data" in capsys.readouterr().err
    record = SetupErrorRecord.load(tmp_path, TaskId(job="worker", index=0))
    assert record is not None and record.message == "no train_data; pass train_data=..."
