"""The wire vocabulary: every encoding a tensor may travel in, in one table.

Each :class:`WireEncoding` says its name (the value of ``--wire-dtype`` and ``--pull-dtype``),
its number on the wire (:class:`Encoding`, the ``.proto``'s ``TensorEncoding``), its bits per
value, where it may travel (a push, a pull, torch's DDP communication hook under ``allreduce``)
and what encoding and decoding it costs the planner. Every other place reads this table: the
flags' checks (``ps.compression.encoding_for``, ``ps.pull_encoding.pull_encoding_for``), the
DDP hooks (``runtime.ddp``), what ``allreduce`` refuses, and the cost model (``plan.choices``).
A new encoding is a value in the ``.proto``, a line here and its codec function in
``ps.compression``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Encoding(enum.IntEnum):
    """How a piece's values travel; the numbers are the wire contract (proto ``TensorEncoding``)."""

    RAW = 0
    """The piece's own dtype (float16, float32 or float64), unchanged."""
    FP16 = 1
    """IEEE half precision."""
    BF16 = 2
    """The upper 16 bits of float32, rounded to nearest even, as uint16."""
    INT8 = 3
    """int8 ``q``; value ``q * scale``, ``scale = max|x| / 127``."""
    INT4 = 4
    """4-bit codes with a float32 scale per chunk of 128 (:mod:`distsgd.ps.quantize`)."""
    INT2 = 5
    """2-bit (ternary) codes with a float32 scale per chunk of 128."""


_PER_MB = 1e-3 / 2.7e6
"""One millisecond per 2.7 MB of float32 (the benchmark MLP's push), per byte."""


@dataclass(frozen=True, kw_only=True)
class WireEncoding:
    """One encoding of the wire vocabulary."""

    name: str
    """The flags' value (``--wire-dtype``, ``--pull-dtype``)."""
    encoding: Encoding
    """Its number on the wire."""
    bits: int
    """Bits per value (``float32``: each piece's own dtype, counted as float32)."""
    push: bool
    """Whether a push (an update to a parameter server) may travel in it."""
    pull: bool
    """Whether a pull (the parameters themselves) may: the integer codes carry updates only."""
    hook: str | None
    """Under ``allreduce``, the ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``
    hook (``<hook>_hook``) that carries gradients in it; None: not offered there."""
    cost: float
    """CPU seconds per float32 byte to encode and decode it (with error feedback where it
    keeps some), as the planner assumes or measured (docs/compression.md)."""


FLOAT32 = WireEncoding(
    name="float32", encoding=Encoding.RAW, bits=32, push=True, pull=True, hook="allreduce",
    cost=0.0,
)  # fmt: skip
FP16 = WireEncoding(
    name="fp16", encoding=Encoding.FP16, bits=16, push=True, pull=True, hook="fp16_compress",
    cost=0.4 * _PER_MB,  # 0.2 ms to encode, about 0.1 to decode 2.7 MB, measured
)  # fmt: skip
BF16 = WireEncoding(
    name="bf16", encoding=Encoding.BF16, bits=16, push=True, pull=True, hook="bf16_compress",
    cost=0.3 * _PER_MB,
)  # fmt: skip
INT8 = WireEncoding(
    name="int8", encoding=Encoding.INT8, bits=8, push=True, pull=False, hook=None,
    cost=0.8 * _PER_MB,  # with its error feedback: a residual, the scale, the rounding; assumed
)  # fmt: skip
INT4 = WireEncoding(
    name="int4", encoding=Encoding.INT4, bits=4, push=True, pull=False, hook=None,
    # a scale per chunk of 128, the codes packed: 2.9x to 3.0x int8's, measured
    # (python benchmarks/codec_cost.py: 3.3 to 3.5 ms against 1.1 ms per 2.7 MB)
    cost=3.0 * 0.8 * _PER_MB,
)  # fmt: skip
INT2 = WireEncoding(
    name="int2", encoding=Encoding.INT2, bits=2, push=True, pull=False, hook=None,
    cost=3.0 * 0.8 * _PER_MB,
)  # fmt: skip

TABLE: tuple[WireEncoding, ...] = (FLOAT32, FP16, BF16, INT8, INT4, INT2)
"""Every encoding, the uncompressed one first and then by bits."""

TOPK_COST = 1.5 * _PER_MB
"""Top-k with error feedback (a selection over the piece), per float32 byte, assumed: top-k
travels in any push encoding's values, so it is no line of the table."""


def pushes() -> dict[str, Encoding]:
    """The names a push may travel in, and their numbers."""
    return {e.name: e.encoding for e in TABLE if e.push}


def pulls() -> dict[str, Encoding]:
    """The names a pull may travel in, and their numbers."""
    return {e.name: e.encoding for e in TABLE if e.pull}


def hooks() -> dict[str, str]:
    """The names ``allreduce`` offers, and their DDP hooks."""
    return {e.name: e.hook for e in TABLE if e.hook is not None}


def named(name: str) -> WireEncoding:
    """The encoding called ``name``; KeyError when there is none (the flags' checks say which
    names a use allows, in one line)."""
    return {entry.name: entry for entry in TABLE}[name]
