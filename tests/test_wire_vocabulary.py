"""The wire vocabulary (``ps/wire.py``): one table of encodings that every other place reads
(issue 39, "one wire vocabulary")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distsgd.ps import compression, pull_encoding, wire
from distsgd.transport.proto import distsgd_pb2 as pb

SRC = Path(__file__).resolve().parents[1] / "src" / "distsgd"


def test_the_table_is_the_protos_enum() -> None:
    proto = {name: number for name, number in pb.TensorEncoding.items()}
    assert {f"TENSOR_ENCODING_{e.name}": e.value for e in wire.Encoding} == proto
    assert sorted(e.encoding for e in wire.TABLE) == sorted(wire.Encoding)


def test_every_use_reads_the_table() -> None:
    assert {e.name: e.encoding for e in wire.TABLE if e.push} == compression.ENCODINGS
    assert {e.name: e.encoding for e in wire.TABLE if e.pull} == pull_encoding.PULL_ENCODINGS
    assert compression.LOW_BITS == {wire.Encoding.INT4: 4, wire.Encoding.INT2: 2}
    for entry in wire.TABLE:  # bytes a value: its bits, and a low-bit code's share of a scale
        share = 4 / 128 if entry.bits < 8 else 0.0
        assert compression.value_bytes(entry.encoding, "float32") == entry.bits / 8 + share
    with pytest.raises(ValueError, match="unknown wire dtype 'int3'"):
        compression.encoding_for("int3")
    with pytest.raises(KeyError):
        wire.named("int3")


def test_no_encoding_is_named_outside_the_table() -> None:
    """The issue's check: the encodings' names as strings appear in the table's module only."""
    named = re.compile(r'"(int8|int4|int2|bf16|fp16)"')
    found = [
        f"{path.relative_to(SRC)}:{n}"
        for path in sorted(SRC.rglob("*.py"))
        if not path.name.endswith("_pb2.py") and path.name != "wire.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if named.search(line)
    ]
    assert found == []
