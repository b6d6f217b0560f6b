"""A write-ahead log's replica (ps/replica.py): a server whose folder is gone comes back from
the replica's copy, where it was; a replica refuses what it should; one that went away takes
the log down until it answers again and is seeded anew."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from distsgd.ps import wal, wal_outage
from distsgd.ps.replica import ReplicaError, ReplicaLink, replica_proof
from distsgd.ps.replica_server import ReplicaServer
from distsgd.ps.rules import PushMeta
from distsgd.ps.shard import Shard
from distsgd.schemes import make_server_rule
from distsgd.transport import bulk
from distsgd.transport.proto import distsgd_pb2 as pb
from tests.test_wal import _assert_same, _drive, _push, _shard

pytestmark = pytest.mark.timeout(60)

SECRET = "s" * 40


def _pair(tmp_path: Path, scheme: str = "hogwild", **link: object) -> tuple[ReplicaServer, Path]:
    """A replica (folder ``replica``) on loopback, and the log folder mirrored to it."""
    server = ReplicaServer(
        tmp_path / "replica", host="127.0.0.1", port=0, run_id="r", shard=0, secret=SECRET
    ).start()
    folder = tmp_path / "log"
    options = {"run_id": "r", "shard": 0, "secret": SECRET, **link}
    wal.replicate(folder, ReplicaLink(server.address, **options))  # type: ignore[arg-type]
    return server, folder


@pytest.fixture(autouse=True)
def _no_replicas_left(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(wal_outage, "PUSH_WAIT_SECONDS", 0.2)  # a push meeting a down log
    yield
    wal._REPLICAS.clear()


def _lose_and_recover(folder: Path, live: Shard) -> None:
    """The server's host and disk are lost: its shard comes back from the replica as it was."""
    live.wal.close()
    shutil.rmtree(folder)
    _assert_same(_resume(folder), live)


def _resume(folder: Path) -> Shard:
    shard = wal.resume(folder, None, make_server_rule, shard_index=0, max_workers=3)
    assert shard is not None
    return shard


@pytest.mark.parametrize("scheme", ["hogwild", "sync"])
def test_a_server_whose_folder_is_lost_comes_back_from_its_replica(
    tmp_path: Path, scheme: str
) -> None:
    replica, folder = _pair(tmp_path, scheme)
    try:
        live = _shard(scheme)
        wal.begin(folder, live)
        _drive(live, 40)
        live.wal.compact(live, wait=True)  # a generation's snapshot travels too
        _drive(live, 7)
        live.wal.close()
        shutil.rmtree(folder)  # the host and its disk are gone
        back = _resume(folder)  # fetched from the replica, then recovered
        _assert_same(back, live)
        assert replica.store.records > 40
    finally:
        replica.close()


def test_a_replica_refuses_a_wrong_secret_and_writes_nothing(tmp_path: Path) -> None:
    replica, folder = _pair(tmp_path, secret="x" * 40)
    try:
        live = _shard("hogwild")
        wal.begin(folder, live)  # the snapshot is refused: the log starts down
        assert live.wal.broken
        assert replica.refused == 1
        assert not any((tmp_path / "replica").glob("snapshot-*"))
        with pytest.raises(wal.NotLogged):
            _push(live, 1, 0)
        live.wal.close()
    finally:
        replica.close()


def test_a_replica_refuses_a_record_whose_head_does_not_fit(tmp_path: Path) -> None:
    replica, folder = _pair(tmp_path)
    try:
        live = _shard("hogwild")
        wal.begin(folder, live)
        link = live.wal.replica
        assert link is not None
        bad = pb.ReplicaWrite(generation=0, offset=0, length=4, head=9)
        with pytest.raises(ReplicaError, match="does not fit") as caught:
            link._request(pb.REPLICA_FRAME_WRITE, bad.SerializeToString(), [memoryview(b"abcd")])
            link.wait()
        assert caught.value.code == 3  # INVALID_ARGUMENT
        live.wal.close()
    finally:
        replica.close()


def test_a_replica_that_went_away_takes_the_log_down_until_it_is_seeded_again(
    tmp_path: Path,
) -> None:
    replica, folder = _pair(tmp_path)
    port = int(replica.address.rsplit(":", 1)[1])
    live = _shard("hogwild")
    wal.begin(folder, live)
    _drive(live, 5)
    replica.close()  # its host is lost: its disk too
    shutil.rmtree(tmp_path / "replica")
    with pytest.raises(wal.NotLogged):
        _push(live, 50, 0)
    assert live.wal.broken
    replica = ReplicaServer(
        tmp_path / "replica", host="127.0.0.1", port=port, run_id="r", shard=0, secret=SECRET
    ).start()
    try:
        assert live.wal.revive(live)  # a new generation's snapshot seeds it
        _drive(live, 6)
        _lose_and_recover(folder, live)
    finally:
        replica.close()


def _answer_hello(listener: socket.socket) -> socket.socket:
    """A peer of the run: the next connection, its challenge, and the hello answered."""
    sock, _ = listener.accept()
    sock.sendall(b"c" * 32)
    _, body = bulk.recv_frame(sock, deadline=1e18)
    ours = pb.ReplicaHello.FromString(body).challenge
    ack = pb.ReplicaAck(proof=replica_proof(SECRET, ours)).SerializeToString()
    bulk.send_frame(sock, pb.REPLICA_FRAME_ACK, ack, 1.0)
    return sock


def test_a_push_is_answered_only_once_the_replica_holds_it(tmp_path: Path) -> None:
    """A replica that takes the record but never answers: the push is not acknowledged."""
    listener = socket.create_server(("127.0.0.1", 0))
    folder = tmp_path / "log"
    link = ReplicaLink(
        f"127.0.0.1:{listener.getsockname()[1]}", run_id="r", shard=0, secret=SECRET, timeout=1.0
    )
    wal.replicate(folder, link)
    live = _shard("hogwild")
    seen: list[int] = []

    def mute() -> None:  # a peer of the run that answers the hello and the snapshot only
        sock = _answer_hello(listener)
        kind, body = bulk.recv_frame(sock, deadline=1e18)  # the snapshot
        size = pb.ReplicaFile.FromString(body).length
        bulk.recv_into(sock, np.empty(size, np.uint8), deadline=1e18)
        bulk.send_frame(sock, pb.REPLICA_FRAME_ACK, b"", 1.0)
        seen.append(kind)
        threading.Event().wait(3.0)
        sock.close()

    peer = threading.Thread(target=mute, daemon=True)
    peer.start()
    wal.begin(folder, live)
    before = live.version
    with pytest.raises(wal.NotLogged, match="replica"):
        live.push(
            {k: np.ones_like(v) for k, v in live.values.items()},
            PushMeta(worker=0, incarnation=1, base_version=before),
        )
    assert live.version == before  # not applied
    assert seen == [pb.REPLICA_FRAME_FILE]  # it took the snapshot: the log was up
    live.wal.close()
    listener.close()
    peer.join(5.0)


def test_a_peer_that_cannot_show_the_secret_is_no_replica(tmp_path: Path) -> None:
    """A listener at the replica's address that does not hold the run secret gets nothing
    written and gives nothing to recover from: its answer to the server's challenge is wrong."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        sock, _ = listener.accept()
        sock.sendall(b"c" * 32)
        bulk.recv_frame(sock, deadline=1e18)
        forged = pb.ReplicaAck(proof=replica_proof("w" * 40, b"anything")).SerializeToString()
        bulk.send_frame(sock, pb.REPLICA_FRAME_ACK, forged, 1.0)
        sock.close()

    peer = threading.Thread(target=impostor, daemon=True)
    peer.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    link = ReplicaLink(address, run_id="r", shard=0, secret=SECRET, timeout=2.0)
    with pytest.raises(ReplicaError, match="no replica of this run") as caught:
        link.fetch(tmp_path / "log")
    assert caught.value.code == 16
    assert not any((tmp_path / "log").glob("*"))
    listener.close()
    peer.join(5.0)


def test_a_replica_without_its_task_folder_or_address_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distsgd.cli.main import main

    monkeypatch.setenv("DISTSGD_SECRET", SECRET)
    assert main(["server", "--job", "replica", "--wal-dir", "x", "--address", "a:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distsgd: error: --job replica needs --task") and "\n" not in err
    monkeypatch.delenv("DISTSGD_SECRET")
    argv = [
        "server",
        "--task",
        "0",
        "--replica",
        "127.0.0.1:1",
        "--wal",
        "off",
        "--ps-hosts",
        "a:1",
    ]
    assert main([*argv, "--worker-hosts", "a:2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--replica needs the write-ahead log" in err and "\n" not in err


def test_a_fetch_cut_short_leaves_no_snapshot_to_recover_from(tmp_path: Path) -> None:
    """A replica that dies after the snapshot, before the log files: the folder stays without
    a snapshot, so the next start fetches again rather than recover without the log."""
    listener = socket.create_server(("127.0.0.1", 0))

    def dies_midway() -> None:
        sock = _answer_hello(listener)
        bulk.recv_frame(sock, deadline=1e18)  # the fetch
        head = pb.ReplicaFile(kind=pb.REPLICA_FILE_KIND_SNAPSHOT, generation=0, length=4)
        bulk.send_frame(sock, pb.REPLICA_FRAME_FILE, head.SerializeToString(), 1.0)
        sock.sendall(b"snap")
        sock.close()  # the log files never come

    peer = threading.Thread(target=dies_midway, daemon=True)
    peer.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    link = ReplicaLink(address, run_id="r", shard=0, secret=SECRET, timeout=2.0)
    with pytest.raises(ReplicaError):
        link.fetch(tmp_path / "log")
    assert not wal.has_state(tmp_path / "log")
    assert list((tmp_path / "log").iterdir()) == []
    listener.close()
    peer.join(5.0)


def test_a_stranger_connecting_does_not_end_the_servers_connection(tmp_path: Path) -> None:
    replica, folder = _pair(tmp_path)
    try:
        live = _shard("hogwild")
        wal.begin(folder, live)
        _drive(live, 3)
        host, port = replica.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as stranger:
            stranger.sendall(b"\x01\xff\xff\xff\x00garbage")  # a hello that does not parse
            _drive(live, 3)  # the server's pushes go on meanwhile
        assert not live.wal.broken
        _lose_and_recover(folder, live)
    finally:
        replica.close()


def test_a_revival_the_replica_refuses_leaves_no_snapshot_behind(tmp_path: Path) -> None:
    replica, folder = _pair(tmp_path)
    live = _shard("hogwild")
    wal.begin(folder, live)
    replica.close()  # gone for good
    with pytest.raises(wal.NotLogged):
        _push(live, 1, 0)
    for _ in range(3):
        assert not live.wal.revive(live)
    assert len(list(folder.glob("snapshot-*.npz"))) == 1  # the first generation's only
    live.wal.close()


def test_a_server_finds_its_replica_where_the_run_control_says_it_moved(tmp_path: Path) -> None:
    """A replica started again on another node reports a new address; the server's link asks
    ``resolve`` before each connection, and mirrors to it there."""
    server = ReplicaServer(
        tmp_path / "replica", host="127.0.0.1", port=0, run_id="r", shard=0, secret=SECRET
    ).start()
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))  # a port nobody listens on: where the replica was
    old = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()
    asked: list[str] = []

    def resolve() -> str | None:
        asked.append("?")
        return server.address if len(asked) > 1 else None  # the first time: not known yet

    try:
        link = ReplicaLink(old, run_id="r", shard=0, secret=SECRET, resolve=resolve)
        folder = tmp_path / "log"
        wal.replicate(folder, link)
        live = _shard("hogwild")
        with pytest.raises(ReplicaError, match="unreachable"):
            link._connect()  # still at the old address
        wal.begin(folder, live)  # the log connects again, now at the new address
        _drive(live, 5)
        assert link.address == server.address and server.store.records >= 5
        live.wal.close()
    finally:
        server.close()
