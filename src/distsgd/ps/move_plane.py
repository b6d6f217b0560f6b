"""The RPCs that move pieces between shards (ExportPieces, ImportPieces, FinishMove), to which
:class:`~distsgd.ps.service.ParameterService` routes them; the decisions and the locking are
:mod:`distsgd.ps.moves`'."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from distsgd.ps import checks, moves
from distsgd.ps.load import PieceCounts
from distsgd.ps.segments import SegmentTable
from distsgd.ps.service_errors import abort, clip, guarded
from distsgd.transport.codec import header_then_chunks, specs_of
from distsgd.transport.proto import distsgd_pb2 as pb

if TYPE_CHECKING:
    from distsgd.ps.shard import Shard
    from distsgd.ps.shard_holder import ShardHolder

log = logging.getLogger(__name__)


def piece_loads(counts: dict[str, PieceCounts]) -> list[pb.PieceLoad]:
    return [pb.PieceLoad(key=k, **vars(c)) for k, c in counts.items()]  # the same fields


def moved_owners(shard: Shard, keys: Iterator[str] | list[str]) -> list[pb.PieceOwner]:
    """Where the pieces among ``keys`` that left ``shard`` went."""
    return [
        pb.PieceOwner(key=k, shard=shard.move_book.moved[k])
        for k in keys
        if k in shard.move_book.moved
    ]


class MovePlane:
    """Moving pieces: the three calls of the .proto's "Moving pieces", on ``holder``'s shard.
    A move that changes the shard's pieces retires ``segments``' attachments (their layout is
    stale); an export streams in ``chunk_bytes`` chunks."""

    def __init__(self, holder: ShardHolder, segments: SegmentTable, *, chunk_bytes: int) -> None:
        self.holder = holder
        self.segments = segments
        self.chunk_bytes = chunk_bytes

    def _move_request(self, request: pb.MoveRequest, context: grpc.ServicerContext) -> Shard:
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        if request.header.worker != -1:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "only the launcher moves pieces")
        if any(not 0 < len(k) <= checks.MAX_KEY_CHARS for k in request.keys):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a piece key of bad length")
        return shard

    def _refused(self, exc: moves.MoveRefused, context: grpc.ServicerContext) -> None:
        code = (
            grpc.StatusCode.INVALID_ARGUMENT
            if exc.refusal is None
            else grpc.StatusCode.FAILED_PRECONDITION
        )
        abort(context, code, clip(str(exc), 400), exc.refusal)

    @guarded
    def ExportPieces(
        self, request: pb.MoveRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ExportResponse]:
        shard = self._move_request(request, context)
        try:
            out = moves.export(shard, list(request.keys), request.peer_shard)
        except moves.MoveRefused as exc:
            self._refused(exc, context)
        log.info(
            "shard %d: exporting %d piece(s) to shard %d at version %d",
            self.holder.index,
            len(request.keys),
            request.peer_shard,
            out.version,
        )
        header = pb.ExportHeader(
            version=out.version,
            tensors=specs_of(out.arrays),
            loads=piece_loads(out.loads),
            move_id=out.move_id,
        )
        arrays = list(out.arrays.values())
        yield from header_then_chunks(pb.ExportResponse, header, arrays, self.chunk_bytes)

    @guarded
    def ImportPieces(
        self, request_iterator: Iterator[pb.ImportRequest], context: grpc.ServicerContext
    ) -> pb.MoveResponse:
        head = self.holder.stream_head(request_iterator, context)
        shard = self.holder.registered(context)
        if head.header.worker != -1 or head.from_shard == self.holder.index:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "an import from the launcher only")
        checks.check_register_specs(head.tensors, context)
        arrays = checks.assemble(head.tensors, request_iterator, context)
        loads = {p.key: PieceCounts(p.push_bytes, p.pull_bytes, p.applies) for p in head.loads}
        try:
            taken, receipt = moves.adopt(
                shard, arrays, loads, head.from_shard, move_id=head.move_id, version=head.version
            )
        except (moves.MoveRefused, ValueError) as exc:
            refusal = exc.refusal if isinstance(exc, moves.MoveRefused) else None
            self._refused(moves.MoveRefused(refusal, str(exc)), context)
        self.segments.retire()  # the layout changed: workers attach again
        log.info(
            "shard %d: took %d piece(s) from shard %d", self.holder.index, taken, head.from_shard
        )
        return pb.MoveResponse(version=shard.version, pieces=taken, receipt=receipt)

    @guarded
    def FinishMove(self, request: pb.MoveRequest, context: grpc.ServicerContext) -> pb.MoveResponse:
        shard = self._move_request(request, context)
        try:
            changed = moves.finish(
                shard,
                list(request.keys),
                request.peer_shard,
                commit=request.commit,
                move_id=request.move_id,
                version=request.version,
                receipt=request.receipt,
            )
        except moves.MoveRefused as exc:
            self._refused(exc, context)
        if changed:
            self.segments.retire()
        log.info(
            "shard %d: move %s of %d piece(s) with shard %d %s",
            self.holder.index,
            request.move_id[:8],
            len(request.keys),
            request.peer_shard,
            "committed" if request.commit else "undone",
        )
        return pb.MoveResponse(version=shard.version, pieces=changed)
