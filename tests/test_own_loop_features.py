"""distsgd.Worker at full strength: gradient accumulation, a scaled loss (GradScaler) and a
learning-rate scheduler of the user's own (docs/own-loop.md; its examples run in test_docs).

In-process tests run the loop alone (one worker, allreduce: a local optimizer); the real runs
start ``distsgd run`` on 2 workers with tests/scripts/own_loop_features.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_scheme
from torch import nn

import distsgd
from distsgd.runtime.data import micro_batches
from distsgd.runtime.rates import SMALLEST_SCALE, ServerRate

SCRIPT = Path(__file__).parent / "scripts" / "own_loop_features.py"


def _data(n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


CONFIG = distsgd.TrainConfig(batch_size=32, epochs=2, lr=0.2, momentum=0.0)


def _train(
    *,
    parts: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    overflow_at: int | None = None,
    skip_backward_at: int | None = None,
    config: distsgd.TrainConfig = CONFIG,
) -> nn.Module:
    """The loop of the page's examples, alone; ``overflow_at``: that step's loss is made
    infinite (as a float16 overflow would); ``skip_backward_at``: that step has no backward."""
    model = _model()
    worker = distsgd.Worker(model, train_data=_data(), config=config, grad_scaler=scaler)
    for batch in worker.batches():
        with worker.step() as step:
            if worker.local_step == skip_backward_at:
                continue
            for inputs, target in step.micro_batches(batch, parts):
                loss = F.cross_entropy(worker.model(inputs), target) / parts
                if worker.local_step == overflow_at:
                    loss = loss * float("inf")
                (loss if scaler is None else scaler.scale(loss)).backward()
    worker.finish()
    return model


def _same(a: nn.Module, b: nn.Module, atol: float = 0.0) -> bool:
    return all(
        torch.allclose(p, q, rtol=0, atol=atol)
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


# --------------------------------------------------------------------------- accumulation


def test_two_micro_batches_of_16_update_as_one_batch_of_32() -> None:
    whole, halves = _train(), _train(parts=2)
    assert _same(whole, halves, atol=1e-6)
    assert not _same(whole, _train(parts=2, config=CONFIG.replace(lr=0.1)), atol=1e-3)


def test_micro_batches_cut_every_tensor_and_name_mistakes() -> None:
    x, y = _data(10)
    pieces = micro_batches({"x": x, "pair": (y, ["s"] * 10)}, 3)
    assert [len(p["x"]) for p in pieces] == [4, 3, 3]
    assert torch.equal(torch.cat([p["pair"][0] for p in pieces]), y)
    assert sum(len(p["pair"][1]) for p in pieces) == 10
    with pytest.raises(ValueError, match="from 1 to the batch's 10 samples"):
        micro_batches((x, y), 11)
    with pytest.raises(ValueError, match="from 1 to the batch's 10 samples"):
        micro_batches((x, y), True)
    with pytest.raises(ValueError, match="every tensor must have the batch's size first"):
        micro_batches((x, y[:5]), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        micro_batches(("a", "b"), 1)


def test_step_samples_must_be_a_positive_whole_number() -> None:
    worker = distsgd.Worker(_model(), config=CONFIG.replace(steps=1))
    x, y = _data()
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"step\.samples must be"), worker.step() as step:
            step.samples = bad  # type: ignore[assignment]
    assert worker.local_step == 0  # the refused steps were not taken
    with worker.step() as step:
        F.cross_entropy(worker.model(x[:64]), y[:64]).backward()
        step.samples = 64
    assert worker.finish().samples == 64


# --------------------------------------------------------------------------- loss scaling


def test_a_scaled_loss_trains_as_the_plain_one() -> None:
    """A power-of-two scale divides back exactly: the same parameters as without it."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert _same(_train(), _train(scaler=scaler))


def test_a_step_whose_gradients_overflow_is_skipped_and_the_scale_lowered() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    skipped = _train(scaler=scaler, overflow_at=2)
    assert scaler.get_scale() == 2.0**15  # backed off once
    assert all(torch.isfinite(p).all() for p in skipped.parameters())
    # SGD without momentum: a step with no update is a step without backward
    assert _same(skipped, _train(skip_backward_at=2))
    assert not _same(skipped, _train())


def test_the_scaler_must_be_a_grad_scaler() -> None:
    with pytest.raises(ValueError, match=r"grad_scaler= takes a torch\.amp\.GradScaler"):
        distsgd.Worker(_model(), config=CONFIG.replace(steps=1), grad_scaler=object())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- own scheduler


def test_a_scheduler_over_the_local_optimizer_sets_its_rate() -> None:
    model = _model()
    worker = distsgd.Worker(model, train_data=_data(), config=CONFIG)
    scheduler = torch.optim.lr_scheduler.StepLR(worker.optimizer, step_size=3, gamma=0.5)
    seen = []
    for inputs, target in worker.batches():
        with worker.step():
            seen.append(worker.optimizer.param_groups[0]["lr"])
            F.cross_entropy(worker.model(inputs), target).backward()
        scheduler.step()
    worker.finish()
    assert seen == [0.2 * 0.5 ** (i // 3) for i in range(8)]


def test_a_scheduler_beside_distsgds_schedule_is_refused_before_the_first_step() -> None:
    worker = distsgd.Worker(_model(), train_data=_data(), config=CONFIG.replace(warmup=0.2))
    torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda step: 1.0)
    with pytest.raises(ValueError, match="would both set its rate at every step; drop"):
        next(iter(worker.batches()))
    worker.close()


def test_the_servers_rate_follows_its_stand_in() -> None:
    rate = ServerRate(_model().parameters(), lr=0.2)
    assert rate.scale() == 1.0
    scheduler = torch.optim.lr_scheduler.StepLR(rate, step_size=1, gamma=0.5)
    rate.step()
    scheduler.step()
    assert rate.scale() == 0.5
    rate.param_groups[0]["lr"] = 0.0
    assert rate.scale() == SMALLEST_SCALE  # 0 on the wire would mean 1.0
    rate.param_groups[0]["lr"] = 1e4
    with pytest.raises(ValueError, match="more than the servers accept"):
        rate.scale()


# --------------------------------------------------------------------------- real runs


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_model.pt", weights_only=True)


def _lines(run_dir: Path, task: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("task") == task and "skipped_steps" in line]


@pytest.mark.slow
def test_accumulation_under_allreduce_with_2_workers_matches_whole_batches(
    tmp_path: Path,
) -> None:
    for args in ((), ("accumulate",)):
        done = run_scheme("allreduce", tmp_path / "-".join(("r", *args)), SCRIPT, *args)
        assert done.returncode == 0, done.stderr[-3000:]
    whole, halves = _final(tmp_path / "r"), _final(tmp_path / "r-accumulate")
    assert all(torch.allclose(whole[k], halves[k], rtol=0, atol=1e-6) for k in whole)


@pytest.mark.slow
def test_sync_with_2_workers_skips_an_overflow_and_follows_the_loops_scheduler(
    tmp_path: Path,
) -> None:
    """Under sync the script's LambdaLR schedules the servers' rate to 0 (the parameters end
    as they began); worker 1's overflowed step 3 is skipped, not pushed, and its next batch
    answers the round (no wait for the step timeout)."""
    done = run_scheme("sync", tmp_path / "r", SCRIPT, "scaler", "frozen")
    assert done.returncode == 0, done.stderr[-3000:]
    torch.manual_seed(0)
    torch.randn(256, 8)  # as the script: its data, then its model
    start = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).state_dict()
    final = _final(tmp_path / "r")
    assert all(torch.allclose(start[k], final[k], rtol=0, atol=1e-12) for k in start)
    last0, last1 = _lines(tmp_path / "r", "worker0")[-1], _lines(tmp_path / "r", "worker1")[-1]
    assert (last0["skipped_steps"], last1["skipped_steps"]) == (0, 1)
    assert last1["grad_scale"] == 2.0**15 and last0["grad_scale"] == 2.0**16
    assert last0["nonfinite_skipped"] == last1["nonfinite_skipped"] == 0
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert result["seconds"] < 40, result["seconds"]  # the round's timeout is 60 s


@pytest.mark.slow
def test_localsgd_with_2_workers_skips_an_overflow_on_one_worker(tmp_path: Path) -> None:
    done = run_scheme("localsgd", tmp_path / "r", SCRIPT, "scaler", "accumulate")
    assert done.returncode == 0, done.stderr[-3000:]
    last1 = _lines(tmp_path / "r", "worker1")[-1]
    assert last1["skipped_steps"] == 1 and last1["local_step"] == 8  # 2 epochs of 128 samples
    assert all(torch.isfinite(v).all() for v in _final(tmp_path / "r").values())
