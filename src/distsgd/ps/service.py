"""The gRPC service of one parameter-server task (see ``transport/proto/distsgd.proto``)."""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import grpc

from distsgd.ps.rules import PushMeta, RuleFactory
from distsgd.ps.shard import Shard
from distsgd.transport.codec import ChunkAssembler, WireError, iter_chunks, specs_of
from distsgd.transport.errors import NOT_REGISTERED, PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 30
"""Largest total tensor payload one Register or Push may announce (4 GiB)."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class ParameterService(pb_grpc.ParameterServerServicer):
    """Serves one shard. The shard exists once the chief has registered it."""

    def __init__(
        self, *, shard_index: int, rule_factory: RuleFactory, chunk_bytes: int = 1 << 20
    ) -> None:
        self.shard_index = shard_index
        self.rule_factory = rule_factory
        self.chunk_bytes = chunk_bytes
        self.shard: Shard | None = None
        self.incarnation = secrets.randbits(63) | 1
        """Random per server process; a client seeing another one knows the server restarted."""
        self._register_lock = threading.Lock()

    # -- checks ---------------------------------------------------------------------------------
    def _check(self, header: pb.RequestHeader, context: grpc.ServicerContext) -> None:
        if header.protocol_version != PROTOCOL_VERSION:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: client speaks {header.protocol_version}, "
                f"server speaks {PROTOCOL_VERSION}; run the same distsgd version on every task",
            )
        shard = self.shard
        if shard is not None and shard.run_id and header.run_id and header.run_id != shard.run_id:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a task of run {header.run_id} reached shard {self.shard_index} of run "
                f"{shard.run_id}; stop the old run's tasks or give this run other ports",
            )

    def _registered(self, context: grpc.ServicerContext) -> Shard:
        shard = self.shard
        if shard is None:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shard {self.shard_index} {NOT_REGISTERED} yet; the chief registers it at start",
            )
        return shard

    @staticmethod
    def _first(messages: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            first = next(messages)
        except StopIteration:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty stream; send a header first")
        if first.WhichOneof("part") != "header":
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "stream must start with a header")
        return first.header

    @staticmethod
    def _assemble(
        specs: Iterable[pb.TensorSpec], messages: Iterator[Any], context: grpc.ServicerContext
    ) -> dict[str, Any]:
        try:
            assembler = ChunkAssembler(list(specs), max_bytes=MAX_MESSAGE_BYTES)
            for message in messages:
                if message.WhichOneof("part") != "chunk":
                    raise WireError("a second header in one stream")
                assembler.add(message.chunk)
            return assembler.finish()
        except WireError as exc:
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if "over the limit" in str(exc)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            _abort(context, code, str(exc))

    # -- RPCs -----------------------------------------------------------------------------------
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        self._check(request.header, context)
        shard = self.shard
        reply = pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            shard_index=self.shard_index,
            server_incarnation=self.incarnation,
        )
        if shard is not None:
            with shard.cond:
                reply.registered = True
                reply.scheme = shard.scheme
                reply.version = shard.version
                reply.tensors.extend(specs_of(shard.values))
                reply.num_workers = shard.num_workers
                reply.active_workers = shard.active_workers
                reply.finished_workers = len(shard.finished)
                reply.pushes_accepted = shard.pushes_accepted
                reply.pushes_rejected = shard.pushes_rejected
        return reply

    def Register(
        self, request_iterator: Iterator[pb.RegisterRequest], context: grpc.ServicerContext
    ) -> pb.RegisterResponse:
        head = self._first(request_iterator, context)
        self._check(head.header, context)
        if head.shard_index != self.shard_index:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration meant for shard {head.shard_index} reached shard "
                f"{self.shard_index}; "
                "check the order of ps addresses in the cluster spec",
            )
        values = self._assemble(head.tensors, request_iterator, context)
        with self._register_lock:
            if self.shard is not None:
                same = (
                    specs_of(self.shard.values) == list(head.tensors)
                    and self.shard.scheme == head.scheme
                    and self.shard.options_json == head.options_json
                    and self.shard.num_workers == head.num_workers
                )
                if not same:
                    _abort(
                        context,
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"shard {self.shard_index} already holds a different model or scheme "
                        f"({self.shard.scheme}); restart the ps task to train another one",
                    )
                return pb.RegisterResponse(created=False, version=self.shard.version)
            try:
                options = json.loads(head.options_json or "{}")
                rule = self.rule_factory(head.scheme, options, head.num_workers)
            except (ValueError, TypeError, KeyError) as exc:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"scheme {head.scheme!r}: {exc}")
            self.shard = Shard(
                index=self.shard_index,
                scheme=head.scheme,
                options_json=head.options_json,
                num_workers=head.num_workers,
                values=values,
                run_id=head.header.run_id,
                rule=rule,
            )
            nbytes = sum(v.nbytes for v in values.values())
            log.info(
                "shard %d registered: scheme %s, %d pieces, %d bytes, %d workers",
                self.shard_index,
                head.scheme,
                len(values),
                nbytes,
                head.num_workers,
            )
            return pb.RegisterResponse(created=True, version=0)

    def Pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponse]:
        self._check(request.header, context)
        shard = self._registered(context)
        shard.see(request.header.worker, request.header.incarnation)
        remaining = context.time_remaining()
        wait = request.wait_seconds if remaining is None else min(request.wait_seconds, remaining)
        restarted = request.server_incarnation not in (0, self.incarnation)
        if not restarted and not shard.wait_for(request.min_version, wait):
            _abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"shard {self.shard_index} still at version {shard.version} after {wait:.1f}s "
                f"waiting for version {request.min_version}",
            )
        version, values = shard.snapshot()
        header = pb.PullHeader(
            version=version, tensors=specs_of(values), server_incarnation=self.incarnation
        )
        yield pb.PullResponse(header=header)
        for chunk in iter_chunks(list(values.values()), self.chunk_bytes):
            yield pb.PullResponse(chunk=chunk)

    def Push(
        self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext
    ) -> pb.PushResponse:
        head = self._first(request_iterator, context)
        self._check(head.header, context)
        shard = self._registered(context)
        for spec in head.tensors:
            have = shard.values.get(spec.key)
            if have is None:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{spec.key}: no such parameter on shard {self.shard_index}",
                )
            if spec.dtype != have.dtype.name or tuple(spec.shape) != have.shape:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{spec.key}: pushed {spec.dtype}{list(spec.shape)}, "
                    f"registered {have.dtype.name}{list(have.shape)}",
                )
        payload = self._assemble(head.tensors, request_iterator, context)
        meta = PushMeta(
            worker=head.header.worker,
            incarnation=head.header.incarnation,
            base_version=head.base_version,
        )
        outcome, version = shard.push(payload, meta)
        return pb.PushResponse(accepted=outcome.accepted, version=version, reason=outcome.reason)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        version = shard.leave(request.header.worker)
        log.info("shard %d: worker %d finished", self.shard_index, request.header.worker)
        return pb.LeaveResponse(version=version)
