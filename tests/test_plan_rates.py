"""``distsgd plan`` reads a path's rate from a probe only where the transfer is measurable: the
demo's all-reduce once read as 'gloo: pulls 153 GB/s' (a step no longer than the compute
measured in another run, the rest floored at 1 us)."""

from __future__ import annotations

import argparse

import pytest

from distsgd.plan.choices import ASSUMED_PATHS
from distsgd.plan.cost import MIN_TRANSFER_SHARE, transfer_rate
from distsgd.schemes.entries import parse_entry

GLOO = ASSUMED_PATHS["gloo"].pull
DEMO_BYTES = 153_128  # the demo's float32 model


def test_a_step_no_longer_than_its_compute_keeps_the_assumed_rate() -> None:
    # the all-reduce run's 4.40 ms steps against Hogwild's 4.43 ms of compute: no transfer left
    got = transfer_rate(
        DEMO_BYTES, 4.40e-3, fixed=4.43e-3 + 2e-4, assumed=GLOO, source="measured: all-reduce"
    )
    assert got.value == GLOO.value < 1e9  # not 153 GB/s
    assert got.source.startswith(GLOO.source) and "too little left to measure" in got.source


def test_a_rest_within_the_noise_is_not_a_measurement() -> None:
    seconds = 10e-3
    fixed = seconds * (1 - MIN_TRANSFER_SHARE / 2)  # 5% left: within the two runs' noise
    assert transfer_rate(DEMO_BYTES, seconds, fixed=fixed, assumed=GLOO, source="m").value == (
        GLOO.value
    )


def test_a_measurable_transfer_gives_its_rate() -> None:
    # 13.5 ms steps of all-reduce beyond 4.4 ms of compute and two 0.1 ms calls: 8.9 ms
    got = transfer_rate(
        DEMO_BYTES, 13.5e-3, fixed=4.4e-3 + 2e-4, assumed=GLOO, source="measured: all-reduce"
    )
    assert got.value == pytest.approx(DEMO_BYTES / 8.9e-3)  # 17 MB/s
    assert got.source == "measured: all-reduce"


def test_plan_of_the_demo_does_not_read_a_step_within_its_compute_as_153_gb_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `distsgd plan` on the demo measured: the all-reduce run's steps no longer than the
    compute of the Hogwild run (the two runs apart, on a busy machine)."""
    from distsgd.cli import plan
    from distsgd.launcher import probe

    hogwild = probe.ExchangeProbe(
        path="shared memory",
        param_bytes=DEMO_BYTES,
        compute_s=4.43e-3,
        pull_s=1.38e-3,
        push_s=2.89e-3,
        steps=80,
    )
    monkeypatch.setattr(probe, "probe_exchange", lambda *a, **k: hogwild)
    monkeypatch.setattr(
        probe, "probe_allreduce", lambda *a, **k: probe.AllreduceProbe(step_s=4.40e-3, steps=120)
    )
    monkeypatch.setattr(plan, "_say", lambda text: None)
    args = argparse.Namespace(link=None, script_args=[])
    parts = plan._measured_parts(args, [parse_entry("allreduce")], "digits.py")
    gloo = parts.paths["gloo"]
    assert gloo.pull.value == GLOO.value and "too little left to measure" in gloo.pull.source
    assert 1e8 < parts.paths["shared memory"].pull.value < 1e9  # measured: 0.12 GB/s
