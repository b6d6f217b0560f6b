"""A mean over workers of compressed tensors: each worker encodes its own (with error feedback),
all-gathers the encoded frames, and every worker decodes all of them and averages.

The encodings are the parameter servers' (:mod:`distsgd.ps.compression`: ``--wire-dtype``
int8, int4, int2, fp16, bf16 and ``--topk``). All-reduce cannot sum encoded values, so the
frames are all-gathered instead: with N workers each sends its frame to the N - 1 others (ring
all-gather: (N - 1) frames out per worker, against about 2 (N - 1) / N float32 copies of the
tensor for a ring all-reduce). Every worker decodes the same frames in the same order, so the
means are bit-identical everywhere, as all-reduce's.

A frame, little-endian, of a size every worker derives from the element count alone::

    byte 0       the encoding used (``Encoding``), or 255: the values were not finite
    bytes 1-3    zero
    bytes 4-7    nnz, uint32 (0: dense; top-k: the entries kept)
    bytes 8-15   the INT8 scale, float64 (1.0 for the other encodings)
    bytes 16-    the payload (:func:`distsgd.ps.compression.decode`'s), zero-padded

A frame whose values were not finite (the integer codes cannot carry NaN or inf) decodes to
NaN, so that a diverged worker poisons the mean as it would under all-reduce and the run's
divergence checks see it. Every field of a peer's frame is checked: an unexpected encoding or
nnz, or a payload ``decode`` refuses, raises :class:`CorruptFrame`.
"""

from __future__ import annotations

import numpy as np

from distsgd.ps.compression import (
    Encoding,
    ErrorFeedback,
    decode,
    topk_count,
    wire_nbytes,
)

HEADER = 16
"""Bytes of a frame's header."""

NONFINITE = 255
"""Byte 0 of a frame whose values were not finite."""

_HEAD = np.dtype([("encoding", "u1"), ("pad", "u1", (3,)), ("nnz", "<u4"), ("scale", "<f8")])


class CorruptFrame(ValueError):
    """A peer's frame does not hold what the shared element count and encoding say it must."""


class EncodedMean:
    """Frames for one worker's tensors (by key) and the mean of every worker's frames."""

    def __init__(self, encoding: Encoding, topk: float = 0.0) -> None:
        self.encoding = encoding
        self.topk = topk
        self.feedback = ErrorFeedback(encoding, topk)

    def planned_nnz(self, count: int) -> int:
        """Entries a frame of ``count`` values carries sparse (0: dense), as ``encode`` decides."""
        k = topk_count(count, self.topk)
        sparse = k and wire_nbytes(self.encoding, np.float32, count, k) < wire_nbytes(
            self.encoding, np.float32, count, 0
        )
        return k if sparse else 0

    def frame_nbytes(self, count: int) -> int:
        """Bytes of every worker's frame for a tensor of ``count`` float32 values."""
        return HEADER + wire_nbytes(self.encoding, np.float32, count, self.planned_nnz(count))

    def encode(self, key: str, values: np.ndarray) -> np.ndarray:
        """This worker's frame (uint8) for the flat float32 ``values`` under ``key``."""
        frame = np.zeros(self.frame_nbytes(values.size), dtype=np.uint8)
        head = frame[:HEADER].view(_HEAD)[0]
        if not np.isfinite(values).all():
            head["encoding"] = NONFINITE
            return frame
        message = self.feedback.encode(key, values)
        assert message.encoding is self.encoding and message.nnz == self.planned_nnz(values.size)
        head["encoding"], head["nnz"], head["scale"] = message.encoding, message.nnz, message.scale
        offset = HEADER
        for part in message.parts:
            raw = part.view(np.uint8)
            frame[offset : offset + raw.size] = raw
            offset += raw.size
        return frame

    def mean(self, frames: list[np.ndarray], count: int) -> np.ndarray:
        """The mean (float32, flat) of the values that ``frames`` (one per worker) encode."""
        total = np.zeros(count, dtype=np.float32)
        for rank, frame in enumerate(frames):
            total += self._decode(frame, count, rank)
        total /= len(frames)
        return total

    def _decode(self, frame: np.ndarray, count: int, rank: int) -> np.ndarray:
        if frame.size != self.frame_nbytes(count):
            raise CorruptFrame(f"rank {rank}: frame of {frame.size} bytes for {count} values")
        head = frame[:HEADER].view(_HEAD)[0]
        if int(head["encoding"]) == NONFINITE:
            return np.full(count, np.nan, dtype=np.float32)
        nnz, planned = int(head["nnz"]), self.planned_nnz(count)
        if int(head["encoding"]) != self.encoding or nnz != planned:
            raise CorruptFrame(
                f"rank {rank}: frame says encoding {int(head['encoding'])} with {nnz} entries, "
                f"expected {int(self.encoding)} with {planned}"
            )
        size = wire_nbytes(self.encoding, np.float32, count, nnz)
        try:
            return decode(
                frame[HEADER : HEADER + size],
                encoding=self.encoding,
                scale=float(head["scale"]),
                nnz=nnz,
                shape=(count,),
                dtype=np.float32,
            )
        except ValueError as error:
            raise CorruptFrame(f"rank {rank}: {error}") from None
