"""Tests for the parameter-server gRPC service, driven in-process over 127.0.0.1 (port 0)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import loadclock
import numpy as np
import pytest
from conftest import run_distsgd, wait_for

from distsgd.ps import ParameterClient, PartitionPlan, serve, start_server, stop_server
from distsgd.schemes import make_server_rule
from distsgd.transport import PROTOCOL_VERSION, Refusal, RemoteError, ShardClient
from distsgd.transport.codec import CHUNK_BYTES, iter_chunks, spec_of, specs_of
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

HOGWILD = {"lr": 0.5, "momentum": 0.0}


def _arrays() -> dict[str, np.ndarray]:
    return {
        "w#0": np.arange(12, dtype=np.float32).reshape(3, 4) / 10,
        "b#0": np.array([1.0, -2.0, 3.0], dtype=np.float32),
        "step#0": np.array([7.0], dtype=np.float64),
    }


@pytest.fixture
def server():
    """One in-process parameter server (shard 0); yields (address, service)."""
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        yield address, service
    finally:
        srv.stop(grace=None).wait(timeout=5)


@pytest.fixture
def two_servers():
    started = []
    try:
        for i in range(2):
            started.append(
                start_server(address="127.0.0.1:0", shard_index=i, rule_factory=make_server_rule)
            )
        yield [(address, service) for _, address, service in started]
    finally:
        for srv, _, _ in started:
            srv.stop(grace=None).wait(timeout=5)


def _client(address: str, **kw) -> ShardClient:
    kw.setdefault("timeout", 10.0)
    kw.setdefault("retry_seconds", 0.0)
    return ShardClient(address, **kw)


def _register(client: ShardClient, arrays=None, scheme="hogwild", options=None, num_workers=2):
    return client.register(
        shard_index=0,
        scheme=scheme,
        options_json=json.dumps(HOGWILD if options is None else options),
        num_workers=num_workers,
        tensors=_arrays() if arrays is None else arrays,
    )


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# --------------------------------------------------------------------------- happy paths


def test_register_pull_round_trip(server) -> None:
    address, service = server
    with _client(address, worker=0) as client:
        info = client.info()
        assert info.protocol_version == PROTOCOL_VERSION and not info.registered
        reply = _register(client)
        assert reply.created and reply.version == 0
        version, values = client.pull()
        assert version == 0
        _assert_same(values, _arrays())
        info = client.info()
        assert info.registered and info.scheme == "hogwild" and info.num_workers == 2
        assert [(t.key, t.dtype, list(t.shape)) for t in info.tensors] == [
            ("w#0", "float32", [3, 4]),
            ("b#0", "float32", [3]),
            ("step#0", "float64", [1]),
        ]
        # Registering the same model again is idempotent.
        again = _register(client)
        assert not again.created
    assert service.shard is not None


def test_push_applies_rule_and_bumps_version(server) -> None:
    address, _ = server
    with _client(address, worker=1) as client:
        _register(client)
        grad = {"b#0": np.array([1.0, 1.0, 2.0], dtype=np.float32)}
        result = client.push(base_version=0, tensors=grad)
        assert result.accepted and result.version == 1
        version, values = client.pull(min_version=1)
        assert version == 1
        np.testing.assert_allclose(values["b#0"], _arrays()["b#0"] - 0.5 * grad["b#0"])
        _assert_same({"w#0": values["w#0"]}, {"w#0": _arrays()["w#0"]})
        info = client.info()
        assert info.pushes_accepted == 1 and info.pushes_rejected == 0


def _count_pull_chunks(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        request = pb.PullRequest(
            header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=-1),
            wait_seconds=1.0,
        )
        parts = [m.WhichOneof("part") for m in stub.Pull(request, timeout=30)]
    assert parts[0] == "header"
    return parts.count("header"), parts.count("chunk")


@pytest.mark.parametrize("chunk_bytes", [None, 64 * 1024])
def test_ten_megabyte_tensor_travels(server, chunk_bytes) -> None:
    address, _ = server
    rng = np.random.default_rng(0)
    big = rng.standard_normal(10 * (1 << 20) // 4 + 123).astype(np.float32)  # ~10 MiB
    arrays = {"embedding#0": big, "bias#0": np.ones(5, np.float32)}
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    with _client(address, worker=0, timeout=60.0, **kw) as client:
        assert _register(client, arrays=arrays).created
        _, values = client.pull()
        _assert_same(values, arrays)
        grad = {"embedding#0": np.full_like(big, 2.0)}
        assert client.push(base_version=0, tensors=grad).accepted
        _, values = client.pull(min_version=1)
        np.testing.assert_allclose(values["embedding#0"], big - 1.0, rtol=0, atol=1e-6)
    headers, chunks = _count_pull_chunks(address)
    assert headers == 1
    # the server streamed the pull in chunks of at most CHUNK_BYTES (4 MiB - 64 KiB)
    assert chunks == -(-big.nbytes // CHUNK_BYTES) + 1 and chunks >= 4  # + the bias


def test_pull_before_register_fails_precondition(server) -> None:
    address, _ = server
    with _client(address, retry_seconds=0.0) as client:
        watch = loadclock.Stopwatch()
        with pytest.raises(RemoteError) as info:
            client.pull(wait_seconds=0.1)
        assert watch.elapsed() < 5
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "not registered" in info.value.message
    assert info.value.refusal is Refusal.NOT_REGISTERED  # typed: trailing metadata, not text
    assert info.value.retryable


def test_push_and_leave_before_register_fail_precondition(server) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        with pytest.raises(RemoteError) as push_err:
            client.push(base_version=0, tensors={"w#0": np.zeros((3, 4), np.float32)})
        with pytest.raises(RemoteError) as leave_err:
            client.leave()
    for err in (push_err.value, leave_err.value):
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not registered" in err.message
        assert err.refusal is Refusal.NOT_REGISTERED


def test_protocol_version_mismatch(server) -> None:
    address, _ = server
    with _client(address) as client:
        _register(client)
    bad = pb.RequestHeader(protocol_version=99, worker=0)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        calls = {
            "Info": lambda: stub.Info(pb.InfoRequest(header=bad), timeout=10),
            "Pull": lambda: list(
                stub.Pull(pb.PullRequest(header=bad, wait_seconds=0.1), timeout=10)
            ),
            "Push": lambda: stub.Push(
                iter([pb.PushRequest(header=pb.PushHeader(header=bad, base_version=0))]),
                timeout=10,
            ),
            "Leave": lambda: stub.Leave(pb.LeaveRequest(header=bad), timeout=10),
            "Register": lambda: stub.Register(
                iter(
                    [
                        pb.RegisterRequest(
                            header=pb.RegisterHeader(header=bad, scheme="hogwild", shard_index=0)
                        )
                    ]
                ),
                timeout=10,
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            details = info.value.details()
            assert "99" in details and str(PROTOCOL_VERSION) in details, name
            assert "version" in details, name


def _raw_push(address: str, messages: list[pb.PushRequest]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Push(iter(messages), timeout=10)
    return info.value


@pytest.mark.parametrize(
    ("tensors", "key"),
    [
        ({"w#0": np.zeros((4, 3), np.float32)}, "w#0"),  # wrong shape
        ({"b#0": np.zeros(3, np.float64)}, "b#0"),  # wrong dtype
        ({"w#0": np.zeros((3, 4), np.float32), "nope#0": np.zeros(3, np.float32)}, "nope#0"),
    ],
    ids=["shape", "dtype", "unknown-key"],
)
def test_bad_push_is_invalid_argument_and_changes_nothing(server, tensors, key) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        _register(client)
        with pytest.raises(RemoteError) as info:
            client.push(base_version=0, tensors=tensors)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert key in info.value.message
        version, values = client.pull()
        assert version == 0
        _assert_same(values, _arrays())


def test_truncated_push_is_invalid_argument(server) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        _register(client)
    grad = np.ones((3, 4), np.float32)
    header = pb.PushHeader(
        header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
        base_version=0,
        tensors=[spec_of("w#0", grad)],
    )
    chunks = list(iter_chunks([grad], chunk_bytes=16))
    err = _raw_push(
        address, [pb.PushRequest(header=header)] + [pb.PushRequest(chunk=c) for c in chunks[:-1]]
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "w#0" in err.details() and "truncated" in err.details()
    with _client(address) as client:
        version, values = client.pull()
    assert version == 0
    _assert_same(values, _arrays())


def test_stream_without_header_is_invalid_argument(server) -> None:
    address, _ = server
    with _client(address) as client:
        _register(client)
    chunk = pb.TensorChunk(index=0, offset=0, data=b"\0" * 12)
    err = _raw_push(address, [pb.PushRequest(chunk=chunk)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header" in err.details()
    err = _raw_push(address, [])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A second header in one stream is malformed too.
    header = pb.PushHeader(
        header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0), base_version=0
    )
    err = _raw_push(address, [pb.PushRequest(header=header), pb.PushRequest(header=header)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_register_different_model_already_exists(server) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        _register(client)
        other = dict(_arrays())
        other["w#0"] = np.zeros((4, 3), np.float32)
        with pytest.raises(RemoteError) as info:
            _register(client, arrays=other)
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(RemoteError) as info:
            _register(client, scheme="downpour", options={"server_lr": 1.0})
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        _, values = client.pull()
        _assert_same(values, _arrays())


def test_register_for_another_shard_is_invalid_argument(server) -> None:
    address, service = server
    with _client(address, worker=0) as client, pytest.raises(RemoteError) as info:
        client.register(
            shard_index=3,
            scheme="hogwild",
            options_json=json.dumps(HOGWILD),
            num_workers=1,
            tensors=_arrays(),
        )
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert service.shard is None


def test_register_unknown_scheme_is_invalid_argument(server) -> None:
    address, service = server
    with _client(address, worker=0) as client, pytest.raises(RemoteError) as info:
        _register(client, scheme="no-such-scheme", options={})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no-such-scheme" in info.value.message
    assert service.shard is None


def test_register_with_missing_rule_option_is_invalid_argument(server) -> None:
    address, service = server
    with _client(address, worker=0) as client, pytest.raises(RemoteError) as info:
        _register(client, scheme="sync", options={"lr": 0.1})  # no "required"
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert service.shard is None


def test_pull_min_version_not_reached_deadline_exceeded(server) -> None:
    address, _ = server
    with _client(address, worker=0, retry_seconds=0.0) as client:
        _register(client)
        started, watch = time.monotonic(), loadclock.Stopwatch()
        with pytest.raises(RemoteError) as info:
            client.pull(min_version=5, wait_seconds=0.5)
        elapsed = time.monotonic() - started
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "version 5" in info.value.message
    assert elapsed >= 0.4 and watch.elapsed() < 3.0


def test_pull_waits_for_min_version(server) -> None:
    """A pull for a future version returns as soon as a push reaches it."""
    address, _ = server

    def late_push() -> None:
        with _client(address, worker=1) as other:
            other.push(base_version=0, tensors={"b#0": np.ones(3, np.float32)})

    with _client(address, worker=0) as client:
        _register(client)
        timer = threading.Timer(0.3, late_push)
        watch = loadclock.Stopwatch()
        timer.start()
        try:
            version, values = client.pull(min_version=1, wait_seconds=10.0)
        finally:
            timer.join()
    assert watch.elapsed() < 5.0
    assert version == 1
    np.testing.assert_allclose(values["b#0"], _arrays()["b#0"] - 0.5)


def test_leave_counts_finished_workers(server) -> None:
    address, _ = server
    with _client(address, worker=0) as c0, _client(address, worker=1) as c1:
        _register(c0)
        c1.leave()
        c1.leave()  # idempotent
        info = c0.info()
    assert info.finished_workers == 1 and info.active_workers == 1


# --------------------------------------------------------------------------- two shards


def test_two_shards_with_parameter_client(two_servers) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "embedding": rng.standard_normal((300, 8)).astype(np.float32),
        "fc.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "fc.bias": rng.standard_normal(4).astype(np.float32),
        "scale": np.array(3.0, dtype=np.float64),
    }
    plan = PartitionPlan.from_arrays(arrays, 2)
    assert {pc.shard for pc in plan.pieces} == {0, 1}
    addresses = [address for address, _ in two_servers]
    client = ParameterClient(addresses, plan, worker=0, timeout=10.0, retry_seconds=5.0)
    try:
        client.register(arrays, scheme="hogwild", options=HOGWILD, num_workers=1)
        client.wait_registered(5.0)
        expected = plan.split(arrays)
        for i, (_, service) in enumerate(two_servers):
            assert service.shard is not None and service.shard.index == i
            have = service.shard.values
            assert set(have) == {pc.key for pc in plan.shard_pieces(i)}
            for key, value in expected[i].items():
                np.testing.assert_array_equal(have[key], value)
        version, pulled = client.pull()
        assert version == 0
        assert list(pulled) == list(arrays)
        for name, value in arrays.items():
            assert pulled[name].dtype == value.dtype and pulled[name].shape == value.shape
            np.testing.assert_array_equal(pulled[name], value)

        grads = {k: np.ones_like(v) for k, v in arrays.items()}
        results = client.push(grads)
        assert [r.accepted for r in results] == [True, True]
        version, pulled = client.pull(min_version=1)
        assert version == 1 and client.versions == [1, 1]
        for name, value in arrays.items():
            np.testing.assert_allclose(pulled[name], value - 0.5, rtol=0, atol=1e-6)
    finally:
        client.close()


def test_parameter_client_detects_different_model(two_servers) -> None:
    arrays = {"a": np.zeros(100, np.float32), "b": np.zeros(60, np.float32)}
    plan = PartitionPlan.from_arrays(arrays, 2)
    addresses = [address for address, _ in two_servers]
    client = ParameterClient(addresses, plan, worker=0, timeout=10.0, retry_seconds=5.0)
    other_plan = PartitionPlan.from_arrays({"a": np.zeros(100, np.float32)}, 2)
    other = ParameterClient(addresses, other_plan, worker=1, timeout=10.0, retry_seconds=5.0)
    try:
        client.register(arrays, scheme="hogwild", options=HOGWILD, num_workers=2)
        with pytest.raises(ValueError, match="different parameters"):
            other.wait_registered(5.0)
    finally:
        client.close()
        other.close()


def test_specs_of_preserves_order() -> None:
    arrays = _arrays()
    assert [s.key for s in specs_of(arrays)] == list(arrays)


def test_other_failed_preconditions_are_not_retried(server) -> None:
    """A run-id or protocol mismatch is FAILED_PRECONDITION without a refusal: not retried,
    whatever its message says."""
    address, _ = server
    with _client(address, worker=0, run_id="run-a") as client:
        _register(client)
    other = _client(address, worker=0, run_id="run-b (not registered)")
    with other, pytest.raises(RemoteError) as err:
        other.info()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.refusal is None and not err.value.retryable


# --------------------------------------------------------------------------- waiting pulls


def _waiting_pulls(address: str, count: int, results: list[object]) -> list[threading.Thread]:
    """``count`` pulls for a version that is not there yet, each in its own thread."""

    def pull() -> None:
        with _client(address, worker=0, retry_seconds=0.0) as client:
            try:
                results.append(client.pull(min_version=1, wait_seconds=20.0)[0])
            except RemoteError as exc:
                results.append(exc)

    threads = [threading.Thread(target=pull) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_waiting_pulls_cannot_starve_other_calls() -> None:
    """With 8 threads at most 6 pulls wait; a 7th is RESOURCE_EXHAUSTED (busy, retried), and
    Info and Push still answer at once, so the push that the waiting pulls wait for arrives."""
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_threads=8
    )
    results: list[object] = []
    try:
        assert service.max_waiting_pulls == 6
        with _client(address, worker=1) as client:
            _register(client)
            threads = _waiting_pulls(address, 6, results)
            deadline = time.monotonic() + 10
            while service.waiting_pulls < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert service.waiting_pulls == 6, "the six pulls did not start waiting"
            with pytest.raises(RemoteError) as err:
                client.pull(min_version=1, wait_seconds=20.0)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.refusal is Refusal.BUSY and err.value.retryable
            watch = loadclock.Stopwatch()
            assert client.info().version == 0
            grad = {"b#0": np.ones(3, np.float32)}
            assert client.push(base_version=0, tensors=grad).accepted
            assert watch.elapsed() < 2.0
            for thread in threads:
                thread.join(timeout=10)
        assert results == [1] * 6  # every waiting pull got version 1
        assert service.waiting_pulls == 0
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def test_stop_server_wakes_waiting_pulls_with_unavailable() -> None:
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_threads=8
    )
    results: list[object] = []
    with _client(address, worker=0) as client:
        _register(client)
    threads = _waiting_pulls(address, 3, results)
    time.sleep(0.3)
    watch = loadclock.Stopwatch()
    stop_server(srv, service)
    for thread in threads:
        thread.join(timeout=5)
    assert watch.elapsed() < 1.5
    assert len(results) == 3
    for result in results:
        assert isinstance(result, RemoteError), result
        assert result.code == grpc.StatusCode.UNAVAILABLE
        assert result.refusal is Refusal.CLOSING


def test_serve_with_a_waiting_pull_stops_within_a_second(tmp_path) -> None:
    """serve() used to take about 40 s to return with a pull waiting (the pull held a server
    thread for its whole wait_seconds); now it wakes the pull and returns within a second."""
    stop = threading.Event()
    address_file = tmp_path / "ps0.address"
    kw = {"address": "127.0.0.1:0", "shard_index": 0, "rule_factory": make_server_rule}
    # In a thread: on the main thread serve would take over SIGINT for the whole session.
    runner = threading.Thread(
        target=serve, kwargs={**kw, "stop": stop, "address_file": address_file}
    )
    runner.start()
    results: list[object] = []
    try:
        deadline = time.monotonic() + 10
        while not address_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        address = address_file.read_text().strip()
        with _client(address, worker=0) as client:
            _register(client)
        threads = _waiting_pulls(address, 1, results)
        time.sleep(0.3)
        assert not results  # it waits
    finally:
        watch = loadclock.Stopwatch()
        stop.set()
        runner.join(timeout=10)
    elapsed = watch.elapsed()
    threads[0].join(timeout=5)
    assert not runner.is_alive()
    assert elapsed < 1.5, f"serve took {elapsed:.2f}s to stop"
    assert isinstance(results[0], RemoteError) and results[0].code == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- ports


def test_second_server_on_the_same_port_fails(server, monkeypatch) -> None:
    """No SO_REUSEPORT: a second server cannot share a port (it used to, silently)."""
    address, _ = server
    with pytest.raises(OSError, match="in use") as err:
        start_server(address=address, shard_index=0, rule_factory=make_server_rule)
    assert "\n" not in str(err.value) and "port" in str(err.value)
    # Without the plain-socket check first, gRPC's own bind fails too (SO_REUSEPORT is off).
    from distsgd.ps import server as server_module

    monkeypatch.setattr(server_module, "_port_in_use", lambda host, port: False)
    with pytest.raises(OSError, match="cannot listen"):
        start_server(address=address, shard_index=0, rule_factory=make_server_rule)
    with _client(address) as client:  # the first server is unharmed
        assert not client.info().registered


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_args(port: int, address_file: Path | None = None) -> list[str]:
    args = ["server", "--task", "0", "--ps-hosts", f"127.0.0.1:{port}"]
    args += ["--worker-hosts", "127.0.0.1:0"]
    return args + (["--address-file", str(address_file)] if address_file else [])


def test_distsgd_server_on_a_busy_port_is_one_line(spawn, tmp_path: Path) -> None:
    """`distsgd server` on a port another server holds: exit 2 and exactly one line on stderr
    (distsgd's own; no gRPC C-core log line before it)."""
    address_file = tmp_path / "ps0.address"
    port = _free_port()
    first = spawn(_server_args(port, address_file))
    assert wait_for(address_file.exists, 60), "the first server did not start"
    done = run_distsgd(_server_args(port), timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("distsgd: error: cannot listen on") and "in use" in lines[0]
    assert first.poll() is None  # the first one is still serving


def test_distsgd_server_exits_within_a_second_of_sigterm(spawn, tmp_path: Path) -> None:
    """A ps process with a waiting pull used to need about 40 s to exit after SIGTERM."""
    address_file = tmp_path / "ps0.address"
    proc = spawn(_server_args(0, address_file))
    assert wait_for(address_file.exists, 60), "the server did not start"
    address = address_file.read_text().strip()
    with _client(address, worker=0) as client:
        _register(client)
    results: list[object] = []
    threads = _waiting_pulls(address, 1, results)
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    elapsed = time.monotonic() - started
    threads[0].join(timeout=5)
    assert proc.returncode == 0
    assert elapsed < 1.5, f"the ps took {elapsed:.2f}s to exit"
    assert isinstance(results[0], RemoteError) and results[0].code == grpc.StatusCode.UNAVAILABLE


def test_every_rpc_of_the_proto_is_routed_to_a_plane() -> None:
    """``ParameterService`` serves each RPC by its plane's method (``ROUTES``): an RPC added to
    the ``.proto`` and to no plane would answer UNIMPLEMENTED; one routed twice, or routed but
    not in the ``.proto``, is a mistake of the table."""
    from distsgd.ps.service import ROUTES
    from distsgd.transport.proto import distsgd_pb2

    service = distsgd_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    routed = [method for methods in ROUTES.values() for method in methods]
    assert sorted(routed) == sorted(m.name for m in service.methods)
