"""INT4 and INT2 pushes: the payload's layout, the error bound of each chunk, what a peer's
malformed bytes get, and error feedback by default (ps/quantize.py, ps/compression.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from distsgd.ps import quantize
from distsgd.ps.compression import (
    Encoding,
    ErrorFeedback,
    decode,
    encode,
    value_bytes,
    wire_nbytes,
)

LOW = [(Encoding.INT4, 7), (Encoding.INT2, 1)]


def _decode(message, n: int, dtype=np.float32) -> np.ndarray:
    return decode(
        message.tobytes(),
        encoding=message.encoding,
        scale=message.scale,
        nnz=message.nnz,
        shape=(n,),
        dtype=dtype,
    )


def test_the_layout_is_the_documented_one() -> None:
    """3 values, one chunk: a float32 scale 2/7, then codes -7, 1, 7 as q + 8 in nibbles, low
    first: 0x91 (1 | 9 << 4), 0x0f (15, padded)."""
    x = np.array([-2.0, 0.3, 2.0], dtype=np.float32)
    message = encode(x, Encoding.INT4)
    raw = message.tobytes()
    assert message.scale == 1.0 and len(raw) == 4 + 2 == wire_nbytes(Encoding.INT4, "f4", 3, 0)
    assert struct.unpack("<f", raw[:4])[0] == pytest.approx(2 / 7)
    assert raw[4:] == bytes([0x91, 0x0F])
    ternary = encode(np.array([-1.0, 0.2, 0.9, 1.0, -0.6], np.float32), Encoding.INT2).tobytes()
    assert ternary[4:] == bytes([0b11_11_10_01, 0b01])  # q + 2, two bits each, low first


@pytest.mark.parametrize(("encoding", "levels"), LOW, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_value_is_within_half_its_chunks_scale(encoding, levels, dtype) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * np.exp(rng.uniform(-3, 3, 1000))).astype(dtype)
    got = _decode(encode(x, encoding), x.size, dtype)
    assert got.dtype == dtype
    for start in range(0, x.size, quantize.CHUNK):
        chunk = x[start : start + quantize.CHUNK]
        scale = float(np.abs(chunk).max()) / levels
        error = float(np.abs(got[start : start + quantize.CHUNK] - chunk).max())
        assert error <= scale / 2 * (1 + 1e-6)
    assert float(np.abs(got - x).max()) > 0  # lossy, as claimed


def test_a_large_entry_coarsens_only_its_own_chunk() -> None:
    x = np.full(256, 0.01, dtype=np.float32)
    x[3] = 100.0
    got = _decode(encode(x, Encoding.INT4), 256)
    assert np.all(got[128:] == pytest.approx(0.01, rel=1e-6))  # the other chunk is exact
    assert np.all(got[:128][x[:128] == 0.01] == 0.0)  # beside the peak: below half a step


@pytest.mark.parametrize(("encoding", "levels"), LOW, ids=lambda v: getattr(v, "name", v))
def test_sparse_values_travel_in_the_low_bit_form(encoding, levels) -> None:
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    message = encode(x, encoding, topk=0.01)
    assert message.nnz == 50
    assert message.nbytes == 50 * 4 + quantize.packed_nbytes(
        levels and (4 if levels == 7 else 2), 50
    )
    got = _decode(message, x.size)
    assert np.count_nonzero(got) <= 50


def test_bytes_per_value_and_the_reduction_against_float32() -> None:
    assert value_bytes(Encoding.INT4, "float32") == pytest.approx(0.5 + 4 / 128)
    n = 675_000  # the demo-sized model of docs/compression.md
    assert 4 * n / wire_nbytes(Encoding.INT4, "float32", n, 0) == pytest.approx(7.53, abs=0.01)
    assert 4 * n / wire_nbytes(Encoding.INT2, "float32", n, 0) == pytest.approx(14.2, abs=0.05)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (struct.pack("<f", float("nan")) + b"\x88", "scale"),
        (struct.pack("<f", -1.0) + b"\x88", "scale"),
        (struct.pack("<f", 1.0) + b"\x88\x88", "payload has 6 bytes, expected 5"),
        (b"\x88", "payload has 1 bytes"),
    ],
    ids=["nan-scale", "negative-scale", "too-long", "no-scale"],
)
def test_decode_refuses_a_malformed_payload(payload: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode(payload, encoding=Encoding.INT4, scale=1.0, nnz=0, shape=(2,), dtype="float32")
    with pytest.raises(ValueError, match=r"must be 1\.0"):
        decode(payload, encoding=Encoding.INT2, scale=0.5, nnz=0, shape=(2,), dtype="float32")


@pytest.mark.parametrize("encoding", [Encoding.INT4, Encoding.INT2], ids=lambda e: e.name)
def test_error_feedback_is_on_by_default_and_loses_nothing(encoding) -> None:
    feedback = ErrorFeedback(encoding)
    assert feedback.feedback
    rng = np.random.default_rng(2)
    sent = np.zeros(700)
    updates = [rng.standard_normal(700).astype(np.float32) for _ in range(30)]
    for x in updates:
        sent += _decode(feedback.encode("k", x), 700)
    residual = feedback.residual("k")
    assert residual is not None
    np.testing.assert_allclose(sent + residual, np.sum(updates, axis=0), atol=1e-4)


def test_a_non_finite_piece_travels_raw() -> None:
    x = np.array([1.0, np.inf, 2.0], dtype=np.float32)
    for encoding in (Encoding.INT4, Encoding.INT2):
        message = encode(x, encoding)
        assert message.encoding is Encoding.RAW
        assert np.isinf(_decode(message, 3)[1])
