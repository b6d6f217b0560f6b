"""One parameter-server shard: its pieces, a version counter, membership, and its update rule.

A shard serialises to one ``.npz`` file (:meth:`Shard.pack_into`, :meth:`Shard.from_bytes`):
every piece, the rule's state, a JSON header with the version, membership and counters. This
module owns that layout: :func:`read_shard_header` reads the header (a :class:`ShardHeader`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distsgd.ps import moves, snapshot_check
from distsgd.ps.gate import Gate
from distsgd.ps.load import ShardLoad
from distsgd.ps.membership import DEFAULT_EVICT_AFTER, Membership
from distsgd.ps.rules import (
    DUPLICATE,
    PushMeta,
    PushOutcome,
    RuleFactory,
    UpdateRule,
    all_finite,
    parse_options_json,
)
from distsgd.ps.sequence import AppliedSequences
from distsgd.ps.shard_file import (  # re-exported: callers read them here too
    CHECKPOINT_FORMAT as CHECKPOINT_FORMAT,
)
from distsgd.ps.shard_file import (
    CorruptCheckpoint,
    first_line,
    pack_state,
    pack_state_into,
    unpack_state,
)
from distsgd.ps.wal_outage import until_logged
from distsgd.ps.work import Unit, WorkQueue, WorkSpec
from distsgd.transport.errors import PushReject

if TYPE_CHECKING:
    from distsgd.ps.wal import WriteAheadLog

log = logging.getLogger(__name__)


@dataclass
class ShardCounts:
    """A shard's counters of pushes decided, and the version it was restored at."""

    pushes_accepted: int = 0
    pushes_rejected: int = 0
    nonfinite_rejected: int = 0
    """Pushes refused for a NaN or Inf (counted among ``pushes_rejected`` too)."""
    restored_version: int = 0

    def header(self) -> dict[str, int]:
        """The counters as the shard file's header holds them."""
        return {k: v for k, v in asdict(self).items() if k != "restored_version"}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> ShardCounts:
        """The counters of a shard file's header, restored at its version."""
        return cls(
            **{k: int(header[k]) for k in cls().header()}, restored_version=int(header["version"])
        )


class Shard:
    """Pieces of the model held by one ps task.

    ``version`` counts parameter changes (one per applied update, or per closed step under a
    synchronous rule). Readers wait on ``cond`` for a version; writers call :meth:`bump`.
    """

    def __init__(
        self,
        *,
        index: int,
        scheme: str,
        options_json: str,
        num_workers: int,
        values: Mapping[str, np.ndarray],
        rule: UpdateRule,
        run_id: str = "",
        max_workers: int = 0,
        evict_after: float = DEFAULT_EVICT_AFTER,
        work: WorkSpec | None = None,
        own: bool = False,
    ) -> None:
        """``max_workers``, ``evict_after``: see :class:`~distsgd.ps.membership.Membership`;
        ``work``: the work units it hands out (:mod:`distsgd.ps.work`); ``own``: ``values`` are
        its to keep (nothing else holds them), not copied: no second model while it registers."""
        self.index, self.scheme, self.options_json = index, scheme, options_json
        self.num_workers = num_workers
        self.values: dict[str, np.ndarray] = {k: _kept(v, own) for k, v in values.items()}
        self.rule = rule
        self.run_id = run_id
        self.version = 0
        self.cond = threading.Condition()
        self.finished: set[int] = set()
        self.incarnations: dict[int, int] = {}
        self.counts = ShardCounts()
        """Pushes accepted and refused, and the version restored (``Info``, the shard file)."""
        self.load = ShardLoad()
        """Pushes, pulls, their bytes and the seconds pushes took here (``Info``)."""
        self.closing = False
        """Set by :meth:`close`: the server is stopping, waiting readers give up."""
        self.membership = Membership(
            num_workers=num_workers, max_workers=max_workers, evict_after=evict_after
        )
        """Live members and their epoch; read and changed under ``cond``."""
        self.work: WorkQueue | None = None if work is None else WorkQueue(work)
        """The work units (None: this shard hands out none); read and changed under ``cond``."""
        self.wal: WriteAheadLog | None = None
        """The write-ahead log every change is appended to before it is applied (None: off;
        see :mod:`distsgd.ps.wal`)."""
        self.gate = Gate()
        """An unlocked rule's pushes hold it shared; a compaction or an export exclusive."""
        self.sequences = AppliedSequences()
        """Per worker, the highest push sequence applied (exactly once; see
        :mod:`distsgd.ps.sequence`)."""
        self.move_book = moves.MoveBook()
        """Its moves (open steps, frozen pieces, pieces gone; see :mod:`distsgd.ps.moves`).
        Changed under ``cond``."""

    @property
    def pushes_accepted(self) -> int:
        return self.counts.pushes_accepted

    @property
    def pushes_rejected(self) -> int:
        return self.counts.pushes_rejected

    @property
    def nonfinite_rejected(self) -> int:
        """Pushes refused for a NaN or Inf (counted among ``pushes_rejected`` too)."""
        return self.counts.nonfinite_rejected

    @property
    def restored_version(self) -> int:
        """The version the shard was restored at (0: registered afresh)."""
        return self.counts.restored_version

    def bump(self, steps: int = 1) -> int:
        """Advance the version and wake readers waiting for it."""
        with self.cond:
            self.version += steps
            self.cond.notify_all()
            return self.version

    def wait_for(self, min_version: int, timeout: float) -> bool:
        """Block until ``version >= min_version`` or :meth:`close`; False on timeout. A rule's
        deadline (:meth:`UpdateRule.deadline_at`) that passes meanwhile is acted on here, by
        the waiting pull, rather than at the ticker's next half second.

        After it returns, ``closing`` tells whether the shard was closed meanwhile.
        """
        end = time.monotonic() + max(0.0, timeout)
        with self.cond:
            while not (self.closing or self.version >= min_version):
                now = time.monotonic()
                if now >= end:
                    return False
                due = self.rule.deadline_at()
                if due is not None and now >= due:
                    self._rule_tick(now)  # a round's deadline passed: close it now
                    continue
                self.cond.wait(timeout=(end if due is None else min(end, due)) - now)
            return True

    def close(self) -> None:
        """Wake every reader waiting in :meth:`wait_for`; the server is stopping."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def snapshot(self, keys: Iterable[str] | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """A copy of the pieces (``keys``: those of them the shard holds) and the version they
        belong to (consistent under locked rules)."""
        with self.cond if self.rule.locked else nullcontext():
            return self.version, {k: v.copy() for k, v in self._some(keys).items()}

    def live(self, keys: Iterable[str] | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """The version and the pieces themselves (``keys``: those of them the shard holds), not
        copies (for an unlocked rule, whose readers see updates as they land anyway): read them
        at once, never write them."""
        return self.version, self._some(keys)

    def _some(self, keys: Iterable[str] | None) -> dict[str, np.ndarray]:
        """The pieces named in ``keys`` that the shard holds (all of them for None)."""
        if keys is None:
            return self.values
        return {k: self.values[k] for k in keys if k in self.values}

    def snapshot_into(self, out: Mapping[str, Callable[[np.ndarray], object]]) -> int:
        """Hand each piece to its writer in ``out`` (such as one into a shared-memory segment's
        pull area); returns their version (consistent under locked rules, as
        :meth:`snapshot`). A piece ``out`` has no place for (one that moved here since ``out``
        was laid out) is left out; the next request on ``out`` is refused."""
        with self.cond if self.rule.locked else nullcontext():
            version = self.version
            for key, value in self.values.items():
                if (write := out.get(key)) is not None:
                    write(value)
            return version

    def see(self, worker: int, incarnation: int) -> None:
        """Record the worker's incarnation (a restarted worker shows a new one); the call makes
        it a member (implicit membership, see :mod:`distsgd.ps.membership`)."""
        if worker >= 0:
            self.incarnations[worker] = incarnation
            with self.cond:
                self._work_seen(worker, incarnation)
                if self.membership.see(worker, incarnation):
                    self._membership_changed(f"worker {worker} seen")

    def join(
        self, worker: int, incarnation: int, *, claim: bool = False
    ) -> tuple[int, list[int]] | None:
        """Explicit membership: ``worker`` joins (again); returns (epoch, members). ``claim``:
        only as an index never used here (None, nothing changed, if it was). A joiner runs:
        one finished in a stopped run's shards (saved after it left) is finished no more."""
        with self.cond:
            if claim and not self.membership.claim(worker, incarnation):
                return None
            self.incarnations[worker] = incarnation
            self._work_seen(worker, incarnation)
            if self.membership.join(worker, incarnation) or claim or worker in self.finished:
                self.finished.discard(worker)
                self._membership_changed(f"worker {worker} joined")
            return self.membership.epoch, self.membership.live

    def heartbeat(self, worker: int, incarnation: int) -> tuple[int, list[int]] | None:
        """(epoch, members), or None when ``worker`` is not a member."""
        with self.cond:
            if not self.membership.heartbeat(worker, incarnation):
                return None
            return self.membership.epoch, self.membership.live

    def _work_seen(self, worker: int, incarnation: int) -> None:
        """Under ``cond``: a new incarnation of ``worker`` (a restart) gives its units back."""
        if self.work is not None:
            _log_back(self.index, worker, self.work.seen(worker, incarnation), "restarted")

    def _work_released(self, worker: int, why: str) -> None:
        """Under ``cond``: ``worker`` went away; its leased-but-not-done units go back."""
        if self.work is not None:
            _log_back(self.index, worker, self.work.release(worker), why)

    def lease_work(
        self, worker: int, incarnation: int, done: list[Unit], want: int
    ) -> tuple[list[Unit], list[Unit], WorkQueue]:
        """Count ``done`` and lease up to ``want`` units (see :meth:`WorkQueue.lease`); the
        call makes ``worker`` a member as any other does. Returns (held, ignored, queue)."""
        assert self.work is not None
        self.see(worker, incarnation)
        with self.cond:
            member = worker in self.membership.members
            result = self.work.lease(worker, incarnation, done=done, want=want, member=member)
            return result.units, result.ignored, self.work

    def _membership_changed(self, why: str, *, logged: bool = False) -> None:
        """Under ``cond``: log the new epoch and tell the rule (``logged``: the write-ahead log
        holds the change already, as a leave, which replays its own change)."""
        members = self.membership.live
        if self.wal is not None and not logged:
            self.wal.append_members(self)
        log.info(
            "shard %d: membership epoch %d (%s): %d members %s",
            self.index,
            self.membership.epoch,
            why,
            len(members),
            members,
        )
        self.rule.on_membership(self, members)

    def push(self, payload: dict[str, np.ndarray], meta: PushMeta) -> tuple[PushOutcome, int]:
        """Hand a validated payload to the rule; returns the outcome and the version after it.

        The caller has checked every key, dtype and shape against :attr:`values` (a key that
        moved away, see :attr:`move_book`, passes and is refused here, MOVED). A payload with NaN
        or Inf anywhere is refused (and counted) before the rule sees any of it.
        """
        started = time.perf_counter()
        try:
            return self._push(payload, meta)
        finally:
            self.load.pushed(sum(a.nbytes for a in payload.values()), started)

    def _push(self, payload: dict[str, np.ndarray], meta: PushMeta) -> tuple[PushOutcome, int]:
        self.see(meta.worker, meta.incarnation)
        for key, array in payload.items():
            if not all_finite(array):
                with self.cond:
                    self.counts.nonfinite_rejected += 1
                    self.counts.pushes_rejected += 1
                    refusal = PushOutcome.refused(PushReject.NONFINITE, f"NaN or Inf in {key}")
                    return refusal, self.version
        while True:  # a log that is down: not applied, waits (NotLogged past the wait)
            outcome = until_logged(lambda: self._push_unless_moving(payload, meta))
            if outcome is not None:
                return outcome, self.version
            moves.wait_unfrozen(self, payload)

    def _push_unless_moving(
        self, payload: dict[str, np.ndarray], meta: PushMeta
    ) -> PushOutcome | None:
        """The rule's outcome (or MOVED, counted); None if a piece of it is frozen (a move is
        under way): wait and try again."""
        wal = self.wal
        if self.rule.locked:
            with self.cond:
                if moves.blocked(self, payload):
                    return self._moved(payload)
                if self.sequences.duplicate(meta.worker, meta.sequence):
                    return DUPLICATE  # a resend of a push applied before: not again
                if wal is not None:
                    wal.append_push(self, payload, meta)
                outcome = self.rule.apply(self, payload, meta)
                if outcome.accepted:
                    self.sequences.record(meta.worker, meta.sequence)
                self._count(outcome, payload)
                return outcome
        with self.gate.shared():
            if moves.blocked(self, payload):
                return self._moved(payload)
            before = self.sequences.highest(meta.worker)
            if not self.sequences.claim(meta.worker, meta.sequence):
                return DUPLICATE  # an unlocked rule applies every push: claimed before it
            if wal is not None:  # a log that is down: the claim is taken back (not applied)
                undo = partial(self.sequences.unclaim, meta.worker, meta.sequence, before)
                wal.append_push(self, payload, meta, undo=undo)
            outcome = self.rule.apply(self, payload, meta)
            self._count(outcome, payload)
            return outcome

    def _moved(self, payload: Mapping[str, np.ndarray]) -> PushOutcome | None:
        """A push that meets a move: None while a piece of it is frozen, else MOVED."""
        with self.cond:
            if any(key in self.move_book.frozen for key in payload):
                return None
            self.counts.pushes_rejected += 1
            gone = sorted(key for key in payload if key in self.move_book.moved)
            return PushOutcome.refused(
                PushReject.MOVED, f"{len(gone)} piece(s) moved to another shard: {gone[:4]}"
            )

    def _count(self, outcome: PushOutcome, payload: Mapping[str, np.ndarray]) -> None:
        """Count a push the rule decided on, where it was applied (under ``cond`` or the gate,
        which a move's export holds exclusive: see :meth:`ShardLoad.reached`)."""
        nbytes = {k: a.nbytes for k, a in payload.items()}
        self.load.reached(nbytes, applied=outcome.accepted)
        with self.cond:  # re-entrant: the locked path holds it already
            if outcome.accepted:
                self.counts.pushes_accepted += 1
            else:
                self.counts.pushes_rejected += 1

    def leave(self, worker: int) -> int:
        """Mark a worker finished and let the rule react (a sync step may now close)."""
        with self.cond:
            if self.wal is not None:
                self.wal.append_leave(self, worker)
            if worker >= 0 and worker not in self.finished:
                self.finished.add(worker)
                self.rule.on_leave(self, worker)
            self._work_released(worker, "left")
            if self.membership.leave(worker):
                self._membership_changed(f"worker {worker} left", logged=True)
            return self.version

    @property
    def active_workers(self) -> int:
        """Registered workers (indexes below ``num_workers``) that have not left; a worker of
        a larger index (an elastic run's newcomer) that left does not count."""
        return self.num_workers - sum(1 for w in self.finished if w < self.num_workers)

    def tick(self) -> None:
        """Let the rule act on time (a synchronous step waiting for a dead worker)."""
        with self.cond:
            evicted = self.membership.evict()
            if evicted:
                log.warning(
                    "shard %d: evicted worker(s) %s, silent for over %gs",
                    self.index,
                    evicted,
                    self.membership.evict_after,
                )
                for worker in evicted:
                    self._work_released(worker, "was evicted")
                self._membership_changed(f"evicted {evicted}")
            now = time.monotonic()
            moves.expire(self, now)
            self._rule_tick(now)

    def _rule_tick(self, now: float) -> None:
        """The rule's :meth:`~UpdateRule.tick`, under the lock, logged to the WAL if it changed
        the parameters."""
        before = self.version
        self.rule.tick(self, now)
        if self.wal is not None and self.version != before:
            self.wal.append_tick(self, before)  # its effect: replayed, not re-decided

    # -- checkpoints ----------------------------------------------------------------------------
    def to_bytes(self) -> tuple[int, bytes]:
        """(version, an ``.npz`` of the whole shard), taken under the lock: a consistent state."""
        version, arrays, header = self.state_copy()
        return version, self.pack(arrays, header)

    def state_copy(self, copy: bool = True) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
        """(version, arrays, header) for :meth:`pack`: copies taken under the lock (``copy``
        False: the live arrays, for a caller that holds every push off while it writes them)."""
        with self.cond:
            rule_state = self.rule.state_dict()
            arrays = {f"values/{k}": np.array(v, copy=copy) for k, v in self.values.items()}
            arrays.update(
                {
                    f"rule/{k}": np.array(v, copy=copy)
                    for k, v in rule_state.items()
                    if isinstance(v, np.ndarray)
                }
            )
            header = _state_header(self, rule_state)
            return self.version, arrays, header

    pack = staticmethod(pack_state)
    """The ``.npz`` of a :meth:`state_copy` (outside the lock)."""
    pack_into = staticmethod(pack_state_into)
    """:meth:`pack` into a file (how a server writes snapshots: never twice whole)."""

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        rule_factory: RuleFactory,
        *,
        name: str = "checkpoint",
        max_workers: int = 0,
        evict_after: float = DEFAULT_EVICT_AFTER,
    ) -> Shard:
        """Rebuild a shard written by :meth:`to_bytes`; :class:`CorruptCheckpoint` if unreadable."""
        try:
            header, arrays = unpack_state(data, name)
            shard = _rebuild(cls, header, arrays, rule_factory, max_workers, evict_after)
        except CorruptCheckpoint:
            raise
        except Exception as exc:  # zip, json, key, rule state errors: the file is damaged
            raise CorruptCheckpoint(
                f"{name}: not a readable shard checkpoint ({first_line(exc)})"
            ) from None
        return shard


# -- the shard file, read without rebuilding a shard ---------------------------------------------
def _kept(value: np.ndarray, own: bool) -> np.ndarray:
    """``value`` as the shard keeps it: itself when ``own`` and writable and contiguous."""
    keep = own and value.flags.writeable and value.flags.c_contiguous
    return value if keep else np.array(value, copy=True)


def _state_header(shard: Shard, rule_state: Mapping[str, Any]) -> dict[str, Any]:
    """Under ``cond``: the shard file's JSON header of ``shard`` (its rule's state given)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "index": shard.index,
        "scheme": shard.scheme,
        "options_json": shard.options_json,
        "num_workers": shard.num_workers,
        "run_id": shard.run_id,
        "version": shard.version,
        "finished": sorted(shard.finished),
        **shard.counts.header(),
        "rule": {k: v for k, v in rule_state.items() if not isinstance(v, np.ndarray)},
        "keys": list(shard.values),
        "specs": {k: snapshot_check.spec_of(v) for k, v in shard.values.items()},
        "moved": dict(shard.move_book.moved),
        "applied_sequences": shard.sequences.state(),
        **({} if shard.work is None else {"work": shard.work.state_dict()}),
    }


def _rebuild(
    cls: type[Shard],
    header: dict[str, Any],
    arrays: dict[str, np.ndarray],
    rule_factory: RuleFactory,
    max_workers: int,
    evict_after: float,
) -> Shard:
    """The shard of a shard file's checked header and arrays (:meth:`Shard.from_bytes`)."""
    values = {k: arrays[f"values/{k}"] for k in header["keys"]}
    rule = rule_factory(
        header["scheme"], parse_options_json(header["options_json"]), header["num_workers"]
    )
    work = WorkQueue.from_state(header["work"]) if "work" in header else None
    rule_state: dict[str, Any] = dict(header["rule"])
    rule_state.update({k[5:]: v for k, v in arrays.items() if k.startswith("rule/")})
    rule.load_state_dict(rule_state)
    shard = cls(
        index=header["index"],
        scheme=header["scheme"],
        options_json=header["options_json"],
        num_workers=header["num_workers"],
        values=values,
        rule=rule,
        run_id=header["run_id"],
        max_workers=max_workers,
        evict_after=evict_after,
        own=True,  # np.load made them
    )
    shard.version = int(header["version"])
    shard.counts = ShardCounts.from_header(header)
    shard.finished = set(header["finished"])
    shard.work = work
    shard.move_book.moved = {str(k): int(v) for k, v in header.get("moved", {}).items()}
    shard.sequences = AppliedSequences.from_state(header.get("applied_sequences"))
    return shard


def _log_back(index: int, worker: int, units: list[Unit], why: str) -> None:
    """Log the work units a worker gave back (restarted, left, evicted)."""
    if units:
        log.info(
            "shard %d: worker %d %s; %d work unit(s) back in the queue: %s",
            index,
            worker,
            why,
            len(units),
            units[:8],
        )


def read_shard_file(
    path: Path,
    rule_factory: RuleFactory,
    *,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
) -> Shard:
    """:meth:`Shard.from_bytes` of the shard file at ``path`` (named by it in errors); OSError
    if it cannot be read."""
    data = path.read_bytes()
    return Shard.from_bytes(
        data, rule_factory, name=str(path), max_workers=max_workers, evict_after=evict_after
    )
