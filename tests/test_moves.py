"""Moving pieces between shards (``--rebalance``): the three steps on real in-process servers,
pushes that meet a move, clients that follow it, and the count of updates (none lost)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from distsgd.ps import moves, start_server, stop_server
from distsgd.ps.client import ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.schemes import make_server_rule
from distsgd.transport.carriers.attached import AttachedCarrier
from distsgd.transport.carriers.base import CarrierFailed
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import PushReject, Refusal, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd_rebalance import Rebalancer


def _model() -> dict[str, np.ndarray]:
    arrays = {"big": np.zeros(1000, np.float32)}
    arrays.update({f"small{i}": np.zeros(250, np.float32) for i in range(8)})
    return arrays


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[list[str]]:
    started = [
        start_server(
            address="127.0.0.1:0",
            shard_index=i,
            rule_factory=make_server_rule,
            wal_dir=tmp_path / f"wal{i}",
        )
        for i in range(2)
    ]
    try:
        yield [address for _, address, _ in started]
    finally:
        for srv, _, service in started:
            stop_server(srv, service, grace=0.1)


def _client(
    addresses: list[str], worker: int, scheme: str = "hogwild", carrier: str = "stream"
) -> ParameterClient:
    plan = PartitionPlan.from_arrays(_model(), 2, placement="round-robin")
    client = ParameterClient(
        addresses,
        plan,
        worker=worker,
        timeout=10,
        shared_memory=carrier == "shared_memory",
        tensor_socket=carrier == "tensor_socket",
    )
    if worker == 0:
        options = {"lr": 1.0, **({"required": 2} if scheme == "sync" else {})}
        client.register(_model(), scheme=scheme, options=options, num_workers=2)
    client.wait_registered(10)
    return client


def move(addresses: list[str], keys: list[str], a: int, b: int) -> None:
    """What the launcher does: export from ``a``, import into ``b``, commit on ``a``."""
    with ShardClient(addresses[a]) as src, ShardClient(addresses[b]) as dst:
        header, arrays = src.export_pieces(keys, b)
        receipt = dst.import_pieces(a, header, arrays).receipt
        src.finish_move(
            keys, b, commit=True, move_id=header.move_id, version=header.version, receipt=receipt
        )
        dst.finish_move(keys, a, commit=True, move_id=header.move_id)


def _applies(addresses: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for address in addresses:
        with ShardClient(address) as shard:
            for piece in shard.info().load.pieces:
                out[piece.key] = out.get(piece.key, 0) + piece.applies
    return out


def test_round_robin_places_whole_parameters_in_turn() -> None:
    plan = PartitionPlan.from_arrays(_model(), 2, placement="round-robin")
    assert [p.shard for p in plan.pieces] == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert plan.shard_bytes == [4000 + 4 * 1000, 4 * 1000]
    moved = plan.with_owners({"small0#0": 0})
    assert moved.shard_bytes == [4000 + 5 * 1000, 3 * 1000]
    assert plan.shard_bytes == [4000 + 4 * 1000, 4 * 1000]  # the original is untouched
    with pytest.raises(ValueError, match="no piece"):
        plan.with_owners({"nope#0": 1})
    with pytest.raises(ValueError, match="placement"):
        PartitionPlan.from_arrays(_model(), 2, placement="random")


def test_follow_walks_each_piece_to_where_it_is_now() -> None:
    start = {"a": 0, "b": 0, "c": 1}
    assert moves.follow(start, [{"a": 1}, {}]) == {"a": 1}
    assert moves.follow(start, [{"a": 1}, {"a": 2}, {}]) == {"a": 2}
    assert moves.follow(start, [{"a": 1}, {"a": 0}]) == {"a": 1}  # a cycle: stops before it
    assert moves.follow(start, [{}, {"c": 0}]) == {"c": 0}


def test_a_moved_piece_keeps_its_value_and_the_clients_follow_it(two_servers: list[str]) -> None:
    chief, other = _client(two_servers, 0), _client(two_servers, 1)
    grads = {k: np.ones_like(v) for k, v in _model().items()}
    chief.pull()
    assert all(r.accepted for r in chief.push(grads))
    move(two_servers, ["small1#0", "small3#0"], 0, 1)
    # The chief's plan is stale: its push is refused MOVED by ps0, and sent on to ps1.
    results = chief.push(grads)
    assert all(r.accepted for r in results), results
    assert chief.plan.shard_bytes == [4000 + 2 * 1000, 6 * 1000]
    assert chief.moves_followed == 1
    # The other worker learns it at its pull (ps0's answer lacks the pieces).
    _, values = other.pull()
    assert other.plan.shard_bytes == chief.plan.shard_bytes
    for key, value in values.items():
        np.testing.assert_allclose(value, -2.0, err_msg=key)  # two pushes of lr 1.0 x 1
    applied = _applies(two_servers)
    assert applied == {piece.key: 2 for piece in chief.plan.pieces}
    # A worker that starts now (a restart) finds the pieces where they are.
    late = _client(two_servers, 1)
    assert late.plan.shard_bytes == chief.plan.shard_bytes
    for c in (chief, other, late):
        c.close()


def test_a_numbered_push_sent_on_after_a_move_is_applied_not_dropped(
    two_servers: list[str],
) -> None:
    """A push with a sequence (a worker's step) that ps0 refuses MOVED goes on to ps1, which
    applied its own part of the same push already: the pieces sent on travel under a sequence
    of their own, or ps1 would drop them as a duplicate (2998 of 3000 in a real run)."""
    chief = _client(two_servers, 0)
    grads = {k: np.ones_like(v) for k, v in _model().items()}
    chief.pull()
    assert all(r.accepted for r in chief.push(grads, step=1))
    move(two_servers, ["small1#0", "small3#0"], 0, 1)
    assert all(r.accepted for r in chief.push(grads, step=2))  # ps0 refuses MOVED, ps1 takes
    assert all(r.accepted for r in chief.push(grads, step=3))
    assert _applies(two_servers) == {piece.key: 3 for piece in chief.plan.pieces}
    chief.close()


@pytest.mark.parametrize("carrier", ["stream", "shared_memory", "tensor_socket"])
def test_pushes_during_moves_lose_no_update(two_servers: list[str], carrier: str) -> None:
    """Two workers push as fast as they can while pieces move back and forth; every push of
    every piece is applied exactly once (the counters move with the pieces), on every
    carrier: a move retires the workers' segments and data channels without cutting a
    request short, and the workers attach again."""
    clients = [_client(two_servers, w, carrier=carrier) for w in range(2)]
    grads = {k: np.full_like(v, 0.001) for k, v in _model().items()}
    stop = threading.Event()
    pushed = [0, 0]

    def work(w: int) -> None:
        while not stop.is_set():
            clients[w].pull()
            results = clients[w].push(grads)
            assert all(r.accepted for r in results), results
            pushed[w] += 1

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    try:
        keys = ["small1#0", "small3#0", "small5#0"]
        for hop in range(20):
            a, b = (0, 1) if hop % 2 == 0 else (1, 0)
            move(two_servers, keys, a, b)
            time.sleep(0.02)  # pushes go on between moves, as under the launcher's pace
    finally:
        stop.set()
        for t in threads:
            t.join(10)

    def used() -> int:
        return {
            "stream": 2,
            "shared_memory": clients[0].shared_memory_shards,
            "tensor_socket": clients[0].tensor_socket_shards,
        }[carrier]

    deadline = time.monotonic() + 10.0  # a loaded machine re-attaches a few exchanges later
    for w, client in enumerate(clients):  # after the last move's retire: attached again
        rounds = 0
        while rounds < 2 or (w == 0 and used() < 2 and time.monotonic() < deadline):
            client.pull()
            assert all(r.accepted for r in client.push(grads))
            pushed[w] += 1
            rounds += 1
    total = sum(pushed)
    assert total > 0
    assert set(_applies(two_servers).values()) == {total}
    assert used() == 2, f"the pushes did not travel by {carrier}"
    _, values = clients[0].pull()
    for key, value in values.items():
        np.testing.assert_allclose(value, -0.001 * total, rtol=1e-4, err_msg=key)
    for c in clients:
        c.close()


class _RefusingStub:
    """A server whose shared-memory calls are refused for ``refusal``."""

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RemoteError(
            "127.0.0.1:1", "call", grpc.StatusCode.INVALID_ARGUMENT, "no", self.refusal
        )

    PullShared = PushShared = _refuse


class _Attached(AttachedCarrier):
    """The requests of an attached carrier (pull, and push's send), nothing of its own."""

    def carries(self, payload: Any) -> bool:
        return True

    def push(self, header: pb.PushHeader, payload: Any) -> pb.PushResponse:
        return self.send_push(header)


@pytest.mark.parametrize("refusal", [Refusal.NO_SEGMENT, Refusal.CLOSING])
def test_a_retired_segment_is_attached_again_without_counting_a_failure(refusal: Refusal) -> None:
    """A move retires the workers' segments (refused NO_SEGMENT): that failure does not count
    toward giving shared memory up (3 in a row once did under load, and a worker sent by the
    stream for the rest of its run); any other refusal counts."""
    link = SimpleNamespace(stub=_RefusingStub(refusal), timeout=1.0, metadata=(), address="a:1")
    carrier = _Attached(link, 7, {}, {}, None)  # type: ignore[arg-type]
    counts = refusal is not Refusal.NO_SEGMENT
    with pytest.raises(CarrierFailed) as pulled:
        carrier.pull(pb.PullRequest(), 0.0)
    assert pulled.value.counted is counts and pulled.value.error is None
    with pytest.raises(CarrierFailed) as pushed:
        carrier.send_push(pb.PushHeader())
    assert pushed.value.counted is counts
    assert (pushed.value.error is None) is (refusal is Refusal.NO_SEGMENT)  # sent again if so


def test_a_move_not_committed_in_time_is_undone(two_servers: list[str]) -> None:
    client = _client(two_servers, 0)
    with ShardClient(two_servers[0]) as src:
        header, _ = src.export_pieces(["small1#0"], 1)
        with pytest.raises(RemoteError) as frozen:
            src.export_pieces(["small1#0"], 1)
        assert frozen.value.refusal is Refusal.NOT_FROZEN
        src.finish_move(["small1#0"], 1, commit=False, move_id=header.move_id)  # it stays
        assert all(
            r.accepted for r in client.push({k: np.ones_like(v) for k, v in _model().items()})
        )
        with pytest.raises(RemoteError) as late:
            src.finish_move(["small1#0"], 1, commit=True, move_id=header.move_id)
        assert late.value.refusal is Refusal.NO_SUCH_MOVE
    client.close()


def test_a_synchronous_rule_refuses_to_move_its_pieces(two_servers: list[str]) -> None:
    client = _client(two_servers, 0, scheme="sync")
    with ShardClient(two_servers[0]) as src, pytest.raises(RemoteError) as refused:
        src.export_pieces(["small1#0"], 1)
    assert refused.value.refusal is Refusal.NOT_MOVABLE
    client.close()


def test_only_the_launcher_moves_pieces(two_servers: list[str]) -> None:
    client = _client(two_servers, 0)
    with ShardClient(two_servers[0], worker=0) as worker, pytest.raises(RemoteError) as refused:
        worker.export_pieces(["small1#0"], 1)
    assert "launcher" in str(refused.value)
    with ShardClient(two_servers[0]) as src, pytest.raises(RemoteError):
        src.export_pieces(["small1#0"], 0)  # to itself
    client.close()


def test_a_restarted_shard_comes_back_with_what_it_held_after_the_move(
    tmp_path: Path, two_servers: list[str]
) -> None:
    client = _client(two_servers, 0)
    move(two_servers, ["small1#0"], 0, 1)
    assert client.push({k: np.ones_like(v) for k, v in _model().items()})[0].accepted
    from distsgd.ps import wal

    for i, holds in ((0, False), (1, True)):
        recovery = wal.recover(tmp_path / f"wal{i}", make_server_rule)
        assert recovery is not None
        recovered = recovery.shard
        assert ("small1#0" in recovered.values) is holds
        if not holds:
            assert recovered.move_book.moved == {"small1#0": 1}
    client.close()


def test_moved_reject_is_typed() -> None:
    assert PushReject.MOVED.wire_name == "PUSH_REJECT_REASON_MOVED"


def test_the_launchers_mover_evens_the_load_and_loses_nothing(
    two_servers: list[str],
) -> None:
    """Two readings of real servers' counters, with pushes between them: the mover moves
    ps0's small pieces to ps1, logs the event, and every piece keeps its count of updates."""
    client = _client(two_servers, 0)
    grads = {k: np.full_like(v, 0.01) for k, v in _model().items()}
    events: list[dict[str, Any]] = []
    notes: list[str] = []
    mover = Rebalancer(
        num_ps=2,
        address_of=lambda i: two_servers[i],
        run_id="",
        secret=None,
        tls=None,
        event=lambda **fields: events.append(fields),
        note=notes.append,
        window=0.0,
    )

    def read() -> None:
        for i, address in enumerate(two_servers):
            with ShardClient(address) as shard:
                mover.see(i, shard.info())

    read()
    mover.poll(0.0, step=0)  # the window starts
    for _ in range(5):
        client.pull()
        client.push(grads)
    read()
    mover.poll(1.0, step=5)
    mover.join()
    assert mover.moves == 1, (notes, events)
    (event,) = events
    assert event["event"] == "rebalance" and event["ok"] and event["source"] == 0
    assert event["pause_s"] < 5
    plan = PartitionPlan.from_arrays(_model(), 2, placement="round-robin")
    assert event["before_mb_per_s"][0] == pytest.approx(2 * event["before_mb_per_s"][1], rel=0.2)
    for _ in range(3):
        client.pull()
        assert all(r.accepted for r in client.push(grads))
    assert set(_applies(two_servers).values()) == {8}
    assert client.plan.shard_bytes != plan.shard_bytes
    client.close()


def test_an_undone_import_drops_only_the_copy_it_took(two_servers: list[str]) -> None:
    """The launcher undoes a move whose commit failed by dropping the copy on the
    destination; a destination never drops a piece it did not take from that shard."""
    client = _client(two_servers, 0)
    with ShardClient(two_servers[0]) as src, ShardClient(two_servers[1]) as dst:
        header, arrays = src.export_pieces(["small1#0"], 1)
        with pytest.raises(RemoteError) as refused:  # ps1's own piece: kept
            dst.finish_move(["small0#0"], 0, commit=False, move_id=header.move_id)
        assert refused.value.refusal is Refusal.NO_SUCH_MOVE
        dst.import_pieces(0, header, arrays)
        undone = dst.finish_move(["small1#0"], 0, commit=False, move_id=header.move_id)
        assert undone.pieces == 1  # the copy goes
        src.finish_move(["small1#0"], 1, commit=False, move_id=header.move_id)  # it stays
        held = {t.key for t in dst.info().tensors}
    assert "small0#0" in held and "small1#0" not in held
    assert all(r.accepted for r in client.push({k: np.ones_like(v) for k, v in _model().items()}))
    client.close()


def test_an_export_copies_the_count_of_every_update_in_its_copy() -> None:
    """A piece's counters travel with its values: each export, taken while two threads push,
    copies exactly as many applies as updates its copy holds (hogwild, lr 1, gradient -1: the
    value is the count). A count recorded after the push left the gate would fall behind."""
    import json

    from distsgd.ps.rules import PushMeta
    from distsgd.ps.shard import Shard

    options = {"lr": 1.0}
    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps(options),
        num_workers=2,
        values={"p#0": np.zeros(4, np.float64), "q#0": np.zeros(4, np.float64)},
        rule=make_server_rule("hogwild", options, 2),
    )
    stop = threading.Event()

    def work(w: int) -> None:
        grads = {k: -np.ones(4, np.float64) for k in ("p#0", "q#0")}
        while not stop.is_set():
            shard.push(grads, PushMeta(worker=w, incarnation=1, base_version=shard.version))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps of a push
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            out = moves.export(shard, ["p#0"], 1)
            assert out.arrays["p#0"][0] == out.loads["p#0"].applies, out
            moves.finish(shard, ["p#0"], 1, commit=False, move_id=out.move_id)
    finally:
        stop.set()
        sys.setswitchinterval(switch)
        for t in threads:
            t.join(10)
    assert shard.values["p#0"][0] == shard.load.piece_counts(["p#0"])["p#0"].applies > 0
