"""Data for one worker: a disjoint shard of the training set, in seeded random order; and how
a batch is read: what the model is called with, and what the loss compares its output to.

**How distsgd reads a batch** (as ``torch.utils.data.default_collate`` batched the items):

* a tuple (or list) ``(inputs, target)``: ``model(inputs)``;
* a tuple ``(x1, x2, ..., target)``: the last element is the target, ``model(x1, x2, ...)``;
* a dict (mapping) with exactly one target key, the first of :data:`TARGET_KEYS` present
  (``"target"``, ``"targets"``, ``"label"``, ``"labels"``, ``"y"``): every other key is a
  keyword argument, ``model(**rest)``, as Hugging Face models are called;
* anything else, or another split: a ``batch_fn(batch) -> (inputs, target)``, where
  ``inputs`` is a tuple of positional arguments, a dict of keyword arguments, or one input.

Then ``loss_fn(model(...), target)``. Tensors anywhere inside (nested tuples, lists, dicts) are
moved to the model's device; other values, such as strings, are passed on as they are.
:func:`check_data` refuses an unreadable first item before training starts.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

DataLike = Dataset[Any] | Sequence[Any] | tuple[Any, Any]

BatchFn = Callable[[Any], tuple[Any, Any]]
"""``batch_fn(batch) -> (inputs, target)``: ``inputs`` a tuple of positional arguments of the
model, a dict of keyword arguments, or one input."""

TARGET_KEYS = ("target", "targets", "label", "labels", "y")
"""The keys under which a dict item holds its target."""

_EMPTY = object()
"""What ``next`` gives for a stream with no item."""

READABLE = (
    "distsgd reads (inputs, target) tuples, (x1, ..., target) tuples or dicts with a 'target' "
    "key ('targets', 'label', 'labels' or 'y' too); pass batch_fn= to read anything else"
)


@dataclass(frozen=True)
class Batch:
    """One batch, split: the model is called ``model(*args, **kwargs)``, the loss compares
    its output to ``target``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor in it on ``device``."""
        return Batch(
            to_device(self.args, device),
            to_device(self.kwargs, device),
            to_device(self.target, device),
        )

    def forward(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside it (tuples, lists, dicts, nested) moved to ``device``;
    anything else is returned as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def micro_batches(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut along its first dimension into ``parts`` micro-batches of the same shape
    (sizes differ by at most one): every tensor inside it (tuples, lists, dicts, nested) is
    cut, a list of other values (strings) as a sequence of samples.

    Raises:
        ValueError: ``parts`` is not a whole number from 1 to the batch's size, the batch holds
            no tensor, or its tensors differ in length.
    """
    size = _first_length(batch)
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= max(size, 1):
        raise ValueError(
            f"micro-batches: parts must be a whole number from 1 to the batch's {size} "
            f"samples, got {parts!r}"
        )
    return [_cut(batch, parts, size, i) for i in range(parts)]


def _first_length(value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return int(value.shape[0])
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, (Mapping, tuple, list)):
        for item in items:
            if isinstance(item, (torch.Tensor, Mapping, tuple, list)):
                try:
                    return _first_length(item)
                except ValueError:
                    continue
    raise ValueError(
        f"micro-batches: {_kind(value)} holds no tensor to cut; cut the batch yourself"
    )


def _cut(value: Any, parts: int, size: int, index: int) -> Any:
    """Micro-batch ``index`` of ``parts`` of ``value`` (:func:`micro_batches`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != size:
            raise ValueError(
                f"micro-batches: a tensor of shape {list(value.shape)} in a batch of {size} "
                "samples; every tensor must have the batch's size first"
            )
        return value.tensor_split(parts)[index]
    if isinstance(value, Mapping):
        return {k: _cut(v, parts, size, index) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        if any(isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in value):
            cut = [_cut(v, parts, size, index) for v in value]
            return type(value)(*cut) if hasattr(value, "_fields") else type(value)(cut)
        if len(value) != size:
            raise ValueError(
                f"micro-batches: a list of {len(value)} values in a batch of {size} samples; "
                "cut the batch yourself"
            )
        bounds = torch.arange(size).tensor_split(parts)[index]
        return type(value)(value[int(i)] for i in bounds)
    return value


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _keywords(mapping: Mapping[Any, Any], what: str) -> dict[str, Any]:
    bad = [k for k in mapping if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"{what} has the non-string key {bad[0]!r}; the model's keyword arguments need "
            "string keys: pass batch_fn= to read it"
        )
    return dict(mapping)


def split_batch(batch: Any, batch_fn: BatchFn | None = None, what: str = "a batch") -> Batch:
    """Split ``batch`` into the model's arguments and the target (module docstring)."""
    if batch_fn is not None:
        got = batch_fn(batch)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise ValueError(
                f"batch_fn returned {_kind(got)} for {what}; return (inputs, target), inputs "
                "a tuple of positional arguments, a dict of keyword arguments or one input"
            )
        inputs, target = got
        if isinstance(inputs, tuple):
            return Batch(inputs, {}, target)
        if isinstance(inputs, Mapping):
            return Batch((), _keywords(inputs, "batch_fn's inputs"), target)
        return Batch((inputs,), {}, target)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return Batch(tuple(batch[:-1]), {}, batch[-1])
    if isinstance(batch, Mapping):
        keys = [k for k in TARGET_KEYS if k in batch]
        if len(keys) == 1:
            rest = {k: v for k, v in batch.items() if k != keys[0]}
            return Batch((), _keywords(rest, what), batch[keys[0]])
        if len(keys) > 1:
            raise ValueError(
                f"{what} is a dict with the target keys {', '.join(map(repr, keys))}; which is "
                "the target? keep one, or pass batch_fn= to say"
            )
        shown = ", ".join(map(repr, list(batch)[:6]))
        raise ValueError(f"{what} is a dict with the keys {shown} but no target key; {READABLE}")
    raise ValueError(f"{what} is {_kind(batch)}; {READABLE}")


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
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:  # torch's batched read (e.g. ShardFolder: a shard's rows at once)
        return default_collate(getitems([int(i) for i in indices]))
    return default_collate([dataset[int(i)] for i in indices])


def shard_size(n: int, world: int, batch_size: int) -> int:
    """The samples of each of ``world`` workers' equal shards of ``n``; ValueError when that
    is not even one batch."""
    per = n // world
    if per < batch_size:
        raise ValueError(
            f"batch_size {batch_size} is larger than each worker's shard of {per} samples "
            f"({n} samples / {world} workers); lower --batch-size or use fewer workers"
        )
    return per


class ShardedBatches:
    """Endless batches from worker ``rank``'s shard; every worker gets the same number per epoch.

    The training set is permuted once with ``seed`` and cut into ``world`` equal, disjoint
    shards; each epoch reshuffles the shard. ``position`` (epoch, batch) says where it stands.
    """

    def __init__(
        self, dataset: Dataset[Any], *, rank: int, world: int, batch_size: int, seed: int
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        per = shard_size(n, world, batch_size)
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

    def order(self, epoch: int) -> torch.Tensor:
        """The shard's indices in ``epoch``'s order (batch b is slice b of ``batch_size``)."""
        return self.indices[
            torch.randperm(
                len(self.indices), generator=torch.Generator().manual_seed(self.seed + epoch)
            )
        ]

    def __iter__(self) -> Iterator[Any]:
        while True:
            order = self.order(self.epoch)
            while self.batch < self.steps_per_epoch:
                b = self.batch
                self.batch += 1
                yield fetch(self.dataset, order[b * self.batch_size : (b + 1) * self.batch_size])
            self.epoch += 1
            self.batch = 0


def check_data(
    dataset: Dataset[Any],
    name: str,
    *,
    batch_fn: BatchFn | None = None,
    model: nn.Module | None = None,
    stream: bool = False,
) -> None:
    """Refuse, with a ``ValueError`` naming what it got, a data set whose first item distsgd
    cannot read, or whose inputs ``model.forward`` cannot take: before the first step.

    An ``IterableDataset`` is refused unless ``stream`` (training data may stream, see
    :mod:`distsgd.runtime.stream`); its first item is read from a fresh iterator.
    Reading the item leaves the random generators as they were (an augmenting data set may
    draw from them), so a run is the same with the check as without it.
    """
    if isinstance(dataset, IterableDataset):
        if not stream:
            raise ValueError(
                f"{name} is an IterableDataset, which distsgd cannot evaluate on (it needs a "
                "length); give a map-style Dataset, e.g. distsgd.ShardFolder(path)"
            )
    elif len(dataset) == 0:  # type: ignore[arg-type]
        return
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            split = _read_first(dataset, name, batch_fn)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    if model is not None:
        _check_forward(model, split, name)


def _read_first(dataset: Dataset[Any], name: str, batch_fn: BatchFn | None) -> Batch:
    if isinstance(dataset, IterableDataset):
        first = next(iter(dataset), _EMPTY)
        if first is _EMPTY:
            raise ValueError(f"{name} yields no item; give it data")
    else:
        first = dataset[0]
    if batch_fn is None:
        split_batch(first, None, f"{name} item")
    try:
        batch = default_collate([first])
    except (TypeError, RuntimeError) as exc:
        raise ValueError(
            f"{name} items cannot be batched by torch's default_collate "
            f"({str(exc).splitlines()[0]}); {READABLE}"
        ) from exc
    try:
        return split_batch(batch, batch_fn, f"a batch of {name}")
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            f"batch_fn raised {type(exc).__name__}: {exc} on a batch of {name}'s first item; "
            "fix batch_fn"
        ) from exc


def _check_forward(model: nn.Module, split: Batch, name: str) -> None:
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a compiled or built-in forward: nothing to check
        return
    try:
        signature.bind(*split.args, **split.kwargs)
    except TypeError as exc:
        given = [f"{len(split.args)} positional"] if split.args else []
        given += [f"keywords {', '.join(split.kwargs)}"] if split.kwargs else []
        raise ValueError(
            f"{type(model).__name__}.forward{signature} cannot take the inputs of {name} "
            f"({' and '.join(given) or 'none'}): {exc}; pass batch_fn= to say what the "
            "model gets"
        ) from exc
