"""The gRPC service of one parameter-server task (see ``transport/proto/distsgd.proto``).

Every field a peer sends is checked before anything changes: a request that fails a check is
refused as a whole with a documented status code and leaves the shard exactly as it was. A push
is validated whole (header, lr_scale, every key, dtype and shape, then every value finite)
before the rule sees any of it. An exception no check foresaw is answered INTERNAL and logged,
never UNKNOWN.

What is validated is what is applied: the rule only ever reads server-private memory that no
peer can write once the checks begin. A stream's chunks are assembled into buffers of the call
(``ChunkAssembler``); a data-channel frame is read into bytes of its own; a tensor socket's
payload is received into the entry's ``scratch``; a shared-memory push, whose segment the
worker (or any process mapping it) can still write, is first copied, exactly the announced
bytes, into that same ``scratch`` under the entry's lock, and checked and applied from there."""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from distsgd.ps import checks, wal
from distsgd.ps.checks import push_nbytes
from distsgd.ps.membership import DEFAULT_EVICT_AFTER, check_evict_after
from distsgd.ps.move_plane import MovePlane, moved_owners, piece_loads, push_response
from distsgd.ps.pull_encoding import encode_pull
from distsgd.ps.rules import (
    MAX_WORKERS,
    PushMeta,
    RuleFactory,
    check_max_workers,
    parse_options_json,
)
from distsgd.ps.segments import SegmentTable
from distsgd.ps.service_errors import abort, clip, guarded
from distsgd.ps.shard import Shard, restore_file
from distsgd.ps.shard_file import shard_file_name
from distsgd.ps.shared_plane import SharedPlane
from distsgd.ps.work import MAX_DONE, MAX_LEASE, Unit, WorkQueue, WorkSpec
from distsgd.transport import bulk
from distsgd.transport.codec import (
    CHUNK_BYTES,
    iter_chunks,
    specs_of,
)
from distsgd.transport.errors import (
    NOT_REGISTERED,
    PROTOCOL_VERSION,
    Refusal,
)
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.util import file_digest, write_stream_atomic

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SCHEME_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def segment_record(checkpoint_dir: Path | None, shard_index: int) -> Path | None:
    """The file where ps ``shard_index`` records the names of the segments it creates: in its
    checkpoint folder (the run's, under ``distsgd run``), or None without one."""
    return None if checkpoint_dir is None else checkpoint_dir / f"ps{shard_index}.segments"


def work_status(queue: WorkQueue) -> pb.WorkStatus:
    """The queue's state as the wire's WorkStatus (call under the shard's lock)."""
    spec = queue.spec
    return pb.WorkStatus(
        epochs=spec.num_epochs,
        units_per_epoch=spec.units_per_epoch,
        total_units=spec.total_units,
        units_done=queue.units_done,
        epoch=queue.epoch,
        finished=queue.finished,
        unit_size=spec.unit_size,
        samples=spec.samples,
        **queue.tally(),
    )


class ParameterService(SharedPlane, MovePlane, pb_grpc.ParameterServerServicer):
    """Serves one shard. The shard exists once the chief has registered it.

    At most ``max_waiting_pulls`` Pulls wait for a version at once (each holds a server thread);
    one more is answered RESOURCE_EXHAUSTED (``Refusal.BUSY``, retried by clients), so waiting
    pulls never take the threads that pushes, Info and Leave need. :meth:`close` wakes every
    waiting pull, which then answers UNAVAILABLE."""

    def __init__(
        self,
        *,
        shard_index: int,
        rule_factory: RuleFactory,
        chunk_bytes: int = CHUNK_BYTES,
        checkpoint_dir: Path | None = None,
        restore: Path | None = None,
        max_waiting_pulls: int = 48,
        host: str = "",
        tls: bool = False,
        max_workers: int = 0,
        evict_after: float = DEFAULT_EVICT_AFTER,
        wal_dir: Path | None = None,
    ) -> None:
        """``wal_dir``: the shard's write-ahead log (None = none; see :mod:`distsgd.ps.wal`):
        a shard found there is served (or ``restore``'s, if newer). ``host``: the address the
        server listens on, where it offers tensor sockets ("" = none); ``tls``: the server
        encrypts its calls, so it offers no tensor sockets.
        ``max_workers``: worker indexes up to this may join (0 = the registered number);
        ``evict_after``: seconds after which a silent member is evicted (see
        :mod:`distsgd.ps.membership`)."""
        if max_waiting_pulls < 1:
            raise ValueError(f"max_waiting_pulls must be at least 1, got {max_waiting_pulls}")
        self.max_workers = check_max_workers(max_workers)
        self.evict_after = check_evict_after(evict_after)
        self.shard_index = shard_index
        self.rule_factory = rule_factory
        self.chunk_bytes = chunk_bytes
        self.checkpoint_dir = checkpoint_dir
        self.max_waiting_pulls = max_waiting_pulls
        self.shard: Shard | None = None
        if restore is not None:  # a damaged file: the log's state, if there is one
            self.shard = restore_file(
                Path(restore),
                rule_factory,
                shard_index=shard_index,
                fallback=wal_dir is not None and wal.has_state(wal_dir),
                max_workers=max_workers,
                evict_after=evict_after,
            )
        self.wal_dir = wal_dir
        if wal_dir is not None:
            self.shard = wal.resume(
                wal_dir,
                self.shard,
                rule_factory,
                shard_index=shard_index,
                max_workers=max_workers,
                evict_after=evict_after,
            )
        self._stop = threading.Event()
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._ticker = threading.Thread(
            target=self._tick, name=f"ps{shard_index}-tick", daemon=True
        )
        self._ticker.start()
        self.incarnation = secrets.randbits(63) | 1
        """Random per server process; a client seeing another one knows the server restarted."""
        self._register_lock = threading.Lock()
        self._segments = SegmentTable()
        self.host = host
        self.tls = tls
        self._bulk: bulk.Listener | None = None
        self.segment_record = segment_record(checkpoint_dir, shard_index)
        """Where each segment's name is recorded before it is created (None: nowhere), so that
        the launcher removes exactly the names a killed server left (``shm.remove_leftovers``)."""

    @property
    def waiting_pulls(self) -> int:
        """How many Pulls are waiting for a version now."""
        return self._waiting

    def _start_waiting(self) -> bool:
        """Take one of the ``max_waiting_pulls`` places; False when all are taken."""
        with self._waiting_lock:
            if self._waiting >= self.max_waiting_pulls:
                return False
            self._waiting += 1
            return True

    def _stop_waiting(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (the server is stopping)."""
        return self._stop.is_set()

    def close(self) -> None:
        """Stop the background ticker and wake every waiting Pull (they answer UNAVAILABLE)."""
        self._stop.set()
        shard = self.shard
        if shard is not None:
            shard.close()
        self._segments.close()
        if self._bulk is not None:
            self._bulk.close()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            shard = self.shard
            if shard is not None:
                shard.tick()
                if shard.wal is not None:
                    shard.wal.maybe_compact(shard)
            self._segments.purge()

    # -- checks ---------------------------------------------------------------------------------
    def _check(self, header: pb.RequestHeader, context: grpc.ServicerContext) -> None:
        self._check_header(header, context)
        shard = self.shard
        if shard is not None:
            self._check_worker(header.worker, shard.membership.max_workers, context)

    def _check_header(self, header: pb.RequestHeader, context: grpc.ServicerContext) -> None:
        """The protocol version and the run; not the worker index."""
        if header.protocol_version != PROTOCOL_VERSION:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: client speaks {header.protocol_version}, "
                f"server speaks {PROTOCOL_VERSION}; run the same distsgd version on every task",
            )
        shard = self.shard
        if shard is not None and shard.run_id and header.run_id and header.run_id != shard.run_id:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a task of run {clip(header.run_id)} reached shard {self.shard_index} of run "
                f"{shard.run_id}; stop the old run's tasks or give this run other ports",
            )

    @staticmethod
    def _check_worker(worker: int, num_workers: int, context: grpc.ServicerContext) -> None:
        if not -1 <= worker < num_workers:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} is not in this run of {num_workers} workers; "
                "give each worker its index 0..N-1 (-1 for tools)",
            )

    def _check_member(
        self, header: pb.RequestHeader, context: grpc.ServicerContext, *, joining: bool
    ) -> Shard:
        """The checks of a Join or Heartbeat: the header, a registered shard, a worker index
        (not -1) this shard accepts. A Join beyond max_workers is RESOURCE_EXHAUSTED."""
        self._check_header(header, context)
        shard = self._registered(context)
        worker = header.worker
        if not 0 <= worker < MAX_WORKERS:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} cannot be a member; give a worker index 0..{MAX_WORKERS - 1}",
            )
        limit = shard.membership.max_workers
        if joining and worker >= limit:
            abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker {worker} cannot join ps{self.shard_index}: it takes worker indexes "
                f"0..{limit - 1}; start the servers with a larger --max-workers",
                Refusal.RUN_FULL,
            )
        return shard

    def _registered(self, context: grpc.ServicerContext) -> Shard:
        shard = self.shard
        if shard is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shard {self.shard_index} {NOT_REGISTERED} yet; the chief registers it at start",
                Refusal.NOT_REGISTERED,
            )
        return shard

    def _unless_closing(self, context: grpc.ServicerContext) -> None:
        if self.closing:
            abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.shard_index} is shutting down; retry once it is back",
                Refusal.CLOSING,
            )

    # -- RPCs -----------------------------------------------------------------------------------
    @guarded
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
                        pieces=piece_loads(load.piece_counts(shard.values)),
                    )
                )
                reply.moved.extend(moved_owners(shard, list(shard.moved)))
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
        head = checks.first_header(request_iterator, context)
        self._check(head.header, context)
        self._check_register_head(head, context)
        work = self._work_spec(head.work, context)
        with self._register_lock:
            if self.shard is not None:  # decided before reading any tensor data
                return self._registered_again(self.shard, head, work, context)
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
                index=self.shard_index,
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
            self.shard = shard
            if self.closing:  # close() ran while this call assembled: wake its pulls too
                shard.close()
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

    def _check_register_head(self, head: pb.RegisterHeader, context: grpc.ServicerContext) -> None:
        """The checks of a Register's header (after the request header's), which change nothing:
        the shard index, the number of workers, the worker, the scheme name, every piece."""
        if head.shard_index != self.shard_index:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration meant for shard {head.shard_index} reached shard "
                f"{self.shard_index}; "
                "check the order of ps addresses in the cluster spec",
            )
        if not 1 <= head.num_workers <= MAX_WORKERS:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration for {head.num_workers} workers; a run has 1 to {MAX_WORKERS}",
            )
        self._check_worker(head.header.worker, head.num_workers, context)
        if not SCHEME_NAME.fullmatch(head.scheme):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scheme name {clip(head.scheme)!r} is not a scheme; "
                "names are 1-64 of [A-Za-z0-9_.-] (see distsgd schemes)",
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
                f"shard {self.shard_index} already holds a different model or scheme "
                f"({shard.scheme}); restart the ps task to train another one",
            )
        return pb.RegisterResponse(created=False, version=shard.version)

    def _check_pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> tuple[Shard, float]:
        """The checks of a pull, which change nothing: (shard, seconds it may wait)."""
        self._check(request.header, context)
        shard = self._registered(context)
        wait = checks.wait_seconds(request.wait_seconds, context)
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining)
        self._unless_closing(context)
        return shard, wait

    def _await_version(
        self, shard: Shard, wait: float, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> float:
        """A checked pull (:meth:`_check_pull`) makes its worker a member, then waits for
        ``min_version``: the seconds waited. A pull refused BUSY changes nothing."""
        restarted = request.server_incarnation not in (0, self.incarnation)
        if restarted or shard.version >= request.min_version:
            shard.see(request.header.worker, request.header.incarnation)
            return 0.0
        if not self._start_waiting():
            abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ps{self.shard_index} already holds {self.max_waiting_pulls} waiting pulls; "
                "retry later, or start the server with more threads",
                Refusal.BUSY,
            )
        began = time.monotonic()
        try:
            shard.see(request.header.worker, request.header.incarnation)
            reached = shard.wait_for(request.min_version, wait)
        finally:
            self._stop_waiting()
            waited = time.monotonic() - began
        self._unless_closing(context)
        if not reached:
            abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"shard {self.shard_index} still at version {shard.version} after {wait:.1f}s "
                f"waiting for version {request.min_version}",
            )
        return waited

    @guarded
    def Pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponse]:
        shard, wait = self._check_pull(request, context)
        encoding = checks.pull_encoding(request.encoding, context)
        keys = checks.pull_keys(request.keys, context)
        waited = self._await_version(shard, wait, request, context)
        # A locked rule's values are copied under its lock (one version); an unlocked rule's
        # are streamed as they are, each chunk copied (or encoded) as it goes, as its readers
        # expect.
        version, values = shard.snapshot(keys) if shard.rule.locked else shard.live(keys)
        specs, arrays = encode_pull(values, encoding)
        shard.load.pulled({spec.key: a.nbytes for spec, a in zip(specs, arrays, strict=True)})
        header = pb.PullHeader(
            version=version,
            tensors=specs,
            server_incarnation=self.incarnation,
            waited_seconds=waited,
        )
        yield pb.PullResponse(header=header)
        for chunk in iter_chunks(arrays, self.chunk_bytes):
            yield pb.PullResponse(chunk=chunk)

    @guarded
    def Push(
        self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext
    ) -> pb.PushResponse:
        head = checks.first_header(request_iterator, context)
        self._check(head.header, context)
        shard = self._registered(context)
        lr_scale = checks.lr_scale(head.lr_scale, context)
        checks.push_sequence(head.sequence, context)
        checks.check_push_specs(shard, head.tensors, context)
        payload = checks.assemble(head.tensors, request_iterator, context, push_nbytes)
        payload = checks.decode(head.tensors, payload, context)
        return self._apply_push(shard, head, lr_scale, payload)

    def _apply_push(
        self, shard: Shard, head: pb.PushHeader, lr_scale: float, payload: dict[str, np.ndarray]
    ) -> pb.PushResponse:
        meta = PushMeta(
            lr_scale=lr_scale,
            worker=head.header.worker,
            incarnation=head.header.incarnation,
            base_version=head.base_version,
            sequence=head.sequence,
        )
        outcome, version = shard.push(payload, meta)
        reply = push_response(
            shard, outcome.accepted, version, outcome.reason, outcome.reject, list(payload)
        )
        reply.duplicate = outcome.duplicate
        return reply

    @guarded
    def Checkpoint(
        self, request: pb.CheckpointRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        if self.checkpoint_dir is None:
            abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.shard_index} has no checkpoint directory; start it with --checkpoint-dir",
            )
        if not CHECKPOINT_NAME.fullmatch(request.name) or set(request.name) == {"."}:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad checkpoint name {request.name[:80]!r}; use letters, digits, '.', '_' and '-'",
            )
        path = self.checkpoint_dir / request.name / shard_file_name(self.shard_index)
        try:  # written as it is packed: the shard is never whole in memory a second time
            version = _write_state(shard, path)
            digest, size = file_digest(path)
        except OSError as exc:
            log.error("shard %d: cannot write checkpoint %s: %s", self.shard_index, path, exc)
            abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"ps{self.shard_index} cannot write {path} ({exc.strerror}); "
                "check the checkpoint directory's space and permissions",
            )
        return pb.CheckpointResponse(version=version, file=str(path), sha256=digest, bytes=size)

    @guarded
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        version = shard.leave(request.header.worker)
        log.info("shard %d: worker %d finished", self.shard_index, request.header.worker)
        return pb.LeaveResponse(version=version)

    def _membership_reply(self, shard: Shard, epoch: int, members: list[int]) -> Any:
        return pb.MembershipResponse(
            epoch=epoch,
            members=members,
            evict_after_seconds=shard.membership.evict_after,
            max_workers=shard.membership.max_workers,
        )

    @guarded
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.MembershipResponse:
        shard = self._check_member(request.header, context, joining=True)
        self._unless_closing(context)
        joined = shard.join(request.header.worker, request.header.incarnation, claim=request.claim)
        if joined is None:
            abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker {request.header.worker} is or was in use in this run; a joining worker "
                "takes an index never used (leave out --task to be given one)",
                Refusal.TAKEN,
            )
        return self._membership_reply(shard, *joined)

    @guarded
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.MembershipResponse:
        shard = self._check_member(request.header, context, joining=False)
        seen = shard.heartbeat(request.header.worker, request.header.incarnation)
        if seen is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {request.header.worker} is not a member of ps{self.shard_index} (never "
                "joined, left, or evicted); call Join again",
                Refusal.NOT_MEMBER,
            )
        return self._membership_reply(shard, *seen)

    @staticmethod
    def _work_spec(spec: pb.WorkSpec, context: grpc.ServicerContext) -> WorkSpec | None:
        """``RegisterHeader.work`` checked: None for samples 0 (no work units)."""
        if spec.samples == 0:
            return None
        try:
            return WorkSpec(
                samples=spec.samples, unit_size=spec.unit_size, epochs=spec.epochs, seed=spec.seed
            )
        except ValueError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), 400))

    @guarded
    def LeaseWork(
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> pb.LeaseResponse:
        # a lease makes the worker a member (as a pull does): the index checks of a Join
        shard = self._check_member(request.header, context, joining=True)
        self._unless_closing(context)
        queue = shard.work
        if queue is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.shard_index} hands out no work units; ask ps0 of a run registered "
                "with them (--world-size dynamic)",
                Refusal.NO_WORK,
            )
        if request.want > MAX_LEASE:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"want {request.want} is more than {MAX_LEASE} units; lease fewer ahead",
            )
        if len(request.done) > MAX_DONE:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.done)} done units in one call; report at most {MAX_DONE}",
            )
        done: list[Unit] = []
        for item in request.done:
            unit = (item.epoch, item.unit)
            why = queue.spec.check_unit(unit)
            if why is not None:
                abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"done unit {why}; report only units this run leased",
                )
            done.append(unit)
        worker, incarnation = request.header.worker, request.header.incarnation
        held, ignored, queue = shard.lease_work(worker, incarnation, done, request.want)
        with shard.cond:
            status = work_status(queue)
        return pb.LeaseResponse(
            units=[pb.WorkUnit(epoch=e, unit=u) for e, u in held],
            ignored=[pb.WorkUnit(epoch=e, unit=u) for e, u in ignored],
            status=status,
        )


def _write_state(shard: Shard, path: Path) -> int:
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
