"""The README's "Train your own model" script runs as shown: alone, and under `distsgd run`."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch
from conftest import ROOT, final_accuracy, run_scheme

pytestmark = pytest.mark.slow


def _readme_script(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = next(b for b in blocks if "distsgd.train(" in b)
    path = tmp_path / "train.py"
    path.write_text(example)
    return path


def test_readme_script_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python train.py``: run as ``__main__`` in this process (a process of its own cost its
    own import of torch), on one torch thread as a task of ``distsgd run`` on 2 cores."""
    script = _readme_script(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert float(capsys.readouterr().out.strip().splitlines()[-1]) > 0.9


@pytest.mark.parametrize("scheme", ["sync", "allreduce"])
def test_readme_script_under_run(scheme: str, tmp_path: Path) -> None:
    script = _readme_script(tmp_path)
    accuracy = final_accuracy(run_scheme(scheme, tmp_path / "r", script))
    assert accuracy > 0.9
    # only the chief prints (distsgd.task().is_chief): the other worker printed no None
    assert "None" not in (tmp_path / "r" / "logs" / "worker1.log").read_text()
