"""A diloco run shorter than one round (fewer local steps than ``--inner-steps``) would train
its replicas apart until the final outer step: refused before training, in one line naming the
fix; a loop that decides its own length is warned at its end (issue 36, item 12e)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distsgd
from distsgd.control.task import ENV_VAR, TaskEnv
from distsgd.runtime.setup import UNBOUNDED
from distsgd.schemes.diloco import DilocoOptions
from distsgd.workers.diloco import DilocoWorker


def _alone_under_diloco(monkeypatch: pytest.MonkeyPatch, inner_steps: int) -> None:
    """This process as the only worker of a diloco run (no run folder)."""
    env = TaskEnv(
        cluster={"ps": [], "worker": ["127.0.0.1:1"]},
        task_index=0,
        scheme="diloco",
        scheme_options={"inner_steps": inner_steps},
    )
    monkeypatch.setenv(ENV_VAR, env.to_json())


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def test_a_run_shorter_than_one_round_is_refused() -> None:
    worker = DilocoWorker(DilocoOptions(inner_steps=50), num_workers=2)
    with pytest.raises(ValueError) as refused:
        worker.check_steps(20)
    assert str(refused.value) == (
        "diloco: each worker takes 20 local steps, fewer than --inner-steps 50, so the "
        "replicas train apart until the run's final outer step; lower --inner-steps to at "
        "most 20 (--inner-steps 5 gives 4 rounds), or raise --steps or --epochs"
    )
    worker.check_steps(50)  # one round, then the final step
    worker.check_steps(UNBOUNDED)  # the loop decides: judged at its end


@pytest.mark.parametrize(
    ("steps", "epochs", "taken"), [(6, 1.0, 6), (0, 2.0, 8)]
)  # 64 items / 16 a batch = 4 steps an epoch
def test_train_refuses_it_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch, steps: int, epochs: float, taken: int
) -> None:
    _alone_under_diloco(monkeypatch, inner_steps=10)
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    config = distsgd.TrainConfig(batch_size=16, steps=steps, epochs=epochs)
    with pytest.raises(distsgd.SetupError, match=f"lower --inner-steps to at most {taken}"):
        distsgd.train(model=model, loss_fn=F.cross_entropy, train_data=_data(64), config=config)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_loop_of_its_own_length_is_warned_at_its_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _alone_under_diloco(monkeypatch, inner_steps=10)
    x, y = _data(48)
    at_level = caplog.at_level(logging.WARNING, logger="distsgd.workers.diloco")
    with at_level, distsgd.Worker(nn.Linear(4, 2)) as worker:
        for i in range(3):
            with worker.step() as step:
                part = slice(i * 16, (i + 1) * 16)
                loss = F.cross_entropy(worker.model(x[part]), y[part])
                loss.backward()
                step.loss = loss
    said = [r.getMessage() for r in caplog.records if r.name == "distsgd.workers.diloco"]
    assert said == [
        "diloco: each worker took 3 local steps, fewer than --inner-steps 10, so the replicas "
        "train apart until the run's final outer step; lower --inner-steps to at most 3, or "
        "raise --steps or --epochs"
    ]
