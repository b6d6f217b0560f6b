"""The emulated hosts' plan (distsgd_emulate.hosts): link text, placement, addresses. Pure: no
process, no socket."""

from __future__ import annotations

import ipaddress

import pytest

from distsgd.cluster import TaskId
from distsgd_emulate.hosts import (
    MAX_HOSTS,
    Links,
    LinkSpec,
    Placement,
    parse_links,
    place,
    plan_hosts,
)


def _tasks(ps: int, workers: int) -> list[TaskId]:
    return [TaskId.parse(f"ps{i}") for i in range(ps)] + [
        TaskId.parse(f"worker{i}") for i in range(workers)
    ]


def _names(placed: dict[TaskId, int]) -> dict[str, int]:
    return {t.name: h for t, h in placed.items()}


@pytest.mark.parametrize(
    ("text", "rate", "delay", "jitter"),
    [
        ("1gbit", 1_000_000_000, 0.0, 0.0),
        ("100mbit,5ms", 100_000_000, 0.005, 0.0),
        ("10mbit,5ms,1ms", 10_000_000, 0.005, 0.001),
        ("2.5Mbit, 250us", 2_500_000, 0.00025, 0.0),
        ("64kbit,1s,0.5s", 64_000, 1.0, 0.5),
        ("5000bit", 5000, 0.0, 0.0),
    ],
)
def test_link_text_is_read(text: str, rate: int, delay: float, jitter: float) -> None:
    spec = LinkSpec.parse(text)
    assert (spec.rate_bits, spec.delay_s, spec.jitter_s) == (rate, delay, jitter)
    assert LinkSpec.parse(spec.text) == spec


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("fast", "bad rate"),
        ("10mbps", "bad rate"),
        ("10mbit,5", "bad time"),
        ("10mbit,5ms,1ms,2ms", "4 parts"),
        ("10mbit,1ms,2ms", "above the delay"),
        ("100bit", "below 1kbit"),
        ("1gbit,20s", "out of range"),
    ],
)
def test_bad_link_text_is_refused_in_one_line(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        LinkSpec.parse(text)
    message = str(caught.value)
    assert "\n" not in message and ";" in message


def test_links_have_one_default_and_overrides_by_task_or_host() -> None:
    links = parse_links(["1gbit", "worker1=10mbit", "ps:0=100mbit,5ms", "host2=5mbit"])
    assert links.default == LinkSpec(rate_bits=1_000_000_000)
    assert links.overrides == {
        "worker1": LinkSpec(rate_bits=10_000_000),
        "ps0": LinkSpec(rate_bits=100_000_000, delay_s=0.005),
        "host2": LinkSpec(rate_bits=5_000_000),
    }
    assert parse_links([]) == Links()
    assert parse_links(["worker0=1mbit"]).default is None


@pytest.mark.parametrize(
    ("texts", "words"),
    [
        (["1gbit", "10mbit"], "second link"),
        (["worker1=1mbit", "worker:1=2mbit"], "already has a link"),
        (["chief=1mbit"], "names no host or task"),
    ],
)
def test_bad_link_lists_are_refused(texts: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_links(texts)


def test_spread_deals_servers_then_workers_round_robin() -> None:
    placed = place(_tasks(2, 4), 3)
    assert _names(placed) == {
        "ps0": 0,
        "ps1": 1,
        "worker0": 2,
        "worker1": 0,
        "worker2": 1,
        "worker3": 2,
    }


def test_pack_fills_hosts_in_order_as_evenly_as_it_can() -> None:
    assert _names(place(_tasks(2, 4), 3, "pack")) == {
        "ps0": 0,
        "ps1": 0,
        "worker0": 1,
        "worker1": 1,
        "worker2": 2,
        "worker3": 2,
    }
    # 5 tasks on 3 hosts: blocks of 2, 2, 1 (never an empty host)
    assert sorted(place(_tasks(1, 4), 3, Placement.PACK).values()) == [0, 0, 1, 1, 2]


def test_placement_does_not_depend_on_the_order_tasks_are_given() -> None:
    tasks = _tasks(2, 4)
    for policy in Placement:
        assert place(list(reversed(tasks)), 3, policy) == place(tasks, 3, policy)


def test_one_host_takes_every_task() -> None:
    for policy in Placement:
        assert set(place(_tasks(1, 3), 1, policy).values()) == {0}


@pytest.mark.parametrize(
    ("hosts", "policy", "words"),
    [
        (7, "spread", "leave a host empty"),
        (0, "spread", "use 1 to"),
        (MAX_HOSTS + 1, "pack", "use 1 to"),
        (2, "random", "unknown"),
    ],
)
def test_bad_placements_are_refused(hosts: int, policy: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        place(_tasks(2, 4), hosts, policy)


def test_a_task_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        place([*_tasks(1, 2), TaskId.parse("worker1")], 2)


def test_hosts_get_addresses_in_the_benchmarking_range() -> None:
    plan = plan_hosts(count=3, tasks=_tasks(2, 4))
    assert [h.name for h in plan.hosts] == ["host0", "host1", "host2"]
    assert [h.address for h in plan.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    benchmarking = ipaddress.ip_network("198.18.0.0/15")
    subnet = ipaddress.ip_network(f"{plan.bridge_address}/{plan.prefix_len}", strict=False)
    for host in plan.hosts:
        assert ipaddress.ip_address(host.address) in benchmarking
        assert ipaddress.ip_address(host.address) in subnet
    assert plan.bridge_address not in {h.address for h in plan.hosts}
    assert [t.name for t in plan.hosts[0].tasks] == ["ps0", "worker1"]
    assert plan.host_of(TaskId.parse("worker3")).name == "host2"
    assert plan.host("host1").tasks == (TaskId.parse("ps1"), TaskId.parse("worker2"))


def test_the_last_host_address_is_below_the_bridge() -> None:
    plan = plan_hosts(count=MAX_HOSTS, tasks=_tasks(0, MAX_HOSTS))
    assert plan.hosts[-1].address == "198.18.0.252"  # .253: the launcher
    assert len({h.address for h in plan.hosts}) == MAX_HOSTS


def test_each_host_gets_its_link_default_or_override() -> None:
    links = parse_links(["1gbit", "worker1=10mbit", "host2=5mbit"])
    plan = plan_hosts(count=3, tasks=_tasks(2, 4), links=links)
    assert [h.link.text if h.link else None for h in plan.hosts] == ["10mbit", "1gbit", "5mbit"]
    unshaped = plan_hosts(count=2, tasks=_tasks(1, 1))
    assert [h.link for h in unshaped.hosts] == [None, None]


def test_tasks_sharing_a_host_with_different_links_are_refused() -> None:
    links = parse_links(["ps0=10mbit", "worker1=20mbit"])  # both on host0 under spread
    with pytest.raises(ValueError, match="different links"):
        plan_hosts(count=3, tasks=_tasks(2, 4), links=links)
    # the same link twice on one host is fine, and a host override settles a conflict
    same = parse_links(["ps0=10mbit", "worker1=10mbit"])
    assert plan_hosts(count=3, tasks=_tasks(2, 4), links=same).hosts[0].link == LinkSpec(
        rate_bits=10_000_000
    )
    settled = parse_links(["ps0=10mbit", "worker1=20mbit", "host0=30mbit"])
    plan = plan_hosts(count=3, tasks=_tasks(2, 4), links=settled)
    assert plan.hosts[0].link == LinkSpec(rate_bits=30_000_000)


def test_links_for_tasks_or_hosts_not_in_the_run_are_refused() -> None:
    for text in ("worker9=1mbit", "host5=1mbit"):
        with pytest.raises(ValueError, match="no such host or task"):
            plan_hosts(count=3, tasks=_tasks(2, 4), links=parse_links([text]))


def test_unknown_host_or_task_lookups_are_refused() -> None:
    plan = plan_hosts(count=2, tasks=_tasks(1, 1))
    with pytest.raises(ValueError, match="no host"):
        plan.host("host7")
    with pytest.raises(ValueError, match="on no host"):
        plan.host_of(TaskId.parse("worker5"))
