"""``--rebalance auto``: the launcher reads each server's per-piece load from its Info polls,
asks :func:`distsgd_rebalance.policy.decide` whether a move evens it, and carries the move out
(export, import, commit, confirm: :mod:`distsgd.ps.moves`, each step naming the move's id) on
a thread of its own, so the launcher's loop never waits on it. Each move, made or failed, is a
``rebalance`` event in metrics.jsonl with the loads before and after (after: as predicted from
the same rates), the pieces, their bytes, the version they moved at and the pause (seconds
between export and commit, the longest any push of those pieces waited)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from distsgd.transport.client import ShardClient
from distsgd.transport.codec import nbytes_of
from distsgd.transport.errors import Refusal, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.security import TlsConfig
from distsgd_rebalance.policy import Decision, Move, decide, piece_rates, summary

log = logging.getLogger(__name__)

WINDOW_SECONDS = 3.0
"""Seconds of load a decision reads (rates over at least this long)."""
SETTLE_SECONDS = 1.0
"""Seconds after a move before the next window starts (the workers follow the move)."""
MOVE_TIMEOUT = 30.0
"""Seconds each call of a move may take."""


class Rebalancer:
    """Turns successive per-piece counters into moves (see the module docstring)."""

    def __init__(
        self,
        *,
        num_ps: int,
        address_of: Callable[[int], str],
        run_id: str,
        secret: str | None,
        tls: TlsConfig | None,
        event: Callable[..., None],
        note: Callable[[str], None],
        window: float = WINDOW_SECONDS,
    ) -> None:
        self.num_ps = num_ps
        self.address_of = address_of
        self.run_id = run_id
        self.secret = secret
        self.tls = tls
        self.event = event
        self.note = note
        self.window = window
        self.moves = 0
        self.failed = 0
        self._readings: dict[int, pb.InfoResponse] = {}
        self._start: tuple[float, dict[str, int]] | None = None
        self._not_before = 0.0
        self._thread: threading.Thread | None = None
        self._last_why = ""

    def see(self, index: int, reply: pb.InfoResponse) -> None:
        """ps ``index`` answered ``reply`` (a registered shard's Info)."""
        if reply.HasField("load"):
            self._readings[index] = reply

    def poll(self, now: float, step: int) -> None:
        """After a round of Info polls: start a window, or decide at its end."""
        busy = self._thread is not None and self._thread.is_alive()
        if busy or now < self._not_before or len(self._readings) < self.num_ps:
            return
        counters, owner = self._counters()
        if self._start is None:
            self._start = (now, counters)
            return
        began, before = self._start
        if now - began < self.window:
            return
        self._start = (now, counters)
        rates = piece_rates(before, counters, now - began)
        decision = decide(rates, owner, self.num_ps)
        if decision.move is None:
            self._quiet(decision)
            return
        sizes = {t.key: nbytes_of(t) for i in self._readings for t in self._readings[i].tensors}
        self.note(
            "[distsgd] rebalance: " + summary(decision.move, [sizes[k] for k in decision.move.keys])
        )
        self._thread = threading.Thread(
            target=self._execute, args=(decision.move, step, sizes), name="rebalance", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float = MOVE_TIMEOUT * 3) -> None:
        """Wait for a move in flight (the run is ending)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def result(self, read_info: Callable[[int], pb.InfoResponse | None]) -> dict[str, Any]:
        """The run's end (``result.json``'s ``rebalance``): the moves made and each piece's
        updates over the run, summed over the servers (``read_info(I)``: ps I's Info, None
        where it does not answer; a moved piece's count moves with it): equal for every piece
        when no update was lost."""
        self.join()
        applies: dict[str, int] = {}
        for index in range(self.num_ps):
            reply = read_info(index)
            if reply is None:
                continue
            held = {t.key for t in reply.tensors}
            for piece in reply.load.pieces:
                if piece.key in held:
                    applies[piece.key] = applies.get(piece.key, 0) + piece.applies
        counts = list(applies.values()) or [0]
        return {
            "moves": self.moves,
            "failed": self.failed,
            "applies_min": min(counts),
            "applies_max": max(counts),
        }

    def _quiet(self, decision: Decision) -> None:
        if decision.why != self._last_why:
            log.info("rebalance: nothing to move (%s)", decision.why)
            self._last_why = decision.why

    def _counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per piece: bytes pushed and pulled so far, and the shard that holds it."""
        counters: dict[str, int] = {}
        owner: dict[str, int] = {}
        for index, reply in self._readings.items():
            held = {t.key for t in reply.tensors}
            for piece in reply.load.pieces:
                if piece.key in held:
                    counters[piece.key] = piece.push_bytes + piece.pull_bytes
                    owner[piece.key] = index
        return counters, owner

    def _client(self, index: int) -> ShardClient:
        return ShardClient(
            self.address_of(index),
            run_id=self.run_id,
            timeout=MOVE_TIMEOUT,
            retry_seconds=0.0,
            secret=self.secret,
            tls=self.tls,
        )

    def _execute(self, move: Move, step: int, sizes: dict[str, int]) -> None:
        """Export, import, commit; undone where a step fails."""
        keys = list(move.keys)
        began = time.monotonic()
        record: dict[str, Any] = {
            "source": move.source,
            "dest": move.dest,
            "pieces": len(keys),
            "keys": keys[:16],
            "bytes": sum(sizes.get(k, 0) for k in keys),
            "before_mb_per_s": [round(x / 1e6, 3) for x in move.before],
            "after_mb_per_s": [round(x / 1e6, 3) for x in move.after],
        }
        with self._client(move.source) as src, self._client(move.dest) as dst:
            try:
                header, arrays = src.export_pieces(keys, move.dest)
            except RemoteError as exc:
                return self._failed(record, step, "export", exc)
            record["version"] = header.version
            move_id = header.move_id
            try:
                receipt = dst.import_pieces(move.source, header, arrays).receipt
            except RemoteError as exc:
                _finish(src, keys, move.dest, move_id, commit=False)
                _finish(dst, keys, move.source, move_id, commit=False)  # if it took them
                return self._failed(record, step, "import", exc)
            try:
                src.finish_move(
                    keys,
                    move.dest,
                    commit=True,
                    move_id=move_id,
                    version=header.version,
                    receipt=receipt,
                )
            except RemoteError as exc:
                committed = _committed(src, keys, move.dest)  # the answer may have been lost
                if committed is not True:
                    if committed is False:  # not moved: the copy there goes (else it stays,
                        _finish(src, keys, move.dest, move_id, commit=False)  # unused)
                        _finish(dst, keys, move.source, move_id, commit=False)
                    return self._failed(record, step, "commit", exc)
            _finish(dst, keys, move.source, move_id, commit=True)  # B's now: no undo ends it
        record["pause_s"] = round(time.monotonic() - began, 4)
        self.moves += 1
        self._not_before = time.monotonic() + SETTLE_SECONDS
        self._start = None
        self.event(step=step, event="rebalance", ok=True, **record)
        log.info(
            "rebalance: moved %d piece(s) ps%d -> ps%d in %.3fs",
            len(keys),
            move.source,
            move.dest,
            record["pause_s"],
        )

    def _failed(self, record: dict[str, Any], step: int, stage: str, exc: RemoteError) -> None:
        self.failed += 1
        self._not_before = time.monotonic() + SETTLE_SECONDS
        self._start = None
        self.event(
            step=step, event="rebalance", ok=False, stage=stage, error=str(exc)[:300], **record
        )
        self.note(f"[distsgd] rebalance: the move failed at its {stage} ({exc}); nothing moved")


def _committed(src: ShardClient, keys: list[str], dest: int) -> bool | None:
    """Whether the source lists every piece as moved to ``dest`` (a commit whose answer was
    lost); None when it cannot tell."""
    try:
        moved = {owner.key: owner.shard for owner in src.info(retry=False).moved}
    except RemoteError:
        return None
    return all(moved.get(k) == dest for k in keys)


def _finish(client: ShardClient, keys: list[str], peer: int, move_id: str, *, commit: bool) -> None:
    """Undo one side of a move, or confirm it on the destination (best effort: a freeze also
    ends by itself; a step that is not open there is refused and changes nothing)."""
    try:
        client.finish_move(keys, peer, commit=commit, move_id=move_id)
    except RemoteError as exc:
        if exc.refusal is not Refusal.NO_SUCH_MOVE:
            what = "confirm" if commit else "undo"
            log.warning("rebalance: could not %s a step of move %s: %s", what, move_id[:8], exc)
