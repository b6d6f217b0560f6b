"""A task's error in one line, whole: a message of several lines is joined, not cut after its
first (which may end inside a quotation and left a stray quote), and the launcher's one line
about a task that failed for good names the script's error, not its log's last line (issue 36,
item 12a)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_distsgd

from distsgd.control.errors import MESSAGE_LIMIT, one_line
from distsgd.launcher.bootstrap import raised


def test_a_message_of_several_lines_is_one_line_whole(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    try:
        exec(compile("raise ValueError(\"bad batch 'x\\ny'\")", str(script), "exec"))
    except ValueError as exc:
        said = raised(exc, script)
    assert said == "ValueError at line 1: bad batch 'x y'"
    assert one_line("  a\n\n   b  \n") == "a b"
    long = one_line("x" * (2 * MESSAGE_LIMIT))
    assert len(long) == MESSAGE_LIMIT and long.endswith("...")


FAILS = """\
import sys
sys.path.insert(0, {scripts!r})
import torch.nn.functional as F
from torch import nn
import distsgd
from blobs import make_data

calls = [0]
def loss(out, y):
    calls[0] += 1
    if calls[0] == 4:
        raise ValueError("bad batch 'x\\ny'")
    return F.cross_entropy(out, y)

model = nn.Sequential(nn.Linear(8, 4))
distsgd.train(model=model, loss_fn=loss, train_data=make_data(320, 1),
              config=distsgd.TrainConfig(batch_size=16, steps=10))
"""


def test_the_launcher_names_the_scripts_error_in_its_line(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS.format(scripts=str(Path(__file__).parent / "scripts")))
    run_dir = tmp_path / "run"
    flags = ["--scheme", "allreduce", "--workers", "1", "--max-restarts", "0", "--quiet"]
    done = run_distsgd(["run", *flags, "--run-dir", str(run_dir), str(script)])
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("distsgd: error: ")]
    assert line == (
        "distsgd: error: task worker0 failed (exit code 1): ValueError at line 12: bad batch "
        "'x y'; its last log lines:"
    )
    record = json.loads((run_dir / "worker0.setup-error.json").read_text())
    assert record["kind"] == "crash"


def test_the_first_steps_refusal_says_the_whole_error() -> None:
    from distsgd.runtime.first_step import _said

    assert _said(ValueError("labels 'a\nb' unknown")) == "ValueError: labels 'a b' unknown"
