"""What a server validates is what it applies: a shared-memory push is copied out of the
segment before it is checked, so a process that rewrites the segment while the server reads it
can get a push refused (and counted) but never NaN into a parameter (issue 18, item 1)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from distsgd.ps import start_server, stop_server
from distsgd.ps.service import ParameterService
from distsgd.schemes import make_server_rule
from distsgd.transport import PROTOCOL_VERSION, PushReject, ShardClient, shm
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")

RUN = "race" + os.urandom(4).hex()
ELEMENTS = 1 << 16
"""Elements of the one piece: enough that the server's finiteness check takes a while."""

# The attacker: maps the segment by name (before the worker confirms it, while it still has
# one) and toggles the piece's last element between NaN and a finite value until killed or
# its time is up.
ATTACKER = """
import mmap, os, sys, time
import numpy as np
name, size, offset, count, seconds = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
fd = os.open("/dev/shm/" + name, os.O_RDWR)
buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)
piece = np.frombuffer(buf, np.float32, count, offset)
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(1000):
        piece[-1] = np.nan
        piece[-1] = 0.5
"""


@contextlib.contextmanager
def _server(scheme: str) -> Iterator[tuple[ParameterService, pb_grpc.ParameterServerStub]]:
    """A one-piece shard of ``scheme`` for one worker, and a raw stub to it."""
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        with ShardClient(address, worker=0, run_id=RUN, timeout=10.0) as client:
            client.register(
                shard_index=0,
                scheme=scheme,
                options_json=json.dumps(
                    {"lr": 0.01, **({"required": 1} if scheme == "sync" else {})}
                ),
                num_workers=1,
                tensors={"w#0": np.zeros(ELEMENTS, np.float32)},
            )
        with grpc.insecure_channel(address) as channel:
            yield service, pb_grpc.ParameterServerStub(channel)
    finally:
        stop_server(srv, service, grace=0.1)


HEADER = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
SPEC = pb.TensorSpec(key="w#0", dtype="float32", shape=[ELEMENTS])


def _attach(
    stub: pb_grpc.ParameterServerStub, before_confirm: Any = None
) -> tuple[pb.AttachResponse, shm.Segment, np.ndarray]:
    """Attach worker 0's segment (running ``before_confirm(reply)`` while it has a name) and
    confirm it; the reply, the worker's mapping, and its push area."""
    reply = stub.Attach(pb.AttachRequest(header=HEADER), timeout=5)
    segment = shm.Segment.open(reply.name, reply.size)
    if before_confirm is not None:
        before_confirm(reply)
    done = stub.Attach(
        pb.AttachRequest(header=HEADER, confirm=reply.segment, nonce=segment.nonce), timeout=5
    )
    assert done.confirmed
    area = segment.array(reply.push_offsets[0], np.dtype(np.float32), (ELEMENTS,))
    return reply, segment, area


def _push(stub: pb_grpc.ParameterServerStub, segment_id: int, version: int) -> pb.PushResponse:
    """A push of the segment's push area, computed on ``version`` (sync refuses stale ones)."""
    request = pb.PushHeader(header=HEADER, segment=segment_id, tensors=[SPEC], base_version=version)
    return stub.PushShared(request, timeout=10)


def _info(stub: pb_grpc.ParameterServerStub) -> pb.InfoResponse:
    return stub.Info(pb.InfoRequest(header=HEADER), timeout=5)


@pytest.mark.parametrize("scheme", ["hogwild", "sync"])
def test_nan_written_between_check_and_apply_never_reaches_the_parameters(scheme: str) -> None:
    """The segment is rewritten with NaN right after the server checked the push and before the
    rule applies it: the parameters stay finite (the rule applies the checked copy). A NaN
    written before the push is refused and counted."""
    with _server(scheme) as (service, stub):
        reply, segment, area = _attach(stub)
        shard = service.shard
        assert shard is not None
        real_apply = shard.rule.apply

        def poisoned_apply(*args: Any, **kwargs: Any) -> Any:
            area[:] = np.nan  # the worker (or anyone mapping the segment) writes now
            return real_apply(*args, **kwargs)

        shard.rule.apply = poisoned_apply  # type: ignore[method-assign]
        try:
            version = 0
            for _ in range(3):
                area[:] = 1.0
                answer = _push(stub, reply.segment, version)
                assert answer.accepted
                version = answer.version
            assert np.isfinite(shard.values["w#0"]).all()
            # NaN before the push: refused as non-finite, and counted.
            area[:] = 1.0
            area[7] = np.nan
            answer = _push(stub, reply.segment, version)
            assert not answer.accepted and answer.reject == PushReject.NONFINITE
            info = _info(stub)
            assert (info.pushes_accepted, info.nonfinite_rejected) == (3, 1)
            assert np.isfinite(shard.values["w#0"]).all()
        finally:
            shard.rule.apply = real_apply  # type: ignore[method-assign]
            segment.close()


@pytest.mark.parametrize("scheme", ["hogwild", "sync"])
def test_a_second_process_rewriting_the_segment_gets_no_nan_into_the_parameters(
    scheme: str,
) -> None:
    """Another process maps the worker's segment and toggles one element between NaN and a
    finite value while the worker pushes finite values (200 times at least): no parameter becomes
    non-finite, every push is answered, and every refusal is a counted non-finite one."""
    pushes = 200
    # At least this many pushes; more (up to ``budget`` seconds) until the attacker has hit one,
    # since on a loaded machine it may not be scheduled during the first ones (CI, stop 23).
    budget = 20.0
    attacker: list[subprocess.Popen[str]] = []

    def start_attacker(reply: pb.AttachResponse) -> None:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                ATTACKER,
                reply.name,
                str(reply.size),
                str(reply.push_offsets[0]),
                str(ELEMENTS),
                str(budget + 10),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        attacker.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    with _server(scheme) as (service, stub):
        try:
            reply, segment, area = _attach(stub, before_confirm=start_attacker)
            accepted = refused = version = 0
            began = time.monotonic()
            done = 0
            while done < pushes or (refused == 0 and time.monotonic() - began < budget):
                done += 1
                area[:] = 1.0
                answer = _push(stub, reply.segment, version)
                version = answer.version
                if answer.accepted:
                    accepted += 1
                else:
                    assert answer.reject == PushReject.NONFINITE, answer.reason
                    refused += 1
            elapsed = time.monotonic() - began
        finally:
            for proc in attacker:
                proc.kill()
                proc.wait(5)
                assert proc.stdout is not None
                proc.stdout.close()
        segment.close()
        shard = service.shard
        assert shard is not None
        info = _info(stub)
        assert accepted + refused == done
        assert (info.pushes_accepted, info.pushes_rejected) == (accepted, refused)
        assert info.nonfinite_rejected == refused
        assert np.isfinite(shard.values["w#0"]).all(), (
            f"{np.count_nonzero(~np.isfinite(shard.values['w#0']))} non-finite parameters after "
            f"{accepted} accepted and {refused} refused pushes"
        )
        assert refused > 0, f"the attacker never hit a push in {done} pushes, {elapsed:.1f}s"
