"""``control/spec.py``: the run folder's one settings file, typed (:class:`RunSpec`), and the one
check of ``--max-workers`` and ``--wire-dtype``. No process, no torch."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import loadclock
import pytest

from distsgd.control.config import TrainConfig
from distsgd.control.folder import CONFIG_FILE
from distsgd.control.spec import RUN_SPEC_VERSION, RunSpec, check_worker_bounds
from distsgd.ps.compression import WIRE_DTYPES, encoding_for
from distsgd.ps.rules import MAX_WORKERS, check_max_workers

SCRIPT = str(Path(__file__).parent / "scripts" / "blobs.py")

OLD_CONFIG = {  # what a run folder written before RunSpec holds (no version, no bounds)
    "script": SCRIPT,
    "script_args": ["--steps", "20"],
    "scheme": "hogwild",
    "scheme_options": {},
    "overrides": {},
    "workers": 1,
    "ps": 1,
    "threads_per_worker": 1,
    "run_id": "0123456789abcdef",
    "checkpoint_every": 5,
    "checkpoint_seconds": 0.0,
}


def _spec(**changes: object) -> RunSpec:
    fields: dict[str, object] = {
        "script": SCRIPT,
        "scheme": "hogwild",
        "workers": 2,
        "ps": 1,
        "run_id": "abc",
        "overrides": {"world_size": "dynamic"},
        "min_workers": 1,
        "max_workers": 4,
        **changes,
    }
    return RunSpec(**fields)  # type: ignore[arg-type]


def test_save_and_load_give_the_same_spec_in_a_private_file(tmp_path: Path) -> None:
    spec = _spec(script_args=("--steps", "3"), scheme_options={"server_lr": 0.5})
    spec.save(tmp_path)
    path = tmp_path / CONFIG_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["version"] == RUN_SPEC_VERSION
    loaded = RunSpec.load(tmp_path)
    assert loaded == spec and loaded.script_args == ("--steps", "3")
    assert (loaded.lowest_workers, loaded.highest_workers, loaded.elastic) == (1, 4, True)
    assert loaded.dynamic_world_size


def test_a_config_written_before_the_version_field_loads(tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_text(json.dumps(OLD_CONFIG))
    spec = RunSpec.load(tmp_path)
    assert spec.version == RUN_SPEC_VERSION and spec.checkpoint_every == 5
    assert (spec.lowest_workers, spec.highest_workers, spec.elastic) == (1, 1, False)
    minimal = {k: OLD_CONFIG[k] for k in ("script", "script_args", "scheme", "scheme_options")}
    minimal.update(overrides={}, workers=2, ps=1, run_id="r")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(minimal))
    assert RunSpec.load(tmp_path).threads_per_worker == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "not a distsgd run folder (no config.json)"),
        ("{not json", "damaged"),
        ("[1, 2]", "damaged (not a JSON object)"),
        (json.dumps({"script": SCRIPT}), "damaged (no script_args, scheme"),
        (json.dumps({**OLD_CONFIG, "colour": "red"}), "unknown settings colour"),
        (json.dumps({**OLD_CONFIG, "version": 2}), "version 2, this distsgd reads 1"),
        (json.dumps({**OLD_CONFIG, "workers": "2"}), "workers must be a whole number"),
        (json.dumps({**OLD_CONFIG, "overrides": {"speed": 1}}), "speed are no training settings"),
        (json.dumps({**OLD_CONFIG, "overrides": {"lr": -1}}), "lr must be positive"),
    ],
)
def test_a_missing_damaged_or_foreign_file_is_one_line(
    tmp_path: Path, text: str | None, expected: str
) -> None:
    if text is not None:
        (tmp_path / CONFIG_FILE).write_text(text)
    with pytest.raises(ValueError) as info:
        RunSpec.load(tmp_path)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert "; " in message  # cause; fix


def test_worker_bounds_are_checked_in_one_place() -> None:
    with pytest.raises(ValueError, match="need 1 <= min <= workers <= max"):
        _spec(workers=5)
    with pytest.raises(ValueError, match="must be 0 \\(= --workers\\) or more"):
        check_worker_bounds(workers=2, min_workers=-1, max_workers=0)
    with pytest.raises(ValueError, match=f"--max-workers must be in 0..{MAX_WORKERS}"):
        check_worker_bounds(workers=2, min_workers=0, max_workers=MAX_WORKERS + 1)
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        check_worker_bounds(workers=0, min_workers=0, max_workers=0)
    assert check_max_workers(MAX_WORKERS) == MAX_WORKERS
    check_worker_bounds(workers=2, min_workers=0, max_workers=0)


def test_the_spec_refuses_values_of_the_wrong_type() -> None:
    with pytest.raises(ValueError, match="script_args must be text"):
        _spec(script_args=(1,))
    with pytest.raises(ValueError, match="scheme_options must be a JSON object"):
        _spec(scheme_options=[])
    with pytest.raises(ValueError, match="checkpoint_seconds must be 0 or more"):
        _spec(checkpoint_seconds=-1.0)
    with pytest.raises(ValueError, match="ps must be a whole number of at least 0"):
        _spec(ps=True)
    with pytest.raises(ValueError, match="script and scheme must be given"):
        _spec(script="")


def test_wire_dtype_has_one_check_that_the_config_uses() -> None:
    for name in WIRE_DTYPES:
        assert TrainConfig(wire_dtype=name).wire_dtype == name
        encoding_for(name)
    with pytest.raises(ValueError, match="unknown wire dtype 'int3'"):
        TrainConfig(wire_dtype="int3")
    with pytest.raises(ValueError, match="unknown wire dtype 'int3'"):
        encoding_for("int3")


def test_the_spec_imports_with_torch_blocked() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import distsgd.control.spec\n"
        "assert sys.modules['torch'] is None\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    done = loadclock.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_task_env_carries_faults_and_tls_typed_through_its_json(tmp_path: Path) -> None:
    from distsgd.control.faults import Fault
    from distsgd.control.task import TaskEnv
    from distsgd.transport.security import TlsConfig

    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    tls = TlsConfig(cert=tmp_path / "cert.pem", key=tmp_path / "key.pem", ca=tmp_path / "ca.pem")
    faults = (Fault.parse("delay:worker:1=200ms"), Fault.parse("partition:worker:1@step=3+1s"))
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:0"] * 2},
        task_index=1,
        scheme="hogwild",
        faults=faults,
        tls=tls,
    )
    back = TaskEnv.from_json(env.to_json())
    assert back == env and back.tls == tls and back.faults == faults
    assert back.faults[0].task_id == back.task
    plain = TaskEnv.from_json(TaskEnv.standalone().to_json())
    assert plain.tls is None and plain.faults == ()
    with pytest.raises(ValueError, match="tls must be"):
        TaskEnv.from_json(env.to_json().replace('"tls": [', '"tls": ["x", '))


def test_metrics_lines_are_routed_by_task_id_not_by_name_prefix() -> None:
    from distsgd_compare.summary import _is_eval_line, _is_worker_line

    assert _is_worker_line({"task": "worker3", "loss": 0.5})
    assert not _is_worker_line({"task": "ps0", "loss": 0.5})
    assert not _is_worker_line({"task": "launcher", "loss": 0.5})
    assert not _is_worker_line({"task": "workers", "loss": 0.5})
    assert not _is_worker_line({"task": "worker1"})
    assert _is_eval_line({"task": "worker0", "test_loss": 0.1})
    assert not _is_eval_line({"task": "worker1", "test_loss": 0.1})
    assert not _is_eval_line({"loss": 0.1, "test_loss": 0.1})
