"""Encoded pulls ("Encoded pulls" in the .proto): a shard's float pieces sent in bf16
or fp16 where a pull crosses a network (the gRPC stream, a tensor socket), decoded by the client.

A float32 pull of ``n`` values moves ``4n`` bytes; encoded it moves ``2n``. Hogwild, sync and
every scheme that pulls the whole model each step move as many bytes down as up, so with
``--wire-dtype bf16`` for pushes, ``--pull-dtype bf16`` halves a step's bytes again. The values
a worker then computes on are the server's rounded to the encoding (bf16 keeps 8 significant
bits: relative error at most ``2**-9``; fp16 11 bits, within its range); the server's own copy
stays exact, so rounding never accumulates in the model, only in the gradients of one step.

The server encodes with :func:`encode_pull`; the client's transport receives the bytes and
decodes them with :class:`PullDecoder` (the transport's ``PullDecoding``), which trusts nothing
the server said: a spec that is not the expected piece's dtype and shape, an encoding the client
did not ask for, or a byte count that does not match is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from distsgd.ps import compression, wire
from distsgd.ps.compression import Encoding
from distsgd.transport.codec import WireError, nbytes_of, spec_of
from distsgd.transport.proto import distsgd_pb2 as pb

PULL_ENCODINGS: dict[str, Encoding] = wire.pulls()
"""``TrainConfig.pull_dtype`` -> encoding; ``float32`` is each piece's own dtype, unchanged;
from the wire vocabulary (:mod:`distsgd.ps.wire`)."""

PULL_DTYPES = tuple(PULL_ENCODINGS)
"""What ``--pull-dtype`` (``TrainConfig.pull_dtype``) may be."""


def pull_encoding_for(pull_dtype: str) -> Encoding:
    """The encoding of a ``--pull-dtype`` value: the flag's one check, a one-line ValueError for
    a value that is none (int8 is not offered: a pull is the model itself, not an update)."""
    try:
        return PULL_ENCODINGS[pull_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown pull dtype {pull_dtype!r} (--pull-dtype); use one of "
            f"{', '.join(PULL_ENCODINGS)}"
        ) from None


def check_requested(value: int) -> Encoding:
    """``PullRequest.encoding`` as an :class:`Encoding`; ValueError for INT8 or an unknown one."""
    if value not in (Encoding.RAW, Encoding.BF16, Encoding.FP16):
        raise ValueError(f"pull encoding {value} is not RAW, FP16 or BF16")
    return Encoding(value)


def encode_pull(
    values: Mapping[str, np.ndarray], encoding: Encoding
) -> tuple[list[pb.TensorSpec], list[np.ndarray]]:
    """A pull's answer: each piece's spec and the array whose bytes travel.

    Float pieces in ``encoding`` where it can carry them; pieces of another dtype, and a piece
    fp16 cannot carry (a finite value beyond its range), RAW, their spec saying so."""
    specs: list[pb.TensorSpec] = []
    arrays: list[np.ndarray] = []
    for key, value in values.items():
        spec = spec_of(key, value)
        wire: np.ndarray = value
        if encoding is not Encoding.RAW and value.dtype.kind == "f":
            try:
                piece = compression.encode(value, encoding)
            except ValueError:  # beyond the encoding's range: this piece travels RAW
                pass
            else:
                spec = pb.TensorSpec(
                    key=key,
                    dtype=spec.dtype,
                    shape=spec.shape,
                    encoding=f"TENSOR_ENCODING_{piece.encoding.name}",
                )
                wire = piece.parts[0]
        specs.append(spec)
        arrays.append(wire)
    return specs, arrays


class PullDecoder:
    """The client's side (the transport's ``PullDecoding``): sizes and decodes the pieces of a
    pull asked in ``encoding``."""

    def __init__(self, encoding: Encoding) -> None:
        self.encoding = encoding

    @property
    def requested(self) -> str:
        """What the client puts in ``PullRequest.encoding``."""
        return f"TENSOR_ENCODING_{self.encoding.name}"

    def nbytes(self, spec: pb.TensorSpec) -> int:
        """Bytes the piece a spec announces takes on the wire; WireError for an encoding this
        client did not ask for, or a sparse one."""
        if spec.encoding == pb.TENSOR_ENCODING_RAW and spec.nnz == 0:
            return nbytes_of(spec)
        if spec.encoding != self.encoding or spec.nnz != 0:
            raise WireError(
                f"{spec.key}: the server answered encoding {spec.encoding} (nnz {spec.nnz}) to a "
                f"pull that asked {self.encoding.name}"
            )
        count = int(np.prod(spec.shape, dtype=np.int64)) if spec.shape else 1
        try:
            return compression.wire_nbytes(self.encoding, spec.dtype, count, 0)
        except (TypeError, ValueError) as exc:
            raise WireError(f"{spec.key}: {exc}") from None

    def decode(self, spec: pb.TensorSpec, raw: np.ndarray) -> np.ndarray:
        """The values of an encoded piece (``raw``: its bytes) as its dtype and shape."""
        try:
            return compression.decode(
                raw,
                encoding=spec.encoding,
                scale=1.0,
                nnz=0,
                shape=tuple(spec.shape),
                dtype=spec.dtype,
            )
        except ValueError as exc:
            raise WireError(f"{spec.key}: {exc}") from None
