"""Moving pieces between shards at a consistent version, losing no update (``--rebalance``).

A move of pieces ``K`` from shard A to shard B takes three calls, each a function here that the
service runs under the shard's locks (the protocol is in the .proto, "Moving pieces"):

1. :func:`export` on A: with no push half-applied (the gate held exclusive) and under the lock,
   copy the pieces of ``K``, their rule state and their counters at A's version ``v``, and
   *freeze* them: from now on a push to A that contains a piece of ``K`` waits
   (:func:`wait_unfrozen`) instead of applying. Every update A applied to ``K`` is in the copy.
2. :func:`adopt` on B: B holds the copy (until A commits, no client pushes ``K`` to B).
3. :func:`finish` on A (commit): A drops ``K`` and remembers where it went (``MoveBook.moved``);
   the waiting pushes and every later one that contains a piece of ``K`` are refused MOVED with
   the new owner, and the client sends those pieces to B. Nothing is lost: an update of ``K``
   is either in the copy (applied by A before the freeze) or refused by A and sent to B.

Each move has an id (:func:`new_move_id`: 128 random bits, chosen by A at the export and sent
only to the one who exported) and a version (A's, of the copy), and each shard keeps the open
steps of its moves (:class:`MoveBook`): the export on A, the import on B. A step out of order
is refused and changes nothing (``Refusal.NO_SUCH_MOVE``: no open step of that move here, e.g.
an undo after the commit; ``Refusal.MOVE_MISMATCH``: other pieces, peer or version than the
move's, or a commit whose receipt is not the digest of what A exported, i.e. B holds another
copy). B's import answers a *receipt*, the SHA-256 of the move id, version and every array it
took (:func:`digest`); A commits only with the receipt equal to the digest of its own export,
so a stale copy, or a copy of another shape or dtype, is never committed. B never replaces a
piece it holds (its own, or another move's copy) except by a retry of the same import; the
launcher ends a move by confirming it on B (``FinishMove`` commit there), after which B's
copy is B's and an undo of that move is refused.

The pause a move costs is the time a push containing ``K`` waits: from the export to the
commit, the copy's transfer and B's adoption. It is bounded by :data:`FREEZE_SECONDS`, after
which A undoes the freeze itself (:func:`expire`): a launcher that dies mid-move stops nothing,
and its commit then fails ``NO_SUCH_MOVE``. Only rules whose state is per piece
(``UpdateRule.movable``: the asynchronous ones) move pieces; a synchronous step's open
accumulators are not per piece and stay.

A move ends with a new write-ahead-log generation on both shards, whose snapshot holds the
pieces (B) or the record of where they went (A): a shard restarted after a move comes back with
what it held then.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distsgd.ps.load import PieceCounts
from distsgd.transport.codec import FLOAT_DTYPES
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
    prefixed :data:`STATE_PREFIX`), their counters, the version they belong to, and the move's
    id."""

    version: int
    arrays: dict[str, np.ndarray]
    loads: dict[str, PieceCounts]
    move_id: str = ""


@dataclass(frozen=True)
class OpenStep:
    """A move's step that is done here and waits for its end: an export (on A; ``peer`` is
    B) or an import (on B; ``peer`` is A), with its pieces, version and digest."""

    peer: int
    keys: tuple[str, ...]
    version: int
    digest: bytes


class MoveBook:
    """A shard's moves: its open steps, by move id (exported or imported here, not yet ended,
    since this server started: the only ones a FinishMove may end), its frozen pieces and the
    pieces that left it. Changed under the shard's ``cond``."""

    def __init__(self) -> None:
        self.exports: dict[str, OpenStep] = {}
        self.imports: dict[str, OpenStep] = {}
        self.frozen: dict[str, float] = {}
        """Pieces being moved away (key -> the ``time.monotonic()`` their freeze ends); a push
        that contains one waits (:func:`wait_unfrozen`)."""
        self.moved: dict[str, int] = {}
        """Pieces that left the shard: key -> the shard they went to."""


_MOVE_ID = re.compile(r"[0-9a-f]{32}")


def new_move_id() -> str:
    """A move's id: 128 random bits in hex (known only to whoever did the export)."""
    return secrets.token_hex(16)


def check_move_id(move_id: str) -> None:
    if not _MOVE_ID.fullmatch(move_id):
        raise MoveRefused(None, "a move step names its move: 32 hex digits (ExportHeader.move_id)")


def digest(move_id: str, version: int, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The SHA-256 of a move's id, version and arrays (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256(f"{move_id}:{version}".encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.digest()


def _exclusive(shard: Shard) -> AbstractContextManager[object]:
    """No push half-applied: an unlocked rule's gate held exclusive (a locked rule's pushes
    apply under ``cond``, which the caller holds next)."""
    return nullcontext() if shard.rule.locked else shard.gate.exclusive()


def blocked(shard: Shard, payload: Mapping[str, object]) -> bool:
    """Whether a push of these pieces meets a move (a frozen or moved piece). Read under the
    gate (shared) or ``cond``, which every change of the two holds."""
    if not (shard.move_book.frozen or shard.move_book.moved):
        return False
    return any(key in shard.move_book.frozen or key in shard.move_book.moved for key in payload)


def wait_unfrozen(shard: Shard, payload: Mapping[str, object]) -> None:
    """Wait until no piece of ``payload`` is frozen (the move committed or was undone)."""
    with shard.cond:
        while not shard.closing:
            now = time.monotonic()
            expire(shard, now)
            due = [shard.move_book.frozen[key] for key in payload if key in shard.move_book.frozen]
            if not due:
                return
            shard.cond.wait(timeout=max(0.01, min(due) - now))


def expire(shard: Shard, now: float) -> None:
    """Under ``cond``: undo freezes past their end (the launcher never committed them)."""
    late = [key for key, end in shard.move_book.frozen.items() if end <= now]
    if late:
        for key in late:
            del shard.move_book.frozen[key]
        book = shard.move_book
        book.exports = {
            m: step for m, step in book.exports.items() if step.keys[0] in shard.move_book.frozen
        }
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
    """Step 1 on the source shard: copy and freeze ``keys`` under a new move id (see the
    module docstring)."""
    _check_keys(shard, keys, peer)
    if not shard.rule.movable:
        raise MoveRefused(
            Refusal.NOT_MOVABLE,
            f"scheme {shard.scheme!r} keeps state that is not per piece; its pieces cannot move",
        )
    now = time.monotonic() if now is None else now
    with _exclusive(shard), shard.cond:
        expire(shard, now)
        missing = [k for k in keys if k not in shard.values]
        if missing:
            raise MoveRefused(None, f"shard {shard.index} holds no piece {missing[0]!r}")
        if any(k in shard.move_book.frozen for k in keys):
            raise MoveRefused(Refusal.NOT_FROZEN, "another move holds these pieces")
        if any(k in step.keys for step in shard.move_book.imports.values() for k in keys):
            raise MoveRefused(Refusal.MOVE_MISMATCH, "a move into this shard is not confirmed")
        arrays = {k: shard.values[k].copy() for k in keys}
        arrays.update(
            {STATE_PREFIX + name: buf for name, buf in shard.rule.piece_state(keys).items()}
        )
        shard.move_book.frozen.update({k: now + FREEZE_SECONDS for k in keys})
        out = Exported(shard.version, arrays, shard.load.piece_counts(keys), new_move_id())
    step = OpenStep(peer, tuple(keys), out.version, digest(out.move_id, out.version, arrays))
    with shard.cond:  # the digest outside the locks: pushes of other pieces go on
        if all(k in shard.move_book.frozen for k in keys):
            shard.move_book.exports[out.move_id] = step
    return out


def _check_import(
    shard: Shard, pieces: Mapping[str, np.ndarray], source: int, move_id: str
) -> None:
    """Under ``cond``: an import brings pieces this shard does not hold (or a retry of the
    same import), none of them being moved away from here."""
    again = shard.move_book.imports.get(move_id)
    for key in pieces:
        if key in shard.move_book.frozen:
            raise MoveRefused(Refusal.NOT_FROZEN, f"{key} is being moved away from here")
        if key in shard.values and not (again and again.peer == source and key in again.keys):
            raise MoveRefused(
                Refusal.MOVE_MISMATCH,
                f"shard {shard.index} holds {key!r:.80} already; an import brings pieces it "
                "does not hold (no export of that move named this shard)",
            )
    if again is not None and (again.peer != source or set(again.keys) != set(pieces)):
        raise MoveRefused(Refusal.MOVE_MISMATCH, "a repeated import with other pieces")


def _split_import(
    arrays: Mapping[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(pieces, rule state) of an import, each piece a float array of finite values."""
    pieces = {k: v for k, v in arrays.items() if not k.startswith(STATE_PREFIX)}
    state = {k[len(STATE_PREFIX) :]: v for k, v in arrays.items() if k.startswith(STATE_PREFIX)}
    if not 1 <= len(pieces) <= MAX_MOVE_KEYS:
        raise MoveRefused(None, f"a move names 1 to {MAX_MOVE_KEYS} pieces")
    for key, value in pieces.items():
        if value.dtype.name not in FLOAT_DTYPES:
            raise MoveRefused(
                None, f"{key!r:.80}: a moved piece is float16/32/64, not {value.dtype}"
            )
        if not np.isfinite(value).all():
            raise MoveRefused(None, f"{key!r:.80}: NaN or Inf in a moved piece")
    return pieces, state


def adopt(
    shard: Shard,
    arrays: Mapping[str, np.ndarray],
    loads: Mapping[str, PieceCounts],
    source: int,
    *,
    move_id: str,
    version: int,
) -> tuple[int, bytes]:
    """Step 2 on the destination shard: hold the pieces that shard ``source`` exported in
    move ``move_id`` at ``version``, with their rule state and counters. Returns how many
    pieces it took and the receipt (:func:`digest` of what it took)."""
    if not shard.rule.movable:
        raise MoveRefused(Refusal.NOT_MOVABLE, f"scheme {shard.scheme!r} takes no moved pieces")
    check_move_id(move_id)
    pieces, state = _split_import(arrays)
    receipt = digest(move_id, version, arrays)
    with _exclusive(shard), shard.cond:
        _check_import(shard, pieces, source, move_id)
        shard.rule.take_piece_state(state, pieces)  # checks every name before changing any
        values = dict(shard.values)  # a new dict: a reader iterating the old one (an unlocked
        for key, value in pieces.items():  # rule's pull) goes on undisturbed
            values[key] = np.array(value, copy=True)
            shard.move_book.moved.pop(key, None)  # a piece that comes back
        shard.values = values
        shard.move_book.imports[move_id] = OpenStep(source, tuple(pieces), version, receipt)
        shard.load.give({k: loads.get(k, PieceCounts()) for k in pieces})
        shard.cond.notify_all()
    _new_generation(shard)
    return len(pieces), receipt


def finish(
    shard: Shard,
    keys: Sequence[str],
    peer: int,
    *,
    commit: bool,
    move_id: str,
    version: int = 0,
    receipt: bytes = b"",
) -> int:
    """Step 3 of move ``move_id``: on the source shard, commit (drop the pieces, remember
    ``peer`` holds them; ``version`` and ``receipt`` must be the export's) or undo the freeze;
    on the destination, confirm the import (commit: the pieces are this shard's now) or drop
    the copy it took (undo). Returns how many pieces it dropped."""
    _check_keys(shard, keys, peer)
    check_move_id(move_id)
    with _exclusive(shard), shard.cond:
        expire(shard, time.monotonic())
        book = shard.move_book
        step = book.exports.get(move_id) or book.imports.get(move_id)
        if step is None:
            raise MoveRefused(
                Refusal.NO_SUCH_MOVE,
                f"shard {shard.index} has no open step of move {move_id[:8]}: it was never "
                "exported or imported here, or it was committed, undone or its freeze ended",
            )
        if step.peer != peer or step.keys != tuple(keys):
            raise MoveRefused(Refusal.MOVE_MISMATCH, "other pieces or another peer than the move's")
        if move_id in book.imports:
            del book.imports[move_id]
            if commit:
                return 0  # confirmed: from now on nothing undoes it
        elif not commit:
            del book.exports[move_id]
            for key in keys:
                del shard.move_book.frozen[key]
            shard.cond.notify_all()
            return 0
        elif version != step.version or receipt != step.digest:
            raise MoveRefused(
                Refusal.MOVE_MISMATCH,
                f"the commit does not match the export of version {step.version} (the copy on "
                f"shard {peer} is another); undo the move",
            )
        else:
            del book.exports[move_id]
        _drop(shard, keys, moved_to=peer if commit else None)
    _new_generation(shard)
    return len(keys)


def _drop(shard: Shard, keys: Sequence[str], moved_to: int | None) -> None:
    """Under the locks: forget these pieces (a committed move records where they went)."""
    shard.values = {k: v for k, v in shard.values.items() if k not in keys}  # as adopt's
    for key in keys:
        shard.move_book.frozen.pop(key, None)
        if moved_to is not None:
            shard.move_book.moved[key] = moved_to
    shard.rule.drop_piece_state(keys)
    shard.load.take(keys)
    shard.cond.notify_all()


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
