"""The write-ahead log (ps/wal.py): a shard rebuilt from its folder equals the one that died."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distsgd.ps import wal
from distsgd.ps.rules import PushMeta
from distsgd.ps.shard import Shard
from distsgd.schemes import make_server_rule

pytestmark = pytest.mark.timeout(60)

SCHEMES: dict[str, dict[str, Any]] = {
    "hogwild": {"lr": 0.1, "momentum": 0.9},
    "sync": {"lr": 0.1, "momentum": 0.9, "required": 3},
    "downpour": {"server_lr": 0.5, "per_worker": True, "world_size": "dynamic"},
    "easgd": {},
}


def _shard(scheme: str, workers: int = 3) -> Shard:
    rng = np.random.default_rng(0)
    return Shard(
        index=0,
        scheme=scheme,
        options_json=json.dumps(SCHEMES[scheme]),
        num_workers=workers,
        values={
            "w": rng.standard_normal((5, 4)).astype(np.float32),
            "b": rng.standard_normal(4).astype(np.float32),
            "d": rng.standard_normal(3),  # float64
        },
        rule=make_server_rule(scheme, SCHEMES[scheme], workers),
    )


def _payload(shard: Shard, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in shard.values.items()}


def _push(shard: Shard, seed: int, worker: int) -> None:
    meta = PushMeta(
        worker=worker, incarnation=7, base_version=shard.version, lr_scale=0.5 + seed % 3 / 4
    )
    shard.push(_payload(shard, seed), meta)


def _drive(shard: Shard, pushes: int) -> None:
    """Pushes from three workers (sync: stale ones too), a leave, and one more step."""
    for i in range(pushes):
        _push(shard, i, i % 3)
        if i == pushes // 2:
            stale = PushMeta(worker=1, incarnation=7, base_version=shard.version - 1)
            shard.push(_payload(shard, 1000 + i), stale)
    shard.leave(2)
    _push(shard, 999, 0)


def _recover(folder: Path, scheme: str) -> Shard:
    recovery = wal.recover(folder, make_server_rule)
    assert recovery is not None
    return recovery.shard


def _assert_same(a: Shard, b: Shard, *, rejected: bool = True) -> None:
    assert a.version == b.version
    assert a.values.keys() == b.values.keys()
    for key in a.values:
        np.testing.assert_array_equal(a.values[key], b.values[key])
    sa, sb = a.rule.state_dict(), b.rule.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        np.testing.assert_array_equal(np.asarray(sa[key]), np.asarray(sb[key]))
    assert a.finished == b.finished
    assert a.membership.live == b.membership.live and a.membership.epoch == b.membership.epoch
    assert a.pushes_accepted == b.pushes_accepted
    if rejected:  # refusals of the rule; a non-finite payload is refused before the log
        assert a.pushes_rejected == b.pushes_rejected
    if hasattr(a.rule, "sgd"):
        assert a.rule.sgd.lr == b.rule.sgd.lr


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_recovery_rebuilds_the_shard_exactly(tmp_path: Path, scheme: str) -> None:
    live = _shard(scheme)
    wal.WriteAheadLog.start(tmp_path, live)
    _drive(live, 10)
    if scheme == "sync":  # a partial step pending at the kill
        assert live.rule.contributors
    assert live.version > 0
    _assert_same(live, _recover(tmp_path, scheme))


def test_files_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "wal" / "ps0"
    wal.WriteAheadLog.start(folder, _shard("hogwild"))
    assert folder.stat().st_mode & 0o777 == 0o700
    assert folder.parent.stat().st_mode & 0o777 == 0o700
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_sync_step_closed_by_its_timeout_is_replayed(tmp_path: Path) -> None:
    live = _shard("sync")
    wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    _push(live, 2, 1)
    live.rule.opened -= 1e6  # the step has waited past step_timeout for worker 2
    live.tick()
    assert live.version == 1
    _push(live, 3, 1)
    _assert_same(live, _recover(tmp_path, "sync"))


def test_dynamic_membership_is_replayed(tmp_path: Path) -> None:
    live = _shard("downpour")
    wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    live.leave(1)
    live.leave(2)  # the rate follows the one member left
    assert live.rule.sgd.lr == 1.0
    _push(live, 2, 0)
    live.join(2, 9)
    _push(live, 3, 2)
    again = _recover(tmp_path, "downpour")
    _assert_same(live, again)
    assert again.membership.live == [0, 2]


def _log(folder: Path, generation: int = 0) -> Path:
    return folder / f"log-{generation % 2}.wal"


@pytest.mark.parametrize("damage", ["truncate", "no header", "flip", "magic", "stale"])
def test_a_torn_or_corrupt_last_record_is_dropped(tmp_path: Path, damage: str) -> None:
    """A process killed mid-record leaves its body short, or a body without its header (the
    header is written last); a damaged header fails its CRC; an older generation's record ends
    the log."""
    live, reference = _shard("sync"), _shard("sync")
    log = wal.WriteAheadLog.start(tmp_path, live)
    for i in range(7):
        _push(live, i, i % 3)
        if i < 6:
            _push(reference, i, i % 3)
    path = _log(tmp_path)
    size = log.size  # where the records end (the file is allocated past them)
    record = wal.HEAD.size + 4 + 4 * 3 + (20 + 4) * 4 + 3 * 8
    last = size - record
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: size - record // 2]
    elif damage == "no header":
        data[last : last + wal.HEAD.size] = bytes(wal.HEAD.size)
    elif damage == "flip":
        data[last + 40] ^= 0x40  # the version
    elif damage == "magic":
        data[last + 1] ^= 0xFF
    else:
        data[last + 16] = log.generation + 2  # as if left by generation 2 before
    path.write_bytes(bytes(data))
    recovery = wal.recover(tmp_path, make_server_rule)
    assert recovery is not None and recovery.records == 1 + 6  # the members, 6 pushes
    _assert_same(recovery.shard, reference)


@pytest.mark.parametrize("live_snapshot", [False, True], ids=["copied", "live"])
def test_compaction_starts_a_new_generation_and_recovery_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live_snapshot: bool
) -> None:
    monkeypatch.setattr(wal.WriteAheadLog, "_compact_soon", lambda self: None)  # by hand here
    if live_snapshot:  # every shard is a large one: snapshots from the live values
        monkeypatch.setattr(wal, "LIVE_SNAPSHOT_BYTES", 0)
    for scheme in ("hogwild", "sync"):
        folder = tmp_path / scheme
        live = _shard(scheme)
        log = wal.WriteAheadLog.start(folder, live)
        _drive(live, 8)
        log.bound = 1
        assert log.maybe_compact(live)
        assert sorted(p.name for p in folder.iterdir()) == [
            "log-0.wal",
            "log-1.wal",
            "snapshot-00000001.npz",
        ]
        _drive(live, 5)
        _assert_same(live, _recover(folder, scheme))
        for _ in range(3):  # each log file is written over, older records left behind it
            log.compact(live)
            _push(live, 77, 0)
        assert log.generation == 4 and (folder / "snapshot-00000004.npz").exists()
        assert _log(folder, 4).stat().st_size > log.size  # generation 2 left more behind
        _assert_same(live, _recover(folder, scheme))


def test_a_large_shard_writes_its_snapshot_from_its_live_values_holding_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wal, "LIVE_SNAPSHOT_BYTES", 0)
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _drive(live, 3)
    events: list[str] = []
    write = log.write_snapshot

    def slow_write(path: Path, data: Any) -> None:
        events.append("snapshot begins")
        time.sleep(0.3)
        write(path, data)
        events.append("snapshot written")

    log.write_snapshot = slow_write
    shared: list[bool] = []
    packer = wal._packer

    def spy(arrays: dict[str, np.ndarray], header: dict[str, Any]) -> Any:
        shared.extend(np.shares_memory(arrays[f"values/{k}"], v) for k, v in live.values.items())
        return packer(arrays, header)

    monkeypatch.setattr(wal, "_packer", spy)
    compacting = threading.Thread(target=log.compact, args=(live,))
    compacting.start()
    while not events:
        time.sleep(0.01)
    _push(live, 5, 1)  # waits for the snapshot: it is written from these very arrays
    events.append("push applied")
    compacting.join(5)
    assert events == ["snapshot begins", "snapshot written", "push applied"]
    assert shared and all(shared)  # no copy of the shard was made
    _assert_same(live, _recover(tmp_path, "hogwild"))


def test_a_lost_new_snapshot_replays_both_logs(tmp_path: Path) -> None:
    """Killed after the switch to a new log but before its snapshot was written: the older
    snapshot and both logs."""
    live = _shard("sync")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _drive(live, 4)
    first = (tmp_path / "snapshot-00000000.npz").read_bytes()
    log.compact(live)
    _drive(live, 4)
    (tmp_path / "snapshot-00000001.npz").unlink()
    (tmp_path / "snapshot-00000000.npz").write_bytes(first)
    recovery = wal.recover(tmp_path, make_server_rule)
    assert recovery is not None and (recovery.snapshot, recovery.generation) == (0, 1)
    _assert_same(live, recovery.shard)
    # a server started on it goes on past both generations
    again = wal.resume(tmp_path, None, make_server_rule, shard_index=0)
    assert again is not None and again.wal is not None and again.wal.generation == 2
    _push(again, 5, 0)
    _push(live, 5, 0)
    _assert_same(live, _recover(tmp_path, "sync"))


def test_a_refused_payload_is_never_logged(tmp_path: Path) -> None:
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    size, records = log.size, log.records
    bad = _payload(live, 2)
    bad["w"][1, 1] = np.nan
    outcome, _ = live.push(bad, PushMeta(worker=0, incarnation=7, base_version=live.version))
    assert not outcome.accepted
    assert (log.size, log.records) == (size, records)
    _assert_same(live, _recover(tmp_path, "hogwild"), rejected=False)


def test_no_snapshot_means_nothing_to_recover(tmp_path: Path) -> None:
    assert wal.recover(tmp_path, make_server_rule) is None
    assert not wal.has_state(tmp_path)
    (tmp_path / "snapshot-00000000.npz").write_bytes(b"not a zip")
    assert wal.has_state(tmp_path)
    with pytest.raises(wal.WalError, match="no readable snapshot"):
        wal.recover(tmp_path, make_server_rule)


def test_a_server_restarted_on_its_folder_serves_the_shard_it_had(tmp_path: Path) -> None:
    """In process, over gRPC: Register writes the base snapshot, pushes are logged, and a new
    server on the same folder comes up registered at the same version with the same values."""
    from distsgd.ps import start_server, stop_server
    from distsgd.transport import ShardClient

    folder = tmp_path / "wal" / "ps0"
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3)}
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, wal_dir=folder
    )
    try:
        with ShardClient(address, worker=0, timeout=10.0, retry_seconds=0.0) as client:
            client.register(
                shard_index=0,
                scheme="hogwild",
                options_json=json.dumps(SCHEMES["hogwild"]),
                num_workers=2,
                tensors=arrays,
            )
            assert wal.has_state(folder)
            for i in range(5):
                grad = {"w": np.full((3, 4), i, dtype=np.float32)}
                assert client.push(base_version=i, tensors=grad).accepted
            version, before = client.pull(min_version=5)
    finally:
        stop_server(srv, service)
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, wal_dir=folder
    )
    try:
        with ShardClient(address, worker=0, timeout=10.0, retry_seconds=0.0) as client:
            info = client.info()
            assert info.registered and info.version == info.restored_version == version == 5
            _, after = client.pull(min_version=0)
        for key in arrays:
            np.testing.assert_array_equal(before[key], after[key])
    finally:
        stop_server(srv, service)


def test_a_newer_checkpoint_wins_over_an_older_log(tmp_path: Path) -> None:
    live = _shard("hogwild")
    wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    ahead = _shard("hogwild")
    for i in range(4):
        _push(ahead, i, 0)
    served = wal.resume(tmp_path, ahead, make_server_rule, shard_index=0)
    assert served is ahead and served.wal is not None
    assert _recover(tmp_path, "hogwild").version == 4  # and the log goes on from there
    assert wal.resume(tmp_path, _shard("hogwild"), make_server_rule, shard_index=0).version == 4


def test_scalar_and_empty_pieces(tmp_path: Path) -> None:
    values = {"s": np.array(2.0, dtype=np.float32), "e": np.zeros((0, 3)), "v": np.ones(3)}
    live = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps(SCHEMES["hogwild"]),
        num_workers=1,
        values=values,
        rule=make_server_rule("hogwild", SCHEMES["hogwild"], 1),
    )
    wal.WriteAheadLog.start(tmp_path, live)
    for i in range(3):
        _push(live, i, 0)
    _push(live, 5, 0)
    live.push({"v": np.full(3, 0.5)}, PushMeta(worker=0, incarnation=7, base_version=4))
    _assert_same(live, _recover(tmp_path, "hogwild"))


def test_a_log_past_its_bound_starts_the_next_generation_by_itself(tmp_path: Path) -> None:
    """No ticker here: the push that takes the log past its bound wakes the log's compactor,
    which starts the next generation off the pushes' path; closing the log ends it."""
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 1, 0)
    log.bound = log.size + 1  # the next push passes it
    _push(live, 2, 1)
    deadline = time.monotonic() + 10
    while log.generation == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.generation == 1
    while not (tmp_path / "snapshot-00000001.npz").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    _push(live, 3, 2)
    compactor = log._compactor
    log.close()
    assert compactor is not None and not compactor.is_alive()
    _assert_same(live, _recover(tmp_path, "hogwild"))


def test_a_log_file_is_allocated_ahead_of_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records are written into allocated room (``posix_fallocate`` ahead of them, up to the
    bound); a file system that refuses leaves the writes to themselves."""
    live = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path / "a", live)
    _push(live, 1, 0)
    file = _log(tmp_path / "a").stat()
    assert min(log.bound, wal.RESERVE_BYTES) < file.st_size <= log.size + wal.RESERVE_BYTES
    assert file.st_blocks * 512 >= file.st_size

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    other = _shard("hogwild")
    log = wal.WriteAheadLog.start(tmp_path / "b", other)
    _push(other, 1, 0)
    _push(live, 2, 0)
    _push(other, 2, 0)
    assert not log.broken and _log(tmp_path / "b").stat().st_size == log.size
    _assert_same(other, _recover(tmp_path / "b", "hogwild"))
