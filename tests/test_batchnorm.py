"""What every scheme does with BatchNorm's buffers (docs/schemes/README.md, "BatchNorm
statistics"): each worker's stay its own; the chief evaluates, and saves, the model of the
scheme's parameters (the servers' or its replica's) with running statistics re-estimated at
those parameters over its latest training batches (runtime/batchnorm.py).

Unit tests check the re-estimate against ``torch.optim.swa_utils.update_bn`` (an independent
implementation of the same average) for every scheme's evaluated model; one in-process run
alone checks the wiring; a slow test runs the BatchNorm digits CNN in its own loop under a
parameter-server scheme and under allreduce on 2 workers against the script alone.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from torch import nn
from torch.optim.swa_utils import update_bn

import distsgd
from distsgd import schemes
from distsgd.control.config import LrScaling, TrainConfig
from distsgd.control.metrics import MetricsWriter
from distsgd.demo.digits import DigitsCNN, load_digits
from distsgd.runtime import batchnorm
from distsgd.runtime.batchnorm import RecentInputs, recalibrate, running_stats_modules
from distsgd.runtime.chief import Chief
from distsgd.runtime.modules import exchanged_parameters

TRAIN, TEST = load_digits()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Small forward passes: one thread (two contend on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(n: int, size: int = 32, start: int = 0) -> list[torch.Tensor]:
    return [TRAIN[0][start + i * size : start + (i + 1) * size] for i in range(n)]


def _stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def _reference(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The statistics torch's SWA update computes for ``model``'s parameters over ``batches``."""
    twin = copy.deepcopy(model)
    update_bn(batches, twin)
    return _stats(twin)


def _assert_stats(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = _stats(model)
    assert got.keys() == expected.keys() and got
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


@functools.cache
def _trained_once(seed: int, steps: int = 5) -> DigitsCNN:
    """A BatchNorm CNN after a few SGD steps from ``seed``: its own parameters and statistics."""
    torch.manual_seed(seed)
    model = DigitsCNN(batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    start = seed * 100
    for inputs in _batches(steps, start=start):
        opt.zero_grad()
        F.cross_entropy(model(inputs), TRAIN[1][start : start + len(inputs)]).backward()
        opt.step()
        start += len(inputs)
    return model


def _trained(seed: int) -> DigitsCNN:
    return copy.deepcopy(_trained_once(seed))


def test_recalibrate_averages_the_batches_statistics_at_the_current_parameters() -> None:
    """Statistics measured at other parameters are replaced by the equal-weight average over
    the recorded batches at the model's own; its mode, momentum and batch count are kept."""
    torch.manual_seed(0)
    model = DigitsCNN(batch_norm=True)
    recent = RecentInputs(model)
    model.train()
    for inputs in _batches(5):
        model(inputs)
    assert len(recent.batches) == 5 and recent.samples == 160
    with torch.no_grad():  # other parameters than those the statistics were measured at
        for p in model.parameters():
            p.mul_(1.5).add_(0.1)
    before = _stats(model)
    counts = [m.num_batches_tracked.clone() for m in running_stats_modules(model)]  # type: ignore[union-attr]
    model.eval()
    assert recalibrate(model, recent) == 5
    _assert_stats(model, _reference(model, _batches(5)))
    assert not torch.allclose(before["bn1.running_mean"], model.bn1.running_mean)  # type: ignore[arg-type]
    assert not model.training  # its mode as it was
    for m, count in zip(running_stats_modules(model), counts, strict=True):
        assert m.momentum == 0.1 and torch.equal(m.num_batches_tracked, count)  # type: ignore[arg-type]
    assert len(recent.batches) == 5  # the replays were not recorded
    recent.remove()
    model.train()
    model(_batches(1)[0])
    assert not recent.batches and not model._forward_pre_hooks


def test_recent_inputs_keep_the_newest_batches_within_their_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batchnorm, "RECENT_BATCHES", 3)
    monkeypatch.setattr(batchnorm, "RECENT_SAMPLES", 80)
    model = DigitsCNN(batch_norm=True)
    recent = RecentInputs(model)
    batches = _batches(4)
    for inputs in batches:
        model(inputs)
    assert [b[0][0] for b in recent.batches] == batches[-2:]  # 80 samples: two of 32
    assert recent.samples == 64
    model(TRAIN[0][:200])  # one batch over the bound is still kept, alone
    assert recent.samples == 200 and len(recent.batches) == 1
    for inputs in batches:
        model(inputs)
    assert len(recent.batches) == 2  # the count bound: never more than 3
    monkeypatch.setattr(batchnorm, "RECENT_BATCHES", 10)
    monkeypatch.setattr(batchnorm, "RECENT_SAMPLES", 10**6)
    monkeypatch.setattr(batchnorm, "RECENT_BYTES", 2 * batches[0].nbytes)
    for inputs in batches:  # the byte bound: two batches' inputs at most
        model(inputs)
    assert len(recent.batches) == 2 and recent.nbytes == 2 * batches[0].nbytes
    model.eval()
    model(batches[0])  # evaluation passes are not training batches
    assert recent.samples == 64


def test_a_model_without_batchnorm_is_left_alone() -> None:
    model = DigitsCNN()
    assert running_stats_modules(model) == []
    chief = _chief(test_set=None)
    chief.start(model, from_start=True)
    assert chief.recent is None and not model._forward_pre_hooks
    assert recalibrate(model, RecentInputs(nn.BatchNorm1d(2))) == 0


def _chief(test_set: Any = None) -> Chief:
    config = TrainConfig(eval_every=1)
    return Chief(
        test_set=test_set,
        loss_fn=F.cross_entropy,
        batch_fn=None,
        metric_fns={},
        config=config,
        given_config=config,
        lr_scaling=LrScaling.resolve(config, "none", 1),
        files=None,
        metrics=MetricsWriter(None, "worker0"),
    )


def _fake_run(model: nn.Module, server: dict[str, np.ndarray]) -> tuple[Any, Any]:
    def load(arrays: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, p in exchanged_parameters(model).items():
                p.copy_(torch.from_numpy(arrays[name]))

    ctx = SimpleNamespace(
        model=model,
        device=torch.device("cpu"),
        global_step=40,
        local_step=1,
        load=load,
        clock=SimpleNamespace(measure=lambda name: contextlib.nullcontext()),
        ps=SimpleNamespace(pull=lambda record: (40, server)),
    )
    conn = SimpleNamespace(server_parameters=lambda: (40, server))
    return ctx, conn


@pytest.mark.parametrize("name", schemes.names())
def test_each_scheme_evaluates_its_parameters_with_statistics_measured_at_them(
    name: str,
) -> None:
    """The chief's replica trained at its own parameters (statistics of those); the servers
    hold others (another model's, as far from it as a center after many pushes). The evaluated
    model, every ``eval_every`` steps and at the end, has the statistics of the parameters
    the scheme evaluates (the servers' under a parameter-server scheme, the replica's under a
    collective one) over the chief's latest batches; the replica's own stay as they were until
    the end."""
    scheme = schemes.get(name).worker_class()
    replica, other = _trained(seed=1), _trained(seed=2)
    server = {k: p.detach().numpy().copy() for k, p in exchanged_parameters(other).items()}
    chief = _chief(test_set=torch.utils.data.TensorDataset(TEST[0][:96], TEST[1][:96]))
    chief.start(replica, from_start=True)
    replica.train()
    last = _batches(20, start=3)
    for inputs in last:
        replica(inputs)
    recorded = last[-batchnorm.RECENT_BATCHES :]
    evaluated = other if scheme.evaluate_on == "server" else replica
    expected = _reference(evaluated, recorded)
    own = _stats(replica)
    ctx, conn = _fake_run(replica, server)
    assert chief.every_step(ctx, scheme) is not None  # type: ignore[arg-type]
    assert chief.eval_model is not None
    _assert_stats(chief.eval_model, expected)
    _assert_stats(replica, own)  # its training statistics untouched by the evaluation
    result = distsgd.TrainResult(
        scheme=name,
        worker=0,
        local_steps=20,
        global_step=40,
        seconds=1.0,
        samples=640,
        bytes_sent=0,
    )
    result = chief.finish(result, ctx=ctx, conn=conn, scheme=scheme, on_evaluate=lambda s: None)  # type: ignore[arg-type]
    _assert_stats(replica, expected)  # the final model: the evaluated parameters' statistics
    assert result.test_accuracy is not None
    chief.close()
    assert not replica._forward_pre_hooks


@pytest.mark.parametrize("name", schemes.names())
def test_each_schemes_page_states_what_it_does_with_the_statistics(name: str) -> None:
    page = (ROOT / "docs" / "schemes" / f"{name}.md").read_text()
    assert "**BatchNorm statistics.**" in page, f"docs/schemes/{name}.md: state the rule"
    table = (ROOT / "docs" / "schemes" / "README.md").read_text().split("## BatchNorm")[1]
    assert f"`{name}`" in table.split("\n\n## ")[0], f"docs/schemes/README.md: {name}'s row"


def test_a_run_alone_ends_with_the_statistics_of_its_final_parameters(tmp_path: Path) -> None:
    """distsgd.Worker in a loop of one's own (its model the script's): the final model's
    statistics are the final parameters' over the last batches, the hook is gone after."""
    torch.manual_seed(0)
    model = DigitsCNN(batch_norm=True)
    seen: list[torch.Tensor] = []

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if module.training and torch.is_grad_enabled():  # a training step, not a replay
            seen.append(args[0])

    model.register_forward_pre_hook(record)
    config = TrainConfig(batch_size=32, steps=24, lr=0.3, eval_every=10)
    with distsgd.Worker(
        model, train_data=TRAIN, test_data=TEST, loss_fn=F.cross_entropy, config=config
    ) as worker:
        for inputs, target in worker.batches():
            with worker.step():
                F.cross_entropy(worker.model(inputs), target).backward()
    assert sum(len(x) == 32 for x in seen) == 24  # and the first-step check's few items
    _assert_stats(model, _reference(model, seen[-batchnorm.RECENT_BATCHES :]))
    assert len(model._forward_pre_hooks) == 1  # only the test's own
