"""Where a worker's client sends each piece: the partition plan every task computes, and the
pieces the servers moved since (``--rebalance``; see :mod:`distsgd.ps.moves`), as last heard
from the shards' Info and MOVED answers."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from distsgd.ps.moves import follow
from distsgd.ps.partition import PartitionPlan
from distsgd.transport.carriers.base import Payload
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)


class PiecePlacement:
    """Where each piece of ``base`` (the plan every task computes) is, as last heard by worker
    ``worker``'s client: :attr:`plan` is ``base`` with the pieces the servers moved."""

    def __init__(self, base: PartitionPlan, worker: int) -> None:
        self.base = base
        self.plan = base
        self.worker = worker
        self._where = {p.key: p.shard for p in base.pieces}
        self.moves_followed = 0
        """How many times this client learned that pieces had moved."""

    def by_owner(self, payload: Payload) -> dict[int, list[str]]:
        """The payload's piece keys by the shard that holds each now."""
        by_shard: dict[int, list[str]] = {}
        for spec in payload.specs:
            by_shard.setdefault(self._where[spec.key], []).append(spec.key)
        return by_shard

    def owner(self, key: str) -> int | None:
        """The shard that holds piece ``key`` as last heard (None: no such piece)."""
        return self._where.get(key)

    def lacks(
        self,
        results: Sequence[tuple[int, Mapping[str, np.ndarray]] | None],
        names: Collection[str] | None = None,
    ) -> bool:
        """Whether a pull's answers lack a piece of ``names`` (None: any) the plan places on
        their shard (a shard not asked answered None)."""
        return any(
            (answer := results[piece.shard]) is None or piece.key not in answer[1]
            for piece in self.plan.some(names)
        )

    def follow(self, infos: Sequence[pb.InfoResponse]) -> None:
        """Learn from every shard's ``moved`` where the pieces are (see :func:`moves.follow`)."""
        start = {piece.key: piece.shard for piece in self.base.pieces}
        reported = [{m.key: m.shard for m in info.moved} for info in infos]
        self.adopt(follow(start, reported), replace=True)

    def adopt(self, owners: Mapping[str, int], *, replace: bool = False) -> None:
        """Place the pieces of ``owners`` there (``replace``: those and no other moves)."""
        if not owners and not replace:
            return
        base = {p.key: p.shard for p in self.base.pieces}
        known = {k: s for k, s in self._where.items() if s != base[k]}
        merged = dict(owners) if replace else {**known, **owners}
        plan = self.base.with_owners(merged)
        if [p.shard for p in plan.pieces] != [p.shard for p in self.plan.pieces]:
            self.moves_followed += 1
            log.info(
                "worker %d: pieces moved; bytes per shard now %s", self.worker, plan.shard_bytes
            )
        self.plan = plan
        self._where = {p.key: p.shard for p in plan.pieces}

    def check_held(self, infos: Sequence[pb.InfoResponse]) -> None:
        """ValueError unless each shard's Info lists the pieces the plan places there."""
        for i, info in enumerate(infos):
            expected = sorted((p.key, p.shape) for p in self.plan.shard_pieces(i))
            have = sorted(
                (t.key, tuple(t.shape)) for t in info.tensors if self.owner(t.key) in (i, None)
            )
            if expected != have:
                raise ValueError(
                    f"ps{i} holds different parameters than this worker's model "
                    f"(first difference: {_first_difference(expected, have)}); "
                    "every task must build the same model"
                )

    def buffers(
        self, areas: Sequence[Mapping[str, np.ndarray] | None]
    ) -> dict[str, np.ndarray] | None:
        """One array per parameter from each shard's push area (``areas``), or None unless
        every parameter is a whole piece with a place of its shape and dtype there."""
        out: dict[str, np.ndarray] = {}
        for piece in self.plan.pieces:
            area = areas[piece.shard]
            if not piece.whole or area is None or piece.key not in area:
                return None
            view = area[piece.key]
            if view.dtype != piece.param.dtype or tuple(view.shape) != piece.param.shape:
                return None
            out[piece.param.name] = view
        return out


def _first_difference(expected: list[Any], have: list[Any]) -> str:
    for a, b in zip(expected, have, strict=False):
        if a != b:
            return f"expected {a}, server has {b}"
    if len(expected) != len(have):
        return f"expected {len(expected)} pieces, server has {len(have)}"
    return "none"
