"""Pulls and pushes of some parameters only (PullRequest.keys; Streaming DiLoCo's fragments),
in-process over 127.0.0.1 (port 0)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from test_ps_service import HOGWILD, _arrays, _client, _register, server, two_servers

from distsgd.ps import ParameterClient, PartitionPlan
from distsgd.ps.checks import MAX_KEY_CHARS
from distsgd.transport import RemoteError

__all__ = ["server", "two_servers"]  # the fixtures, used by name


def test_a_pull_of_some_keys_answers_those_the_shard_holds(server) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        _register(client)
        version, values = client.pull(keys=["b#0"])
        assert version == 0 and list(values) == ["b#0"]
        np.testing.assert_array_equal(values["b#0"], _arrays()["b#0"])
        _, values = client.pull(keys=["step#0", "moved-away#0"])
        assert list(values) == ["step#0"]
        assert client.last_pull_nbytes == 8


@pytest.mark.parametrize(
    ("keys", "said"),
    [(["b#0", "b#0"], "twice"), (["x" * (MAX_KEY_CHARS + 1)], "bad length")],
)
def test_a_pull_of_bad_keys_is_invalid_argument(server, keys: list[str], said: str) -> None:
    address, _ = server
    with _client(address, worker=0) as client:
        _register(client)
        with pytest.raises(RemoteError) as raised:
            client.pull(keys=keys)
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert said in raised.value.message


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "embedding": rng.standard_normal((300, 8)).astype(np.float32),
        "fc.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "fc.bias": rng.standard_normal(4).astype(np.float32),
    }


@pytest.mark.parametrize("placement", ["round-robin", "balanced"])
def test_the_parameter_client_moves_only_the_parameters_named(two_servers, placement) -> None:
    arrays = _model()
    plan = PartitionPlan.from_arrays(arrays, 2, placement=placement)
    addresses = [address for address, _ in two_servers]
    client = ParameterClient(addresses, plan, worker=0, timeout=10.0, retry_seconds=5.0)
    try:
        client.register(arrays, scheme="hogwild", options=HOGWILD, num_workers=1)
        client.wait_registered(5.0)
        for names in (["fc.bias"], ["embedding"], ["fc.weight", "fc.bias"]):
            holders = {p.shard for p in plan.some(names)}
            before = client.bytes_received
            _, pulled = client.pull(names=names)
            assert sorted(pulled) == sorted(names)
            for name in names:
                np.testing.assert_array_equal(pulled[name], arrays[name])
            expected = sum(p.nbytes for p in plan.some(names))
            assert client.bytes_received - before == expected
            versions = [service.shard.version for _, service in two_servers]
            results = client.push({name: np.ones_like(arrays[name]) for name in names})
            assert [r.sent for r in results] == [i in holders for i in range(2)]
            for name in names:
                arrays[name] = arrays[name] - 0.5
            after = [service.shard.version for _, service in two_servers]
            assert [a - b for a, b in zip(after, versions, strict=True)] == [
                int(i in holders) for i in range(2)
            ]
        _, pulled = client.pull()
        for name, value in arrays.items():
            np.testing.assert_allclose(pulled[name], value, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="no parameter named 'nope'"):
            client.pull(names=["nope"])
    finally:
        client.close()


def test_a_partial_pull_keeps_the_versions_of_the_shards_not_asked(two_servers) -> None:
    arrays = _model()
    plan = PartitionPlan.from_arrays(arrays, 2, placement="round-robin")
    owner = {p.param.name: p.shard for p in plan.pieces}
    addresses = [address for address, _ in two_servers]
    client = ParameterClient(addresses, plan, worker=0, timeout=10.0, retry_seconds=5.0)
    try:
        client.register(arrays, scheme="hogwild", options=HOGWILD, num_workers=1)
        client.wait_registered(5.0)
        client.push({name: np.ones_like(v) for name, v in arrays.items()})
        client.push({"fc.weight": np.ones_like(arrays["fc.weight"])})
        version, _ = client.pull(names=["fc.weight"])
        asked = owner["fc.weight"]
        assert version == 2
        assert client.versions[asked] == 2 and client.versions[1 - asked] == 0
    finally:
        client.close()
