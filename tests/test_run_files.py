"""A run folder and everything in it are its user's only: folders 0700, files 0600 (issue 18,
item 2.5), whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SCRIPTS, run_distsgd

from distsgd.control.metrics import MetricsWriter
from distsgd.launcher.progress import Console
from distsgd.util import open_private, private_dir, write_atomic

BLOBS = str(SCRIPTS / "blobs.py")


def _exposed(root: Path) -> list[str]:
    """Every folder or file under ``root`` (itself included) that group or others may use."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            found.append(f"{oct(mode)} {path.relative_to(root.parent)}")
    return found


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask, so that only the modes distsgd asks for count."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_the_writers_make_private_folders_and_files(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "run"
    private_dir(root / "a" / "b")
    write_atomic(root / "c" / "result.json", "{}\n")
    os.close(open_private(root / "a" / "x.log", os.O_WRONLY | os.O_APPEND))
    writer = MetricsWriter(root / "metrics.jsonl", "worker0")
    writer.log(event="step", step=1, loss=0.5)
    writer.close()
    console = Console(quiet=True)
    console.keep(root / "launcher.log")
    console.line("hello")
    console.close()
    assert (root / "metrics.jsonl").exists() and list((root / "tensorboard").rglob("events.*"))
    assert _exposed(root) == []


@pytest.mark.slow
def test_a_real_runs_folder_is_private(tmp_path: Path, open_umask: None) -> None:
    """A two-worker run with checkpoints: its folder, logs, metrics, TensorBoard events,
    checkpoints and result are 0700 and 0600, under umask 0."""
    run_dir = tmp_path / "run"
    done = run_distsgd(
        [
            "run",
            "--workers",
            "2",
            "--scheme",
            "hogwild",
            "--quiet",
            "--checkpoint-every",
            "1s",
            "--run-dir",
            str(run_dir),
            BLOBS,
            "--steps",
            "30",
            "--slow",
            "0.05",
        ]
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert list((run_dir / "checkpoints").rglob("*.npz")), "no checkpoint was written"
    assert (run_dir / "logs" / "worker1.log").exists()
    assert _exposed(run_dir) == []
