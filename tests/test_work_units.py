"""Work units (protocol 5): shard 0's queue, LeaseWork's checks, and elastic training in which
no sample is lost or trained twice in an epoch while workers come and go."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import loadclock
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import distsgd_cmd, task_pids, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st
from test_membership import _client, _w0
from torch import nn
from torch.utils.data import TensorDataset

from distsgd import schemes
from distsgd.control.folder import METRICS_FILE, RESULT_FILE
from distsgd.ps import start_server
from distsgd.ps.rules import RuleFactory
from distsgd.ps.server import stop_server
from distsgd.ps.service import ParameterService
from distsgd.ps.shard import Shard
from distsgd.ps.work import MAX_LEASE, WorkQueue, WorkSpec
from distsgd.runtime import TaskEnv, TrainConfig, run_worker
from distsgd.runtime.setup import stop_on_sigterm
from distsgd.runtime.work import LeasedBatches, epoch_order
from distsgd.schemes import make_server_rule
from distsgd.transport.errors import Refusal, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb

DEMO = Path(__file__).resolve().parents[1] / "src" / "distsgd" / "demo" / "digits.py"
DEMO_EPOCHS = "15"
"""Epochs of the real run of DEMO below (its own 30 cost twice the CPU; it still reaches the
0.95 it asserts: hogwild demo runs of 3 workers measured 0.947 to 0.972 at 12 epochs, too
near the bar, 0.967 to 0.981 at 20)."""


# --------------------------------------------------------------------------- the queue itself


def _queue(samples: int = 10, unit_size: int = 4, epochs: float = 2.0) -> WorkQueue:
    return WorkQueue(WorkSpec(samples=samples, unit_size=unit_size, epochs=epochs))


def test_spec_cuts_epochs_into_units_and_a_fractional_last_epoch() -> None:
    spec = WorkSpec(samples=10, unit_size=4, epochs=2.5)
    assert spec.units_per_epoch == 3  # 4 + 4 + 2: every sample covered
    assert spec.total_units == 8 and spec.num_epochs == 3
    assert [spec.units_in(e) for e in range(3)] == [3, 3, 2]
    assert spec.check_unit((2, 1)) is None
    assert "outside" in (spec.check_unit((2, 2)) or "")
    assert "outside" in (spec.check_unit((3, 0)) or "")


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"samples": 0, "unit_size": 1, "epochs": 1.0}, "samples"),
        ({"samples": 4, "unit_size": 5, "epochs": 1.0}, "unit_size"),
        ({"samples": 4, "unit_size": 0, "epochs": 1.0}, "unit_size"),
        ({"samples": 4, "unit_size": 1, "epochs": float("nan")}, "epochs"),
        ({"samples": 4, "unit_size": 1, "epochs": 0.0}, "epochs"),
        ({"samples": 1 << 30, "unit_size": 1, "epochs": 1.0}, "units"),
    ],
)
def test_spec_refuses_bad_fields(fields: dict[str, Any], word: str) -> None:
    with pytest.raises(ValueError, match=word) as info:
        WorkSpec(**fields)
    assert "\n" not in str(info.value)


def test_epochs_advance_in_order_and_a_straggler_stalls_no_one() -> None:
    q = _queue()  # 3 units per epoch, 2 epochs
    slow = q.lease(0, 1, done=[], want=1).units
    assert slow == [(0, 0)]
    fast: list[tuple[int, int]] = []
    for _ in range(5):
        got = q.lease(1, 1, done=fast[-1:], want=1).units
        fast.extend(got)
    assert fast == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]  # epoch 1 while (0, 0) is out
    assert q.epoch == 2 and not q.finished
    assert q.lease(1, 1, done=[(1, 2)], want=1).units == []  # nothing left to lease
    assert q.lease(0, 1, done=[(0, 0)], want=1).units == []
    assert q.finished and q.progress == 1.0
    assert q.tally() == {"trained_once": [3, 3], "trained_twice": [0, 0], "never_trained": [0, 0]}


@pytest.mark.parametrize("how", ["leave", "evict", "restart"])
def test_a_workers_units_go_back_to_the_front(how: str) -> None:
    q = _queue(samples=12, unit_size=4, epochs=1.0)
    assert q.lease(0, 1, done=[], want=2).units == [(0, 0), (0, 1)]
    assert q.lease(1, 1, done=[], want=1).units == [(0, 2)]
    if how == "restart":
        assert q.seen(0, 2) == [(0, 0), (0, 1)]
        assert q.lease(0, 2, done=[(0, 0)], want=1).units == [(0, 0)]  # its own, again
        assert q.lease(0, 2, done=[], want=2).units == [(0, 0), (0, 1)]
        assert q.counts == [[0, 0, 0]]  # the old incarnation's report counted nothing
    else:
        assert q.release(0) == [(0, 0), (0, 1)]
        assert q.lease(1, 1, done=[(0, 2)], want=2).units == [(0, 0), (0, 1)]
        assert q.lease(0, 1, done=[(0, 0)], want=0).ignored == [(0, 0)]  # no longer its
        assert q.counts == [[0, 0, 1]]


def test_a_worker_that_left_is_leased_nothing_and_a_repeat_counts_once() -> None:
    q = _queue()
    assert q.lease(0, 1, done=[], want=1, member=False).units == []
    (unit,) = q.lease(0, 1, done=[], want=1).units
    first = q.lease(0, 1, done=[unit], want=0)
    again = q.lease(0, 1, done=[unit], want=0)  # a retried call whose answer was lost
    assert first.ignored == [] and again.ignored == [unit]
    assert q.counts[0][0] == 1 and q.units_done == 1


def test_the_queue_survives_a_shard_checkpoint() -> None:
    values = {"w#0": np.zeros(3, np.float32)}
    rule = make_server_rule("hogwild", {"lr": 0.1}, 2)
    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json='{"lr": 0.1}',
        num_workers=2,
        values=values,
        rule=rule,
        work=WorkSpec(samples=10, unit_size=4, epochs=2.0),
    )
    held, _, _ = shard.lease_work(0, 7, [], 2)
    shard.lease_work(0, 7, [held[0]], 1)
    factory: RuleFactory = make_server_rule
    again = Shard.from_bytes(shard.to_bytes()[1], factory)
    assert again.work is not None and shard.work is not None
    assert again.work.state_dict() == shard.work.state_dict()
    assert again.work.held(0) == [(0, 1), (0, 2)]
    again.leave(0)  # the restored leases go back on a leave as before the restart
    assert list(again.work.returned) == [(0, 1), (0, 2)]


ops = st.lists(
    st.tuples(
        st.sampled_from(["lease", "train", "release", "restart"]),
        st.integers(0, 2),
        st.integers(0, 4),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_model_no_unit_is_lost_or_held_twice(ops: list[tuple[str, int, int]]) -> None:
    """Random leases, reports, leaves and restarts of three workers: every unit is always in
    exactly one place (not yet handed out, given back, held by one worker, or done), and
    draining the queue with one worker trains each unit exactly once."""
    q = _queue(samples=10, unit_size=3, epochs=1.5)  # 4 units an epoch, 6 in all
    incarnation = {0: 1, 1: 1, 2: 1}
    trained: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    for op, worker, n in ops:
        if op == "lease":
            report, trained[worker] = trained[worker], []
            q.lease(worker, incarnation[worker], done=report, want=n)
        elif op == "train":
            held = q.held(worker)
            trained[worker] = [u for u in held if u not in trained[worker]][:n] + trained[worker]
        elif op == "release":
            q.release(worker)
            trained[worker] = []
        else:
            incarnation[worker] += 1
            q.seen(worker, incarnation[worker])
            trained[worker] = []
        everywhere = list(q.returned) + [u for w in q.leases for u in q.held(w)]
        done = [(e, u) for e, counts in enumerate(q.counts) for u, c in enumerate(counts) if c]
        fresh = [divmod(i, 4) for i in range(q.next_fresh, q.spec.total_units)]
        waiting = [u for u in everywhere if u not in done]
        assert len(set(everywhere)) == len(everywhere)  # nowhere twice
        assert sorted(set(waiting) | set(done) | set(fresh)) == sorted(
            divmod(i, 4) for i in range(6)
        )
        assert max((c for counts in q.counts for c in counts), default=0) <= 1
    for w in range(3):
        q.release(w)
    while not q.finished:
        (unit,) = q.lease(9, 1, done=[], want=1).units
        q.lease(9, 1, done=[unit], want=0)
    assert q.tally()["trained_once"] == [4, 2] and q.tally()["trained_twice"] == [0, 0]


# --------------------------------------------------------------------------- the RPC


@pytest.fixture
def work_server() -> Iterator[tuple[str, ParameterService]]:
    grpc_server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_workers=3
    )
    try:
        yield address, service
    finally:
        stop_server(grpc_server, service)


def _register(address: str, work: pb.WorkSpec | None) -> None:
    chief = _client(address, 0)
    try:
        chief.register(_w0(), scheme="hogwild", options={"lr": 0.1}, num_workers=2, work=work)
    finally:
        chief.close()


def test_lease_work_over_grpc(work_server: tuple[str, ParameterService]) -> None:
    address, _ = work_server
    _register(address, pb.WorkSpec(samples=10, unit_size=4, epochs=1.0, seed=3))
    a, b = _client(address, 0), _client(address, 1)
    try:
        reply = a.lease_work([], 2)
        assert [(u.epoch, u.unit) for u in reply.units] == [(0, 0), (0, 1)]
        assert reply.status.units_per_epoch == 3 and reply.status.total_units == 3
        b.leave()
        assert b.lease_work([], 2).units == []  # it left: nothing for it
        reply = a.lease_work([(0, 0), (0, 1)], 2)
        assert [(u.epoch, u.unit) for u in reply.units] == [(0, 2)]
        reply = a.lease_work([(0, 2)], 0)
        assert reply.status.finished and list(reply.status.trained_once) == [3]
        info = a.info()[0]
        assert info.work.finished and list(info.work.never_trained) == [0]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("done", "want", "word"),
    [
        ([(1, 0)], 1, "epoch 1"),
        ([(0, 3)], 1, "unit 3"),
        ([], MAX_LEASE + 1, "want"),
        ([(0, 0)] * 1025, 1, "done units"),
    ],
)
def test_lease_work_refuses_bad_fields(
    work_server: tuple[str, ParameterService], done: list[tuple[int, int]], want: int, word: str
) -> None:
    address, service = work_server
    _register(address, pb.WorkSpec(samples=10, unit_size=4, epochs=1.0))
    client = _client(address, 1)
    try:
        client.lease_work([], 1)
        before = service.shard.work.state_dict()  # type: ignore[union-attr]
        with pytest.raises(RemoteError) as info:
            client.lease_work(done, want)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert word in info.value.message and "\n" not in info.value.message
        assert service.shard.work.state_dict() == before  # type: ignore[union-attr]
    finally:
        client.close()


def test_lease_work_beyond_max_workers_is_refused_and_changes_nothing(
    work_server: tuple[str, ParameterService],
) -> None:
    address, service = work_server  # max_workers 3
    _register(address, pb.WorkSpec(samples=10, unit_size=4, epochs=1.0))
    client = _client(address, 3)
    try:
        with pytest.raises(RemoteError) as info:
            client.lease_work([], 1)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.refusal is Refusal.RUN_FULL
        assert service.shard is not None and service.shard.membership.live == [0, 1]
        assert service.shard.work is not None and service.shard.work.leases == {}
    finally:
        client.close()


def test_lease_work_without_a_queue_and_bad_registrations(
    work_server: tuple[str, ParameterService],
) -> None:
    address, _ = work_server
    with pytest.raises(RemoteError) as bad:
        _register(address, pb.WorkSpec(samples=4, unit_size=8, epochs=1.0))
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unit_size" in bad.value.message
    _register(address, None)
    client = _client(address, 1)
    try:
        with pytest.raises(RemoteError) as info:
            client.lease_work([], 1)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.refusal is Refusal.NO_WORK
        with pytest.raises(RemoteError) as other:  # the same model with work: another run
            _register(address, pb.WorkSpec(samples=10, unit_size=4, epochs=1.0))
        assert other.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        client.close()


def test_a_restart_and_an_eviction_give_units_back(
    work_server: tuple[str, ParameterService],
) -> None:
    address, service = work_server
    _register(address, pb.WorkSpec(samples=12, unit_size=4, epochs=1.0))
    old, new = _client(address, 1, incarnation=5), _client(address, 1, incarnation=6)
    try:
        assert len(old.lease_work([], 2).units) == 2
        new.join()  # the restarted worker: a new incarnation
        assert [(u.epoch, u.unit) for u in new.lease_work([], 3).units] == [(0, 0), (0, 1), (0, 2)]
        assert service.shard is not None and service.shard.work is not None
        service.shard.membership.evict_after = 0.01
        time.sleep(0.05)
        service.shard.tick()  # evicts workers 0 and 1
        assert service.shard.work.leases == {}
        assert list(service.shard.work.returned) == [(0, 0), (0, 1), (0, 2)]
    finally:
        old.close()
        new.close()


def test_a_unit_is_reported_once_its_push_was_accepted_and_retrained_if_refused(
    work_server: tuple[str, ParameterService],
) -> None:
    address, _ = work_server
    _register(address, pb.WorkSpec(samples=12, unit_size=4, epochs=1.0, seed=2))
    client = _client(address, 1)
    data = TensorDataset(torch.arange(12))
    batches = LeasedBatches(data, ps=client, batch_size=4, seed=2, ahead=0)
    try:
        it = iter(batches)
        (first,) = next(it)
        batches.trained(0)  # its update goes with push 1
        batches.settle(deque([(1, False)]))  # refused (stale, lost): trained again
        assert batches.retrained == 1 and batches.ready == []
        (again,) = next(it)
        assert again.tolist() == first.tolist()
        batches.trained(1)
        outcomes = deque([(2, True)])
        batches.settle(outcomes)
        assert batches.ready == [(0, 0)] and not outcomes
        (second,) = next(it)  # the lease reports (0, 0)
        assert batches.status.units_done == 1
        batches.trained(2)
        status = batches.report(deque())  # push 3 never came: (0, 1) is not reported
        assert status.units_done == 1 and batches.held == [((0, 1), 2)]
        assert sorted(first.tolist() + second.tolist()) == sorted(
            epoch_order(12, 2, 0)[:8].tolist()
        )
    finally:
        client.close()


def test_sigterm_sets_the_stop_event_and_the_old_handler_comes_back() -> None:
    stop = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    restore = stop_on_sigterm(stop)
    assert restore is not None
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before


# --------------------------------------------------------------------------- elastic training


def _unit_of(samples: int, unit_size: int, seed: int, epochs: int) -> dict[frozenset[int], Any]:
    """Each unit's set of sample indices -> (epoch, unit)."""
    table = {}
    for epoch in range(epochs):
        order = epoch_order(samples, seed, epoch).tolist()
        for u in range(-(-samples // unit_size)):
            table[frozenset(order[u * unit_size : (u + 1) * unit_size])] = (epoch, u)
    return table


Plan = list[tuple[int, str, int]]
"""(chief batches, "start" or "stop", worker): once the chief has trained that many batches,
start (again) or stop that worker; in order."""


def _elastic(
    run_dir: Path,
    *,
    scheme_name: str,
    world: int,
    max_workers: int,
    plan: Plan | None = None,
    stop_after: dict[int, int] | None = None,
    samples: int = 96,
    epochs: float = 3.0,
) -> tuple[dict[int, list[list[int]]], dict[str, Any]]:
    """Workers of ``scheme_name`` under --world-size dynamic in threads, ``world`` registered
    and started, ``max_workers`` in the cluster; ``plan`` starts and stops workers as the chief
    goes; ``stop_after[r]``: worker r is asked to stop after that many batches. Returns each
    worker index's batches (sample indices, all its incarnations) and result.json."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    idx = torch.arange(samples)
    data = TensorDataset(torch.randn(samples, 4, generator=gen), torch.randn(samples, 3), idx)
    config = TrainConfig(
        batch_size=8, epochs=epochs, lr=0.05, log_every=1, world_size="dynamic", seed=4
    )
    spec = schemes.get(scheme_name)
    grpc_server, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        max_workers=max_workers,
    )
    seen: dict[int, list[list[int]]] = {r: [] for r in range(max_workers)}
    stops = {r: threading.Event() for r in range(max_workers)}
    errors: list[BaseException] = []

    def batch_fn_for(rank: int) -> Callable[[Any], tuple[Any, Any]]:
        def read(batch: Any) -> tuple[Any, Any]:
            x, y, i = batch
            seen[rank].append(i.tolist())
            if stop_after and len(seen[rank]) == stop_after.get(rank):
                stops[rank].set()
            time.sleep(0.01)  # a step takes a while, so the others come and go meanwhile
            return x, y

        return read

    def work(rank: int) -> None:
        try:
            env = TaskEnv(
                cluster={"ps": [address], "worker": ["127.0.0.1:0"] * max_workers},
                task_index=rank,
                scheme=scheme_name,
                run_dir=str(run_dir),
                rpc_timeout=10,
                wait_timeout=20,
                registered_workers=world,
            )
            run_worker(
                model=copy.deepcopy(model),
                loss_fn=F.mse_loss,
                train_set=data,
                test_set=None,
                config=config,
                env=env,
                scheme=spec.make_worker(spec.options(), world),
                batch_fn=batch_fn_for(rank),
                stop=stops[rank],
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    def start(rank: int) -> None:
        stops[rank] = threading.Event()
        threads[rank] = threading.Thread(target=work, args=(rank,), daemon=True)
        threads[rank].start()

    threads: dict[int, threading.Thread] = {}
    try:
        for r in range(world):
            start(r)
        todo = list(plan or [])
        deadline = time.monotonic() + 60
        while todo and threads[0].is_alive() and time.monotonic() < deadline:
            at, action, rank = todo[0]
            if len(seen[0]) < at:
                time.sleep(0.002)
                continue
            todo.pop(0)
            if action == "stop":
                stops[rank].set()
            else:
                if rank in threads:
                    threads[rank].join(timeout=30)  # its last incarnation left first
                start(rank)
        threads[0].join(timeout=60)
        for t in threads.values():
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads.values()), "a worker hung"
        if errors:
            raise errors[0]
        assert not todo, f"the run ended before the plan's {todo}"
        result = json.loads((run_dir / RESULT_FILE).read_text())
        return seen, result
    finally:
        stop_server(grpc_server, service)


def _assert_each_sample_once_per_epoch(
    seen: dict[int, list[list[int]]], result: dict[str, Any], samples: int, epochs: int
) -> Counter[int]:
    table = _unit_of(samples, 8, 4, epochs)
    units = Counter(table[frozenset(batch)] for batches in seen.values() for batch in batches)
    assert sorted(units) == sorted(table.values())  # every unit of every epoch ...
    assert set(units.values()) == {1}  # ... exactly once
    per_sample: Counter[int] = Counter(i for b in seen.values() for batch in b for i in batch)
    assert set(per_sample.values()) == {epochs} and len(per_sample) == samples
    work = result["work"]
    assert work["trained_once"] == epochs * 12 and work["units_per_epoch"] == 12
    assert work["trained_twice"] == 0 and work["never_trained"] == 0 and work["finished"]
    return Counter({r: len(b) for r, b in seen.items()})


def test_elastic_hogwild_trains_each_sample_once_per_epoch(tmp_path: Path) -> None:
    seen, result = _elastic(tmp_path, scheme_name="hogwild", world=2, max_workers=2)
    counts = _assert_each_sample_once_per_epoch(seen, result, 96, 3)
    assert counts[0] > 0 and counts[1] > 0  # both trained
    events = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    work = [e for e in events if e.get("event") == "work"]
    assert len(work) == 1 and work[0]["trained_twice"] == 0


def test_a_worker_stops_midway_and_a_new_index_joins(tmp_path: Path) -> None:
    seen, result = _elastic(
        tmp_path,
        scheme_name="hogwild",
        world=2,
        max_workers=3,
        plan=[(4, "start", 2)],
        stop_after={1: 5},
    )
    counts = _assert_each_sample_once_per_epoch(seen, result, 96, 3)
    assert counts[1] == 5  # it stopped after its fifth batch
    assert counts[2] > 0  # the newcomer (index >= num_workers) trained
    events = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [e["task"] for e in events if e.get("event") == "left"] == ["worker1"]


@pytest.mark.parametrize("scheme_name", ["sync", "easgd"])
def test_elastic_sync_and_easgd_lose_no_unit(tmp_path: Path, scheme_name: str) -> None:
    seen, result = _elastic(
        tmp_path, scheme_name=scheme_name, world=2, max_workers=2, stop_after={1: 6}
    )
    _assert_each_sample_once_per_epoch(seen, result, 96, 3)


# --------------------------------------------------------------------------- a real run


def test_a_killed_worker_and_a_worker_sent_sigterm_lose_no_unit_in_a_real_run(
    tmp_path: Path,
) -> None:
    """One run of 3 workers for two ways out (two runs before: the same claims, half the CPU).

    SIGTERM, how the launcher shrinks an elastic run: worker 2 pushes, reports its units,
    leaves with exit code 0 (no restart), and the others train its units. SIGKILL: worker 1's
    unreported units are leased again (its restart shows a new incarnation). Every unit is
    trained once and the demo still learns. (On a loaded machine the kill may come before
    worker 1 leased anything: then nothing goes back.)"""
    run_dir = tmp_path / "run"
    args = ["run", "--workers", "3", "--ps", "1", "--scheme", "hogwild", "--quiet"]
    args += ["--world-size", "dynamic", "--inject-fault", "kill:worker:1@step=300"]
    args += ["--epochs", DEMO_EPOCHS, "--run-dir", str(run_dir), str(DEMO)]
    proc = subprocess.Popen(
        distsgd_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def training() -> bool:
            path = run_dir / METRICS_FILE
            return path.is_file() and '"task": "worker2", "step"' in path.read_text()

        assert wait_for(training, 60), "worker2 never trained"
        os.kill(task_pids(run_dir)["worker2"], signal.SIGTERM)
        out, _ = loadclock.communicate(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert float(out.strip().splitlines()[-1].split(":")[1]) >= 0.95, out[-2000:]
    events = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    assert [e["task"] for e in events if e.get("event") == "left"] == ["worker2"]
    # worker 2 exited 0: no restart; worker 1's kill: one
    assert [e["target"] for e in events if e.get("event") == "fault"] == ["worker1"], events
    kill = next((i for i, e in enumerate(events) if e.get("event") == "fault_injected"), None)
    assert kill is not None, "no kill"
    if any(e["task"] == "worker1" and "loss" in e for e in events[:kill]):  # it was training
        ps_log = (run_dir / "logs" / "ps0.log").read_text()
        assert "restarted; " in ps_log, ps_log[-3000:]  # so its units went back to the queue
    work = json.loads((run_dir / RESULT_FILE).read_text())["work"]
    assert work["never_trained"] == 0 and work["trained_twice"] == 0, work
    assert work["trained_once"] == work["total_units"] > 0


@pytest.mark.parametrize("scheme_name", ["hogwild", "sync", "easgd"])
def test_workers_two_four_one_three_lose_no_unit(tmp_path: Path, scheme_name: str) -> None:
    """The elastic acceptance scenario in one process: 2 workers, then 4, then 1, then 3 (the
    stopped indexes come back as new incarnations)."""
    plan: Plan = [(3, "start", 2), (3, "start", 3)]
    plan += [(8, "stop", 1), (8, "stop", 2), (8, "stop", 3)]
    plan += [(12, "start", 1), (12, "start", 2)]
    seen, result = _elastic(
        tmp_path, scheme_name=scheme_name, world=2, max_workers=4, plan=plan, samples=192
    )
    table = _unit_of(192, 8, 4, 3)
    units = Counter(table[frozenset(b)] for batches in seen.values() for b in batches)
    assert sorted(units) == sorted(table.values()) and set(units.values()) == {1}
    work = result["work"]
    assert (work["trained_once"], work["trained_twice"], work["never_trained"]) == (72, 0, 0)
    assert all(seen[r] for r in range(4))  # every index trained
    events = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert sorted(e["task"] for e in events if e.get("event") == "left") == [
        "worker1",
        "worker2",
        "worker3",
    ]


def test_info_and_lease_work_cost_no_time_per_unit_with_millions_of_units() -> None:
    """With 2^22 units, what Info and LeaseWork do under the shard's lock (the WorkStatus, a
    lease with reports) takes well under a millisecond, not time proportional to the units
    (cc7a4d7: 0.2-0.9 s a call), and the queue holds a byte per unit (cc7a4d7: 32 MiB)."""
    import statistics
    import tracemalloc

    from distsgd.ps.member_plane import work_status

    tracemalloc.start()
    try:
        queue = WorkQueue(WorkSpec(samples=1 << 22, unit_size=1, epochs=1.0))
        memory = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert memory < 8 << 20, f"the queue of 2^22 units takes {memory / 2**20:.1f} MiB"
    held = queue.lease(0, 1, done=[], want=MAX_LEASE).units
    seconds = []
    for _ in range(5):
        began = time.perf_counter()
        held = queue.lease(0, 1, done=held[:4], want=4).units
        status = work_status(queue)
        seconds.append(time.perf_counter() - began)
    assert statistics.median(seconds) < 0.02, f"{statistics.median(seconds) * 1e3:.1f} ms a call"
    assert status.units_done == 20 and status.total_units == 1 << 22
    assert list(status.trained_once) == [20] and list(status.never_trained) == [(1 << 22) - 20]


def test_a_work_spec_beyond_the_unit_cap_is_refused_naming_the_fix(
    work_server: tuple[str, ParameterService],
) -> None:
    from distsgd.ps.work import MAX_TOTAL_UNITS

    with pytest.raises(ValueError, match="raise the unit size"):
        WorkSpec(samples=MAX_TOTAL_UNITS, unit_size=1, epochs=2.0)
    address, service = work_server
    with pytest.raises(RemoteError) as bad:
        _register(address, pb.WorkSpec(samples=MAX_TOTAL_UNITS + 1, unit_size=1, epochs=1.0))
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_TOTAL_UNITS) in bad.value.message and service.shard is None
