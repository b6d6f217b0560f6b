"""The allreduce scheme through PyTorch's DDP: its fp16, bf16 and PowerSGD hooks train, the
bytes they report are what they all-reduce, and settings no hook can honour are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, metrics, run_distsgd
from torch.utils.data import TensorDataset

from distsgd import schemes
from distsgd.cli.main import main
from distsgd.runtime import TaskEnv, TrainConfig, run_worker

BLOBS = str(SCRIPTS / "blobs.py")
STEPS = 40
PARAMS = 8 * 32 + 32 + 32 * 4 + 4 + 1  # blobs.py: Linear(8, 32), Linear(32, 4), the unused z


def _powersgd_numel(rank: int) -> int:
    """Elements PowerSGD all-reduces per step for blobs.py's model: an n x m weight travels as
    n x r and m x r factors when (n + m) r * 2 < n m (min_compression_rate 2), else whole."""
    numel = 32 + 4 + 1  # the biases and z: vectors are never compressed
    for n, m in ((32, 8), (4, 32)):
        r = min(n, m, rank)
        numel += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return numel


def _run(tmp_path: Path, name: str, *flags: str) -> tuple[dict, list[int]]:
    """A 2-worker allreduce run of blobs.py: result.json and each worker's final bytes_sent."""
    run_dir = tmp_path / name
    args = ["run", "--workers", "2", "--scheme", "allreduce", "--quiet", "--run-dir", str(run_dir)]
    done = run_distsgd([*args, *flags, BLOBS, "--steps", str(STEPS)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = {r["task"]: r["bytes_sent"] for r in metrics(run_dir) if "bytes_sent" in r}
    return json.loads((run_dir / "result.json").read_text()), [last[t] for t in sorted(last)]


@pytest.mark.slow
def test_hooks_train_and_count_what_they_all_reduce(tmp_path: Path) -> None:
    plain, plain_bytes = _run(tmp_path, "float32")
    assert plain["test_accuracy"] > 0.9, plain
    assert plain_bytes == [STEPS * PARAMS * 4] * 2  # every bucket, every step, once
    # fp16 with --dynamic-graph too: DDP's search for unused parameters at every step, not the
    # first only (blobs.py's z is never used), changes nothing of what travels
    for dtype, *more in (("fp16", "--dynamic-graph"), ("bf16",)):
        result, sent = _run(tmp_path, dtype, "--wire-dtype", dtype, *more)
        assert result["test_accuracy"] > 0.9, (dtype, result)
        assert sent == [b // 2 for b in plain_bytes], dtype  # 2 bytes an element, not 4
    start, rank = 10, 2
    result, sent = _run(
        tmp_path, "powersgd", "--powersgd-rank", str(rank), "--powersgd-start", str(start)
    )
    assert result["test_accuracy"] > 0.9, result
    # float32 for the first `start` steps, then the factors and the uncompressed vectors
    expected = (start * PARAMS + (STEPS - start) * _powersgd_numel(rank)) * 4
    assert sent == [expected] * 2
    assert expected < plain_bytes[0] * 0.7


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--scheme", "allreduce", "--wire-dtype", "int8"], "use fp16, bf16 or --powersgd-rank"),
        (["--scheme", "allreduce", "--topk", "0.01"], "top-k is for parameter-server schemes"),
        (["--scheme", "sync", "--powersgd-rank", "2"], "use --scheme allreduce"),
        (["--scheme", "diloco", "--powersgd-rank", "2"], "use --scheme allreduce"),
        (
            ["--scheme", "allreduce", "--powersgd-rank", "2", "--wire-dtype", "bf16"],
            "drop one of them",
        ),
        (["--scheme", "allreduce", "--powersgd-start", "1"], "at least 2"),
    ],
)
def test_refusals_are_one_line(
    flags: list[str],
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``distsgd run`` refuses before any task starts (the CLI's main, in this process: a
    refused command starts no process, and a command line of its own cost a CPU-second)."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", *flags, BLOBS]) == 2
    said = capsys.readouterr()
    lines = [line for line in said.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distsgd: error: "), said
    assert needle in lines[0]
    assert not (tmp_path / "distsgd-runs").exists()


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_but_allreduce_refuses_powersgd(name: str) -> None:
    worker = schemes.get(name).make_worker(schemes.get(name).options(), 2)
    config = TrainConfig(powersgd_rank=2)
    if name == "allreduce":
        worker.check_config(config)
    else:
        with pytest.raises(ValueError, match="use --scheme allreduce or drop --powersgd-rank"):
            worker.check_config(config)


def test_allreduce_alone_keeps_any_compression_setting() -> None:
    """A script run alone (one worker, nothing travels) keeps the config it was written with
    for a parameter-server run; with two workers the same config is refused."""
    spec = schemes.get("allreduce")
    config = TrainConfig(wire_dtype="int8", topk=0.01)
    spec.make_worker(spec.options(), 1).check_config(config)
    with pytest.raises(ValueError, match="int8 under allreduce: integer codes are for"):
        spec.make_worker(spec.options(), 2).check_config(config)
    for codes in ("int4", "int2"):
        with pytest.raises(ValueError, match=f"--wire-dtype {codes} under allreduce"):
            spec.make_worker(spec.options(), 2).check_config(TrainConfig(wire_dtype=codes))


def test_worker_refuses_before_it_connects() -> None:
    """A script's own config meets the scheme when the worker starts: refused before it
    looks for parameter servers (there are none here)."""
    spec = schemes.get("sync")
    with pytest.raises(ValueError, match="--powersgd-rank"):
        run_worker(
            model=torch.nn.Linear(2, 1),
            loss_fn=F.mse_loss,
            train_set=TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1)),
            test_set=None,
            config=TrainConfig(powersgd_rank=1, steps=1, batch_size=2),
            env=TaskEnv.standalone("sync"),
            scheme=spec.make_worker(spec.options(), 1),
        )


BRANCHY = '''
import torch, torch.nn.functional as F
from torch import nn
import distsgd


class Branchy(nn.Module):
    """Uses its extra layer at the first forward passes only: the used parameters change."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.extra = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        return self.extra(out) if self.calls <= 2 else out


g = torch.Generator().manual_seed(0)
x, y = torch.randn(512, 8, generator=g), torch.randint(0, 4, (512,), generator=g)
distsgd.train(
    model=Branchy(), loss_fn=F.cross_entropy, train_data=(x, y),
    config=distsgd.TrainConfig(batch_size=16, steps=12, lr=0.05, eval_every=0),
)
'''


@pytest.mark.slow
def test_a_model_whose_used_parameters_change_is_told_to_run_with_dynamic_graph(
    tmp_path: Path,
) -> None:
    """allreduce assumes a static graph (DDP's static_graph); a model that breaks it fails with
    torch's error and the flag that fixes it, and trains with that flag."""
    script = tmp_path / "branchy.py"
    script.write_text(BRANCHY)
    args = ["run", "--workers", "2", "--scheme", "allreduce", "--quiet", "--checkpoint-every", "0"]
    static = ["--max-restarts", "0", "--run-dir", str(tmp_path / "static")]  # it fails alike
    failed = run_distsgd([*args, *static, str(script)])
    assert failed.returncode != 0
    logs = "".join(p.read_text() for p in (tmp_path / "static").rglob("*.log"))
    assert "--dynamic-graph" in failed.stderr + logs, failed.stderr[-2000:]
    ok = run_distsgd([*args, "--dynamic-graph", "--run-dir", str(tmp_path / "dyn"), str(script)])
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
