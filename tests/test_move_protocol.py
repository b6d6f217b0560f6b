"""The move protocol against a holder of the run secret or a second re-balancer, on real
in-process servers: each move has an id and a version, a step out of order is refused with a
typed reason and changes nothing, and no piece or applied update is lost."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from test_moves import _client, _model, move, two_servers  # noqa: F401 (a fixture)

from distsgd.ps import moves
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import Refusal, RemoteError

KEY = "small1#0"  # round-robin: on ps0


def _refused(call: object, refusal: Refusal) -> RemoteError:
    assert callable(call)
    with pytest.raises(RemoteError) as refused:
        call()
    assert refused.value.refusal is refusal, refused.value
    return refused.value


def _commit(src: ShardClient, move_id: str, version: int, receipt: bytes) -> Callable[[], object]:
    return partial(
        src.finish_move, [KEY], 1, commit=True, move_id=move_id, version=version, receipt=receipt
    )


def _undo(shard: ShardClient, peer: int, move_id: str) -> Callable[[], object]:
    return partial(shard.finish_move, [KEY], peer, commit=False, move_id=move_id)


def _holds(address: str) -> set[str]:
    with ShardClient(address) as shard:
        return {t.key for t in shard.info().tensors}


def _value(addresses: list[str], key: str) -> float:
    for address in addresses:
        with ShardClient(address) as shard:
            if key in {t.key for t in shard.info().tensors}:
                return float(shard.pull(min_version=0, keys=[key])[1][key][0])
    raise AssertionError(f"no server holds {key}")


def test_an_undo_after_the_commit_deletes_nothing(two_servers: list[str]) -> None:  # noqa: F811
    """The undo that deleted the piece from every server: after a commit neither side has an
    open step of that move, so an undo on either is refused NO_SUCH_MOVE."""
    client = _client(two_servers, 0)
    with ShardClient(two_servers[0]) as src, ShardClient(two_servers[1]) as dst:
        header, arrays = src.export_pieces([KEY], 1)
        receipt = dst.import_pieces(0, header, arrays).receipt
        _commit(src, header.move_id, header.version, receipt)()
        dst.finish_move([KEY], 0, commit=True, move_id=header.move_id)  # confirmed on B
        _refused(_undo(dst, 0, header.move_id), Refusal.NO_SUCH_MOVE)
        _refused(_undo(src, 1, header.move_id), Refusal.NO_SUCH_MOVE)
        other = moves.new_move_id()  # a second re-balancer's, or a guessed, id
        _refused(_undo(dst, 0, other), Refusal.NO_SUCH_MOVE)
    assert KEY in _holds(two_servers[1]) and KEY not in _holds(two_servers[0])
    assert all(r.accepted for r in client.push({k: np.ones_like(v) for k, v in _model().items()}))
    assert _value(two_servers, KEY) == -1.0  # lr 1, one update: the piece lives on ps1
    client.close()


def test_a_stale_copy_is_never_committed(
    two_servers: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lost updates: re-balancer 1 exports and imports, its freeze ends, ps0 applies 5
    updates, re-balancer 2 exports again. Neither re-balancer 1's late commit nor a commit of
    move 2 with the stale copy's receipt is taken: the 5 updates stay."""
    monkeypatch.setattr(moves, "FREEZE_SECONDS", 0.3)
    client = _client(two_servers, 0)
    grads = {k: np.ones_like(v) for k, v in _model().items()}
    with ShardClient(two_servers[0]) as src, ShardClient(two_servers[1]) as dst:
        first, arrays = src.export_pieces([KEY], 1)
        stale = dst.import_pieces(0, first, arrays).receipt
        for _ in range(5):  # the first waits for the freeze to end; then all apply on ps0
            assert all(r.accepted for r in client.push(grads))
        monkeypatch.setattr(moves, "FREEZE_SECONDS", 60.0)
        second, _ = src.export_pieces([KEY], 1)
        assert second.version == first.version + 5 and second.move_id != first.move_id
        _refused(_commit(src, first.move_id, first.version, stale), Refusal.NO_SUCH_MOVE)
        _refused(_commit(src, second.move_id, second.version, stale), Refusal.MOVE_MISMATCH)
        _refused(_commit(src, second.move_id, first.version, stale), Refusal.MOVE_MISMATCH)
        _undo(src, 1, second.move_id)()
        _undo(dst, 0, first.move_id)()  # the stale copy goes
    assert KEY in _holds(two_servers[0]) and KEY not in _holds(two_servers[1])
    assert _value(two_servers, KEY) == -5.0  # every update applied is there
    client.close()


def test_an_import_no_export_announced_changes_no_piece(two_servers: list[str]) -> None:  # noqa: F811
    """An import of pieces the destination holds (its own, or another move's copy), with no
    or another move's id, or of a wrong dtype, is refused; nothing it sent is ever committed."""
    client = _client(two_servers, 0)
    own = "small0#0"  # ps1's
    with ShardClient(two_servers[0]) as src, ShardClient(two_servers[1]) as dst:
        header, arrays = src.export_pieces([KEY], 1)
        forged = type(header)()
        forged.CopyFrom(header)
        evil = {own: np.full((3, 3), 7.0, np.float32)}
        forged.move_id = moves.new_move_id()
        del forged.tensors[:]
        forged.tensors.add(key=own, dtype="float32", shape=[3, 3])
        _refused(partial(dst.import_pieces, 0, forged, evil), Refusal.MOVE_MISMATCH)
        forged.move_id = ""
        with pytest.raises(RemoteError, match="32 hex digits"):
            dst.import_pieces(0, forged, evil)
        ints = type(header)()
        ints.CopyFrom(header)
        del ints.tensors[:]
        ints.tensors.add(key=KEY, dtype="int32", shape=[250])
        with pytest.raises(RemoteError, match="not a parameter dtype"):
            dst.import_pieces(0, ints, {KEY: np.zeros(250, np.int32)})
        # a copy of another shape under a forged id: taken, never committed
        odd = type(header)()
        odd.CopyFrom(header)
        odd.move_id = moves.new_move_id()
        del odd.tensors[:]
        odd.tensors.add(key=KEY, dtype="float32", shape=[5])
        junk = dst.import_pieces(0, odd, {KEY: np.zeros(5, np.float32)}).receipt
        real = partial(dst.import_pieces, 0, header, arrays)
        _refused(real, Refusal.MOVE_MISMATCH)  # B holds the junk: the real copy is not mixed in
        _refused(_commit(src, header.move_id, header.version, junk), Refusal.MOVE_MISMATCH)
        _undo(src, 1, header.move_id)()
    assert _value(two_servers, own) == 0.0 and _value(two_servers, KEY) == 0.0
    assert all(r.accepted for r in client.push({k: np.ones_like(v) for k, v in _model().items()}))
    assert _value(two_servers, KEY) == -1.0
    client.close()


def test_a_whole_move_still_works_after_refused_steps(two_servers: list[str]) -> None:  # noqa: F811
    client = _client(two_servers, 0)
    move(two_servers, [KEY], 0, 1)
    move(two_servers, [KEY], 1, 0)  # and back
    assert KEY in _holds(two_servers[0]) and KEY not in _holds(two_servers[1])
    assert all(r.accepted for r in client.push({k: np.ones_like(v) for k, v in _model().items()}))
    client.close()
