"""benchmarks/rebalance.py without running anything: how it reads a run's folder, splits the
rates at the move, takes the ratio, and writes the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import rebalance as rbench  # noqa: E402


def _run_dir(tmp_path: Path, *, moved_at: float | None) -> Path:
    """A run folder as distsgd run leaves it: two workers at 10 steps/s (20 after a move)."""
    run = tmp_path / ("auto" if moved_at is not None else "off")
    run.mkdir()
    lines: list[dict[str, Any]] = []
    for w in range(2):
        step, t = 0, 100.0
        while t <= 110.0:
            lines.append({"time": t, "task": f"worker{w}", "step": step, "local_step": step})
            fast = moved_at is not None and t >= 100.0 + moved_at
            step += 20 if fast else 10
            t += 1.0
        lines.append({"time": t, "task": f"worker{w}", "event": "finished_steps",
                      "local_step": step, "seconds": 10.0})  # fmt: skip
    result: dict[str, Any] = {"global_step": 0}
    if moved_at is not None:
        lines.append({"time": 100.0 + moved_at, "task": "launcher", "event": "rebalance",
                      "ok": True, "pieces": 16, "bytes": 532480, "pause_s": 0.05,
                      "version": 300, "before_mb_per_s": [120.0, 40.0],
                      "after_mb_per_s": [80.0, 80.0]})  # fmt: skip
        result["rebalance"] = {"moves": 1, "failed": 0, "applies_min": 400, "applies_max": 400}
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "result.json").write_text(json.dumps(result))
    return run


def test_a_run_is_read_with_its_move_and_its_updates(tmp_path: Path) -> None:
    row = rbench.read_run(_run_dir(tmp_path, moved_at=4.0), steps=200)
    assert row["moves"] == 1 and row["failed_moves"] == 0
    assert row["updates_per_piece"] == [400, 400] and row["expected_updates"] == 400
    assert row["move"]["at_s"] == 4.0 and row["move"]["pause_s"] == 0.05
    assert row["rate"] > 0


def test_rates_split_at_the_move_for_both_runs_of_a_round(tmp_path: Path) -> None:
    auto = rbench.read_run(_run_dir(tmp_path, moved_at=4.0), steps=200)
    off = rbench.read_run(_run_dir(tmp_path, moved_at=None), steps=200)
    rows = [{**off, "round": 1, "mode": "off"}, {**auto, "round": 1, "mode": "auto"}]
    rbench.phases(rows)
    assert rows[0]["before_move"] == pytest.approx(20.0)
    assert rows[0]["after_move"] == pytest.approx(20.0)
    assert rows[1]["before_move"] == pytest.approx(20.0)
    assert rows[1]["after_move"] == pytest.approx(40.0)
    assert rbench.ratio_of(rows, "after_move") == pytest.approx(2.0)


def test_the_ratio_is_the_median_of_the_rounds() -> None:
    rows = [
        {"round": 1, "mode": "off", "rate": 10.0},
        {"round": 1, "mode": "auto", "rate": 13.0},
        {"round": 2, "mode": "off", "rate": 10.0},
        {"round": 2, "mode": "auto", "rate": 11.0},
        {"round": 3, "mode": "off", "rate": 10.0},
        {"round": 3, "mode": "auto", "rate": 15.0},
    ]
    assert rbench.ratio_of(rows) == pytest.approx(1.3)
    assert rbench.ratio_of(rows[:1]) is None


def test_the_table_says_whether_the_target_is_met(tmp_path: Path) -> None:
    auto = rbench.read_run(_run_dir(tmp_path, moved_at=4.0), steps=200)
    report = {
        "machine": {"date": "d", "distsgd_commit": "c", "cpu": "x", "cores": 2, "load_before": "0"},
        "command": "python benchmarks/rebalance.py",
        "link": "1gbit",
        "rows": [{**auto, "round": 1, "mode": "auto"}],
        "ratio": 1.1,
        "ratio_after_move": None,
    }
    text = rbench.markdown(report)
    assert "not met" in text and "400..400 (400)" in text and "1 (4.0 s)" in text
    report["ratio"] = 1.3
    assert "; met." in rbench.markdown(report)
