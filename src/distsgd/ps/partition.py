"""Parameter placement: spread parameters over parameter-server shards, balanced by bytes.

Each parameter becomes one or more *pieces*. A parameter larger than a shard's fair share
(total bytes / number of shards) is cut into contiguous ranges of its flattened elements, so one
huge embedding cannot leave a single server holding most of the model. Pieces then go, largest
first, to the least-loaded shard (greedy LPT scheduling: the resulting maximum load is within 4/3
of the optimum). The plan is a pure function of the parameters' names, shapes and dtypes, so the
chief and every worker compute the same one without talking.

``placement="round-robin"`` is TensorFlow 1's ``replica_device_setter``: whole parameters go to
shards in turn, by order, whatever their size. It is there to compare with, and to make an
unbalanced placement on purpose (a run with ``--rebalance auto`` then moves pieces, see
:mod:`distsgd.ps.moves`). A plan whose pieces moved is :meth:`PartitionPlan.with_owners`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """What the partitioner needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A contiguous range ``[start, stop)`` of a flattened parameter, stored on ``shard``."""

    param: ParamInfo
    start: int
    stop: int
    shard: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.param.numel

    @property
    def key(self) -> str:
        """Wire key: ``name#start``."""
        return f"{self.param.name}#{self.start}"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.param.shape if self.whole else (self.stop - self.start,)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * np.dtype(self.param.dtype).itemsize


PLACEMENTS = ("balanced", "round-robin")
"""``balanced``: byte-balanced LPT with large parameters cut (the default); ``round-robin``:
whole parameters to shards in turn (TensorFlow 1's ``replica_device_setter``)."""


class PartitionPlan:
    """Which shard holds which piece of which parameter; splits and joins named arrays."""

    def __init__(
        self, params: Sequence[ParamInfo], num_shards: int, *, placement: str = "balanced"
    ) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        self.params = list(params)
        self.names = frozenset(names)
        """Every parameter's name."""
        self.num_shards = num_shards
        self.placement = placement
        if placement == "round-robin":
            self.pieces = [
                Piece(param=p, start=0, stop=p.numel, shard=i % num_shards)
                for i, p in enumerate(params)
            ]
            return
        total = sum(p.nbytes for p in params)
        fair = max(1, math.ceil(total / num_shards))
        cuts: list[tuple[ParamInfo, int, int]] = []
        for p in params:
            parts = 1 if num_shards == 1 else max(1, math.ceil(p.nbytes / fair))
            parts = min(parts, max(1, p.numel))
            bounds = [p.numel * i // parts for i in range(parts + 1)]
            cuts.extend((p, bounds[i], bounds[i + 1]) for i in range(parts))
        order = sorted(
            range(len(cuts)),
            key=lambda i: (-(cuts[i][2] - cuts[i][1]) * np.dtype(cuts[i][0].dtype).itemsize, i),
        )
        load = [0] * num_shards
        assigned: dict[int, int] = {}
        for i in order:
            shard = min(range(num_shards), key=lambda s: (load[s], s))
            p, start, stop = cuts[i]
            load[shard] += (stop - start) * np.dtype(p.dtype).itemsize
            assigned[i] = shard
        self.pieces = [
            Piece(param=p, start=a, stop=b, shard=assigned[i]) for i, (p, a, b) in enumerate(cuts)
        ]

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, np.ndarray], num_shards: int, *, placement: str = "balanced"
    ) -> PartitionPlan:
        infos = [
            ParamInfo(name=k, shape=tuple(v.shape), dtype=v.dtype.name) for k, v in arrays.items()
        ]
        return cls(infos, num_shards, placement=placement)

    def with_owners(self, owners: Mapping[str, int]) -> PartitionPlan:
        """This plan with the pieces named in ``owners`` (piece key -> shard) held elsewhere:
        the plan of a run whose servers moved pieces. Unknown keys and shards are ValueError."""
        known = {piece.key for piece in self.pieces}
        for key, shard in owners.items():
            if key not in known:
                raise ValueError(f"no piece {key!r} in this plan")
            if not 0 <= shard < self.num_shards:
                raise ValueError(f"piece {key!r} moved to shard {shard} of {self.num_shards}")
        plan = copy.copy(self)
        plan.pieces = [
            replace(piece, shard=owners.get(piece.key, piece.shard)) for piece in self.pieces
        ]
        return plan

    @property
    def shard_bytes(self) -> list[int]:
        """Bytes of the pieces each shard holds."""
        return [sum(x.nbytes for x in self.shard_pieces(s)) for s in range(self.num_shards)]

    def shard_pieces(self, shard: int) -> list[Piece]:
        return [piece for piece in self.pieces if piece.shard == shard]

    def some(self, names: Collection[str] | None) -> list[Piece]:
        """The pieces of the parameters ``names`` (every piece for None); ValueError for a name
        that is no parameter."""
        if names is None:
            return self.pieces
        wanted = set(names)
        unknown = wanted - self.names
        if unknown:
            raise ValueError(f"no parameter named {sorted(unknown)[0]!r} in the plan")
        return [piece for piece in self.pieces if piece.param.name in wanted]

    def split(
        self, arrays: Mapping[str, np.ndarray], *, partial: bool = False
    ) -> list[dict[str, np.ndarray]]:
        """Named full arrays -> one dict of piece arrays per shard (views where possible).
        ``partial``: ``arrays`` may hold some parameters only (a shard none of whose pieces
        are among them gets an empty dict)."""
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_shards)]
        for piece in self.some(list(arrays) if partial else None):
            array = arrays[piece.param.name]
            if tuple(array.shape) != piece.param.shape:
                raise ValueError(
                    f"{piece.param.name}: shape {tuple(array.shape)} != {piece.param.shape}"
                )
            out[piece.shard][piece.key] = (
                array if piece.whole else array.reshape(-1)[piece.start : piece.stop]
            )
        return out

    def join_into(
        self,
        shards: Sequence[Mapping[str, np.ndarray]],
        out: Mapping[str, np.ndarray],
        names: Collection[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Per-shard piece arrays written into ``out`` (every parameter, of its shape);
        ``names``: only those parameters."""
        params = [p for p in self.params if names is None or p.name in names]
        for p in params:
            have = out[p.name]
            if tuple(have.shape) != p.shape or not have.flags.c_contiguous:
                raise ValueError(
                    f"{p.name}: need a contiguous array of shape {p.shape}, got {tuple(have.shape)}"
                )
        for piece in self.some(names):
            target = out[piece.param.name]
            source = shards[piece.shard][piece.key]
            if piece.whole:
                np.copyto(target, source.reshape(target.shape))
            else:
                target.reshape(-1)[piece.start : piece.stop] = source.reshape(-1)
        return {p.name: out[p.name] for p in params}

    def join(
        self, shards: Sequence[Mapping[str, np.ndarray]], names: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Per-shard piece arrays -> named full arrays (``names``: only those parameters)."""
        params = [p for p in self.params if names is None or p.name in names]
        out = {p.name: np.empty(p.numel, dtype=p.dtype) for p in params}
        for piece in self.some(names):
            out[piece.param.name][piece.start : piece.stop] = shards[piece.shard][
                piece.key
            ].reshape(-1)
        return {p.name: out[p.name].reshape(p.shape) for p in params}
