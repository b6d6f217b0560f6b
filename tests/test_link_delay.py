"""An emulated link's delay (``--hosts --link RATE,DELAY[,JITTER]``), added in user space to each
parameter-server call (transport/delay.py): where it comes from (the plan, the launcher's task
environment), its bounds, and that a client's calls wait it."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from distsgd.cluster import Role, TaskId
from distsgd.control.task import TaskEnv
from distsgd.launcher.config import ClusterSize, Hosting, LaunchConfig
from distsgd.launcher.emulated import NoHosts, host_plan
from distsgd.ps import ParameterClient, PartitionPlan, start_server
from distsgd.schemes import make_server_rule
from distsgd.transport.delay import LinkDelay
from distsgd_emulate.hosts import link_delays, parse_links, plan_hosts

PS0, PS1 = TaskId(job=Role.PS, index=0), TaskId(job=Role.PS, index=1)
W0, W1 = TaskId(job=Role.WORKER, index=0), TaskId(job=Role.WORKER, index=1)
SCRIPT = str(Path(__file__).parent / "scripts" / "blobs.py")


def test_the_round_trip_crosses_both_hosts_links_both_ways() -> None:
    links = parse_links(["1gbit,5ms,1ms", "host2=10mbit,20ms"])
    plan = plan_hosts(count=3, tasks=[PS0, W0, W1], links=links)  # ps0, worker0, worker1
    assert plan.round_trip(W0, PS0) == pytest.approx((2 * (0.005 + 0.005), 0.002))
    assert plan.round_trip(W1, PS0) == pytest.approx((2 * (0.020 + 0.005), 0.001))
    one_host = plan_hosts(count=1, tasks=[PS0, W0], links=parse_links(["1gbit,5ms"]))
    assert one_host.round_trip(W0, PS0) == (0.0, 0.0)  # no link crossed
    unshaped = plan_hosts(count=2, tasks=[PS0, W0])
    assert unshaped.round_trip(W0, PS0) == (0.0, 0.0)


def test_the_launcher_gives_each_worker_its_round_trip_to_each_server() -> None:
    config = LaunchConfig(
        script=SCRIPT,
        scheme="hogwild",
        size=ClusterSize(workers=2, ps=2),
        hosting=Hosting(hosts=2, links=("100mbit,10ms",)),
    )
    # spread: ps0 -> host0, ps1 -> host1, worker0 -> host0, worker1 -> host1
    assert link_delays(host_plan(config), 0, 2) == [[0.0, 0.0], [0.04, 0.0]]
    assert link_delays(host_plan(config), 1, 2) == [[0.04, 0.0], [0.0, 0.0]]
    no_delay = LaunchConfig(
        script=SCRIPT,
        scheme="hogwild",
        size=ClusterSize(workers=2),
        hosting=Hosting(hosts=2, links=("1gbit",)),
    )
    assert link_delays(host_plan(no_delay), 0, 1) == []
    assert NoHosts().link_delays(0, 1) == []  # no --hosts


def test_the_task_environment_carries_the_delays_and_refuses_nonsense() -> None:
    env = TaskEnv(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
        task_index=0,
        scheme="hogwild",
        ps_link_delays=[[0.04, 0.002]],
    )
    assert TaskEnv.from_json(env.to_json()).ps_link_delays == [[0.04, 0.002]]
    for bad in ([[0.04]], [[-1.0, 0.0]], [["5ms", 0.0]], [[0.04, 0.0, 1.0]]):
        with pytest.raises(ValueError, match="ps_link_delays"):
            TaskEnv(
                cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                task_index=0,
                scheme="hogwild",
                ps_link_delays=bad,
            )


def test_a_delay_samples_within_its_jitter_and_refuses_what_it_cannot_be() -> None:
    delay = LinkDelay(round_trip_s=0.02, jitter_s=0.004, rng=random.Random(1))
    waits = [delay.sample() for _ in range(2000)]
    assert min(waits) >= 0.012 and max(waits) <= 0.028
    assert abs(sum(waits) / len(waits) - 0.02) < 0.0005
    assert LinkDelay(round_trip_s=0.02).sample() == 0.02
    with pytest.raises(ValueError, match="round trip"):
        LinkDelay(round_trip_s=-0.001)
    with pytest.raises(ValueError, match="round trip"):
        LinkDelay(round_trip_s=61.0)
    with pytest.raises(ValueError, match="jitter"):
        LinkDelay(round_trip_s=0.02, jitter_s=0.011)


def test_every_call_of_a_delayed_client_waits_the_round_trip() -> None:
    server, address, _ = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    arrays = {"w": np.zeros((64, 64), np.float32)}
    plan = PartitionPlan.from_arrays(arrays, 1)
    plain = ParameterClient([address], plan, worker=0, timeout=10.0, retry_seconds=5.0)
    delayed = ParameterClient(
        [address],
        plan,
        worker=1,
        timeout=10.0,
        retry_seconds=5.0,
        link_delays=[LinkDelay(round_trip_s=0.05)],
    )
    try:
        plain.register(arrays, scheme="hogwild", options={"lr": 0.1}, num_workers=2)

        def timed(client: ParameterClient) -> float:
            began = time.monotonic()
            client.pull()
            client.push({"w": np.ones((64, 64), np.float32)})
            return time.monotonic() - began

        for _ in range(3):
            assert timed(delayed) >= 2 * 0.05  # a pull and a push: two round trips
        assert min(timed(plain) for _ in range(3)) < 0.05
    finally:
        plain.close()
        delayed.close()
        server.stop(grace=None).wait(timeout=5)
