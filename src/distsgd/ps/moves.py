"""Moving pieces between shards at a consistent version, losing no update (``--rebalance``).

A move of pieces ``K`` from shard A to shard B takes three calls, each a function here that the
service runs under the shard's locks (the protocol is in the .proto, "Moving pieces"):

1. :func:`export` on A: with no push half-applied (the gate held exclusive) and under the lock,
   copy the pieces of ``K``, their rule state and their counters at A's version ``v``, and
   *freeze* them: from now on a push to A that contains a piece of ``K`` waits
   (:func:`wait_unfrozen`) instead of applying. Every update A applied to ``K`` is in the copy.
2. :func:`adopt` on B: B holds the copy (until A commits, no client pushes ``K`` to B).
3. :func:`finish` on A (commit): A drops ``K`` and remembers where it went (``shard.moved``);
   the waiting pushes and every later one that contains a piece of ``K`` are refused MOVED with
   the new owner, and the client sends those pieces to B. Nothing is lost: an update of ``K``
   is either in the copy (applied by A before the freeze) or refused by A and sent to B.

The pause a move costs is the time a push containing ``K`` waits: from the export to the
commit, the copy's transfer and B's adoption. It is bounded by :data:`FREEZE_SECONDS`, after
which A undoes the freeze itself (:func:`expire`): a launcher that dies mid-move stops nothing,
and its commit then fails ``NOT_FROZEN``. Only rules whose state is per piece
(``UpdateRule.movable``: the asynchronous ones) move pieces; a synchronous step's open
accumulators are not per piece and stay.

A move ends with a new write-ahead-log generation on both shards, whose snapshot holds the
pieces (B) or the record of where they went (A): a shard restarted after a move comes back with
what it held then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distsgd.ps.load import PieceCounts
from distsgd.transport.errors import Refusal

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard

log = logging.getLogger(__name__)

FREEZE_SECONDS = 10.0
"""How long a piece stays frozen between its export and the move's commit, at most: the bound
on a push's pause during a move."""

MAX_MOVE_KEYS = 1024
"""Pieces one move may name."""

STATE_PREFIX = "rule/"
"""An exported array named ``rule/<attribute>/<key>`` is rule state, not a piece."""


class MoveRefused(ValueError):
    """A move step that cannot be done; ``refusal`` says why (typed), the message in words."""

    def __init__(self, refusal: Refusal | None, message: str) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True)
class Exported:
    """What :func:`export` copied: the pieces and their rule state (one dict, state names
    prefixed :data:`STATE_PREFIX`), their counters, and the version they belong to."""

    version: int
    arrays: dict[str, np.ndarray]
    loads: dict[str, PieceCounts]


def _exclusive(shard: Shard) -> AbstractContextManager[object]:
    """No push half-applied: an unlocked rule's gate held exclusive (a locked rule's pushes
    apply under ``cond``, which the caller holds next)."""
    return nullcontext() if shard.rule.locked else shard.gate.exclusive()


def blocked(shard: Shard, payload: Mapping[str, object]) -> bool:
    """Whether a push of these pieces meets a move (a frozen or moved piece). Read under the
    gate (shared) or ``cond``, which every change of the two holds."""
    if not (shard.frozen or shard.moved):
        return False
    return any(key in shard.frozen or key in shard.moved for key in payload)


def wait_unfrozen(shard: Shard, payload: Mapping[str, object]) -> None:
    """Wait until no piece of ``payload`` is frozen (the move committed or was undone)."""
    with shard.cond:
        while not shard.closing:
            now = time.monotonic()
            expire(shard, now)
            due = [shard.frozen[key] for key in payload if key in shard.frozen]
            if not due:
                return
            shard.cond.wait(timeout=max(0.01, min(due) - now))


def expire(shard: Shard, now: float) -> None:
    """Under ``cond``: undo freezes past their end (the launcher never committed them)."""
    late = [key for key, end in shard.frozen.items() if end <= now]
    if late:
        for key in late:
            del shard.frozen[key]
        log.warning(
            "shard %d: a move of %d piece(s) was not committed within %gs; they stay here",
            shard.index,
            len(late),
            FREEZE_SECONDS,
        )
        shard.cond.notify_all()


def _check_keys(shard: Shard, keys: Sequence[str], peer: int) -> None:
    if not 1 <= len(keys) <= MAX_MOVE_KEYS or len(set(keys)) != len(keys):
        raise MoveRefused(None, f"a move names 1 to {MAX_MOVE_KEYS} distinct pieces")
    if peer == shard.index:
        raise MoveRefused(None, f"shard {shard.index} cannot move pieces to itself")


def export(shard: Shard, keys: Sequence[str], peer: int, now: float | None = None) -> Exported:
    """Step 1 on the source shard: copy and freeze ``keys`` (see the module docstring)."""
    _check_keys(shard, keys, peer)
    if not shard.rule.movable:
        raise MoveRefused(
            Refusal.NOT_MOVABLE,
            f"scheme {shard.scheme!r} keeps state that is not per piece; its pieces cannot move",
        )
    with _exclusive(shard), shard.cond:
        missing = [k for k in keys if k not in shard.values]
        if missing:
            raise MoveRefused(None, f"shard {shard.index} holds no piece {missing[0]!r}")
        if any(k in shard.frozen for k in keys):
            raise MoveRefused(Refusal.NOT_FROZEN, "another move holds these pieces")
        arrays = {k: shard.values[k].copy() for k in keys}
        arrays.update(
            {STATE_PREFIX + name: buf for name, buf in shard.rule.piece_state(keys).items()}
        )
        end = (time.monotonic() if now is None else now) + FREEZE_SECONDS
        shard.frozen.update({k: end for k in keys})
        return Exported(shard.version, arrays, shard.load.piece_counts(keys))


def adopt(
    shard: Shard,
    arrays: Mapping[str, np.ndarray],
    loads: Mapping[str, PieceCounts],
    source: int,
) -> int:
    """Step 2 on the destination shard: hold the exported pieces of shard ``source`` with
    their rule state and counters (replacing a copy a failed move left). Returns how many
    pieces it took."""
    if not shard.rule.movable:
        raise MoveRefused(Refusal.NOT_MOVABLE, f"scheme {shard.scheme!r} takes no moved pieces")
    pieces = {k: v for k, v in arrays.items() if not k.startswith(STATE_PREFIX)}
    state = {k[len(STATE_PREFIX) :]: v for k, v in arrays.items() if k.startswith(STATE_PREFIX)}
    if not 1 <= len(pieces) <= MAX_MOVE_KEYS:
        raise MoveRefused(None, f"a move names 1 to {MAX_MOVE_KEYS} pieces")
    for key, value in pieces.items():
        if not np.isfinite(value).all():
            raise MoveRefused(None, f"{key}: NaN or Inf in a moved piece")
        if key in shard.frozen:
            raise MoveRefused(Refusal.NOT_FROZEN, f"{key} is being moved away from here")
    with _exclusive(shard), shard.cond:
        shard.rule.take_piece_state(state, pieces)  # checks every name before changing any
        values = dict(shard.values)  # a new dict: a reader iterating the old one (an unlocked
        for key, value in pieces.items():  # rule's pull) goes on undisturbed
            values[key] = np.array(value, copy=True)
            shard.moved.pop(key, None)  # a piece that comes back
            shard.adopted[key] = source
        shard.values = values
        shard.load.give({k: loads.get(k, PieceCounts()) for k in pieces})
        shard.cond.notify_all()
    _new_generation(shard)
    return len(pieces)


def finish(shard: Shard, keys: Sequence[str], peer: int, *, commit: bool) -> int:
    """Step 3: on the source shard, commit (drop the pieces, remember ``peer`` holds them) or
    undo the freeze; on the destination (``commit`` False, the pieces not frozen here), drop
    a copy it adopted. Returns how many pieces it changed."""
    _check_keys(shard, keys, peer)
    with _exclusive(shard), shard.cond:
        expire(shard, time.monotonic())
        frozen = [k for k in keys if k in shard.frozen]
        if frozen and len(frozen) != len(keys):
            raise MoveRefused(Refusal.NOT_FROZEN, "only some of these pieces are being moved")
        if not frozen and commit:
            raise MoveRefused(
                Refusal.NOT_FROZEN,
                f"shard {shard.index} is not moving these pieces (the freeze of "
                f"{FREEZE_SECONDS:g}s ended); start the move again",
            )
        if frozen and not commit:
            for key in keys:
                del shard.frozen[key]
            shard.cond.notify_all()
            return 0
        if not commit and any(shard.adopted.get(k) != peer for k in keys):
            raise MoveRefused(None, f"shard {shard.index} took no such pieces from shard {peer}")
        shard.values = {k: v for k, v in shard.values.items() if k not in keys}  # as adopt's
        for key in keys:
            shard.adopted.pop(key, None)
            shard.frozen.pop(key, None)
            if commit:
                shard.moved[key] = peer
        shard.rule.drop_piece_state(keys)
        shard.load.take(keys)
        shard.cond.notify_all()
    _new_generation(shard)
    return len(keys)


def _new_generation(shard: Shard) -> None:
    """Start a new write-ahead-log generation, whose snapshot holds the shard's pieces now."""
    wal = shard.wal
    if wal is not None and not wal.broken:
        wal.compact(shard, wait=True)


def follow(start: Mapping[str, int], moved: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Where each piece is now: from the shard ``start`` places it on (the plan's), follow
    the moves each shard reports (``moved[j]``: piece -> the shard it went to; a shard that
    holds a piece again lists it no more). Returns the pieces not where ``start`` put them."""
    out: dict[str, int] = {}
    for key, first in start.items():
        here, seen = first, {first}
        while 0 <= here < len(moved) and key in moved[here] and moved[here][key] not in seen:
            here = moved[here][key]
            seen.add(here)
        if here != first:
            out[key] = here
    return out
