"""The cost model (``distsgd.plan``) and ``distsgd plan``: the equations on hand-made parts,
each bound in the regime where it binds, the recommendation, every scheme's declared traffic,
the probe's arithmetic on recorded metrics, and the command (one real probe run)."""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Any

import loadclock
import pytest
from conftest import ROOT

from distsgd import schemes
from distsgd.cli.main import main as cli_main
from distsgd.launcher import probe
from distsgd.plan.choices import (
    ASSUMED_PATHS,
    pull_factor,
    push_encode,
    push_factor,
    recommend,
)
from distsgd.plan.cost import Cluster, Part, Path, Setting, Workload, predict
from distsgd.plan.traffic import Exchange, Traffic

B = 2.7e6
C = 5e-3


def part(value: float) -> Part:
    return Part(value=value, source="given: test")


def path(beta: float = 1e9, latency: float = 0.0, encoded_pulls: bool = True) -> Path:
    return Path(
        name="test",
        latency=part(latency),
        pull=part(beta),
        push=part(beta),
        encoded_pulls=encoded_pulls,
    )


WORK = Workload(param_bytes=part(B), step=part(C))


def setting(kind: str = "async", period: int = 1, overlap: bool = False, **kw: Any) -> Setting:
    return Setting(label=kind, exchange=Exchange(kind=kind, period=period, overlap=overlap), **kw)


def test_async_without_contention_is_compute_plus_exchange() -> None:
    got = predict(setting(), WORK, Cluster(workers=2, ps=1), path(beta=1e9))
    step = C + 2 * B / 1e9
    assert got.rate == pytest.approx(2 / step)
    assert got.bottleneck == "compute and exchange"
    assert got.bytes_per_step == pytest.approx(2 * B)
    # staleness: the other worker's pushes while this one computes and pushes
    assert got.staleness == pytest.approx(0.5 * got.rate * (C + B / 1e9))


def test_a_window_divides_the_exchange_and_overlap_hides_it() -> None:
    cluster = Cluster(workers=2, ps=1)
    windowed = predict(setting(period=10), WORK, cluster, path(beta=1e9))
    assert windowed.rate == pytest.approx(2 / (C + 2 * B / 1e9 / 10))
    assert windowed.bytes_per_step == pytest.approx(2 * B / 10)
    hidden = predict(setting(overlap=True), WORK, cluster, path(beta=1e10))
    assert hidden.rate == pytest.approx(2 / C)  # the exchange (0.54 ms) is under the compute
    assert hidden.staleness > predict(setting(), WORK, cluster, path(beta=1e10)).staleness


def test_a_slow_link_binds_at_the_server_and_fewer_bytes_lift_it() -> None:
    link = 125e6  # 1 Gbit/s
    cluster = Cluster(workers=8, ps=1, link=link)
    got = predict(setting(), WORK, cluster, path(beta=1e9))
    assert got.bottleneck == "server link"
    assert got.rate == pytest.approx(link / B)
    half = predict(setting(push_factor=0.5, pull_factor=0.5), WORK, cluster, path(beta=1e9))
    assert half.rate == pytest.approx(2 * got.rate)
    two = predict(setting(), WORK, Cluster(workers=8, ps=2, link=link), path(beta=1e9))
    assert two.rate == pytest.approx(2 * got.rate)
    assert two.server_link_bytes_per_step == pytest.approx(got.server_link_bytes_per_step / 2)


def test_sync_rounds_share_the_servers_link() -> None:
    link = 125e6
    got = predict(setting("sync"), WORK, Cluster(workers=4, ps=1, link=link), path(beta=1e9))
    # pushes of 4 workers in, then pulls of 4 out: one way of the link idles in each phase
    assert got.rate == pytest.approx(4 / (C + 2 * 4 * B / link))
    assert got.staleness == 0.0


def test_pulls_and_pushes_crossing_on_a_link_slow_the_servers_link() -> None:
    """Where a server's link carries pulls out and pushes in at once, each way moves at D
    of its rate (``--link`` measured): the link's bound scales by D, from 2 workers on."""
    link = 125e6
    full = predict(setting(), WORK, Cluster(workers=8, ps=1, link=link), path(beta=1e9))
    slowed = Cluster(workers=8, ps=1, link=link, duplex=0.6)
    got = predict(setting(), WORK, slowed, path(beta=1e9))
    assert got.rate == pytest.approx(0.6 * full.rate) and got.bottleneck == "server link"
    one = Cluster(workers=1, ps=1, link=link, duplex=0.6)  # its pull and push never cross
    assert predict(setting(), WORK, one, path(beta=1e9)).rate == pytest.approx(
        predict(setting(), WORK, Cluster(workers=1, ps=1, link=link), path(beta=1e9)).rate
    )


def test_a_round_whose_pulls_go_in_turn_overlaps_them_with_the_pushes() -> None:
    """Q = 1: each worker's pull in turn, its push as the next pull goes out (at D); Q = 0 is
    the shared round above; between, the model weighs the two."""
    link, n = 125e6, 4
    t = B / link
    shared = predict(setting("sync"), WORK, Cluster(workers=n, ps=1, link=link), path(beta=1e9))
    turn = Cluster(workers=n, ps=1, link=link, turns=1.0, duplex=0.5)
    in_turn = predict(setting("sync"), WORK, turn, path(beta=1e9))
    assert in_turn.rate == pytest.approx(n / (C + 2 * t + (n - 1) * t / 0.5))
    half = Cluster(workers=n, ps=1, link=link, turns=0.5, duplex=0.5)
    mixed = predict(setting("sync"), WORK, half, path(beta=1e9))
    assert 1 / mixed.rate == pytest.approx((1 / shared.rate + 1 / in_turn.rate) / 2)


def test_the_simulator_slows_crossing_transfers_and_serves_round_pulls_in_turn() -> None:
    link = 125e6
    crossing = Cluster(workers=2, ps=1, link=link, duplex=0.5)
    model = predict(setting(), WORK, crossing, path(beta=1e9)).rate
    played = sim(setting(), crossing).rate
    assert played < sim(setting(), Cluster(workers=2, ps=1, link=link)).rate
    assert played == pytest.approx(model, rel=0.25)
    turn = Cluster(workers=4, ps=1, link=link, turns=1.0, duplex=0.7)
    model = predict(setting("sync"), WORK, turn, path(beta=1e9)).rate
    assert sim(setting("sync"), turn).rate == pytest.approx(model, rel=0.25)
    shared = Cluster(workers=4, ps=1, link=link, duplex=0.7)
    assert sim(setting("sync"), turn).rate > sim(setting("sync"), shared).rate


def test_shared_cores_bound_the_rate() -> None:
    got = predict(setting(), WORK, Cluster(workers=8, ps=1, cores=2), path(beta=1e9))
    assert got.bottleneck == "cpu"
    assert got.rate == pytest.approx(2 / (C + 2 * B / 1e9))


def test_the_ring_all_reduce_sends_two_n_minus_one_over_n() -> None:
    got = predict(setting("collective"), WORK, Cluster(workers=4, ps=0), path(beta=1e9))
    sent = 2 * 3 / 4 * B
    assert got.rate == pytest.approx(4 / (C + sent / 1e9))
    assert got.bytes_per_step == pytest.approx(2 * sent)
    assert got.server_link_bytes_per_step == 0.0 and got.staleness == 0.0


def test_shared_memory_pulls_stay_float32() -> None:
    cluster = Cluster(workers=2, ps=1)
    plain = predict(setting(), WORK, cluster, path(encoded_pulls=False))
    asked = predict(setting(pull_factor=0.5), WORK, cluster, path(encoded_pulls=False))
    assert asked.rate == pytest.approx(plain.rate)


def test_encoding_costs_cpu() -> None:
    cluster = Cluster(workers=2, ps=1)
    plain = predict(setting(), WORK, cluster, path(beta=1e10))
    encoded = predict(setting(push_factor=0.25, push_encode=1e-9), WORK, cluster, path(beta=1e10))
    assert encoded.rate < plain.rate  # memory-speed path: the encoding costs more than it saves


def test_wire_factors() -> None:
    assert push_factor() == 1.0 and push_factor("bf16") == 0.5 and push_factor("int8") == 0.25
    assert push_factor("float32", topk=0.01) == pytest.approx(0.02)
    assert pull_factor("bf16") == 0.5 and pull_factor() == 1.0
    assert push_factor("int4") == pytest.approx((0.5 + 4 / 128) / 4)  # a scale per 128 values
    assert push_factor("int2") == pytest.approx((0.25 + 4 / 128) / 4)
    assert push_encode("int4") > push_encode("int8") > push_encode("bf16") > push_encode() == 0.0
    with pytest.raises(ValueError, match="wire dtype"):
        push_factor("int3")


def test_recommend_compresses_on_a_slow_link_but_not_on_one_host() -> None:
    base = setting()
    link = Cluster(workers=2, ps=1, link=125e6, cores=2)
    got, flags = recommend(base, WORK, link, lambda c: ASSUMED_PATHS["tensor socket"])
    assert "--wire-dtype" in flags and got.rate > predict(base, WORK, link, path()).rate
    local = Cluster(workers=2, ps=1, cores=2)
    _, flags = recommend(base, WORK, local, lambda c: ASSUMED_PATHS["shared memory"])
    assert flags == "--ps 1"


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Part(value=-1.0, source="x"),
        lambda: Part(value=math.nan, source="x"),
        lambda: Exchange(kind="async", period=0),
        lambda: Exchange(kind="gossip"),  # type: ignore[arg-type]
        lambda: Cluster(workers=0, ps=1),
        lambda: Cluster(workers=2, ps=1, link=0.0),
        lambda: Cluster(workers=2, ps=1, duplex=0.0),
        lambda: Cluster(workers=2, ps=1, turns=1.5),
        lambda: Setting(label="x", exchange=Exchange(kind="async"), push_factor=0.0),
    ],
)
def test_bad_parts_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_declares_its_traffic(name: str) -> None:
    spec = schemes.get(name)
    assert spec.traffic is not None, f"{name}: add traffic=Traffic(...) to its SchemeSpec"
    exchange = spec.exchange(spec.options())
    assert (exchange.kind == "collective") == spec.collective
    if spec.traffic.period_option:
        option = spec.traffic.period_option
        assert exchange.period == getattr(spec.options(), option)


def test_traffic_reads_the_options() -> None:
    spec = schemes.get("downpour")
    exchange = spec.exchange(spec.parse_options({"window": 7, "overlap": True}))
    assert exchange == Exchange(kind="async", period=7, overlap=True)
    assert Traffic(kind="sync").resolve(object()) == Exchange(kind="sync")


def test_the_probe_reads_steady_state_per_step_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    def line(step: int, compute: float, pull: float, push: float, **kw: Any) -> dict[str, Any]:
        return {
            "task": "worker0",
            "local_step": step,
            "compute_s": compute,
            "pull_s": pull,
            "push_s": push,
            **kw,
        }

    records = [
        line(10, 0.08, 0.03, 0.05, bytes_sent=27_000_000),  # the slow first steps
        line(20, 0.13, 0.04, 0.07, bytes_sent=54_000_000),
        line(30, 0.18, 0.05, 0.09, bytes_sent=81_000_000),
        line(30, 0.18, 0.05, 0.09, event="finished_steps", seconds=0.4),
    ]
    monkeypatch.setattr(probe, "_run", lambda *a, **k: records)
    got = probe.probe_exchange("s.py", shared_memory=True)
    assert got.param_bytes == 2_700_000 and got.steps == 20  # from step 10 on
    assert (got.compute_s, got.pull_s, got.push_s) == pytest.approx((0.005, 0.001, 0.002))
    monkeypatch.setattr(probe, "_run", lambda *a, **k: records[:3])
    with pytest.raises(probe.ProbeFailed, match="finished_steps"):
        probe.probe_exchange("s.py", shared_memory=False)


def test_plan_with_given_parts_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["plan", "--assume", "--step-ms", "4.6", "--model-mb", "2.7", "--workers", "4"]
    assert cli_main([*flags, "--link", "1gbit", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "| hogwild |" in out and "| downpour(window=10) |" in out
    assert "assumed: tensor socket" in out and "given: --step-ms" in out
    assert cli_main([*flags, "--json", "--schemes", "sync,allreduce"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = [p["setting"]["exchange"]["kind"] for p in report["predictions"]]
    assert kinds == ["sync", "collective"]
    assert report["predictions"][1]["recommended"] is None


def test_plan_refuses_assume_without_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--assume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-ms" in err[0]


def test_plan_measures_a_script() -> None:
    """One real probe run (Hogwild, 1 worker + 1 ps) of the benchmark's MLP script."""
    cmd = [sys.executable, "-m", "distsgd", "plan", "--json", "--schemes", "hogwild"]
    script = str(ROOT / "benchmarks" / "mlp_script.py")
    done = loadclock.run([*cmd, script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["workload"]["param_bytes"]["value"] == 669_706 * 4
    assert report["workload"]["step"]["source"].startswith("measured")
    (hogwild,) = report["predictions"]
    assert hogwild["rate"] > 0 and hogwild["path"]["pull"]["source"].startswith("measured")


# --------------------------------------------------------------------------- the simulator


def sim(s: Setting, cluster: Cluster, p: Path | None = None, **kw: Any) -> Any:
    from distsgd.plan.simulate import simulate

    return simulate(s, WORK, cluster, p or path(beta=1e9), steps=kw.pop("steps", 200), **kw)


@pytest.mark.parametrize(
    ("s", "cluster"),
    [
        (setting(), Cluster(workers=1, ps=1)),  # a worker on its own: compute + exchange
        (setting(period=10), Cluster(workers=2, ps=1, cores=2)),
        (setting(), Cluster(workers=8, ps=1, link=125e6)),  # the server's link binds
        (setting(), Cluster(workers=8, ps=2, link=125e6)),
        (setting(), Cluster(workers=8, ps=1, cores=2)),  # the cores bind
        (setting("collective"), Cluster(workers=4, ps=0)),
    ],
)
def test_the_simulator_agrees_with_the_model_where_one_bound_rules(
    s: Setting, cluster: Cluster
) -> None:
    played = sim(s, cluster)
    assert played.rate == pytest.approx(predict(s, WORK, cluster, path(beta=1e9)).rate, rel=0.03)
    assert played.worker_steps == 200 * cluster.workers


def test_the_simulator_queues_where_the_model_takes_a_minimum() -> None:
    """Near the knee (link and loop nearly equal) queues cost throughput the roofline misses."""
    cluster = Cluster(workers=3, ps=1, link=125e6)
    model = predict(setting(), WORK, cluster, path(beta=1e9)).rate
    assert sim(setting(), cluster).rate < model


def test_the_simulator_reports_load_staleness_and_stragglers() -> None:
    from distsgd.plan.simulate import Stragglers

    cluster = Cluster(workers=4, ps=2, link=125e6)
    played = sim(setting(), cluster, stragglers=Stragglers(sigma=0.3), seed=1)
    assert len(played.server_busy) == 2 and len(played.link_busy) == 2
    assert all(0 < b <= 1.0 + 1e-9 for b in played.link_busy)
    assert sum(played.staleness.values()) == 200 * 4 * 2  # one per server piece of each push
    assert played.staleness_mean() > 0
    slow = sim(setting(), Cluster(workers=4, ps=1), stragglers=Stragglers(slow=2, factor=3.0))
    even = sim(setting(), Cluster(workers=4, ps=1))
    assert slow.rate < even.rate
    synced = sim(setting("sync"), Cluster(workers=4, ps=1), stragglers=Stragglers(sigma=0.3))
    assert set(synced.staleness) == {0}
    again = sim(setting(), cluster, stragglers=Stragglers(sigma=0.3), seed=1)
    assert again.rate == played.rate  # seeded: the same run


def test_windows_that_end_together_share_the_servers_link_in_the_simulator() -> None:
    """DOWNPOUR across hosts: two workers compute their windows side by side (2 cores) and
    exchange at once, each transfer taking twice one alone, as the cost model counts them."""
    cluster = Cluster(workers=2, ps=1, link=125e6, cores=2)
    s = setting(period=10)
    played = sim(s, cluster)
    model = predict(s, WORK, cluster, path(beta=1e9)).rate
    assert played.rate == pytest.approx(model, rel=0.1)
    # Every window's update is applied once: one per server piece of each exchange.
    assert sum(played.staleness.values()) == 2 * 200 // 10
    # With one core the windows take turns, and so do their exchanges: faster than together.
    alone = sim(s, Cluster(workers=2, ps=1, link=125e6, cores=1))
    one_core = predict(s, WORK, Cluster(workers=2, ps=1, link=125e6, cores=1), path(beta=1e9))
    assert alone.rate == pytest.approx(one_core.rate, rel=0.15)


def test_windowed_schemes_across_hosts_get_a_range_and_others_one_rate() -> None:
    """Together (the rate) or staggered (each exchange alone on the link): both predicted,
    and the simulator plays either; Hogwild and one-host runs have one regime."""
    cluster = Cluster(workers=2, ps=1, link=125e6, cores=2)
    got = predict(setting(period=10), WORK, cluster, path(beta=1e9))
    assert got.staggered is not None and got.staggered > got.rate * 1.2
    apart = sim(setting(period=10), cluster, staggered=True)
    assert apart.rate == pytest.approx(got.staggered, rel=0.15)
    assert predict(setting(), WORK, cluster, path(beta=1e9)).staggered is None
    one_host = Cluster(workers=2, ps=1, cores=2)
    assert predict(setting(period=10), WORK, one_host, path(beta=1e9)).staggered is None


def test_overlap_hides_the_exchange_in_the_simulator() -> None:
    cluster = Cluster(workers=2, ps=1)
    hidden = sim(setting(overlap=True), cluster, path(beta=1e10))
    assert hidden.rate == pytest.approx(2 / C, rel=0.03)


def test_simulate_command_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [
        "plan",
        "--simulate",
        "--assume",
        "--step-ms",
        "5",
        "--model-mb",
        "10",
        "--link",
        "1gbit",
    ]
    argv = [*flags, "--schemes", "hogwild", "--steps", "50", "--sweep-ps", "1,2"]
    assert cli_main([*argv, "--sweep-workers", "4,8", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["workers"], r["ps"]) for r in runs] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    assert runs[3]["rate"] > runs[2]["rate"]  # a second server's link
    assert cli_main([*flags, "--slow", "x"]) == 2
    assert "--slow" in capsys.readouterr().err


def test_a_server_that_logs_each_push_binds_and_more_servers_share_it() -> None:
    """A push that takes longer than its transfer (the write-ahead log): the extra is the
    server's, one push after another, not the workers' CPU."""
    slow = Path(
        name="test",
        latency=part(0.0),
        pull=part(5e9),
        push=part(B / 5e-3),  # 5 ms a push
        push_cpu=part(5e9),
        server=part(4.5e-3 / B),  # of which 4.5 ms the server's
    )
    one = predict(setting(), WORK, Cluster(workers=4, ps=1, cores=2), slow)
    assert one.bottleneck == "server" and one.rate == pytest.approx(1 / 4.5e-3)
    two = predict(setting(), WORK, Cluster(workers=4, ps=2, cores=2), slow)
    assert two.rate > one.rate
    played = sim(setting(), Cluster(workers=4, ps=1, cores=2), slow)
    assert played.rate == pytest.approx(one.rate, rel=0.05)
    assert max(played.server_busy) > 0.95


def test_windowed_workers_exchange_together_over_links() -> None:
    """DOWNPOUR's workers compute their windows side by side and meet at the servers' links:
    each exchange shares the link with the others computing beside it (min(N, cores))."""
    link = 125e6
    got = predict(setting(period=10), WORK, Cluster(workers=2, ps=1, link=link, cores=2), path())
    assert got.rate == pytest.approx(2 / (C + 2 * 2 * B / link / 10))
    four = predict(setting(period=10), WORK, Cluster(workers=4, ps=1, link=link, cores=2), path())
    assert four.rate == pytest.approx(4 / (C + 2 * 2 * B / link / 10))  # two at a time
    alone = predict(setting(), WORK, Cluster(workers=2, ps=1, link=link, cores=2), path())
    assert alone.rate == pytest.approx(2 / (C + 2 * B / link))  # Hogwild: they alternate


def test_a_script_that_cannot_be_measured_is_a_one_line_error(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('no data here')\n")
    cmd = [sys.executable, "-m", "distsgd", "plan", "--schemes", "hogwild", str(script)]
    done = loadclock.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("distsgd: error:")]
    assert len(errors) == 1 and "could not measure broken.py" in errors[0]
    assert "--step-ms" in errors[0] and "internal error" not in done.stderr
