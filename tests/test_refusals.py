"""Refused calls change nothing, and malformed ones are answered INVALID_ARGUMENT (issue 18,
item 2)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import wait_for

from distsgd.ps import start_server, stop_server
from distsgd.ps.service import ParameterService
from distsgd.schemes import make_server_rule
from distsgd.transport import PROTOCOL_VERSION, Refusal, ShardClient, bulk
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

RUN = "refuse" + os.urandom(4).hex()


@contextlib.contextmanager
def _shard(
    max_workers: int = 4,
) -> Iterator[tuple[str, ParameterService, pb_grpc.ParameterServerStub]]:
    """A registered one-piece hogwild shard of 1 worker that takes worker indexes up to
    ``max_workers``; its address, service and a raw stub."""
    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        max_workers=max_workers,
    )
    try:
        with ShardClient(address, worker=0, run_id=RUN, timeout=10.0) as client:
            client.register(
                shard_index=0,
                scheme="hogwild",
                options_json=json.dumps({"lr": 0.1}),
                num_workers=1,
                tensors={"w#0": np.ones(10, np.float32)},
            )
        with grpc.insecure_channel(address) as channel:
            yield address, service, pb_grpc.ParameterServerStub(channel)
    finally:
        stop_server(srv, service, grace=0.1)


def _header(worker: int) -> pb.RequestHeader:
    return pb.RequestHeader(
        protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=worker, incarnation=7
    )


def test_a_refused_pull_shared_makes_no_member() -> None:
    """A PullShared naming no segment (or another worker's) is refused NO_SEGMENT and leaves
    the membership as it was: the caller is not made a member, the epoch does not move."""
    with _shard() as (_, service, stub):
        before = stub.Info(pb.InfoRequest(header=_header(-1)), timeout=5)
        assert list(before.members) == [0]
        other = stub.Attach(pb.AttachRequest(header=_header(0)), timeout=5)
        for segment in (0, 12345, other.segment):
            with pytest.raises(grpc.RpcError) as info:
                stub.PullShared(pb.PullRequest(header=_header(2), segment=segment), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert Refusal.from_metadata(info.value.trailing_metadata()) is Refusal.NO_SEGMENT
        after = stub.Info(pb.InfoRequest(header=_header(-1)), timeout=5)
        assert after.membership_epoch == before.membership_epoch
        assert list(after.members) == [0]
        assert service.shard is not None and 2 not in service.shard.incarnations
        # A pull that is not refused does make its worker a member.
        list(stub.Pull(pb.PullRequest(header=_header(2)), timeout=5))
        joined = stub.Info(pb.InfoRequest(header=_header(-1)), timeout=5)
        assert joined.membership_epoch == before.membership_epoch + 1
        assert list(joined.members) == [0, 2]


def test_a_pull_refused_busy_makes_no_member() -> None:
    """A pull that would wait while every waiting place is taken is refused BUSY, and the
    caller is not made a member."""
    with _shard() as (_, service, stub):
        service.max_waiting_pulls = 1
        service.data._waiting[-1] = (9, 5, 0.0)  # every place taken (by a worker 9)
        try:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Pull(pb.PullRequest(header=_header(3), min_version=5), timeout=5))
        finally:
            service.data._waiting.clear()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        after = stub.Info(pb.InfoRequest(header=_header(-1)), timeout=5)
        assert list(after.members) == [0] and after.membership_epoch == 0


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(bulk.FRAME.pack(pb.CHANNEL_FRAME_PULL, 1000) + b"x" * 10, id="short-body"),
        pytest.param(bulk.FRAME.pack(pb.CHANNEL_FRAME_PULL, 1000)[:2], id="partial-head"),
    ],
)
def test_a_frame_that_stops_coming_closes_its_data_channel(monkeypatch, sent: bytes) -> None:
    """A data-channel frame whose head announces 1000 bytes followed by 10 (or a head cut
    short) loses its channel once the frame's deadline passes: the server closes the
    connection and drops its segment instead of holding a thread."""
    monkeypatch.setattr(bulk, "FRAME_SECONDS", 0.5, raising=False)
    with _shard() as (address, service, stub):
        reply = stub.Attach(pb.AttachRequest(header=_header(0), socket=True), timeout=5)
        sock = bulk.connect(address.rsplit(":", 1)[0], reply.port, reply.segment, reply.token, 5)
        try:
            began = time.monotonic()
            sock.sendall(sent)
            sock.settimeout(10)
            try:
                closed = sock.recv(1) == b""
            except ConnectionResetError:
                closed = True
            took = time.monotonic() - began
        finally:
            sock.close()
        assert closed
        assert took < 5, f"the server held the channel {took:.1f}s"
        assert wait_for(lambda: service._segments.get(reply.segment, 0) is None, 5)


GARBAGE = b"\xff\xff\xff\xff"
"""Not a protobuf message of any type (a field tag that never ends)."""


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("Info", "unary_unary"),
        ("Join", "unary_unary"),
        ("PushShared", "unary_unary"),
        ("Pull", "unary_stream"),
        ("Register", "stream_unary"),
        ("Push", "stream_unary"),
    ],
)
def test_an_unparseable_request_is_answered_invalid_argument(method: str, kind: str) -> None:
    """Bytes that are not the method's request message are answered INVALID_ARGUMENT (not
    grpcio's INTERNAL "Exception deserializing request!"), unary and streamed alike, and the
    shard is unchanged."""
    with _shard() as (address, service, _), grpc.insecure_channel(address) as channel:
        path = f"/{pb.DESCRIPTOR.services_by_name['ParameterServer'].full_name}/{method}"
        call = getattr(channel, kind)(path)  # no serializers: raw bytes both ways
        with pytest.raises(grpc.RpcError) as info:
            if kind == "unary_unary":
                call(GARBAGE, timeout=5)
            elif kind == "unary_stream":
                list(call(GARBAGE, timeout=5))
            else:
                call(iter([GARBAGE]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "malformed" in (info.value.details() or "")
        assert service.shard is not None and service.shard.version == 0
