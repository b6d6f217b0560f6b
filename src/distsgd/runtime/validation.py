"""A validation split carved from the training set (``TrainConfig.validation``).

With ``validation = X`` (a fraction in (0, 1)), :func:`split_validation` holds out a fixed
``X`` of ``train_data``: the samples at the last ``ceil(X * n)`` places of a permutation drawn
from :data:`VALIDATION_SEED`, never from ``--seed``, so every worker and every repeat of a run
holds out the same samples. The workers train on the rest and the chief evaluates on the
held-out part *instead of* ``test_data``, which such a run never reads: ``distsgd compare
--tune`` picks settings on it, keeping the test set for the final runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

VALIDATION_SEED = 20240601
"""Seed of the permutation that picks the held-out samples (independent of ``--seed``)."""


def validation_indices(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, held-out indices) of ``n`` samples, ``ceil(fraction * n)`` held out;
    the same for the same ``n`` and ``fraction`` on every process."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation must be a fraction in (0, 1), got {fraction}")
    held = math.ceil(fraction * n)
    if held < 1 or held >= n:
        raise ValueError(
            f"validation {fraction} of {n} training samples leaves no training or no "
            "validation samples; give a fraction that keeps some of both"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(VALIDATION_SEED))
    keep, out = order[: n - held], order[n - held :]
    return keep.sort().values, out.sort().values


def split_validation(dataset: Dataset[Any], fraction: float) -> tuple[Dataset[Any], Dataset[Any]]:
    """(training part, validation part) of ``dataset`` (:func:`validation_indices`); a
    ``TensorDataset`` stays one (the fast batch path), any other Dataset becomes Subsets."""
    n = len(dataset)  # type: ignore[arg-type]
    keep, out = validation_indices(n, fraction)
    if isinstance(dataset, TensorDataset):
        return (
            TensorDataset(*(t[keep] for t in dataset.tensors)),
            TensorDataset(*(t[out] for t in dataset.tensors)),
        )
    return Subset(dataset, keep.tolist()), Subset(dataset, out.tolist())
