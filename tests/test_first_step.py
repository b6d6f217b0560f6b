"""The first step tried before training (runtime/first_step.py): a model, a loss or shapes
that do not fit are refused in one line naming the cause and the fix; a good first step
changes nothing (parameters, buffers, random generators, mode)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from distsgd.runtime.first_step import ITEMS, try_first_step

X = torch.randn(40, 6)
LABELS = (X[:, 0] > 0).long()
VALUES = X[:, :1] * 2.0


def _try(model: nn.Module, loss_fn: Any, y: torch.Tensor, **kw: Any) -> None:
    try_first_step(model, loss_fn, TensorDataset(X, y), batch_size=32, **kw)


@pytest.mark.parametrize(
    ("model", "loss_fn", "y", "says"),
    [
        (nn.Linear(6, 3), F.mse_loss, VALUES, "output is shape (8, 3) and the target shape (8, 1)"),
        (nn.Linear(6, 1), nn.L1Loss(), VALUES[:, 0], "shape (8, 1) and the target shape (8,)"),
        (nn.Sequential(nn.Linear(6, 2), nn.Flatten(0)), F.cross_entropy, LABELS, "loss_fn raised"),
        (nn.Linear(5, 2), F.cross_entropy, LABELS, "the model raised RuntimeError"),
        (nn.Linear(6, 2), lambda o, t: F.cross_entropy(o, t, reduction="none"), LABELS, "one num"),
        (nn.Linear(6, 2), lambda o, t: 0.5, LABELS, "returned a float"),
    ],
    ids=["mse-broadcast", "l1-module", "batch-flattened", "forward", "per-item", "not-a-tensor"],
)
def test_a_first_step_that_does_not_fit_is_refused(
    model: nn.Module, loss_fn: Any, y: torch.Tensor, says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        _try(model, loss_fn, y)
    assert "; " in str(info.value) and "\n" not in str(info.value)  # one line: cause; fix


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(6, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(x))
        return self.out(self.drop(self.norm(x)))


def test_a_good_first_step_leaves_parameters_buffers_generators_and_mode() -> None:
    model = _Counting().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    _try(model, F.cross_entropy, LABELS)
    assert torch.equal(torch.rand(3), expected)  # dropout drew from a forked generator
    assert model.seen == [ITEMS] and not model.training and not model.norm.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_nothing_is_tried_on_a_single_item_and_a_small_batch_size_is_kept() -> None:
    model = _Counting()
    try_first_step(model, F.mse_loss, TensorDataset(X[:1], VALUES[:1]), batch_size=32)
    try_first_step(model, F.cross_entropy, TensorDataset(X, LABELS), batch_size=3)
    assert model.seen == [3]


class _Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(zip(X, VALUES, strict=True))


def test_a_streamed_data_set_is_tried_on_its_first_items() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        try_first_step(nn.Linear(6, 4), F.mse_loss, _Stream(), batch_size=16)
    try_first_step(nn.Linear(6, 1), F.mse_loss, _Stream(), batch_size=16)


def test_batch_fn_says_what_the_model_gets() -> None:
    def batch_fn(batch: Any) -> tuple[Any, Any]:
        x, y = batch
        return {"features": x}, y

    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(6, 1)

        def forward(self, *, features: torch.Tensor) -> torch.Tensor:
            return self.out(features)

    _try(Keyword(), F.mse_loss, VALUES, batch_fn=batch_fn)


def test_train_and_worker_refuse_test_data_the_evaluation_could_not_score() -> None:
    """The chief scores test_data with loss_fn at the end: a mismatch there is found before
    the first step, not after the whole run."""
    import distsgd

    bad_test = (X[:16], VALUES[:16, 0])  # targets of shape (B,) for an output of (B, 1)
    config = distsgd.TrainConfig(batch_size=8, steps=2)
    with pytest.raises(
        distsgd.SetupError, match=r"test_data.*\(8,\)|\(8,\).*test_data|shape \(8,\)"
    ):
        distsgd.train(
            model=nn.Linear(6, 1),
            loss_fn=F.mse_loss,
            train_data=(X, VALUES),
            test_data=bad_test,
            config=config,
        )
    with pytest.raises(distsgd.SetupError, match=r"shape \(8, 1\) and the target shape \(8,\)"):
        distsgd.Worker(nn.Linear(6, 1), test_data=bad_test, loss_fn=F.mse_loss, config=config)
