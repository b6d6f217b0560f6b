"""Membership on the servers (protocol 4): join, heartbeat, leave, eviction, the epoch, and the
rules that read the live number of workers (``world_size`` dynamic).

The servers run in this process on 127.0.0.1 (port 0) with a short eviction timeout.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import loadclock
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from distsgd import schemes
from distsgd.control.folder import METRICS_FILE
from distsgd.ps import ParameterClient, PartitionPlan, PushMeta, Shard, start_server
from distsgd.ps.client import Heartbeat
from distsgd.ps.membership import Membership, check_evict_after
from distsgd.ps.rules import MAX_WORKERS
from distsgd.ps.server import stop_server
from distsgd.ps.service import ParameterService
from distsgd.runtime import TaskEnv, TrainConfig, WorkerContext, run_worker
from distsgd.schemes import make_server_rule
from distsgd.schemes.downpour import DownpourOptions
from distsgd.schemes.easgd import EasgdOptions
from distsgd.transport import PushReject
from distsgd.transport.client import ShardClient
from distsgd.transport.errors import PROTOCOL_VERSION, Refusal, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.workers.downpour import DownpourWorker
from distsgd.workers.easgd import EasgdWorker

EVICT = 1.0
"""The servers' eviction timeout in these tests (seconds)."""


def _w0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }


def _grads(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _w0().items()}
        for _ in range(n)
    ]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- Membership itself


def test_registered_workers_are_members_at_epoch_zero() -> None:
    m = Membership(num_workers=3)
    assert m.live == [0, 1, 2] and m.epoch == 0 and m.max_workers == 3


def test_join_leave_and_eviction_bump_the_epoch_once_per_change() -> None:
    clock = _Clock()
    m = Membership(num_workers=2, max_workers=4, evict_after=10.0, clock=clock)
    assert not m.join(1, 7)  # a member already: nothing changes
    assert m.epoch == 0
    assert m.join(3, 1) and m.epoch == 1 and m.live == [0, 1, 3]
    assert m.leave(0) and m.epoch == 2 and m.live == [1, 3]
    assert not m.leave(0) and m.epoch == 2  # twice: no change
    clock.now += 5
    assert m.heartbeat(1, 7)
    clock.now += 6  # 3 silent for 11 s, 1 for 6 s
    assert m.evict() == [3] and m.epoch == 3 and m.live == [1]
    assert m.evict() == [] and m.epoch == 3
    assert not m.heartbeat(3, 1)  # evicted: not a member


def test_implicit_membership_readds_an_evicted_worker_but_not_one_that_left() -> None:
    clock = _Clock()
    m = Membership(num_workers=2, evict_after=1.0, clock=clock)
    clock.now += 2
    m.heartbeat(0, 0)
    assert m.evict() == [1] and m.epoch == 1
    assert m.see(1, 5) and m.live == [0, 1] and m.epoch == 2  # it pushed: it is alive
    assert m.leave(1) and m.epoch == 3
    assert not m.see(1, 5) and m.live == [0]  # a pull after its leave does not bring it back
    assert not m.see(-1, 0)  # tools are no members
    assert m.join(1, 6) and m.live == [0, 1] and m.epoch == 4  # an explicit join does


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e9])
def test_evict_after_out_of_range_is_a_one_line_error(bad: float) -> None:
    with pytest.raises(ValueError, match="--evict-after") as info:
        check_evict_after(bad)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- over gRPC


@pytest.fixture
def server() -> Iterator[tuple[str, ParameterService]]:
    grpc_server, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        evict_after=EVICT,
        max_workers=4,
    )
    try:
        yield address, service
    finally:
        stop_server(grpc_server, service)


def _register(address: str, scheme: str, options: dict[str, Any], num_workers: int) -> None:
    values = _w0()
    chief = ParameterClient(
        [address], PartitionPlan.from_arrays(values, 1), worker=0, retry_seconds=5.0
    )
    try:
        chief.register(values, scheme=scheme, options=options, num_workers=num_workers)
    finally:
        chief.close()


def _client(address: str, worker: int, incarnation: int = 1) -> ParameterClient:
    return ParameterClient(
        [address],
        PartitionPlan.from_arrays(_w0(), 1),
        worker=worker,
        incarnation=incarnation,
        timeout=10.0,
        retry_seconds=5.0,
    )


def _shard_client(address: str, worker: int, **kw: Any) -> ShardClient:
    return ShardClient(address, worker=worker, incarnation=3, retry_seconds=0.5, **kw)


SYNC = {"lr": 0.1, "momentum": 0.0, "required": 3, "step_timeout": 60.0}


def test_join_heartbeat_and_leave_over_grpc(server: tuple[str, ParameterService]) -> None:
    address, _ = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    with _shard_client(address, 3) as newcomer, _shard_client(address, 1) as one:
        reply = one.join()
        assert (reply.epoch, list(reply.members)) == (0, [0, 1])  # a registered worker
        assert reply.evict_after_seconds == EVICT and reply.max_workers == 4
        reply = newcomer.join()
        assert (reply.epoch, list(reply.members)) == (1, [0, 1, 3])
        assert newcomer.join().epoch == 1  # joining twice changes nothing
        beat = one.heartbeat()
        assert (beat.epoch, list(beat.members)) == (1, [0, 1, 3])
        one.leave()
        info = newcomer.info()
        assert (info.membership_epoch, list(info.members)) == (2, [0, 3])
        assert info.finished_workers == 1
        with pytest.raises(RemoteError) as err:
            one.heartbeat()  # it left: no longer a member
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.refusal is Refusal.NOT_MEMBER
        assert one.join().epoch == 3  # an explicit join brings it back
        assert newcomer.info().finished_workers == 0


def test_silent_member_is_evicted_after_the_timeout(server: tuple[str, ParameterService]) -> None:
    address, service = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    client = _client(address, 0)
    changes: list[tuple[int, int, list[int]]] = []
    try:
        joined = client.join()
        assert client.live_workers == 2
        beat = Heartbeat(client, joined, lambda *change: changes.append(change))
        try:
            began, watch = time.monotonic(), loadclock.Stopwatch()
            while service.shard is not None and 1 in service.shard.membership.members:
                assert watch.elapsed() < EVICT + 3.0, "worker 1 never evicted"
                time.sleep(0.02)
            took = time.monotonic() - began
            assert took >= EVICT - 0.1  # not before the timeout
            time.sleep(EVICT)  # the heartbeat thread sees the new epoch
        finally:
            beat.stop()
        info = client.info()[0]
        assert (info.membership_epoch, list(info.members)) == (1, [0])  # worker 0 heartbeats
        assert changes == [(0, 1, [0])]
        assert client.live_workers == 1  # what the heartbeat heard (2 at the join)
    finally:
        client.close()


def test_heartbeat_joins_again_after_an_eviction(server: tuple[str, ParameterService]) -> None:
    address, service = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 1)
    client = _client(address, 0)
    changes: list[tuple[int, int, list[int]]] = []
    try:
        joined = client.join()
        assert service.shard is not None
        with service.shard.cond:
            service.shard.membership.leave(0)  # as if evicted while it was away
            service.shard.membership.left.discard(0)
        beat = Heartbeat(client, joined, lambda *change: changes.append(change))
        try:
            deadline = time.monotonic() + 3.0
            while not changes and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            beat.stop()
        assert changes and changes[-1] == (0, 2, [0])
    finally:
        client.close()


def test_join_beyond_max_workers_is_refused_naming_the_flag(
    server: tuple[str, ParameterService],
) -> None:
    address, _ = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    with _shard_client(address, 3) as last, _shard_client(address, 4) as beyond:
        assert list(last.join().members) == [0, 1, 3]
        with pytest.raises(RemoteError) as err:
            beyond.join()
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.refusal is Refusal.RUN_FULL
        assert "--max-workers" in err.value.message and "\n" not in err.value.message
        assert not err.value.retryable
        assert last.info().membership_epoch == 1  # the refused join changed nothing


def test_default_max_workers_is_the_registered_number() -> None:
    grpc_server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
        with _shard_client(address, 2) as third:
            with pytest.raises(RemoteError) as err:
                third.join()
            assert err.value.refusal is Refusal.RUN_FULL
            with pytest.raises(RemoteError) as err:
                third.info()  # as before protocol 4: not a worker of this run
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stop_server(grpc_server, service)


def test_a_worker_up_to_max_workers_may_push_and_becomes_a_member(
    server: tuple[str, ParameterService],
) -> None:
    address, _ = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    client = _client(address, 3)
    try:
        client.pull()
        [result] = client.push(_grads(1)[0])
        assert result.accepted
        info = client.info()[0]
        assert (info.membership_epoch, list(info.members)) == (1, [0, 1, 3])
    finally:
        client.close()


@pytest.mark.parametrize("worker", [-1, -2, MAX_WORKERS, 2**31 - 1, -(2**31)])
def test_join_and_heartbeat_of_a_bad_index_are_invalid(
    server: tuple[str, ParameterService], worker: int
) -> None:
    address, _ = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    with _shard_client(address, worker) as bad, _shard_client(address, 0) as good:
        for call in (bad.join, bad.heartbeat):
            with pytest.raises(RemoteError) as err:
                call()
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT, call
            assert "\n" not in err.value.message
        info = good.info()
        assert (info.membership_epoch, list(info.members)) == (0, [0, 1])


def test_heartbeat_of_an_unknown_member_and_before_registration(
    server: tuple[str, ParameterService],
) -> None:
    address, _ = server
    with _shard_client(address, 1) as one:
        for call in (one.join, one.heartbeat):
            with pytest.raises(RemoteError) as err:
                call(retry=False) if call == one.join else call()
            assert err.value.refusal is Refusal.NOT_REGISTERED
        _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    with _shard_client(address, 2) as stranger:  # within max_workers, never joined
        with pytest.raises(RemoteError) as err:
            stranger.heartbeat()
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.refusal is Refusal.NOT_MEMBER
        assert stranger.info().membership_epoch == 0  # the refused heartbeat changed nothing


def test_join_with_another_protocol_version_is_refused(
    server: tuple[str, ParameterService],
) -> None:
    address, _ = server
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
    channel = grpc.insecure_channel(address)
    try:
        stub = pb_grpc.ParameterServerStub(channel)
        header = pb.RequestHeader(protocol_version=3, worker=1)
        for call in (stub.Join, stub.Heartbeat):
            request = (pb.JoinRequest if call is stub.Join else pb.HeartbeatRequest)(header=header)
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=5)
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"client speaks 3, server speaks {PROTOCOL_VERSION}" in (
                err.value.details() or ""
            )
    finally:
        channel.close()


# --------------------------------------------------------------------------- world_size


def _open_step(address: str, options: dict[str, Any]) -> tuple[list[ParameterClient], Any]:
    """Three registered workers; 0 and 1 push a gradient for step 0 and keep heartbeating,
    2 never calls. Returns the two clients and their heartbeats' stop."""
    _register(address, "sync", options, 3)
    clients = [_client(address, w) for w in (0, 1)]
    beats = []
    for client, grad in zip(clients, _grads(2), strict=True):
        beats.append(Heartbeat(client, client.join(), lambda *change: None))
        client.pull()
        [result] = client.push(grad)
        assert result.accepted

    def stop() -> None:
        for beat in beats:
            beat.stop()
        for client in clients:
            client.close()

    return clients, stop


def test_dynamic_sync_closes_the_open_step_when_a_silent_worker_is_evicted(
    server: tuple[str, ParameterService],
) -> None:
    address, service = server
    began = time.monotonic()
    clients, stop = _open_step(address, {**SYNC, "world_size": "dynamic"})
    try:
        version, values = clients[0].pull(min_version=1, wait_seconds=EVICT + 5.0)
        waited = time.monotonic() - began
        assert version == 1
        assert waited < EVICT + 3.0, f"the step closed only after {waited:.1f}s"
        w0, (g0, g1) = _w0(), _grads(2)
        for key in w0:  # the mean of the two gradients that came, not a third of their sum
            np.testing.assert_allclose(
                values[key], w0[key] - 0.1 * (g0[key] + g1[key]) / 2, rtol=0, atol=1e-6
            )
        assert service.shard is not None and service.shard.membership.live == [0, 1]
        assert service.shard.membership.epoch == 1
    finally:
        stop()


def test_fixed_sync_keeps_waiting_for_an_evicted_worker(
    server: tuple[str, ParameterService],
) -> None:
    address, service = server
    _, stop = _open_step(address, SYNC)
    try:
        deadline = time.monotonic() + EVICT + 3.0
        shard = service.shard
        assert shard is not None
        while 2 in shard.membership.members:
            assert time.monotonic() < deadline, "worker 2 never evicted"
            time.sleep(0.02)
        time.sleep(0.6)  # a few ticks after the eviction
        assert shard.version == 0  # fixed: the step waits (step_timeout) for all three
        assert sorted(shard.rule.contributors) == [0, 1]  # type: ignore[attr-defined]
    finally:
        stop()


def test_dynamic_sync_needs_a_newcomers_push_and_keeps_backups(
    server: tuple[str, ParameterService],
) -> None:
    address, service = server
    options = {**SYNC, "required": 2, "world_size": "dynamic"}  # 3 workers, 1 backup
    _register(address, "sync", options, 3)
    shard = service.shard
    assert shard is not None
    grads = [{f"{k}#0": v for k, v in g.items()} for g in _grads(4)]  # the pieces' keys
    meta = lambda w: PushMeta(worker=w, incarnation=1, base_version=0)  # noqa: E731
    shard.join(3, 1)  # 4 members, 1 backup: a step needs 3 pushes
    for w in (0, 1):
        assert shard.push(dict(grads[w]), meta(w))[0].accepted
    assert shard.version == 0
    assert shard.push(dict(grads[3]), meta(3))[0].accepted
    assert shard.version == 1
    outcome, _ = shard.push(dict(grads[2]), meta(2))
    assert outcome.reject is PushReject.STALE


def test_dynamic_world_size_with_every_worker_equals_fixed() -> None:
    results = []
    for world_size in ("fixed", "dynamic"):
        options = {**SYNC, "world_size": world_size}
        shard = Shard(
            index=0,
            scheme="sync",
            options_json=json.dumps(options),
            num_workers=3,
            values=_w0(),
            rule=make_server_rule("sync", options, 3),
        )
        for step in range(3):
            for w, grad in enumerate(_grads(3)):
                meta = PushMeta(worker=w, incarnation=1, base_version=step)
                assert shard.push({k: v * (step + 1) for k, v in grad.items()}, meta)[0].accepted
        assert shard.version == 3
        results.append(shard.values)
    for key in results[0]:
        np.testing.assert_array_equal(results[0][key], results[1][key])


@pytest.mark.parametrize(("world_size", "rate"), [("fixed", 0.5), ("dynamic", 1.0)])
def test_downpour_default_rate_follows_the_live_members(world_size: str, rate: float) -> None:
    config = TrainConfig(world_size=world_size)
    options = DownpourWorker(DownpourOptions(), 2).server_options(config)
    assert options.get("per_worker", False) is (world_size == "dynamic")
    options = {**options, "world_size": world_size}
    shard = Shard(
        index=0,
        scheme="downpour",
        options_json=json.dumps(options),
        num_workers=2,
        values=_w0(),
        rule=make_server_rule("downpour", options, 2),
    )
    shard.leave(1)
    update = _grads(1)[0]
    shard.push(dict(update), PushMeta(worker=0, incarnation=1, base_version=0))
    for key, value in _w0().items():
        np.testing.assert_allclose(shard.values[key], value - rate * update[key], atol=1e-6)


def test_an_explicit_server_rate_ignores_the_membership() -> None:
    options = DownpourWorker(DownpourOptions(server_lr=0.25), 2).server_options(
        TrainConfig(world_size="dynamic")
    )
    assert options == {"server_lr": 0.25}


@pytest.mark.parametrize("bad", ["elastic", "", 2, None, True])
def test_world_size_option_is_validated(server: tuple[str, ParameterService], bad: object) -> None:
    with pytest.raises(ValueError, match="world_size") as info:
        make_server_rule("sync", {**SYNC, "world_size": bad}, 3)
    assert "\n" not in str(info.value)
    address, _ = server
    with pytest.raises(RemoteError) as err:
        _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0, "world_size": bad}, 2)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "world_size" in err.value.message
    with pytest.raises(ValueError, match="world_size"):
        TrainConfig(world_size=str(bad))


def test_eviction_never_blocks_pushes_for_long(server: tuple[str, ParameterService]) -> None:
    """Pushes from several threads while members come and go: nothing deadlocks."""
    address, service = server
    _register(address, "sync", {**SYNC, "world_size": "dynamic"}, 3)
    shard = service.shard
    assert shard is not None
    errors: list[BaseException] = []

    def churn(worker: int) -> None:
        try:
            for i in range(50):
                shard.join(worker, i + 1)
                meta = PushMeta(worker=worker, incarnation=i + 1, base_version=shard.version)
                shard.push(dict(_grads(1)[0]), meta)
                shard.leave(worker)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(w,)) for w in (0, 1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads) and not errors
    assert shard.membership.epoch >= 3


membership_calls = st.lists(
    st.tuples(
        st.sampled_from(["Join", "Heartbeat", "Leave"]),
        st.one_of(st.integers(-2, 5), st.integers(-(2**31), 2**31 - 1)),
        st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION - 1, 0]),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(calls=membership_calls)
def test_fuzz_membership_calls_follow_the_model(calls: list[tuple[str, int, int]]) -> None:
    """Join, Heartbeat and Leave with any index and protocol version: each is answered OK
    exactly when the model says so, and the members and epoch the server reports are the
    model's (a refused call changes nothing)."""
    grpc_server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_workers=4
    )
    try:
        _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 2)
        members, epoch = {0, 1}, 0
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            for method, worker, version in calls:
                header = pb.RequestHeader(protocol_version=version, worker=worker, incarnation=1)
                valid = version == PROTOCOL_VERSION
                if method == "Join":
                    ok = valid and 0 <= worker < 4
                    request: Any = pb.JoinRequest(header=header)
                elif method == "Heartbeat":
                    ok = valid and worker in members
                    request = pb.HeartbeatRequest(header=header)
                else:
                    ok = valid and -1 <= worker < 4
                    request = pb.LeaveRequest(header=header)
                try:
                    reply = getattr(stub, method)(request, timeout=5)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                    assert code in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                    ), code
                assert (code == grpc.StatusCode.OK) == ok, (method, worker, version, code)
                if ok and method == "Join" and worker not in members:
                    members, epoch = members | {worker}, epoch + 1
                if ok and method == "Leave" and worker in members:
                    members, epoch = members - {worker}, epoch + 1
                if ok and method != "Leave":
                    assert (reply.epoch, list(reply.members)) == (epoch, sorted(members))
            tool = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=-1)
            info = stub.Info(pb.InfoRequest(header=tool))
            assert (info.membership_epoch, list(info.members)) == (epoch, sorted(members))
    finally:
        stop_server(grpc_server, service)


# --------------------------------------------------------------------------- the worker side


def _train_sync(world_size: str, run_dir: Path) -> tuple[int, dict[str, np.ndarray]]:
    """Two workers of sync through ``run_worker``; the server's final (version, values)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 3, generator=gen))
    config = TrainConfig(batch_size=4, steps=4, lr=0.1, log_every=1, world_size=world_size)
    spec = schemes.get("sync")
    grpc_server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            env = TaskEnv(
                cluster={"ps": [address], "worker": ["127.0.0.1:0"] * 2},
                task_index=rank,
                scheme="sync",
                run_dir=str(run_dir),
                rpc_timeout=10,
                wait_timeout=30,
            )
            run_worker(
                model=copy.deepcopy(model),
                loss_fn=F.mse_loss,
                train_set=data,
                test_set=None,
                config=config,
                env=env,
                scheme=spec.make_worker(spec.options(), 2),
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        if errors:
            raise errors[0]
        assert service.shard is not None
        return service.shard.version, {k: v.copy() for k, v in service.shard.values.items()}
    finally:
        stop_server(grpc_server, service)


def test_workers_join_log_membership_and_dynamic_equals_fixed(tmp_path: Path) -> None:
    runs = {}
    for world_size in ("fixed", "dynamic"):
        (tmp_path / world_size).mkdir()
        runs[world_size] = _train_sync(world_size, tmp_path / world_size)
        lines = (tmp_path / world_size / METRICS_FILE).read_text().splitlines()
        events = [r for r in map(json.loads, lines) if r.get("event") == "membership"]
        assert all({"time", "step", "task"} <= set(r) for r in events)  # as every line
        assert sorted((r["task"], r["ps"], r["epoch"], r["members"]) for r in events) == [
            ("worker0", 0, 0, [0, 1]),
            ("worker1", 0, 0, [0, 1]),
        ]
    (v_fixed, fixed), (v_dynamic, dynamic) = runs["fixed"], runs["dynamic"]
    assert v_fixed == v_dynamic == 4
    for key in fixed:
        np.testing.assert_array_equal(fixed[key], dynamic[key])


def test_dynamic_world_size_is_refused_under_a_collective_scheme() -> None:
    torch.manual_seed(0)
    spec = schemes.get("localsgd")
    with pytest.raises(ValueError, match="--world-size dynamic") as info:
        run_worker(
            model=nn.Linear(4, 3),
            loss_fn=F.mse_loss,
            train_set=TensorDataset(torch.randn(8, 4), torch.randn(8, 3)),
            test_set=None,
            config=TrainConfig(batch_size=4, steps=1, world_size="dynamic"),
            env=TaskEnv.standalone(),
            scheme=spec.make_worker(spec.options(), 1),
        )
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--evict-after", "0"),
        ("--evict-after", "nan"),
        ("--max-workers", "-1"),
        ("--max-workers", "70000"),
    ],
)
def test_server_flags_are_checked(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    from distsgd.cli.main import main

    cluster = ["--ps_hosts", "127.0.0.1:1", "--worker_hosts", "127.0.0.1:2", "--task", "0"]
    assert main(["server", *cluster, flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err


@pytest.mark.parametrize(
    ("world_size", "alpha", "live", "rate"),
    [("fixed", 0.0, 2, 0.3), ("dynamic", 0.0, 2, 0.45), ("dynamic", 0.25, 2, 0.25)],
)
def test_easgd_moving_rate_reads_the_live_workers(
    world_size: str, alpha: float, live: int, rate: float
) -> None:
    """alpha = 0.9 / workers: 3 registered, 2 live; a given alpha stays as it is."""
    client = _client("127.0.0.1:1", 0)
    try:
        client.members = [list(range(live))]
        ctx = WorkerContext(
            model=nn.Linear(2, 1),
            config=TrainConfig(world_size=world_size),
            rank=0,
            num_workers=3,
            device=torch.device("cpu"),
            ps=client,
        )
        worker = EasgdWorker(EasgdOptions(alpha=alpha), 3)
        assert worker.moving_rate(ctx) == pytest.approx(rate)
    finally:
        client.close()


def test_heartbeat_stops_promptly_when_the_server_is_gone() -> None:
    """A worker finishing while its server is down must not hang in the heartbeat thread."""
    grpc_server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, evict_after=EVICT
    )
    _register(address, "hogwild", {"lr": 0.1, "momentum": 0.0}, 1)
    client = _client(address, 0)
    try:
        beat = Heartbeat(client, client.join(), lambda *change: None)
        stop_server(grpc_server, service)
        time.sleep(EVICT)  # a beat or two fail meanwhile (logged, not raised)
        watch = loadclock.Stopwatch()
        beat.stop()
        assert watch.elapsed() < 3.0
        assert not beat._thread.is_alive()
    finally:
        client.close()
