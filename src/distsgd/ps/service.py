"""The gRPC service of one parameter-server task (see ``transport/proto/distsgd.proto``)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import grpc

from distsgd.ps.rules import PushMeta, RuleFactory
from distsgd.ps.shard import CorruptCheckpoint, Shard
from distsgd.transport.codec import ChunkAssembler, WireError, iter_chunks, specs_of
from distsgd.transport.errors import NOT_REGISTERED, PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.util import write_bytes_atomic

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_MESSAGE_BYTES = 4 << 30
"""Largest total tensor payload one Register or Push may announce (4 GiB)."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")


class ParameterService(pb_grpc.ParameterServerServicer):
    """Serves one shard. The shard exists once the chief has registered it."""

    def __init__(
        self,
        *,
        shard_index: int,
        rule_factory: RuleFactory,
        chunk_bytes: int = 1 << 20,
        checkpoint_dir: Path | None = None,
        restore: Path | None = None,
    ) -> None:
        self.shard_index = shard_index
        self.rule_factory = rule_factory
        self.chunk_bytes = chunk_bytes
        self.checkpoint_dir = checkpoint_dir
        self.shard: Shard | None = None
        if restore is not None:
            self.shard = Shard.from_bytes(
                Path(restore).read_bytes(), rule_factory, name=str(restore)
            )
            if self.shard.index != shard_index:
                raise CorruptCheckpoint(
                    f"{restore} holds shard {self.shard.index}, not shard {shard_index}"
                )
            log.info(
                "shard %d restored from %s at version %d", shard_index, restore, self.shard.version
            )
        self._stop = threading.Event()
        self._ticker = threading.Thread(
            target=self._tick, name=f"ps{shard_index}-tick", daemon=True
        )
        self._ticker.start()
        self.incarnation = secrets.randbits(63) | 1
        """Random per server process; a client seeing another one knows the server restarted."""
        self._register_lock = threading.Lock()

    def close(self) -> None:
        """Stop the background ticker."""
        self._stop.set()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            shard = self.shard
            if shard is not None:
                shard.tick()

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
        if shard is not None and not -1 <= header.worker < shard.num_workers:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {header.worker} is not in this run of {shard.num_workers} workers; "
                "give each worker its index 0..N-1 (-1 for tools)",
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
                reply.restored_version = shard.restored_version
                reply.nonfinite_rejected = shard.nonfinite_rejected
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
        if head.num_workers < 1:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration for {head.num_workers} workers; a run has at least one worker",
            )
        with self._register_lock:
            if self.shard is not None:  # decided before reading any tensor data
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
            values = self._assemble(head.tensors, request_iterator, context)
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
            lr_scale=head.lr_scale or 1.0,
            worker=head.header.worker,
            incarnation=head.header.incarnation,
            base_version=head.base_version,
        )
        outcome, version = shard.push(payload, meta)
        return pb.PushResponse(accepted=outcome.accepted, version=version, reason=outcome.reason)

    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        if self.checkpoint_dir is None:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.shard_index} has no checkpoint directory; start it with --checkpoint-dir",
            )
        if not CHECKPOINT_NAME.fullmatch(request.name) or set(request.name) == {"."}:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad checkpoint name {request.name[:80]!r}; use letters, digits, '.', '_' and '-'",
            )
        version, data = shard.to_bytes()
        path = self.checkpoint_dir / request.name / f"ps{self.shard_index}.npz"
        write_bytes_atomic(path, data)
        digest = hashlib.sha256(data).hexdigest()
        return pb.CheckpointResponse(
            version=version, file=str(path), sha256=digest, bytes=len(data)
        )

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        version = shard.leave(request.header.worker)
        log.info("shard %d: worker %d finished", self.shard_index, request.header.worker)
        return pb.LeaveResponse(version=version)
