"""Asynchronous DiLoCo: the servers' Delayed Nesterov rule against its equations, DyLU's pace
estimate, and two workers in a forced order against a single-process replay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import final_accuracy, metrics, run_distsgd
from test_catalogue import RATE_AS_GIVEN, _numpy, _Replicas, _run_in_turns
from test_scheme_rules import (
    _assert_close,
    _grads,
    _push,
    _shard,
    _w0,
    ps_server,  # noqa: F401 - fixture
)

from distsgd import schemes
from distsgd.runtime import TrainConfig
from distsgd.schemes.asyncdiloco import AsyncDilocoOptions, DelayedNesterovServer, Pace


def _delayed_nesterov(
    pushes: list[tuple[dict[str, np.ndarray], float]], lr: float, beta: float, period: int
) -> dict[str, np.ndarray]:
    """The module docstring's update, written out: (pseudo-gradient, weight) per arrival."""
    theta = _w0()
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    acc = {k: np.zeros_like(v) for k, v in theta.items()}
    for t, (g, w) in enumerate(pushes, start=1):
        for k in theta:
            acc[k] += w * g[k]
            if t % period == 0:
                m[k] = beta * m[k] + acc[k] / period
                theta[k] = theta[k] - lr * (beta * m[k] + w * g[k] / period)
                acc[k] = np.zeros_like(acc[k])
            else:
                theta[k] = theta[k] - lr * w * g[k] / period
    return theta


@pytest.mark.parametrize("period", [1, 2, 3])
def test_the_rule_takes_a_momentum_step_every_period_arrivals(period: int) -> None:
    options = {"outer_lr": 0.7, "outer_momentum": 0.5, "nesterov_period": period}
    shard = _shard("asyncdiloco", options, 3)
    grads = _grads(7)
    for i, g in enumerate(grads):
        outcome, version = _push(shard, g, worker=i % 3, base=i)  # no staleness
        assert outcome.accepted and version == i + 1
    _assert_close(shard.values, _delayed_nesterov([(g, 1.0) for g in grads], 0.7, 0.5, period))


def test_period_one_is_torch_nesterov_on_every_arrival() -> None:
    shard = _shard("asyncdiloco", {"outer_lr": 0.3, "outer_momentum": 0.9, "nesterov_period": 1}, 2)
    grads = _grads(4)
    params = {k: torch.tensor(v) for k, v in _w0().items()}
    opt = torch.optim.SGD(params.values(), lr=0.3, momentum=0.9, nesterov=True)
    for i, g in enumerate(grads):
        _push(shard, g, worker=i % 2, base=i)
        for k, p in params.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    _assert_close(shard.values, {k: p.numpy() for k, p in params.items()})


def test_period_zero_is_the_number_of_workers() -> None:
    shard = _shard("asyncdiloco", {"outer_lr": 0.7, "outer_momentum": 0.5}, 2)
    grads = _grads(4)
    for i, g in enumerate(grads):
        _push(shard, g, worker=i % 2, base=i)
    _assert_close(shard.values, _delayed_nesterov([(g, 1.0) for g in grads], 0.7, 0.5, 2))


def test_inverse_staleness_shrinks_only_a_change_later_than_a_round() -> None:
    """n = 2: pushes 1-2 on version 0 (tau 0, then 1: full weight), push 3 on version 0 too
    (tau 2: weight 2/3), push 4 on the version before it (tau 0)."""
    options = {"outer_lr": 0.5, "outer_momentum": 0.5, "staleness": "inverse"}
    shard = _shard("asyncdiloco", options, 2)
    grads = _grads(4)
    for g, base in zip(grads, [0, 0, 0, 3], strict=True):
        assert _push(shard, g, worker=0, base=base)[0].accepted
    weights = [1.0, 1.0, 2 / 3, 1.0]
    expected = _delayed_nesterov(list(zip(grads, weights, strict=True)), 0.5, 0.5, 2)
    _assert_close(shard.values, expected)


def test_the_rules_state_survives_a_checkpoint() -> None:
    options = {"outer_lr": 0.7, "outer_momentum": 0.5, "nesterov_period": 3}
    first = _shard("asyncdiloco", options, 3)
    grads = _grads(5)
    for i, g in enumerate(grads[:4]):
        _push(first, g, worker=0, base=i)
    second = _shard(
        "asyncdiloco", options, 3, values={k: v.copy() for k, v in first.values.items()}
    )
    assert isinstance(second.rule, DelayedNesterovServer)
    second.rule.load_state_dict(first.rule.state_dict())
    _push(first, grads[4], worker=0, base=4)
    _push(second, grads[4], worker=0, base=4)
    _assert_close(second.values, first.values)


def test_each_piece_counts_the_arrivals_that_carried_it() -> None:
    """Fragments: pushes of w alone and b alone, interleaved, on period 2: each piece takes
    its momentum step on every second push of its own, as if it were pushed alone."""
    options = {"outer_lr": 0.7, "outer_momentum": 0.5, "nesterov_period": 2}
    shard = _shard("asyncdiloco", options, 2)
    grads = _grads(6)
    keys = ["w#0", "b#0", "b#0", "w#0", "w#0", "b#0"]
    for i, (g, key) in enumerate(zip(grads, keys, strict=True)):
        assert _push(shard, {key: g[key]}, worker=i % 2, base=i)[0].accepted
    for key in ("w#0", "b#0"):
        alone = [
            ({k: v for k, v in g.items()}, 1.0)
            for g, k in zip(grads, keys, strict=True)
            if k == key
        ]
        expected = _delayed_nesterov(alone, 0.7, 0.5, 2)[key]
        np.testing.assert_allclose(shard.values[key], expected, rtol=0, atol=1e-6, err_msg=key)
    assert isinstance(shard.rule, DelayedNesterovServer)
    assert shard.rule.arrivals == {"w#0": 3, "b#0": 3}


def test_a_checkpoint_from_before_fragments_counts_every_piece_alike() -> None:
    rule = DelayedNesterovServer({"outer_lr": 0.7}, 2)
    zeros = {k: np.zeros_like(v) for k, v in _w0().items()}
    rule.load_state_dict({"arrivals": 5, **{f"buffered/{k}": v for k, v in zeros.items()}})
    assert rule.arrivals == {"w#0": 5, "b#0": 5}
    again = DelayedNesterovServer({"outer_lr": 0.7}, 2)
    again.load_state_dict(rule.state_dict())
    assert again.arrivals == rule.arrivals


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"nesterov_period": -1}, "nesterov_period"),
        ({"staleness": "linear"}, "staleness"),
        ({"inner_lr": 0.0}, "inner_lr"),
        ({"inner_steps": 4, "fragments": 5}, "fragments must be between 1 and inner_steps"),
        ({"fragments": 0}, "fragments must be between 1"),
        ({"fragments": 2, "dylu": True}, "drop --dylu or use --fragments 1"),
        ({"fragments": 2, "staleness": "inverse"}, "use --staleness none with --fragments"),
    ],
)
def test_options_are_checked(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AsyncDilocoOptions(**options)


def test_the_server_refuses_an_unknown_staleness_weight() -> None:
    with pytest.raises(ValueError, match="staleness"):
        DelayedNesterovServer({"outer_lr": 0.7, "staleness": "linear"}, 2)


# ------------------------------------------------------------------------------------- DyLU


def _rounds(pace: Pace, *, mine: float, others: list[float], most: int, rounds: int) -> int:
    """Seconds per inner step of this worker (``mine``) and of the others, every other worker
    taking ``most`` steps a round, this one following ``pace``: its H after ``rounds``."""
    steps = most
    for _ in range(rounds):
        seconds = steps * mine
        arrivals = round(sum(seconds / (most * s) for s in others))  # the others', meanwhile
        pace.update(arrivals=arrivals, steps=steps)
        steps = pace.next_round(steps, most, len(others))
    return steps


def test_dylu_gives_a_3x_slower_worker_a_third_of_the_steps() -> None:
    assert _rounds(Pace(), mine=0.03, others=[0.01, 0.01, 0.01], most=30, rounds=8) == 10


def test_dylu_leaves_a_fast_worker_at_h() -> None:
    assert _rounds(Pace(), mine=0.01, others=[0.03, 0.01, 0.01], most=30, rounds=8) == 30


def test_dylu_ignores_equal_workers_noise() -> None:
    """Equal workers: the others' arrivals in one round are 3, give or take one (where the
    round falls against theirs); H stays."""
    pace, steps = Pace(), 30
    for arrivals in [4, 2, 4, 2, 3, 4, 2, 4, 3, 2, 4]:
        pace.update(arrivals=arrivals, steps=steps)
        steps = pace.next_round(steps, 30, 3)
        assert steps == 30
    assert Pace().next_round(30, 30, 3) == 30  # nothing measured: H


def test_dylu_never_goes_below_an_eighth_of_h() -> None:
    assert _rounds(Pace(), mine=0.1, others=[0.001] * 3, most=16, rounds=6) == 2


# ---------------------------------------------------------------------------- forced order


def _reference(model, data, config: TrainConfig, *, world: int, h: int, o: AsyncDilocoOptions):
    """Workers taking steps in turns (``_Turns``): AdamW inside, a push every h steps (and the
    remainder at the end), the servers' DN update on each arrival. ``o.fragments`` P: the
    tensors in P runs, run p pushed and pulled alone every h steps from step p * h / P on.
    ``o.overlap`` (one worker only: the background exchange's order is then fixed): a round
    starts from the parameters pulled one round earlier plus the progress made since that
    pull was sent."""
    reps = _Replicas(model, data, world, config)
    inner = [
        torch.optim.AdamW(m.parameters(), lr=o.inner_lr, weight_decay=o.weight_decay)
        for m in reps.models
    ]
    center = _numpy(reps.get(0))
    server = _ReferenceServer(center, o, o.nesterov_period or world)
    names = list(center)
    parts = [
        [n for i, n in enumerate(names) if i * o.fragments // len(names) == p]
        for p in range(o.fragments)
    ]
    starts = [dict(center) for _ in range(world)]
    pending = [[0] * len(parts) for _ in range(world)]
    lead = [[(h - p * h // len(parts)) % h for p in range(len(parts))] for _ in range(world)]
    travelling: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (overlap) its pull

    def exchange(r: int, p: int, *, last: bool = False) -> None:
        now = {k: v for k, v in _numpy(reps.get(r)).items() if k in parts[p]}
        if pending[r][p]:
            server.arrive({k: starts[r][k] - now[k] for k in now})
        landed = travelling.pop((r, p), None)
        if landed is not None:  # overlap: the last round's pull, plus this round's progress
            keep = 0.0 if last else 1.0
            now = {k: landed[k] + keep * (now[k] - starts[r][k]) for k in landed}
        if o.overlap and not last:
            travelling[r, p] = {k: center[k].copy() for k in now}
        else:
            now = {k: center[k].copy() for k in now}
        reps.set(r, {k: torch.tensor(v) for k, v in {**_numpy(reps.get(r)), **now}.items()})
        starts[r] = {**starts[r], **{k: v.copy() for k, v in now.items()}}
        pending[r][p] = lead[r][p] = 0

    for _ in range(config.steps):
        for r in range(world):
            reps.backward(r)
            inner[r].step()
            for p in range(len(parts)):
                pending[r][p] += 1
                if pending[r][p] + lead[r][p] == h:
                    exchange(r, p)
    for r in range(world):
        for p in range(len(parts)):
            if pending[r][p]:
                exchange(r, p)
        for p in range(len(parts)):
            exchange(r, p, last=True)
    return center


class _ReferenceServer:
    """The DN update of the module docstring, on the reference's ``center`` in place; each
    tensor counts the arrivals that carried it."""

    def __init__(self, center: dict[str, np.ndarray], o: AsyncDilocoOptions, period: int):
        self.center, self.o, self.period = center, o, period
        self.arrivals = dict.fromkeys(center, 0)
        self.momentum = {k: np.zeros_like(v) for k, v in center.items()}
        self.acc = {k: np.zeros_like(v) for k, v in center.items()}

    def arrive(self, g: dict[str, np.ndarray]) -> None:
        o, period, center = self.o, self.period, self.center
        for k in g:
            self.arrivals[k] += 1
            self.acc[k] = self.acc[k] + g[k]
            if self.arrivals[k] % period == 0:
                self.momentum[k] = o.outer_momentum * self.momentum[k] + self.acc[k] / period
                center[k] = center[k] - o.outer_lr * o.outer_momentum * self.momentum[k]
                self.acc[k] = np.zeros_like(self.acc[k])
            center[k] = center[k] - o.outer_lr * g[k] / period


@pytest.mark.parametrize(("fragments", "pushes"), [(1, 3), (2, 6)])
def test_two_workers_in_a_forced_order_equal_the_replay(
    ps_server,  # noqa: F811
    fragments: int,
    pushes: int,
) -> None:
    """Per worker, over 5 steps in rounds of 2: the whole model after steps 2 and 4, then the
    remainder of 1 (3 pushes); or (2 fragments) the weight after 2, 4 and its remainder, the
    bias after 1, 3 and 5 (6 pushes)."""
    address, _ = ps_server
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=5, lr=0.1, log_every=1)
    options = schemes.get("asyncdiloco").options(
        inner_steps=2, inner_lr=0.01, outer_lr=0.7, outer_momentum=0.5, fragments=fragments
    )
    model, data, (version, server) = _run_in_turns(address, "asyncdiloco", options, config, 2)
    assert version == 2 * pushes
    expected = _reference(model, data, config, world=2, h=2, o=options)
    for key in expected:
        np.testing.assert_allclose(server[key], expected[key], rtol=1e-5, atol=1e-5)
    # ...and the period matters: Nesterov on every arrival gives another result.
    other = _reference(
        model,
        data,
        config,
        world=2,
        h=2,
        o=AsyncDilocoOptions(**{**vars(options), "nesterov_period": 1}),
    )
    assert any(not np.allclose(server[k], other[k], atol=1e-4) for k in other)
    # ...and so do the fragments.
    unlike = AsyncDilocoOptions(**{**vars(options), "fragments": 3 - fragments})
    other = _reference(model, data, config, world=2, h=2, o=unlike)
    assert any(not np.allclose(server[k], other[k], atol=1e-4) for k in other)


@pytest.mark.parametrize(("fragments", "pushes"), [(1, 4), (2, 8)])
def test_overlap_lands_each_pull_a_round_late_as_the_replay(
    ps_server,  # noqa: F811
    fragments: int,
    pushes: int,
) -> None:
    """One worker (the background exchange's order is then fixed; fragments touch disjoint
    tensors), rounds of 2 over 7 steps: the servers' parameters equal the replay's at 1e-5,
    and differ from the blocking form. Pushes: rounds of 2, 2, 2, then the remainder of 1; or
    (2 fragments) the weight's 4 so, and the bias's after 1, 3, 5 and 7."""
    address, _ = ps_server
    config = TrainConfig(lr_rule=RATE_AS_GIVEN, batch_size=4, steps=7, lr=0.1, log_every=1)
    options = schemes.get("asyncdiloco").options(
        inner_steps=2,
        inner_lr=0.01,
        outer_lr=0.7,
        outer_momentum=0.5,
        overlap=True,
        fragments=fragments,
    )
    model, data, (version, server) = _run_in_turns(address, "asyncdiloco", options, config, 1)
    assert version == pushes
    expected = _reference(model, data, config, world=1, h=2, o=options)
    for key in expected:
        np.testing.assert_allclose(server[key], expected[key], rtol=1e-5, atol=1e-5)
    plain = AsyncDilocoOptions(**{**vars(options), "overlap": False})
    blocking = _reference(model, data, config, world=1, h=2, o=plain)
    assert any(not np.allclose(server[k], blocking[k], atol=1e-4) for k in blocking)


@pytest.mark.slow  # about 8 s
def test_the_demo_with_two_slow_workers_learns_and_dylu_shortens_their_rounds(
    tmp_path: Path,
) -> None:
    """4 workers, 2 of them sleeping 30 ms a step, batches leased: >= 0.95, and the slow
    workers' last rounds shorter than the fast ones' (which stay at or near H)."""
    run_dir = tmp_path / "run"
    slow = ["--inject-fault", "delay:worker:2=30ms", "--inject-fault", "delay:worker:3=30ms"]
    done = run_distsgd(
        [
            *("demo", "--scheme", "asyncdiloco", "--workers", "4", "--dylu"),
            *("--world-size", "dynamic", "--quiet", "--run-dir", str(run_dir), *slow),
        ]
    )
    assert final_accuracy(done) >= 0.95
    last = {r["task"]: r["inner_steps"] for r in metrics(run_dir) if "inner_steps" in r}
    # the fast pair stays at or near H (a busy CI machine slows them too: 9 and 7 seen), the
    # slow pair well below it
    assert min(last["worker0"], last["worker1"]) > max(last["worker2"], last["worker3"]), last
    assert last["worker2"] < 10 and last["worker3"] < 10, last


@pytest.mark.slow  # about 12 s
def test_the_demo_with_fragments_on_two_servers_learns_and_pulls_one_fragment_at_a_time(
    tmp_path: Path,
) -> None:
    """4 fragments over 2 servers: >= 0.95; each exchange pulls only its fragment, so a
    worker receives about what it sends (whole-model pulls would bring in about 4x)."""
    run_dir = tmp_path / "run"
    done = run_distsgd(
        [
            *("demo", "--scheme", "asyncdiloco", "--workers", "4", "--ps", "2"),
            *("--fragments", "4", "--quiet", "--run-dir", str(run_dir)),
        ]
    )
    assert final_accuracy(done) >= 0.95
    result = json.loads((run_dir / "result.json").read_text())
    assert 0.8 < result["bytes_received"] / result["bytes_sent"] < 1.5, result


def test_the_inner_adamw_is_torchs_fused_one_where_it_can_be() -> None:
    """The DiLoCo family's inner AdamW: torch's fused kernel on CPU (no whole-model temporary
    at each step, as the foreach one makes), the foreach one where fusing cannot be."""
    from distsgd.runtime.context import _fusable

    floats = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    assert _fusable(floats)
    assert not _fusable([])
    assert not _fusable([*floats, torch.zeros(2, dtype=torch.int64)])
    assert not _fusable([torch.zeros(1, device="meta")])
