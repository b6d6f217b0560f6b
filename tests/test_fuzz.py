"""Fuzzing the parameter server over the wire: whatever arrives, it answers with an error status,
stays up, and leaves the registered parameters and version as they were.

One in-process server (port 0, run secret set) holds a small hogwild model. Hypothesis sends
every RPC random and malformed requests through a raw stub (with the right secret, so the
requests reach the service): random protocol versions and run ids, random and huge shapes,
unknown dtypes and keys, chunks with random index, offset and data, streams without a header or
with two, and random bytes that may not even parse. A well-formed push with valid keys and
shapes would be applied by hogwild, so such pushes are filtered out: every push sent must be
refused. After every example a correct client pulls and compares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import loadclock
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from distsgd.ps import UpdateRule, start_server
from distsgd.ps.rules import MAX_LR_SCALE
from distsgd.schemes import make_server_rule, names
from distsgd.transport import METADATA_KEY, PROTOCOL_VERSION, PushReject, RemoteError, ShardClient
from distsgd.transport.codec import ALLOWED_DTYPES, ChunkAssembler, WireError, iter_chunks
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc

SECRET = "fuzz-" + "0f" * 16
RUN = "fuzzrun"
METADATA = ((METADATA_KEY, SECRET),)
HOGWILD = {"lr": 0.5, "momentum": 0.0}
NUM_WORKERS = 2
SERVICE = "/distsgd.v1.ParameterServer/"
TIMEOUT = 5.0
PULL_TIMEOUT = 0.25
"""Deadline of fuzzed pulls: one whose min_version is never reached waits this long."""
REGISTER_ALLOC_LIMIT = 16 << 20
"""Register assembles what its header announces before comparing it with the registered pieces
(up to checks.MAX_MESSAGE_BYTES, 4 GiB, each call); fuzzed Registers stay below this or far above
4 GiB so that the test does not allocate gigabytes."""

CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_.-]+")

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _model() -> dict[str, np.ndarray]:
    return {
        "w#0": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
        "b#0": np.array([1.0, -2.0, 0.5], dtype=np.float32),
        "s#0": np.array(3.0, dtype=np.float64),
    }


MODEL = _model()
SPECS = {key: (a.dtype.name, a.shape) for key, a in MODEL.items()}


@dataclass
class Target:
    address: str
    service: Any
    channel: grpc.Channel
    stub: pb_grpc.ParameterServerStub
    good: ShardClient
    version: int
    values: dict[str, np.ndarray]
    root: Path
    checkpoint_dir: Path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("fuzz")
    checkpoint_dir = root / "checkpoints"
    checkpoint_dir.mkdir()
    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        secret=SECRET,
        checkpoint_dir=checkpoint_dir,
    )
    channel = grpc.insecure_channel(address)
    good = ShardClient(address, worker=0, run_id=RUN, secret=SECRET, timeout=TIMEOUT)
    try:
        reply = good.register(
            shard_index=0,
            scheme="hogwild",
            options_json=json.dumps(HOGWILD),
            num_workers=NUM_WORKERS,
            tensors=MODEL,
        )
        assert reply.created
        version, values = good.pull()
        yield Target(
            address=address,
            service=service,
            channel=channel,
            stub=pb_grpc.ParameterServerStub(channel),
            good=good,
            version=version,
            values=values,
            root=root,
            checkpoint_dir=checkpoint_dir,
        )
    finally:
        good.close()
        channel.close()
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def _files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def assert_unchanged(t: Target) -> None:
    """The server answers, and holds exactly the registered parameters at the same version."""
    info = t.good.info(retry=False)
    assert info.registered and info.scheme == "hogwild"
    assert [(s.key, s.dtype, tuple(s.shape)) for s in info.tensors] == [
        (k, d, s) for k, (d, s) in SPECS.items()
    ]
    version, values = t.good.pull()
    assert version == t.version
    assert list(values) == list(t.values)
    for key, value in values.items():
        assert value.dtype == t.values[key].dtype and value.shape == t.values[key].shape, key
        np.testing.assert_array_equal(value, t.values[key], err_msg=key)
    outside = {p for p in _files_under(t.root) if t.checkpoint_dir not in p.parents}
    assert not outside, f"files written outside the checkpoint dir: {sorted(outside)}"


def call(fn: Any, *args: Any, **kw: Any) -> tuple[grpc.StatusCode, Any]:
    """Run one RPC; (status code, reply or None)."""
    try:
        reply = fn(*args, metadata=METADATA, **kw)
        if isinstance(reply, Iterator):
            reply = list(reply)
    except grpc.RpcError as exc:
        event(f"status {exc.code().name}")  # shown by pytest --hypothesis-show-statistics
        return exc.code(), None
    event("status OK")
    return grpc.StatusCode.OK, reply


# --------------------------------------------------------------------------- strategies

U32 = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1))
I64 = st.one_of(st.integers(-2, 4), st.integers(-(2**63), 2**63 - 1))

workers = st.one_of(st.integers(-1, NUM_WORKERS - 1), st.integers(-(2**31), 2**31 - 1))
good_headers = st.builds(
    pb.RequestHeader,
    protocol_version=st.just(PROTOCOL_VERSION),
    run_id=st.sampled_from(["", RUN]),
    worker=workers,
    incarnation=U64,
)
any_headers = st.builds(
    pb.RequestHeader,
    protocol_version=U32,
    run_id=st.one_of(st.just(""), st.just(RUN), st.text(max_size=12)),
    worker=workers,
    incarnation=U64,
)
headers = st.one_of(good_headers, any_headers)
"""Request headers, half of them ones the server accepts (so the rest of the request is tested)."""

dtypes = st.one_of(
    st.sampled_from(sorted(ALLOWED_DTYPES)),
    st.sampled_from(["bfloat16", "float128", "complex64", "object", "<f4", ">f4", "f4", "", "V8"]),
    st.text(max_size=8),
)

shapes = st.one_of(
    st.lists(st.integers(0, 5), max_size=3),
    st.lists(I64, max_size=4),
    st.lists(st.sampled_from([2**31, 2**40, 2**62, -1, -(2**63)]), min_size=1, max_size=3),
)

random_specs = st.builds(
    pb.TensorSpec,
    key=st.one_of(st.sampled_from(sorted(SPECS)), st.text(max_size=10)),
    dtype=dtypes,
    shape=shapes,
)
registered_specs = st.sampled_from(sorted(SPECS)).map(
    lambda k: pb.TensorSpec(key=k, dtype=SPECS[k][0], shape=list(SPECS[k][1]))
)
specs = st.one_of(random_specs, registered_specs)

random_chunks = st.builds(pb.TensorChunk, index=U32, offset=U64, data=st.binary(max_size=40))


def _nbytes(spec: pb.TensorSpec) -> int | None:
    """What the header announces for one tensor; None if the spec is invalid anyway."""
    if spec.dtype not in ALLOWED_DTYPES or any(d < 0 for d in spec.shape):
        return None
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize


def _announced(tensors: list[pb.TensorSpec]) -> int:
    sizes = [_nbytes(s) for s in tensors]
    return 0 if None in sizes else sum(s for s in sizes if s is not None)


def _safe_to_send(tensors: list[pb.TensorSpec]) -> bool:
    total = _announced(tensors)
    return total <= REGISTER_ALLOC_LIMIT or total > (4 << 30)


@st.composite
def tensor_streams(draw: st.DrawFn) -> tuple[list[pb.TensorSpec], list[pb.TensorChunk], str]:
    """Specs and the chunks that follow them: random, or right with one mutation."""
    tensors = draw(st.lists(specs, max_size=4))
    shape_of = st.sampled_from(
        ["random", "exact", "drop", "extra", "offset", "index", "dup", "shuffle", "none"]
    )
    how = draw(shape_of)
    if how == "random":
        return tensors, draw(st.lists(random_chunks, max_size=6)), how
    # Chunks for the tensors as announced, where they can be made (small, valid dtype).
    arrays: list[np.ndarray] = []
    for spec in tensors:
        size = _nbytes(spec)
        if size is None or size > 4096:
            arrays.append(np.zeros(draw(st.integers(0, 8)), np.uint8))
        else:
            raw = draw(st.binary(min_size=size, max_size=size))
            arrays.append(np.frombuffer(raw, np.uint8))
    chunks = list(iter_chunks(arrays, chunk_bytes=draw(st.integers(1, 16))))
    if how == "drop" and chunks:
        del chunks[draw(st.integers(0, len(chunks) - 1))]
    elif how == "extra":
        chunks.append(draw(random_chunks))
    elif how == "offset" and chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = pb.TensorChunk(index=chunks[i].index, offset=draw(U64), data=chunks[i].data)
    elif how == "index" and chunks:
        i = draw(st.integers(0, len(chunks) - 1))
        chunks[i] = pb.TensorChunk(index=draw(U32), offset=chunks[i].offset, data=chunks[i].data)
    elif how == "dup" and chunks:
        chunks.insert(draw(st.integers(0, len(chunks))), draw(st.sampled_from(chunks)))
    elif how == "shuffle":
        chunks = draw(st.permutations(chunks))
    elif how == "none":
        chunks = []
    return tensors, chunks, how


FRAMINGS = ["ok", "no-header", "two-headers", "only-chunks", "empty", "header-last"]


def _frame(kind: Any, header: Any, chunks: list[pb.TensorChunk], framing: str) -> list[Any]:
    body = [kind(chunk=c) for c in chunks]
    if framing == "ok":
        return [kind(header=header), *body]
    if framing == "no-header" or framing == "only-chunks":
        return body or [kind(chunk=pb.TensorChunk())]
    if framing == "two-headers":
        return [kind(header=header), *body[:1], kind(header=header), *body[1:]]
    if framing == "empty":
        return []
    return [*body, kind(header=header)]  # header-last


# --------------------------------------------------------------------------- what is valid


REFUSED_HEADER = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
"""Another protocol or run: FAILED_PRECONDITION; a worker outside the run: INVALID_ARGUMENT."""


def header_ok(header: pb.RequestHeader) -> bool:
    """What a registered shard accepts: this protocol, this run, a worker of the run (or -1)."""
    return (
        header.protocol_version == PROTOCOL_VERSION
        and header.run_id in ("", RUN)
        and -1 <= header.worker < NUM_WORKERS
    )


def assembles(tensors: list[pb.TensorSpec], rest: list[Any]) -> bool:
    """Whether header specs plus the remaining messages form a complete, well-formed stream."""
    try:
        assembler = ChunkAssembler(tensors, max_bytes=4 << 30)
        for message in rest:
            if message.WhichOneof("part") != "chunk":
                return False
            assembler.add(message.chunk)
        assembler.finish()
    except WireError:
        return False
    return True


def lr_scale_ok(value: float) -> bool:
    """What a server accepts as ``PushHeader.lr_scale``: 0 (= 1.0) or finite in (0, 1000]."""
    return value == 0 or 0 < value <= MAX_LR_SCALE


def push_would_apply(messages: list[pb.PushRequest]) -> bool:
    """A correct server applies exactly these pushes (hogwild applies every valid one)."""
    if not messages or messages[0].WhichOneof("part") != "header":
        return False
    head = messages[0].header
    if not header_ok(head.header) or not lr_scale_ok(head.lr_scale):
        return False
    for spec in head.tensors:
        if spec.key not in SPECS or (spec.dtype, tuple(spec.shape)) != SPECS[spec.key]:
            return False
    return assembles(list(head.tensors), messages[1:])


def register_is_same(messages: list[pb.RegisterRequest]) -> bool:
    """A Register a correct server answers OK (created = false): the same registration again."""
    if not messages or messages[0].WhichOneof("part") != "header":
        return False
    head = messages[0].header
    same = (
        header_ok(head.header)
        and head.shard_index == 0
        and head.scheme == "hogwild"
        and head.options_json == json.dumps(HOGWILD)
        and head.num_workers == NUM_WORKERS
        and [(s.key, s.dtype, tuple(s.shape)) for s in head.tensors]
        == [(k, d, s) for k, (d, s) in SPECS.items()]
    )
    return same and assembles(list(head.tensors), messages[1:])


def check_push(t: Target, messages: list[pb.PushRequest]) -> None:
    code, reply = call(t.stub.Push, iter(messages), timeout=TIMEOUT)
    assert code != grpc.StatusCode.OK, f"malformed push was answered OK: {reply}"
    assert code != grpc.StatusCode.UNAUTHENTICATED
    assert_unchanged(t)


def check_register(t: Target, messages: list[pb.RegisterRequest]) -> None:
    code, reply = call(t.stub.Register, iter(messages), timeout=TIMEOUT)
    if code == grpc.StatusCode.OK:
        assert register_is_same(messages), f"malformed register was answered OK: {reply}"
        assert not reply.created
    assert_unchanged(t)


# --------------------------------------------------------------------------- tests


lr_scales = st.one_of(
    st.just(0.0),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1.0, MAX_LR_SCALE * 1.0001]),
)
"""Valid and invalid ``lr_scale`` values; a push with an invalid one is refused as a whole."""


@FUZZ
@given(
    header=headers,
    base_version=U64,
    stream=tensor_streams(),
    framing=st.sampled_from(FRAMINGS),
    lr_scale=lr_scales,
)
def test_fuzz_push(target: Target, header, base_version, stream, framing, lr_scale) -> None:
    tensors, chunks, _ = stream
    assume(_safe_to_send(tensors))  # the service checks pushed specs first; stay safe anyway
    head = pb.PushHeader(
        header=header, base_version=base_version, tensors=tensors, lr_scale=lr_scale
    )
    messages = _frame(pb.PushRequest, head, chunks, framing)
    assume(not push_would_apply(messages))
    check_push(target, messages)


@FUZZ
@given(
    header=headers,
    scheme=st.one_of(st.just("hogwild"), st.sampled_from(names()), st.text(max_size=10)),
    options_json=st.one_of(st.just(json.dumps(HOGWILD)), st.text(max_size=20)),
    num_workers=st.one_of(st.just(NUM_WORKERS), U32),
    shard_index=st.one_of(st.just(0), U32),
    stream=tensor_streams(),
    framing=st.sampled_from(FRAMINGS),
)
def test_fuzz_register_on_registered_server(
    target: Target, header, scheme, options_json, num_workers, shard_index, stream, framing
) -> None:
    tensors, chunks, _ = stream
    assume(_safe_to_send(tensors))
    head = pb.RegisterHeader(
        header=header,
        scheme=scheme,
        options_json=options_json,
        num_workers=num_workers,
        tensors=tensors,
        shard_index=shard_index,
    )
    check_register(target, _frame(pb.RegisterRequest, head, chunks, framing))


@settings(FUZZ, max_examples=60)
@given(
    header=headers,
    min_version=st.one_of(st.just(0), U64),
    wait_seconds=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.floats(-1.0, PULL_TIMEOUT)
    ),
    server_incarnation=U64,
)
def test_fuzz_pull(target: Target, header, min_version, wait_seconds, server_incarnation) -> None:
    request = pb.PullRequest(
        header=header,
        min_version=min_version,
        wait_seconds=wait_seconds,
        server_incarnation=server_incarnation,
    )
    code, reply = call(target.stub.Pull, request, timeout=PULL_TIMEOUT)
    bad_wait = math.isnan(wait_seconds) or wait_seconds < 0
    restarted = server_incarnation not in (0, target.service.incarnation)
    waits = header_ok(header) and not bad_wait and min_version > target.version and not restarted
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not waits:
        # An answer that needs no waiting came too late for the short deadline (a loaded
        # machine): ask again with the long one; the answer is checked the same.
        code, reply = call(target.stub.Pull, request, timeout=TIMEOUT)
    if not header_ok(header):
        assert code in REFUSED_HEADER
    elif bad_wait:  # refused before anything else, whatever the version
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    elif code == grpc.StatusCode.OK:  # a pull is read-only: check what it sent
        assert reply[0].WhichOneof("part") == "header"
        assert reply[0].header.version == target.version
        assembler = ChunkAssembler(reply[0].header.tensors)
        for message in reply[1:]:
            assembler.add(message.chunk)
        values = assembler.finish()
        for key, value in target.values.items():
            np.testing.assert_array_equal(values[key], value)
    else:
        assert min_version > target.version and not restarted, code
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_unchanged(target)


@FUZZ
@given(header=headers)
def test_fuzz_info(target: Target, header) -> None:
    code, reply = call(target.stub.Info, pb.InfoRequest(header=header), timeout=TIMEOUT)
    assert (code == grpc.StatusCode.OK) == header_ok(header), code
    if reply is not None:
        assert reply.registered and reply.version == target.version
    assert_unchanged(target)


leave_workers = st.one_of(st.integers(-1, NUM_WORKERS - 1), st.integers(-(2**31), 2**31 - 1))
"""A worker index outside [-1, num_workers) is refused (INVALID_ARGUMENT) by every RPC."""


@contextlib.contextmanager
def fresh_server(*, register: bool) -> Iterator[tuple[str, Any, ShardClient]]:
    """A server of its own (for calls that legitimately change its state), with a client."""
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, max_threads=4
    )
    client = ShardClient(address, worker=0, run_id=RUN, timeout=TIMEOUT, retry_seconds=0.0)
    try:
        if register:
            client.register(
                shard_index=0,
                scheme="hogwild",
                options_json=json.dumps(HOGWILD),
                num_workers=NUM_WORKERS,
                tensors=MODEL,
            )
        yield address, service, client
    finally:
        client.close()
        srv.stop(grace=None).wait(timeout=5)
        service.close()


@settings(FUZZ, max_examples=50)
@given(
    leaves=st.lists(
        st.builds(
            pb.RequestHeader,
            protocol_version=st.one_of(st.just(PROTOCOL_VERSION), U32),
            run_id=st.one_of(st.sampled_from(["", RUN]), st.text(max_size=12)),
            worker=leave_workers,
            incarnation=U64,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_leave(leaves) -> None:
    """Leave changes membership (that is its job), never the parameters or the version, and the
    server goes on answering Info with consistent counters."""
    with fresh_server(register=True) as (address, _, client):
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            for header in leaves:
                code, _ = call(stub.Leave, pb.LeaveRequest(header=header), timeout=TIMEOUT)
                if not header_ok(header):
                    assert code in REFUSED_HEADER
        info = client.info(retry=False)
        assert info.active_workers + info.finished_workers == NUM_WORKERS
        version, values = client.pull()
        assert version == 0
        for key, value in MODEL.items():
            np.testing.assert_array_equal(values[key], value)


def test_leave_from_unknown_worker_is_refused() -> None:
    with fresh_server(register=True) as (address, _, client):
        stranger = ShardClient(address, worker=7, timeout=TIMEOUT, retry_seconds=0.0)
        with stranger, pytest.raises(RemoteError) as err:
            stranger.leave()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        info = client.info(retry=False)
        assert (info.active_workers, info.finished_workers) == (NUM_WORKERS, 0)


checkpoint_names = st.one_of(
    st.sampled_from(
        ["", ".", "..", "...", "../x", "../../etc/x", "/tmp/x", "a/b", "a\\b", "x" * 300, "c1"]
    ),
    st.text(max_size=20),
    st.from_regex(CHECKPOINT_NAME, fullmatch=True).filter(lambda s: len(s) <= 40),
    st.text(max_size=10).map(lambda s: "../" + s),
)


@FUZZ
@given(header=headers, name=checkpoint_names)
def test_fuzz_checkpoint(target: Target, header, name) -> None:
    request = pb.CheckpointRequest(header=header, name=name)
    code, reply = call(target.stub.Checkpoint, request, timeout=TIMEOUT)
    if code == grpc.StatusCode.OK:
        assert header_ok(header)
        assert CHECKPOINT_NAME.fullmatch(name) and set(name) != {"."}, name
        written = Path(reply.file).resolve()
        assert target.checkpoint_dir.resolve() in written.parents, reply.file
        assert reply.version == target.version
    assert_unchanged(target)


RAW_METHODS = {
    "Info": ("unary_unary", pb.InfoRequest),
    "Leave": ("unary_unary", pb.LeaveRequest),
    "Checkpoint": ("unary_unary", pb.CheckpointRequest),
    "Pull": ("unary_stream", pb.PullRequest),
    "Register": ("stream_unary", pb.RegisterRequest),
    "Push": ("stream_unary", pb.PushRequest),
    "Attach": ("unary_unary", pb.AttachRequest),
    "PullShared": ("unary_unary", pb.PullRequest),
    "PushShared": ("unary_unary", pb.PushHeader),
    "LeaseWork": ("unary_unary", pb.LeaseRequest),  # this run has no work units: refused
}


def _parse(cls: Any, raw: bytes) -> Any:
    try:
        return cls.FromString(raw)
    except Exception:  # any parse failure (DecodeError, invalid UTF-8, ...)
        return None


junk_bytes = st.one_of(
    st.binary(max_size=64),
    # a valid-looking prefix (field 1, length-delimited) followed by junk
    st.binary(max_size=48).map(lambda b: b"\x0a" + bytes([len(b) + 5]) + b),
)


@FUZZ
@given(
    method=st.sampled_from(sorted(RAW_METHODS)),
    messages=st.lists(junk_bytes, max_size=4),
)
def test_fuzz_raw_bytes(target: Target, method, messages) -> None:
    """Bytes that may not even parse, as whole messages, to every method."""
    kind, cls = RAW_METHODS[method]
    path = SERVICE + method
    parsed = [_parse(cls, raw) for raw in messages]
    announced = (
        [m.header.tensors for m in parsed if m is not None and m.HasField("header")]
        if kind == "stream_unary"
        else []
    )
    assume(all(_safe_to_send(list(t)) for t in announced))
    if kind == "stream_unary":
        fn = target.channel.stream_unary(path)
        code, _ = call(fn, iter(messages), timeout=TIMEOUT)
        if None in parsed:
            assert code != grpc.StatusCode.OK
        elif method == "Push":
            assume(not push_would_apply(parsed))
            assert code != grpc.StatusCode.OK
        elif code == grpc.StatusCode.OK:
            assert register_is_same(parsed)
    else:
        request = messages[0] if messages else b""
        first = parsed[0] if messages else cls()
        if kind == "unary_unary":
            code, _ = call(target.channel.unary_unary(path), request, timeout=TIMEOUT)
        else:
            code, _ = call(target.channel.unary_stream(path), request, timeout=PULL_TIMEOUT)
        if first is None or not header_ok(first.header):
            assert code != grpc.StatusCode.OK, method
    assert_unchanged(target)


@FUZZ
@given(
    header=headers,
    segment=U64,
    confirm=U64,
    nonce=st.binary(max_size=20),
    cancel=st.booleans(),
    tensors=st.lists(specs, max_size=3),
    lr_scale=st.floats(allow_nan=True, allow_infinity=True),
)
def test_fuzz_shared_memory_rpcs(
    target: Target, header, segment, confirm, nonce, cancel, tensors, lr_scale
) -> None:
    """Attach, PullShared and PushShared with random ids, nonces and specs: a segment nobody
    confirmed is never usable (no-segment), nothing is answered UNKNOWN or INTERNAL, and the
    parameters never change."""
    attach = pb.AttachRequest(header=header, confirm=confirm, nonce=nonce, cancel=cancel)
    code, reply = call(target.stub.Attach, attach, timeout=TIMEOUT)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), code
    if code == grpc.StatusCode.OK:
        assert header_ok(header)
        # creating is allowed; confirming needs the nonce in the segment (16 random bytes)
        assert confirm == 0 or cancel or not reply.confirmed
    pull = pb.PullRequest(header=header, segment=segment, wait_seconds=0.0)
    code, _ = call(target.stub.PullShared, pull, timeout=TIMEOUT)
    assert code in (*REFUSED_HEADER, grpc.StatusCode.INVALID_ARGUMENT), code
    push = pb.PushHeader(header=header, segment=segment, tensors=tensors, lr_scale=lr_scale)
    code, _ = call(target.stub.PushShared, push, timeout=TIMEOUT)
    assert code in (*REFUSED_HEADER, grpc.StatusCode.INVALID_ARGUMENT), code
    assert_unchanged(target)


# --------------------------------------------------------------------------- fresh servers

options_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
option_names = st.one_of(
    st.sampled_from(["lr", "momentum", "required", "server_lr", "alpha", "window", "tau"]),
    st.text(max_size=6),
)


@settings(FUZZ, max_examples=60)
@given(
    scheme=st.one_of(st.sampled_from(names()), st.text(max_size=8)),
    options_json=st.one_of(
        st.dictionaries(option_names, options_values, max_size=3).map(json.dumps),
        st.sampled_from(["", "[]", "null", "1", '"x"', "{", "1e999", '{"lr": NaN}']),
        st.text(max_size=12),
    ),
    num_workers=st.one_of(st.integers(0, 4), U32),
)
def test_fuzz_register_options_on_fresh_server(scheme, options_json, num_workers) -> None:
    """A Register that the rule factory refuses leaves the server unregistered and working."""
    with fresh_server(register=False) as (_, service, client):
        try:
            reply = client.register(
                shard_index=0,
                scheme=scheme,
                options_json=options_json,
                num_workers=num_workers,
                tensors=MODEL,
            )
            code = grpc.StatusCode.OK
        except RemoteError as exc:
            code = exc.code
        event(f"status {code.name}")
        info = client.info(retry=False)
    if code == grpc.StatusCode.OK:
        assert reply.created and info.registered
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, scheme, options_json)
        assert not info.registered and service.shard is None


# --------------------------------------------------------------------------- every field checked
# Each case below is a request a peer can send that the server used to accept (or answer
# UNKNOWN after changing part of its state). Each must now be refused with a documented status
# code, and leave values, version and counters exactly as they were (seen through Info and Pull).


@dataclass(frozen=True)
class State:
    """What a client can see of a shard: Info's counters and specs, and Pull's values."""

    registered: bool
    info: tuple[Any, ...]
    version: int
    values: dict[str, np.ndarray]


def observe(client: ShardClient) -> State:
    info = client.info(retry=False)
    counters = (
        info.scheme,
        info.version,
        info.pushes_accepted,
        info.pushes_rejected,
        info.nonfinite_rejected,
        info.active_workers,
        tuple((s.key, s.dtype, tuple(s.shape)) for s in info.tensors),
    )
    if not info.registered:
        with pytest.raises(RemoteError) as err:
            client.pull(wait_seconds=0)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        return State(False, counters, 0, {})
    version, values = client.pull(wait_seconds=0)
    return State(True, counters, version, values)


def assert_same_state(before: State, after: State) -> None:
    assert (after.registered, after.info, after.version) == (
        before.registered,
        before.info,
        before.version,
    )
    assert list(after.values) == list(before.values)
    for key, value in before.values.items():
        assert after.values[key].dtype == value.dtype, key
        np.testing.assert_array_equal(after.values[key], value, err_msg=key)


def refused(fn: Any, code: grpc.StatusCode, needle: str = "") -> RemoteError:
    """Run ``fn``; it must fail with ``code`` (never UNKNOWN) and a message holding ``needle``."""
    with pytest.raises(RemoteError) as err:
        fn()
    assert err.value.code == code, (err.value.code, err.value.message)
    assert needle in err.value.message, err.value.message
    assert "\n" not in err.value.message
    return err.value


SCHEME_OPTIONS: dict[str, dict[str, Any]] = {
    "hogwild": HOGWILD,
    "dynsgd": HOGWILD,
    "sync": {"lr": 0.5, "momentum": 0.0, "required": NUM_WORKERS},
}


@contextlib.contextmanager
def registered(scheme: str) -> Iterator[tuple[Any, ShardClient]]:
    """A fresh server holding MODEL under ``scheme``; yields (service, worker 0's client)."""
    with fresh_server(register=False) as (_, service, client):
        client.register(
            shard_index=0,
            scheme=scheme,
            options_json=json.dumps(SCHEME_OPTIONS[scheme]),
            num_workers=NUM_WORKERS,
            tensors=MODEL,
        )
        yield service, client


BAD_LR_SCALES = [math.nan, math.inf, -math.inf, 1e308, -1.0, -1e-9, MAX_LR_SCALE * 2]


@pytest.mark.parametrize("scheme", sorted(SCHEME_OPTIONS))
@pytest.mark.parametrize("lr_scale", BAD_LR_SCALES, ids=repr)
def test_push_with_bad_lr_scale_is_refused_and_changes_nothing(scheme, lr_scale) -> None:
    """A finite payload with a NaN, infinite, huge or negative lr_scale used to turn every
    parameter NaN or Inf (hogwild, dynsgd; sync at the step's close)."""
    with registered(scheme) as (service, client):
        before = observe(client)
        grads = {k: np.ones_like(v) for k, v in MODEL.items()}
        refused(
            lambda: client.push(base_version=0, tensors=grads, lr_scale=lr_scale),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lr_scale",
        )
        assert_same_state(before, observe(client))
        if scheme == "sync":
            assert not service.shard.rule.contributors  # the open step saw nothing either
        # The limit itself is accepted; 0 means 1.0.
        assert client.push(base_version=0, tensors=grads, lr_scale=MAX_LR_SCALE).accepted
        assert client.push(base_version=0, tensors=grads, lr_scale=0.0).accepted == (
            scheme != "sync"  # the same worker twice in one step is a duplicate
        )


@pytest.mark.parametrize("dtype", ["int64", "int32", "int8", "uint8", "bool"])
def test_register_with_a_non_float_piece_is_refused(dtype) -> None:
    """An int or bool piece used to register, and a later push then failed UNKNOWN after the
    float pieces before it were already updated (values changed, version not)."""
    with fresh_server(register=False) as (_, service, client):
        before = observe(client)
        model = {**MODEL, "step#0": np.zeros(2, dtype)}
        _register_refused(service, client, before, model, "step#0")


BAD_PIECES: dict[str, dict[str, np.ndarray]] = {
    "wrong dtype": {"b#0": MODEL["b#0"].astype(np.float64)},
    "wrong shape": {"b#0": np.ones(4, np.float32)},
    "unknown key": {"nope#0": np.ones(3, np.float32)},
    "int dtype": {"b#0": np.ones(3, np.int32)},
    "scalar as vector": {"s#0": np.ones(1, np.float64)},
}


@pytest.mark.parametrize("bad", sorted(BAD_PIECES))
def test_push_with_one_bad_piece_changes_no_piece(target: Target, bad) -> None:
    """The good pieces listed before the bad one are not applied either: the push is checked
    whole before any of it is."""
    good = {k: np.ones_like(v) for k, v in MODEL.items() if k not in BAD_PIECES[bad]}
    tensors = {**good, **BAD_PIECES[bad]}  # the bad one last: after every good one
    before = observe(target.good)
    refused(
        lambda: target.good.push(base_version=0, tensors=tensors),
        grpc.StatusCode.INVALID_ARGUMENT,
        next(iter(BAD_PIECES[bad])),
    )
    assert_same_state(before, observe(target.good))
    assert_unchanged(target)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_push_with_one_nonfinite_piece_changes_no_piece(target: Target, bad) -> None:
    """Not an error (PushResponse.accepted is false, reject NONFINITE), and nothing applied."""
    tensors = {k: np.ones_like(v) for k, v in MODEL.items()}
    tensors["s#0"] = np.array(bad)  # the last piece
    before = observe(target.good)
    result = target.good.push(base_version=0, tensors=tensors)
    assert not result.accepted and result.reject is PushReject.NONFINITE, result
    assert result.reason.startswith("nonfinite") and "s#0" in result.reason
    after = observe(target.good)
    assert after.info[4] == before.info[4] + 1  # nonfinite_rejected counted the refusal
    assert after.version == before.version
    assert_same_state(before, dataclasses.replace(after, info=before.info))  # values as they were


def _deep(depth: int) -> str:
    return '{"lr": 0.5, "x": ' + "[" * depth + "]" * depth + "}"


BAD_OPTIONS = [
    # (scheme, options_json, what the message names)
    ("hogwild", '{"lr": NaN}', "NaN"),
    ("hogwild", '{"lr": Infinity}', "Infinity"),
    ("hogwild", '{"lr": -Infinity}', "Infinity"),
    ("hogwild", '{"lr": 0.5, "momentum": NaN}', "NaN"),
    ("hogwild", '{"lr": 1e400}', "overflows"),
    ("hogwild", '{"lr": -0.5}', "lr"),
    ("hogwild", '{"lr": 0}', "lr"),
    ("hogwild", '{"lr": 1e9}', "lr"),
    ("hogwild", '{"lr": "0.5"}', "lr"),
    ("hogwild", '{"lr": true}', "lr"),
    ("hogwild", '{"lr": [0.5]}', "lr"),
    ("hogwild", '{"lr": 0.5, "momentum": 2}', "momentum"),
    ("hogwild", '{"momentum": 0.5}', "lr"),
    ("hogwild", '{"lr": 0.5, "typo": 1}', "typo"),
    ("hogwild", '{"lr": 1' + "0" * 5000 + "}", "options_json"),
    ("hogwild", "[]", "object"),
    ("hogwild", "null", "object"),
    ("hogwild", '{"lr": 0.5', "JSON"),
    ("hogwild", _deep(4), "nests"),
    ("hogwild", _deep(30_000), "nests"),  # 60 KB: within the size limit, past recursion
    ("hogwild", '{"lr": 0.5, "pad": "' + "x" * (64 << 10) + '"}', "bytes"),
    ("sync", '{"lr": 0.5, "required": -1}', "required"),
    ("sync", '{"lr": 0.5, "required": 0}', "required"),
    ("sync", '{"lr": 0.5, "required": 1e400}', "overflows"),
    ("sync", '{"lr": 0.5, "required": 1.5}', "required"),
    ("sync", '{"lr": 0.5, "required": 2.0}', "required"),
    ("sync", '{"lr": 0.5, "required": 3}', "required"),  # more than the 2 workers
    ("sync", '{"lr": 0.5, "required": 99999999999999999999999}', "required"),
    ("sync", '{"lr": 0.5, "required": 2, "step_timeout": 0}', "step_timeout"),
    ("sync", '{"lr": 0.5, "required": 2, "step_timeout": 1e300}', "step_timeout"),
    ("sync", '{"lr": 0.5}', "required"),
    ("sagn", '{"lr": NaN, "required": 2}', "NaN"),
    ("downpour", '{"server_lr": -1}', "server_lr"),
    ("downpour", '{"server_lr": 0.5, "lr": 0.1}', "lr"),
    ("easgd", '{"alpha": 0.5}', "alpha"),
]


@pytest.mark.parametrize(("scheme", "options_json", "needle"), BAD_OPTIONS, ids=lambda v: v[:40])
def test_register_with_bad_options_is_refused(scheme, options_json, needle) -> None:
    """NaN, Infinity, overflowing or out-of-range options, deep or huge JSON: INVALID_ARGUMENT
    with a message naming the option (they used to register, or answer UNKNOWN)."""
    with fresh_server(register=False) as (_, service, client):
        before = observe(client)
        refused(
            lambda: client.register(
                shard_index=0,
                scheme=scheme,
                options_json=options_json,
                num_workers=NUM_WORKERS,
                tensors=MODEL,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            needle,
        )
        assert service.shard is None
        assert_same_state(before, observe(client))


def _register_refused(service, client, before, model, key: str) -> None:  # type: ignore[no-untyped-def]
    """Registering ``model`` is refused INVALID_ARGUMENT naming ``key``, and nothing changes."""
    refused(
        lambda: client.register(
            shard_index=0,
            scheme="hogwild",
            options_json=json.dumps(HOGWILD),
            num_workers=NUM_WORKERS,
            tensors=model,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        key,
    )
    assert service.shard is None
    assert_same_state(before, observe(client))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_register_with_nonfinite_initial_values_is_refused(bad, dtype) -> None:
    with fresh_server(register=False) as (_, service, client):
        before = observe(client)
        model = {**MODEL, "z#0": np.array([0.0, bad, 1.0], dtype)}
        _register_refused(service, client, before, model, "z#0")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("num_workers", 0, "workers"),
        ("num_workers", 2**32 - 1, "workers"),
        ("scheme", "", "scheme"),
        ("scheme", "x" * 100_000, "scheme"),
        ("scheme", "hog wild", "scheme"),
    ],
)
def test_register_header_fields_are_checked(field, value, needle) -> None:
    with fresh_server(register=False) as (address, service, client):
        before = observe(client)
        head = pb.RegisterHeader(
            header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
            scheme="hogwild",
            options_json=json.dumps(HOGWILD),
            num_workers=NUM_WORKERS,
            shard_index=0,
        )
        setattr(head, field, value)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(iter([pb.RegisterRequest(header=head)]), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (err.value.details() or "")
        assert service.shard is None
        assert_same_state(before, observe(client))


def raw_pull(t: Target, request: pb.PullRequest, timeout: float) -> grpc.StatusCode:
    """One Pull through the raw stub (no client-side checks); its status code."""
    try:
        list(t.stub.Pull(request, metadata=METADATA, timeout=timeout))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("wait_seconds", "code"),
    [
        (math.nan, grpc.StatusCode.INVALID_ARGUMENT),
        (-1.0, grpc.StatusCode.INVALID_ARGUMENT),
        (-math.inf, grpc.StatusCode.INVALID_ARGUMENT),
        (math.inf, grpc.StatusCode.DEADLINE_EXCEEDED),  # capped, then bounded by the deadline
        (1e300, grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
    ids=["nan", "negative", "-inf", "inf", "huge"],
)
def test_pull_wait_seconds_is_checked(target: Target, wait_seconds, code) -> None:
    """inf used to answer UNKNOWN ("timestamp out of range"); NaN and negative are refused."""
    before = observe(target.good)
    request = pb.PullRequest(
        header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
        min_version=target.version + 1,  # never reached: the pull would wait
        wait_seconds=wait_seconds,
    )
    assert raw_pull(target, request, PULL_TIMEOUT) == code
    # Reached at once: a refused wait_seconds is refused all the same, a valid one answers.
    request.min_version = 0
    now = grpc.StatusCode.OK if code != grpc.StatusCode.INVALID_ARGUMENT else code
    assert raw_pull(target, request, TIMEOUT) == now
    assert_same_state(before, observe(target.good))
    assert_unchanged(target)


def test_pull_wait_is_capped_on_the_server(target: Target, monkeypatch) -> None:
    """A pull asking to wait forever (and with no deadline) waits MAX_WAIT_SECONDS, then
    DEADLINE_EXCEEDED; here the cap is lowered to 0.3 s to see it."""
    from distsgd.ps import checks

    monkeypatch.setattr(checks, "MAX_WAIT_SECONDS", 0.3)
    request = pb.PullRequest(
        header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
        min_version=target.version + 1,
        wait_seconds=math.inf,
    )
    started, watch = time.monotonic(), loadclock.Stopwatch()
    with pytest.raises(grpc.RpcError) as err:
        list(target.stub.Pull(request, metadata=METADATA))  # no client deadline at all
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "after 0.3s" in (err.value.details() or "")
    assert time.monotonic() - started > 0.25 and watch.elapsed() < 5.0
    assert_unchanged(target)


def test_shard_client_checks_wait_seconds(target: Target) -> None:
    with pytest.raises(ValueError, match="wait_seconds"):
        target.good.pull(wait_seconds=math.nan)
    with pytest.raises(ValueError, match="wait_seconds"):
        target.good.pull(wait_seconds=-1.0)
    assert target.good.pull(wait_seconds=math.inf)[0] == target.version  # capped, answered
    assert_unchanged(target)


def test_unexpected_error_is_internal_not_unknown() -> None:
    """A rule that raises (a bug) answers INTERNAL with a one-line message, never UNKNOWN."""

    class Broken(UpdateRule):
        def apply(self, shard: Any, payload: Any, meta: Any) -> Any:
            raise ZeroDivisionError("bug")

    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=lambda scheme, options, n: Broken(options, n),
        max_threads=4,
    )
    try:
        with ShardClient(address, worker=0, timeout=TIMEOUT, retry_seconds=0.0) as client:
            client.register(
                shard_index=0, scheme="broken", options_json="{}", num_workers=1, tensors=MODEL
            )
            err = refused(
                lambda: client.push(base_version=0, tensors={"b#0": np.ones(3, np.float32)}),
                grpc.StatusCode.INTERNAL,
                "ZeroDivisionError",
            )
            assert not err.retryable
            assert client.info().version == 0  # and the server goes on answering
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()
