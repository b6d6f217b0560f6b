"""A write-ahead log whose disk is full for a while (ps/wal.py): no push is acknowledged that
the log does not hold, and the log comes back by itself as a new generation from a snapshot."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_wal import _assert_same, _payload, _push, _shard

from distsgd.ps import wal, wal_outage, wal_writer
from distsgd.ps.rules import PushMeta
from distsgd.ps.shard import Shard
from distsgd.schemes import make_server_rule

pytestmark = pytest.mark.timeout(60)


class Disk:
    """The log's writes, full (ENOSPC) while :attr:`full` is set."""

    def __init__(self) -> None:
        self.full = threading.Event()
        self.refused = 0

    def wrap(self, write: Callable[..., Any]) -> Callable[..., Any]:
        def flaky(*args: Any) -> Any:
            if self.full.is_set():
                self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(*args)

        return flaky


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    """Every write of the log and of its snapshots goes through ``disk`` (the module's
    functions, so that the log's older code path meets the same full disk)."""
    found = Disk()
    monkeypatch.setattr(wal_writer, "pwrite_all", found.wrap(wal_writer.pwrite_all))
    monkeypatch.setattr(wal, "_write_snapshot", found.wrap(wal._write_snapshot))
    return found


def _push_in_thread(shard: Shard, seed: int) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        meta = PushMeta(worker=0, incarnation=7, base_version=shard.version)
        try:
            out.append(shard.push(_payload(shard, seed), meta))
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("scheme", ["hogwild", "sync"])
def test_a_full_disk_holds_pushes_and_the_log_comes_back_losing_nothing(
    tmp_path: Path, disk: Disk, scheme: str
) -> None:
    live = _shard(scheme)
    log = wal.WriteAheadLog.start(tmp_path, live)
    for seed in range(4):
        _push(live, seed, seed % 3)
    acknowledged = live.version
    disk.full.set()
    thread, out = _push_in_thread(live, 10)
    thread.join(1.0)
    assert thread.is_alive() and not out  # not applied, not answered: it waits for the log
    assert live.version == acknowledged and live.pushes_accepted + live.pushes_rejected == 4
    state = log.state()
    assert state.down and state.outages == 1 and state.error == os.strerror(errno.ENOSPC)
    assert not log.revive(live)  # still full: no new generation
    assert wal.has_state(tmp_path)  # the older files stay: a kill now loses nothing
    _assert_same(live, wal.recover(tmp_path, make_server_rule).shard)  # type: ignore[union-attr]

    disk.full.clear()
    assert log.revive(live)  # a new generation from a snapshot of the shard as it is
    thread.join(10.0)
    assert out and not isinstance(out[0], Exception), out
    assert live.pushes_accepted + live.pushes_rejected == 5  # decided once, after the wait
    after = log.state()
    assert not after.down and after.generation == state.generation + 1
    assert after.outages == 1 and after.down_seconds > 0
    _push(live, 11, 1)
    _assert_same(live, wal.recover(tmp_path, make_server_rule).shard)  # type: ignore[union-attr]


def test_a_push_that_waits_too_long_is_refused_unapplied(
    tmp_path: Path, disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wal_outage, "PUSH_WAIT_SECONDS", 0.2)
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    disk.full.set()
    with pytest.raises(wal.NotLogged, match=r"cannot be written.*send it again"):
        _push(live, 2, 0)
    assert live.version == 1 and log.state().refused_pushes == 1


def test_a_failed_snapshot_of_a_compaction_takes_the_log_down_not_off(
    tmp_path: Path, disk: Disk
) -> None:
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    disk.full.set()
    log.compact(live)  # the log file switched, its snapshot failed
    assert log.state().down
    _assert_same(live, wal.recover(tmp_path, make_server_rule).shard)  # type: ignore[union-attr]
    disk.full.clear()
    log.outage.next_try = 0.0
    log.maybe_compact(live)  # the ticker's call: the log comes back
    assert not log.state().down
    _push(live, 2, 0)
    _assert_same(live, wal.recover(tmp_path, make_server_rule).shard)  # type: ignore[union-attr]


def test_a_log_that_cannot_start_starts_down(tmp_path: Path, disk: Disk) -> None:
    live = _shard("hogwild")
    disk.full.set()
    log = wal.begin(tmp_path, live)
    assert live.wal is log and log.state().down
    disk.full.clear()
    assert log.revive(live)
    _push(live, 1, 0)
    _assert_same(live, wal.recover(tmp_path, make_server_rule).shard)  # type: ignore[union-attr]


def test_a_membership_change_while_down_is_counted_unlogged(tmp_path: Path, disk: Disk) -> None:
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    disk.full.set()
    with pytest.raises(wal.LogDown):
        log.append_push(live, _payload(live, 1), PushMeta(worker=0, incarnation=1, base_version=0))
    live.leave(2)  # applied: it cannot wait
    assert log.state().unlogged >= 1 and 2 in live.finished
    disk.full.clear()
    assert log.revive(live)  # the new snapshot holds it
    recovered = wal.recover(tmp_path, make_server_rule)
    assert recovered is not None and 2 in recovered.shard.finished


def test_a_push_that_waited_for_the_log_is_applied_once_not_taken_for_a_duplicate(
    tmp_path: Path, disk: Disk
) -> None:
    """Hogwild claims a push's sequence before it logs it: a push the down log refused must
    not leave its sequence claimed, or its resend would be answered DUPLICATE, unapplied."""
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    disk.full.set()
    meta = PushMeta(worker=0, incarnation=7, base_version=0, sequence=1)
    with pytest.raises(wal.LogDown):
        log.append_push(live, _payload(live, 1), meta)  # (the shard's own path waits instead)
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(live.push(_payload(live, 1), meta)))
    thread.start()
    thread.join(0.5)
    disk.full.clear()
    assert log.revive(live)
    thread.join(10.0)
    outcome, version = out[0]
    assert outcome.accepted and outcome.reason != "duplicate" and version == 1
    assert live.sequences.highest(0) == 1


def test_over_grpc_info_says_the_log_is_down_and_a_push_is_refused_not_logged(
    tmp_path: Path, disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, over gRPC: while the disk is full Info's ``wal`` says down and a push that
    waits too long is answered UNAVAILABLE ``not-logged``, unapplied; once there is room the
    log comes back by itself (the server's ticker) and a push is applied and logged."""
    import grpc
    import numpy as np

    from distsgd.ps import start_server, stop_server
    from distsgd.transport import ShardClient
    from distsgd.transport.errors import Refusal, RemoteError

    monkeypatch.setattr(wal_outage, "PUSH_WAIT_SECONDS", 0.3)
    folder = tmp_path / "wal" / "ps0"
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, wal_dir=folder
    )
    try:
        with ShardClient(address, worker=0, timeout=10.0, retry_seconds=0.0) as client:
            client.register(
                shard_index=0,
                scheme="hogwild",
                options_json='{"lr": 0.1}',
                num_workers=1,
                tensors={"w": np.zeros(4, dtype=np.float32)},
            )
            grad = {"w": np.ones(4, dtype=np.float32)}
            assert client.push(base_version=0, tensors=grad).accepted
            disk.full.set()
            with pytest.raises(RemoteError) as refused:
                client.push(base_version=1, tensors=grad)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert refused.value.refusal is Refusal.NOT_LOGGED
            info = client.info()
            assert info.version == 1 and info.wal.down and info.wal.outages == 1
            assert info.wal.error == os.strerror(errno.ENOSPC) and info.wal.refused_pushes == 1
            monkeypatch.setattr(wal_outage, "PUSH_WAIT_SECONDS", 30.0)
            disk.full.clear()
            assert client.push(base_version=1, tensors=grad).accepted  # waits for the ticker
            info = client.info()
            assert info.version == 2 and not info.wal.down and info.wal.down_seconds > 0
    finally:
        stop_server(srv, service)
    recovered = wal.recover(folder, make_server_rule)
    assert recovered is not None and recovered.shard.version == 2
