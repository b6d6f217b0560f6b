"""Tensors on the wire: raw little-endian bytes, cut into chunks and put back together.

A stream of tensors is a list of :class:`~distsgd.transport.proto.distsgd_pb2.TensorSpec` (in a
header message) followed by :class:`TensorChunk` messages. :func:`iter_chunks` cuts arrays into
chunks of at most ``chunk_bytes``; :class:`ChunkAssembler` checks and reassembles them, refusing
anything out of range, out of order, or incomplete.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from distsgd.transport.proto import distsgd_pb2 as pb

CHUNK_BYTES = (4 << 20) - (64 << 10)
"""Default chunk size: 4 MiB less 64 KiB, so a chunk message fits gRPC's default 4 MiB limit
of any client (distsgd's own allow 8 chunks). Measured on loopback with 100 MB: 1 MiB chunks
move about half the bytes per second of 4 MiB ones; 16 MiB ones are no faster."""

PREALLOCATE_BYTES = 64 << 20
"""A receiver reserves a tensor's whole buffer up front up to this size (one copy per chunk,
no regrowth); a larger announced tensor grows as its bytes arrive, so announcing a huge
tensor costs the sender the bytes, not the receiver's memory."""

ALLOWED_DTYPES = frozenset(
    np.dtype(t).name
    for t in (
        *(np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64),
        *(np.uint8, np.bool_),
    )
)
"""Dtypes a tensor may have on the wire. There is no ``bfloat16``: numpy has none."""

FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
"""The floating-point subset of :data:`ALLOWED_DTYPES` (what a parameter server stores)."""


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name`` (numpy computes it in Python each time; a server asks per piece)."""
    return dtype.name


class WireError(ValueError):
    """A malformed tensor stream; the message names the tensor key."""


class TooLarge(WireError):
    """A stream that announces more bytes than the receiver's limit."""


def wire_dtype(name: str, key: str = "?") -> np.dtype:
    """The little-endian numpy dtype for a wire dtype name, or :class:`WireError`."""
    if name not in ALLOWED_DTYPES:
        raise WireError(f"{key}: unsupported dtype {name!r}; use one of {sorted(ALLOWED_DTYPES)}")
    return np.dtype(name).newbyteorder("<")


def spec_of(key: str, array: np.ndarray) -> pb.TensorSpec:
    """The wire description of one array."""
    return pb.TensorSpec(key=key, dtype=array.dtype.name, shape=list(array.shape))


def specs_of(arrays: Mapping[str, np.ndarray]) -> list[pb.TensorSpec]:
    """Wire descriptions of named arrays, in mapping order."""
    return [spec_of(key, array) for key, array in arrays.items()]


def nbytes_of(spec: pb.TensorSpec) -> int:
    """Size in bytes of the tensor a spec describes."""
    if any(dim < 0 for dim in spec.shape):
        raise WireError(f"{spec.key}: negative dimension in shape {list(spec.shape)}")
    return math.prod(spec.shape) * wire_dtype(spec.dtype, spec.key).itemsize


def is_encoded(spec: pb.TensorSpec) -> bool:
    """Whether a spec's bytes are an encoding (compressed or sparse) rather than raw values."""
    return spec.encoding != pb.TENSOR_ENCODING_RAW or spec.nnz != 0


def to_wire_bytes(array: np.ndarray) -> bytes:
    """An array's raw little-endian bytes (C order)."""
    return wire_view(array).tobytes()


def wire_view(array: np.ndarray) -> memoryview:
    """The array's raw little-endian bytes (C order) as a memoryview: no copy when the array is
    already contiguous and little-endian (every array on x86 and ARM)."""
    wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return wire.reshape(-1).view(np.uint8).data


_M = TypeVar("_M")


def header_then_chunks(
    message: Callable[..., _M],
    header: Any,
    arrays: Sequence[np.ndarray],
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[_M]:
    """A stream of tensors as ``message``s: ``message(header=header)``, then ``arrays`` cut by
    :func:`iter_chunks`, each piece a ``message(chunk=...)``."""
    yield message(header=header)
    for chunk in iter_chunks(arrays, chunk_bytes):
        yield message(chunk=chunk)


def iter_chunks(
    arrays: Sequence[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """Cut arrays into TensorChunk messages of at most ``chunk_bytes`` data bytes each.

    An empty array still yields one (empty) chunk, so the receiver sees every tensor.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for index, array in enumerate(arrays):
        raw = wire_view(array)
        if len(raw) == 0:
            yield pb.TensorChunk(index=index, offset=0, data=b"")
            continue
        for start in range(0, len(raw), chunk_bytes):
            yield pb.TensorChunk(
                index=index, offset=start, data=bytes(raw[start : start + chunk_bytes])
            )


class ChunkAssembler:
    """Reassembles the tensors announced by a header from their chunks.

    Chunks of one tensor must arrive in order (each ``offset`` equal to the bytes received so far);
    tensors may interleave. ``finish`` fails if any tensor is incomplete.
    """

    def __init__(
        self,
        specs: Sequence[pb.TensorSpec],
        *,
        max_bytes: int | None = None,
        nbytes: Callable[[pb.TensorSpec], int] = nbytes_of,
    ) -> None:
        """``nbytes``: the byte count a spec announces (the default knows raw tensors only; a
        receiver that accepts encoded pieces passes one that knows their sizes, and
        :meth:`finish` then returns their bytes as uint8 arrays for it to decode)."""
        keys = [spec.key for spec in specs]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise WireError(f"{dup}: tensor listed twice in one message header")
        self._specs = list(specs)
        self._sizes = [nbytes(spec) for spec in specs]
        total = sum(self._sizes)
        if max_bytes is not None and total > max_bytes:
            raise TooLarge(
                f"message announces {total} bytes, over the limit of {max_bytes}; "
                "split the model over more parameter servers"
            )
        # Reserved up to PREALLOCATE_BYTES (uninitialised: only filled bytes are ever read);
        # beyond, grown as data arrives.
        self._buffers: list[np.ndarray | bytearray] = [
            np.empty(n, np.uint8) if n <= PREALLOCATE_BYTES else bytearray() for n in self._sizes
        ]
        self._filled = [0] * len(specs)

    def add(self, chunk: pb.TensorChunk) -> None:
        """Take one chunk, checking it lands exactly where the tensor continues."""
        i = chunk.index
        if i >= len(self._specs):
            raise WireError(f"chunk for tensor #{i}, but the header lists {len(self._specs)}")
        key, size, filled = self._specs[i].key, self._sizes[i], self._filled[i]
        if chunk.offset != filled:
            raise WireError(f"{key}: chunk at byte {chunk.offset}, expected byte {filled}")
        end = filled + len(chunk.data)
        if end > size:
            raise WireError(f"{key}: chunk ends at byte {end}, past the tensor's {size} bytes")
        buf = self._buffers[i]
        if isinstance(buf, np.ndarray):
            buf[filled:end] = np.frombuffer(chunk.data, np.uint8)
        else:
            buf += chunk.data
        self._filled[i] = end

    def finish(self) -> dict[str, np.ndarray]:
        """The complete tensors by key, or :class:`WireError` naming a truncated one."""
        out: dict[str, np.ndarray] = {}
        for spec, size, filled, buf in zip(
            self._specs, self._sizes, self._filled, self._buffers, strict=True
        ):
            if filled != size:
                raise WireError(f"{spec.key}: truncated, got {filled} of {size} bytes")
            if is_encoded(spec):
                out[spec.key] = np.frombuffer(buf, dtype=np.uint8)
                continue
            dtype = wire_dtype(spec.dtype, spec.key)
            out[spec.key] = (
                np.frombuffer(buf, dtype=dtype)
                .reshape(tuple(spec.shape))
                .astype(dtype.newbyteorder("="), copy=False)
            )
        return out
