"""``--rebalance``: the pure decision (distsgd_rebalance/policy.py) and the launcher's flag
checks (the mover on real servers: tests/test_moves.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, alive, metrics, run_distsgd, task_pids

from distsgd.launcher.config import ClusterSize, LaunchConfig
from distsgd.util.optional import installed
from distsgd_rebalance import policy as rb

MB = 1e6


def test_an_unbalanced_pair_moves_small_pieces_to_even_it() -> None:
    # ps0: one 1 MB/s piece and four of 0.25; ps1: four of 0.25 -> 2.0 against 1.0.
    rates = {"big": 1 * MB, **{f"a{i}": 0.25 * MB for i in range(4)}}
    rates.update({f"b{i}": 0.25 * MB for i in range(4)})
    owner = {"big": 0, **{f"a{i}": 0 for i in range(4)}, **{f"b{i}": 1 for i in range(4)}}
    decision = rb.decide(rates, owner, 2)
    move = decision.move
    assert move is not None, decision.why
    assert (move.source, move.dest) == (0, 1)
    assert "big" not in move.keys and len(move.keys) == 2  # half the gap: 0.5 MB/s
    assert move.before == (2 * MB, 1 * MB) and move.after == (1.5 * MB, 1.5 * MB)
    assert move.gain == pytest.approx(0.25)


def test_a_balanced_placement_stays() -> None:
    rates = {"a": 1.0, "b": 1.1}
    decision = rb.decide(rates, {"a": 0, "b": 1}, 2)
    assert decision.move is None and "balanced" in decision.why


def test_a_piece_larger_than_the_gap_allows_stays_where_it_is() -> None:
    # One piece carries everything: moving it would only move the bottleneck.
    decision = rb.decide({"big": 10.0, "tiny": 0.1}, {"big": 0, "tiny": 1}, 2)
    assert decision.move is None
    assert "overshooting" in decision.why


def test_one_piece_moves_when_none_fits_in_half_the_gap() -> None:
    # ps0: 3 + 3, ps1: 2 -> no piece fits in (6 - 2) / 2 = 2; moving one 3 gives 3 and 5.
    decision = rb.decide({"x": 3.0, "y": 3.0, "z": 2.0}, {"x": 0, "y": 0, "z": 1}, 2)
    assert decision.move is not None
    assert decision.move.keys == ("x",) and decision.move.after == (3.0, 5.0)


def test_a_small_gain_is_not_worth_a_move() -> None:
    rates = {"a": 1.3, "b": 0.02, "c": 1.0}
    decision = rb.decide(rates, {"a": 0, "b": 0, "c": 1}, 2, margin=0.05, min_gain=0.05)
    assert decision.move is None and "gain" in decision.why


def test_nothing_moves_without_load_or_with_one_server() -> None:
    assert rb.decide({"a": 0.0}, {"a": 0}, 2).move is None
    assert rb.decide({"a": 5.0}, {"a": 0}, 1).move is None


def test_rates_come_from_two_readings_of_the_counters() -> None:
    assert rb.piece_rates({"a": 100}, {"a": 400, "b": 50}, 2.0) == {"a": 150.0, "b": 25.0}
    assert rb.piece_rates({"a": 400}, {"a": 100}, 1.0) == {"a": 0.0}  # a restarted server
    with pytest.raises(ValueError):
        rb.piece_rates({}, {}, 0.0)


def _launch(tmp_path: Path, **changes: Any) -> LaunchConfig:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    base: dict[str, Any] = {"script": str(script), "scheme": "hogwild"}
    size = ClusterSize(workers=2, ps=changes.pop("ps", 2))
    return LaunchConfig(**{**base, **changes}, size=size)


def test_rebalance_auto_needs_an_asynchronous_scheme_and_two_servers(tmp_path: Path) -> None:
    assert _launch(tmp_path, rebalance="auto").rebalance == "auto"
    with pytest.raises(ValueError, match="synchronous"):
        _launch(tmp_path, rebalance="auto", scheme="sync")
    with pytest.raises(ValueError, match="2 or more servers"):
        _launch(tmp_path, rebalance="auto", ps=1)
    with pytest.raises(ValueError, match="off or auto"):
        _launch(tmp_path, rebalance="sometimes")


SCRIPT = ROOT / "benchmarks" / "unbalanced_script.py"


def test_a_run_with_rebalance_auto_moves_pieces_and_loses_no_update(tmp_path: Path) -> None:
    """The whole path: the launcher reads the servers' loads, moves ps0's small pieces (the
    round-robin placement gives ps0 about 3x ps1's bytes) and every piece takes 2 x steps
    updates; no task outlives the run. The workers are paced (20 ms a step, asleep): the run
    must last past the first decision's 3 s window on any machine, which 1,500 unpaced steps
    did at 40 CPU-seconds; 300 paced ones last at least 6 s at 16 CPU-seconds."""
    steps = 300
    run_dir = tmp_path / "run"
    flags = "--scheme hogwild --workers 2 --ps 2 --param-placement round-robin --rebalance auto"
    pace = [f"--inject-fault=delay:worker:{i}=20ms" for i in range(2)]
    args = ["run", *flags.split(), *pace, "--steps", str(steps), "--threads", "1"]
    args += ["--checkpoint-every", "0", "--quiet", "--run-dir", str(run_dir), str(SCRIPT)]
    done = run_distsgd(args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    moved = result["rebalance"]
    assert moved["moves"] >= 1 and moved["failed"] == 0, done.stdout[-2000:]
    assert moved["applies_min"] == moved["applies_max"] == 2 * steps
    events = [r for r in metrics(run_dir) if r.get("event") == "rebalance"]
    assert events and events[0]["ok"] and events[0]["source"] == 0 and events[0]["dest"] == 1
    assert "rebalance: moving" in done.stdout
    assert not alive(list(task_pids(run_dir).values()))


def test_rebalance_auto_under_a_synchronous_scheme_is_a_one_line_error(tmp_path: Path) -> None:
    done = run_distsgd(
        ["run", "--scheme", "sync", "--ps", "2", "--rebalance", "auto", str(SCRIPT)], timeout=60
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rebalance auto" in lines[0], done.stderr


def test_a_package_outside_the_core_that_is_missing_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--rebalance auto`` (or emulated hosts) without its package: ValueError naming it and
    the fix; a module missing inside the package is not hidden."""
    monkeypatch.setitem(sys.modules, "distsgd_rebalance", None)
    package, what = "distsgd_rebalance", "--rebalance auto"
    with (
        pytest.raises(ValueError, match=f"{what} needs the {package} package"),
        installed(package, what),
    ):
        from distsgd_rebalance import Rebalancer  # noqa: F401
    with pytest.raises(ModuleNotFoundError), installed(package, what):
        import distsgd_no_such_module  # type: ignore[import-not-found]  # noqa: F401
