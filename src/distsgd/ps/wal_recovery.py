"""Recovery of a shard from its write-ahead log folder (:mod:`distsgd.ps.wal`): the newest
readable snapshot, then every record logged after it, replayed through :meth:`Shard.push` and
:meth:`Shard.leave` as the live server applied them, up to the first record that is missing,
torn, or of another generation."""

from __future__ import annotations

import json
import logging
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.ps.membership import DEFAULT_EVICT_AFTER, Member
from distsgd.ps.rules import PushMeta, RuleFactory
from distsgd.ps.wal_files import SLOTS
from distsgd.ps.wal_files import SNAPSHOT as _SNAPSHOT_RE
from distsgd.ps.wal_files import generations as _generations
from distsgd.ps.wal_files import log_path as _log_path
from distsgd.ps.wal_format import CRC_FROM, HEAD, MAGIC, MAX_META_BYTES, Kind, WalError

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """A shard rebuilt from its folder: the snapshot's generation and version, the last
    generation replayed, and the records replayed."""

    shard: Shard
    snapshot: int
    generation: int
    snapshot_version: int
    records: int


def recover(
    folder: Path,
    rule_factory: RuleFactory,
    *,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
) -> Recovery | None:
    """The shard as the dead server had it: the newest readable snapshot, then every record
    logged after it. None if ``folder`` holds no snapshot; :class:`WalError` if none reads."""
    from distsgd.ps.shard import read_shard_file
    from distsgd.ps.shard_file import CorruptCheckpoint

    folder = Path(folder)
    snapshots = _generations(folder, _SNAPSHOT_RE)
    if not snapshots:
        return None
    for generation in reversed(snapshots):
        path = folder / f"snapshot-{generation:08d}.npz"
        try:
            shard = read_shard_file(
                path, rule_factory, max_workers=max_workers, evict_after=evict_after
            )
            break
        except (CorruptCheckpoint, OSError) as exc:
            log.warning("write-ahead log: skipping %s: %s", path, exc)
    else:
        raise WalError(
            f"{folder}: no readable snapshot; restore from a checkpoint, or remove the folder "
            "to start over"
        )
    start, records, last = shard.version, 0, generation
    for gen in range(generation, generation + SLOTS):  # the next one: its snapshot was not out
        replayed = _replay(folder, gen, shard)
        if not replayed:
            break
        records, last = records + replayed, gen
    shard.counts.restored_version = shard.version
    log.info(
        "shard %d recovered from %s: snapshot %d at version %d, %d records replayed, version %d",
        shard.index,
        folder,
        generation,
        start,
        records,
        shard.version,
    )
    return Recovery(
        shard=shard, snapshot=generation, generation=last, snapshot_version=start, records=records
    )


def _replay(folder: Path, generation: int, shard: Shard) -> int:
    """Apply the records of ``generation`` to ``shard``; how many there were."""
    path = _log_path(folder, generation)
    limit = MAX_META_BYTES + 8 + sum(4 + v.nbytes for v in shard.values.values())
    count = 0
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0
    with f:
        while True:
            head = f.read(HEAD.size)
            if len(head) < HEAD.size:
                break
            magic, kind, length, crc, gen, *fields = HEAD.unpack(head)
            if magic != MAGIC or gen != generation or kind not in Kind._value2member_map_:
                break
            body = f.read(length) if length <= limit else b""
            if len(body) < length or (len(body) < 4 and kind == Kind.PUSH):
                break
            checked = 4 + 4 * struct.unpack_from("<I", body)[0] if kind == Kind.PUSH else length
            if checked > length or zlib.crc32(body[:checked], zlib.crc32(head[CRC_FROM:])) != crc:
                break
            try:
                _apply(shard, Kind(kind), body, fields)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                log.warning("write-ahead log %s: record %d unreadable (%s)", path, count, exc)
                break
            count += 1
    return count


def _apply(shard: Shard, kind: Kind, body: bytes, fields: list[Any]) -> None:
    version, worker, incarnation, base_version, lr_scale, sequence = fields
    if kind is Kind.PUSH:
        if shard.rule.locked and version != shard.version:
            log.warning(
                "shard %d: a logged push saw version %d, the replay is at %d",
                shard.index,
                version,
                shard.version,
            )
        meta = PushMeta(
            worker=worker,
            incarnation=incarnation,
            base_version=base_version,
            lr_scale=lr_scale,
            sequence=sequence,
        )
        shard.push(_payload(shard, body), meta)
    elif kind is Kind.LEAVE:
        shard.leave(struct.unpack("<q", body)[0])
    elif kind is Kind.TICK:
        with shard.cond:
            shard.rule.tick(shard, math.inf)
    else:
        _apply_members(shard, json.loads(body))


def _payload(shard: Shard, body: bytes) -> dict[str, np.ndarray]:
    (count,) = struct.unpack_from("<I", body)
    keys = list(shard.values)
    index = np.frombuffer(body, dtype="<u4", count=count, offset=4)
    offset = 4 + 4 * count
    payload: dict[str, np.ndarray] = {}
    for i in index:
        have = shard.values[keys[int(i)]]
        payload[keys[int(i)]] = np.frombuffer(
            body, dtype=have.dtype, count=have.size, offset=offset
        ).reshape(have.shape)
        offset += have.nbytes
    if offset != len(body):
        raise ValueError(f"a push record of {len(body)} bytes holds {offset}")
    return payload


def _apply_members(shard: Shard, state: dict[str, Any]) -> None:
    with shard.cond:
        m = shard.membership
        now = m.clock()
        m.members = {int(w): Member(int(inc), now) for w, inc in state["members"]}
        m.left = {int(w) for w in state["left"]}
        m.epoch = int(state["epoch"])
        shard.finished = {int(w) for w in state["finished"]}
        if state["hook"]:
            shard.rule.on_membership(shard, m.live)
