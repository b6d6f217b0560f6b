"""A worker index is taken once: ``distsgd elastic join`` claims it at the servers (a Join with
``claim``), so two joiners never run as the same worker, and an index that was in use (a
departed worker's) is never handed out again within a run."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_scale import _run_folder

from distsgd.ps import start_server, stop_server
from distsgd.ps.membership import Membership
from distsgd.schemes import make_server_rule
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import Refusal, RemoteError


def test_a_claim_takes_only_an_index_never_used() -> None:
    now = [0.0]
    members = Membership(num_workers=2, max_workers=6, evict_after=10.0, clock=lambda: now[0])
    assert not members.claim(0, 5) and not members.claim(1, 5)  # registered: in use
    assert members.claim(2, 7) and members.live == [0, 1, 2] and members.epoch == 1
    assert not members.claim(2, 8)  # a second joiner of the same index
    assert members.claim(2, 7) and members.epoch == 1  # a retry of the granted claim
    assert not members.join(2, 7) and members.epoch == 1  # the claimer's own Join: no change
    members.leave(2)
    assert not members.claim(2, 9)  # a departed worker's index is not handed out again
    now[0] = 5.0
    assert members.claim(3, 1)
    now[0] = 20.0
    assert members.evict() == [0, 1, 3]
    assert not members.claim(3, 2) and members.claim(4, 1)


@pytest.fixture
def server() -> Iterator[str]:
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_workers=8
    )
    try:
        with ShardClient(address, worker=0, timeout=10.0, retry_seconds=0.0) as chief:
            chief.register(
                shard_index=0,
                scheme="hogwild",
                options_json=json.dumps({"lr": 0.1, "world_size": "dynamic"}),
                num_workers=2,
                tensors={"w": np.zeros(4, np.float32)},
            )
        yield address
    finally:
        stop_server(srv, service)


def _claim(address: str, worker: int, incarnation: int) -> Refusal | None:
    with ShardClient(
        address, worker=worker, incarnation=incarnation, timeout=10.0, retry_seconds=0.0
    ) as shard:
        try:
            shard.join(retry=False, claim=True)
        except RemoteError as exc:
            return exc.refusal
    return None


def test_two_joiners_of_one_index_at_once_one_is_refused(server: str) -> None:
    outcomes: list[Refusal | None] = []
    start = threading.Barrier(4)

    def joiner(incarnation: int) -> None:
        start.wait()
        outcomes.append(_claim(server, 2, incarnation))

    threads = [threading.Thread(target=joiner, args=(i + 11,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes, key=str) == [None, Refusal.TAKEN, Refusal.TAKEN, Refusal.TAKEN]
    assert _claim(server, 1, 3) is Refusal.TAKEN  # a launcher's worker
    with ShardClient(server, worker=3, timeout=10.0) as worker3:
        worker3.join()
        worker3.leave()
    assert _claim(server, 3, 4) is Refusal.TAKEN  # departed
    assert _claim(server, 4, 5) is None


def test_join_env_is_given_a_free_index_or_refused_in_one_line(server: str, tmp_path: Path) -> None:
    """``distsgd elastic join`` claims its index at ps0: a taken --task is one line; without --task
    it is given the highest index never used."""
    from distsgd.launcher import join

    run_dir = _joinable_run(tmp_path, server)
    env, *_ = join.join_env(run_dir, 5)
    assert env.task_index == 5
    with pytest.raises(ValueError, match=r"^--task 5: worker5 of .* is or was in use"):
        join.join_env(run_dir, 5)
    given = [join.join_env(run_dir, None)[0].task_index for _ in range(2)]
    assert given == [7, 6]


def _joinable_run(tmp_path: Path, address: str) -> Path:
    """A run folder that ``join_env`` accepts, with ``address`` as ps0 and this process as its
    launcher."""
    run = _run_folder(tmp_path, run_id="", max_workers=8)
    cluster = {"ps": [address], "worker": ["127.0.0.1:0"] * 8}
    (run / "cluster.json").write_text(json.dumps(cluster))
    (run / "secret").write_text("")  # the test's server takes no secret
    return run


def test_a_departed_index_stays_taken_after_the_server_recovers_from_its_log(
    tmp_path: Path,
) -> None:
    from distsgd.ps import wal
    from distsgd.ps.shard import Shard

    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps({"lr": 0.1}),
        num_workers=2,
        values={"w": np.zeros(4, np.float32)},
        rule=make_server_rule("hogwild", {"lr": 0.1}, 2),
        max_workers=6,
    )
    wal.WriteAheadLog.start(tmp_path, shard)
    assert shard.join(3, 7, claim=True) is not None
    shard.leave(3)
    recovery = wal.recover(tmp_path, make_server_rule, max_workers=6)
    assert recovery is not None
    assert shard.join(3, 8, claim=True) is None
    assert recovery.shard.join(3, 8, claim=True) is None
    assert recovery.shard.join(4, 8, claim=True) is not None


def test_two_distsgd_join_processes_of_one_index_one_is_refused(
    server: str, tmp_path: Path
) -> None:
    """Real processes: two ``distsgd elastic join RUN --task 2`` at once; one runs as worker2, the
    other is refused in one line and exits 2 without running anything."""
    from conftest import run_distsgd

    run_dir = _joinable_run(tmp_path, server)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")  # the winner's script: ends at once
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "script": str(script)}))
    done: list[subprocess.CompletedProcess[str]] = []
    start = threading.Barrier(2)

    def join_once() -> None:
        start.wait()
        done.append(run_distsgd(["elastic", "join", str(run_dir), "--task", "2"]))

    threads = [threading.Thread(target=join_once) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    joined = [d for d in done if "as worker2" in d.stderr]
    refused = [d for d in done if d not in joined]
    assert len(joined) == 1 and len(refused) == 1, [d.stderr for d in done]
    (line,) = refused[0].stderr.strip().splitlines()
    assert refused[0].returncode == 2
    assert line.startswith("distsgd: error: --task 2: worker2 of ") and "in use" in line
