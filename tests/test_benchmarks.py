"""The benchmark suite runs: ``benchmarks/run.py --quick`` writes every row and picture, and
leaves no process behind. It checks that the suite works, not how fast distsgd is."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import loadclock
import psutil
import pytest
from conftest import ROOT

ROWS = ["1", "1b", "2", "2b", "2c", "3", "4", "4b"]
TF_MISSING = "not measured: pass --tf-python (see docs/performance.md for install)"


def _marked(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries ``marker`` (the suite and all it started)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("DISTSGD_BENCH_TEST") == marker:
                found.append(proc)
    return found


@pytest.mark.slow
@pytest.mark.xdist_group("demo-runs")
def test_quick_suite_writes_every_row_and_cleans_up(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = {**os.environ, "DISTSGD_BENCH_TEST": marker}
    started = time.monotonic()
    try:
        done = loadclock.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "run.py"),
                "--quick",
                "--figures",
                # Figures 2 (a parameter server against plain PyTorch), 3 (all-reduce against
                # DDP) and 5 (the transports): every kind of run the suite makes. Not 1, 4 and
                # 6 (more Hogwild and DOWNPOUR runs of the same kinds, a minute of the suite's
                # 12): their rows and table say so.
                "2,3,5",
                "--out",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        seconds = time.monotonic() - started
        deadline = time.monotonic() + 10
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline()[:4])) for p in _marked(marker)]
    finally:
        for proc in _marked(marker):  # only what this test started
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert not left, f"the suite left processes running: {left}"
    print(f"quick suite: {seconds:.0f} s")

    for name in ("results.md", "results.json", "throughput.png", "transport.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for name in ("throughput.png", "transport.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    report = json.loads((tmp_path / "results.json").read_text())
    assert [row["key"] for row in report["rows"]] == ROWS
    machine = report["machine"]
    for key in ("cpu", "cores", "python", "torch", "numpy", "grpcio", "distsgd_commit"):
        assert machine[key], key
    for row in report["rows"]:
        assert "failed" not in f"{row['distsgd']} {row['reference']}", row
    rows = {row["key"]: row for row in report["rows"]}
    assert rows["2"]["reference"] == TF_MISSING
    for key in ("1", "1b", "4"):
        assert rows[key]["distsgd"] == rows[key]["reference"] == "not run (--figures)", key
    for key in ("2", "2b", "3"):
        assert rows[key]["distsgd_samples"][0]["rate"] > 0, key
    for key in ("2b", "3", "4b"):  # 4b: figure 2's plain run
        assert rows[key]["reference_samples"][0]["rate"] > 0, key
        assert rows[key]["ratio"] is not None or key == "4b", key
    sizes = report["transport"]["sizes"]
    assert [round(s["megabytes"]) for s in sizes] == [1, 4]
    assert all(s["grpc_pull_gbps"] > 0 and s["grpc_push_gbps"] > 0 for s in sizes)
    paths = report["transport"]["paths"]
    assert paths["grpc"]["available"]
    for name, path in paths.items():
        if path["available"]:
            assert all(s[f"{name}_pull_gbps"] > 0 and s[f"{name}_push_gbps"] > 0 for s in sizes)
    assert report["step_sizes"] == []

    text = (tmp_path / "results.md").read_text()
    for key in ROWS:
        assert f"\n| {key} | " in text, key
    assert TF_MISSING in text
    assert "| 1 MB |" in text and "| 4 MB |" in text
