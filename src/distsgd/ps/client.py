"""The worker's view of all parameter servers: named arrays in, named arrays out.

:class:`ParameterClient` splits arrays into pieces by the :class:`PartitionPlan`, talks to every
shard in parallel, and joins the answers. Versions are per shard; ``pull`` returns the smallest.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import numpy as np

from distsgd.ps import compression
from distsgd.ps.heartbeat import MIN_HEARTBEAT_SECONDS as MIN_HEARTBEAT_SECONDS
from distsgd.ps.heartbeat import Heartbeat as Heartbeat  # re-exported: importers name it here
from distsgd.ps.heartbeat import MembershipCallback as MembershipCallback
from distsgd.ps.partition import PartitionPlan
from distsgd.ps.placement import PiecePlacement
from distsgd.ps.pull_encoding import PullDecoder, pull_encoding_for
from distsgd.ps.sequence import push_sequence, steps_applied
from distsgd.transport.carriers.base import Payload
from distsgd.transport.client import PushResult, ShardClient
from distsgd.transport.delay import LinkDelay
from distsgd.transport.errors import PushReject, RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.security import TlsConfig

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[ParameterClient, _P], _R],
) -> Callable[Concatenate[ParameterClient, _P], _R]:
    """``method`` under the client's lock: one exchange at a time."""

    @functools.wraps(method)
    def under_lock(self: ParameterClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return under_lock


class ParameterClient:
    """Pull and push named numpy arrays across the shards of a partition plan.

    Exactly once (:mod:`distsgd.ps.sequence`): ``last_sequence`` is the sequence of this
    worker's last push; ``applied_sequences``, per shard, the highest one it had applied from
    this worker when :meth:`wait_registered` asked (a restarted worker continues from there).
    """

    startup_seconds = 300.0
    """How long the first pull that waits for a version may wait in all (the start-up wait:
    ``TaskEnv.startup_timeout``); later ones wait a call's time and its retries."""
    _waited_once = False

    def __init__(
        self,
        addresses: Sequence[str],
        plan: PartitionPlan,
        *,
        worker: int,
        incarnation: int = 0,
        run_id: str = "",
        timeout: float = 30.0,
        retry_seconds: float = 60.0,
        secret: str | None = None,
        tls: TlsConfig | None = None,
        shared_memory: bool = False,
        tensor_socket: bool = False,
        wire_dtype: str = "float32",
        topk: float = 0.0,
        link_delays: Sequence[LinkDelay | None] = (),
        pull_dtype: str = "float32",
    ) -> None:
        """``shared_memory``: tensors to and from servers on this host go through shared memory
        (see :class:`~distsgd.transport.client.ShardClient`), ``tensor_socket``: to other
        servers (or with shared memory off) through a plain TCP connection. ``wire_dtype``
        (float32, bf16, fp16, int8, int4, int2) and ``topk`` (a fraction, 0 = off) compress
        pushes (:mod:`distsgd.ps.compression`); the residual of integer codes and top-k stays
        here and joins
        the next push (error feedback). ``link_delays``: per shard, the emulated link's delay
        each call to it waits (:mod:`distsgd.transport.delay`; none where not given).
        ``pull_dtype`` (float32, bf16, fp16): the dtype pulled float pieces travel in where a
        pull crosses a network (:mod:`distsgd.ps.pull_encoding`)."""
        if len(addresses) != plan.num_shards:
            raise ValueError(
                f"{len(addresses)} ps addresses for a plan of {plan.num_shards} shards"
            )
        self.placement = PiecePlacement(plan, worker)
        """Where each piece is, as last heard (``--rebalance``; see :mod:`distsgd.ps.moves`)."""
        self.worker = worker
        self.shards = [
            ShardClient(
                a,
                worker=worker,
                incarnation=incarnation,
                run_id=run_id,
                timeout=timeout,
                retry_seconds=retry_seconds,
                secret=secret,
                tls=tls,
                shared_memory=shared_memory,
                tensor_socket=tensor_socket,
                delay=link_delays[i] if i < len(link_delays) else None,
                pull_decoding=_pull_decoder(pull_dtype),
            )
            for i, a in enumerate(addresses)
        ]
        self._pool = ThreadPoolExecutor(max(1, len(addresses)), "ps-client")
        encoding = compression.encoding_for(wire_dtype)
        self.feedback: compression.ErrorFeedback | None = (
            compression.ErrorFeedback(encoding, topk)
            if encoding is not compression.Encoding.RAW or topk > 0
            else None
        )
        """The pushes' encoder (None: raw float32 pushes)."""
        self.versions = [0] * len(addresses)
        self._lock = threading.RLock()
        """One exchange at a time: a background exchange and the chief's evaluation pull share
        the shards' shared-memory segments."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_waited = 0.0
        """Seconds the last pull spent waiting on the servers for a version (the longest
        shard's wait: the shards are pulled in parallel)."""
        self.members: list[list[int]] = [[] for _ in addresses]
        """Each shard's live members as last heard (:meth:`join`, :class:`Heartbeat`)."""
        self.last_sequence, self.applied_sequences = 0, [0] * len(addresses)

    @property
    def plan(self) -> PartitionPlan:
        """Where each piece is, as last heard: the base plan with the pieces the servers moved."""
        return self.placement.plan

    @property
    def moves_followed(self) -> int:
        """How many times this client learned that pieces had moved."""
        return self.placement.moves_followed

    @property
    def tensor_socket_shards(self) -> int:
        """How many shards this client reaches through a tensor socket now."""
        return sum(shard.uses_tensor_socket for shard in self.shards)

    @property
    def shared_memory_shards(self) -> int:
        """How many shards this client reaches through shared memory now."""
        return sum(shard.uses_shared_memory for shard in self.shards)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for shard in self.shards:
            shard.close()

    def _each(self, fn: Any) -> list[Any]:
        if len(self.shards) == 1:
            return [fn(0, self.shards[0])]
        return list(self._pool.map(lambda i: fn(i, self.shards[i]), range(len(self.shards))))

    def register(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        scheme: str,
        options: Mapping[str, Any],
        num_workers: int,
        work: pb.WorkSpec | None = None,
    ) -> None:
        """(Chief) hand each shard its pieces; idempotent for the same model and scheme.
        ``work``: the work units shard 0 hands out (see :meth:`lease_work`)."""
        parts = self.plan.split(arrays)
        text = json.dumps(dict(options), sort_keys=True)
        self._each(
            lambda i, s: s.register(
                shard_index=i,
                scheme=scheme,
                options_json=text,
                num_workers=num_workers,
                tensors=parts[i],
                work=work if i == 0 else None,
            )
        )

    def lease_work(self, done: Sequence[tuple[int, int]] = (), want: int = 0) -> pb.LeaseResponse:
        """Report work units done and hold up to ``want`` (shard 0 hands them out)."""
        return self.shards[0].lease_work(done, want)

    def wait_registered(self, timeout: float) -> None:
        """Block until every shard is registered with this plan's pieces (following the moves
        the shards report: a worker that starts after pieces moved learns where they are)."""
        infos = _registered_infos(self.shards, timeout)
        self.applied_sequences = [info.applied_sequence for info in infos]
        self.placement.follow(infos)
        self.placement.check_held(infos)

    @_locked
    def pull(
        self,
        *,
        min_version: int | Sequence[int] = 0,
        wait_seconds: float | None = None,
        record: bool = True,
        into: Mapping[str, np.ndarray] | None = None,
        names: Collection[str] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Named full arrays once each shard reaches its ``min_version``: (min version, arrays).

        ``record`` keeps the shards' versions as the base of the next push (off for a look that
        must not disturb the worker's own bookkeeping, such as a mid-run evaluation). ``into``:
        write the values into these arrays (every parameter, its shape and dtype; e.g. numpy
        views of a model's parameters) and return them, saving a copy. ``names``: only these
        parameters, from the shards that hold a piece of them (the version is the least of
        theirs; the others' recorded versions stay).
        """
        mins = _per_shard(min_version, len(self.shards))

        def attempt() -> list[tuple[int, dict[str, np.ndarray]] | None]:
            keys: list[list[str]] = [[] for _ in self.shards]
            for piece in [] if names is None else self.plan.some(names):  # where they are now
                keys[piece.shard].append(piece.key)

            def one(i: int, shard: ShardClient) -> tuple[int, dict[str, np.ndarray]] | None:
                if names is None:
                    return shard.pull(min_version=mins[i], wait_seconds=wait_seconds)
                if not keys[i]:
                    return None  # holds none of them: not asked
                return shard.pull(min_version=mins[i], wait_seconds=wait_seconds, keys=keys[i])

            return self._each(one)

        results = self._patient(attempt, mins)
        if self.placement.lacks(results, names):  # pieces moved: learn where, and pull again
            self.placement.follow(self.info())
            results = attempt()
        asked = [i for i, result in enumerate(results) if result is not None]
        self.last_waited = max(self.shards[i].last_waited for i in asked)
        if record:
            self.versions = [
                v if r is None else r[0] for v, r in zip(self.versions, results, strict=True)
            ]
        self.bytes_received += sum(self.shards[i].last_pull_nbytes for i in asked)
        pieces = [{} if result is None else result[1] for result in results]
        joined = (
            self.plan.join(pieces, names)
            if into is None
            else self.plan.join_into(pieces, into, names)
        )
        return min(r[0] for r in results if r is not None), joined

    def _patient(self, attempt: Callable[[], _Pulled], mins: Sequence[int]) -> _Pulled:
        """``attempt()``; while no pull of this client has waited for a version yet, one that
        timed out waiting (DEADLINE_EXCEEDED: the other workers have not pushed yet; on a
        cluster started by hand they may start minutes later) is tried again for up to
        :attr:`startup_seconds`, the start-up wait, not only a call's."""
        if self._waited_once or not any(mins):
            return attempt()
        give_up = time.monotonic() + self.startup_seconds
        while True:
            try:
                results = attempt()
                break
            except RemoteError as exc:
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > give_up:
                    raise
                log.info("worker %d: waiting for the other workers' first updates", self.worker)
                time.sleep(0.05)
        self._waited_once = True
        return results

    @_locked
    def push(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        base_version: int | Sequence[int] | None = None,
        lr_scale: float = 1.0,
        step: int | None = None,
    ) -> list[PushResult]:
        """Send named arrays (gradients, updates); ``base_version`` defaults to the last pulled.

        ``step``: the steps of this worker the push reflects; it numbers the push (exactly
        once: a shard applies a sequence once, see :mod:`distsgd.ps.sequence`), so that it is
        sent again, not lost, when its server dies and comes back. None: no number (a tool)."""
        seq = 0 if step is None else push_sequence(step, self.last_sequence)
        self.last_sequence = max(self.last_sequence, seq)
        n = len(self.shards)
        bases = self.versions if base_version is None else _per_shard(base_version, n)
        partial = set(arrays) != self.plan.names
        parts = self.plan.split(arrays, partial=partial)
        payloads = [Payload.raw({}) for _ in parts]

        def first(i: int, shard: ShardClient) -> PushResult:
            if partial and not parts[i]:  # holds none of them: nothing sent, nothing changed
                return PushResult(True, self.versions[i], sent=False)
            payloads[i] = _payload(self.feedback, parts[i])  # encoded side by side, in the pool
            return self._send(i, payloads[i], bases[i], lr_scale, seq)

        results = self._each(first)
        moved = [i for i, r in enumerate(results) if r.reject is PushReject.MOVED]
        if moved:  # pieces moved: send them on to where they are
            results = self._resend(moved, payloads, results, lr_scale, seq)
        return results

    def _send(
        self, i: int, payload: Payload, base: int, lr_scale: float, seq: int = 0
    ) -> PushResult:
        """One shard's part of a push, under sequence ``seq`` (0: none), sent again while the
        server is down or restarting, up to ``retry_seconds`` (it applies it once); a server
        down longer loses it (LOST), and training goes on."""
        self.bytes_sent += sum(a.nbytes for a in payload.arrays)
        try:
            return self.shards[i].push(
                base_version=base, tensors=payload, lr_scale=lr_scale, sequence=seq
            )
        except RemoteError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            # The server is down (or restarting) past the retries: this update is lost,
            # training goes on; the next pull waits, with backoff, until the server is back.
            log.warning("push to ps%d lost: %s", i, exc.message)
            lost = PushReject.LOST
            return PushResult(False, self.versions[i], f"{lost.label}: {exc.message}", lost)

    def _resend(
        self,
        moved: list[int],
        payloads: list[Payload],
        results: list[PushResult],
        lr_scale: float,
        seq: int = 0,
    ) -> list[PushResult]:
        """Shards ``moved`` refused their part MOVED (nothing of it applied): follow the moves
        and send each of its pieces to the shard that holds it now (again, should it have
        moved on meanwhile, up to :data:`MAX_MOVE_HOPS` times). Each hop goes under a sequence
        of its own, the worker's next: the shard that holds a piece now may have applied its own
        part of this push under ``seq`` already, and would drop the resend as a duplicate."""
        out = list(results)
        for i in moved:
            pending = [(payloads[i], results[i])]
            done: list[tuple[Payload, PushResult]] = []
            for _ in range(MAX_MOVE_HOPS):
                self.placement.adopt({k: s for _, r in pending for k, s in r.moved.items()})
                again: list[tuple[Payload, PushResult]] = []
                hop = 0 if seq == 0 else push_sequence(steps_applied(seq), self.last_sequence)
                self.last_sequence = max(self.last_sequence, hop)
                for payload, _ in pending:
                    for j, keys in self.placement.by_owner(payload).items():
                        part = payload.only(keys)
                        reply = self._send(j, part, self.versions[j], lr_scale, hop)
                        (again if reply.reject is PushReject.MOVED else done).append((part, reply))
                pending = again
                if not pending:
                    break
            replies = [r for _, r in done + pending]
            out[i] = next((r for r in replies if not r.accepted), replies[0])
        return out

    def steps_applied(self) -> int:
        """The steps of this worker whose pushes every shard had applied when
        :meth:`wait_registered` asked (0: none, or a fresh run): where a restarted worker
        continues. A shard that lacks a later step's push gets it when the step is trained
        again; the shards that have it answer that push ``duplicate``."""
        return min(steps_applied(s) for s in self.applied_sequences)

    def push_buffers(self) -> dict[str, np.ndarray] | None:
        """Where to write a whole push so that :meth:`push` copies nothing: one array per
        parameter (of its shape), views of the servers' shared-memory push areas, or None
        unless every parameter is a whole piece on a server reached through shared memory and
        pushes travel uncompressed.

        Write them only between calls (never while a pull or push runs). A failure that
        abandons a segment leaves them valid memory that later pushes copy from as from any
        array; call this again to get the new segment's."""
        if self.feedback is not None:
            return None
        with self._lock:
            areas = [shard.push_area() for shard in self.shards]
        return self.placement.buffers(areas)

    def release_pulled(self) -> None:
        """Give the memory the last pull's values took on the way back (each shared-memory
        segment's pull area: a pull writes it again). Only once they were copied where they
        are kept, such as the replica's parameters (``pull(into=...)``)."""
        with self._lock:
            for shard in self.shards:
                shard.release_pulled()

    def checkpoint(self, name: str) -> list[dict[str, Any]]:
        """Every shard writes its state under checkpoint ``name``: file, sha256, bytes, version."""
        replies = self._each(lambda i, s: s.checkpoint(name))
        return [
            {"file": r.file, "sha256": r.sha256, "bytes": r.bytes, "version": r.version}
            for r in replies
        ]

    def leave(self) -> None:
        self._each(lambda i, s: s.leave())

    def join(self) -> list[pb.MembershipResponse]:
        """Join every shard's membership (protocol 4); each shard's epoch and members."""
        replies: list[pb.MembershipResponse] = self._each(lambda i, s: s.join())
        self.members = [list(r.members) for r in replies]
        return replies

    @property
    def live_workers(self) -> int:
        """How many workers are members of any shard, as last heard (0 before :meth:`join`)."""
        return len(set().union(*self.members)) if self.members else 0

    def info(self) -> list[pb.InfoResponse]:
        return self._each(lambda i, s: s.info())


def _payload(
    feedback: compression.ErrorFeedback | None, pieces: Mapping[str, np.ndarray]
) -> Payload:
    """One shard's pieces as they travel: raw, or encoded by ``feedback``."""
    if feedback is None:
        return Payload.raw(pieces)
    encoded = {}
    for key, array in pieces.items():
        piece = feedback.encode(key, array)
        spec = pb.TensorSpec(
            key=key,
            dtype=array.dtype.name,
            shape=list(array.shape),
            encoding=f"TENSOR_ENCODING_{piece.encoding.name}",
            scale=piece.scale,
            nnz=piece.nnz,
        )
        encoded[key] = (spec, piece.parts)
    return Payload.of_encoded(encoded)


def _per_shard(value: int | Sequence[int], count: int) -> list[int]:
    """One value per shard: ``value`` for each of ``count``, or the sequence given."""
    return [value] * count if isinstance(value, int) else list(value)


def _registered_infos(shards: Sequence[ShardClient], timeout: float) -> list[pb.InfoResponse]:
    """Each shard's Info once it is registered, waiting up to ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    infos: list[pb.InfoResponse] = []
    for i, shard in enumerate(shards):
        while True:
            info = shard.info()
            if info.registered:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ps{i} at {shard.address} was not registered within {timeout:.0f}s; "
                    "is the chief (worker 0) running?"
                )
            time.sleep(0.05)
        infos.append(info)
    return infos


def _pull_decoder(pull_dtype: str) -> PullDecoder | None:
    """The decoder of pulls asked in ``pull_dtype`` (None: float32, nothing to decode)."""
    encoding = pull_encoding_for(pull_dtype)
    return None if encoding is compression.Encoding.RAW else PullDecoder(encoding)


_Pulled = list[tuple[int, dict[str, np.ndarray]] | None]
"""Each shard's answer to a pull (None: not asked)."""

MAX_MOVE_HOPS = 8
"""How many times one push follows its pieces to another shard before it gives up (a piece
moved again between two answers); the last answer, MOVED, is then the push's."""
