"""The first step, tried before training: ``loss_fn(model(batch), target)`` on the first few
items of ``train_data``, so that a model whose output does not fit the targets or the loss is
refused in one line (a :class:`~distsgd.control.errors.SetupError`, which the launcher does
not restart) before any worker connects, instead of failing on every worker, restart after
restart.

What it checks:

* ``model`` takes the batch: its forward does not raise;
* ``loss_fn`` takes the model's output and the target, and returns one number (what
  ``loss.backward()`` needs);
* an elementwise loss (:data:`ELEMENTWISE_FUNCTIONS` and :data:`ELEMENTWISE_MODULES`:
  ``mse_loss``, ``nn.L1Loss``, ...) gets an output of
  the target's shape: torch broadcasts ``(B, 3)`` against ``(B, 1)`` with only a warning, and
  the run would train on the wrong thing and exit 0.

What it leaves as it was: the parameters (no backward, no optimizer step), the buffers
(BatchNorm's running statistics are put back), the random generators (dropout draws from a
forked generator) and the model's mode. It costs one forward pass on :data:`ITEMS` items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from distsgd.control.errors import one_line
from distsgd.runtime.data import BatchFn, split_batch

ITEMS = 8
"""Items in the tried batch, at most (and at most ``batch_size``): more than one, so a model
that mixes up the batch dimension shows it."""

ELEMENTWISE_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
)
"""Loss functions that compare output and target entry by entry."""

ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
)
"""Loss modules that compare output and target entry by entry."""


def try_first_step(
    model: nn.Module,
    loss_fn: Callable[..., Any],
    dataset: Dataset[Any],
    *,
    batch_size: int,
    batch_fn: BatchFn | None = None,
    name: str = "train_data",
) -> None:
    """Run the loss of one batch of ``dataset``'s first items; ValueError naming the cause and
    the fix when the model, the loss or their shapes do not fit (module docstring). Nothing
    is tried on fewer than 2 items (a batch of one may fail where training would not)."""
    items = _first_items(dataset, min(batch_size, ITEMS))
    if len(items) < 2:
        return
    batch = split_batch(default_collate(items), batch_fn, f"a batch of {name}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batch = batch.to(device)
    with _untouched(model, device):
        try:
            output = batch.forward(model)
        except Exception as exc:
            raise ValueError(
                f"the model raised {_said(exc)} on a batch of {len(items)} items of {name} "
                "(tried before training); fix the model, or pass batch_fn= to say what it gets"
            ) from exc
        _check_shapes(loss_fn, output, batch.target, f"{len(items)} items of {name}")
        try:
            loss = loss_fn(output, batch.target)
        except Exception as exc:
            raise ValueError(
                f"loss_fn raised {_said(exc)} on the model's output ({_shape(output)}) and the "
                f"target ({_shape(batch.target)}) of {len(items)} items of {name}; make the "
                "model's output what the loss takes for that target"
            ) from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned {_shape(loss)}; it must return one number, a tensor of one "
            "element (e.g. reduction='mean')"
        )


def _first_items(dataset: Dataset[Any], count: int) -> list[Any]:
    if isinstance(dataset, IterableDataset):
        return list(islice(iter(dataset), count))
    size = len(dataset)  # type: ignore[arg-type]
    return [dataset[i] for i in range(min(size, count))]


@contextmanager
def _untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """The model in training mode, its buffers and the random generators put back after."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model.train()
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for module, training in modes:
                module.training = training


def _check_shapes(loss_fn: Callable[..., Any], output: Any, target: Any, what: str) -> None:
    elementwise = loss_fn in ELEMENTWISE_FUNCTIONS or isinstance(loss_fn, ELEMENTWISE_MODULES)
    if not (elementwise and isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return
    if output.shape != target.shape:
        raise ValueError(
            f"loss_fn compares entries, but on {what} the model's output is {_shape(output)} "
            f"and the target {_shape(target)}: torch would broadcast them and train on the "
            "wrong thing; give the model an output of the target's shape (e.g. its last "
            "layer's width, or .squeeze(-1))"
        )


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _said(exc: Exception) -> str:
    text = one_line(str(exc))  # whole: a first line alone may end inside a quotation
    return f"{type(exc).__name__}" + (f": {text}" if text else "")
