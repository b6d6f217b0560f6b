"""The link probe of ``distsgd plan --link`` (``distsgd_emulate/link_probe.py``): its two figures
computed from transfer times (pure), and one real probe on emulated hosts, which it removes."""

from __future__ import annotations

import argparse

import pytest
from conftest import netns_refusal, on_emulated_hosts

from distsgd.cli import plan as plan_cli
from distsgd_emulate import link_probe
from distsgd_emulate.link_probe import MIN_DUPLEX, LinkProbe, duplex_of, probe_link, turns_of


def test_turns_is_0_when_transfers_end_together_and_1_when_in_turn() -> None:
    assert turns_of([(1.0, 1.0), (2.0, 2.0)]) == 0.0
    assert turns_of([(0.5, 1.0)]) == 1.0
    assert turns_of([(0.2, 1.0)]) == 1.0  # one far before the other: in turn, at most 1
    assert turns_of([(0.75, 1.0), (1.0, 0.75)]) == pytest.approx(0.5)
    assert turns_of([]) == 0.0


def test_duplex_is_the_bytes_both_ways_moved_against_twice_the_alone_rate() -> None:
    # alone: 1 byte a second; two peers, two transfers each in 2 s: both ways at full rate
    assert duplex_of(1.0, 1, [[1.0, 1.0], [1.0, 1.0]]) == pytest.approx(1.0)
    # the same four transfers took 4 s: each way at half its alone rate
    assert duplex_of(1.0, 1, [[2.0, 2.0], [1.0, 1.0]]) == pytest.approx(0.5)
    assert duplex_of(1.0, 1, [[0.1, 0.1], [0.1, 0.1]]) == 1.0  # never above 1
    assert duplex_of(1.0, 1, [[1e6, 1e6], [1.0, 1.0]]) == MIN_DUPLEX  # nor below the floor


@on_emulated_hosts(netns_refusal(root=False))
def test_a_real_probe_measures_a_link_and_leaves_no_namespace() -> None:
    from distsgd_emulate.netns import EmulatedHosts

    made: list[EmulatedHosts] = []
    start = EmulatedHosts.start

    def spy(self: EmulatedHosts) -> None:
        made.append(self)
        start(self)

    patch = pytest.MonkeyPatch()
    patch.setattr(EmulatedHosts, "start", spy)
    try:
        got = probe_link("1gbit", 512 * 1024, workers=2)  # the fewest: 3 hosts, not 4
    finally:
        patch.undo()
    assert got.peers == 2 and got.nbytes == 512 * 1024
    assert 0 < got.alone_s < 1.0  # 0.5 MB at 1 Gbit/s: about 4 ms
    assert 0 < got.duplex <= 1 and 0 <= got.turns <= 1
    assert "1gbit" in got.describe()
    assert len(made) == 1 and made[0].keepers == {} and made[0].root_links() == []


def test_plan_says_when_the_link_cannot_be_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*_: object, **__: object) -> LinkProbe:
        raise ValueError("emulated hosts need root")

    monkeypatch.setattr(link_probe, "probe_link", refuse)
    args = argparse.Namespace(link="100mbit", ps=1, workers=2)
    assert plan_cli._probe_link(args, 2_700_000) is None
    assert "not measured (emulated hosts need root)" in capsys.readouterr().err
    cluster = plan_cli._cluster(argparse.Namespace(link="100mbit", cores=2.0), 2, 1, None)
    assert (cluster.duplex, cluster.turns) == (1.0, 0.0)
    probe = LinkProbe(rate="100mbit", nbytes=1, alone_s=0.2, duplex=0.6, turns=0.7, peers=2)
    cluster = plan_cli._cluster(argparse.Namespace(link="100mbit", cores=2.0), 2, 1, probe)
    assert (cluster.duplex, cluster.turns) == (0.6, 0.7)
