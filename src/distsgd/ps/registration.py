"""Registration and the shard's lifecycle in the parameter-server service: Info, Register
(the chief's, once; again with the same model is no change) and Checkpoint, to which
:class:`~distsgd.ps.service.ParameterService` routes them, and the shard a server starts from
(a shard file, its write-ahead log)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from distsgd.ps import checks, wal
from distsgd.ps.member_plane import work_spec, work_status
from distsgd.ps.membership import DEFAULT_EVICT_AFTER
from distsgd.ps.move_plane import moved_owners, piece_loads
from distsgd.ps.rules import MAX_WORKERS, RuleFactory, parse_options_json
from distsgd.ps.service_errors import abort, clip, guarded
from distsgd.ps.shard import Shard, read_shard_file
from distsgd.ps.shard_file import CorruptCheckpoint, shard_file_name
from distsgd.ps.shard_holder import ShardHolder
from distsgd.ps.work import WorkSpec
from distsgd.transport.codec import specs_of
from distsgd.transport.errors import PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.util import file_digest, write_stream_atomic

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SCHEME_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def restore_file(
    path: Path,
    rule_factory: RuleFactory,
    *,
    shard_index: int,
    fallback: bool,
    max_workers: int = 0,
    evict_after: float = DEFAULT_EVICT_AFTER,
) -> Shard | None:
    """The shard a server starts from with ``--restore path``: checked as
    :meth:`Shard.from_bytes` checks it; a damaged or unreadable file (or another shard's) is
    :class:`CorruptCheckpoint` naming it, or, with a ``fallback`` (the write-ahead log holds
    state), None after one ERROR line that names the file and the damage."""
    try:
        shard = read_shard_file(
            path, rule_factory, max_workers=max_workers, evict_after=evict_after
        )
        if shard.index != shard_index:
            raise CorruptCheckpoint(f"{path} holds shard {shard.index}, not shard {shard_index}")
    except (CorruptCheckpoint, OSError) as exc:
        if not fallback:
            raise
        log.error("shard %d: %s; starting from the write-ahead log instead", shard_index, exc)
        return None
    log.info("shard %d restored from %s at version %d", shard_index, path, shard.version)
    return shard


def starting_shard(
    *,
    shard_index: int,
    rule_factory: RuleFactory,
    restore: Path | None,
    wal_dir: Path | None,
    max_workers: int,
    evict_after: float,
) -> Shard | None:
    """The shard a server starts with: ``restore``'s file and the log in ``wal_dir`` (the
    newer; a damaged file: the log's state, if there is one), or None (the chief registers)."""
    shard: Shard | None = None
    if restore is not None:
        shard = restore_file(
            Path(restore),
            rule_factory,
            shard_index=shard_index,
            fallback=wal_dir is not None and wal.has_state(wal_dir),
            max_workers=max_workers,
            evict_after=evict_after,
        )
    if wal_dir is not None:
        shard = wal.resume(
            wal_dir,
            shard,
            rule_factory,
            shard_index=shard_index,
            max_workers=max_workers,
            evict_after=evict_after,
        )
    return shard


class RegistrationPlane:
    """Info, Register and Checkpoint of ``holder``'s shard. A Register makes the shard with
    ``rule_factory``'s rule, ``max_workers`` and ``evict_after`` (its membership), and begins
    its write-ahead log in ``wal_dir`` (None = none); Checkpoint writes into
    ``checkpoint_dir`` (None = refused)."""

    def __init__(
        self,
        holder: ShardHolder,
        rule_factory: RuleFactory,
        *,
        max_workers: int,
        evict_after: float,
        wal_dir: Path | None,
        checkpoint_dir: Path | None,
    ) -> None:
        self.holder = holder
        self.rule_factory = rule_factory
        self.max_workers = max_workers
        self.evict_after = evict_after
        self.wal_dir = wal_dir
        self.checkpoint_dir = checkpoint_dir

    @guarded
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        self.holder.check(request.header, context)
        shard = self.holder.shard
        reply = pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            shard_index=self.holder.index,
            server_incarnation=self.holder.incarnation,
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
                reply.membership_epoch = shard.membership.epoch
                reply.members.extend(shard.membership.live)
                load = shard.load
                reply.load.CopyFrom(
                    pb.ShardLoad(
                        pushes=load.pushes,
                        push_bytes=load.push_bytes,
                        pulls=load.pulls,
                        pull_bytes=load.pull_bytes,
                        busy_seconds=load.busy_seconds,
                        pull_busy_seconds=load.pull_busy_seconds,
                        pieces=piece_loads(load.piece_counts(shard.values)),
                    )
                )
                reply.moved.extend(moved_owners(shard, list(shard.move_book.moved)))
                if shard.wal is not None:
                    reply.wal.CopyFrom(pb.WalStatus(**vars(shard.wal.state())))
                reply.applied_sequence = shard.sequences.highest(request.header.worker)
                if shard.work is not None:
                    reply.work.CopyFrom(work_status(shard.work))
        return reply

    @guarded
    def Register(
        self, request_iterator: Iterator[pb.RegisterRequest], context: grpc.ServicerContext
    ) -> pb.RegisterResponse:
        head = self.holder.stream_head(request_iterator, context)
        self._check_register_head(head, context)
        work = work_spec(head.work, context)
        with self.holder.register_lock:
            if self.holder.shard is not None:  # decided before reading any tensor data
                return self._registered_again(self.holder.shard, head, work, context)
            try:
                options = parse_options_json(head.options_json)
                rule = self.rule_factory(head.scheme, options, head.num_workers)
            except (ValueError, TypeError, KeyError) as exc:
                abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    clip(f"scheme {head.scheme!r}: {exc}", 400),
                )
            values = checks.assemble(head.tensors, request_iterator, context)
            for key, value in values.items():
                if not np.isfinite(value).all():
                    abort(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{clip(key)}: NaN or Inf in the initial values; register a finite model",
                    )
            shard = Shard(
                index=self.holder.index,
                scheme=head.scheme,
                options_json=head.options_json,
                num_workers=head.num_workers,
                values=values,
                run_id=head.header.run_id,
                rule=rule,
                max_workers=self.max_workers,
                evict_after=self.evict_after,
                work=work,
                own=True,  # the stream's buffers, assembled for it alone: no copy
            )
            if self.wal_dir is not None:
                wal.begin(self.wal_dir, shard)  # the base snapshot, before any push
            self.holder.shard = shard
            if self.holder.closing:  # close() ran while this call assembled: wake its pulls too
                shard.close()
            nbytes = sum(v.nbytes for v in values.values())
            log.info(
                "shard %d registered: scheme %s, %d pieces, %d bytes, %d workers",
                self.holder.index,
                head.scheme,
                len(values),
                nbytes,
                head.num_workers,
            )
            return pb.RegisterResponse(created=True, version=0)

    def _check_register_head(self, head: pb.RegisterHeader, context: grpc.ServicerContext) -> None:
        """The checks of a Register's header (after the request header's), which change nothing:
        the shard index, the number of workers, the worker, the scheme name, every piece."""
        if head.shard_index != self.holder.index:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration meant for shard {head.shard_index} reached shard "
                f"{self.holder.index}; "
                "check the order of ps addresses in the cluster spec",
            )
        if not 1 <= head.num_workers <= MAX_WORKERS:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration for {head.num_workers} workers; a run has 1 to {MAX_WORKERS}",
            )
        self.holder.check_worker(head.header.worker, head.num_workers, context)
        if not SCHEME_NAME.fullmatch(head.scheme):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scheme name {clip(head.scheme)!r} is not a scheme; "
                "names are 1-64 of [A-Za-z0-9_.-] (see distsgd run --help-scheme)",
            )
        checks.check_register_specs(head.tensors, context)

    def _registered_again(
        self,
        shard: Shard,
        head: pb.RegisterHeader,
        work: WorkSpec | None,
        context: grpc.ServicerContext,
    ) -> pb.RegisterResponse:
        """A Register of a shard already registered: ``created=False`` when it registers the
        same model, scheme, workers and work; ALREADY_EXISTS otherwise."""
        have = shard.work
        same = (
            specs_of(shard.values) == list(head.tensors)
            and shard.scheme == head.scheme
            and shard.options_json == head.options_json
            and shard.num_workers == head.num_workers
            and (None if have is None else have.spec) == work
        )
        if not same:
            abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"shard {self.holder.index} already holds a different model or scheme "
                f"({shard.scheme}); restart the ps task to train another one",
            )
        return pb.RegisterResponse(created=False, version=shard.version)

    @guarded
    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointResponse:
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        if self.checkpoint_dir is None:
            abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.holder.index} has no checkpoint directory; "
                "start it with --checkpoint-dir",
            )
        if not CHECKPOINT_NAME.fullmatch(request.name) or set(request.name) == {"."}:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad checkpoint name {request.name[:80]!r}; use letters, digits, '.', '_' and '-'",
            )
        path = self.checkpoint_dir / request.name / shard_file_name(self.holder.index)
        try:  # written as it is packed: the shard is never whole in memory a second time
            version = write_state(shard, path)
            digest, size = file_digest(path)
        except OSError as exc:
            log.error("shard %d: cannot write checkpoint %s: %s", self.holder.index, path, exc)
            abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"ps{self.holder.index} cannot write {path} ({exc.strerror}); "
                "check the checkpoint directory's space and permissions",
            )
        return pb.CheckpointResponse(version=version, file=str(path), sha256=digest, bytes=size)


def write_state(shard: Shard, path: Path) -> int:
    """Write the shard's state (no push half-applied) into ``path``; its version. As the log's
    snapshots (:data:`~distsgd.ps.wal.LIVE_SNAPSHOT_BYTES`): copied, or live, pushes held."""
    live = sum(v.nbytes for v in shard.values.values()) >= wal.LIVE_SNAPSHOT_BYTES
    hold: Any = shard.gate.exclusive()  # an unlocked rule's pushes held (a locked one's: cond)
    if shard.rule.locked:
        hold = shard.cond if live else nullcontext()  # state_copy takes cond itself
    with hold:
        version, arrays, header = shard.state_copy(copy=not live)
        if live:
            write_stream_atomic(path, lambda f: Shard.pack_into(f, arrays, header))
    if not live:
        write_stream_atomic(path, lambda f: Shard.pack_into(f, arrays, header))
    return version
