"""Schemes of the wider catalogue against plain single-process references (DynSGD)."""

from __future__ import annotations

from test_scheme_rules import (
    _assert_close,
    _grads,
    _problem,
    _push,
    _reference_sgd,
    _run_workers,
    _server_params,
    _shard,
    _w0,
    ps_server,  # noqa: F401 - fixture
)

from distsgd import schemes
from distsgd.runtime.config import TrainConfig


def test_dynsgd_scales_each_gradient_by_one_over_staleness_plus_one() -> None:
    shard = _shard("dynsgd", {"lr": 1.0}, 3)
    expected = _w0()
    grads = _grads(3)
    # Three pushes all computed on version 0: staleness 0, 1, 2 as they arrive.
    for i, g in enumerate(grads):
        outcome, version = _push(shard, g, worker=i, base=0)
        assert outcome.accepted and version == i + 1
        expected = {k: expected[k] - g[k] / (i + 1) for k in expected}
    _assert_close(shard.values, expected)


def test_dynsgd_one_worker_equals_plain_sgd(ps_server) -> None:  # noqa: F811
    address, _ = ps_server
    model, data = _problem()
    config = TrainConfig(batch_size=4, steps=6, lr=0.1, log_every=1)
    spec = schemes.get("dynsgd")
    _run_workers(
        address=address,
        scheme_name="dynsgd",
        make_scheme=lambda rank: spec.worker(spec.options(), 1),
        model=model,
        data=data,
        config=config,
        world=1,
    )
    version, server = _server_params(address, model)
    assert version == config.steps
    _assert_close(server, _reference_sgd(model, data, world=1, config=config))
