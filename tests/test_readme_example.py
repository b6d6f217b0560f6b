"""The README's "Train your own model" script runs as shown: alone, and under `distsgd run`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import loadclock
import pytest
from conftest import ROOT, final_accuracy, run_scheme

pytestmark = pytest.mark.slow


def _readme_script(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = next(b for b in blocks if "distsgd.train(" in b)
    path = tmp_path / "train.py"
    path.write_text(example)
    return path


def test_readme_script_alone(tmp_path: Path) -> None:
    script = _readme_script(tmp_path)
    done = loadclock.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip().splitlines()[-1]) > 0.9


@pytest.mark.parametrize("scheme", ["sync", "allreduce"])
def test_readme_script_under_run(scheme: str, tmp_path: Path) -> None:
    script = _readme_script(tmp_path)
    accuracy = final_accuracy(run_scheme(scheme, tmp_path / "r", script))
    assert accuracy > 0.9
    # only the chief prints (distsgd.task().is_chief): the other worker printed no None
    assert "None" not in (tmp_path / "r" / "logs" / "worker1.log").read_text()
