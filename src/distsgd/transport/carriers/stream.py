"""The gRPC streams: a Pull's values in chunks after a header, a Push's chunks after its header
(see ``Pull`` and ``Push`` in the .proto). Always there; every other carrier falls back to it.
One try per call: the client retries (a pull) or not (a push may have been applied)."""

from __future__ import annotations

import grpc
import numpy as np

from distsgd.transport.carriers.base import Carrier, Payload
from distsgd.transport.codec import ChunkAssembler, header_then_chunks
from distsgd.transport.errors import RemoteError
from distsgd.transport.link import Link
from distsgd.transport.proto import distsgd_pb2 as pb


class StreamCarrier(Carrier):
    """Tensors in protobuf chunks of at most ``chunk_bytes`` on the gRPC streams."""

    def __init__(self, link: Link, chunk_bytes: int) -> None:
        self.link = link
        self.chunk_bytes = chunk_bytes

    def pull(
        self, request: pb.PullRequest, wait: float
    ) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        link = self.link
        stream = link.stub.Pull(request, timeout=wait + link.timeout, metadata=link.metadata)
        first = next(stream)
        if first.WhichOneof("part") != "header":
            raise RemoteError(link.address, "Pull", grpc.StatusCode.INTERNAL, "no header first")
        specs = first.header.tensors
        assembler = ChunkAssembler(specs, nbytes=link.pull_nbytes)
        for message in stream:
            assembler.add(message.chunk)
        values = assembler.finish()
        for spec in specs:
            values[spec.key] = link.decode_pulled(spec, values[spec.key])
        return first.header, values

    def carries(self, payload: Payload) -> bool:
        return True

    def push(self, header: pb.PushHeader, payload: Payload) -> pb.PushResponse:
        messages = header_then_chunks(pb.PushRequest, header, payload.arrays, self.chunk_bytes)
        link = self.link
        reply: pb.PushResponse = link.stub.Push(
            messages, timeout=link.timeout, metadata=link.metadata
        )
        return reply
