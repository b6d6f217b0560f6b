"""The gRPC service of one parameter-server task (see ``transport/proto/distsgd.proto``).

Every field a peer sends is checked before anything changes: a request that fails a check is
refused as a whole with a documented status code and leaves the shard exactly as it was. A push
is validated whole (header, lr_scale, every key, dtype and shape, then every value finite)
before the rule sees any of it. An exception no check foresaw is answered INTERNAL and logged,
never UNKNOWN.

What is validated is what is applied: the rule only ever reads server-private memory that no
peer can write once the checks begin. A stream's chunks are assembled into buffers of the call
(``ChunkAssembler``); a data-channel frame is read into bytes of its own; a tensor socket's
payload is received into the entry's ``scratch``; and a shared-memory push, whose segment the
worker (or any process mapping it) can still write, is first copied, exactly the announced
bytes, into that same ``scratch`` under the entry's lock, and checked and applied from there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import math
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import grpc
import numpy as np

from distsgd.ps import channel, compression, wal
from distsgd.ps.channel import Aborted as _Aborted
from distsgd.ps.membership import DEFAULT_EVICT_AFTER, check_evict_after
from distsgd.ps.rules import (
    MAX_LR_SCALE,
    MAX_WORKERS,
    PushMeta,
    RuleFactory,
    parse_options_json,
)
from distsgd.ps.segments import Attached, Layout, SegmentTable
from distsgd.ps.shard import CorruptCheckpoint, Shard
from distsgd.ps.work import MAX_DONE, MAX_LEASE, Unit, WorkQueue, WorkSpec
from distsgd.transport import bulk, shm
from distsgd.transport.codec import (
    CHUNK_BYTES,
    FLOAT_DTYPES,
    ChunkAssembler,
    TooLarge,
    WireError,
    dtype_name,
    is_encoded,
    iter_chunks,
    nbytes_of,
    specs_of,
)
from distsgd.transport.errors import (
    ERROR_KEY,
    MAX_WAIT_SECONDS,
    NOT_REGISTERED,
    PROTOCOL_VERSION,
    Refusal,
)
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.util import write_bytes_atomic

log = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SCHEME_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_MESSAGE_BYTES = 4 << 30
"""Largest total tensor payload one Register or Push may announce (4 GiB)."""
PARAM_DTYPES = FLOAT_DTYPES
"""Dtypes a registered piece may have: parameters are floating point (float16/32/64)."""
MAX_KEY_CHARS = 1024
"""Longest piece key."""
RPC_BYTES_SECONDS = 120.0
"""How long a data-channel request may take (its wait for a version and its bytes)."""

F = TypeVar("F", bound=Callable[..., Any])


def push_nbytes(spec: pb.TensorSpec) -> int:
    """The bytes a pushed piece's spec announces, encoded or raw; WireError if it cannot say."""
    if not is_encoded(spec):
        return nbytes_of(spec)
    count = nbytes_of(pb.TensorSpec(key=spec.key, dtype="uint8", shape=spec.shape))
    try:
        encoding = compression.Encoding(spec.encoding)
        return compression.wire_nbytes(encoding, spec.dtype, count, spec.nnz)
    except ValueError as exc:
        raise WireError(f"{_clip(spec.key)}: {exc}") from None


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


def _clip(text: str, limit: int = 80) -> str:
    """``text`` for a status message: a peer's string may be megabytes long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    refusal: Refusal | None = None,
) -> NoReturn:
    """Answer the call with ``code`` and ``message`` (and ``refusal`` as trailing metadata)."""
    if refusal is not None:
        context.set_trailing_metadata(((ERROR_KEY, refusal.value),))
    with contextlib.suppress(Exception):  # abort sets the status, then raises a bare Exception
        context.abort(code, message)
    raise _Aborted(code.name)


def _internal(method: str, exc: Exception, context: grpc.ServicerContext) -> NoReturn:
    log.error("%s failed with an unexpected error (a bug)", method, exc_info=exc)
    _abort(
        context,
        grpc.StatusCode.INTERNAL,
        f"{method}: internal error in the parameter server ({type(exc).__name__}); "
        "see the server's log",
    )


def _guarded(method: F) -> F:
    """The RPC ``method``, answering INTERNAL (and logging the traceback) for any exception
    that is not an abort of its own; a call the client already gave up is left alone."""
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except _Aborted:
                raise
            except Exception as exc:
                if not context.is_active():  # the client went away: nothing to answer
                    raise
                _internal(name, exc, context)

        return cast(F, stream)

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except _Aborted:
            raise
        except Exception as exc:
            if not context.is_active():
                raise
            _internal(name, exc, context)

    return cast(F, unary)


class ParameterService(pb_grpc.ParameterServerServicer):
    """Serves one shard. The shard exists once the chief has registered it.

    At most ``max_waiting_pulls`` Pulls wait for a version at once (each holds a server thread);
    one more is answered RESOURCE_EXHAUSTED (``Refusal.BUSY``, retried by clients), so waiting
    pulls never take the threads that pushes, Info and Leave need. :meth:`close` wakes every
    waiting pull, which then answers UNAVAILABLE.
    """

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
        if not 0 <= max_workers <= MAX_WORKERS:
            raise ValueError(f"--max-workers must be in 0..{MAX_WORKERS}, got {max_workers}")
        self.max_workers = max_workers
        self.evict_after = check_evict_after(evict_after)
        self.shard_index = shard_index
        self.rule_factory = rule_factory
        self.chunk_bytes = chunk_bytes
        self.checkpoint_dir = checkpoint_dir
        self.max_waiting_pulls = max_waiting_pulls
        self.shard: Shard | None = None
        if restore is not None:
            self.shard = Shard.from_bytes(
                Path(restore).read_bytes(),
                rule_factory,
                name=str(restore),
                max_workers=max_workers,
                evict_after=evict_after,
            )
            if self.shard.index != shard_index:
                raise CorruptCheckpoint(
                    f"{restore} holds shard {self.shard.index}, not shard {shard_index}"
                )
            log.info(
                "shard %d restored from %s at version %d", shard_index, restore, self.shard.version
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
                f"a task of run {_clip(header.run_id)} reached shard {self.shard_index} of run "
                f"{shard.run_id}; stop the old run's tasks or give this run other ports",
            )

    @staticmethod
    def _check_worker(worker: int, num_workers: int, context: grpc.ServicerContext) -> None:
        if not -1 <= worker < num_workers:
            _abort(
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
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"worker {worker} cannot be a member; give a worker index 0..{MAX_WORKERS - 1}",
            )
        limit = shard.membership.max_workers
        if joining and worker >= limit:
            _abort(
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
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shard {self.shard_index} {NOT_REGISTERED} yet; the chief registers it at start",
                Refusal.NOT_REGISTERED,
            )
        return shard

    def _unless_closing(self, context: grpc.ServicerContext) -> None:
        if self.closing:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"ps{self.shard_index} is shutting down; retry once it is back",
                Refusal.CLOSING,
            )

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
    def _check_register_specs(
        specs: Iterable[pb.TensorSpec], context: grpc.ServicerContext
    ) -> None:
        """Every piece of a Register: a key of sane length, a floating-point dtype."""
        for spec in specs:
            if is_encoded(spec):
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{_clip(spec.key)}: Register carries raw values only (encoding "
                    f"{spec.encoding}, nnz {spec.nnz}); compress pushes, not initial values",
                )
            if not 0 < len(spec.key) <= MAX_KEY_CHARS:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"piece key {_clip(spec.key)!r} has {len(spec.key)} characters; "
                    f"use 1 to {MAX_KEY_CHARS}",
                )
            if spec.dtype not in PARAM_DTYPES:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{_clip(spec.key)}: dtype {_clip(spec.dtype)!r} is not a parameter dtype; "
                    f"register only floating-point tensors ({', '.join(sorted(PARAM_DTYPES))})",
                )

    @staticmethod
    def _check_push_specs(
        shard: Shard, specs: Iterable[pb.TensorSpec], context: grpc.ServicerContext
    ) -> None:
        """Every piece of a Push is registered, with its registered dtype and shape."""
        for spec in specs:
            have = shard.values.get(spec.key)
            if have is None:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{_clip(spec.key)}: no such parameter on shard {shard.index}",
                )
            if spec.dtype != dtype_name(have.dtype) or tuple(spec.shape) != have.shape:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{_clip(spec.key)}: pushed {_clip(spec.dtype, 16)}{list(spec.shape)[:8]}, "
                    f"registered {have.dtype.name}{list(have.shape)}",
                )

    @staticmethod
    def _lr_scale(value: float, context: grpc.ServicerContext) -> float:
        """``PushHeader.lr_scale``: 0 means 1.0; else finite in (0, MAX_LR_SCALE]."""
        if value == 0:
            return 1.0
        if not 0 < value <= MAX_LR_SCALE:  # NaN fails too
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lr_scale {value!r} is outside (0, {MAX_LR_SCALE:g}]; send the schedule's "
                "factor (0 means 1.0)",
            )
        return value

    @staticmethod
    def _wait_seconds(value: float, context: grpc.ServicerContext) -> float:
        """``PullRequest.wait_seconds``: >= 0 (NaN refused), capped at MAX_WAIT_SECONDS."""
        if math.isnan(value) or value < 0:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"wait_seconds {value!r} must be 0 or more; the server waits at most "
                f"{MAX_WAIT_SECONDS:g}s",
            )
        return min(value, MAX_WAIT_SECONDS)

    @staticmethod
    def _decode(
        specs: Iterable[pb.TensorSpec],
        payload: dict[str, np.ndarray],
        context: grpc.ServicerContext,
    ) -> dict[str, np.ndarray]:
        """The encoded pieces of a push decoded to their registered dtype and shape (checked
        before); raw pieces as they are. INVALID_ARGUMENT naming the piece if one does not
        decode."""
        for spec in specs:
            if not is_encoded(spec):
                continue
            try:
                payload[spec.key] = compression.decode(
                    payload[spec.key],
                    encoding=spec.encoding,
                    scale=spec.scale,
                    nnz=spec.nnz,
                    shape=tuple(spec.shape),
                    dtype=spec.dtype,
                )
            except ValueError as exc:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    _clip(f"{spec.key}: {exc}", 400),
                )
        return payload

    @staticmethod
    def _assemble(
        specs: Iterable[pb.TensorSpec],
        messages: Iterator[Any],
        context: grpc.ServicerContext,
        nbytes: Callable[[pb.TensorSpec], int] = nbytes_of,
    ) -> dict[str, np.ndarray]:
        try:
            assembler = ChunkAssembler(list(specs), max_bytes=MAX_MESSAGE_BYTES, nbytes=nbytes)
            for message in messages:
                if message.WhichOneof("part") != "chunk":
                    raise WireError("a second header in one stream")
                assembler.add(message.chunk)
            return assembler.finish()
        except TooLarge as exc:
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), Refusal.TOO_LARGE)
        except WireError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, _clip(str(exc), 400))

    # -- RPCs -----------------------------------------------------------------------------------
    @_guarded
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
                if shard.work is not None:
                    reply.work.CopyFrom(work_status(shard.work))
        return reply

    @_guarded
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
        if not 1 <= head.num_workers <= MAX_WORKERS:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"registration for {head.num_workers} workers; a run has 1 to {MAX_WORKERS}",
            )
        self._check_worker(head.header.worker, head.num_workers, context)
        if not SCHEME_NAME.fullmatch(head.scheme):
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scheme name {_clip(head.scheme)!r} is not a scheme; "
                "names are 1-64 of [A-Za-z0-9_.-] (see distsgd schemes)",
            )
        self._check_register_specs(head.tensors, context)
        work = self._work_spec(head.work, context)
        with self._register_lock:
            if self.shard is not None:  # decided before reading any tensor data
                have = self.shard.work
                same = (
                    specs_of(self.shard.values) == list(head.tensors)
                    and self.shard.scheme == head.scheme
                    and self.shard.options_json == head.options_json
                    and self.shard.num_workers == head.num_workers
                    and (None if have is None else have.spec) == work
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
                options = parse_options_json(head.options_json)
                rule = self.rule_factory(head.scheme, options, head.num_workers)
            except (ValueError, TypeError, KeyError) as exc:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    _clip(f"scheme {head.scheme!r}: {exc}", 400),
                )
            values = self._assemble(head.tensors, request_iterator, context)
            for key, value in values.items():
                if not np.isfinite(value).all():
                    _abort(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{_clip(key)}: NaN or Inf in the initial values; register a finite model",
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

    def _check_pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> tuple[Shard, float]:
        """The checks of a pull, which change nothing: (shard, seconds it may wait)."""
        self._check(request.header, context)
        shard = self._registered(context)
        wait = self._wait_seconds(request.wait_seconds, context)
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
            _abort(
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
            _abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"shard {self.shard_index} still at version {shard.version} after {wait:.1f}s "
                f"waiting for version {request.min_version}",
            )
        return waited

    @_guarded
    def Pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponse]:
        shard, wait = self._check_pull(request, context)
        waited = self._await_version(shard, wait, request, context)
        # A locked rule's values are copied under its lock (one version); an unlocked rule's
        # are streamed as they are, each chunk copied as it goes, as its readers expect.
        version, values = shard.snapshot() if shard.rule.locked else shard.live()
        header = pb.PullHeader(
            version=version,
            tensors=specs_of(values),
            server_incarnation=self.incarnation,
            waited_seconds=waited,
        )
        yield pb.PullResponse(header=header)
        for chunk in iter_chunks(list(values.values()), self.chunk_bytes):
            yield pb.PullResponse(chunk=chunk)

    @_guarded
    def Push(
        self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext
    ) -> pb.PushResponse:
        head = self._first(request_iterator, context)
        self._check(head.header, context)
        shard = self._registered(context)
        lr_scale = self._lr_scale(head.lr_scale, context)
        self._check_push_specs(shard, head.tensors, context)
        payload = self._assemble(head.tensors, request_iterator, context, push_nbytes)
        payload = self._decode(head.tensors, payload, context)
        return self._apply_push(shard, head, lr_scale, payload)

    def _apply_push(
        self, shard: Shard, head: pb.PushHeader, lr_scale: float, payload: dict[str, np.ndarray]
    ) -> pb.PushResponse:
        meta = PushMeta(
            lr_scale=lr_scale,
            worker=head.header.worker,
            incarnation=head.header.incarnation,
            base_version=head.base_version,
        )
        outcome, version = shard.push(payload, meta)
        return pb.PushResponse(
            accepted=outcome.accepted,
            version=version,
            reason=outcome.reason,
            reject=outcome.reject.wire_name,
        )

    @_guarded
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
        try:
            write_bytes_atomic(path, data)
        except OSError as exc:
            log.error("shard %d: cannot write checkpoint %s: %s", self.shard_index, path, exc)
            _abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"ps{self.shard_index} cannot write {path} ({exc.strerror}); "
                "check the checkpoint directory's space and permissions",
            )
        digest = hashlib.sha256(data).hexdigest()
        return pb.CheckpointResponse(
            version=version, file=str(path), sha256=digest, bytes=len(data)
        )

    @_guarded
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

    @_guarded
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.MembershipResponse:
        shard = self._check_member(request.header, context, joining=True)
        self._unless_closing(context)
        epoch, members = shard.join(request.header.worker, request.header.incarnation)
        return self._membership_reply(shard, epoch, members)

    @_guarded
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.MembershipResponse:
        shard = self._check_member(request.header, context, joining=False)
        seen = shard.heartbeat(request.header.worker, request.header.incarnation)
        if seen is None:
            _abort(
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
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, _clip(str(exc), 400))

    @_guarded
    def LeaseWork(
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> pb.LeaseResponse:
        # a lease makes the worker a member (as a pull does): the index checks of a Join
        shard = self._check_member(request.header, context, joining=True)
        self._unless_closing(context)
        queue = shard.work
        if queue is None:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.shard_index} hands out no work units; ask ps0 of a run registered "
                "with them (--world-size dynamic)",
                Refusal.NO_WORK,
            )
        if request.want > MAX_LEASE:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"want {request.want} is more than {MAX_LEASE} units; lease fewer ahead",
            )
        if len(request.done) > MAX_DONE:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.done)} done units in one call; report at most {MAX_DONE}",
            )
        done: list[Unit] = []
        for item in request.done:
            unit = (item.epoch, item.unit)
            why = queue.spec.check_unit(unit)
            if why is not None:
                _abort(
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

    # -- shared memory and tensor sockets (protocol 2; see the .proto) ---------------------------
    def _attached(
        self, segment_id: int, header: pb.RequestHeader, context: grpc.ServicerContext
    ) -> Attached:
        entry = self._segments.get(segment_id, header.worker)
        if entry is None or not entry.confirmed:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ps{self.shard_index} holds no confirmed segment {segment_id} of worker "
                f"{header.worker}; attach again (or send over the stream)",
                Refusal.NO_SEGMENT,
            )
        return entry

    def _listener(self) -> bulk.Listener:
        with self._register_lock:
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
        entry = self._segments.bind_socket(segment_id, token, sock)
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
            _abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"unknown data-channel frame {kind}")

        return functools.partial(
            channel.serve,
            sock,
            handle=handle,
            closing=lambda: self.closing,
            seconds=RPC_BYTES_SECONDS,
            on_close=lambda: self._segments.remove(entry),
            name=f"ps{self.shard_index} data channel of worker {entry.worker}",
        )

    @_guarded
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        self._check(request.header, context)
        shard = self._registered(context)
        self._unless_closing(context)
        worker = request.header.worker
        if request.confirm:
            entry = self._segments.get(request.confirm, worker)
            if entry is None or entry.segment is None:
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"ps{self.shard_index} holds no segment {request.confirm} of worker {worker}"
                    "; attach again",
                    Refusal.NO_SEGMENT,
                )
            if request.cancel:
                self._segments.remove(entry)
                return pb.AttachResponse(segment=entry.id, confirmed=False)
            if not self._segments.confirm(entry, request.nonce):
                _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"wrong nonce for segment {entry.id}: the worker does not see this server's "
                    "memory; send over the stream",
                    Refusal.NO_SEGMENT,
                )
            return pb.AttachResponse(segment=entry.id, name=entry.segment.name, confirmed=True)
        with shard.cond:
            layout = Layout.of(shard.values)
        if request.socket:
            if not self.offers_channels:
                _abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"ps{self.shard_index} offers no tensor socket "
                    f"({'its data is encrypted by TLS' if self.tls else 'no address'}); "
                    "use the stream",
                    Refusal.NO_SHARED_MEMORY,
                )
            listener = self._listener()
            token = bulk.new_token()
            entry = self._segments.add(worker, None, layout, token)
            return pb.AttachResponse(
                segment=entry.id,
                size=layout.size,
                tensors=list(layout.specs),
                pull_offsets=list(layout.pull),
                push_offsets=list(layout.push),
                port=listener.port,
                token=token,
            )
        if not shm.available():
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.shard_index} has no shared memory ({shm.SHM_DIR}); use the stream",
                Refusal.NO_SHARED_MEMORY,
            )
        try:
            segment = shm.Segment.create(
                shm.run_prefix(shard.run_id), layout.size, record=self.segment_record
            )
        except shm.SegmentError as exc:
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ps{self.shard_index}: {exc.strerror or exc}; using the stream instead",
                Refusal.TOO_LARGE,
            )
        token = bulk.new_token() if self.offers_channels else b""
        entry = self._segments.add(worker, segment, layout, token)
        return pb.AttachResponse(
            segment=entry.id,
            name=segment.name,
            size=segment.size,
            tensors=list(layout.specs),
            pull_offsets=list(layout.pull),
            push_offsets=list(layout.push),
            port=self._listener().port if token else 0,
            token=token,
        )

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
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"segment {request_segment} is not this data channel's; attach again",
                Refusal.NO_SEGMENT,
            )
        if via is None and entry.segment is None:
            _abort(
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
        shard, wait = self._check_pull(request, context)
        entry = self._own_entry(request.segment, request.header, context, via)
        waited = self._await_version(shard, wait, request, context)
        arrays: list[np.ndarray] = []
        with entry.lock:
            if entry.segment is not None:
                version = shard.snapshot_into(entry.pull_views())
            else:  # a locked rule's values copied under its lock, an unlocked rule's as they are
                version, values = shard.snapshot() if shard.rule.locked else shard.live()
                arrays = list(values.values())
        header = pb.PullHeader(
            version=version,
            tensors=list(entry.layout.specs),
            server_incarnation=self.incarnation,
            waited_seconds=waited,
            in_segment=True,
        )
        return header, arrays

    @_guarded
    def PullShared(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullHeader:
        return self._pull_shared(request, context, None)[0]

    @_guarded
    def PushShared(self, request: pb.PushHeader, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._push_shared(request, context, None)

    def _push_shared(
        self, request: pb.PushHeader, context: grpc.ServicerContext, via: Attached | None
    ) -> pb.PushResponse:
        self._check(request.header, context)
        shard = self._registered(context)
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
        sizes = [
            self._encoded_size(shard, spec, context) if is_encoded(spec) else nbytes_of(spec)
            for spec in request.tensors
        ]
        with entry.lock:
            # The push area stays writable by the worker (and any process mapping the segment):
            # copy exactly the announced bytes into server-private memory first, so the bytes
            # checked (finite, decodable) are the bytes applied.
            scratch = entry.scratch_of(sum(shm.align(size) for size in sizes))
            payload: dict[str, np.ndarray] = {}
            start = 0
            for spec, size in zip(request.tensors, sizes, strict=True):
                part = scratch[start : start + size]
                start = shm.align(start + size)
                np.copyto(part, entry.segment.raw(entry.push_offset(spec.key), size))
                payload[spec.key] = (
                    part
                    if is_encoded(spec)
                    else part.view(np.dtype(spec.dtype)).reshape(tuple(spec.shape))
                )
            payload = self._decode(request.tensors, payload, context)
            return self._apply_push(shard, request, lr_scale, payload)

    def _check_shared_push(
        self, shard: Shard, request: pb.PushHeader, context: grpc.ServicerContext
    ) -> float:
        """The checks of a PushShared's header (a stream push's assembler does the last one):
        lr_scale, every piece registered as announced, no piece twice. Returns the lr_scale."""
        lr_scale = self._lr_scale(request.lr_scale, context)
        self._check_push_specs(shard, request.tensors, context)
        keys = [spec.key for spec in request.tensors]
        if len(set(keys)) != len(keys):
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a piece listed twice in one push")
        return lr_scale

    def _encoded_size(
        self, shard: Shard, spec: pb.TensorSpec, context: grpc.ServicerContext
    ) -> int:
        """Bytes of an encoded piece, at most the raw piece's (its place in a segment)."""
        try:
            size = push_nbytes(spec)
        except WireError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, _clip(str(exc), 400))
        if size > shard.values[spec.key].nbytes:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{_clip(spec.key)}: {size} encoded bytes do not fit its "
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
        sizes = [
            self._encoded_size(shard, spec, context) if is_encoded(spec) else nbytes_of(spec)
            for spec in request.tensors
        ]
        with entry.lock:
            raw = entry.scratch_of(sum(sizes))[: sum(sizes)]
            try:
                bulk.recv_into(entry.sock, raw, deadline=time.monotonic() + RPC_BYTES_SECONDS)
            except bulk.SocketClosed as exc:
                _abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"tensor socket of worker {request.header.worker}: {exc}",
                    Refusal.NO_SEGMENT,
                )
            payload: dict[str, np.ndarray] = {}
            start = 0
            for spec, size in zip(request.tensors, sizes, strict=True):
                part = raw[start : start + size]
                start += size
                payload[spec.key] = (
                    part
                    if is_encoded(spec)
                    else part.view(np.dtype(spec.dtype)).reshape(tuple(spec.shape))
                )
            payload = self._decode(request.tensors, payload, context)
            return self._apply_push(shard, request, lr_scale, payload)
