"""Training data that streams: an ``IterableDataset``, and batches read by DataLoader workers.

**An IterableDataset** (``train(train_data=stream)``) is read by every distsgd worker, and
each must train on its own part of it. Two ways, by the data set's choice:

* by default distsgd splits it: every reader (a distsgd worker, or one of its DataLoader
  worker processes) iterates the whole stream and keeps every ``parts``-th item, from item
  ``part`` on (:func:`data_part`). Correct for any iterable, but each reader reads everything;
* a data set that reads only its own part says so with the class attribute
  ``reads_own_part = True``, and distsgd keeps every item it yields. It asks
  :func:`data_part` (``distsgd.data_part()``) which part is its own, e.g. to open only the
  files ``files[part::parts]``, as WebDataset's ``split_by_node`` and ``split_by_worker`` do.

An *epoch* of a stream is one pass of this worker's part: its iterator runs out. Its length is
not known before, so a stream needs ``--steps`` (steps per worker); a worker whose part runs
out starts the next epoch (calling the data set's ``set_epoch(epoch)`` first, where it has one,
so it can reshuffle). The last incomplete batch of a pass is dropped. The checkpointed
position is (epoch, batches served of it); on resume a worker starts the pass again and skips
that many batches, so the resumed run trains on what the uninterrupted one would have where
the stream yields the same items for the same epoch. ``--world-size dynamic`` counted in epochs
leases work units by index, which a stream has not: it is refused (use ``--steps``, or a
map-style data set such as :class:`distsgd.ShardFolder`).

**DataLoader workers** (``TrainConfig.loader_workers`` / ``--loader-workers K``): batches are
read and collated by K child processes of the worker, a few batches ahead of training. For a
map-style data set (:class:`LoaderBatches`) the order, epochs and positions are those of the
batches it wraps, the position counting the batches trained, not those read ahead; the
children live for the whole run. A stream starts new ones for each pass, so that the data
set's ``set_epoch`` reaches their copies of it. The children end with the worker (when its
loop ends, and on Linux at once when the worker itself dies).

**A shard folder's order** (:class:`WindowedBatches`): a global shuffle of data larger than
the page cache makes every sample a random read from the disk (measured: 117 samples/s
against about 5,500 in windows of 4 shards, docs/large-data.md). So a :class:`ShardFolder` is
shuffled by shards and within windows of a few shards (``ShardFolder(path, window=4)``), which
reads each shard in one stretch; ``window=0`` shuffles it globally, as data in memory, giving
the very batches the same data in memory gives.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from distsgd.control.config import TrainConfig
from distsgd.control.errors import SetupError
from distsgd.runtime.data import ShardedBatches, shard_size
from distsgd.runtime.shards import ShardFolder
from distsgd.util.libc import die_with_parent

log = logging.getLogger(__name__)

UNKNOWN_LENGTH = 1 << 62
"""``steps_per_epoch`` of a stream: its length is not known, so a step count splits into
(epoch 0, that many batches), which :meth:`StreamBatches.seek` skips across passes."""

PREFETCH = 2
"""Batches each DataLoader worker reads ahead."""


def data_part() -> tuple[int, int]:
    """``(part, parts)``: which part of a stream the code calling it reads.

    ``parts`` is the run's workers times each worker's DataLoader workers (1 without them);
    ``part`` is ``rank * loader_workers + loader_worker_id``. Alone, ``(0, 1)``. A data set
    with ``reads_own_part = True`` calls it in ``__iter__`` to pick its share, e.g.
    ``files[part::parts]``."""
    from distsgd.control.task import TaskEnv

    env = TaskEnv.from_environ()
    return _reader_part(*((0, 1) if env is None else (env.task_index, env.num_workers)))


def _reader_part(rank: int, world: int) -> tuple[int, int]:
    """``(part, parts)`` of this reader (a DataLoader worker of worker ``rank``, or the worker
    itself) among every reader of a run of ``world`` workers."""
    info = get_worker_info()
    if info is None:
        return rank, world
    return rank * info.num_workers + info.id, world * info.num_workers


class _Part(IterableDataset[Any]):
    """This reader's part of a stream: every item, when the data set reads only its own part,
    else every ``parts``-th from ``part`` on."""

    def __init__(self, dataset: IterableDataset[Any], rank: int, world: int) -> None:
        self.dataset = dataset
        self.rank, self.world = rank, world
        self.own = bool(getattr(dataset, "reads_own_part", False))

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.dataset)
        if self.own:
            return items
        part, parts = _reader_part(self.rank, self.world)
        return itertools.islice(items, part, None, parts)


def _die_with_parent(worker_id: int, parent: int) -> None:
    """(In each DataLoader worker) be killed when the process that forked it (``parent``)
    dies, so no reader outlives a killed worker; torch's own check notices only every few
    seconds."""
    die_with_parent(parent)


def _loader(dataset: Dataset[Any], workers: int, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        num_workers=workers,
        prefetch_factor=PREFETCH if workers else None,
        worker_init_fn=functools.partial(_die_with_parent, parent=os.getpid()) if workers else None,
        **kwargs,
    )


class StreamBatches:
    """Endless batches of worker ``rank``'s part of an ``IterableDataset`` (module docstring);
    ``position`` is (epoch, batches served of it)."""

    steps_per_epoch = UNKNOWN_LENGTH

    def __init__(
        self,
        dataset: IterableDataset[Any],
        *,
        rank: int,
        world: int,
        batch_size: int,
        loader_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.loader_workers = loader_workers
        self.part = _Part(dataset, rank, world)
        self.epoch = 0
        self.batch = 0
        self.skip = 0
        """Batches still to skip (after a :meth:`seek`), across passes if need be."""

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already served)."""
        return self.epoch, self.batch

    def seek(self, position: tuple[int, int]) -> None:
        """Continue from a saved :attr:`position` (before iterating): the pass of that epoch
        starts again and its first ``position[1]`` batches are skipped (a count beyond the pass
        goes on into the next ones)."""
        self.epoch, self.skip = int(position[0]), int(position[1])
        self.batch = 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            # A new loader a pass: its workers fork with the data set as set_epoch left it.
            loader = _loader(
                self.part, self.loader_workers, batch_size=self.batch_size, drop_last=True
            )
            served = False
            for batch in loader:
                served = True
                self.batch += 1
                if self.skip:
                    self.skip -= 1
                else:
                    yield batch
            if not served:  # (a SetupError: the same data would fail the same way again)
                raise SetupError(
                    f"train_data's part for this worker yields fewer than {self.batch_size} "
                    f"items (epoch {self.epoch}); give it more data or lower --batch-size"
                )
            self.epoch += 1
            self.batch = 0


class WindowedBatches(ShardedBatches):
    """:class:`ShardedBatches` of a :class:`ShardFolder` in an order that reads the disk in few
    places at a time: what data larger than the page cache needs, where a global shuffle would
    make every sample a random read from the disk.

    Each epoch the shards are put in an order seeded by (seed, epoch), the same on every
    worker, and the samples so lined up are cut into ``world`` equal, disjoint ranges, one a
    worker (so a worker reads other shards each epoch). A worker then takes its range in
    windows of ``window`` consecutive shards (pieces of them), in that order, each window's
    samples shuffled. Every sample of a worker's range is served once an epoch, every worker
    serves the same number of batches, and (epoch, batch) is a position as exact as
    :class:`ShardedBatches`'s."""

    def __init__(
        self, dataset: ShardFolder, *, rank: int, world: int, batch_size: int, seed: int
    ) -> None:
        self.per = shard_size(len(dataset), world, batch_size)
        self.dataset = self.folder = dataset
        self.rank = rank
        self.window = dataset.window
        self.batch_size = batch_size
        self.steps_per_epoch = self.per // batch_size
        self.run_seed = seed
        self.seed = seed * 1000 + rank
        self.epoch = 0
        self.batch = 0

    def order(self, epoch: int) -> torch.Tensor:
        """This worker's indices in ``epoch``'s order (see the class docstring)."""
        starts = self.folder.starts
        shared = torch.Generator().manual_seed(self.run_seed * 1_000_003 + epoch)
        lo, hi = self.rank * self.per, (self.rank + 1) * self.per
        pieces: list[tuple[int, int]] = []
        at = 0
        for shard in torch.randperm(len(starts) - 1, generator=shared).tolist():
            begin, length = starts[shard], starts[shard + 1] - starts[shard]
            first, last = max(lo, at), min(hi, at + length)
            if first < last:
                pieces.append((begin + first - at, begin + last - at))
            at += length
        own = torch.Generator().manual_seed(self.seed + epoch)
        out = []
        for w in range(0, len(pieces), self.window):
            window = torch.cat([torch.arange(a, b) for a, b in pieces[w : w + self.window]])
            out.append(window[torch.randperm(len(window), generator=own)])
        return torch.cat(out)


class _Orders:
    """The index lists of a :class:`ShardedBatches`'s batches from its position on, for a
    DataLoader's ``batch_sampler`` (the loader reads ahead of the position)."""

    def __init__(self, batches: ShardedBatches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batches
        epoch, start = b.epoch, b.batch
        while True:
            order = b.order(epoch)
            for i in range(start, b.steps_per_epoch):
                yield order[i * b.batch_size : (i + 1) * b.batch_size].tolist()
            epoch, start = epoch + 1, 0


class LoaderBatches:
    """The batches of ``inner`` (a :class:`ShardedBatches` or :class:`WindowedBatches`), read
    by ``loader_workers`` DataLoader processes: the same batches in the same order, the
    position counting those served, not those read ahead."""

    def __init__(self, inner: ShardedBatches, loader_workers: int) -> None:
        self.inner = inner
        self.loader_workers = loader_workers
        self.steps_per_epoch = inner.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already served)."""
        return self.inner.position

    def seek(self, position: tuple[int, int]) -> None:
        """Continue from a saved :attr:`position` (before iterating)."""
        self.inner.seek(position)

    def __iter__(self) -> Iterator[Any]:
        b = self.inner
        loader = _loader(b.dataset, self.loader_workers, batch_sampler=_Orders(b))
        for batch in loader:
            b.batch += 1  # served (as ShardedBatches counts): a checkpoint now skips it
            yield batch
            if b.batch == b.steps_per_epoch:
                b.epoch += 1
                b.batch = 0


Batches = ShardedBatches | StreamBatches | LoaderBatches
"""What :func:`make_batches` builds."""


def make_batches(
    dataset: Dataset[Any], *, rank: int, world: int, config: TrainConfig, leased: bool
) -> Batches | None:
    """This worker's batches of ``dataset``: :class:`StreamBatches` for an IterableDataset;
    else :class:`WindowedBatches` for a :class:`ShardFolder` with a ``window``, otherwise
    :class:`ShardedBatches`, read through :class:`LoaderBatches` with
    ``config.loader_workers``; None when the run leases work units (``leased``: the loop
    builds them once registered).

    Raises:
        ValueError: a stream without ``steps`` or under work units, or loader workers with
            work units.
    """
    if isinstance(dataset, IterableDataset):
        if leased:
            raise ValueError(
                "train_data is an IterableDataset, and --world-size dynamic counted in epochs "
                "leases work units by index; pass --steps N, or give a map-style data set "
                "(e.g. distsgd.ShardFolder(path))"
            )
        if config.steps == 0:
            raise ValueError(
                "train_data is an IterableDataset of unknown length, so --epochs cannot say "
                "when to stop; pass --steps N (steps per worker; an epoch is one pass of each "
                "worker's part)"
            )
        return StreamBatches(
            dataset,
            rank=rank,
            world=world,
            batch_size=config.batch_size,
            loader_workers=config.loader_workers,
        )
    if leased:
        if config.loader_workers:
            raise ValueError(
                "--loader-workers with --world-size dynamic counted in epochs: work units are "
                "read in the worker itself; use --loader-workers 0, or --steps"
            )
        return None
    windowed = isinstance(dataset, ShardFolder) and dataset.window
    kind: type[ShardedBatches] = WindowedBatches if windowed else ShardedBatches
    batches = kind(dataset, rank=rank, world=world, batch_size=config.batch_size, seed=config.seed)
    log.info(
        "worker%d: %s, %d loader processes", rank, type(batches).__name__, config.loader_workers
    )
    return LoaderBatches(batches, config.loader_workers) if config.loader_workers else batches
