"""The bundled language model (distsgd.demo.lm): its text ships in the package and reads as
shifted byte sequences, and a short run alone learns (the next-byte loss falls well below a
uniform guess over 256 bytes, ln 256 = 5.55)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_distsgd

from distsgd.demo import lm


def test_the_text_reads_as_byte_sequences_and_their_next_bytes() -> None:
    (x, y), (tx, ty) = lm.load_text()
    text = gzip.decompress(lm.TEXT.read_bytes())
    assert len(text) > 400_000 and b"parameter server" in text
    assert x.shape[1] == y.shape[1] == lm.CONTEXT and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:-1, -1], x[1:, 0])
    assert bytes(x[0].tolist()) == text[: lm.CONTEXT]
    assert 8 < len(x) / len(tx) < 10  # 90% for training, 10% for test
    assert bytes(tx[0].tolist()) == text[int(0.9 * len(text)) :][: lm.CONTEXT]
    assert torch.equal(ty[:, :-1], tx[:, 1:])


def test_a_short_run_alone_learns_the_bytes() -> None:
    """In this process on one torch thread, as ``distsgd run`` budgets a worker of a 2-core
    machine (the suite runs three test processes on 2 cores: two threads each spin for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = lm.main(["--steps", "40"])
    finally:
        torch.set_num_threads(threads)
    assert result.test_loss is not None
    assert result.test_loss < math.log(256) - 1.5, result.test_loss


@pytest.mark.slow
def test_distsgd_demo_model_lm_trains_the_language_model(tmp_path: Path) -> None:
    """``distsgd demo --model lm``: the bundled LM under a scheme, its test loss printed last."""
    run_dir = tmp_path / "run"
    args = ["demo", "--model", "lm", "--workers", "2", "--scheme", "hogwild", "--steps", "20"]
    done = run_distsgd([*args, "--quiet", "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("test loss: ") and float(last.split()[-1]) < 4.5, last
    result = json.loads((run_dir / "result.json").read_text())
    assert result["scheme"] == "hogwild" and result["local_steps"] == 20


def test_an_unknown_demo_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """(The CLI's main, in this process: a refused command starts no process.)"""
    from distsgd.cli.main import main

    with pytest.raises(SystemExit) as exited:  # argparse's exit, as the command's
        main(["demo", "--model", "gpt4"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "distsgd demo: error: argument --model: invalid choice: 'gpt4' (choose from digits, lm); "
        "see distsgd demo --help"
    ]
