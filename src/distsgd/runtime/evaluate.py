"""Held-out evaluation: mean loss, and accuracy when the model outputs class scores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.runtime.data import fetch

LossFn = Callable[[Any, Any], torch.Tensor]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset[Any],
    loss_fn: LossFn,
    *,
    batch_size: int,
    device: torch.device,
) -> dict[str, float]:
    """``{"loss": ..., "accuracy": ...}`` over the data set (accuracy for class targets only)."""
    was_training = model.training
    model.eval()
    n = len(dataset)  # type: ignore[arg-type]
    total_loss, correct, classified = 0.0, 0, True
    try:
        for start in range(0, n, batch_size):
            x, y = fetch(dataset, torch.arange(start, min(n, start + batch_size)))
            x, y = x.to(device), y.to(device)
            out = model(x)
            total_loss += float(loss_fn(out, y)) * len(y)
            if classified and out.dim() == 2 and y.dim() == 1 and not torch.is_floating_point(y):
                correct += int((out.argmax(dim=1) == y).sum())
            else:
                classified = False
    finally:
        model.train(was_training)
    result = {"loss": total_loss / max(1, n)}
    if classified and n:
        result["accuracy"] = correct / n
    return result
