"""``--step-timeout auto``: the learned straggler deadline of sync and SAGN rounds
(``distsgd/ps/deadline.py``), on a bare shard with a hand-moved clock; no process, no socket."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pytest

from distsgd import schemes
from distsgd.control.config import TrainConfig
from distsgd.ps import deadline as dl
from distsgd.ps.deadline import StepDeadline, parse_step_timeout
from distsgd.ps.rules import PushMeta
from distsgd.ps.shard import Shard
from distsgd.schemes.registry import make_server_rule


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("distsgd.schemes.sync.time.monotonic", c)
    return c


def shard(workers: int = 3, step_timeout: str = "auto") -> Shard:
    spec = schemes.get("sync")
    worker = spec.make_worker(spec.parse_options({"step_timeout": step_timeout}), workers)
    options = json.loads(json.dumps(worker.server_options(TrainConfig(lr=0.1))))
    return Shard(
        index=0,
        scheme="sync",
        options_json=json.dumps(options),
        num_workers=workers,
        values={"w#0": np.zeros(2, np.float32)},
        rule=make_server_rule("sync", options, workers),
    )


def push(s: Shard, worker: int, base: int | None = None) -> Any:
    grad = {"w#0": np.ones(2, np.float32)}
    version = s.version if base is None else base
    return s.push(grad, PushMeta(worker=worker, incarnation=0, base_version=version))[0]


def test_parse_step_timeout() -> None:
    assert parse_step_timeout("auto") == (60.0, True)
    assert parse_step_timeout("AUTO", default=5.0) == (5.0, True)
    assert parse_step_timeout("2.5") == (2.5, False)
    assert parse_step_timeout(30.0) == (30.0, False)  # a config.json of older runs
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="step_timeout"):
            parse_step_timeout(bad)


def test_the_deadline_is_the_timeout_until_it_has_learned() -> None:
    d = StepDeadline(60.0, adaptive=True)
    for _ in range(dl.WARMUP - 1):
        d.arrived(0.002)
    assert d.allowed() == 60.0 and not d.learned()
    d.arrived(0.002)
    assert d.allowed() == pytest.approx(dl.LAG_FACTOR * 0.002) and d.learned()
    for t in (0.0, 0.1, 0.2, 0.3):  # rounds 0.1 s apart: a quarter of that is the floor
        d.closed(t)
    assert d.allowed() == pytest.approx(0.025)
    fixed = StepDeadline(60.0, adaptive=False)
    for _ in range(100):
        fixed.arrived(0.001)
    assert fixed.allowed() == 60.0 and not fixed.learned()


def test_a_round_closes_at_the_learned_deadline_without_the_straggler(clock: Clock) -> None:
    s = shard(workers=3)
    rule: Any = s.rule
    for _ in range(dl.WARMUP):  # every round: workers 0 and 1 within 2 ms, worker 2 late
        push(s, 0)
        clock.now += 0.002
        push(s, 1)
        clock.now += 0.050
        push(s, 2)
        clock.now += 0.001
    assert s.version == dl.WARMUP and rule.deadline.learned()
    push(s, 0)
    clock.now += 0.002
    push(s, 1)
    assert rule.deadline_at() == pytest.approx(clock.now - 0.002 + rule.deadline.allowed())
    clock.now += 0.004  # before the deadline (3 x the 2 ms lag, or a quarter of a round)
    s.tick()
    assert s.version == dl.WARMUP
    clock.now += 0.050
    s.tick()  # past it: the round closes with workers 0 and 1
    assert s.version == dl.WARMUP + 1 and rule.deadline.early_closes == 1
    late = push(s, 2, base=dl.WARMUP)  # computed on the closed round's version: stale
    assert not late.accepted


def test_a_fixed_timeout_waits_for_every_worker(clock: Clock) -> None:
    s = shard(workers=2, step_timeout="60")
    for _ in range(dl.WARMUP + 5):
        push(s, 0)
        clock.now += 0.5
        push(s, 1)
    push(s, 0)
    clock.now += 30.0
    s.tick()
    assert s.version == dl.WARMUP + 5  # still waiting: 30 s < 60 s
    clock.now += 31.0
    s.tick()
    assert s.version == dl.WARMUP + 6


def test_a_waiting_pull_closes_the_round_at_its_deadline() -> None:
    """Not at the ticker's next half second: the pull waiting for the version acts on it."""
    s = shard(workers=2)
    rule: Any = s.rule
    rule.deadline.lags.extend([0.001] * dl.WARMUP)  # learned: 3 ms after the first push
    push(s, 0)
    version = s.version
    done = threading.Event()

    def wait() -> None:
        if s.wait_for(version + 1, timeout=5.0):
            done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(timeout=5.0)
    assert done.is_set() and s.version == version + 1  # worker 1 never pushed


def test_sagn_takes_auto_too() -> None:
    spec = schemes.get("sagn")
    worker = spec.make_worker(spec.parse_options({"step_timeout": "auto"}), 2)
    options = worker.server_options(TrainConfig())
    assert options["adaptive_deadline"] is True and options["step_timeout"] == 60.0
    rule = make_server_rule("sagn", json.loads(json.dumps(options)), 2)
    assert rule.deadline.adaptive  # type: ignore[attr-defined]
