"""fp16 and bf16 as pushed updates travel (:mod:`distsgd.ps.compression`): float arrays to
their bits and back, a piece whose largest finite magnitude would overflow refused.

Speed. Everything is vectorised, without Python loops over elements. numpy's own
float32-to-float16 cast has no SIMD path (1.6 ms for 670k elements, 1.1 ms back), so fp16 is
encoded with float arithmetic doing the rounding: adding and subtracting
``2**(max(e, -14) + 13)`` (``e`` the exponent of ``|x|``) rounds ``|x|`` to fp16's precision,
ties to even, normals and subnormals alike; multiplying by ``2**-112`` then makes the float32
bits, shifted right by 13, the fp16 bits (a variant of ``fp16_ieee_from_fp32_value`` in
Maratyszcza's FP16 library, without its overflow branch, since overflow is refused first). It
matches numpy's cast bit for bit on every finite float32 below 65520 (checked exhaustively
when it was written; the tests check a sample). Decoding runs the same way backwards: shift
the magnitude bits into place and multiply by ``2**112`` (a 65536-entry table where there is
an inf or NaN). Both rely on subnormal floats (a thread with flush-to-zero on would send fp16
subnormals, below ``2**-14``, as zero).
bf16 is integer arithmetic on the uint32 bits, decoded with one shift.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from distsgd.ps import wire

FP16_OVERFLOW = 65520.0
"""Smallest magnitude that rounds to inf in fp16 (halfway between 65504 and 2**16)."""

BF16_OVERFLOW = float(np.array(0x7F7F8000, dtype=np.uint32).view(np.float32))
"""Smallest magnitude that rounds to inf in bf16 (about 3.3961776e38)."""

_U32 = np.uint32
_U16 = np.uint16


def extremes(x: np.ndarray) -> tuple[float, float]:
    """(max, min) of a non-empty array; NaN if it holds a NaN."""
    return float(x.max()), float(x.min())


def finite_peak(x: np.ndarray, high: float, low: float) -> float:
    """The largest finite ``|x|`` from ``x``'s (max, min); slow only when those are not finite."""
    if math.isfinite(high) and math.isfinite(low):
        return max(high, -low)
    magnitude = np.abs(x)
    finite = magnitude[np.isfinite(magnitude)]
    return float(finite.max()) if finite.size else 0.0


def refuse_overflow(name: str, peak: float, overflow: float, largest: float, fix: str) -> None:
    if peak >= overflow:
        raise ValueError(
            f"{name} cannot carry this piece: its largest magnitude {peak:.6g} is beyond "
            f"{name}'s largest {largest:.6g} and would become inf; use {fix}"
        )


def to_fp16(x: np.ndarray, high: float, low: float) -> np.ndarray:
    if x.dtype == np.float16:
        return x.astype("<f2")  # a copy, like every other encoding's output
    peak = finite_peak(x, high, low)
    refuse_overflow(wire.FP16.name, peak, FP16_OVERFLOW, 65504.0, "--wire-dtype bf16 or float32")
    if x.dtype == np.float32 and math.isfinite(high) and math.isfinite(low):
        return fp16_bits(x).view("<f2")
    return x.astype("<f2")  # float64 (rounded once, directly), or inf or NaN among the values


def fp16_bits(x: np.ndarray) -> np.ndarray:
    """fp16 bits of a finite float32 array with ``|x| < 65520`` (see the module docstring)."""
    bits = x.view(_U32)
    rounded = np.abs(x)
    magnitude = rounded.view(_U32)
    magic = np.maximum(magnitude, _U32(113 << 23))  # exponents below fp16's -14 count as -14
    magic &= _U32(0x7F800000)
    magic += _U32(13 << 23)  # 2**(e + 13): its ulp is fp16's ulp at exponent e
    magic_f = magic.view(np.float32)
    rounded += magic_f
    rounded -= magic_f  # exact (Sterbenz): |x| rounded to fp16 precision, ties to even
    rounded *= np.float32(2.0**-112)  # exact: fp16's exponent bias, subnormals included
    magnitude >>= _U32(13)
    np.right_shift(bits, _U32(16), out=magic)
    magic &= _U32(0x8000)
    magnitude |= magic
    out = np.empty(x.size, dtype=_U16)
    np.copyto(out, magnitude, casting="unsafe")
    return out


def to_bf16(x: np.ndarray, high: float, low: float) -> np.ndarray:
    largest = 3.3895314e38  # bf16 0x7F7F
    if x.dtype != np.float32:
        peak = finite_peak(x, high, low)
        refuse_overflow(wire.BF16.name, peak, BF16_OVERFLOW, largest, "--wire-dtype float32")
        x = x.astype(np.float32)  # finite: float64 below BF16_OVERFLOW rounds to at most it
        high, low = extremes(x)
    peak = finite_peak(x, high, low)
    refuse_overflow(wire.BF16.name, peak, BF16_OVERFLOW, largest, "--wire-dtype float32")
    bits = x.view(_U32)
    work = np.right_shift(bits, _U32(16))
    work &= _U32(1)
    work += _U32(0x7FFF)
    work += bits  # u + 0x7FFF + lsb: carries into the upper half when rounding up
    out = np.empty(x.size, dtype=_U16)
    np.right_shift(work, _U32(16), out=out, casting="unsafe")
    if math.isnan(high) or math.isnan(low):
        nan = np.isnan(x)
        out[nan] = (bits[nan] >> _U32(16)).astype(_U16) | _U16(0x0040)  # quiet, sign kept
    return out


@functools.cache
def fp16_table() -> np.ndarray:
    """Every fp16 bit pattern's float32 value (65536 entries)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(_U16).view(np.float16).astype(np.float32)


def fp16_values(half: np.ndarray) -> np.ndarray:
    """float32 values of fp16 bits: the magnitude bits shifted into place and scaled by
    ``2**112`` (exact, subnormals included); a table where there is an inf or NaN."""
    bits = np.left_shift(half, _U32(13), dtype=_U32)
    bits &= _U32(0x0FFFE000)
    if bits.size and int(bits.max()) >= 0x0F800000:  # exponent 31: inf or NaN
        return np.take(fp16_table(), half)
    floats = bits.view(np.float32)
    floats *= np.float32(2.0**112)
    sign = np.left_shift(half, _U32(16), dtype=_U32)
    sign &= _U32(0x80000000)
    bits |= sign
    return floats
