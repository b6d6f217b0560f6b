"""Data for one worker: a disjoint shard of the training set, in seeded random order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

DataLike = Dataset[Any] | Sequence[Any] | tuple[Any, Any]


def as_dataset(data: Any, name: str = "train_data") -> Dataset[Any]:
    """A torch Dataset from a Dataset, or an ``(inputs, targets)`` pair of tensors or arrays."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, tuple) and len(data) == 2:
        x, y = (
            torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in data
        )
        if len(x) != len(y):
            raise ValueError(
                f"{name}: {len(x)} inputs but {len(y)} targets; give one target per input"
            )
        return TensorDataset(x, y)
    raise ValueError(
        f"{name}: expected a torch Dataset or an (inputs, targets) pair, got {type(data).__name__}"
    )


def fetch(dataset: Dataset[Any], indices: torch.Tensor) -> Any:
    """One batch by index (fast path for tensor datasets)."""
    if isinstance(dataset, TensorDataset):
        return tuple(t[indices] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in indices])


class ShardedBatches:
    """Endless batches from worker ``rank``'s shard; every worker gets the same number per epoch.

    The training set is permuted once with ``seed`` and cut into ``world`` equal, disjoint
    shards; each epoch reshuffles the shard. ``position`` (epoch, batch) says where it stands.
    """

    def __init__(
        self, dataset: Dataset[Any], *, rank: int, world: int, batch_size: int, seed: int
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        per = n // world
        if per < batch_size:
            raise ValueError(
                f"batch_size {batch_size} is larger than each worker's shard of {per} samples "
                f"({n} samples / {world} workers); lower --batch-size or use fewer workers"
            )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.dataset = dataset
        self.indices = perm[rank * per : (rank + 1) * per]
        self.batch_size = batch_size
        self.steps_per_epoch = per // batch_size
        self.seed = seed * 1000 + rank
        self.epoch = 0
        self.batch = 0

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already served)."""
        return self.epoch, self.batch

    def seek(self, position: tuple[int, int]) -> None:
        """Continue from a saved :attr:`position` (before iterating)."""
        self.epoch, self.batch = int(position[0]), int(position[1])

    def __iter__(self) -> Iterator[Any]:
        while True:
            order = self.indices[
                torch.randperm(
                    len(self.indices),
                    generator=torch.Generator().manual_seed(self.seed + self.epoch),
                )
            ]
            while self.batch < self.steps_per_epoch:
                b = self.batch
                self.batch += 1
                yield fetch(self.dataset, order[b * self.batch_size : (b + 1) * self.batch_size])
            self.epoch += 1
            self.batch = 0
