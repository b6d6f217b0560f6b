"""Schemes of the wider catalogue against plain single-process references.

Asynchronous schemes run with their workers' hooks forced into a fixed order (``_Turns``), so a
plain loop over the same batches in the same order must give the same parameters.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest
import torch
from test_scheme_rules import (
    _assert_close,
    _grads,
    _loss,
    _problem,
    _push,
    _reference_sgd,
    _run_workers,
    _server_params,
    _shard,
    _w0,
    ps_server,  # noqa: F401 - fixture
)
from torch import nn
from torch.utils.data import TensorDataset

from distsgd import schemes
from distsgd.runtime import TrainConfig, WorkerContext
from distsgd.runtime.data import ShardedBatches
from distsgd.runtime.scheme import WorkerScheme

RATE_AS_GIVEN = "none"
"""The references below replay each scheme's math at the rate its workers apply; ``--lr-rule``
(the scheme's default factor on N workers, tests/test_defaults.py) is off so that rate is
``lr``."""


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
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=6, lr=0.1, log_every=1)
    spec = schemes.get("dynsgd")
    _run_workers(
        address=address,
        scheme_name="dynsgd",
        make_scheme=lambda rank: spec.make_worker(spec.options(), 1),
        model=model,
        data=data,
        config=config,
        world=1,
    )
    version, server = _server_params(address, model)
    assert version == config.steps
    _assert_close(server, _reference_sgd(model, data, world=1, config=config))


# --------------------------------------------------------------------------- forced interleaving


class _Turns(WorkerScheme):
    """Runs a scheme's hooks in a fixed order across worker threads: every worker's ``start``
    by rank, then step 0 of rank 0, step 0 of rank 1, ..., then every ``finish`` by rank. An
    asynchronous scheme under this order is deterministic, so a plain reference can replay it."""

    def __init__(self, inner: WorkerScheme, rank: int, world: int, board: dict) -> None:
        self.inner, self.rank, self.world, self.board = inner, rank, world, board
        self.uses_parameter_servers = inner.uses_parameter_servers  # type: ignore[misc]
        self.evaluate_on = inner.evaluate_on  # type: ignore[misc]

    def _wait(self) -> None:
        with self.board["cond"]:
            ok = self.board["cond"].wait_for(
                lambda: self.board["turn"] % self.world == self.rank, timeout=20
            )
            assert ok, f"rank {self.rank} never got its turn"

    def _advance(self) -> None:
        with self.board["cond"]:
            self.board["turn"] += 1
            self.board["cond"].notify_all()

    def server_options(self, config: TrainConfig) -> dict[str, Any]:
        return self.inner.server_options(config)

    def start(self, ctx: WorkerContext) -> None:
        self._wait()
        self.inner.start(ctx)
        self._advance()

    def before_step(self, ctx: WorkerContext) -> None:
        self._wait()
        self.inner.before_step(ctx)

    def after_backward(self, ctx: WorkerContext) -> None:
        self.inner.after_backward(ctx)
        self._advance()

    def finish(self, ctx: WorkerContext) -> None:
        self._wait()
        self.inner.finish(ctx)
        self._advance()


def _run_in_turns(
    address: str,
    name: str,
    options: Any,
    config: TrainConfig,
    world: int,
    turns: type[_Turns] = _Turns,
):
    model, data = _problem()
    spec = schemes.get(name)
    board = {"cond": threading.Condition(), "turn": 0}
    _run_workers(
        address=address,
        scheme_name=name,
        make_scheme=lambda rank: turns(spec.make_worker(options, world), rank, world, board),
        model=model,
        data=data,
        config=config,
        world=world,
    )
    return model, data, _server_params(address, model)


class _Replicas:
    """The plain reference's workers: a model copy and a batch stream per rank."""

    def __init__(self, model: nn.Module, data: TensorDataset, world: int, config: TrainConfig):
        self.models = [copy.deepcopy(model) for _ in range(world)]
        self.batches = [
            iter(ShardedBatches(data, rank=r, world=world, batch_size=config.batch_size, seed=0))
            for r in range(world)
        ]

    def backward(self, rank: int) -> nn.Module:
        """One batch's gradient on replica ``rank`` (zeroed first, as the runtime does)."""
        model = self.models[rank]
        x, y = next(self.batches[rank])
        model.zero_grad(set_to_none=False)
        _loss(model(x), y).backward()
        return model

    def get(self, rank: int) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.models[rank].named_parameters()}

    @torch.no_grad()
    def set(self, rank: int, values: dict[str, torch.Tensor]) -> None:
        for n, p in self.models[rank].named_parameters():
            p.copy_(values[n])


def _numpy(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in values.items()}


def _reference_window(
    model: nn.Module,
    data: TensorDataset,
    config: TrainConfig,
    *,
    world: int,
    window: int,
    server_lr: float,
    normalize: bool,
    optimizer: str = "sgd",
) -> dict[str, np.ndarray]:
    """DOWNPOUR (normalize=False) and AGN (True), workers taking steps in turn."""
    reps = _Replicas(model, data, world, config)
    opt_class = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[optimizer]
    opts = [opt_class(m.parameters(), lr=config.lr) for m in reps.models]
    center = reps.get(0)
    starts = [dict(center) for _ in range(world)]
    pending = [0] * world

    def exchange(r: int) -> None:
        now = reps.get(r)
        for k in center:
            delta = starts[r][k] - now[k]
            center[k] = center[k] - server_lr * (delta / pending[r] if normalize else delta)
        reps.set(r, center)
        starts[r], pending[r] = dict(center), 0

    for _ in range(config.steps):
        for r in range(world):
            reps.backward(r)
            opts[r].step()
            pending[r] += 1
            if pending[r] == window:
                exchange(r)
    for r in range(world):
        if pending[r]:
            exchange(r)
    return _numpy(center)


@pytest.mark.parametrize(
    ("name", "options", "optimizer"),
    [
        ("downpour", {"window": 2, "server_lr": 0.5}, "sgd"),
        ("downpour", {"window": 2, "server_lr": 0.5, "local_optimizer": "adagrad"}, "adagrad"),
        ("agn", {"window": 2}, "sgd"),
    ],
)
def test_window_schemes_in_a_forced_order_equal_the_reference(
    ps_server,  # noqa: F811
    name: str,
    options: dict,
    optimizer: str,
) -> None:
    address, _ = ps_server
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, log_every=1)
    spec = schemes.get(name)
    parsed = spec.options(**options)
    model, data, (version, server) = _run_in_turns(address, name, parsed, config, 2)
    assert version == 2 * 3  # per worker: windows of 2, 2, then the remainder of 1
    expected = _reference_window(
        model,
        data,
        config,
        world=2,
        window=2,
        server_lr=parsed.server_lr,
        normalize=name == "agn",
        optimizer=optimizer,
    )
    _assert_close(server, expected)


class _SettledTurns(_Turns):
    """:class:`_Turns` that also waits, before passing the turn on, for the exchange a scheme
    runs in the background (DOWNPOUR's ``--overlap``): the order stays deterministic."""

    def _settle(self) -> None:
        inflight = getattr(self.inner, "inflight", None)
        if inflight is not None:  # DOWNPOUR keeps (future, params when sent); Hogwild the future
            (inflight[0] if isinstance(inflight, tuple) else inflight).result(timeout=20)

    def after_backward(self, ctx: WorkerContext) -> None:
        self.inner.after_backward(ctx)
        self._settle()
        self._advance()


def _reference_overlap(
    model: nn.Module,
    data: TensorDataset,
    config: TrainConfig,
    *,
    world: int,
    window: int,
    server_lr: float,
) -> dict[str, np.ndarray]:
    """DOWNPOUR with the exchange overlapped (the module docstring's math), in turns."""
    reps = _Replicas(model, data, world, config)
    opts = [torch.optim.SGD(m.parameters(), lr=config.lr) for m in reps.models]
    center = reps.get(0)
    starts = [dict(center) for _ in range(world)]
    pending = [0] * world
    inflight: list[tuple[dict, dict] | None] = [None] * world  # (fetched P, params when sent)

    def land(r: int, keep_progress: bool) -> None:
        if inflight[r] is None:
            return
        fetched, sent_at = inflight[r]
        now = reps.get(r)
        reps.set(
            r,
            {
                k: fetched[k] + (now[k] - sent_at[k]) if keep_progress else fetched[k]
                for k in fetched
            },
        )
        inflight[r] = None

    def exchange(r: int) -> None:
        now = reps.get(r)
        delta = {k: starts[r][k] - now[k] for k in now}
        land(r, keep_progress=True)
        sent_at = reps.get(r)
        for k in center:
            center[k] = center[k] - server_lr * delta[k]
        inflight[r] = (dict(center), sent_at)
        starts[r], pending[r] = reps.get(r), 0

    for _ in range(config.steps):
        for r in range(world):
            reps.backward(r)
            opts[r].step()
            pending[r] += 1
            if pending[r] == window:
                exchange(r)
    for r in range(world):
        if pending[r]:
            exchange(r)
        land(r, keep_progress=False)
    return _numpy(center)


def test_downpour_overlap_in_a_forced_order_equals_the_reference(ps_server) -> None:  # noqa: F811
    """--overlap: each window's update is sent in the background and the worker continues
    from the fetched parameters plus its progress since; exact against the math."""
    address, _ = ps_server
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, log_every=1)
    options = schemes.get("downpour").options(window=2, server_lr=0.5, overlap=True)
    model, data, (version, server) = _run_in_turns(
        address, "downpour", options, config, 2, turns=_SettledTurns
    )
    assert version == 2 * 3
    expected = _reference_overlap(model, data, config, world=2, window=2, server_lr=0.5)
    _assert_close(server, expected)
    plain = _reference_window(
        model, data, config, world=2, window=2, server_lr=0.5, normalize=False
    )
    assert any(not np.allclose(server[k], plain[k]) for k in plain)  # it is another schedule


def _reference_hogwild_overlap(
    model: nn.Module, data: TensorDataset, config: TrainConfig, *, world: int
) -> dict[str, np.ndarray]:
    """Hogwild with --overlap in turns: step k computes on what the exchange of step k-2
    fetched (the first two on the parameters pulled at the start)."""
    reps = _Replicas(model, data, world, config)
    center = reps.get(0)
    fetched: list[dict | None] = [None] * world
    inflight: list[dict | None] = [None] * world
    for step in range(config.steps):
        for r in range(world):
            if step == 0:
                reps.set(r, center)
            elif fetched[r] is not None:
                reps.set(r, fetched[r])
                fetched[r] = None
            m = reps.backward(r)
            grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
            if inflight[r] is not None:
                fetched[r] = inflight[r]
            center = {k: center[k] - config.lr * grads[k] for k in center}
            inflight[r] = dict(center)
    return _numpy(center)


def test_hogwild_overlap_in_a_forced_order_equals_the_reference(ps_server) -> None:  # noqa: F811
    address, _ = ps_server
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, log_every=1)
    options = schemes.get("hogwild").options(overlap=True)
    model, data, (version, server) = _run_in_turns(
        address, "hogwild", options, config, 2, turns=_SettledTurns
    )
    assert version == 2 * 5
    _assert_close(server, _reference_hogwild_overlap(model, data, config, world=2))


@pytest.mark.parametrize(("name", "delta"), [("eamsgd", 0.9), ("easgd", 0.0)])
def test_elastic_averaging_in_a_forced_order_equals_the_reference(
    ps_server,  # noqa: F811
    name: str,
    delta: float,
) -> None:
    """EAMSGD (Algorithm 2); with delta = 0 its worker step is plain SGD: EASGD (Algorithm 1)."""
    address, _ = ps_server
    world, tau, alpha = 2, 2, 0.3
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.05, log_every=1)
    extra = {"delta": delta} if name == "eamsgd" else {}
    options = schemes.get(name).options(tau=tau, alpha=alpha, **extra)
    model, data, (_, server) = _run_in_turns(address, name, options, config, world)

    reps = _Replicas(model, data, world, config)
    center = reps.get(0)
    velocity = [{k: torch.zeros_like(v) for k, v in center.items()} for _ in range(world)]

    def elastic(r: int) -> None:
        x = reps.get(r)
        diff = {k: alpha * (x[k] - center[k]) for k in x}
        reps.set(r, {k: x[k] - diff[k] for k in x})
        for k in center:
            center[k] = center[k] + diff[k]

    for step in range(config.steps):
        for r in range(world):
            if step % tau == 0 and step > 0:
                elastic(r)
            x = reps.get(r)
            reps.set(r, {k: x[k] + delta * velocity[r][k] for k in x})  # look-ahead point
            grads = {n: p.grad.clone() for n, p in reps.backward(r).named_parameters()}
            velocity[r] = {k: delta * velocity[r][k] - config.lr * grads[k] for k in x}
            reps.set(r, {k: x[k] + velocity[r][k] for k in x})
    for r in range(world):
        elastic(r)
    _assert_close(server, _numpy(center))


def test_sagn_equals_the_reference(ps_server) -> None:  # noqa: F811
    """Synchronous: any interleaving gives the same rounds, so no forced order is needed."""
    address, _ = ps_server
    world, window, server_lr = 2, 2, 0.7
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, log_every=1)
    spec = schemes.get("sagn")
    model, data = _problem()
    _run_workers(
        address=address,
        scheme_name="sagn",
        make_scheme=lambda rank: spec.make_worker(
            spec.options(window=window, server_lr=server_lr), world
        ),
        model=model,
        data=data,
        config=config,
        world=world,
    )
    version, server = _server_params(address, model)
    assert version == 3  # rounds of 2, 2 and the remainder of 1

    reps = _Replicas(model, data, world, config)
    opts = [torch.optim.SGD(m.parameters(), lr=config.lr) for m in reps.models]
    center = reps.get(0)
    for length in (2, 2, 1):
        updates = []
        for r in range(world):
            reps.set(r, center)
            for _ in range(length):
                reps.backward(r)
                opts[r].step()
            now = reps.get(r)
            updates.append({k: (center[k] - now[k]) / length for k in now})
        center = {k: center[k] - server_lr * sum(u[k] for u in updates) for k in center}
    _assert_close(server, _numpy(center))


def test_sync_with_per_worker_learning_rates_equals_the_reference(ps_server) -> None:  # noqa: F811
    address, service = ps_server
    world, rates = 2, [0.05, 0.2]
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=4, lr=0.1, log_every=1)
    spec = schemes.get("sync")
    model, data = _problem()
    _run_workers(
        address=address,
        scheme_name="sync",
        make_scheme=lambda rank: spec.make_worker(spec.options(worker_lrs="0.05,0.2"), world),
        model=model,
        data=data,
        config=config,
        world=world,
    )
    _, server = _server_params(address, model)
    reps = _Replicas(model, data, world, config)
    w = reps.get(0)
    for _ in range(config.steps):
        step = {k: torch.zeros_like(v) for k, v in w.items()}
        for r in range(world):
            reps.set(r, w)
            for n, p in reps.backward(r).named_parameters():
                step[n] += rates[r] * p.grad / world
        w = {k: w[k] - step[k] for k in w}
    assert service.shard is not None and service.shard.pushes_rejected == 0
    _assert_close(server, _numpy(w))


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("agn", {"window": 0}, "window"),
        ("agn", {"server_lr": 0}, "server_lr"),
        ("sagn", {"step_timeout": 0}, "step_timeout"),
        ("eamsgd", {"delta": 1.0}, "delta"),
        ("eamsgd", {"tau": 0}, "tau"),
        ("downpour", {"local_optimizer": "adam"}, "local_optimizer"),
        ("sync", {"worker_lrs": "0.1,x"}, "worker_lrs"),
        ("sync", {"worker_lrs": "0.1,-1"}, "positive"),
        ("diloco", {"fragments": 0}, "fragments"),
        ("diloco", {"inner_steps": 4, "fragments": 5}, "fragments"),
        ("diloco", {"outer_momentum": 1.0}, "outer_momentum"),
        ("diloco", {"inner_lr": 0}, "inner_lr"),
        ("diloco", {"inner_steps": 4, "overlap_steps": 5}, "overlap_steps"),
        ("diloco", {"overlap_steps": -1}, "overlap_steps"),
        ("diloco", {"merge": 1.0}, "merge"),
        ("diloco", {"inner_steps": 4, "overlap_steps": 4, "merge": 0.0}, "merge"),
    ],
)
def test_options_are_validated(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schemes.get(name).options(**options)


def test_worker_lrs_need_one_rate_per_worker() -> None:
    spec = schemes.get("sync")
    with pytest.raises(ValueError, match="2 rates for 3 workers"):
        spec.make_worker(spec.options(worker_lrs="0.1,0.2"), 3)


def test_each_scheme_names_what_to_lower_when_it_diverges() -> None:
    fixes = {name: schemes.get(name).divergence_fix() for name in schemes.names()}
    assert fixes["hogwild"] == "lower --lr"
    assert fixes["downpour"] == "lower --lr or --server-lr"
    assert fixes["diloco"] == "lower --inner-lr or --outer-lr"
    assert all(fix.startswith("lower --") for fix in fixes.values())
