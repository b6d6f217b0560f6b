"""Batches of any shape: (inputs, target), (x1, ..., target), dicts with a target key, and
anything else through batch_fn; what distsgd cannot read is refused before training starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import distsgd
from distsgd import api
from distsgd.runtime import ENV_VAR
from distsgd.runtime.data import Batch, check_data, split_batch, to_device
from distsgd.runtime.evaluate import evaluate

CPU = torch.device("cpu")
CONFIG = distsgd.TrainConfig(batch_size=16, steps=60, lr=0.2, log_every=20, eval_every=0)


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``distsgd.train`` trains in this process, as under ``python script.py``."""
    monkeypatch.delenv(ENV_VAR, raising=False)


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) + 3 * y[:, None].float()
    return x, y


class Items(Dataset[Any]):
    """A data set of ``make(x, y)`` items."""

    def __init__(self, n: int, seed: int, make: Any) -> None:
        self.x, self.y = _blobs(n, seed)
        self.make = make

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.make(self.x[i], self.y[i])


class Keywords(nn.Module):
    """Called as HF models are: ``model(features=..., note=...)``; ``note`` is strings."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, features: torch.Tensor, note: list[str]) -> torch.Tensor:
        assert isinstance(note, list) and all(isinstance(s, str) for s in note), note
        return self.fc(features)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(scale)


def _train(model: nn.Module, make: Any, **kw: Any) -> distsgd.TrainResult:
    torch.manual_seed(0)
    return distsgd.train(
        model=model,
        loss_fn=F.cross_entropy,
        train_data=Items(320, 1, make),
        test_data=Items(100, 2, make),
        config=CONFIG,
        **kw,
    )


# ------------------------------------------------------------------------------- the rules


def test_tuples_last_element_is_the_target() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    assert split_batch((x, y)) == Batch((x,), {}, y)
    assert split_batch([x, x, y]) == Batch((x, x), {}, y)


def test_dicts_target_key_and_keyword_arguments() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    for key in ("target", "targets", "label", "labels", "y"):
        batch = split_batch({"input_ids": x, key: y, "mask": x})
        assert batch.args == () and batch.kwargs == {"input_ids": x, "mask": x}
        assert batch.target is y


@pytest.mark.parametrize(
    ("batch", "needle"),
    [
        ("some text", r"^a batch is a str; distsgd reads \(inputs, target\) tuples"),
        (torch.ones(3), r"is a Tensor; .*pass batch_fn="),
        ((torch.ones(3),), r"is a tuple of 1; "),
        ({"x": 1, "z": 2}, r"dict with the keys 'x', 'z' but no target key; .*batch_fn="),
        ({"label": 1, "y": 2, "x": 3}, r"target keys 'label', 'y'; which is the target\?"),
        ({0: 1, "y": 2}, r"non-string key 0"),
    ],
)
def test_unreadable_batches_are_explained(batch: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        split_batch(batch)


def test_batch_fn_inputs_tuple_dict_or_one() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    raw = {"a": x, "b": y}
    assert split_batch(raw, lambda b: ((b["a"], b["a"]), b["b"])) == Batch((x, x), {}, y)
    assert split_batch(raw, lambda b: ({"inp": b["a"]}, b["b"])) == Batch((), {"inp": x}, y)
    assert split_batch(raw, lambda b: (b["a"], b["b"])) == Batch((x,), {}, y)
    with pytest.raises(ValueError, match=r"batch_fn returned a dict .*return \(inputs, target\)"):
        split_batch(raw, lambda b: b)


def test_tensors_move_recursively_and_strings_stay() -> None:
    meta = torch.device("meta")
    value = {"a": [torch.ones(1), ("s", torch.ones(2))], "b": "text", "c": 3}
    moved = to_device(value, meta)
    assert moved["a"][0].device == meta and moved["a"][1][1].device == meta
    assert moved["a"][1][0] == "s" and moved["b"] == "text" and moved["c"] == 3
    assert isinstance(moved["a"], list) and isinstance(moved["a"][1], tuple)
    batch = Batch((torch.ones(1),), {"k": [torch.ones(1), "s"]}, torch.ones(1)).to(meta)
    assert batch.args[0].device == meta and batch.kwargs["k"][0].device == meta
    assert batch.kwargs["k"][1] == "s" and batch.target.device == meta


# ---------------------------------------------------------------------- training, evaluation


def test_trains_on_dict_items_with_strings() -> None:
    torch.manual_seed(0)  # the model's initial weights: not whatever earlier tests left
    result = _train(Keywords(), lambda x, y: {"features": x, "note": "a blob", "label": y})
    assert result.local_steps == CONFIG.steps
    assert result.test_accuracy is not None and result.test_accuracy > 0.9


def test_trains_on_three_tuples() -> None:
    torch.manual_seed(0)
    result = _train(TwoInputs(), lambda x, y: (x, x[:1], y))
    assert result.test_accuracy is not None and result.test_accuracy > 0.9


def test_trains_with_batch_fn() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    result = _train(
        model,
        lambda x, y: {"image": x, "class": y, "id": "sample"},
        batch_fn=lambda b: (b["image"], b["class"]),
    )
    assert result.test_accuracy is not None and result.test_accuracy > 0.9


def test_evaluates_dicts_three_tuples_and_batch_fn() -> None:
    torch.manual_seed(0)
    model = TwoInputs()
    triples = Items(50, 3, lambda x, y: (x, x[:1], y))
    dicts = Items(50, 3, lambda x, y: {"x": x, "scale": x[:1], "y": y})
    named = Items(50, 3, lambda x, y: {"img": x, "cls": y})
    scores = evaluate(model, triples, F.cross_entropy, batch_size=16, device=CPU)
    assert evaluate(model, dicts, F.cross_entropy, batch_size=16, device=CPU) == scores
    with_fn = evaluate(
        model,
        named,
        F.cross_entropy,
        batch_size=16,
        device=CPU,
        batch_fn=lambda b: ((b["img"], b["img"][:, :1]), b["cls"]),
    )
    assert with_fn == scores
    assert 0.0 <= scores["accuracy"] <= 1.0 and scores["loss"] > 0


# ------------------------------------------------------------------- refused before training


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(**_: Any) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(api, "run_worker", never)


class Texts(Dataset[Any]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> str:
        return f"sentence {i}"


@pytest.mark.usefixtures("no_training")
def test_train_refuses_str_items_before_training() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError) as info:
        distsgd.train(model=model, loss_fn=F.cross_entropy, train_data=Texts(), config=CONFIG)
    assert str(info.value) == (
        "train_data item is a str; distsgd reads (inputs, target) tuples, (x1, ..., target) "
        "tuples or dicts with a 'target' key ('targets', 'label', 'labels' or 'y' too); pass "
        "batch_fn= to read anything else"
    )


@pytest.mark.usefixtures("no_training")
def test_train_refuses_an_unreadable_test_set_before_training() -> None:
    with pytest.raises(ValueError, match=r"^test_data item is a dict with the keys 'x'"):
        distsgd.train(
            model=nn.Linear(4, 2),
            loss_fn=F.cross_entropy,
            train_data=_blobs(64, 1),
            test_data=Items(20, 2, lambda x, y: {"x": x}),
            config=CONFIG,
        )


@pytest.mark.usefixtures("no_training")
def test_train_refuses_inputs_the_model_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"Linear.forward\(input: .*keywords features.*batch_fn="):
        _train(nn.Linear(4, 2), lambda x, y: {"features": x, "label": y})
    with pytest.raises(ValueError, match=r"cannot take the inputs of train_data \(2 positional"):
        _train(nn.Linear(4, 2), lambda x, y: (x, x, y))


@pytest.mark.usefixtures("no_training")
def test_train_refuses_a_bad_batch_fn_before_training() -> None:
    with pytest.raises(
        ValueError,
        match=r"^batch_fn returned a Tensor for a batch of train_data; return \(inputs, target\)",
    ):
        _train(nn.Linear(4, 2), lambda x, y: (x, y), batch_fn=lambda b: b[0])
    with pytest.raises(ValueError, match=r"batch_fn raised KeyError: 'image' .*fix batch_fn"):
        _train(nn.Linear(4, 2), lambda x, y: {"x": x, "y": y}, batch_fn=lambda b: (b["image"], 0))


def test_the_check_leaves_the_random_generators_alone() -> None:
    class Noisy(Dataset[Any]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.rand(2), 0

    model = nn.Linear(2, 2)
    torch.manual_seed(5)
    check_data(Noisy(), "train_data", model=model)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)
