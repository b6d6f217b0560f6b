"""The tutorial (docs/tutorial/) runs as written: each page's shell commands, on 127.0.0.1.

Every page runs in a folder of its own: first the tutorial's files are written there (a fenced
block whose first line is a comment naming a file, ``# train.py``, is that file), then the
page's ```bash blocks, in order, run as one ``bash -eu`` script (a block whose first line is
``# doctest: skip`` is left out: several machines). ``distsgd`` and ``python`` are this
interpreter's. The page must stop what it starts: processes of the script's session still
running when it ends fail the test, and every one left (or all, on a timeout) is killed by
PID. Then the test checks what the page says the commands leave behind. The ```python blocks
are run by tests/test_docs.py; test_docs also checks that every ``distsgd`` command of a
skipped block parses.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, metrics, wait_for
from test_docs import SKIP_MARKER, fenced_blocks

TUTORIAL = ROOT / "docs" / "tutorial"
PAGE_SECONDS = 180
FILE_LINE = re.compile(r"#\s*([\w.-]+\.(?:py|toml|json))\s*")
"""The first line of a block that is a file of the tutorial."""


def _pages() -> list[Path]:
    return sorted(TUTORIAL.glob("*.md"))


def _files() -> dict[str, str]:
    """The tutorial's files (name -> content), from every page."""
    files: dict[str, str] = {}
    for page in _pages():
        for _, _, code in fenced_blocks(page.read_text(encoding="utf-8"), ("python", "toml")):
            named = FILE_LINE.fullmatch(code.split("\n", 1)[0])
            if named:
                files[named.group(1)] = code
    return files


def _script(page: Path) -> str:
    """The page's ```bash blocks that run here, as one script."""
    blocks = [
        code
        for _, _, code in fenced_blocks(page.read_text(encoding="utf-8"), ("bash",))
        if not code.lstrip().startswith(SKIP_MARKER)
    ]
    assert blocks, f"{page.name} has no shell commands to run"
    return "\n".join(blocks)


def _session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (the page's background tasks among them)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _stop(procs: list[psutil.Process]) -> None:
    """SIGTERM (a launcher then stops its own tasks), SIGKILL after 5 s."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def run_page(page: Path, folder: Path) -> str:
    """Run the page's commands in ``folder``; their output (stdout and stderr)."""
    for name, content in _files().items():
        (folder / name).write_text(content, encoding="utf-8")
    (folder / "page.sh").write_text(_script(page), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTSGD_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    proc = psutil.Popen(
        ["bash", "-eu", "page.sh"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # the page's processes: this session, found by its id
    )
    left: list[psutil.Process] = []
    try:
        out, _ = proc.communicate(timeout=PAGE_SECONDS)
        wait_for(lambda: not _session(proc.pid), 5)
        left = _session(proc.pid)
    finally:
        children = []
        with contextlib.suppress(psutil.NoSuchProcess):
            children = proc.children(recursive=True)
        _stop([*children, *_session(proc.pid)])
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, f"{page.name} failed (exit {proc.returncode}):\n{out[-4000:]}"
    assert not left, f"{page.name} left processes running: {[p.pid for p in left]}\n{out[-2000:]}"
    return out


def _servers_and_workers(folder: Path, out: str) -> None:
    assert re.search(r"parameter server ps0 listening on 127\.0\.0\.1:\d+ \(run secret", out)
    assert re.search(r"^test accuracy: 0\.\d+$", out, re.MULTILINE), out[-2000:]
    assert {p.name for p in (folder / "run").iterdir()} >= {"metrics.jsonl", "result.json"}
    assert json.loads((folder / "run" / "result.json").read_text())["local_steps"] == 50


def _parameters(folder: Path, out: str) -> None:
    assert "allreduce" in out and "hogwild" in out  # distsgd schemes
    assert sorted(p.name for p in (folder / "replicas" / "logs").iterdir()) == [
        "worker0.log",
        "worker1.log",
    ]
    assert re.search(r"^test accuracy: 0\.\d+$", out, re.MULTILINE), out[-2000:]


def _one_machine(folder: Path, out: str) -> None:
    run = folder / "run"
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == ["ps0.log", "ps1.log", *(f"worker{i}.log" for i in range(4))]
    assert "workers: worker0, worker1, worker2, worker3" in out
    assert re.search(r"^worker0: 12 local steps, 384 samples$", out, re.MULTILINE), out[-2000:]
    result = json.loads((run / "result.json").read_text())
    assert result["local_steps"] == 12 and result["global_step"] == 48
    assert f"final test accuracy: {result['test_accuracy']}" in out


def _many_machines(folder: Path, out: str) -> None:
    result = json.loads((folder / "run" / "result.json").read_text())
    # 400 samples each: 12 batches of 32 per epoch; the server counts both workers' pushes
    assert result["local_steps"] == 24 and result["global_step"] == 48
    assert {r["task"] for r in metrics(folder / "run") if "loss" in r} == {"worker0"}
    assert out.count("done, 24 steps") == 2


CHECKS: dict[str, Callable[[Path, str], None]] = {
    "servers-and-workers.md": _servers_and_workers,
    "parameters.md": _parameters,
    "one-machine.md": _one_machine,
    "many-machines.md": _many_machines,
}
"""What each page says its commands leave behind."""


def test_every_page_has_its_check() -> None:
    assert sorted(CHECKS) == sorted(p.name for p in _pages())
    assert "train.py" in _files()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_tutorial_page_runs(name: str, tmp_path: Path) -> None:
    out = run_page(TUTORIAL / name, tmp_path)
    CHECKS[name](tmp_path, out)
