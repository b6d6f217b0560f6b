"""The straggler detector (control/stragglers.py) on synthetic metrics lines: each cause, chronic
against one-off, nothing named in noise; the new fault specs that make stragglers; and one short
real run that names its delayed worker."""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from conftest import alive, distsgd_cmd, wait_for

from distsgd.control.faults import Fault, FaultInjector
from distsgd.control.stragglers import Change, StragglerDetector, progress_note
from distsgd.launcher.argv import server_argv
from distsgd.launcher.config import ClusterSize, LaunchConfig
from distsgd_compare.summary import stragglers_named

T0 = 1_700_000_000.0
FAST = {"compute": 0.02, "data": 0.001, "pull": 0.005, "push": 0.006}
"""A worker's seconds per step by phase, in a run without faults."""
CALLS = {"ps0": {"pull": 0.004, "push": 0.005}, "ps1": {"pull": 0.004, "push": 0.005}}
"""Its seconds per step of the calls to each server."""


def _lines(
    phases: Mapping[str, Mapping[str, float]],
    calls: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    *,
    seconds: float = 40.0,
    every: int = 10,
    noise: float = 0.0,
    seed: int = 0,
    stall: tuple[str, float, float] | None = None,
) -> list[dict]:
    """Each worker's step lines (every ``every`` steps) for ``seconds``: ``phases[worker]``
    seconds per step, ``calls[worker]`` of each server's calls; each line's time drawn up to
    ``noise`` (a share) off; ``stall``: (worker, at, seconds): its first line after ``at``
    record seconds took ``seconds`` more compute (one stall)."""
    rng = random.Random(seed)
    out: list[dict] = []
    for task, per_step in phases.items():
        now, step = T0, 0
        total = dict.fromkeys(per_step, 0.0)
        served = {s: {"pull": 0.0, "push": 0.0} for s in CALLS}
        while now < T0 + seconds:
            if stall is not None and stall[0] == task and stall[1] <= now - T0:
                total["compute"] += stall[2]
                stall = None
            factor = 1 + rng.uniform(-noise, noise)
            for phase, s in per_step.items():
                total[phase] += s * every * factor
            for server, methods in (calls or {}).get(task, CALLS).items():
                for method, s in methods.items():
                    served[server][method] += s * every * factor
            step += every
            now = T0 + sum(total.values())
            out.append(
                {
                    "time": now,
                    "task": task,
                    "step": step,
                    "local_step": step,
                    "samples": 32 * step,
                    "server_s": served,
                    **{f"{p}_s": s for p, s in total.items()},
                }
            )
            served = {k: dict(v) for k, v in served.items()}
    return sorted(out, key=lambda r: r["time"])


def _feed(records: list[dict], busy: Mapping[str, dict] | None = None) -> list[Change]:
    """Feed the records as the launcher does (a decision after each), with ``shard_load``
    events of these ``busy`` fields every 5 s; every change made."""
    detector = StragglerDetector()
    loads = [
        {"time": T0 + t, "task": "launcher", "event": "shard_load", "ps": int(ps[2:]), **b}
        for t in range(0, 60, 5)
        for ps, b in (busy or {}).items()
    ]
    changes: list[Change] = []
    for record in sorted(records + loads, key=lambda r: r["time"]):
        detector.see(record)
        changes += detector.update()
    return changes


def _workers(n: int = 4, **slow: Mapping[str, float]) -> dict[str, dict[str, float]]:
    return {f"worker{i}": {**FAST, **slow.get(f"worker{i}", {})} for i in range(n)}


def _named(changes: list[Change]) -> list[tuple[str, str]]:
    return [(c.finding.task, c.finding.cause) for c in changes if c.state == "named"]


@pytest.mark.parametrize(
    ("slow", "cause"),
    [({"compute": 0.08}, "compute"), ({"data": 0.06}, "data"), ({"push": 0.05}, "link")],
)
def test_a_slow_worker_is_named_with_its_cause(slow: dict[str, float], cause: str) -> None:
    changes = _feed(_lines(_workers(worker2=slow)))
    assert _named(changes) == [("worker2", cause)]
    first = changes[0]
    assert first.finding.score >= 1.5 and first.finding.vs_fastest >= first.finding.score
    assert [c.state for c in changes] == ["named", "chronic"] or first.finding.chronic


def test_under_a_synchronous_step_the_slow_worker_is_named_not_the_ones_waiting() -> None:
    waiting = {"compute": 0.02, "wait": 0.06}  # the fast ones wait at the server for the slow
    phases = {**_workers(3, worker0=waiting, worker1=waiting), "worker2": {**FAST, "compute": 0.08}}
    changes = _feed(_lines(phases))
    assert _named(changes) == [("worker2", "compute")]


def _slow_ps1(method: str, seconds: float) -> dict[str, dict[str, dict[str, float]]]:
    calls = {**CALLS, "ps1": {**CALLS["ps1"], method: seconds}}
    return {f"worker{i}": calls for i in range(4)}


@pytest.mark.parametrize(
    ("method", "busy", "cause"),
    [
        ("pull", {"busy": 1.8, "pull_busy": 1.2}, "server"),
        ("pull", {"busy": 0.05, "pull_busy": 0.02}, "link"),
        ("pull", {"busy": 1.8, "pull_busy": 0.02}, "link"),  # its pushes wait for its replica
        ("push", {"busy": 1.8, "pull_busy": 0.02}, "server"),  # pulls from shared memory
        ("push", {"busy": 0.05}, "link"),
    ],
)
def test_a_server_slow_for_every_worker_is_named_by_its_busy_share(
    method: str, busy: dict, cause: str
) -> None:
    phases = _workers(**{f"worker{i}": {method: 0.05} for i in range(4)})
    fast = {k: 0.05 if k == "busy" else 0.02 for k in busy}
    changes = _feed(_lines(phases, _slow_ps1(method, 0.05)), busy={"ps0": fast, "ps1": busy})
    assert _named(changes) == [("ps1", cause)]
    assert changes[-1].finding.chronic


def test_a_server_whose_pushes_wait_for_a_slow_replica_is_not_named() -> None:
    calls = {"ps0": {"pull": 0.004, "push": 0.06}, "ps1": {"pull": 0.05, "push": 0.02}}
    phases = _workers(**{f"worker{i}": {"pull": 0.05, "push": 0.06} for i in range(4)})
    changes = _feed(_lines(phases, {f"worker{i}": calls for i in range(4)}))
    assert _named(changes) == [("ps1", "link")]


def test_a_server_whose_replica_sits_on_a_slow_workers_host_is_not_named() -> None:
    """worker1's link is slow, and ps1's log replica is on worker1's host: every worker's
    pushes to ps1 wait for it (ps1 busy), but the one to name is worker1."""
    calls = {**CALLS, "ps1": {"pull": 0.004, "push": 0.05}}
    slow = {**calls, "ps0": {"pull": 0.04, "push": 0.05}, "ps1": {"pull": 0.04, "push": 0.09}}
    per_worker = {f"worker{i}": slow if i == 1 else calls for i in range(4)}
    phases = _workers(**{f"worker{i}": {"push": 0.05} for i in range(4)})
    phases["worker1"] = {**phases["worker1"], "pull": 0.08, "push": 0.09}
    busy = {"ps0": {"busy": 0.05, "pull_busy": 0.02}, "ps1": {"busy": 1.5, "pull_busy": 0.02}}
    assert _named(_feed(_lines(phases, per_worker), busy=busy)) == [("worker1", "link")]


def test_a_one_off_stall_is_named_not_chronic_and_cleared() -> None:
    """A stall longer than a window (a shorter one is diluted by the window's other steps)."""
    changes = _feed(_lines(_workers(), seconds=60, stall=("worker1", 20.0, 8.0)))
    assert [(c.state, c.finding.task, c.finding.chronic) for c in changes] == [
        ("named", "worker1", False),
        ("cleared", "worker1", False),
    ]


def test_a_worker_that_finishes_is_cleared_and_stays_a_peer() -> None:
    records = _lines(_workers(worker3={"compute": 0.1}))
    end = max(r["time"] for r in records if r["task"] == "worker0")
    records = [r for r in records if r["task"] != "worker0" or r["time"] < T0 + 15]
    records.append({"time": T0 + 15, "task": "worker0", "event": "finished_steps"})
    changes = _feed([*records, {"time": end, "task": "worker3", "event": "finished_steps"}])
    assert (changes[0].state, changes[0].finding.task) == ("named", "worker3")
    assert changes[-1].state == "cleared" and changes[-1].finding.task == "worker3"


@pytest.mark.parametrize("seed", range(10))
def test_noise_names_nothing(seed: int) -> None:
    phases = _workers()
    rng = random.Random(seed)
    for task in phases:  # each worker a little off the others, every line off by up to 25%
        phases[task] = {p: s * rng.uniform(0.85, 1.15) for p, s in phases[task].items()}
    assert _feed(_lines(phases, seconds=60, noise=0.25, seed=seed)) == []


def test_old_lines_without_data_or_server_seconds_still_work() -> None:
    records = _lines(_workers(worker1={"compute": 0.1}))
    for record in records:
        record.pop("data_s"), record.pop("server_s")
    assert _named(_feed(records)) == [("worker1", "compute")]


def test_the_progress_note_and_the_event_fields() -> None:
    changes = _feed(_lines(_workers(worker2={"data": 0.06})))
    finding = changes[0].finding
    assert progress_note([finding]) == f"straggler worker2 (data, {finding.score:.1f}x)"
    assert progress_note([]) == ""
    fields = finding.fields()
    assert fields["target"] == "worker2" and fields["cause"] == "data"
    assert set(fields) == {"target", "score", "vs_fastest", "vs_best", "cause", "chronic"}


def test_compare_lists_the_stragglers_each_once() -> None:
    def event(state: str, target: str, cause: str) -> dict:
        return {"event": "straggler", "state": state, "target": target, "cause": cause}

    records = [
        event("named", "worker2", "data"),
        event("chronic", "worker2", "data"),
        event("cleared", "worker2", "data"),
        event("named", "ps1", "server"),
        {"event": "shard_load", "ps": 1},
    ]
    assert stragglers_named(records) == ["worker2 (data)", "ps1 (server)"]
    assert stragglers_named([]) == []


def test_the_slow_server_and_slow_loader_faults_parse_and_reach_their_task(tmp_path: Path) -> None:
    data = Fault.parse("delay-data:worker:1=150ms")
    assert (data.kind, data.task, data.seconds) == ("delay-data", "worker1", 0.15)
    server = Fault.parse("delay:ps:1=20ms")
    assert (server.kind, server.task, server.seconds) == ("delay", "ps1", 0.02)
    script = tmp_path / "train.py"
    script.write_text("")
    faults = ("delay:ps:1=20ms", "delay-data:worker:0=1ms")
    config = LaunchConfig(script=str(script), size=ClusterSize(workers=2, ps=2), faults=faults)
    argv = {i: server_argv(config, i, **_server_paths(tmp_path)) for i in (0, 1)}
    assert "--inject-delay" not in argv[0]
    assert argv[1][argv[1].index("--inject-delay") + 1] == "0.02"
    injector = FaultInjector([Fault.parse("delay-data:worker:0=30ms")])
    started = time.perf_counter()
    injector.before_step(0)  # a loader's delay is not a step's
    assert time.perf_counter() - started < 0.02
    injector.before_fetch()
    assert time.perf_counter() - started >= 0.03


def _server_paths(tmp_path: Path) -> dict[str, Path | str | None]:
    return {
        "cluster_file": tmp_path / "c.json",
        "address": "127.0.0.1:0",
        "address_file": tmp_path / "a",
        "checkpoint_dir": tmp_path / "ck",
        "wal_dir": tmp_path / "wal",
        "restore": None,
    }


def test_a_real_run_names_its_delayed_worker(tmp_path: Path) -> None:
    """2 workers, hogwild, worker1's every step 150 ms late: the launcher's ``straggler``
    event names worker1 with cause compute (then the run is stopped: the test ends there)."""
    run_dir = tmp_path / "run"
    args = ["demo", "--workers", "2", "--ps", "1", "--scheme", "hogwild", "--steps", "400"]
    args += ["--log-every", "5", "--quiet", "--run-dir", str(run_dir)]
    args += ["--inject-fault", "delay:worker:1=150ms"]
    launcher = subprocess.Popen(
        distsgd_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    found: list[dict] = []

    def named() -> bool:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return False
        found[:] = [r for r in map(json.loads, lines) if r.get("event") == "straggler"]
        return bool(found)

    try:
        assert wait_for(named, timeout=40), "no straggler named"
    finally:
        launcher.terminate()
        launcher.wait(timeout=30)
    assert (found[0]["target"], found[0]["cause"], found[0]["state"]) == (
        "worker1",
        "compute",
        "named",
    )
    assert not alive([launcher.pid])
