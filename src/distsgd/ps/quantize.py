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
    """The uint8 payload of a 1-D array of finite floats (see the module docstring)."""
    levels = LEVELS[bits]
    m = x.size
    if m == 0:
        return np.empty(0, dtype=np.uint8)
    chunks = math.ceil(m / CHUNK)
    padded = np.zeros(chunks * CHUNK, dtype=np.float64)
    padded[:m] = x
    rows = padded.reshape(chunks, CHUNK)
    scales = (np.abs(rows).max(axis=1) / levels).astype(_SCALE)
    safe = np.where(scales > 0, scales.astype(np.float64), 1.0)
    codes = np.clip(np.rint(rows / safe[:, None]), -levels, levels)
    fields = (codes.reshape(-1)[:m] + (1 << (bits - 1))).astype(np.uint8)
    return np.concatenate([scales.view(np.uint8), _pack_fields(fields, bits)])


def unpack(raw: np.ndarray, bits: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A new 1-D array of ``count`` values of ``dtype`` from :func:`pack`'s bytes (the caller
    checked the byte count); ValueError for a scale that is not finite or is negative."""
    chunks = math.ceil(count / CHUNK)
    cut = chunks * _SCALE.itemsize
    scales = raw[:cut].view(_SCALE).astype(np.float64)
    if chunks and not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise ValueError("a chunk's scale is not finite or is negative")
    fields = _unpack_fields(raw[cut:], bits, count)
    codes = fields.astype(np.float64) - (1 << (bits - 1))
    values = codes * np.repeat(scales, CHUNK)[:count]
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
