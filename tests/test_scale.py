"""``distsgd elastic scale`` and ``distsgd elastic join``: the request file, its answer, and the
refusals a user meets (a fixed-size run, a number out of bounds, no launcher, a taken index)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from distsgd.cli.main import main
from distsgd.control.folder import METRICS_FILE
from distsgd.launcher.config import ClusterSize, LaunchConfig
from distsgd.launcher.join import join_env
from distsgd.launcher.scale import (
    LAUNCHER_FILE,
    SCALE_FILE,
    ScaleRequest,
    read_scale_request,
    request_scale,
)

SCRIPT = str(Path(__file__).parent / "scripts" / "blobs.py")


def _run_folder(tmp_path: Path, **config: object) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    saved = {
        "script": SCRIPT,
        "script_args": [],
        "scheme": "hogwild",
        "scheme_options": {},
        "overrides": {"world_size": "dynamic"},
        "workers": 2,
        "ps": 1,
        "run_id": "abc",
        "min_workers": 1,
        "max_workers": 4,
        **config,
    }
    (run / "config.json").write_text(json.dumps(saved))
    (run / "cluster.json").write_text(
        json.dumps({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:0"] * 4})
    )
    (run / "secret").write_text("s" * 64)
    (run / "secret").chmod(0o600)
    (run / LAUNCHER_FILE).write_text(f"{os.getpid()}\n")  # this test plays the launcher
    return run


def test_launch_config_bounds_and_world_size() -> None:
    with pytest.raises(ValueError, match="need 1 <= min <= workers <= max"):
        LaunchConfig(script=SCRIPT, scheme="hogwild", size=ClusterSize(workers=3, max_workers=2))
    with pytest.raises(ValueError, match="need 1 <= min <= workers <= max"):
        LaunchConfig(
            script=SCRIPT,
            scheme="hogwild",
            size=ClusterSize(workers=2, min_workers=3, max_workers=4),
        )
    with pytest.raises(ValueError, match="--world-size dynamic"):
        LaunchConfig(script=SCRIPT, scheme="hogwild", size=ClusterSize(workers=2, max_workers=4))
    config = LaunchConfig(
        script=SCRIPT,
        scheme="hogwild",
        overrides={"world_size": "dynamic"},
        size=ClusterSize(workers=2, max_workers=4),
    )
    assert config.size.elastic and (config.size.lowest_workers, config.size.highest_workers) == (
        2,
        4,
    )
    assert not LaunchConfig(
        script=SCRIPT, scheme="hogwild", size=ClusterSize(workers=2)
    ).size.elastic
    # a collective scheme scales by a restart: no dynamic world size needed
    assert LaunchConfig(
        script=SCRIPT, scheme="allreduce", size=ClusterSize(workers=2, max_workers=3)
    ).size.elastic


def test_faults_may_name_the_workers_a_run_can_grow_to() -> None:
    """--inject-fault delay:worker:3 is for worker3: one a run of 2 workers may start when it
    grows to --max-workers 4, and none a fixed run of 2 has."""
    dynamic = {"world_size": "dynamic"}
    faults = ["delay:worker:3=50ms"]
    grows = LaunchConfig(
        script=SCRIPT,
        scheme="hogwild",
        overrides=dynamic,
        faults=faults,
        size=ClusterSize(workers=2, max_workers=4),
    )
    assert grows.faults == faults
    with pytest.raises(ValueError, match=r"no worker4 \(4 worker tasks at most\); use an index"):
        LaunchConfig(
            script=SCRIPT,
            scheme="hogwild",
            overrides=dynamic,
            faults=["delay:worker:4=50ms"],
            size=ClusterSize(workers=2, max_workers=4),
        )
    with pytest.raises(ValueError, match=r"no worker3 \(2 worker tasks\); use an index below 2"):
        LaunchConfig(script=SCRIPT, scheme="hogwild", faults=faults, size=ClusterSize(workers=2))


def test_scale_request_is_answered_by_its_sequence_number(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)

    def launcher() -> None:  # answers the first request it sees, as LocalRun._poll_scale does
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            request = read_scale_request(run)
            if request is not None:
                line = {"event": "scale", "seq": request.seq, "workers_before": 2}
                line["workers"] = request.workers
                with open(run / METRICS_FILE, "a") as f:
                    f.write(json.dumps(line) + "\n")
                return
            time.sleep(0.02)

    thread = threading.Thread(target=launcher)
    thread.start()
    answer = request_scale(run, 3, timeout=10)
    thread.join()
    assert answer["workers"] == 3 and answer["seq"] == 1
    assert read_scale_request(run) == ScaleRequest(workers=3, seq=1)


def test_scale_refusals_name_cause_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _run_folder(tmp_path)
    assert main(["elastic", "scale", str(run), "--workers", "5"]) == 2
    assert "ask for a number in 1..4" in capsys.readouterr().err
    assert not (run / SCALE_FILE).exists()
    (run / LAUNCHER_FILE).write_text("999999999\n")
    assert main(["elastic", "scale", str(run), "--workers", "3"]) == 2
    assert "no launcher is running" in capsys.readouterr().err
    fixed = _run_folder(tmp_path / "f", min_workers=2, max_workers=2)
    assert main(["elastic", "scale", str(fixed), "--workers", "3"]) == 2
    assert "fixed size of 2 workers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 1"):
        ScaleRequest(workers=0, seq=1)
    (run / SCALE_FILE).write_text('{"workers": "3", "seq": 1}')
    assert read_scale_request(run) is None  # a damaged request is no request


def test_join_takes_the_highest_free_index_and_refuses_taken_ones(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    (run / "tasks.json").write_text(json.dumps({"worker0": os.getpid(), "worker3": os.getpid()}))
    before = dict(os.environ)
    env, script, _, secret = join_env(run, None, claim=lambda index: True)  # ps0 grants it
    assert dict(os.environ) == before  # nothing leaks into this process (the CLI sets it)
    assert secret == (run / "secret").resolve()
    assert env.task_index == 2 and env.registered_workers == 2 and script == SCRIPT
    assert env.num_workers == 2 and env.run_id == "abc"
    with pytest.raises(ValueError, match=r"worker3 .* is running"):
        join_env(run, 3)
    with pytest.raises(ValueError, match=r"index in 1\.\.3"):
        join_env(run, 0)
    fixed = _run_folder(tmp_path / "f", overrides={})
    with pytest.raises(ValueError, match="fixed world size"):
        join_env(fixed, None)
    collective = _run_folder(tmp_path / "c", scheme="allreduce", ps=0)
    with pytest.raises(ValueError, match="collective scheme"):
        join_env(collective, None)
