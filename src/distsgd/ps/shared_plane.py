"""The data plane of the parameter-server service (protocol 2; see the .proto): Attach of a
shared-memory segment or a tensor socket, PullShared and PushShared over gRPC, and the data
channel serving a tensor socket's frames. A push from a segment is copied, exactly the announced
bytes, into the entry's server-private ``scratch`` under its lock before it is checked and
applied. The server maps a segment smaller than :data:`MAPPED_SEGMENT_BYTES` and reaches a
larger one through its descriptor alone (``pread``, ``pwrite``): a large model's workers' areas
are not in its memory. Push buffers come from the shard's bounded
:class:`~distsgd.ps.segments.ScratchPool`."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np

from distsgd.ps import channel, checks
from distsgd.ps.compression import Encoding
from distsgd.ps.data_plane import DataPlane, apply_push
from distsgd.ps.pull_encoding import encode_pull
from distsgd.ps.segments import Attached, Layout, SegmentTable
from distsgd.ps.service_errors import abort, clip, guarded
from distsgd.ps.shard import Shard
from distsgd.ps.shard_holder import ShardHolder
from distsgd.transport import bulk, shm
from distsgd.transport.codec import (
    WireError,
    is_encoded,
    nbytes_of,
)
from distsgd.transport.errors import Refusal
from distsgd.transport.proto import distsgd_pb2 as pb

MAPPED_SEGMENT_BYTES = 64 << 20
"""Segments (a worker's pull and push areas) below this size are mapped into the server, whose
copies in and out are then ``memcpy``; larger ones are reached through their descriptor, so
that their pages never count in the server's memory (600 MB for 2 workers of a 150 MB shard).
Measured through one server (``benchmarks/run.py`` figure 5, 4 MB, one run each on
2026-12-06): shared-memory pulls at 2.9 GB/s mapped against 2.3 through the descriptor."""

RPC_BYTES_SECONDS = 120.0
"""How long a data-channel request may take (its wait for a version and its bytes)."""


class SharedPlane:
    """The shared-memory and tensor-socket RPCs (Attach, PullShared, PushShared, and a data
    channel's frames) on ``holder``'s shard, to which
    :class:`~distsgd.ps.service.ParameterService` routes them. ``data`` lends its pull checks,
    its wait for a version and its apply; ``segments`` holds the attachments; ``host``: where
    tensor sockets are offered ("" = none), ``tls``: the server encrypts (no tensor sockets);
    ``segment_record``: where each segment's name is recorded before it is created (None:
    nowhere), so that the launcher removes exactly the names a killed server left
    (``shm.remove_leftovers``)."""

    def __init__(
        self,
        holder: ShardHolder,
        data: DataPlane,
        segments: SegmentTable,
        *,
        host: str,
        tls: bool,
        segment_record: Path | None,
    ) -> None:
        self.holder = holder
        self.data = data
        self.segments = segments
        self.host = host
        self.tls = tls
        self.segment_record = segment_record
        self._bulk: bulk.Listener | None = None
        self._bulk_lock = threading.Lock()

    def close(self) -> None:
        """Close the tensor sockets' listener, if one was opened."""
        if self._bulk is not None:
            self._bulk.close()

    def _attached(
        self, segment_id: int, header: pb.RequestHeader, context: grpc.ServicerContext
    ) -> Attached:
        entry = self.segments.get(segment_id, header.worker)
        if entry is None or not entry.confirmed:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ps{self.holder.index} holds no confirmed segment {segment_id} of worker "
                f"{header.worker}; attach again (or send over the stream)",
                Refusal.NO_SEGMENT,
            )
        if entry.stale:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.holder.index}'s pieces moved since segment {segment_id} was attached; "
                "attach again",
                Refusal.NO_SEGMENT,
            )
        return entry

    def _listener(self) -> bulk.Listener:
        with self._bulk_lock:
            if self._bulk is None:
                self._bulk = bulk.Listener(self.host, self._accept_channel)
            return self._bulk

    @property
    def offers_channels(self) -> bool:
        """Whether this server offers data channels (tensor sockets among them): not with TLS
        (they are unencrypted), and only where it has an address to offer them on."""
        return not self.tls and bool(self.host)

    def _accept_channel(
        self, segment_id: int, token: bytes, sock: socket.socket
    ) -> bulk.Serve | None:
        entry = self.segments.bind_socket(segment_id, token, sock)
        if entry is None:
            return None

        def handle(
            kind: int, body: bytes, context: channel.ChannelContext
        ) -> tuple[Any, list[np.ndarray]]:
            ctx = cast(grpc.ServicerContext, context)
            if kind == pb.CHANNEL_FRAME_PULL:
                return self._pull_shared(channel.parse(pb.PullRequest, body, context), ctx, entry)
            if kind == pb.CHANNEL_FRAME_PUSH:
                request = channel.parse(pb.PushHeader, body, context)
                return self._push_shared(request, ctx, entry), []
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"unknown data-channel frame {kind}")

        return functools.partial(
            channel.serve,
            sock,
            handle=handle,
            closing=lambda: self.holder.closing,
            seconds=RPC_BYTES_SECONDS,
            on_close=lambda: self.segments.remove(entry),
            name=f"ps{self.holder.index} data channel of worker {entry.worker}",
        )

    @guarded
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        self.holder.unless_closing(context)
        worker = request.header.worker
        if request.confirm:
            return self._confirm_attach(request, worker, context)
        with shard.cond:
            layout = Layout.of(shard.values)
        if request.socket:
            return self._attach_socket(worker, layout, context)
        if not shm.available():
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.holder.index} has no shared memory ({shm.SHM_DIR}); use the stream",
                Refusal.NO_SHARED_MEMORY,
            )
        try:
            segment = shm.Segment.create(  # a large one reached through its descriptor
                shm.run_prefix(shard.run_id),
                layout.size,
                record=self.segment_record,
                mapped=layout.size < MAPPED_SEGMENT_BYTES,
            )
        except shm.SegmentError as exc:
            abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ps{self.holder.index}: {exc.strerror or exc}; using the stream instead",
                Refusal.TOO_LARGE,
            )
        token = bulk.new_token() if self.offers_channels else b""
        entry = self.segments.add(worker, segment, layout, token)
        return _attach_reply(entry, self._listener().port if token else 0)

    def _confirm_attach(
        self, request: pb.AttachRequest, worker: int, context: grpc.ServicerContext
    ) -> pb.AttachResponse:
        """An Attach that confirms (the worker saw the nonce) or cancels its segment."""
        entry = self.segments.get(request.confirm, worker)
        if entry is None or entry.segment is None:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ps{self.holder.index} holds no segment {request.confirm} of worker {worker}"
                "; attach again",
                Refusal.NO_SEGMENT,
            )
        if request.cancel:
            self.segments.remove(entry)
            return pb.AttachResponse(segment=entry.id, confirmed=False)
        if not self.segments.confirm(entry, request.nonce):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"wrong nonce for segment {entry.id}: the worker does not see this server's "
                "memory; send over the stream",
                Refusal.NO_SEGMENT,
            )
        return pb.AttachResponse(segment=entry.id, name=entry.segment.name, confirmed=True)

    def _attach_socket(
        self, worker: int, layout: Layout, context: grpc.ServicerContext
    ) -> pb.AttachResponse:
        """An Attach of a tensor socket: where to connect, and the token that names it."""
        if not self.offers_channels:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.holder.index} offers no tensor socket "
                f"({'its data is encrypted by TLS' if self.tls else 'no address'}); "
                "use the stream",
                Refusal.NO_SHARED_MEMORY,
            )
        listener = self._listener()
        token = bulk.new_token()
        entry = self.segments.add(worker, None, layout, token)
        return _attach_reply(entry, listener.port)

    def _own_entry(
        self,
        request_segment: int,
        header: pb.RequestHeader,
        context: grpc.ServicerContext,
        via: Attached | None,
    ) -> Attached:
        """The request's attached entry: on a data channel (``via``) the channel's own, over
        gRPC a segment (a tensor socket's requests travel on it)."""
        entry = self._attached(request_segment, header, context)
        if via is not None and entry is not via:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"segment {request_segment} is not this data channel's; attach again",
                Refusal.NO_SEGMENT,
            )
        if via is None and entry.segment is None:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"segment {request_segment} is a tensor socket: its requests travel on it",
                Refusal.NO_SEGMENT,
            )
        return entry

    def _pull_shared(
        self, request: pb.PullRequest, context: grpc.ServicerContext, via: Attached | None
    ) -> tuple[pb.PullHeader, list[np.ndarray]]:
        """A PullShared: its answer, and (tensor socket) the values to send after it."""
        started = time.perf_counter()
        shard, wait = self.data.check_pull(request, context)
        encoding = checks.pull_encoding(request.encoding, context)
        if request.keys:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "PullShared answers the whole shard; send a pull of some keys over the stream",
            )
        entry = self._own_entry(request.segment, request.header, context, via)
        waited = self.data.await_version(shard, wait, request, context)
        arrays: list[np.ndarray] = []
        specs = list(entry.layout.specs)
        with entry.lock:
            if entry.segment is not None:  # memory is not a link: RAW whatever was asked
                version = shard.snapshot_into(entry.pull_writers())
            else:  # a locked rule's values copied under its lock, an unlocked rule's as they are
                version, values = shard.snapshot() if shard.rule.locked else shard.live()
                arrays = list(values.values())
                if encoding is not Encoding.RAW:
                    specs, arrays = encode_pull(values, encoding)
        busy = time.perf_counter() - started - waited
        if arrays:
            shard.load.pulled({s.key: a.nbytes for s, a in zip(specs, arrays, strict=True)}, busy)
        else:  # a segment's pull: the whole shard, raw
            shard.load.pulled({key: value.nbytes for key, value in shard.values.items()}, busy)
        header = pb.PullHeader(
            version=version,
            tensors=specs,
            server_incarnation=self.holder.incarnation,
            waited_seconds=waited,
            in_segment=True,
        )
        return header, arrays

    @guarded
    def PullShared(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullHeader:
        return self._pull_shared(request, context, None)[0]

    @guarded
    def PushShared(self, request: pb.PushHeader, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._push_shared(request, context, None)

    def _push_shared(
        self, request: pb.PushHeader, context: grpc.ServicerContext, via: Attached | None
    ) -> pb.PushResponse:
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        entry = self._own_entry(request.segment, request.header, context, via)
        if entry.segment is None:
            return self._push_from_socket(shard, entry, request, context)
        return self._push_from_segment(shard, entry, request, context)

    def _push_from_segment(
        self,
        shard: Shard,
        entry: Attached,
        request: pb.PushHeader,
        context: grpc.ServicerContext,
    ) -> pb.PushResponse:
        assert entry.segment is not None
        lr_scale = self._check_shared_push(shard, request, context)
        if any(spec.key not in entry.layout.push_at for spec in request.tensors):
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a piece with no place in segment {request.segment} (it moved here since); "
                "attach again",
                Refusal.NO_SEGMENT,
            )
        sizes = self._piece_sizes(shard, request, context)
        total = sum(shm.align(size) for size in sizes)
        with entry.lock, self.segments.scratch.take(total) as scratch:
            # The push area stays writable by the worker (and any process mapping the segment):
            # copy exactly the announced bytes into server-private memory first, so the bytes
            # checked (finite, decodable) are the bytes applied.
            parts = _cut(scratch, sizes, shm.align)
            for spec, part in zip(request.tensors, parts, strict=True):
                entry.segment.read_into(entry.layout.push_at[spec.key], part)
            payload = checks.decode(request.tensors, _pieces(request.tensors, parts), context)
            return apply_push(shard, request, lr_scale, payload, delay=self.data.delay)

    def _check_shared_push(
        self, shard: Shard, request: pb.PushHeader, context: grpc.ServicerContext
    ) -> float:
        """The checks of a PushShared's header (a stream push's assembler does the last one):
        lr_scale, every piece registered as announced, no piece twice. Returns the lr_scale."""
        lr_scale = checks.lr_scale(request.lr_scale, context)
        checks.push_sequence(request.sequence, context)
        checks.check_push_specs(shard, request.tensors, context)
        keys = [spec.key for spec in request.tensors]
        if len(set(keys)) != len(keys):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a piece listed twice in one push")
        return lr_scale

    def _piece_sizes(
        self, shard: Shard, request: pb.PushHeader, context: grpc.ServicerContext
    ) -> list[int]:
        """The bytes of each piece of a PushShared, as announced (an encoded one checked)."""
        return [
            self._encoded_size(shard, spec, context) if is_encoded(spec) else nbytes_of(spec)
            for spec in request.tensors
        ]

    def _encoded_size(
        self, shard: Shard, spec: pb.TensorSpec, context: grpc.ServicerContext
    ) -> int:
        """Bytes of an encoded piece, at most the raw piece's (its place in a segment)."""
        try:
            size = checks.push_nbytes(spec)
        except WireError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), 400))
        if size > shard.values[spec.key].nbytes:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{clip(spec.key)}: {size} encoded bytes do not fit its "
                f"{shard.values[spec.key].nbytes}-byte place in the segment",
            )
        return size

    def _push_from_socket(
        self,
        shard: Shard,
        entry: Attached,
        request: pb.PushHeader,
        context: grpc.ServicerContext,
    ) -> pb.PushResponse:
        assert entry.sock is not None
        lr_scale = self._check_shared_push(shard, request, context)
        sizes = self._piece_sizes(shard, request, context)
        with entry.lock, self.segments.scratch.take(sum(sizes)) as raw:
            try:
                bulk.recv_into(entry.sock, raw, deadline=time.monotonic() + RPC_BYTES_SECONDS)
            except bulk.SocketClosed as exc:
                abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"tensor socket of worker {request.header.worker}: {exc}",
                    Refusal.NO_SEGMENT,
                )
            payload = _pieces(request.tensors, _cut(raw, sizes))
            payload = checks.decode(request.tensors, payload, context)
            return apply_push(shard, request, lr_scale, payload, delay=self.data.delay)


def _attach_reply(entry: Attached, port: int) -> pb.AttachResponse:
    """An Attach's answer for ``entry``: where its pieces are, and where its data channel
    connects (``port`` 0: none offered)."""
    segment, layout = entry.segment, entry.layout
    return pb.AttachResponse(
        segment=entry.id,
        name="" if segment is None else segment.name,
        size=layout.size if segment is None else segment.size,
        tensors=list(layout.specs),
        pull_offsets=list(layout.pull),
        push_offsets=list(layout.push),
        port=port,
        token=entry.token,
    )


def _cut(
    buffer: np.ndarray, sizes: list[int], place: Callable[[int], int] = int
) -> list[np.ndarray]:
    """``buffer`` in consecutive parts of ``sizes`` bytes, each starting at ``place`` of where
    the one before ended (``shm.align``: aligned as in a segment)."""
    parts, start = [], 0
    for size in sizes:
        parts.append(buffer[start : start + size])
        start = place(start + size)
    return parts


def _pieces(tensors: Sequence[pb.TensorSpec], parts: list[np.ndarray]) -> dict[str, np.ndarray]:
    """A push's pieces from their bytes: an encoded one as bytes, the others as their arrays."""
    return {
        spec.key: part
        if is_encoded(spec)
        else part.view(np.dtype(spec.dtype)).reshape(tuple(spec.shape))
        for spec, part in zip(tensors, parts, strict=True)
    }
