"""`distsgd run` end to end with its security on: the 0600 secret never on a command line,
and a whole run over mutual TLS. Fault injection of delays and partitions."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, metrics, one_cert_for_all, run_distsgd, wait_for

pytestmark = pytest.mark.slow
BLOBS = str(SCRIPTS / "blobs.py")


def test_run_over_mutual_tls(tmp_path: Path) -> None:
    pki = one_cert_for_all(tmp_path)
    run_dir = tmp_path / "run"
    args = ["run", "--scheme", "sync", "--quiet", "--run-dir", str(run_dir)]
    args += [
        "--tls-cert",
        str(pki["cert"]),
        "--tls-key",
        str(pki["key"]),
        "--tls-ca",
        str(pki["ca"]),
    ]
    done = run_distsgd([*args, BLOBS, "--steps", "20"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mutual TLS" in (run_dir / "logs" / "ps0.log").read_text()


@pytest.mark.own_fork_server  # every process of the run, in the launcher's tree
def test_secret_is_0600_and_never_on_a_command_line(spawn, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = spawn(
        [
            "run",
            "--scheme",
            "hogwild",
            "--run-dir",
            str(run_dir),
            BLOBS,
            "--steps",
            "300",
            "--slow",
            "0.02",
        ]
    )
    assert wait_for(lambda: any("loss" in r for r in metrics(run_dir)), 90)
    secret_file = run_dir / "secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = secret_file.read_text().strip()
    tasks = psutil.Process(proc.pid).children(recursive=True)
    assert len(tasks) >= 3
    for task in tasks:
        assert not any(secret in arg for arg in task.cmdline())
        assert "DISTSGD_SECRET" not in task.environ()  # the file's path travels, not the secret
    assert secret not in (run_dir / "config.json").read_text()


def test_delay_and_partition_faults(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # downpour: local steps need no server, so pushes made while cut off are lost (a worker
    # whose next call is a pull just waits for the partition to heal).
    args = ["run", "--scheme", "downpour", "--window", "2", "--quiet", "--run-dir", str(run_dir)]
    args += ["--inject-fault", "delay:worker:1=30ms"]
    args += ["--inject-fault", "partition:worker:0@step=10+2s"]
    done = run_distsgd([*args, BLOBS, "--steps", "60"])
    assert done.returncode == 0, done.stdout[-3000:]
    records = metrics(run_dir)
    last = {r["task"]: r for r in records if "lost_pushes" in r}
    assert last["worker0"]["lost_pushes"] > 0 and last["worker1"]["lost_pushes"] == 0
    span = {
        w: max(r["time"] for r in records if r.get("task") == w and "loss" in r)
        - min(r["time"] for r in records if r.get("task") == w and "loss" in r)
        for w in ("worker0", "worker1")
    }
    assert span["worker1"] >= 60 * 0.03 * 0.9  # every step of worker 1 took 30 ms longer
    assert json.loads((run_dir / "result.json").read_text())["test_accuracy"] > 0.9
