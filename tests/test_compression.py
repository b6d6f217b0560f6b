"""The numpy codec of compressed pushes (``distsgd.ps.compression``): exact rounding, top-k,
byte counts, refusal of every malformed payload, and error feedback that loses nothing."""

from __future__ import annotations

import ast
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from distsgd.ps import compression as comp
from distsgd.ps.compression import (
    ENCODINGS,
    WIRE_DTYPES,
    EncodedPiece,
    Encoding,
    ErrorFeedback,
    decode,
    encode,
    topk_count,
    wire_nbytes,
)

PIECE = 669_706
"""Elements of the piece the byte figures are quoted for (a 2.7 MB float32 piece)."""

RNG_SEED = 20260509


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def _f32(bits: int) -> np.float32:
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


def _round_trip(piece: np.ndarray, encoding: Encoding, topk: float = 0.0) -> np.ndarray:
    """Encode, put on the wire as one bytes object, decode into the piece's dtype."""
    message = encode(piece, encoding, topk)
    return _decode(message, piece.shape, piece.dtype)


def _decode(message: EncodedPiece, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return decode(
        message.tobytes(),
        encoding=message.encoding,
        scale=message.scale,
        nnz=message.nnz,
        shape=shape,
        dtype=dtype,
    )


def _spread(n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 values of both signs over many magnitudes (subnormal in fp16 up to about 2e4)."""
    return (rng.standard_normal(n) * np.exp(rng.uniform(-25.0, 9.0, n))).astype(np.float32)


# --------------------------------------------------------------------------- the contract


def test_encoding_numbers_and_names_are_the_wire_contract() -> None:
    assert {e.name: int(e) for e in Encoding} == {
        **{"RAW": 0, "FP16": 1, "BF16": 2, "INT8": 3, "INT4": 4, "INT2": 5}
    }
    assert ENCODINGS == {
        "float32": Encoding.RAW,
        "fp16": Encoding.FP16,
        "bf16": Encoding.BF16,
        "int8": Encoding.INT8,
        "int4": Encoding.INT4,
        "int2": Encoding.INT2,
    }
    assert set(ENCODINGS) == set(WIRE_DTYPES)  # every --wire-dtype the config accepts
    assert comp.encoding_for("bf16") is Encoding.BF16
    with pytest.raises(ValueError, match="unknown wire dtype 'int3'"):
        comp.encoding_for("int3")


def test_the_module_imports_numpy_but_never_torch() -> None:
    tree = ast.parse(Path(comp.__file__).read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "numpy" in imported
    assert "torch" not in imported


# --------------------------------------------------------------------------- bf16


def _bf16_reference(value: np.float32) -> int:
    """bf16 bits of one float32, from its bits with Python integers: round to nearest, ties
    to even; a NaN stays a (quiet) NaN with its sign."""
    u = int(np.array(value, dtype=np.float32).view(np.uint32))
    if u & 0x7FFFFFFF > 0x7F800000:
        return (u >> 16) | 0x0040
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


BF16_KNOWN = [
    (0x3F800000, 0x3F80),  # 1.0
    (0x3F808000, 0x3F80),  # halfway between 0x3F80 and 0x3F81: to even (down)
    (0x3F818000, 0x3F82),  # halfway between 0x3F81 and 0x3F82: to even (up)
    (0x3F808001, 0x3F81),  # just above halfway: up
    (0x3F807FFF, 0x3F80),  # just below halfway: down
    (0xBF818000, 0xBF82),  # negative tie: to even, away from zero here
    (0x3FFFFFFF, 0x4000),  # the carry runs into the exponent: 2.0
    (0x7F7F7FFF, 0x7F7F),  # the largest float32 that stays finite in bf16
    (0x00000000, 0x0000),  # +0
    (0x80000000, 0x8000),  # -0 keeps its sign
    (0x00008000, 0x0000),  # subnormal tie: to even (zero)
    (0x00018000, 0x0002),  # subnormal tie: to even (up)
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7FC00000, 0x7FC0),  # quiet NaN
    (0x7F800001, 0x7FC0),  # NaN with only low mantissa bits: must not become inf
    (0x7FFFFFFF, 0x7FFF),  # NaN whose rounding would carry into the sign bit
    (0xFFFFFFFF, 0xFFFF),  # negative NaN (the uint32 sum wraps)
    (0xFF800001, 0xFFC0),  # negative signalling NaN: quiet, sign kept
]


@pytest.mark.parametrize(("bits", "expected"), BF16_KNOWN, ids=[f"{b:08x}" for b, _ in BF16_KNOWN])
def test_bf16_rounds_known_values_bit_exactly(bits: int, expected: int) -> None:
    value = _f32(bits)
    assert _bf16_reference(value) == expected  # the reference agrees with the table
    message = encode(np.array([value, 1.0], dtype=np.float32), Encoding.BF16)
    assert message.parts[0].dtype == np.dtype("<u2")
    assert int(message.parts[0][0]) == expected


def test_bf16_matches_the_reference_on_random_bit_patterns_and_decodes_by_shifting() -> None:
    bits = _rng().integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[~(np.isfinite(values) & (np.abs(values) >= comp.BF16_OVERFLOW))]
    message = encode(values, Encoding.BF16)
    assert [int(b) for b in message.parts[0]] == [_bf16_reference(v) for v in values]
    decoded = _decode(message, values.shape, np.dtype(np.float32))
    expected = message.parts[0].astype(np.uint32) << np.uint32(16)
    np.testing.assert_array_equal(decoded.view(np.uint32), expected)


def test_bf16_error_is_within_half_an_ulp_and_float64_pieces_decode_to_float64() -> None:
    x = _spread(10_000, _rng()).astype(np.float64)
    decoded = _round_trip(x, Encoding.BF16)
    assert decoded.dtype == np.float64
    normal = np.abs(x) >= 1e-37
    relative = np.abs(decoded - x)[normal] / np.abs(x)[normal]
    assert relative.max() <= 2.0**-8  # half of bf16's 2**-7 ulp, plus float32's first rounding


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bf16_refuses_a_finite_value_that_would_round_to_inf(dtype: type) -> None:
    piece = np.array([1.0, -float(comp.BF16_OVERFLOW)], dtype=dtype)
    with pytest.raises(ValueError, match=r"bf16 cannot carry .* 3\.39618e\+38 .* float32"):
        encode(piece, Encoding.BF16)
    below = np.array([float(_f32(0x7F7F7FFF))], dtype=dtype)
    assert np.isfinite(_round_trip(below, Encoding.BF16)).all()


# --------------------------------------------------------------------------- fp16


def test_fp16_matches_numpys_cast_bit_for_bit() -> None:
    rng = _rng()
    x = np.concatenate(
        [
            _spread(200_000, rng),
            np.float32(2.0**-24) * rng.integers(-2048, 2048, 5000).astype(np.float32),
            rng.uniform(-65519.99, 65519.99, 5000).astype(np.float32),
            np.array([0.0, -0.0, 65504.0, -65504.0, 65519.996, 2.0**-14, 2.0**-24], np.float32),
            np.array([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25], np.float32),  # ties
        ]
    )
    message = encode(x, Encoding.FP16)
    np.testing.assert_array_equal(
        message.parts[0].view(np.uint16), x.astype(np.float16).view(np.uint16)
    )
    decoded = _decode(message, x.shape, np.dtype(np.float32))
    np.testing.assert_array_equal(decoded, x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fp16_decodes_every_bit_pattern_as_numpy_does(dtype: type) -> None:
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = patterns.view(np.float16).astype(dtype)
    for chosen in (patterns, patterns[(patterns & 0x7FFF) < 0x7C00]):  # with and without inf/NaN
        decoded = decode(
            chosen.tobytes(),
            encoding=Encoding.FP16,
            scale=1.0,
            nnz=0,
            shape=(chosen.size,),
            dtype=np.dtype(dtype),
        )
        want = chosen.view(np.float16).astype(dtype)
        assert decoded.dtype == dtype
        np.testing.assert_array_equal(np.isnan(decoded), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(decoded[finite]), np.signbit(want[finite]))
        np.testing.assert_array_equal(decoded[finite], want[finite])
    assert expected.size == 1 << 16


def test_fp16_keeps_inf_nan_and_negative_zero_of_float32_and_float64_pieces() -> None:
    for dtype in (np.float32, np.float64):
        x = np.array([np.inf, -np.inf, np.nan, -0.0, 1.5, 1e-30], dtype=dtype)
        decoded = _round_trip(x, Encoding.FP16)
        np.testing.assert_array_equal(decoded[:2], [np.inf, -np.inf])
        assert np.isnan(decoded[2])
        assert decoded[3] == 0.0 and np.signbit(decoded[3])
        assert decoded[4] == 1.5 and decoded[5] == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("peak", [65520.0, -70000.0, 1e30])
def test_fp16_refuses_overflow_naming_the_piece_max_and_bf16(dtype: type, peak: float) -> None:
    x = np.zeros(1000, dtype=dtype)
    x[7] = peak
    x[8] = np.inf  # an inf already there is not what is refused
    expected = re.escape(f"largest magnitude {abs(peak):.6g} ") + ".* use --wire-dtype bf16"
    with pytest.raises(ValueError, match=expected):
        encode(x, Encoding.FP16)


def test_fp16_rounds_just_below_the_overflow_to_65504() -> None:
    decoded = _round_trip(np.array([65519.996, -65510.0], dtype=np.float32), Encoding.FP16)
    np.testing.assert_array_equal(decoded, [65504.0, -65504.0])


def test_float16_pieces_round_trip_in_every_encoding() -> None:
    x = _rng().standard_normal(500).astype(np.float16)
    for encoding in Encoding:
        decoded = _round_trip(x, encoding)
        assert decoded.dtype == np.float16
        tolerance = {
            Encoding.BF16: 2.0**-8,
            Encoding.INT8: 1 / 254 + 2.0**-10,
            Encoding.INT4: 1 / 14 + 2.0**-10,
            Encoding.INT2: 1 / 2 + 2.0**-10,
        }.get(encoding, 0.0)
        peak = float(np.abs(x.astype(np.float32)).max())
        error = np.abs(decoded.astype(np.float32) - x.astype(np.float32))
        codes = encoding in (Encoding.INT8, Encoding.INT4, Encoding.INT2)
        assert error.max() <= tolerance * max(peak, 1.0) + 1e-3 * codes


# --------------------------------------------------------------------------- int8


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int8_error_is_at_most_half_a_scale_per_element(dtype: type) -> None:
    x = (_rng().standard_normal((300, 257)) * 0.01).astype(dtype)
    message = encode(x, Encoding.INT8)
    peak = float(np.abs(x).max())
    assert message.scale == pytest.approx(peak / 127, rel=1e-15)
    assert message.parts[0].dtype == np.int8
    assert int(np.abs(message.parts[0].astype(np.int32)).max()) == 127
    decoded = _decode(message, x.shape, np.dtype(dtype))
    assert decoded.shape == x.shape and decoded.dtype == dtype
    slack = 4 * float(np.finfo(dtype).eps) * peak  # the float products' own rounding
    assert float(np.abs(decoded - x).max()) <= message.scale / 2 + slack
    assert float(np.abs(decoded - x).max()) > message.scale / 4  # it is lossy, as claimed


def test_int8_of_an_all_zero_piece_has_scale_zero_and_decodes_to_zeros() -> None:
    message = encode(np.zeros(10, np.float32), Encoding.INT8)
    assert message.scale == 0.0
    np.testing.assert_array_equal(_decode(message, (10,), np.dtype(np.float32)), np.zeros(10))


def test_int8_of_a_subnormal_piece_stays_finite_and_close() -> None:
    x = np.array([1e-40, -3e-41, 0.0, 5e-42], dtype=np.float32)  # 127 / max overflows float32
    decoded = _round_trip(x, Encoding.INT8)
    assert np.isfinite(decoded).all()
    assert float(np.abs(decoded - x).max()) <= 1e-40 / 254 + 2e-45


def test_int8_sends_a_piece_with_nan_or_inf_raw_so_the_server_sees_it() -> None:
    x = np.array([1.0, np.nan, -2.0], dtype=np.float32)
    message = encode(x, Encoding.INT8)
    assert message.encoding is Encoding.RAW
    decoded = _decode(message, x.shape, x.dtype)
    assert np.isnan(decoded[1]) and decoded[0] == 1.0 and decoded[2] == -2.0


# --------------------------------------------------------------------------- top-k


def _expected_top(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lower index, ascending (a stable sort)."""
    order = np.argsort(-np.abs(x.reshape(-1)), kind="stable")
    return np.sort(order[:k])


@pytest.mark.parametrize("n", [1000, 200_000], ids=["small", "sampled"])
@pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.name)
def test_topk_keeps_exactly_the_largest_and_decodes_zeros_elsewhere(
    n: int, encoding: Encoding
) -> None:
    x = (_rng().standard_normal(n) * np.exp(_rng().uniform(-3, 3, n))).astype(np.float32)
    x = x.reshape(-1, 8) if n % 8 == 0 else x
    k = topk_count(x.size, 0.01)
    message = encode(x, encoding, 0.01)
    assert message.nnz == k == math.ceil(0.01 * n)
    index = message.parts[0]
    assert index.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(index, _expected_top(x, k))
    decoded = _decode(message, x.shape, np.dtype(np.float32)).reshape(-1)
    kept = np.zeros(x.size, bool)
    kept[index] = True
    assert not decoded[~kept].any()
    dense = _round_trip(x.reshape(-1)[index].copy(), encoding)  # the same values, dense
    np.testing.assert_array_equal(decoded[kept], dense)


def test_topk_with_many_ties_takes_the_lowest_indices_and_nan_counts_as_largest() -> None:
    x = np.zeros(100_000, np.float32)
    x[[5, 50_000, 99_999]] = [3.0, -2.0, 1.0]
    message = encode(x, Encoding.RAW, 0.0001)  # k = 10: three nonzeros and seven tied zeros
    np.testing.assert_array_equal(message.parts[0], [0, 1, 2, 3, 4, 5, 6, 7, 50_000, 99_999])
    x[77] = np.nan
    index = encode(x, Encoding.RAW, 0.00002).parts[0]  # k = 2
    np.testing.assert_array_equal(index, [5, 77])


@pytest.mark.parametrize("sample", ["largest", "smallest"])
def test_topk_is_exact_whatever_the_sample_of_its_threshold(
    sample: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample only narrows the search: one that puts the threshold too high (too few
    entries pass) or too low (almost all pass) still gives exactly the top k."""
    x = _spread(100_000, _rng())
    order = np.argsort(np.abs(x))
    chosen = order[-comp._SAMPLE :] if sample == "largest" else order[: comp._SAMPLE]
    monkeypatch.setattr(comp, "_sample_indices", lambda n: chosen)
    index = encode(x, Encoding.RAW, 0.01).parts[0]
    np.testing.assert_array_equal(index, _expected_top(x, 1000))


def test_topk_count_is_ceil_at_least_one_and_free_of_float_noise() -> None:
    assert topk_count(100, 0.07) == 7  # 0.07 * 100 is 7.000000000000001
    assert topk_count(150, 0.01) == 2
    assert topk_count(10, 0.001) == 1
    assert topk_count(0, 0.5) == 0
    assert topk_count(PIECE, 0.01) == 6698


def test_topk_sends_dense_when_sparse_would_not_be_smaller() -> None:
    x = _rng().standard_normal(1000).astype(np.float32)
    assert encode(x, Encoding.RAW, 0.49).nnz == 490  # 490 * 8 < 1000 * 4
    assert encode(x, Encoding.RAW, 0.5).nnz == 0  # 500 * 8 == 1000 * 4: dense carries more
    assert encode(x, Encoding.INT8, 0.2).nnz == 0  # 200 * 5 == 1000
    np.testing.assert_array_equal(_round_trip(x, Encoding.RAW, 0.5), x)


def test_topk_refuses_a_bad_fraction_and_encode_a_non_float_piece() -> None:
    x = np.ones(4, np.float32)
    for topk in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="topk must be a fraction in"):
            encode(x, Encoding.RAW, topk)
    for dtype in (np.int32, np.bool_, np.complex64):
        with pytest.raises(ValueError, match="pieces must be float16, float32 or float64"):
            encode(np.ones(4, dtype), Encoding.BF16)


# --------------------------------------------------------------------------- bytes


CASES = [
    (encoding, dtype, topk)
    for encoding in Encoding
    for dtype in (np.float16, np.float32, np.float64)
    for topk in (0.0, 0.05)
]


@pytest.mark.parametrize(
    ("encoding", "dtype", "topk"),
    CASES,
    ids=[f"{e.name}-{np.dtype(d).name}-{t}" for e, d, t in CASES],
)
def test_wire_nbytes_is_what_the_parts_hold_and_decode_takes_any_buffer(
    encoding: Encoding, dtype: type, topk: float
) -> None:
    x = _rng().standard_normal((37, 29)).astype(dtype)
    message = encode(x, encoding, topk)
    assert message.nbytes == sum(p.nbytes for p in message.parts) == len(message.tobytes())
    assert message.nbytes == wire_nbytes(message.encoding, x.dtype, x.size, message.nnz)
    assert message.nnz == (topk_count(x.size, topk) if topk else 0)
    assert all(p.ndim == 1 for p in message.parts)
    assert (message.scale == 1.0) is (message.encoding is not Encoding.INT8)
    raw = message.tobytes()
    buffers = [raw, memoryview(raw), np.frombuffer(raw, np.uint8), bytearray(raw)]
    decoded = [
        decode(
            b,
            encoding=int(message.encoding),
            scale=message.scale,
            nnz=message.nnz,
            shape=x.shape,
            dtype=x.dtype,
        )
        for b in buffers
    ]
    for array in decoded:
        assert array.shape == x.shape and array.dtype == x.dtype and array.flags.writeable
        np.testing.assert_array_equal(array, decoded[0])


def test_byte_reduction_figures_for_a_2_7_mb_float32_piece() -> None:
    x = _rng().standard_normal(PIECE).astype(np.float32)
    full = encode(x, Encoding.RAW).nbytes
    assert full == x.nbytes == 4 * PIECE
    assert encode(x, Encoding.BF16).nbytes * 2 == full
    assert encode(x, Encoding.FP16).nbytes * 2 == full
    assert encode(x, Encoding.INT8).nbytes * 4 == full  # the scale travels in the header
    k = topk_count(PIECE, 0.01)
    ratios = {e: full / encode(x, e, 0.01).nbytes for e in Encoding}
    assert encode(x, Encoding.RAW, 0.01).nbytes == k * (4 + 4)
    assert min(ratios.values()) >= 20
    assert ratios[Encoding.RAW] == pytest.approx(50, rel=1e-3)
    assert ratios[Encoding.BF16] == pytest.approx(200 / 3, rel=1e-3)
    assert ratios[Encoding.INT8] == pytest.approx(80, rel=1e-3)


def test_an_empty_piece_is_zero_bytes_and_a_big_endian_piece_encodes_like_a_native_one() -> None:
    for encoding in Encoding:
        message = encode(np.zeros(0, np.float32), encoding, 0.01)
        assert message.nbytes == 0 and message.nnz == 0
        assert _decode(message, (0,), np.dtype(np.float32)).shape == (0,)
    x = _rng().standard_normal(64).astype(np.float32)
    for encoding in Encoding:
        native, swapped = encode(x, encoding), encode(x.astype(">f4"), encoding)
        assert native.tobytes() == swapped.tobytes()


# --------------------------------------------------------------------------- refusals


def _good(nnz: int = 0) -> dict[str, object]:
    """A valid payload of 10 float32 elements: dense INT8, or sparse BF16 with nnz entries."""
    x = np.arange(10, dtype=np.float32) - 4.5
    message = encode(x, Encoding.BF16, nnz / 10) if nnz else encode(x, Encoding.INT8)
    assert message.nnz == nnz
    return {
        "raw": message.tobytes(),
        "encoding": message.encoding,
        "scale": message.scale,
        "nnz": message.nnz,
        "shape": (10,),
        "dtype": np.dtype(np.float32),
    }


def _sparse_raw(indices: list[int], count: int = 10) -> dict[str, object]:
    values = np.ones(len(indices), np.float32)
    return {
        "raw": np.asarray(indices, "<u4").tobytes() + values.tobytes(),
        "encoding": Encoding.RAW,
        "scale": 1.0,
        "nnz": len(indices),
        "shape": (count,),
        "dtype": np.dtype(np.float32),
    }


MALFORMED = {
    "one-byte-short": ({**_good(), "raw": _good()["raw"][:-1]}, "payload has 9 bytes, expected 10"),
    "one-byte-long": ({**_good(), "raw": _good()["raw"] + b"\0"}, "payload has 11 bytes"),
    "sparse-short": ({**_good(3), "raw": _good(3)["raw"][:-2]}, "16 bytes, expected 18 for 10"),
    "scale-nan": ({**_good(), "scale": math.nan}, "scale nan must be finite"),
    "scale-inf": ({**_good(), "scale": math.inf}, "scale inf must be finite"),
    "scale-negative": ({**_good(), "scale": -0.5}, "scale -0.5 must be finite and not negative"),
    "scale-not-number": ({**_good(), "scale": "1"}, "scale must be a number"),
    "scale-overflows-float16": (
        {**_good(), "dtype": np.dtype(np.float16), "scale": 600.0},
        "scale 600.0 is too large for float16",
    ),
    "scale-for-bf16": (
        {**_good(), "encoding": Encoding.BF16, "raw": b"\0" * 20, "scale": 0.0},
        "scale 0.0 must be 1.0 for BF16",
    ),
    "nnz-above-count": (
        {**_sparse_raw(list(range(10))), "nnz": 11},
        "nnz 11 exceeds the piece's 10",
    ),
    "nnz-negative": ({**_good(), "nnz": -1}, "nnz -1 is negative"),
    "nnz-not-int": ({**_good(), "nnz": 1.0}, "nnz must be an integer"),
    "index-out-of-range": (_sparse_raw([2, 10]), "sparse index 10 is out of range for 10"),
    "index-far-out": (_sparse_raw([0, 0xFFFFFFFF]), "sparse index 4294967295 is out of range"),
    "index-duplicate": (_sparse_raw([3, 3]), "not strictly ascending"),
    "index-descending": (_sparse_raw([4, 2, 9]), "not strictly ascending"),
    "raw-sparse-short": ({**_sparse_raw([1, 2]), "nnz": 1}, "payload has 16 bytes, expected 8"),
    "encoding-unknown": ({**_good(), "encoding": 7}, "unknown encoding 7"),
    "encoding-bool": ({**_good(), "encoding": True}, "unknown encoding True"),
    "dtype-int": ({**_good(), "dtype": np.dtype(np.int8)}, "pieces must be float16, float32"),
    "shape-negative": ({**_good(), "shape": (-10,)}, "shape must be a tuple of non-negative"),
    "shape-mismatch": ({**_good(), "shape": (3, 4)}, "expected 12 for 12 elements"),
}


@pytest.mark.parametrize(("fields", "message"), MALFORMED.values(), ids=list(MALFORMED))
def test_decode_refuses_every_malformed_payload_in_one_line(
    fields: dict[str, object], message: str
) -> None:
    args = dict(fields)
    raw = args.pop("raw")
    with pytest.raises(ValueError, match=message) as caught:
        decode(raw, **args)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_decode_accepts_what_the_refusal_cases_are_made_from() -> None:
    """The malformed cases are each one change away from these, which decode."""
    for fields in (_good(), _good(3), _sparse_raw([0, 4, 9])):
        args = dict(fields)
        raw = args.pop("raw")
        assert decode(raw, **args).shape == (10,)  # type: ignore[arg-type]
    decoded = decode(**{**_sparse_raw([0, 4, 9]), "raw": _sparse_raw([0, 4, 9])["raw"]})  # type: ignore[arg-type]
    np.testing.assert_array_equal(np.flatnonzero(decoded), [0, 4, 9])


# --------------------------------------------------------------------------- error feedback


FEEDBACK = [
    (Encoding.RAW, 0.0),  # lossless: the residual stays zero
    (Encoding.INT8, 0.0),
    (Encoding.BF16, 0.0),
    (Encoding.FP16, 0.0),
    (Encoding.RAW, 0.02),
    (Encoding.BF16, 0.02),
    (Encoding.INT8, 0.02),
]


@pytest.mark.parametrize(("encoding", "topk"), FEEDBACK, ids=[f"{e.name}-{t}" for e, t in FEEDBACK])
def test_error_feedback_loses_nothing(encoding: Encoding, topk: float) -> None:
    rng = _rng()
    feedback = ErrorFeedback(encoding, topk, feedback=True)
    shapes = {"w": (40, 50), "b": (50,)}
    sent = {key: np.zeros(shape, np.float64) for key, shape in shapes.items()}
    pushed = {key: np.zeros(shape, np.float64) for key, shape in shapes.items()}
    for _ in range(30):
        for key, shape in shapes.items():
            x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
            message = feedback.encode(key, x)
            sent[key] += _decode(message, shape, np.dtype(np.float32))
            pushed[key] += x
    squares = 0.0
    for key in shapes:
        residual = feedback.residual(key)
        assert residual is not None and residual.dtype == np.float32
        assert not residual.flags.writeable
        np.testing.assert_allclose(sent[key], pushed[key] - residual, rtol=0, atol=2e-6)
        squares += float(np.sum(residual.astype(np.float64) ** 2))
    assert feedback.residual_norm == pytest.approx(math.sqrt(squares), rel=1e-5)
    assert (feedback.residual_norm > 0) is (encoding is not Encoding.RAW or topk > 0)


def test_without_feedback_something_is_lost_which_is_why_topk_needs_it() -> None:
    x = np.linspace(-1.0, 1.0, 1000, dtype=np.float32)
    steps = 1000
    plain = _decode(encode(x, Encoding.RAW, 0.01), x.shape, x.dtype) * steps
    assert float(np.abs(plain - steps * x).max()) > 0.9 * steps  # the small entries never arrive
    feedback = ErrorFeedback(Encoding.RAW, 0.01)
    sent = np.zeros_like(x)
    for step in range(1, 2 * steps + 1):
        sent += _decode(feedback.encode("x", x), x.shape, x.dtype)
        if step % steps == 0:  # what is owed stays bounded: about 50 per entry, never 0.9 T
            assert float(np.abs(sent - step * x).max()) < 0.06 * steps
    assert np.count_nonzero(sent) > 0.9 * x.size  # nine in ten entries have had a turn


def test_feedback_defaults_and_the_refusal_of_topk_without_it() -> None:
    assert ErrorFeedback(Encoding.INT8).feedback is True
    assert ErrorFeedback(Encoding.BF16, 0.01).feedback is True
    assert ErrorFeedback(Encoding.RAW, 0.01).feedback is True
    assert ErrorFeedback(Encoding.BF16).feedback is False
    assert ErrorFeedback(Encoding.FP16).feedback is False
    assert ErrorFeedback(Encoding.RAW).feedback is False
    with pytest.raises(ValueError, match="top-k without error feedback"):
        ErrorFeedback(Encoding.BF16, 0.01, feedback=False)
    with pytest.raises(ValueError, match="topk must be a fraction"):
        ErrorFeedback(Encoding.BF16, 1.5)
    off = ErrorFeedback(Encoding.BF16)
    x = np.full(8, 1 + 2**-9, np.float32)  # not representable in bf16
    np.testing.assert_array_equal(off.encode("x", x).tobytes(), encode(x, Encoding.BF16).tobytes())
    assert off.residual("x") is None and off.residual_norm == 0.0


def test_feedback_reset_shape_change_and_a_non_finite_update() -> None:
    feedback = ErrorFeedback(Encoding.INT8)
    x = np.array([1.0, 0.001, -0.3], np.float32)
    feedback.encode("p", x)
    kept = np.array(feedback.residual("p"))
    assert feedback.residual_norm > 0
    bad = np.array([np.nan, 0.0, 0.0], np.float32)
    message = feedback.encode("p", bad)
    assert message.encoding is Encoding.RAW and np.isnan(_decode(message, (3,), x.dtype)[0])
    np.testing.assert_array_equal(feedback.residual("p"), kept)  # kept as it was
    with pytest.raises(
        ValueError, match=r"p: piece is float32\[4\] but its residual is float32\[3\]"
    ):
        feedback.encode("p", np.zeros(4, np.float32))
    feedback.reset()
    assert feedback.residual("p") is None and feedback.residual_norm == 0.0
    feedback.encode("p", np.zeros(4, np.float32))  # a new shape is fine after reset


def test_feedback_names_the_key_when_the_sum_overflows_fp16() -> None:
    feedback = ErrorFeedback(Encoding.FP16, feedback=True)
    with pytest.raises(ValueError, match=r"^emb\.weight#0: fp16 cannot carry .* residual\)$"):
        feedback.encode("emb.weight#0", np.array([7e4], np.float32))
    assert feedback.residual("emb.weight#0") is None  # nothing kept from a refused encode


def test_an_earlier_message_is_not_changed_by_later_encodes() -> None:
    """Parts never alias the residual, which the next encode changes in place."""
    for encoding, topk in FEEDBACK:
        feedback = ErrorFeedback(encoding, topk, feedback=True)
        x = _rng().standard_normal(500).astype(np.float32)
        first = feedback.encode("k", x)
        before = first.tobytes()
        feedback.encode("k", -x)
        assert first.tobytes() == before, encoding


def test_float16_and_float64_pieces_keep_residuals_that_account_for_the_servers_decode() -> None:
    for dtype, work in ((np.float16, np.float32), (np.float64, np.float64)):
        feedback = ErrorFeedback(Encoding.INT8, 0.1)
        x = _rng().standard_normal(300).astype(dtype)
        total = np.zeros(300, np.float64)
        for _ in range(5):
            total += _decode(feedback.encode("k", x), x.shape, np.dtype(dtype))
        residual = feedback.residual("k")
        assert residual is not None and residual.dtype == work
        np.testing.assert_allclose(total, 5 * x.astype(np.float64) - residual, atol=1e-5)


def test_struct_view_of_a_dense_bf16_payload_is_little_endian() -> None:
    """The bytes are little-endian uint16, whatever the machine: 1.0 is 80 3f."""
    raw = encode(np.array([1.0, -2.0], np.float32), Encoding.BF16).tobytes()
    assert struct.unpack("<2H", raw) == (0x3F80, 0xC000)
    assert raw[:2] == b"\x80\x3f"
