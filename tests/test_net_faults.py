"""Network faults of emulated hosts (``--inject-fault partition:...,for=`` and ``slow:``): the
specs parsed, the settings' checks, which faults a worker injects itself, and when the launcher
applies and undoes them (distsgd_emulate/link_faults.py, on recorded fake hosts). All pure: the
namespaces' side is tests/test_netns.py, a whole run tests/test_hosts_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import SCRIPTS

from distsgd.cluster import ClusterSpec, TaskId
from distsgd.control.faults import Fault, FaultInjector
from distsgd.control.metrics import MetricsWriter
from distsgd.launcher import LaunchConfig
from distsgd.launcher.argv import worker_task
from distsgd.launcher.config import ClusterSize, Hosting
from distsgd.launcher.errors import RunFailed
from distsgd_emulate.hosts import Host, plan_hosts
from distsgd_emulate.link_faults import LinkFaults
from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_keeper import NetnsError

BLOBS = str(SCRIPTS / "blobs.py")


@pytest.mark.parametrize(
    ("text", "kind", "job", "index", "step", "seconds", "rate"),
    [
        ("partition:worker:1@step=40,for=10s", "partition", "worker", 1, 40, 10.0, None),
        ("partition:worker:0@step=30+10s", "partition", "worker", 0, 30, 10.0, None),
        ("partition:worker:2@step=5,for=500ms", "partition", "worker", 2, 5, 0.5, None),
        ("partition:ps:0@step=40,for=10s", "partition", "ps", 0, 40, 10.0, None),
        ("slow:ps:0@step=40=10mbit", "slow", "ps", 0, 40, 0.0, 10_000_000),
        ("slow:ps:1@step=40=10mbit,for=10s", "slow", "ps", 1, 40, 10.0, 10_000_000),
        ("slow:worker:1@step=0=1.5gbit", "slow", "worker", 1, 0, 0.0, 1_500_000_000),
        (" slow:worker:1@step=3=500kbit ", "slow", "worker", 1, 3, 0.0, 500_000),
        ("kill:ps:0@step=5", "kill", "ps", 0, 5, 0.0, None),
        ("lose-host:ps:0@step=40", "lose-host", "ps", 0, 40, 0.0, None),
        ("lose-host:worker:1@step=7", "lose-host", "worker", 1, 7, 0.0, None),
        ("delay:worker:2=200ms", "delay", "worker", 2, None, 0.2, None),
    ],
)
def test_specs_parse(
    text: str, kind: str, job: str, index: int, step: int | None, seconds: float, rate: int | None
) -> None:
    fault = Fault.parse(text)
    assert fault == Fault(
        kind=kind, job=job, index=index, step=step, seconds=seconds, rate_bits=rate
    )
    assert fault.network == (kind in ("partition", "slow"))
    assert fault.kills == (kind in ("kill", "lose-host"))
    assert fault.task == f"{job}{index}"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("partition:worker:1@step=40", "partition needs @step=N,for=DURATION"),
        ("partition:worker:1,for=10s", "partition needs @step=N,for=DURATION"),
        ("partition:worker:1@step=4=10mbit,for=1s", "partition needs"),
        ("partition:worker:1@step=4,for=0s", "for= must be above 0s"),
        ("partition:worker:1@step=4,for=1s,for=2s", "give for= once"),
        ("partition:worker:1@step=4,for=1x", "bad duration '1x'"),
        ("slow:ps:0@step=40", "slow needs @step=N=RATE"),
        ("slow:ps:0=10mbit", "slow needs @step=N=RATE"),
        ("slow:ps:0@step=40=10mbt", "bad rate '10mbt'"),
        ("slow:ps:0@step=40=10bit", "of at least 1kbit"),
        ("slow:ps:0@step=40=10mbit,for=0s", "for= must be above 0s"),
        ("kill:worker:1@step=4,for=1s", "kill needs @step=N only"),
        ("lose-host:ps:0", "lose-host needs @step=N only"),
        ("lose-host:ps:0@step=4=1mbit", "lose-host needs @step=N only"),
        ("lose-hosts:ps:0@step=4", "lose-host:ps:0@step=40"),
        ("delay-data:ps:0=1s", "only a worker's data loading can be delayed"),
        ("delay-data:worker:0@step=3=1s", "delay-data needs =DURATION only"),
        ("delay:ps:0", "delay needs =DURATION only"),
        ("delay:worker:1=5", "bad duration '5'"),
        ("cut:worker:1@step=4,for=1s", "use kill:worker:1@step=50"),
        ("partition:host:1@step=4,for=1s", "use kill:worker:1@step=50"),
    ],
)
def test_bad_specs_say_the_fix_in_one_line(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        Fault.parse(text)
    message = str(caught.value)
    assert needle in message
    assert "\n" not in message
    assert text.strip() in message


@pytest.mark.parametrize(
    "fault",
    [
        "slow:ps:0@step=10=10mbit",
        "slow:worker:1@step=10=10mbit",
        "partition:ps:0@step=10,for=2s",
        "lose-host:ps:0@step=10",
        "lose-host:worker:1@step=10",
    ],
)
def test_link_faults_need_hosts(fault: str) -> None:
    with pytest.raises(ValueError) as caught:
        LaunchConfig(script=BLOBS, scheme="hogwild", faults=(fault,), size=ClusterSize(workers=2))
    assert "add --hosts N" in str(caught.value)
    assert "\n" not in str(caught.value)
    LaunchConfig(
        script=BLOBS,
        scheme="hogwild",
        faults=(fault,),
        size=ClusterSize(workers=2),
        hosting=Hosting(hosts=3),
    )


def test_a_fault_of_a_missing_task_is_refused_under_hosts() -> None:
    with pytest.raises(ValueError, match="there is no ps1"):
        LaunchConfig(
            script=BLOBS,
            scheme="hogwild",
            faults=("slow:ps:1@step=1=1mbit",),
            size=ClusterSize(workers=2),
            hosting=Hosting(hosts=3),
        )


def _worker_faults(config: LaunchConfig, index: int) -> tuple[Fault, ...]:
    spec = ClusterSpec.local(num_ps=1, num_workers=config.size.workers)
    env = worker_task(
        config,
        index,
        spec=spec,
        run_dir=SCRIPTS,
        run_id="r",
        rendezvous="",
        ps_address_files=[],
        active=config.size.workers,
        resume=None,
    )
    return env.faults


def test_a_partition_is_simulated_by_the_worker_only_without_hosts() -> None:
    faults = ("partition:worker:1@step=40,for=5s", "delay:worker:1=10ms")
    plain = LaunchConfig(script=BLOBS, scheme="hogwild", faults=faults, size=ClusterSize(workers=2))
    assert [f.kind for f in _worker_faults(plain, 1)] == ["partition", "delay"]
    assert _worker_faults(plain, 0) == ()
    hosts = LaunchConfig(
        script=BLOBS,
        scheme="hogwild",
        faults=(*faults, "slow:worker:1@step=3=1mbit"),
        size=ClusterSize(workers=2),
        hosting=Hosting(hosts=3),
    )
    assert [f.kind for f in _worker_faults(hosts, 1)] == ["delay"]  # the launcher cuts the link


def test_the_worker_ignores_link_faults() -> None:
    injector = FaultInjector([Fault.parse("slow:worker:0@step=0=1mbit,for=5s")])
    injector.before_step(10)
    assert not injector.partitioned


class _FakeHosts:
    """What LinkFaults calls on EmulatedHosts, recorded (no namespace)."""

    def __init__(self) -> None:
        tasks = [TaskId.parse(n) for n in ("ps0", "worker0", "worker1")]
        self.plan = plan_hosts(count=2, tasks=tasks)
        self.calls: list[tuple[str, str, int | None]] = []

    def cut(self, host: Host | str) -> None:
        self.calls.append(("cut", _name(host), None))

    def heal(self, host: Host | str) -> None:
        self.calls.append(("heal", _name(host), None))

    def set_rate(self, host: Host | str, rate_bits: int | None) -> None:
        self.calls.append(("rate", _name(host), rate_bits))


def _name(host: Host | str) -> str:
    return host if isinstance(host, str) else host.name


def test_link_faults_apply_at_their_step_heal_after_for_and_at_the_end(tmp_path: Path) -> None:
    specs = ["partition:worker:1@step=40,for=5s", "slow:ps:0@step=50=10mbit", "kill:ps:0@step=9"]
    now = [1000.0]
    hosts = _FakeHosts()
    notes: list[str] = []
    events = MetricsWriter(tmp_path / "metrics.jsonl", "launcher")
    recorded: list[list[dict[str, Any]]] = []
    faults = LinkFaults(
        [Fault.parse(s) for s in specs],
        cast(EmulatedHosts, hosts),
        events=events,
        note=notes.append,
        run_dir=tmp_path,
        clock=lambda: now[0],
    )
    faults._record = lambda: recorded.append(faults.records())  # type: ignore[method-assign]
    faults.poll(39)
    assert hosts.calls == []
    faults.poll(41)  # spread: ps0 and worker1 on host0, worker0 on host1
    assert hosts.calls == [("cut", "host0", None)]
    now[0] += 4.9
    faults.poll(45)
    assert len(hosts.calls) == 1
    now[0] += 0.2
    faults.poll(52)
    assert hosts.calls[1:] == [("heal", "host0", None), ("rate", "host0", 10_000_000)]
    faults.restore(60)
    faults.restore(61)  # nothing left to undo
    assert hosts.calls[3:] == [("rate", "host0", None)]
    first, second = faults.records()
    assert first["kind"] == "partition" and first["tasks"] == ["ps0", "worker1"]
    assert (first["step"], first["healed_step"], first["lasted_s"]) == (41, 52, 5.1)
    assert (second["rate_bits"], second["for_s"], second["healed_step"]) == (10**7, None, 60)
    assert len(recorded) == 3 and recorded[-1] == faults.records()
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["fault"]) for e in lines] == [
        ("fault_injected", "partition"),
        ("fault_healed", "partition"),
        ("fault_injected", "slow"),
        ("fault_healed", "slow"),
    ]
    assert "host0 cut off (ps0, worker1) for 5s at step 41" in notes[0]
    assert len(notes) == 3  # undone at the end: no note (the result is the console's last line)


def test_without_hosts_there_are_no_link_faults(tmp_path: Path) -> None:
    faults = LinkFaults(
        [Fault.parse("partition:worker:1@step=1,for=1s")],
        None,
        events=MetricsWriter(None, "launcher"),
        note=print,
        run_dir=tmp_path,
    )
    faults.poll(100)
    faults.restore(100)
    assert faults.pending == [] and faults.records() == []


def test_a_link_that_cannot_be_changed_fails_the_run_in_one_line(tmp_path: Path) -> None:
    hosts = _FakeHosts()

    def refuse(host: Host | str) -> None:
        raise NetnsError("ip failed in switch (exit 2): Cannot find device")

    hosts.cut = refuse  # type: ignore[method-assign]
    faults = LinkFaults(
        [Fault.parse("partition:worker:0@step=1,for=1s")],
        cast(EmulatedHosts, hosts),
        events=MetricsWriter(None, "launcher"),
        note=print,
        run_dir=tmp_path,
    )
    with pytest.raises(RunFailed, match="could not be applied or undone: ip failed"):
        faults.poll(1)
