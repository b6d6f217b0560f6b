"""Tensor bytes through shared memory between a worker and a server of the same host.

The contract (``Shared memory`` in the .proto): the server creates a segment only its user can
read, the worker proves with the nonce that it maps the same memory, the name is then removed
(so no file outlives the processes, whatever kills them), results equal the stream's bit for
bit, and every failure falls back to the stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import wait_for

from distsgd.ps import ParameterClient, PartitionPlan, start_server, stop_server
from distsgd.ps import segments as ps_segments
from distsgd.ps.service import ParameterService
from distsgd.schemes import make_server_rule
from distsgd.transport import PROTOCOL_VERSION, Refusal, ShardClient, bulk, shm
from distsgd.transport.carriers.attach import is_local_address
from distsgd.transport.carriers.segment import SegmentCarrier
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")

RUN = "shmtest" + os.urandom(4).hex()


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "fc.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "fc.bias": rng.standard_normal(64).astype(np.float32),
        "scale": np.array([2.0], dtype=np.float64),
    }


def _leftovers() -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.run_prefix(RUN)}*"))


@pytest.fixture
def servers() -> Iterator[list[tuple[str, ParameterService]]]:
    """Two in-process shards."""
    started = [
        start_server(address="127.0.0.1:0", shard_index=i, rule_factory=make_server_rule)
        for i in range(2)
    ]
    try:
        yield [(address, service) for _, address, service in started]
    finally:
        for srv, _, service in started:
            stop_server(srv, service, grace=0.1)


def _clients(
    addresses: list[str], shared: bool, worker: int = 0
) -> tuple[ParameterClient, dict[str, np.ndarray]]:
    model = _model()
    plan = PartitionPlan.from_arrays(model, len(addresses))
    client = ParameterClient(
        addresses, plan, worker=worker, run_id=RUN, timeout=10.0, shared_memory=shared
    )
    return client, model


def test_pull_and_push_through_shared_memory_equal_the_stream_bit_for_bit(servers) -> None:
    addresses = [a for a, _ in servers]
    shared, model = _clients(addresses, shared=True)
    stream, _ = _clients(addresses, shared=False, worker=1)
    try:
        shared.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=2)
        shared.wait_registered(5)
        rng = np.random.default_rng(1)
        for step in range(5):
            grads = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
            via = shared if step % 2 == 0 else stream
            via.push(grads)
            _, a = shared.pull(record=False)
            _, b = stream.pull(record=False)
            for key in model:
                assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
        assert shared.shared_memory_shards == 2 and stream.shared_memory_shards == 0
        # The values: the initial model minus 0.1 * every gradient, as the stream path says.
        into = {k: np.empty_like(v) for k, v in model.items()}
        version, out = shared.pull(into=into)
        assert version == 5 and all(out[k] is into[k] for k in model)
        assert np.array_equal(out["fc.bias"], b["fc.bias"])
        assert _leftovers() == []  # every confirmed segment has no name any more
    finally:
        shared.close()
        stream.close()


def test_a_released_pull_area_gives_its_pages_back_and_the_next_pull_fills_it(servers) -> None:
    model = {"big": np.arange(1 << 16, dtype=np.float32), "small": np.ones(3, np.float32)}
    plan = PartitionPlan.from_arrays(model, 1)
    client = ParameterClient(
        [servers[0][0]], plan, worker=0, run_id=RUN, timeout=10.0, shared_memory=True
    )
    try:
        client.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=1)
        client.wait_registered(5)
        _, views = client.shards[0].pull()  # views of the segment's pull area, by piece key
        big, small = sorted(views.values(), key=lambda v: -v.size)
        assert client.shared_memory_shards == 1 and np.array_equal(big, model["big"])
        client.release_pulled()
        # The pages wholly inside the 256 KB piece are gone (zeros); the 12-byte one keeps its
        # page, which it shares with its neighbours.
        assert (big == 0).mean() > 0.9 and np.array_equal(small, model["small"])
        into = {k: np.zeros_like(v) for k, v in model.items()}
        client.pull(into=into)
        assert all(np.array_equal(into[k], model[k]) for k in model)
    finally:
        client.close()


@contextlib.contextmanager
def _one_piece_shard(
    address: str,
) -> Iterator[tuple[pb_grpc.ParameterServerStub, pb.RequestHeader]]:
    """Register a one-piece Hogwild shard at ``address``; yield a raw stub and worker 0's
    request header for hand-made calls."""
    with ShardClient(address, worker=0, run_id=RUN, timeout=10.0) as client:
        client.register(
            shard_index=0,
            scheme="hogwild",
            options_json=json.dumps({"lr": 0.1}),
            num_workers=1,
            tensors={"w#0": np.ones(10, np.float32)},
        )
        with grpc.insecure_channel(address) as channel:
            header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
            yield pb_grpc.ParameterServerStub(channel), header


def test_a_segment_is_private_to_the_servers_user_and_loses_its_name_once_confirmed(
    servers,
) -> None:
    address, _ = servers[0]
    with _one_piece_shard(address) as (stub, header):
        reply = stub.Attach(pb.AttachRequest(header=header), timeout=5)
        path = shm.SHM_DIR / reply.name
        assert reply.name.startswith(shm.run_prefix(RUN)) and path.exists()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert reply.size >= shm.HEADER_BYTES + 2 * 40
        # A wrong nonce: refused as no-segment, and the segment is gone.
        with pytest.raises(grpc.RpcError) as wrong:
            stub.Attach(
                pb.AttachRequest(header=header, confirm=reply.segment, nonce=b"x" * 16),
                timeout=5,
            )
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert Refusal.from_metadata(wrong.value.trailing_metadata()) is Refusal.NO_SEGMENT
        assert not path.exists()
        # The right nonce: confirmed, and the name is removed.
        again = stub.Attach(pb.AttachRequest(header=header), timeout=5)
        segment = shm.Segment.open(again.name, again.size)
        done = stub.Attach(
            pb.AttachRequest(header=header, confirm=again.segment, nonce=segment.nonce), timeout=5
        )
        assert done.confirmed and not (shm.SHM_DIR / again.name).exists()
        # Another worker cannot use (or confirm) this worker's segment.
        other = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=-1)
        with pytest.raises(grpc.RpcError) as foreign:
            stub.PullShared(pb.PullRequest(header=other, segment=again.segment), timeout=5)
        assert Refusal.from_metadata(foreign.value.trailing_metadata()) is Refusal.NO_SEGMENT
        segment.close()


def test_an_unconfirmed_segment_is_removed_after_the_confirm_timeout(servers) -> None:
    address, service = servers[0]
    with _one_piece_shard(address) as (stub, header):
        reply = stub.Attach(pb.AttachRequest(header=header), timeout=5)
        assert (shm.SHM_DIR / reply.name).exists()
        service._segments.purge(time.monotonic() + ps_segments.CONFIRM_SECONDS / 2)
        assert (shm.SHM_DIR / reply.name).exists()
        service._segments.purge(time.monotonic() + ps_segments.CONFIRM_SECONDS + 1)
        assert not (shm.SHM_DIR / reply.name).exists() and len(service._segments) == 0


def test_a_restarted_server_is_reattached_and_a_push_to_it_is_not_lost(servers) -> None:
    """The server forgets the segment (as a restarted process would): the push that finds no
    segment is sent again over a new one, and training goes on through shared memory."""
    address, service = servers[0]
    client, model = _clients([address], shared=True)
    try:
        client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
        client.wait_registered(5)
        client.pull()
        assert client.shared_memory_shards == 1
        service._segments.close()  # every segment forgotten
        ones = {k: np.ones_like(v) for k, v in model.items()}
        (result,) = client.push(ones)
        assert result.accepted and result.version == 1
        _, values = client.pull()
        assert np.allclose(values["fc.bias"], model["fc.bias"] - 1.0)
        assert client.shared_memory_shards == 1 and len(service._segments) == 1
    finally:
        client.close()


def test_shared_memory_off_or_another_host_uses_the_stream(servers) -> None:
    address, service = servers[0]
    client, model = _clients([address], shared=False)
    try:
        client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
        client.pull()
        client.push({k: np.ones_like(v) for k, v in model.items()})
        assert client.shared_memory_shards == 0 and len(service._segments) == 0
    finally:
        client.close()
    assert is_local_address("127.0.0.1:5") and is_local_address("localhost:5")
    assert not is_local_address("192.0.2.1:5")  # TEST-NET-1: never this machine's address


def test_sigkill_of_server_and_worker_leaves_no_segment(tmp_path: Path) -> None:
    """A real server process and a real worker process, both SIGKILLed mid-run: nothing of
    theirs is left under /dev/shm (the names were removed at confirmation)."""
    address_file = tmp_path / "address"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distsgd",
            "server",
            "--job",
            "ps",
            "--task",
            "0",
            "--ps-hosts",
            "127.0.0.1:0",
            "--worker-hosts",
            "127.0.0.1:0",
            "--address-file",
            str(address_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = None
    try:
        wait_for(lambda: address_file.exists() and address_file.read_text().strip(), timeout=30)
        address = address_file.read_text().strip()
        ready = tmp_path / "ready"
        code = f"""
import time, numpy as np
from distsgd.ps import ParameterClient, PartitionPlan
m = {{"w": np.ones(1000, np.float32)}}
c = ParameterClient([{address!r}], PartitionPlan.from_arrays(m, 1), worker=0, run_id={RUN!r},
                    shared_memory=True)
c.register(m, scheme="hogwild", options={{"lr": 0.1}}, num_workers=1)
c.pull()
assert c.shared_memory_shards == 1
open({str(ready)!r}, "w").close()
while True:
    c.push({{"w": np.ones(1000, np.float32)}}); c.pull()
"""
        worker = subprocess.Popen([sys.executable, "-c", code])
        wait_for(ready.exists, timeout=60)
        for proc in (worker, server):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        assert _leftovers() == []
    finally:
        for proc in (worker, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


# --------------------------------------------------------------------------- tensor sockets


def _socket_client(address: str, worker: int = 0, **kw) -> tuple[ParameterClient, dict]:
    model = _model()
    client = ParameterClient(
        [address],
        PartitionPlan.from_arrays(model, 1),
        worker=worker,
        run_id=RUN,
        timeout=10.0,
        tensor_socket=True,
        **kw,
    )
    return client, model


@pytest.mark.parametrize("wire_dtype", ["float32", "bf16"])
def test_a_tensor_socket_carries_pulls_and_pushes_bit_for_bit(servers, wire_dtype) -> None:
    address, _ = servers[0]
    via_socket, model = _socket_client(address, wire_dtype=wire_dtype)
    stream = ParameterClient(
        [address],
        PartitionPlan.from_arrays(model, 1),
        worker=1,
        run_id=RUN,
        timeout=10.0,
        wire_dtype=wire_dtype,
    )
    try:
        via_socket.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=2)
        rng = np.random.default_rng(3)
        for step in range(4):
            grads = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
            (via_socket if step % 2 == 0 else stream).push(grads)
            _, a = via_socket.pull(record=False)
            _, b = stream.pull(record=False)
            for key in model:
                assert np.array_equal(a[key], b[key]), key
        assert via_socket.tensor_socket_shards == 1 and stream.tensor_socket_shards == 0
        assert via_socket.shared_memory_shards == 0
        version, _ = via_socket.pull()
        assert version == 4
    finally:
        via_socket.close()
        stream.close()


def test_a_tensor_socket_needs_its_token_and_a_refused_push_closes_it(servers) -> None:
    address, _ = servers[0]
    client, model = _socket_client(address)
    try:
        client.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=1)
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
        reply = stub.Attach(pb.AttachRequest(header=header, socket=True), timeout=5)
        assert reply.port and len(reply.token) == bulk.TOKEN_BYTES
        host = address.rsplit(":", 1)[0]
        with pytest.raises(bulk.SocketClosed):  # a wrong token: closed without the ack
            bulk.connect(host, reply.port, reply.segment, b"\0" * bulk.TOKEN_BYTES, 5.0)
        sock = bulk.connect(host, reply.port, reply.segment, reply.token, 5.0)
        with pytest.raises(bulk.SocketClosed):  # a token serves once
            bulk.connect(host, reply.port, reply.segment, reply.token, 5.0)
        # A tensor socket's requests travel on it, never by gRPC.
        bad = pb.PushHeader(header=header, segment=reply.segment, lr_scale=float("nan"))
        with pytest.raises(grpc.RpcError) as info:
            stub.PushShared(bad, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert Refusal.from_metadata(info.value.trailing_metadata()) is Refusal.NO_SEGMENT
        # On the socket, a push whose header is refused (NaN lr_scale) is answered with the
        # code gRPC would have given, and the socket is closed.
        bulk.send_frame(sock, pb.CHANNEL_FRAME_PUSH, bad.SerializeToString(), 5.0)
        kind, body = bulk.recv_frame(sock, deadline=time.monotonic() + 5)
        error = pb.ChannelError.FromString(body)
        assert kind == pb.CHANNEL_FRAME_ERROR
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "lr_scale" in error.message
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed by the server
        sock.close()
        # The client that trains through its own socket is untouched by all this.
        client.push({k: np.ones_like(v) for k, v in model.items()})
        assert client.pull()[0] == 1
    finally:
        client.close()


def test_a_segment_requests_on_its_data_channel_except_under_tls() -> None:
    """A server without TLS offers a segment's worker a data channel, and the worker's pulls
    and pushes travel on it (no PullShared or PushShared call by gRPC); a TLS server offers
    none, and the same requests go by gRPC, with the same results."""
    results = []
    for tls in (False, True):
        srv, address, service = start_server(
            address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
        )
        service.tls = tls  # what start_server(tls=...) sets; certificates are tested elsewhere
        client, model = _clients([address], shared=True)
        try:
            client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
            client.wait_registered(5)
            client.pull()
            (shard,) = client.shards
            carrier = shard.carrier
            assert shard.uses_shared_memory and isinstance(carrier, SegmentCarrier)
            assert (carrier.sock is None) is tls
            client.push({k: np.ones_like(v) for k, v in model.items()})
            results.append(client.pull())
        finally:
            client.close()
            stop_server(srv, service, grace=0.1)
    (v0, a0), (v1, a1) = results
    assert v0 == v1 == 1
    assert all(np.array_equal(a0[k], a1[k]) for k in a0)


def test_a_data_channel_refuses_malformed_frames_and_another_segment(servers) -> None:
    """Garbage where a PullRequest should be, an unknown frame kind and a request for another
    worker's segment are each answered INVALID_ARGUMENT and close the channel; the segment of a
    closed channel is dropped."""
    address, service = servers[0]
    client, model = _socket_client(address)
    try:
        client.register(model, scheme="hogwild", options={"lr": 0.1}, num_workers=2)
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        host = address.rsplit(":", 1)[0]
        header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
        worker1 = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=1)
        other = stub.Attach(pb.AttachRequest(header=worker1, socket=True), timeout=5)
        wrong_segment = pb.PullRequest(header=header, segment=other.segment)
        frames = [
            (pb.CHANNEL_FRAME_PULL, b"\xff\xff\xff"),
            (7, b""),
            (pb.CHANNEL_FRAME_PULL, wrong_segment.SerializeToString()),
        ]
        for kind, body in frames:
            reply = stub.Attach(pb.AttachRequest(header=header, socket=True), timeout=5)
            sock = bulk.connect(host, reply.port, reply.segment, reply.token, 5.0)
            bulk.send_frame(sock, kind, body, 5.0)
            got, answer = bulk.recv_frame(sock, deadline=time.monotonic() + 5)
            assert got == pb.CHANNEL_FRAME_ERROR
            assert (
                pb.ChannelError.FromString(answer).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            )
            sock.settimeout(5)
            assert sock.recv(1) == b""
            sock.close()
            assert wait_for(lambda r=reply: service._segments.get(r.segment, 0) is None, 5)
    finally:
        client.close()


def test_a_tls_server_offers_no_tensor_socket_and_its_workers_use_the_stream(servers) -> None:
    """A server whose calls are encrypted (``tls``) refuses Attach(socket), typed, and its
    clients push and pull over the stream instead."""
    address, service = servers[0]
    service.tls = True  # what start_server(tls=...) sets; certificates are tested elsewhere
    client, model = _socket_client(address)
    try:
        client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Attach(pb.AttachRequest(header=header, socket=True), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert Refusal.from_metadata(info.value.trailing_metadata()) is Refusal.NO_SHARED_MEMORY
        client.push({k: np.ones_like(v) for k, v in model.items()})
        version, values = client.pull()
        assert version == 1 and np.allclose(values["fc.bias"], model["fc.bias"] - 1)
        assert client.tensor_socket_shards == 0 and service.shared._bulk is None
    finally:
        client.close()
