"""Compressed pushes end to end: a worker's ParameterClient encodes, the server decodes and
applies in float32, over the stream and over shared memory alike; the bytes fall as promised;
malformed encodings are refused whole."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from distsgd.ps import ParameterClient, PartitionPlan, compression
from distsgd.ps.service import ParameterService
from distsgd.transport import PROTOCOL_VERSION, ShardClient
from distsgd.transport.proto import distsgd_pb2 as pb

MODEL_SHAPES = {"fc.weight": (50, 40), "fc.bias": (50,)}


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in MODEL_SHAPES.items()}


@pytest.fixture
def server(ps_server: tuple[str, ParameterService]) -> tuple[str, ParameterService]:
    return ps_server


def test_the_proto_enum_mirrors_the_encodings() -> None:
    for encoding in compression.Encoding:
        assert pb.TensorEncoding.Value(f"TENSOR_ENCODING_{encoding.name}") == encoding.value
    assert len(pb.TensorEncoding.keys()) == len(compression.Encoding)


@pytest.mark.parametrize("shared", [False, True], ids=["stream", "shm"])
@pytest.mark.parametrize(
    ("wire_dtype", "topk"), [("bf16", 0.0), ("fp16", 0.0), ("int8", 0.0), ("float32", 0.05)]
)
def test_the_server_applies_what_the_encoding_carries(server, shared, wire_dtype, topk) -> None:
    """Server values after one push (Hogwild, lr 1) = initial - decode(encode(gradient)),
    exactly; bytes sent are those of the encoding."""
    address, _ = server
    model = _model()
    client = ParameterClient(
        [address],
        PartitionPlan.from_arrays(model, 1),
        worker=0,
        timeout=10.0,
        shared_memory=shared,
        wire_dtype=wire_dtype,
        topk=topk,
    )
    try:
        client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
        client.pull()
        rng = np.random.default_rng(1)
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()}
        (result,) = client.push(grads)
        assert result.accepted
        _, values = client.pull()
        encoding = compression.encoding_for(wire_dtype)
        expected_bytes = 0
        for name, grad in grads.items():
            key = f"{name}#0"
            sent = compression.encode(grad.reshape(grad.shape), encoding, topk)
            expected_bytes += sent.nbytes
            carried = compression.decode(
                sent.tobytes(),
                encoding=sent.encoding,
                scale=sent.scale,
                nnz=sent.nnz,
                shape=grad.shape,
                dtype=grad.dtype,
            )
            np.testing.assert_array_equal(values[name], model[name] - carried, err_msg=key)
        assert client.bytes_sent == expected_bytes
        raw = sum(g.nbytes for g in grads.values())
        want = {"bf16": 2, "fp16": 2, "int8": 4}.get(wire_dtype)
        if want is not None:
            assert raw == want * client.bytes_sent
        else:
            assert client.bytes_sent * 9 < raw  # top-k 5%, 8 bytes an entry: about 10x fewer
        assert client.shared_memory_shards == (1 if shared else 0)
    finally:
        client.close()


def test_topk_error_feedback_delivers_everything_eventually(server) -> None:
    """Pushing the same gradient T times with top-k: the server has received T * gradient
    minus what is still held back on the worker (the residual)."""
    address, _ = server
    model = {"w": np.zeros(1000, np.float32)}
    client = ParameterClient(
        [address], PartitionPlan.from_arrays(model, 1), worker=0, timeout=10.0, topk=0.01
    )
    try:
        client.register(model, scheme="hogwild", options={"lr": 1.0}, num_workers=1)
        grad = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
        for _ in range(30):
            client.push({"w": grad})
        _, values = client.pull()
        assert client.feedback is not None
        residual = client.feedback.residual("w#0")
        assert residual is not None
        np.testing.assert_allclose(-values["w"] + residual, 30 * grad, rtol=1e-4, atol=1e-4)
    finally:
        client.close()


def _push(address: str, spec: pb.TensorSpec, data: bytes) -> grpc.StatusCode:
    with ShardClient(address, worker=0, timeout=5.0) as client:
        header = pb.PushHeader(
            header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
            tensors=[spec],
            lr_scale=1.0,
        )
        messages = [
            pb.PushRequest(header=header),
            pb.PushRequest(chunk=pb.TensorChunk(index=0, offset=0, data=data)),
        ]
        try:
            client.link.stub.Push(iter(messages), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("fields", "nbytes"),
    [
        ({"encoding": 9}, 8),  # an encoding nobody knows
        ({"encoding": 3, "scale": float("nan")}, 4),
        ({"encoding": 3, "scale": -1.0}, 4),
        ({"encoding": 2, "scale": 0.0}, 8),  # bf16 must say scale 1
        ({"encoding": 2, "scale": 1.0}, 6),  # wrong byte count
        ({"encoding": 0, "scale": 1.0, "nnz": 5}, 40),  # nnz above the 4 elements
    ],
)
def test_a_malformed_encoding_is_refused_and_changes_nothing(server, fields, nbytes) -> None:
    address, _ = server
    with ShardClient(address, worker=0, timeout=5.0) as client:
        client.register(
            shard_index=0,
            scheme="hogwild",
            options_json=json.dumps({"lr": 1.0}),
            num_workers=1,
            tensors={"w#0": np.ones(4, np.float32)},
        )
        spec = pb.TensorSpec(key="w#0", dtype="float32", shape=[4], **fields)
        assert _push(address, spec, b"\x01" * nbytes) == grpc.StatusCode.INVALID_ARGUMENT
        version, values = client.pull()
        assert version == 0 and np.array_equal(values["w#0"], np.ones(4, np.float32))


def test_register_with_an_encoding_is_refused(server) -> None:
    address, _ = server
    with ShardClient(address, worker=0, timeout=5.0, retry_seconds=0.0) as client:
        header = pb.RegisterHeader(
            header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
            scheme="hogwild",
            options_json=json.dumps({"lr": 1.0}),
            num_workers=1,
            tensors=[pb.TensorSpec(key="w#0", dtype="float32", shape=[4], encoding=2)],
        )
        with pytest.raises(grpc.RpcError) as info:
            client.link.stub.Register(iter([pb.RegisterRequest(header=header)]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not client.info().registered


@pytest.mark.slow
@pytest.mark.xdist_group("demo-runs")
def test_the_demo_with_compressed_pushes_keeps_its_accuracy_and_cuts_bytes(tmp_path) -> None:
    """The demo (sync, 2 workers, 10 epochs: a third of the CPU of 4 workers and 20 epochs;
    measured 3 times here on a loaded machine, each time float32 0.9750, int8 0.9806, top-k
    0.9750): int8 quarters the bytes pushed, top-k 0.01 cuts them 20x or more; each stays near
    float32's accuracy and above 0.95 (bf16, which halves them, goes the same way as int8
    through the run: the server's decoding of each is checked by
    test_the_server_applies_what_the_encoding_carries, and a third run here cost 8 CPU-seconds
    of the suite's 12 minutes). Measured at 30 epochs on 4 workers (docs/compression.md):
    float32 0.9806, bf16 0.9861, int8 0.9722, top-k 0.9722. The bar
    here is 0.03, not the guide's 0.01, because two float32 runs of the same demo differ by up to
    0.014 on an idle machine (the order in which pushes reach the server changes float sums) and
    by more under the suite's load: one CI run measured int8 0.9583 against float32 0.9833, with
    0.9778 and 0.9806 against 0.9833 and 0.9722 idle (2026-12-07)."""
    from conftest import final_accuracy, run_distsgd

    def run(name: str, *flags: str) -> tuple[float, int]:
        out = tmp_path / name
        done = run_distsgd(
            [
                *("demo", "--scheme", "sync", "--workers", "2", "--epochs", "10", "--quiet"),
                *("--run-dir", str(out), *flags),
            ]
        )
        accuracy = final_accuracy(done)
        return accuracy, json.loads((out / "result.json").read_text())["bytes_sent"]

    base, base_bytes = run("float32")
    for name, flags, ratio in [
        ("int8", ["--wire-dtype", "int8"], 4),
        ("topk", ["--topk", "0.01"], 20),
    ]:
        accuracy, sent = run(name, *flags)
        assert accuracy >= 0.95 and accuracy >= base - 0.03, (name, accuracy, base)
        if name == "topk":
            assert sent * ratio <= base_bytes, (name, sent, base_bytes)
        else:
            assert sent * ratio == base_bytes, (name, sent, base_bytes)


@pytest.mark.parametrize("scheme", ["localsgd"])
@pytest.mark.parametrize("flags", [["--wire-dtype", "bf16"], ["--topk", "0.1"]])
def test_schemes_that_average_uncompressed_refuse_compression(
    scheme, flags, tmp_path, capsys
) -> None:
    """A flag that would do nothing is refused before any task starts: one line, exit 2 (the
    CLI's main, in this process: a refused command starts no process)."""
    from distsgd.cli.main import main

    run_dir = tmp_path / "r"
    assert main(["demo", "--scheme", scheme, "--run-dir", str(run_dir), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"under {scheme}" in lines[0] and "drop the flag" in lines[0]
    assert not run_dir.exists()
