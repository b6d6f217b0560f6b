"""Each scheme's server rule and worker math against a plain single-process reference.

Server rules are driven directly on a :class:`distsgd.ps.Shard`; worker halves run against an
in-process parameter server on 127.0.0.1 (port 0) with the real runtime.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distsgd import schemes
from distsgd.ps import (
    ACCEPTED,
    ParameterClient,
    PartitionPlan,
    PushMeta,
    ServerOptions,
    Shard,
    UpdateRule,
    bounded,
    start_server,
)
from distsgd.ps.rules import MAX_OPTIONS_BYTES, parse_options_json
from distsgd.runtime import TaskEnv, TrainConfig, WorkerContext, run_worker
from distsgd.runtime.data import ShardedBatches
from distsgd.runtime.modules import exchanged_parameters
from distsgd.schemes import make_server_rule
from distsgd.schemes.downpour import DownpourOptions
from distsgd.schemes.easgd import EasgdOptions, ElasticServer
from distsgd.schemes.sync import SyncOptions
from distsgd.transport import PushReject
from distsgd.workers.downpour import DownpourWorker
from distsgd.workers.easgd import EasgdWorker
from distsgd.workers.sync import SyncWorker

ATOL = 1e-5

RATE_AS_GIVEN = "none"
"""The references replay each scheme's math at the rate its workers apply; ``--lr-rule`` (the
scheme's default factor on N workers, tests/test_defaults.py) is off so that rate is ``lr``."""


# --------------------------------------------------------------------------- helpers


def _w0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w#0": rng.standard_normal((3, 4)).astype(np.float32),
        "b#0": rng.standard_normal(3).astype(np.float32),
    }


def _grads(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w#0": rng.standard_normal((3, 4)).astype(np.float32),
            "b#0": rng.standard_normal(3).astype(np.float32),
        }
        for _ in range(n)
    ]


def _shard(scheme: str, options: dict[str, Any], num_workers: int, values=None) -> Shard:
    return Shard(
        index=0,
        scheme=scheme,
        options_json=json.dumps(options),
        num_workers=num_workers,
        values=_w0() if values is None else values,
        rule=make_server_rule(scheme, options, num_workers),
    )


def _push(shard: Shard, grad: dict[str, np.ndarray], worker: int, base: int):
    payload = {k: v.copy() for k, v in grad.items()}
    return shard.push(payload, PushMeta(worker=worker, incarnation=0, base_version=base))


def _assert_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(actual) == set(expected)
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], rtol=0, atol=ATOL, err_msg=key)


def _mean(grads: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.mean([g[k] for g in grads], axis=0) for k in grads[0]}


# --------------------------------------------------------------------------- sync: server rule


def _sync(n: int, required: int | None = None, lr: float = 0.1, momentum: float = 0.0) -> Shard:
    options = {"lr": lr, "momentum": momentum, "required": n if required is None else required}
    return _shard("sync", options, n)


def test_sync_step_closes_after_n_pushes_with_mean_gradient() -> None:
    n, lr = 3, 0.1
    shard = _sync(n, lr=lr)
    grads = _grads(n)
    for i, g in enumerate(grads):
        outcome, version = _push(shard, g, worker=i, base=0)
        assert outcome.accepted, outcome.reason
        assert version == (1 if i == n - 1 else 0)
        if i < n - 1:
            _assert_close(shard.values, _w0())  # nothing applied before the step closes
    assert shard.version == 1
    mean = _mean(grads)
    _assert_close(shard.values, {k: _w0()[k] - lr * mean[k] for k in mean})
    assert shard.pushes_accepted == n and shard.pushes_rejected == 0


def test_sync_rejects_stale_push() -> None:
    shard = _sync(2)
    g = _grads(3)
    _push(shard, g[0], worker=0, base=0)
    _push(shard, g[1], worker=1, base=0)
    before = {k: v.copy() for k, v in shard.values.items()}
    outcome, version = _push(shard, g[2], worker=0, base=0)  # step 0 is closed
    assert not outcome.accepted
    assert outcome.reason.startswith("stale")
    assert version == 1
    outcome, _ = _push(shard, g[2], worker=0, base=7)  # from the future: not this step either
    assert not outcome.accepted and outcome.reason.startswith("stale")
    _assert_close(shard.values, before)
    assert shard.pushes_rejected == 2


def test_sync_rejects_duplicate_worker() -> None:
    shard = _sync(2)
    g = _grads(3)
    assert _push(shard, g[0], worker=0, base=0)[0].accepted
    outcome, version = _push(shard, g[1], worker=0, base=0)
    assert not outcome.accepted and "duplicate" in outcome.reason
    assert version == 0
    assert _push(shard, g[2], worker=1, base=0)[0].accepted
    mean = _mean([g[0], g[2]])  # the duplicate was not counted
    _assert_close(shard.values, {k: _w0()[k] - 0.1 * mean[k] for k in mean})


def test_sync_backup_worker_closes_early_and_late_push_is_stale() -> None:
    n = 3
    shard = _sync(n, required=n - 1)
    g = _grads(n)
    assert _push(shard, g[2], worker=2, base=0) == (ACCEPTED, 0)
    assert _push(shard, g[0], worker=0, base=0) == (ACCEPTED, 1)
    mean = _mean([g[2], g[0]])
    expected = {k: _w0()[k] - 0.1 * mean[k] for k in mean}
    _assert_close(shard.values, expected)
    outcome, version = _push(shard, g[1], worker=1, base=0)  # the slowest worker, too late
    assert not outcome.accepted and outcome.reason.startswith("stale")
    assert version == 1
    _assert_close(shard.values, expected)
    # The next step starts clean: worker 0 may push again at version 1.
    assert _push(shard, g[1], worker=0, base=1)[0].accepted
    assert shard.version == 1


def test_sync_leave_lets_step_close_with_fewer() -> None:
    n = 3
    shard = _sync(n)
    g = _grads(n)
    _push(shard, g[0], worker=0, base=0)
    _push(shard, g[1], worker=1, base=0)
    assert shard.version == 0
    assert shard.leave(2) == 1  # worker 2 finished without pushing: close with two
    assert shard.active_workers == 2
    mean = _mean(g[:2])
    _assert_close(shard.values, {k: _w0()[k] - 0.1 * mean[k] for k in mean})
    # From now on a step closes with the two workers left.
    _push(shard, g[2], worker=0, base=1)
    assert shard.version == 1
    _push(shard, g[0], worker=1, base=1)
    assert shard.version == 2


def test_sync_leave_after_pushing_does_not_close_the_step_early() -> None:
    shard = _sync(2)
    g = _grads(2)
    assert _push(shard, g[0], worker=0, base=0)[0].accepted
    shard.leave(0)  # worker 0 is done after its last push; worker 1 is still on this step
    assert shard.version == 0
    outcome, version = _push(shard, g[1], worker=1, base=0)
    assert outcome.accepted, outcome.reason
    assert version == 1
    mean = _mean(g)
    _assert_close(shard.values, {k: _w0()[k] - 0.1 * mean[k] for k in mean})


def test_sync_server_momentum_matches_torch_sgd() -> None:
    n, lr, mu = 2, 0.05, 0.9
    shard = _sync(n, lr=lr, momentum=mu)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in _w0().items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=mu)
    grads = _grads(2 * 4)
    for step in range(4):
        pair = grads[2 * step : 2 * step + 2]
        for i, g in enumerate(pair):
            assert _push(shard, g, worker=i, base=step)[0].accepted
        for k, p in params.items():
            p.grad = torch.from_numpy(_mean(pair)[k])
        opt.step()
        assert shard.version == step + 1
    _assert_close(shard.values, {k: p.detach().numpy() for k, p in params.items()})


@pytest.mark.parametrize(
    ("options", "workers", "expected"),
    [
        ({}, 4, 4),
        ({"backup_workers": 1}, 4, 3),
        ({"replicas_to_aggregate": 2}, 4, 2),
        ({"replicas_to_aggregate": 3, "backup_workers": 1}, 4, 3),
        ({"replicas_to_aggregate": 1}, 1, 1),
    ],
)
def test_sync_options_required(options, workers, expected) -> None:
    assert SyncOptions(**options).required(workers) == expected


@pytest.mark.parametrize(
    ("options", "workers", "match"),
    [
        ({"backup_workers": 2}, 2, "backup_workers"),
        ({"backup_workers": 5}, 2, "backup_workers"),
        ({"backup_workers": 1}, 1, "backup_workers"),
        ({"replicas_to_aggregate": 3, "backup_workers": 2}, 4, "contradicts"),
        ({"replicas_to_aggregate": 5}, 4, "exceeds"),
    ],
)
def test_sync_options_required_refuses(options, workers, match) -> None:
    with pytest.raises(ValueError, match=match):
        SyncOptions(**options).required(workers)
    with pytest.raises(ValueError, match=match):
        SyncWorker(SyncOptions(**options), workers)


def test_sync_options_negative_and_unknown() -> None:
    with pytest.raises(ValueError):
        SyncOptions(backup_workers=-1)
    with pytest.raises(ValueError):
        SyncOptions(replicas_to_aggregate=-2)
    with pytest.raises(ValueError, match="no_such"):
        schemes.get("sync").parse_options({"no_such": 1})
    worker = SyncWorker(schemes.get("sync").parse_options({"backup_workers": 1}), 3)
    config = TrainConfig(lr=0.2, momentum=0.5)
    assert worker.server_options(config) == {
        "lr": 0.2,
        "momentum": 0.5,
        "required": 2,
        "step_timeout": 60.0,
        "adaptive_deadline": False,
    }


# --------------------------------------------------------------------------- server options


def test_every_server_half_is_its_rule_class() -> None:
    """One factory convention: SchemeSpec.server is the UpdateRule subclass itself, built as
    ``Rule(options, num_workers)`` (no lambdas, no wrapper functions)."""
    for name in schemes.names():
        spec = schemes.get(name)
        if spec.server is None:
            continue
        assert isinstance(spec.server, type) and issubclass(spec.server, UpdateRule), name
        worker = spec.make_worker(spec.parse_options({}), 2)
        options = json.loads(json.dumps(worker.server_options(TrainConfig())))
        rule = make_server_rule(name, options, 2)
        assert type(rule) is spec.server, name


def test_every_worker_half_is_named_by_path_and_subclasses_its_rules() -> None:
    """The catalogue names each worker half by import path (so that reading it loads no torch),
    and the class found there subclasses the scheme's rules: the launcher's checks and the
    worker's are one code."""
    for name in schemes.names():
        spec = schemes.get(name)
        assert (
            spec.worker
            == f"distsgd.workers.{name.replace('-', '_')}:{spec.worker_class().__name__}"
        )
        assert issubclass(spec.worker_class(), spec.rules), name
        assert spec.worker_class().uses_parameter_servers == spec.uses_parameter_servers, name


@dataclass(frozen=True, kw_only=True)
class _Opts(ServerOptions):
    rate: float = bounded(low=0.0, low_open=True, high=10.0)
    steps: int = bounded(3, low=1, high=100)
    flag: bool = False
    mode: str = "a"
    ignored: ClassVar[frozenset[str]] = frozenset({"legacy"})


def test_server_options_from_json_checks_type_finiteness_and_range() -> None:
    opts = _Opts.from_json({"rate": 2, "legacy": "dropped"})
    assert opts == _Opts(rate=2.0, steps=3) and isinstance(opts.rate, float)
    assert _Opts.from_json({"rate": 10.0, "steps": 100, "flag": True, "mode": "b"}).steps == 100
    bad = [
        ({}, "'rate' is missing"),
        ({"rate": 0.0}, "'rate' must be in (0, 10]"),
        ({"rate": 10.5}, "'rate' must be in (0, 10]"),
        ({"rate": float("nan")}, "'rate' must be a finite number"),
        ({"rate": float("inf")}, "'rate' must be a finite number"),
        ({"rate": 10**400}, "'rate' must be a finite number"),
        ({"rate": True}, "'rate' must be a number"),
        ({"rate": "1"}, "'rate' must be a number"),
        ({"rate": None}, "'rate' must be a number"),
        ({"rate": 1, "steps": 2.0}, "'steps' must be an integer"),
        ({"rate": 1, "steps": 0}, "'steps' must be in [1, 100]"),
        ({"rate": 1, "steps": False}, "'steps' must be an integer"),
        ({"rate": 1, "flag": 1}, "'flag' must be true or false"),
        ({"rate": 1, "mode": 3}, "'mode' must be a string"),
        ({"rate": 1, "speed": 3}, "unknown option 'speed'"),
    ]
    for mapping, needle in bad:
        with pytest.raises(ValueError) as err:
            _Opts.from_json(mapping)
        assert needle in str(err.value), (mapping, str(err.value))
        assert "\n" not in str(err.value)


def test_parse_options_json_limits() -> None:
    assert parse_options_json("") == {} and parse_options_json("  ") == {}
    assert parse_options_json('{"lr": 0.5, "s": "[[[[[[["}') == {"lr": 0.5, "s": "[[[[[[["}
    assert parse_options_json('{"a": [[[1]]]}') == {"a": [[[1]]]}  # depth 4 is the limit
    for text, needle in [
        ('{"a": [[[[1]]]]}', "nests deeper"),
        ("[" * 100_000 + "]" * 100_000, "bytes"),
        ('{"lr": NaN}', "NaN"),
        ('{"lr": -Infinity}', "Infinity"),
        ('{"lr": 1e309}', "overflows"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"x": "' + "a" * MAX_OPTIONS_BYTES + '"}', "over the limit"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            parse_options_json(text)


@pytest.mark.parametrize(
    ("scheme", "options", "needle"),
    [
        ("hogwild", {"lr": 0.1, "momentum": -0.1}, "momentum"),
        ("dynsgd", {"lr": 2e4}, "lr"),
        ("sync", {"lr": 0.1, "required": 5}, "required"),
        ("sagn", {"lr": 1.0, "required": 2, "step_timeout": -1.0}, "step_timeout"),
        ("downpour", {"server_lr": 0.0}, "server_lr"),
        ("agn", {}, "server_lr"),
        ("eamsgd", {"tau": 4}, "tau"),
    ],
)
def test_rules_refuse_bad_options_naming_them(scheme, options, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        make_server_rule(scheme, options, 2)


def test_elastic_rule_ignores_the_default_lr_and_momentum() -> None:
    rule = make_server_rule("easgd", {"lr": 0.1, "momentum": 0.9}, 2)
    assert isinstance(rule, ElasticServer)


def test_refusals_are_typed() -> None:
    shard = _sync(2)
    outcome, _ = _push(shard, _grads(1)[0], worker=0, base=5)
    assert outcome.reject is PushReject.STALE and outcome.reason.startswith("stale: ")
    assert _push(shard, _grads(1)[0], worker=0, base=0)[0] is ACCEPTED
    outcome, _ = _push(shard, _grads(1)[0], worker=0, base=0)
    assert outcome.reject is PushReject.DUPLICATE and outcome.reason.startswith("duplicate: ")
    nan = {k: np.full_like(v, np.nan) for k, v in _w0().items()}
    outcome, _ = _push(shard, nan, worker=1, base=0)
    assert outcome.reject is PushReject.NONFINITE and not outcome.accepted


# --------------------------------------------------------------------------- hogwild / downpour


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_hogwild_applies_each_push_like_torch_sgd(momentum: float) -> None:
    lr = 0.05
    shard = _shard("hogwild", {"lr": lr, "momentum": momentum}, 2)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in _w0().items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum)
    for i, g in enumerate(_grads(5)):
        # Applied at once, whatever worker and however stale the base version.
        outcome, version = _push(shard, g, worker=i % 2, base=0)
        assert outcome.accepted and version == i + 1
        for k, p in params.items():
            p.grad = torch.from_numpy(g[k].copy())
        opt.step()
        _assert_close(shard.values, {k: p.detach().numpy() for k, p in params.items()})


def test_hogwild_partial_push_touches_only_its_pieces() -> None:
    shard = _shard("hogwild", {"lr": 0.5}, 1)
    _push(shard, {"b#0": np.ones(3, np.float32)}, worker=0, base=0)
    _assert_close(shard.values, {"w#0": _w0()["w#0"], "b#0": _w0()["b#0"] - 0.5})


def test_downpour_applies_each_push_with_server_lr() -> None:
    server_lr = 0.5
    shard = _shard("downpour", {"server_lr": server_lr}, 2)
    expected = _w0()
    for i, delta in enumerate(_grads(4)):
        outcome, version = _push(shard, delta, worker=i % 2, base=0)
        assert outcome.accepted and version == i + 1
        expected = {k: expected[k] - server_lr * delta[k] for k in expected}
        _assert_close(shard.values, expected)


def test_downpour_options_validated() -> None:
    with pytest.raises(ValueError, match="window"):
        DownpourOptions(window=0)
    with pytest.raises(ValueError, match="server_lr"):
        DownpourOptions(server_lr=-0.5)


def test_downpour_server_lr_zero_means_one_over_workers() -> None:
    config = TrainConfig()
    worker = DownpourWorker(DownpourOptions(server_lr=0.0), 4)
    assert worker.server_options(config) == {"server_lr": 0.25}
    worker = DownpourWorker(DownpourOptions(server_lr=0.7), 4)
    assert worker.server_options(config) == {"server_lr": 0.7}


def test_downpour_default_server_lr_is_one_over_workers() -> None:
    worker = DownpourWorker(DownpourOptions(), 4)
    assert worker.server_options(TrainConfig())["server_lr"] == pytest.approx(0.25)


# --------------------------------------------------------------------------- easgd


def test_elastic_server_adds_pushed_diff() -> None:
    shard = _shard("easgd", {}, 2)
    assert isinstance(shard.rule, ElasticServer)
    expected = _w0()
    for i, diff in enumerate(_grads(3)):
        outcome, version = _push(shard, diff, worker=i % 2, base=0)
        assert outcome.accepted and version == i + 1
        expected = {k: expected[k] + diff[k] for k in expected}
        _assert_close(shard.values, expected)


def test_easgd_default_alpha_and_validation() -> None:
    assert EasgdWorker(EasgdOptions(), 3).alpha == pytest.approx(0.3)
    assert EasgdWorker(EasgdOptions(alpha=0.25), 3).alpha == 0.25
    with pytest.raises(ValueError):
        EasgdOptions(tau=0)
    with pytest.raises(ValueError):
        EasgdOptions(alpha=1.0)


@pytest.fixture
def ps_server():
    """One in-process parameter server; yields its address and service."""
    server, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        yield address, service
    finally:
        server.stop(grace=None).wait(timeout=5)


def test_easgd_elastic_exchange_math(ps_server) -> None:
    address, service = ps_server
    alpha = 0.3
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    center = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    plan = PartitionPlan.from_arrays(center, 1)
    client = ParameterClient([address], plan, worker=0, timeout=10.0, retry_seconds=5.0)
    try:
        client.register(center, scheme="easgd", options={}, num_workers=1)
        rng = np.random.default_rng(3)
        local = {
            k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in center.items()
        }
        ctx = WorkerContext(
            model=model,
            config=TrainConfig(lr=0.1, steps=1),
            rank=0,
            num_workers=1,
            device=torch.device("cpu"),
            ps=client,
        )
        ctx.load(local)
        worker = EasgdWorker(EasgdOptions(alpha=alpha, tau=1), 1)
        worker.elastic_exchange(ctx)

        diff = {k: alpha * (local[k] - center[k]) for k in local}
        _assert_close(ctx.arrays(), {k: local[k] - diff[k] for k in local})
        version, server_center = client.pull(record=False)
        assert version == 1
        _assert_close(server_center, {k: center[k] + diff[k] for k in center})
        assert service.shard is not None and service.shard.pushes_accepted == 1
    finally:
        client.close()


# --------------------------------------------------------------------------- end to end


def _problem() -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=gen)
    y = torch.randn(32, 3, generator=gen)
    return model, TensorDataset(x, y)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _reference_sgd(
    model: nn.Module, data: TensorDataset, *, world: int, config: TrainConfig
) -> dict[str, np.ndarray]:
    """Single-process SGD on the mean gradient of every worker's batch (the large batch)."""
    model = copy.deepcopy(model)
    trained = [p for p in model.parameters() if p.requires_grad]  # a frozen one stays
    opt = torch.optim.SGD(trained, lr=config.lr, momentum=config.momentum)
    iters = [
        iter(
            ShardedBatches(
                data, rank=r, world=world, batch_size=config.batch_size, seed=config.seed
            )
        )
        for r in range(world)
    ]
    for _ in range(config.steps):
        grads = []
        for it in iters:
            x, y = next(it)
            model.zero_grad()
            _loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in trained])
        for i, p in enumerate(trained):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _run_workers(
    *,
    address: str,
    scheme_name: str,
    make_scheme: Callable[[int], Any],
    model: nn.Module,
    data: TensorDataset,
    config: TrainConfig,
    world: int,
    loss_for: Callable[[int], Callable[..., torch.Tensor]] = lambda rank: _loss,
) -> list[nn.Module]:
    """``run_worker`` for every rank in its own thread; returns each worker's model."""
    models = [copy.deepcopy(model) for _ in range(world)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            env = TaskEnv(
                cluster={"ps": [address], "worker": ["127.0.0.1:0"] * world},
                task_index=rank,
                scheme=scheme_name,
                rpc_timeout=10,
                wait_timeout=30,
            )
            run_worker(
                model=models[rank],
                loss_fn=loss_for(rank),
                train_set=data,
                test_set=None,
                config=config,
                env=env,
                scheme=make_scheme(rank),
            )
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]
    return models


def _server_params(address: str, model: nn.Module) -> tuple[int, dict[str, np.ndarray]]:
    arrays = {n: p.detach().numpy() for n, p in exchanged_parameters(model).items()}
    client = ParameterClient(
        [address], PartitionPlan.from_arrays(arrays, 1), worker=-1, retry_seconds=5.0
    )
    try:
        return client.pull(record=False)
    finally:
        client.close()


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


class _SyncAllPushBeforeLeave(SyncWorker):
    """SyncWorker whose workers wait for each other after their last push, before leaving."""

    def __init__(self, options: SyncOptions, num_workers: int, barrier: threading.Barrier):
        super().__init__(options, num_workers)
        self.barrier = barrier

    def finish(self, ctx: WorkerContext) -> None:
        super().finish(ctx)
        self.barrier.wait(timeout=30)


def test_sync_all_replicas_equals_large_batch_sgd(ps_server) -> None:
    address, service = ps_server
    world = 2
    model, data = _problem()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, momentum=0.0, log_every=1
    )
    spec = schemes.get("sync")
    barrier = threading.Barrier(world)
    models = _run_workers(
        address=address,
        scheme_name="sync",
        make_scheme=lambda rank: _SyncAllPushBeforeLeave(spec.options(), world, barrier),
        model=model,
        data=data,
        config=config,
        world=world,
    )
    expected = _reference_sgd(model, data, world=world, config=config)
    assert service.shard is not None
    assert service.shard.pushes_rejected == 0
    assert service.shard.pushes_accepted == world * config.steps
    version, server = _server_params(address, model)
    assert version == config.steps
    _assert_close(server, expected)
    _assert_close(_params(models[0]), expected)  # the chief loads the servers' parameters
    # ...and differs from training on one worker's batches only.
    alone = _reference_sgd(model, data, world=1, config=config)
    assert not all(np.allclose(server[k], alone[k], atol=1e-3) for k in alone)


def test_sync_equals_large_batch_sgd_when_a_worker_is_slow_on_the_last_step(ps_server) -> None:
    address, service = ps_server
    world = 2
    model, data = _problem()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN, batch_size=4, steps=3, lr=0.1, momentum=0.0, log_every=1
    )
    spec = schemes.get("sync")

    def slow_last_step(rank: int) -> Callable[..., torch.Tensor]:
        calls = [0]

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if rank == 1 and calls[0] == config.steps:
                threading.Event().wait(0.5)
            return _loss(output, target)

        return loss

    _run_workers(
        address=address,
        scheme_name="sync",
        make_scheme=lambda rank: spec.make_worker(spec.options(), world),
        model=model,
        data=data,
        config=config,
        world=world,
        loss_for=slow_last_step,
    )
    expected = _reference_sgd(model, data, world=world, config=config)
    _, server = _server_params(address, model)
    assert service.shard is not None and service.shard.pushes_rejected == 0
    _assert_close(server, expected)


def _in_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a distsgd shared-memory segment (a mapping of a
    ``/dev/shm/distsgd-...`` file, in this process's ``/proc/self/maps``)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span = line.split()[0]
        start, stop = (int(x, 16) for x in span.split("-"))
        if start <= address < stop:
            return "/dev/shm/distsgd-" in line
    return False


def _hogwild_alone(
    address: str, model: nn.Module, data: TensorDataset, config: TrainConfig
) -> list[nn.Module]:
    spec = schemes.get("hogwild")
    return _run_workers(
        address=address,
        scheme_name="hogwild",
        make_scheme=lambda rank: spec.make_worker(spec.options(), 1),
        model=model,
        data=data,
        config=config,
        world=1,
    )


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_hogwild_one_worker_equals_plain_sgd(ps_server, shared_memory: str) -> None:
    """Exact through the stream and through shared memory, where backward writes the
    gradients straight into the push area from the second step on."""
    address, _ = ps_server
    model, data = _problem()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN,
        batch_size=4,
        steps=5,
        lr=0.1,
        momentum=0.9,
        log_every=1,
        shared_memory=shared_memory,
    )
    models = _hogwild_alone(address, model, data, config)
    expected = _reference_sgd(model, data, world=1, config=config)
    version, server = _server_params(address, model)
    assert version == config.steps
    _assert_close(server, expected)
    _assert_close(_params(models[0]), expected)
    grads = [p.grad for p in models[0].parameters()]
    assert all(g is not None and _in_shared_memory(g) for g in grads) is (shared_memory == "auto")


def test_a_frozen_parameter_is_not_exchanged(ps_server) -> None:
    """requires_grad=False: not registered on the servers, never pushed nor pulled; it keeps
    the value the worker built, and the rest trains as torch SGD trains it."""
    address, service = ps_server
    model, data = _problem()
    model.weight.requires_grad_(False)
    built = model.weight.detach().clone()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, momentum=0.0, log_every=1
    )
    models = _hogwild_alone(address, model, data, config)
    expected = _reference_sgd(model, data, world=1, config=config)
    version, server = _server_params(address, model)
    assert version == config.steps
    assert list(service.shard.snapshot()[1]) == ["bias#0"]  # the one piece the servers hold
    _assert_close(server, {"bias": expected["bias"]})
    assert torch.equal(models[0].weight, built)
    _assert_close(_params(models[0]), expected)


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_downpour_one_worker_equals_plain_sgd_including_remainder_window(
    ps_server, shared_memory: str
) -> None:
    """Exact through the stream and through shared memory, where each window's update is
    written straight into the push area."""
    address, _ = ps_server
    model, data = _problem()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN,
        batch_size=4,
        steps=5,
        lr=0.1,
        momentum=0.0,
        log_every=1,
        shared_memory=shared_memory,
    )
    spec = schemes.get("downpour")
    models = _run_workers(
        address=address,
        scheme_name="downpour",
        make_scheme=lambda rank: spec.make_worker(spec.options(window=3, server_lr=1.0), 1),
        model=model,
        data=data,
        config=config,
        world=1,
    )
    expected = _reference_sgd(model, data, world=1, config=config)
    version, server = _server_params(address, model)
    assert version == 2  # one full window of 3, then the remainder of 2
    _assert_close(server, expected)
    _assert_close(_params(models[0]), expected)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_allreduce_world_of_one_equals_plain_sgd(momentum: float) -> None:
    model, data = _problem()
    config = TrainConfig(
        lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, momentum=momentum, log_every=1
    )
    spec = schemes.get("allreduce")
    trained = copy.deepcopy(model)
    result = run_worker(
        model=trained,
        loss_fn=_loss,
        train_set=data,
        test_set=None,
        config=config,
        env=TaskEnv.standalone(),
        scheme=spec.make_worker(spec.options(), 1),
    )
    assert result.local_steps == config.steps and result.global_step == config.steps
    expected = _reference_sgd(model, data, world=1, config=config)
    _assert_close(_params(trained), expected)
    assert not np.allclose(_params(trained)["weight"], _params(model)["weight"])
