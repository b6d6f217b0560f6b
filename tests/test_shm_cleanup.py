"""The launcher's cleanup of shared-memory names removes only what this run's servers created,
by the exact names they recorded before creating them (issue 18, item 2.4)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import grpc
import numpy as np
import pytest

from distsgd.ps import start_server, stop_server
from distsgd.schemes import make_server_rule
from distsgd.transport import PROTOCOL_VERSION, ShardClient, shm
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")

RUN = "cleanup" + os.urandom(4).hex()


def test_cleanup_removes_recorded_unconfirmed_segments_and_nothing_else(tmp_path: Path) -> None:
    """A server with a checkpoint folder records each segment's name there (0600) before
    creating it; the cleanup removes a created-and-never-confirmed one, and leaves a file under
    the same prefix that the run did not create, and a recorded line naming anything else."""
    prefix = shm.run_prefix(RUN)
    foreign = shm.SHM_DIR / f"{prefix}notours"
    foreign.write_bytes(b"someone else's")
    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        checkpoint_dir=tmp_path / "checkpoints",
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
        header = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, run_id=RUN, worker=0)
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ParameterServerStub(channel).Attach(
                pb.AttachRequest(header=header), timeout=5
            )
        created = shm.SHM_DIR / reply.name
        assert created.exists()  # not confirmed: it still has its name
        record = tmp_path / "checkpoints" / "ps0.segments"
        assert record.read_text().splitlines() == [reply.name]
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
        with record.open("a") as out:  # lines that name what the run did not create
            out.write(f"../{foreign.name}\n{shm.run_prefix('other')}x\nnot a name\n")
        records = (tmp_path / "checkpoints").glob("ps*.segments")
        assert shm.remove_leftovers(records, prefix) == [reply.name]
        assert not created.exists()
        assert foreign.exists()
    finally:
        stop_server(srv, service, grace=0.1)
        foreign.unlink(missing_ok=True)
