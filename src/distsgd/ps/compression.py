"""Compressed pushes: the numpy codec of a pushed update's pieces, and worker-side error feedback.

A worker's update (a gradient or a parameter delta) travels to the servers as pieces (see
:mod:`distsgd.ps.partition`). With ``--wire-dtype`` and ``--topk`` each piece ``x`` (``n``
elements, float16, float32 or float64) is encoded on the worker by :func:`encode` into raw
little-endian bytes, and decoded on the server by :func:`decode` into a dense array of the
registered dtype, which the server's rule then applies in float32. The numbers of
:class:`Encoding` are the wire contract (the proto enum ``TensorEncoding``).

Encodings (``value`` is what the server decodes; every rounding is to nearest, ties to even):

``RAW``
    The piece's own dtype, unchanged: lossless.
``FP16``
    IEEE 754 binary16 (10-bit mantissa, largest finite 65504; Micikevicius et al. 2018,
    "Mixed Precision Training", ICLR). Relative error at most ``2**-11`` for ``|x| >= 2**-14``,
    absolute error at most ``2**-25`` below (subnormals). A finite ``|x| >= 65520`` would round
    to inf: :func:`encode` refuses the piece and names its largest magnitude (use bf16).
``BF16``
    The upper 16 bits of the float32 ``x``, rounded: ``b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16``
    on the bits ``u`` (NaN stays a quiet NaN, inf stays inf). Float32's range with an 8-bit
    mantissa, relative error at most ``2**-9`` (Kalamkar et al. 2019, "A Study of BFLOAT16 for
    Deep Learning Training", arXiv:1905.12322). Float64 pieces are rounded to float32 first.
``INT8``
    ``q = round(x / s)`` in ``[-127, 127]`` with one scale per piece ``s = max|x| / 127``
    (``s = 0`` for an all-zero piece), ``value = q * s``: error at most ``s / 2`` per element
    (Dettmers 2016, "8-Bit Approximations for Parallelism in Deep Learning", ICLR; deterministic
    rounding, not QSGD's stochastic one, Alistarh et al. 2017). The scale travels in the header.
    A piece holding NaN or inf has no scale; it travels RAW instead, so that the server refuses
    it as non-finite exactly as without compression (``--nonfinite``).
``INT4``, ``INT2``
    4-bit codes in [-7, 7] and 2-bit (ternary) codes in [-1, 1], with a float32 scale per chunk
    of 128 values carried in the payload ahead of the packed codes (the layout and error bounds
    are in :mod:`distsgd.ps.quantize`): 0.53 and 0.28 bytes per value. Non-finite pieces travel
    RAW, as under INT8; error feedback is on by default, as for INT8.

Top-k sparsification (``topk`` in (0, 1); Aji and Heafield 2017, "Sparse Communication for
Distributed Gradient Descent", EMNLP; Lin et al. 2018, "Deep Gradient Compression", ICLR):
keep the ``k = max(1, ceil(topk * n))`` entries of largest ``|x|`` (NaN counts as largest;
ties go to the lower index) and send ``nnz = k`` uint32 indices into the flattened piece,
strictly ascending, followed by the ``k`` values in the chosen encoding. The server decodes
zeros elsewhere. When the sparse form would not be smaller than the dense one
(``k * (4 + v) >= n * v`` for ``v`` bytes per value, e.g. ``k >= n / 2`` for float32 values)
the piece is sent dense, which carries more for fewer bytes.

Error feedback (:class:`ErrorFeedback`; Seide et al. 2014, "1-Bit Stochastic Gradient Descent
and its Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech; Stich,
Cordonnier and Jaggi 2018, "Sparsified SGD with Memory", NeurIPS; Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML). The worker keeps a
residual ``e`` per piece, zero at first, and for each update ``x``::

    a = x + e;    send C(a);    e <- a - D(C(a))

so after ``T`` pushes ``sum_t D(C(a_t)) = sum_t x_t - e_T``: nothing is lost, only delayed.
Top-k needs it (without it the small entries would never be applied); int8 gets it by default
too, because its one scale per piece is coarse: an entry below ``s / 2`` is sent as 0 at every
step, a systematic loss. fp16 and bf16 do not by default: their per-element rounding errors are
small (relative ``2**-11`` and ``2**-9``), round to nearest and so roughly unbiased, and a
residual costs a model-sized float32 copy and three passes per push.

Speed. Everything is vectorised, without Python loops over elements. fp16 and bf16 are
encoded and decoded by bit arithmetic (:mod:`distsgd.ps.half_floats`); int8 is one multiply
and one rounding.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from distsgd.ps import quantize, wire
from distsgd.ps.half_floats import BF16_OVERFLOW as BF16_OVERFLOW
from distsgd.ps.half_floats import FP16_OVERFLOW as FP16_OVERFLOW
from distsgd.ps.half_floats import extremes, fp16_values, to_bf16, to_fp16
from distsgd.ps.wire import Encoding

log = logging.getLogger(__name__)

INDEX_DTYPE = np.dtype("<u4")
"""Dtype of a sparse piece's indices on the wire."""

MAX_SPARSE_COUNT = 1 << 32
"""Most elements a piece may have to be sent sparse (its indices are uint32)."""

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
"""The dtypes a piece may have (and the server may register)."""

_SAMPLED_TOPK_MIN = 1 << 16
"""Pieces at least this large find their top-k threshold from a sample first."""

_SAMPLE = 1 << 14
"""Sample size for the top-k threshold."""

_U32 = np.uint32


LOW_BITS = {e.encoding: e.bits for e in wire.TABLE if e.bits < 8}
_BITS = {e.encoding: e.bits for e in wire.TABLE}
"""The encodings whose scales travel in the payload, a chunk at a time: bits per code."""


ENCODINGS: dict[str, Encoding] = wire.pushes()
"""``TrainConfig.wire_dtype`` -> encoding; ``float32`` is uncompressed (each piece's own dtype);
from the wire vocabulary (:mod:`distsgd.ps.wire`)."""

WIRE_DTYPES = tuple(ENCODINGS)
"""What ``--wire-dtype`` (``TrainConfig.wire_dtype``) may be: the dtype pushed updates travel in."""


def encoding_for(wire_dtype: str) -> Encoding:
    """The encoding of a ``--wire-dtype`` value: the one check of the flag (``TrainConfig``
    calls it too), a one-line ValueError for a value that is none."""
    try:
        return ENCODINGS[wire_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown wire dtype {wire_dtype!r} (--wire-dtype); use one of {', '.join(ENCODINGS)}"
        ) from None


@dataclass(frozen=True)
class EncodedPiece:
    """One encoded piece: the header fields and the byte payload.

    ``parts`` are 1-D arrays whose raw bytes, sent back to back, are the payload: ``(values,)``
    dense, ``(indices, values)`` sparse. A RAW part may be a view of the array that was
    encoded: do not change that array until the bytes have been sent.
    """

    encoding: Encoding
    scale: float
    """INT8's scale (``max|x| / 127``, 0 for an all-zero piece); 1.0 for every other encoding."""
    nnz: int
    """0: dense. More: sparse, ``nnz`` uint32 indices (ascending) then ``nnz`` values."""
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the payload on the wire."""
        return sum(int(part.nbytes) for part in self.parts)

    def tobytes(self) -> bytes:
        """The payload as one bytes object (a copy; for tests and small pieces)."""
        return b"".join(part.tobytes() for part in self.parts)


def value_bytes(encoding: Encoding, dtype: npt.DTypeLike) -> float:
    """Bytes per value on the wire for pieces of ``dtype`` (INT4 and INT2: with their share
    of a chunk's scale)."""
    if encoding is Encoding.RAW:
        return float(_float_dtype(dtype, "dtype").itemsize)
    bits = _BITS[encoding] / 8
    return bits + 4 / quantize.CHUNK if encoding in LOW_BITS else bits


def wire_nbytes(encoding: Encoding, dtype: npt.DTypeLike, count: int, nnz: int) -> int:
    """Bytes on the wire of a piece with `count` elements of logical `dtype` (nnz=0 dense)."""
    encoding = _check_encoding(encoding)
    if count < 0 or not 0 <= nnz <= count:
        raise ValueError(f"need 0 <= nnz <= count, got nnz {nnz} and count {count}")
    values = nnz or count
    if encoding in LOW_BITS:
        size = quantize.packed_nbytes(LOW_BITS[encoding], values)
    else:
        size = values * int(value_bytes(encoding, dtype))
    return size if nnz == 0 else nnz * INDEX_DTYPE.itemsize + size


def topk_count(count: int, topk: float) -> int:
    """How many entries top-k keeps of ``count``: ``max(1, ceil(topk * count))``, 0 if empty.

    The product is taken with a relative tolerance of 1e-12, so that ``0.07 * 100`` (which is
    7.000000000000001 in floating point) keeps 7, not 8.
    """
    _check_topk(topk)
    if count == 0 or topk == 0.0:
        return 0
    return min(count, max(1, math.ceil(topk * count * (1.0 - 1e-12))))


def encode(piece: np.ndarray, encoding: Encoding, topk: float = 0.0) -> EncodedPiece:
    """Encode one piece (float16, float32 or float64, any shape) for the wire.

    ``topk`` in (0, 1) sends only the ``topk_count(n, topk)`` entries of largest magnitude,
    sparse (dense when that is not smaller). Raises ValueError for a piece of another dtype,
    a ``topk`` outside [0, 1), and a finite value that would become inf in fp16 or bf16.
    """
    encoding = _check_encoding(encoding)
    _check_topk(topk)
    x = _flat_piece(piece)
    n = x.size
    k = topk_count(n, topk)
    if k and wire_nbytes(encoding, x.dtype, n, k) < wire_nbytes(encoding, x.dtype, n, 0):
        if n > MAX_SPARSE_COUNT:
            raise ValueError(
                f"a piece of {n} elements cannot be sent top-k (indices are uint32, at most "
                f"{MAX_SPARSE_COUNT}): split it over more servers (--ps) or set --topk 0"
            )
        index = _top_k_indices(x, k)
        used, scale, values = _compress(x[index], encoding)
        return EncodedPiece(used, scale, k, (index.astype(INDEX_DTYPE), values))
    used, scale, values = _compress(x, encoding)
    return EncodedPiece(used, scale, 0, (values,))


def decode(
    raw: memoryview | bytes | np.ndarray,
    *,
    encoding: Encoding | int,
    scale: float,
    nnz: int,
    shape: tuple[int, ...],
    dtype: npt.DTypeLike,
) -> np.ndarray:
    """The dense array of ``dtype`` and ``shape`` that a piece's payload ``raw`` encodes.

    Trusts nothing: raises ValueError (one line, naming the problem) for an unknown encoding, a
    dtype other than float16/32/64, a bad shape, a byte count that does not match
    :func:`wire_nbytes`, a scale that is not finite, negative, too large for ``dtype`` or (for
    any encoding but INT8) not 1.0, ``nnz`` negative or above the element count, and indices
    out of range or not strictly ascending. Values are not checked for NaN or inf (the shard
    refuses a non-finite push as before). The result is a new array; ``raw`` may be reused.

    ``shape`` and ``dtype`` must be the registered piece's, checked before the call: a sparse
    payload of a few bytes decodes into ``prod(shape)`` elements.
    """
    encoding = _check_encoding(encoding)
    dt = _float_dtype(dtype, "dtype")
    dims, count = _check_shape(shape)
    if isinstance(nnz, bool) or not isinstance(nnz, (int, np.integer)):
        raise ValueError(f"nnz must be an integer, got {nnz!r}")
    nnz = int(nnz)
    if nnz < 0:
        raise ValueError(f"nnz {nnz} is negative: it counts the sparse entries (0 = dense)")
    if nnz > count:
        raise ValueError(f"nnz {nnz} exceeds the piece's {count} elements")
    scale = _check_scale(scale, encoding, dt)
    buf = _byte_view(raw)
    expected = wire_nbytes(encoding, dt, count, nnz)
    if buf.size != expected:
        form = f"{nnz} sparse entries" if nnz else "dense"
        raise ValueError(
            f"payload has {buf.size} bytes, expected {expected} for {count} elements of "
            f"{dt.name} in {encoding.name} ({form})"
        )
    wire = _wire_dtype(encoding, dt)
    if nnz == 0:
        return _expand(buf.view(wire), encoding, scale, dt, count).reshape(dims)
    cut = nnz * INDEX_DTYPE.itemsize
    index = buf[:cut].view(INDEX_DTYPE)
    if nnz > 1 and bool(np.any(index[1:] <= index[:-1])):
        raise ValueError("sparse indices are not strictly ascending")
    if int(index[-1]) >= count:
        raise ValueError(f"sparse index {int(index[-1])} is out of range for {count} elements")
    out = np.zeros(count, dtype=dt)
    out[index] = _expand(buf[cut:].view(wire), encoding, scale, dt, nnz)
    return out.reshape(dims)


class ErrorFeedback:
    """Per-piece residuals kept on the worker (Seide et al. 2014 1-bit SGD; Stich et al. 2018
    'Sparsified SGD with memory'; Karimireddy et al. 2019 EF-SGD): e <- x + e; send C(e); keep
    e - decode(C(e)).

    ``feedback`` defaults to on for top-k and INT8 and off for FP16, BF16 and RAW (see the
    module docstring); top-k without it is refused. The residuals take as much memory as the
    pieces pushed (float32 for float16 pieces). Calls for different keys may run in parallel
    threads; two calls for the same key must not.
    """

    def __init__(
        self, encoding: Encoding, topk: float = 0.0, *, feedback: bool | None = None
    ) -> None:
        self.encoding = _check_encoding(encoding)
        _check_topk(topk)
        self.topk = float(topk)
        if feedback is None:
            feedback = topk > 0.0 or self.encoding in (Encoding.INT8, *LOW_BITS)
        if topk > 0.0 and not feedback:
            raise ValueError(
                "top-k without error feedback never applies the entries it leaves out: "
                "keep feedback on, or set topk to 0"
            )
        self.feedback = bool(feedback)
        self._residuals: dict[str, np.ndarray] = {}
        self._squares: dict[str, float] = {}
        self._lock = threading.Lock()

    def encode(self, key: str, piece: np.ndarray) -> EncodedPiece:
        """Encode ``piece`` plus the residual kept for ``key``; keep what did not get through.

        A piece whose sum with its residual is not finite is encoded as it is (the server will
        refuse it) and leaves the residual unchanged. Raises ValueError, naming ``key``, where
        :func:`encode` would, and for a piece whose shape or dtype differs from the last one
        under ``key`` (call :meth:`reset` when the model changes).
        """
        if not self.feedback:
            try:
                return encode(piece, self.encoding, self.topk)
            except ValueError as error:
                raise ValueError(f"{key}: {error}") from None
        x = np.asarray(piece)
        dt = _float_dtype(x.dtype, f"piece {key}")
        work = np.result_type(dt, np.float32)
        with self._lock:
            previous = self._residuals.get(key)
        if previous is None:
            total = np.array(x, dtype=work)  # a copy: encoded parts may view it
        else:
            if previous.shape != x.shape or previous.dtype != work:
                raise ValueError(
                    f"{key}: piece is {x.dtype.name}{list(x.shape)} but its residual is "
                    f"{previous.dtype.name}{list(previous.shape)}: call reset() when the model "
                    "changes"
                )
            total = np.add(x, previous, dtype=work)
        try:
            message = encode(total.astype(dt, copy=False), self.encoding, self.topk)
        except ValueError as error:
            raise ValueError(f"{key}: {error} (with its error-feedback residual)") from None
        residual = self._residual(total, message, dt)
        square = _square_sum(residual)
        if square is None:
            log.debug("%s: non-finite update; its error-feedback residual is kept as it was", key)
            return message
        with self._lock:
            self._residuals[key] = residual
            self._squares[key] = square
        return message

    def reset(self) -> None:
        """Drop every residual (e.g. after the servers restarted from a checkpoint)."""
        with self._lock:
            self._residuals.clear()
            self._squares.clear()

    def residual(self, key: str) -> np.ndarray | None:
        """A read-only view of the residual kept for ``key``, or None."""
        with self._lock:
            residual = self._residuals.get(key)
        if residual is None:
            return None
        view = residual.view()
        view.flags.writeable = False
        return view

    @property
    def residual_norm(self) -> float:
        """The L2 norm of all residuals together (what has not reached the servers yet)."""
        with self._lock:
            return math.sqrt(math.fsum(self._squares.values()))

    def _residual(self, total: np.ndarray, message: EncodedPiece, dtype: np.dtype) -> np.ndarray:
        """``total - D(message)``, decoded exactly as the server decodes into ``dtype``."""
        flat = total.reshape(-1)
        count = message.nnz or flat.size
        values = _expand(message.parts[-1], message.encoding, message.scale, dtype, count)
        if message.nnz:
            index = message.parts[0]
            flat[index] -= values  # parts never view ``total`` when sparse (gathered copies)
            return total
        if any(np.may_share_memory(part, total) for part in message.parts):
            return np.subtract(total, values.reshape(total.shape), dtype=total.dtype)
        np.subtract(flat, values, out=flat)
        return total


# --------------------------------------------------------------------------- checks


def _check_encoding(encoding: Encoding | int) -> Encoding:
    if isinstance(encoding, Encoding):
        return encoding
    if isinstance(encoding, (int, np.integer)) and not isinstance(encoding, bool):
        try:
            return Encoding(int(encoding))
        except ValueError:
            pass
    known = ", ".join(f"{e.name}={e.value}" for e in Encoding)
    raise ValueError(f"unknown encoding {encoding!r}: expected one of {known}")


def _check_topk(topk: float) -> None:
    if not (isinstance(topk, (int, float)) and 0.0 <= topk < 1.0):
        raise ValueError(f"topk must be a fraction in [0, 1) (0 = off, e.g. 0.01), got {topk!r}")


def _float_dtype(dtype: npt.DTypeLike, what: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{what} {dtype!r} is not a numpy dtype") from None
    native = dt.newbyteorder("=")
    if native not in FLOAT_DTYPES:
        raise ValueError(f"{what} is {dt}: pieces must be float16, float32 or float64")
    return native


def _check_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"shape must be a tuple of non-negative integers, got {shape!r}")
    dims = tuple(int(d) for d in shape)
    return dims, math.prod(dims)


def _check_scale(scale: float, encoding: Encoding, dtype: np.dtype) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale < 0.0:
        raise ValueError(f"scale {scale} must be finite and not negative")
    if encoding is not Encoding.INT8:
        if scale != 1.0:
            raise ValueError(f"scale {scale} must be 1.0 for {encoding.name} (it is INT8's)")
    elif scale * 128.0 > float(np.finfo(dtype).max):
        raise ValueError(f"scale {scale} is too large for {dtype.name}: values would overflow")
    return scale


def _byte_view(raw: memoryview | bytes | np.ndarray) -> np.ndarray:
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(raw, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as error:
        raise ValueError(f"payload is not a contiguous byte buffer: {error}") from None


# --------------------------------------------------------------------------- encoding


def _flat_piece(piece: np.ndarray) -> np.ndarray:
    """The piece as a 1-D, C-contiguous array of its native-order float dtype (a view if it is)."""
    x = np.asarray(piece)
    dt = _float_dtype(x.dtype, "piece")
    return np.ascontiguousarray(x, dtype=dt).reshape(-1)


def _wire_dtype(encoding: Encoding, dtype: np.dtype) -> np.dtype:
    if encoding is Encoding.RAW:
        return dtype.newbyteorder("<")
    if encoding is Encoding.FP16:
        return np.dtype("<f2")
    if encoding is Encoding.BF16:
        return np.dtype("<u2")
    return np.dtype(np.int8) if encoding is Encoding.INT8 else np.dtype(np.uint8)


def _compress(x: np.ndarray, encoding: Encoding) -> tuple[Encoding, float, np.ndarray]:
    """(encoding used, scale, values on the wire) of a 1-D contiguous float array."""
    if encoding is Encoding.RAW or x.size == 0:
        return encoding, 1.0 if encoding is not Encoding.INT8 else 0.0, _raw_or_empty(x, encoding)
    high, low = extremes(x)
    if encoding is Encoding.INT8 or encoding in LOW_BITS:
        if not (math.isfinite(high) and math.isfinite(low)):
            log.debug("a piece with NaN or inf travels RAW: integer codes cannot carry it")
            return Encoding.RAW, 1.0, x.astype(x.dtype.newbyteorder("<"), copy=False)
        if encoding in LOW_BITS:
            return encoding, 1.0, quantize.pack(x, LOW_BITS[encoding])
        peak = max(high, -low)
        return encoding, peak / 127.0, quantize.to_int8(x, peak)
    if encoding is Encoding.FP16:
        return encoding, 1.0, to_fp16(x, high, low)
    return encoding, 1.0, to_bf16(x, high, low)


def _raw_or_empty(x: np.ndarray, encoding: Encoding) -> np.ndarray:
    if encoding is Encoding.RAW:
        return x.astype(x.dtype.newbyteorder("<"), copy=False)
    return np.empty(0, dtype=_wire_dtype(encoding, x.dtype))


def _top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending int64 indices of the ``k`` entries of largest ``|x|`` (NaN largest; ties to
    the lower index)."""
    n = x.size
    magnitude = np.abs(x)
    high, _ = extremes(magnitude)
    if math.isnan(high):  # argpartition sorts NaN last, i.e. largest
        index = np.argpartition(magnitude, n - k)[n - k :]
        index.sort()
        return index
    candidates: np.ndarray | None = None
    if n >= _SAMPLED_TOPK_MIN:
        # A threshold from a sample, set so low that (by a 10-sigma margin) at least k entries
        # pass it; the exact selection then runs on those only. Exact whatever the sample: if
        # fewer than k pass, the whole piece is searched.
        expected = _SAMPLE * k / n
        rank = math.ceil(1.5 * expected + 10.0 * math.sqrt(expected) + 8.0)
        if rank < _SAMPLE // 4:
            sample = magnitude[_sample_indices(n)]
            floor = np.partition(sample, _SAMPLE - rank)[_SAMPLE - rank]
            passed = np.flatnonzero(magnitude >= floor)
            if passed.size >= k:
                candidates = passed
    values = magnitude if candidates is None else magnitude[candidates]
    m = values.size
    threshold = np.partition(values, m - k)[m - k]
    chosen = np.flatnonzero(values >= threshold)
    if chosen.size > k:  # ties at the threshold: the lowest indices among them
        above = np.flatnonzero(values > threshold)
        tied = np.flatnonzero(values == threshold)[: k - above.size]
        chosen = np.union1d(above, tied)
    return chosen if candidates is None else candidates[chosen]


def _sample_indices(n: int) -> np.ndarray:
    """:data:`_SAMPLE` random indices below ``n`` (seeded by ``n``: the same piece, the same)."""
    return np.random.default_rng(n).integers(0, n, _SAMPLE)


# --------------------------------------------------------------------------- decoding


def _expand(
    wire: np.ndarray, encoding: Encoding, scale: float, dtype: np.dtype, count: int
) -> np.ndarray:
    """A new 1-D array of ``dtype`` holding the ``count`` values of ``wire`` (the wire dtype's
    array)."""
    if encoding in LOW_BITS:
        return quantize.unpack(wire, LOW_BITS[encoding], count, dtype)
    if encoding is Encoding.RAW:
        return wire.astype(dtype)
    if encoding is Encoding.FP16:
        if dtype == np.float16:
            return wire.astype(np.float16)
        floats = fp16_values(wire.view("<u2"))
    elif encoding is Encoding.BF16:
        floats = np.left_shift(wire.view("<u2"), _U32(16), dtype=_U32).view(np.float32)
    else:
        return quantize.int8_values(wire, scale, dtype)
    if dtype == np.float32:
        return floats
    with np.errstate(over="ignore", invalid="ignore"):  # bf16 beyond float16; signalling NaNs
        return floats.astype(dtype)


def _square_sum(residual: np.ndarray) -> float | None:
    """``sum(residual**2)``, or None if the residual is not finite."""
    flat = residual.reshape(-1)
    square = float(np.dot(flat, flat))
    if math.isfinite(square):
        return square
    if not np.isfinite(flat).all():
        return None
    return float(np.square(flat, dtype=np.float64).sum())  # float32 overflowed, values finite
