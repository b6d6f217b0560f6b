"""Tests for the wire format: tensors as raw bytes in chunks, and the checked-in protocol code."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor

from distsgd.transport import (
    PROTOCOL_VERSION,
    ChunkAssembler,
    PushReject,
    Refusal,
    TooLarge,
    WireError,
    iter_chunks,
    specs_of,
)
from distsgd.transport.codec import (
    ALLOWED_DTYPES,
    CHUNK_BYTES,
    FLOAT_DTYPES,
    nbytes_of,
    spec_of,
    to_wire_bytes,
)
from distsgd.transport.errors import ERROR_KEY
from distsgd.transport.proto import distsgd_pb2 as pb

PROTO_DIR = Path(pb.__file__).resolve().parent
SRC_DIR = PROTO_DIR.parents[2]
PROTO_FILE = PROTO_DIR / "distsgd.proto"


def _round_trip(arrays: dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES):
    chunks = list(iter_chunks(list(arrays.values()), chunk_bytes))
    assembler = ChunkAssembler(specs_of(arrays))
    for chunk in chunks:
        assembler.add(chunk)
    return chunks, assembler.finish()


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "dtype", ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, CHUNK_BYTES])
def test_round_trip_dtypes(dtype: str, chunk_bytes: int) -> None:
    arrays = {"a#0": _sample(dtype, (5, 7)), "b#0": _sample(dtype, (13,), seed=1)}
    chunks, out = _round_trip(arrays, chunk_bytes)
    assert list(out) == ["a#0", "b#0"]
    for key, array in arrays.items():
        assert out[key].dtype == array.dtype
        assert out[key].shape == array.shape
        np.testing.assert_array_equal(out[key], array)
    for chunk in chunks:
        assert 0 < len(chunk.data) <= chunk_bytes


def test_round_trip_empty_and_scalar() -> None:
    arrays = {
        "empty#0": np.zeros((0,), np.float32),
        "empty2d#0": np.zeros((3, 0), np.int64),
        "scalar#0": np.array(2.5, dtype=np.float64),
    }
    chunks, out = _round_trip(arrays)
    # An empty tensor still gets one (empty) chunk, so the receiver sees every tensor.
    assert sorted(c.index for c in chunks) == [0, 1, 2]
    assert out["empty#0"].shape == (0,) and out["empty#0"].dtype == np.float32
    assert out["empty2d#0"].shape == (3, 0) and out["empty2d#0"].dtype == np.int64
    assert out["scalar#0"].shape == () and float(out["scalar#0"]) == 2.5


def test_round_trip_big_endian_and_non_contiguous() -> None:
    big = np.arange(12, dtype=">f4").reshape(3, 4)
    strided = np.arange(40, dtype=np.int32).reshape(5, 8)[:, ::2]
    arrays = {"big#0": big, "strided#0": strided.T}
    _, out = _round_trip(arrays, chunk_bytes=5)
    np.testing.assert_array_equal(out["big#0"], big)
    assert out["big#0"].dtype.isnative
    np.testing.assert_array_equal(out["strided#0"], strided.T)
    # On the wire: little-endian raw bytes in C order.
    assert to_wire_bytes(big) == np.arange(12, dtype="<f4").tobytes()


def test_chunk_size_respected_and_offsets_contiguous() -> None:
    array = np.arange(1000, dtype=np.float32)  # 4000 bytes
    chunks = list(iter_chunks([array], chunk_bytes=1024))
    assert [len(c.data) for c in chunks] == [1024, 1024, 1024, 928]
    assert [c.offset for c in chunks] == [0, 1024, 2048, 3072]
    assert b"".join(c.data for c in chunks) == array.tobytes()
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(iter_chunks([array], chunk_bytes=0))


def test_default_chunk_size_is_four_mib_and_a_message_holds_eight() -> None:
    from distsgd.transport.client import GRPC_OPTIONS

    array = np.zeros(3 * CHUNK_BYTES // 4 + 10, dtype=np.float32)
    chunks = list(iter_chunks([array]))
    assert (4 << 20) - CHUNK_BYTES == 64 << 10  # a message fits gRPC's default 4 MiB limit
    assert dict(GRPC_OPTIONS)["grpc.max_receive_message_length"] == 8 * CHUNK_BYTES
    assert len(chunks) == 4
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)


def test_interleaved_tensors_are_accepted() -> None:
    arrays = {"x#0": np.arange(10, dtype=np.int16), "y#0": np.arange(6, dtype=np.float64)}
    chunks = list(iter_chunks(list(arrays.values()), chunk_bytes=4))
    xs = [c for c in chunks if c.index == 0]
    ys = [c for c in chunks if c.index == 1]
    assembler = ChunkAssembler(specs_of(arrays))
    for i in range(max(len(xs), len(ys))):
        for seq in (ys, xs):
            if i < len(seq):
                assembler.add(seq[i])
    out = assembler.finish()
    np.testing.assert_array_equal(out["x#0"], arrays["x#0"])
    np.testing.assert_array_equal(out["y#0"], arrays["y#0"])


# --------------------------------------------------------------------------- malformed streams


def _specs() -> list[pb.TensorSpec]:
    return [spec_of("w#0", np.zeros(4, np.float32)), spec_of("b#0", np.zeros(2, np.float64))]


def test_out_of_order_chunk_raises_naming_key() -> None:
    assembler = ChunkAssembler(_specs())
    with pytest.raises(WireError, match=r"w#0: chunk at byte 8, expected byte 0"):
        assembler.add(pb.TensorChunk(index=0, offset=8, data=b"\0" * 8))


def test_overlapping_chunk_raises_naming_key() -> None:
    assembler = ChunkAssembler(_specs())
    assembler.add(pb.TensorChunk(index=0, offset=0, data=b"\0" * 8))
    with pytest.raises(WireError, match=r"w#0: .*byte 4, expected byte 8"):
        assembler.add(pb.TensorChunk(index=0, offset=4, data=b"\0" * 8))


def test_chunk_past_the_end_raises_naming_key() -> None:
    assembler = ChunkAssembler(_specs())
    with pytest.raises(WireError, match=r"b#0: chunk ends at byte 24, past .*16 bytes"):
        assembler.add(pb.TensorChunk(index=1, offset=0, data=b"\0" * 24))


def test_chunk_for_unknown_tensor_index_raises() -> None:
    assembler = ChunkAssembler(_specs())
    with pytest.raises(WireError, match="#2"):
        assembler.add(pb.TensorChunk(index=2, offset=0, data=b"\0"))


def test_truncated_stream_raises_naming_key() -> None:
    assembler = ChunkAssembler(_specs())
    assembler.add(pb.TensorChunk(index=0, offset=0, data=b"\0" * 16))
    assembler.add(pb.TensorChunk(index=1, offset=0, data=b"\0" * 8))
    with pytest.raises(WireError, match=r"b#0: truncated, got 8 of 16 bytes"):
        assembler.finish()


def test_missing_tensor_raises_naming_key() -> None:
    assembler = ChunkAssembler(_specs())
    assembler.add(pb.TensorChunk(index=1, offset=0, data=b"\0" * 16))
    with pytest.raises(WireError, match=r"w#0: truncated, got 0 of 16"):
        assembler.finish()


def test_duplicate_keys_in_header_refused() -> None:
    specs = [spec_of("w#0", np.zeros(2, np.float32)), spec_of("w#0", np.zeros(3, np.float32))]
    with pytest.raises(WireError, match=r"w#0: .*twice"):
        ChunkAssembler(specs)


def test_bad_specs_refused() -> None:
    with pytest.raises(WireError, match=r"c#0: unsupported dtype 'complex64'"):
        ChunkAssembler([pb.TensorSpec(key="c#0", dtype="complex64", shape=[2])])
    with pytest.raises(WireError, match=r"n#0: negative dimension"):
        ChunkAssembler([pb.TensorSpec(key="n#0", dtype="float32", shape=[2, -1])])
    with pytest.raises(TooLarge, match="over the limit"):  # typed: the server picks its code
        ChunkAssembler([pb.TensorSpec(key="h#0", dtype="float64", shape=[100])], max_bytes=799)
    assert issubclass(TooLarge, WireError)
    assert nbytes_of(pb.TensorSpec(key="h#0", dtype="float64", shape=[100])) == 800
    assert issubclass(WireError, ValueError)


# --------------------------------------------------------------------------- protocol files


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    rel = PROTO_FILE.relative_to(SRC_DIR).as_posix()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(SRC_DIR),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            rel,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out_dir = tmp_path / PROTO_FILE.parent.relative_to(SRC_DIR)
    for name in ("distsgd_pb2.py", "distsgd_pb2_grpc.py"):
        fresh = (out_dir / name).read_bytes()
        checked_in = (PROTO_DIR / name).read_bytes()
        assert fresh == checked_in, (
            f"src/distsgd/transport/proto/{name} is out of date with distsgd.proto "
            f"(grpcio-tools {metadata.version('grpcio-tools')} here; pyproject.toml pins the "
            "one that generated it); run tools/gen_proto.sh"
        )


def test_the_generator_is_pinned_to_the_version_that_made_the_stubs() -> None:
    """A looser pin lets a fresh install take a newer grpcio-tools, whose output differs."""
    stub = (PROTO_DIR / "distsgd_pb2_grpc.py").read_text()
    made_by = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", stub)
    assert made_by is not None
    pyproject = (SRC_DIR.parent / "pyproject.toml").read_text()
    assert f'"grpcio-tools=={made_by.group(1)}"' in pyproject
    assert f'"grpcio>={made_by.group(1)}"' in pyproject


def _proto_without_comments() -> str:
    text = PROTO_FILE.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_proto_has_no_repeated_float_fields() -> None:
    text = _proto_without_comments()
    assert "message TensorChunk" in text  # the parse sees the real definitions
    offenders = re.findall(r"\brepeated\s+(?:float|double)\s+\w+", text)
    assert offenders == [], f"tensors must travel as raw bytes, not {offenders}"


def test_no_message_carries_repeated_numbers_except_shape() -> None:
    numeric = {
        FieldDescriptor.TYPE_FLOAT,
        FieldDescriptor.TYPE_DOUBLE,
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    }
    found = []
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        for field in message.fields:
            if field.is_repeated and field.type in numeric:
                found.append(f"{message.name}.{field.name}")
    # Shapes, the shared-memory layout (one offset per piece), the live members (worker
    # indexes, at most max_workers) and the work units' counts (one per epoch) are metadata,
    # not tensor values.
    assert sorted(found) == [
        "AttachResponse.pull_offsets",
        "AttachResponse.push_offsets",
        "InfoResponse.members",
        "MembershipResponse.members",
        "TensorSpec.shape",
        "WorkStatus.never_trained",
        "WorkStatus.trained_once",
        "WorkStatus.trained_twice",
    ]
    assert pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].type == FieldDescriptor.TYPE_BYTES


def test_protocol_version_constant() -> None:
    assert PROTOCOL_VERSION == pb.PROTOCOL_VERSION == 5
    assert re.search(r"PROTOCOL_VERSION\s*=\s*5\s*;", _proto_without_comments())


def test_push_reject_mirrors_the_proto_enum() -> None:
    """PushReject (Python) and PushRejectReason (.proto) name the same reasons by the same
    numbers; the text of PushResponse.reason starts with the reject's label."""
    wire = dict(pb.PushRejectReason.items())
    assert {r.wire_name: int(r) for r in PushReject} == wire
    assert PushReject.NONE.wire_name == "PUSH_REJECT_REASON_UNSPECIFIED" and PushReject.NONE == 0
    assert PushReject.NONFINITE.label == "nonfinite" and PushReject.LOST.label == "lost"
    reply = pb.PushResponse(accepted=False, reject=PushReject.STALE.wire_name)
    assert PushReject(reply.reject) is PushReject.STALE
    assert (
        pb.PushResponse.DESCRIPTOR.fields_by_name["reject"].number == 4
    )  # a new field: compatible


def test_refusal_from_trailing_metadata() -> None:
    assert Refusal.from_metadata(((ERROR_KEY, "not-registered"),)) is Refusal.NOT_REGISTERED
    assert Refusal.from_metadata((("other", "x"), (ERROR_KEY, "busy"))) is Refusal.BUSY
    assert Refusal.from_metadata(((ERROR_KEY, "from-a-newer-server"),)) is None
    assert Refusal.from_metadata(None) is None and Refusal.from_metadata(()) is None


def test_float_dtypes_are_allowed_dtypes() -> None:
    assert FLOAT_DTYPES <= ALLOWED_DTYPES
    assert {np.dtype(d).kind for d in FLOAT_DTYPES} == {"f"}
    assert {d for d in ALLOWED_DTYPES if np.dtype(d).kind == "f"} == FLOAT_DTYPES


def test_proto_documents_every_status_code_the_server_uses() -> None:
    """Every grpc.StatusCode the servicer's modules name (ps/ but the workers' client; OK is no
    answer) appears in the .proto's error list, and the server never answers UNKNOWN on purpose."""
    modules = set((SRC_DIR / "distsgd" / "ps").glob("*.py")) - {SRC_DIR / "distsgd/ps/client.py"}
    service = "".join(path.read_text(encoding="utf-8") for path in sorted(modules))
    used = set(re.findall(r"grpc\.StatusCode\.([A-Z_]+)", service)) - {"OK"}
    proto = PROTO_FILE.read_text(encoding="utf-8")
    documented = set(re.findall(r"^//\s{2,}([A-Z_]{5,})\s{2,}", proto, flags=re.MULTILINE))
    assert used and used <= documented, used - documented
    assert "UNKNOWN" not in used
    for refusal in Refusal:
        assert f"x-distsgd-error: {refusal.value}" in " ".join(proto.split()), refusal
