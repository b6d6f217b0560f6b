"""A real Prometheus scrapes a metrics endpoint (launcher/metrics_endpoint.py) fed by a
synthetic ``metrics.jsonl``, and answers a query for ``distsgd_last_step_timestamp_seconds``.

The binary: ``$DISTSGD_PROMETHEUS``, else ``.ci-prometheus/usr/bin/prometheus`` (what .ci/run
unpacks from Debian's package), else ``prometheus`` on PATH. Without one the test is skipped,
except under CI (``CI=true``, or ``DISTSGD_REQUIRE_PROMETHEUS=1``, which .ci/run sets), where
it fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import synthetic_run
from conftest import ROOT, wait_for

from distsgd.launcher.metrics_endpoint import MetricsEndpoint


def _binary() -> str | None:
    given = os.environ.get("DISTSGD_PROMETHEUS")
    if given:
        return given
    unpacked = ROOT / ".ci-prometheus" / "usr" / "bin" / "prometheus"
    return str(unpacked) if unpacked.is_file() else shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={expr}"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return list(json.loads(answer.read())["data"]["result"])
    except (OSError, ValueError, KeyError):  # not up yet
        return []


def test_prometheus_scrapes_the_endpoint(tmp_path: Path) -> None:
    binary = _binary()
    if binary is None:
        why = "no prometheus binary ($DISTSGD_PROMETHEUS, .ci-prometheus/ from .ci/run, PATH)"
        if os.environ.get("CI") == "true" or os.environ.get("DISTSGD_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(why + "; .ci/run's apt-get download prometheus failed")
        pytest.skip(why)
    synthetic_run.write(tmp_path / "run", synthetic_run.lines())
    endpoint = MetricsEndpoint(tmp_path / "run", "127.0.0.1:0")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: distsgd\n"
        f"    static_configs:\n      - targets: ['{endpoint.address}']\n"
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    found: list[dict] = []
    try:

        def scraped() -> bool:
            found[:] = _query(port, "distsgd_last_step_timestamp_seconds")
            return bool(found) or proc.poll() is not None

        assert wait_for(scraped, 30, interval=0.5) and found, (
            tmp_path / "prometheus.log"
        ).read_text()[-3000:]
        tasks = {sample["metric"]["task"]: float(sample["value"][1]) for sample in found}
        assert set(tasks) == {"worker0", "worker1"}
        assert all(0 <= time.time() - t < 60 for t in tasks.values())
        assert found[0]["metric"]["job"] == "distsgd" and found[0]["metric"]["run"] == "run"
        up = _query(port, "up")
        assert up and up[0]["value"][1] == "1"  # the scrape itself succeeded
    finally:
        proc.terminate()  # by its PID, the one process this test started
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        endpoint.close()
