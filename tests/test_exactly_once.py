"""Exactly-once pushes (issue 36, item 13): sequence numbers, the shard's deduplication, and
its record of them in snapshots and the write-ahead log; a kill's step (item 11) and the first
wait for the other workers (item 14a), as the worker sees them. No processes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from distsgd.control.faults import (
    Fault,
    FaultInjector,
    clear_kill_marks,
    kill_due,
    kill_landed,
)
from distsgd.control.folder import LocalFiles
from distsgd.ps import wal
from distsgd.ps.client import ParameterClient
from distsgd.ps.partition import PartitionPlan
from distsgd.ps.rules import PushMeta
from distsgd.ps.sequence import (
    STEP_SHIFT,
    AppliedSequences,
    is_duplicate,
    push_sequence,
    steps_applied,
)
from distsgd.ps.shard import Shard
from distsgd.schemes import make_server_rule
from distsgd.transport.errors import RemoteError

pytestmark = pytest.mark.timeout(60)

OPTIONS: dict[str, dict[str, Any]] = {
    "hogwild": {"lr": 0.1},  # an unlocked rule
    "sync": {"lr": 0.1, "required": 1},  # a locked one
}


def _shard(scheme: str) -> Shard:
    return Shard(
        index=0,
        scheme=scheme,
        options_json=json.dumps(OPTIONS[scheme]),
        num_workers=2,
        values={"w": np.zeros(4, np.float32)},
        rule=make_server_rule(scheme, OPTIONS[scheme], 2),
    )


def _push(shard: Shard, worker: int, sequence: int) -> tuple[bool, bool]:
    """(accepted, duplicate) of a push of ones."""
    meta = PushMeta(worker=worker, incarnation=1, base_version=shard.version, sequence=sequence)
    outcome, _ = shard.push({"w": np.ones(4, np.float32)}, meta)
    return outcome.accepted, outcome.duplicate


def test_the_dedup_decision() -> None:
    highest = {0: 5 << STEP_SHIFT}
    assert is_duplicate(highest, 0, 5 << STEP_SHIFT)
    assert is_duplicate(highest, 0, 3)
    assert not is_duplicate(highest, 0, (5 << STEP_SHIFT) + 1)
    assert not is_duplicate(highest, 1, 1)  # another worker
    assert not is_duplicate(highest, 0, 0)  # no id: applied each time
    assert not is_duplicate({-1: 9}, -1, 3)  # a tool


def test_sequences_number_steps_and_the_pushes_within_one() -> None:
    first = push_sequence(7, 0)
    assert first == 7 << STEP_SHIFT and steps_applied(first) == 7
    second = push_sequence(7, first)  # a second push of the same step
    assert second == first + 1 and steps_applied(second) == 7
    assert push_sequence(8, second) == 8 << STEP_SHIFT
    assert push_sequence(0, 0) == 1  # before any step: still an id
    # A restarted worker training step 7 again sends the number the first try had.
    assert push_sequence(7, 0) == first


@pytest.mark.parametrize("scheme", sorted(OPTIONS))
def test_a_resent_push_is_applied_once(scheme: str) -> None:
    shard = _shard(scheme)
    seq = push_sequence(3, 0)
    assert _push(shard, 0, seq) == (True, False)
    assert shard.version == 1
    assert _push(shard, 0, seq) == (True, True)  # the resend: accepted, not applied
    assert shard.version == 1 and shard.pushes_accepted == 1
    np.testing.assert_array_equal(shard.values["w"], np.full(4, -0.1, np.float32))
    assert _push(shard, 1, seq) == (True, False)  # another worker's push of the same number
    assert _push(shard, 0, seq + 1) == (True, False)
    assert _push(shard, 0, 0) == (True, False)  # no id: applied
    assert _push(shard, 0, 0) == (True, False)
    assert shard.version == 5
    assert shard.sequences.highest(0) == seq + 1 and shard.sequences.highest(1) == seq


@pytest.mark.parametrize("scheme", sorted(OPTIONS))
def test_a_refused_push_is_not_recorded(scheme: str) -> None:
    shard = _shard(scheme)
    nonfinite = PushMeta(worker=0, incarnation=1, base_version=0, sequence=10)
    refused, _ = shard.push({"w": np.full(4, np.nan, np.float32)}, nonfinite)
    assert not refused.accepted
    assert shard.sequences.highest(0) == 0
    assert _push(shard, 0, 10) == (True, False)  # sent again, fixed: applied


def test_the_applied_sequences_survive_a_checkpoint() -> None:
    shard = _shard("hogwild")
    _push(shard, 0, push_sequence(4, 0))
    _push(shard, 1, push_sequence(6, 0))
    _, data = shard.to_bytes()
    back = Shard.from_bytes(data, make_server_rule)
    assert back.sequences.highest(0) == 4 << STEP_SHIFT
    assert back.sequences.highest(1) == 6 << STEP_SHIFT
    assert _push(back, 0, 4 << STEP_SHIFT) == (True, True)


@pytest.mark.parametrize(
    "state", [[1, 2], {"0": -1}, {"x": 3}, {"0": 1.5}, {"0": True}, {"0": 1 << 63}]
)
def test_a_damaged_record_of_sequences_is_refused(state: Any) -> None:
    with pytest.raises(ValueError, match="applied_sequences"):
        AppliedSequences.from_state(state)


@pytest.mark.parametrize("scheme", sorted(OPTIONS))
def test_the_write_ahead_log_replays_the_sequences(tmp_path: Path, scheme: str) -> None:
    live = _shard(scheme)
    _push(live, 0, push_sequence(1, 0))  # in the snapshot
    wal.WriteAheadLog.start(tmp_path, live)
    _push(live, 0, push_sequence(2, 0))  # in the log only
    _push(live, 1, push_sequence(5, 0))
    _push(live, 1, push_sequence(5, 0))  # a resend: neither applied nor logged
    recovery = wal.recover(tmp_path, make_server_rule)
    assert recovery is not None
    back = recovery.shard
    assert back.version == live.version == 3
    assert back.sequences.state() == live.sequences.state()
    assert back.sequences.highest(0) == 2 << STEP_SHIFT
    # The push in flight when the server died, sent again to the restarted one: applied once.
    assert _push(back, 1, push_sequence(5, 0)) == (True, True)
    assert back.version == 3


def test_a_worker_holds_still_at_a_kills_step_until_it_landed(tmp_path: Path) -> None:
    """Issue 36, item 11, the worker's side: at the step of a kill it marks the step and waits
    for the launcher's mark that the kill landed (a restarted target does not wait again)."""
    kill = Fault.parse("kill:ps:0@step=6")
    injector = FaultInjector([kill], files=LocalFiles(tmp_path))
    injector.before_step(5)
    assert kill_due(tmp_path, kill) is None
    landed = threading.Timer(0.3, kill_landed, (tmp_path, kill))
    began = time.monotonic()
    landed.start()
    injector.before_step(7)
    landed.join()
    assert time.monotonic() - began >= 0.25  # it waited for the landing
    assert kill_due(tmp_path, kill) == 7
    again = FaultInjector([kill], files=LocalFiles(tmp_path))  # restarted: landed already
    began = time.monotonic()
    again.before_step(8)
    assert time.monotonic() - began < 1.0
    assert FaultInjector([kill]).kills == []  # no run folder: the launcher's reading only
    clear_kill_marks(tmp_path)  # a resumed run: its kills are due again
    assert kill_due(tmp_path, kill) is None


class _LateOthers:
    """A shard whose version-waiting pulls time out ``timeouts`` times (the other workers
    have not pushed yet), then answer."""

    def __init__(self, timeouts: int) -> None:
        self.timeouts = timeouts
        self.calls = 0
        self.last_waited = 0.0
        self.last_pull_nbytes = 0

    def pull(self, *, min_version: int, wait_seconds: float | None) -> tuple[int, dict]:
        self.calls += 1
        if min_version and self.calls <= self.timeouts:
            raise RemoteError(
                "ps0", "PullShared", grpc.StatusCode.DEADLINE_EXCEEDED, "still at version 0"
            )
        return max(min_version, 1), {"w#0": np.zeros(3, np.float32)}

    def close(self) -> None:
        pass


def _late_client(timeouts: int, startup: float) -> tuple[ParameterClient, _LateOthers]:
    plan = PartitionPlan.from_arrays({"w": np.zeros(3, np.float32)}, 1)
    client = ParameterClient(["127.0.0.1:9"], plan, worker=0)
    fake = _LateOthers(timeouts)
    client.shards = [fake]  # type: ignore[list-item]
    client.startup_seconds = startup
    return client, fake


def test_the_first_wait_for_the_others_lasts_the_startup_timeout() -> None:
    """Issue 36, item 14a: a sync worker started 30 s after the chief ended the run, the
    chief's first pull waiting for a version timing out at a call's 30 s; until a first such
    pull succeeded it now waits up to the start-up timeout (300 s by default)."""
    client, fake = _late_client(timeouts=3, startup=60.0)
    version, _ = client.pull(min_version=1)
    assert version == 1 and fake.calls == 4
    fake.calls, fake.timeouts = 0, 1  # later waits time out as a call does
    with pytest.raises(RemoteError):
        client.pull(min_version=2)
    client.close()


def test_the_first_wait_still_ends_at_the_startup_timeout() -> None:
    client, _ = _late_client(timeouts=10**9, startup=0.2)
    began = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        client.pull(min_version=1)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.2 <= time.monotonic() - began < 30
    client.close()
