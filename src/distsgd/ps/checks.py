"""The checks of a request's fields that need no server state beyond the shard: a stream's
first message, a Register's and a Push's pieces, ``lr_scale``, ``wait_seconds``, and the
assembling and decoding of a push's payload. Each refuses with INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED, ``Refusal.TOO_LARGE``) through :func:`~distsgd.ps.service_errors.abort`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from distsgd.ps import compression
from distsgd.ps import pull_encoding as pull_encoding_module
from distsgd.ps.rules import MAX_LR_SCALE
from distsgd.ps.sequence import MAX_SEQUENCE
from distsgd.ps.service_errors import abort, clip
from distsgd.ps.shard import Shard
from distsgd.transport.codec import (
    FLOAT_DTYPES,
    ChunkAssembler,
    TooLarge,
    WireError,
    dtype_name,
    is_encoded,
    nbytes_of,
)
from distsgd.transport.errors import MAX_WAIT_SECONDS, Refusal
from distsgd.transport.proto import distsgd_pb2 as pb

MAX_MESSAGE_BYTES = 4 << 30
"""Largest total tensor payload one Register or Push may announce (4 GiB)."""
PARAM_DTYPES = FLOAT_DTYPES
"""Dtypes a registered piece may have: parameters are floating point (float16/32/64)."""
MAX_KEY_CHARS = 1024
"""Longest piece key."""
MAX_PULL_KEYS = 1 << 16
"""Most keys one pull may name."""


def push_nbytes(spec: pb.TensorSpec) -> int:
    """The bytes a pushed piece's spec announces, encoded or raw; WireError if it cannot say."""
    if not is_encoded(spec):
        return nbytes_of(spec)
    count = nbytes_of(pb.TensorSpec(key=spec.key, dtype="uint8", shape=spec.shape))
    try:
        encoding = compression.Encoding(spec.encoding)
        return compression.wire_nbytes(encoding, spec.dtype, count, spec.nnz)
    except ValueError as exc:
        raise WireError(f"{clip(spec.key)}: {exc}") from None


def first_header(messages: Iterator[Any], context: grpc.ServicerContext) -> Any:
    try:
        first = next(messages)
    except StopIteration:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty stream; send a header first")
    if first.WhichOneof("part") != "header":
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "stream must start with a header")
    return first.header


def check_register_specs(specs: Iterable[pb.TensorSpec], context: grpc.ServicerContext) -> None:
    """Every piece of a Register: a key of sane length, a floating-point dtype."""
    for spec in specs:
        if is_encoded(spec):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{clip(spec.key)}: Register carries raw values only (encoding "
                f"{spec.encoding}, nnz {spec.nnz}); compress pushes, not initial values",
            )
        if not 0 < len(spec.key) <= MAX_KEY_CHARS:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"piece key {clip(spec.key)!r} has {len(spec.key)} characters; "
                f"use 1 to {MAX_KEY_CHARS}",
            )
        if spec.dtype not in PARAM_DTYPES:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{clip(spec.key)}: dtype {clip(spec.dtype)!r} is not a parameter dtype; "
                f"register only floating-point tensors ({', '.join(sorted(PARAM_DTYPES))})",
            )


def check_push_specs(
    shard: Shard, specs: Iterable[pb.TensorSpec], context: grpc.ServicerContext
) -> None:
    """Every piece of a Push is registered, with its registered dtype and shape (a piece that
    moved away passes: the shard refuses the push MOVED, see :mod:`distsgd.ps.moves`)."""
    for spec in specs:
        have = shard.values.get(spec.key)
        if have is None and spec.key in shard.move_book.moved:
            continue
        if have is None:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{clip(spec.key)}: no such parameter on shard {shard.index}",
            )
        if spec.dtype != dtype_name(have.dtype) or tuple(spec.shape) != have.shape:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{clip(spec.key)}: pushed {clip(spec.dtype, 16)}{list(spec.shape)[:8]}, "
                f"registered {have.dtype.name}{list(have.shape)}",
            )


def lr_scale(value: float, context: grpc.ServicerContext) -> float:
    """``PushHeader.lr_scale``: 0 means 1.0; else finite in (0, MAX_LR_SCALE]."""
    if value == 0:
        return 1.0
    if not 0 < value <= MAX_LR_SCALE:  # NaN fails too
        abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"lr_scale {value!r} is outside (0, {MAX_LR_SCALE:g}]; send the schedule's "
            "factor (0 means 1.0)",
        )
    return value


def push_sequence(value: int, context: grpc.ServicerContext) -> int:
    """``PushHeader.sequence``: 0 (none) .. MAX_SEQUENCE (a signed 64-bit number)."""
    if value > MAX_SEQUENCE:
        abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sequence {value} is above {MAX_SEQUENCE}; number pushes from the local step",
        )
    return value


def wait_seconds(value: float, context: grpc.ServicerContext) -> float:
    """``PullRequest.wait_seconds``: >= 0 (NaN refused), capped at MAX_WAIT_SECONDS."""
    if math.isnan(value) or value < 0:
        abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"wait_seconds {value!r} must be 0 or more; the server waits at most "
            f"{MAX_WAIT_SECONDS:g}s",
        )
    return min(value, MAX_WAIT_SECONDS)


def pull_keys(keys: Sequence[str], context: grpc.ServicerContext) -> list[str] | None:
    """``PullRequest.keys``: None for every piece; else distinct keys of 1 to MAX_KEY_CHARS
    characters, at most MAX_PULL_KEYS of them."""
    if not keys:
        return None
    if len(keys) > MAX_PULL_KEYS:
        abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a pull names {len(keys)} keys; at most {MAX_PULL_KEYS}, or none for every piece",
        )
    if any(not 0 < len(k) <= MAX_KEY_CHARS for k in keys):
        abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a pulled key of bad length; use 1 to {MAX_KEY_CHARS} characters",
        )
    if len(set(keys)) != len(keys):
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a pull names a key twice; name it once")
    return list(keys)


def pull_encoding(value: int, context: grpc.ServicerContext) -> compression.Encoding:
    """``PullRequest.encoding``: RAW, FP16 or BF16."""
    try:
        return pull_encoding_module.check_requested(value)
    except ValueError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; ask RAW, FP16 or BF16")


def decode(
    specs: Iterable[pb.TensorSpec],
    payload: dict[str, np.ndarray],
    context: grpc.ServicerContext,
) -> dict[str, np.ndarray]:
    """The encoded pieces of a push decoded to their registered dtype and shape (checked
    before); raw pieces as they are. INVALID_ARGUMENT naming the piece if one does not
    decode."""
    for spec in specs:
        if not is_encoded(spec):
            continue
        try:
            payload[spec.key] = compression.decode(
                payload[spec.key],
                encoding=spec.encoding,
                scale=spec.scale,
                nnz=spec.nnz,
                shape=tuple(spec.shape),
                dtype=spec.dtype,
            )
        except ValueError as exc:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                clip(f"{spec.key}: {exc}", 400),
            )
    return payload


def assemble(
    specs: Iterable[pb.TensorSpec],
    messages: Iterator[Any],
    context: grpc.ServicerContext,
    nbytes: Callable[[pb.TensorSpec], int] = nbytes_of,
) -> dict[str, np.ndarray]:
    try:
        assembler = ChunkAssembler(list(specs), max_bytes=MAX_MESSAGE_BYTES, nbytes=nbytes)
        for message in messages:
            if message.WhichOneof("part") != "chunk":
                raise WireError("a second header in one stream")
            assembler.add(message.chunk)
        return assembler.finish()
    except TooLarge as exc:
        abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), Refusal.TOO_LARGE)
    except WireError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), 400))
