"""Integer codes of pushed values with scales: INT8 (one scale per piece), INT4 and INT2 (one
scale per chunk of :data:`CHUNK` values). The codecs of :mod:`distsgd.ps.compression`.

INT4 and INT2 (the wire contract, proto ``TensorEncoding``), for ``m`` values ``x``:

    chunks   c = 0 .. ceil(m / CHUNK) - 1, the last one possibly shorter
    scale    s_c = max |x_c| / L          (L = 7 for INT4, 1 for INT2; 0 for an all-zero chunk)
    code     q = round(x / s_c)           in [-L, L], rounding to nearest, ties to even
    bytes    ceil(m / CHUNK) float32 scales, little-endian, then the codes ``q + 2**(b - 1)``
             as b-bit unsigned fields (b = 4 or 2), packed from the low bits of each byte up,
             the last byte padded with zero bits
    value    q * s_c

so a value is off by at most ``s_c / 2``: INT4 keeps 1/14 of its chunk's peak, INT2 (ternary,
as TernGrad, Wen et al. 2017, with a scale per chunk instead of per tensor and deterministic
rounding) 1/2. A chunk's scale follows its own peak, so one large entry coarsens only the 127
values beside it, not the whole piece (the per-group scales of Dettmers et al. 2022's blockwise
quantisation, and of the 4-bit pseudo-gradients in the low-communication training literature).
A field's unused code (0 for both) decodes to ``-8 s`` (INT4) or ``-2 s`` (INT2): finite,
and never sent by :func:`pack`. Bytes per value: ``b / 8 + 4 / CHUNK``: 0.53 for INT4 (7.5x fewer
than float32), 0.28 for INT2 (14.2x).
"""

from __future__ import annotations

import math

import numpy as np

CHUNK = 128
"""Values per scale of INT4 and INT2."""

LEVELS = {4: 7, 2: 1}
"""Bits per code -> L, the largest code magnitude."""

_SCALE = np.dtype("<f4")


def packed_nbytes(bits: int, count: int) -> int:
    """Bytes of ``count`` values at ``bits`` per code: the scales, then the packed codes."""
    return _SCALE.itemsize * math.ceil(count / CHUNK) + math.ceil(count * bits / 8)


def pack(x: np.ndarray, bits: int) -> np.ndarray:
    """The uint8 payload of a 1-D array of finite floats (see the module docstring). The codes
    are worked out in float32 for float32 values (a quotient within 2**-24 of a half may round
    the other way, as the error bound allows), else in float64."""
    levels = LEVELS[bits]
    m = x.size
    if m == 0:
        return np.empty(0, dtype=np.uint8)
    work = np.float32 if x.dtype == np.float32 else np.float64
    rows = _rows(np.asarray(x, dtype=work))
    peaks = np.abs(rows).max(axis=1).astype(np.float64)
    scales = (peaks / levels).astype(_SCALE)
    safe = np.where(scales > 0, scales, 1.0).astype(work)
    codes = np.divide(rows, safe[:, None])
    np.rint(codes, out=codes)
    np.clip(codes, -levels, levels, out=codes)  # a subnormal scale can make them larger
    codes += 1 << (bits - 1)
    fields = codes.reshape(-1)[:m].astype(np.uint8)
    return np.concatenate([scales.view(np.uint8), _pack_fields(fields, bits)])


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as rows of :data:`CHUNK` values, the last one padded with zeros (a view where
    ``x`` fills whole rows)."""
    whole, rest = divmod(x.size, CHUNK)
    if rest == 0:
        return x.reshape(whole, CHUNK)
    padded = np.zeros((whole + 1) * CHUNK, dtype=x.dtype)
    padded[: x.size] = x
    return padded.reshape(whole + 1, CHUNK)


def unpack(raw: np.ndarray, bits: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A new 1-D array of ``count`` values of ``dtype`` from :func:`pack`'s bytes (the caller
    checked the byte count); ValueError for a scale that is not finite or is negative. A code
    times its float32 scale is exact in float64 and rounds once to float32, so float32 values
    are worked out in float32, the same numbers."""
    chunks = math.ceil(count / CHUNK)
    cut = chunks * _SCALE.itemsize
    scales = raw[:cut].view(_SCALE)
    if chunks and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise ValueError("a chunk's scale is not finite or is negative")
    work = np.dtype(np.float32 if dtype == np.float32 else np.float64)
    codes = np.zeros(chunks * CHUNK, dtype=work)  # the last chunk padded to whole rows
    codes[:count] = _unpack_fields(raw[cut:], bits, count)
    np.subtract(codes, 1 << (bits - 1), out=codes)
    rows = codes.reshape(chunks, CHUNK)
    np.multiply(rows, scales.astype(work)[:, None], out=rows)
    values = codes[:count]
    if values.dtype == dtype:
        return values
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def _pack_fields(fields: np.ndarray, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    padded = np.zeros(math.ceil(fields.size / per_byte) * per_byte, dtype=np.uint8)
    padded[: fields.size] = fields
    grid = padded.reshape(-1, per_byte)
    out = np.zeros(grid.shape[0], dtype=np.uint8)
    for i in range(per_byte):
        out |= grid[:, i] << np.uint8(i * bits)
    return out


def _unpack_fields(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    grid = np.stack([(packed >> np.uint8(i * bits)) & mask for i in range(per_byte)], axis=1)
    return grid.reshape(-1)[:count]


def to_int8(x: np.ndarray, peak: float) -> np.ndarray:
    """INT8's codes: ``round(x * 127 / peak)`` (one scale per piece, ``peak = max|x|``)."""
    if peak == 0.0:
        return np.zeros(x.size, dtype=np.int8)
    inverse = 127.0 / peak
    # |x * inverse| <= 127 * (1 + 2**-23) rounds to at most 127: no clipping needed
    if x.dtype == np.float32 and inverse < float(np.finfo(np.float32).max):
        ratio = np.multiply(x, np.float32(inverse))
    else:  # float64 pieces, and float32 pieces so small that 127 / peak overflows float32
        ratio = np.multiply(x, inverse, dtype=np.float64)
    np.rint(ratio, out=ratio)
    return ratio.astype(np.int8)


def int8_values(wire: np.ndarray, scale: float, dtype: np.dtype) -> np.ndarray:
    """INT8's values: ``q * scale`` in ``dtype``."""
    work = np.result_type(dtype, np.float32)
    if scale < float(np.finfo(work).tiny):  # scale is subnormal in work: multiply in float64
        values = np.multiply(wire, scale, dtype=np.float64)
    else:
        values = np.multiply(wire, work.type(scale), dtype=work)
    return values if values.dtype == dtype else values.astype(dtype)
