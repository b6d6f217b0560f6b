"""Held-out evaluation: mean loss, accuracy when the model outputs class scores, and the
user's own metrics (``metrics=`` of ``distsgd.train``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from distsgd.runtime.data import BatchFn, fetch, split_batch

LossFn = Callable[[Any, Any], torch.Tensor]

MetricFns = Mapping[str, Callable[[Any, Any], Any]]
"""``{name: fn(output, target) -> number}``: each evaluated per batch and averaged over the
samples (a batch counts by its size)."""


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset[Any],
    loss_fn: LossFn,
    *,
    batch_size: int,
    device: torch.device,
    batch_fn: BatchFn | None = None,
    metric_fns: MetricFns | None = None,
) -> dict[str, float]:
    """``{"loss": ..., "accuracy": ..., "chance": ..., **metrics}`` over the data set.

    Accuracy (for class targets only) comes with ``chance``: the share of the most frequent
    class, which a model that always answers that class scores (divergence is judged by it).
    """
    was_training = model.training
    model.eval()
    n = len(dataset)  # type: ignore[arg-type]
    total_loss, correct, classified = 0.0, 0, True
    counts: torch.Tensor | None = None
    sums = dict.fromkeys(check_metric_names(metric_fns or {}), 0.0)
    try:
        for start in range(0, n, batch_size):
            indices = torch.arange(start, min(n, start + batch_size))
            batch = split_batch(fetch(dataset, indices), batch_fn).to(device)
            out, y = batch.forward(model), batch.target
            total_loss += float(loss_fn(out, y)) * len(indices)
            for name, fn in (metric_fns or {}).items():
                sums[name] += float(fn(out, y)) * len(indices)
            if (
                classified
                and isinstance(out, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and out.dim() == 2
                and y.dim() == 1
                and not torch.is_floating_point(y)
            ):
                correct += int((out.argmax(dim=1) == y).sum())
                if y.numel() and int(y.min()) >= 0:  # not e.g. an ignore_index of -100
                    batch_counts = torch.bincount(y.reshape(-1).cpu(), minlength=out.shape[1])
                    counts = batch_counts if counts is None else _add_counts(counts, batch_counts)
            else:
                classified = False
    finally:
        model.train(was_training)
    result = {name: total / max(1, n) for name, total in {"loss": total_loss, **sums}.items()}
    if classified and n:
        result["accuracy"] = correct / n
        if counts is not None:
            result["chance"] = int(counts.max()) / n
    return result


def check_metric_names(metric_fns: MetricFns) -> MetricFns:
    """``metric_fns`` itself; ValueError if a name is one of evaluate's own."""
    for name in metric_fns:
        if name in ("loss", "accuracy", "chance"):
            raise ValueError(f"metrics={{{name!r}: ...}}: {name} is distsgd's own; rename it")
    return metric_fns


def _add_counts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum two class-count vectors of possibly different lengths."""
    size = max(len(a), len(b))
    out = torch.zeros(size, dtype=torch.long)
    out[: len(a)] += a
    out[: len(b)] += b
    return out
