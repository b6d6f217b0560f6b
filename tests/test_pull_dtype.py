"""Encoded pulls (``--pull-dtype``): the server sends float pieces in bf16 or fp16
over the gRPC stream and a tensor socket, the client decodes them; shared memory stays RAW; the
bytes halve; what a server answers is checked, and a request it cannot serve is refused. In
process (servers on port 0), no training run."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from distsgd import schemes
from distsgd.control.config import TrainConfig
from distsgd.ps import ParameterClient, PartitionPlan, compression
from distsgd.ps.compression import Encoding
from distsgd.ps.pull_encoding import PULL_DTYPES, PullDecoder, encode_pull, pull_encoding_for
from distsgd.ps.service import ParameterService
from distsgd.transport import PROTOCOL_VERSION, ShardClient
from distsgd.transport.codec import WireError
from distsgd.transport.proto import distsgd_pb2 as pb

SHAPES = {"fc.weight": (64, 48), "fc.bias": (64,)}


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture
def server(ps_server: tuple[str, ParameterService]) -> tuple[str, ParameterService]:
    return ps_server


def _rounded(values: np.ndarray, encoding: Encoding) -> np.ndarray:
    piece = compression.encode(values, encoding)
    return compression.decode(
        piece.tobytes(), encoding=piece.encoding, scale=1.0, nnz=0, shape=values.shape,
        dtype=values.dtype,
    )  # fmt: skip


# -- the pure parts -----------------------------------------------------------------------------
def test_the_flag_has_one_check_that_the_config_uses() -> None:
    for name in PULL_DTYPES:
        assert TrainConfig(pull_dtype=name).pull_dtype == name
    for bad in ("int8", "float16", ""):
        with pytest.raises(ValueError, match=f"unknown pull dtype {bad!r} \\(--pull-dtype\\)"):
            TrainConfig(pull_dtype=bad)
    assert pull_encoding_for("bf16") is Encoding.BF16


def test_the_server_encodes_float_pieces_and_keeps_what_it_cannot_carry() -> None:
    values = {
        "a": np.linspace(-3, 3, 100, dtype=np.float32),
        "big": np.full(10, 1e6, np.float32),  # beyond fp16's range: travels RAW
        "d": np.arange(5, dtype=np.float64),
    }
    specs, arrays = encode_pull(values, Encoding.FP16)
    assert [s.encoding for s in specs] == [
        pb.TENSOR_ENCODING_FP16,
        pb.TENSOR_ENCODING_RAW,
        pb.TENSOR_ENCODING_FP16,
    ]
    assert [a.nbytes for a in arrays] == [200, 40, 10]
    assert [(s.dtype, list(s.shape)) for s in specs] == [
        ("float32", [100]),
        ("float32", [10]),
        ("float64", [5]),
    ]
    specs, arrays = encode_pull(values, Encoding.RAW)
    assert all(s.encoding == pb.TENSOR_ENCODING_RAW for s in specs)
    assert all(a is values[s.key] for s, a in zip(specs, arrays, strict=True))


def test_the_decoder_takes_only_what_it_asked() -> None:
    decoder = PullDecoder(Encoding.BF16)
    spec = pb.TensorSpec(key="w", dtype="float32", shape=[3, 4], encoding="TENSOR_ENCODING_BF16")
    assert decoder.nbytes(spec) == 24
    raw = pb.TensorSpec(key="w", dtype="float32", shape=[3, 4])
    assert decoder.nbytes(raw) == 48
    fp16 = pb.TensorSpec(key="w", dtype="float32", shape=[3], encoding="TENSOR_ENCODING_FP16")
    with pytest.raises(WireError, match="w: the server answered encoding 1"):
        decoder.nbytes(fp16)
    sparse = pb.TensorSpec(
        key="w", dtype="float32", shape=[8], encoding="TENSOR_ENCODING_BF16", nnz=2
    )
    with pytest.raises(WireError, match="nnz 2"):
        decoder.nbytes(sparse)
    with pytest.raises(WireError, match="w: payload has 10 bytes, expected 24"):
        decoder.decode(spec, np.zeros(10, np.uint8))
    values = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    piece = compression.encode(values, Encoding.BF16)
    got = decoder.decode(spec, np.frombuffer(piece.tobytes(), np.uint8))
    assert got.shape == (3, 4) and got.dtype == np.float32
    np.testing.assert_allclose(got, values, rtol=2.0**-8)


@pytest.mark.parametrize("name", schemes.names())
def test_schemes_without_servers_refuse_the_flag(name: str) -> None:
    spec = schemes.get(name)
    worker = spec.make_worker(spec.options(), 2)
    config = TrainConfig(pull_dtype="bf16")
    if worker.uses_parameter_servers:
        worker.check_config(config)
    else:
        with pytest.raises(ValueError, match=f"--pull-dtype bf16 under {name}: it has no"):
            worker.check_config(config)


# -- against a server ---------------------------------------------------------------------------
@pytest.mark.parametrize("pull_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("carrier", ["stream", "socket", "shm"])
def test_a_pull_arrives_rounded_and_at_half_the_bytes(server, carrier, pull_dtype) -> None:
    address, _ = server
    model = _model()
    client = ParameterClient(
        [address],
        PartitionPlan.from_arrays(model, 1),
        worker=0,
        timeout=10.0,
        shared_memory=carrier == "shm",
        tensor_socket=carrier == "socket",
        pull_dtype=pull_dtype,
    )
    try:
        client.register(model, scheme="hogwild", options={"lr": 0.5}, num_workers=1)
        for _ in range(3):  # the socket and segment are attached at the first call
            client.pull()
            grads = {k: np.ones_like(v) for k, v in model.items()}
            assert all(r.accepted for r in client.push(grads))
        before = client.bytes_received
        _, values = client.pull()
        moved = client.bytes_received - before
        assert client.tensor_socket_shards == (carrier == "socket")
        assert client.shared_memory_shards == (carrier == "shm")
    finally:
        client.close()
    step = np.float32(0.5)
    exact = {k: v - step - step - step for k, v in model.items()}  # three float32 updates
    full = sum(v.nbytes for v in model.values())
    if carrier == "shm":  # memory is not a link: RAW whatever was asked
        assert moved == full
        for key, value in exact.items():
            np.testing.assert_array_equal(values[key], value)
        return
    assert moved == full // 2
    for key, value in exact.items():
        assert values[key].dtype == np.float32 and values[key].shape == value.shape
        np.testing.assert_array_equal(values[key], _rounded(value, pull_encoding_for(pull_dtype)))


def test_the_servers_own_values_stay_exact(server) -> None:
    """Rounding is the pull's, never the model's: a RAW pull after encoded ones is exact."""
    address, _ = server
    model = _model()
    plan = PartitionPlan.from_arrays(model, 1)
    bf16 = ParameterClient([address], plan, worker=0, timeout=10.0, pull_dtype="bf16")
    raw = ParameterClient([address], plan, worker=1, timeout=10.0)
    try:
        bf16.register(model, scheme="hogwild", options={"lr": 1e-3}, num_workers=2)
        for _ in range(3):
            bf16.pull()
            bf16.push({k: np.full_like(v, 1.0) for k, v in model.items()})
        _, values = raw.pull()
    finally:
        bf16.close()
        raw.close()
    for key, value in model.items():
        np.testing.assert_allclose(values[key], value - 3e-3, rtol=0, atol=1e-6)


@pytest.mark.parametrize("encoding", ["TENSOR_ENCODING_INT8", 7])
def test_a_pull_in_an_encoding_it_cannot_serve_is_refused(server, encoding) -> None:
    address, _ = server
    model = _model()
    with ShardClient(address, worker=0, timeout=10.0) as shard:
        shard.register(
            shard_index=0,
            scheme="hogwild",
            options_json='{"lr": 0.1}',
            num_workers=1,
            tensors={f"{k}#0": v for k, v in model.items()},
        )
        request = pb.PullRequest(
            header=pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0),
            encoding=encoding,
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(shard.link.stub.Pull(request, timeout=10.0))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not RAW, FP16 or BF16" in caught.value.details()
