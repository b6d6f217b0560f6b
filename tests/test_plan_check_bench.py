"""The arithmetic of ``benchmarks/plan_check.py`` (the cost model against real runs): its
table, its markers, and the simulator fed from ``distsgd plan --json``'s parts. No run is
started (CI does not run the benchmark); the module is imported from its file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT

from distsgd.cli.main import main as cli_main


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "plan_check_bench", ROOT / "benchmarks" / "plan_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pc = _load()


def report(rows: list[dict[str, object]], link: str | None = None) -> dict[str, object]:
    machine = {
        "date": "2026-12-04 17:00 UTC",
        "distsgd_commit": "abc",
        "cpu": "AMD EPYC",
        "cores": 2,
        "load_before": "1.00 1.00 1.00",
    }
    return {"machine": machine, "command": "python benchmarks/plan_check.py", "link": link,
            "rows": rows}  # fmt: skip


def test_the_table_gives_each_error_and_the_largest() -> None:
    rows = [
        {"workers": 2, "entry": "hogwild", "predicted": 180.0, "bottleneck": "server",
         "simulated": 190.0, "measured": 200.0},
        {"workers": 4, "entry": "sync", "predicted": 150.0, "bottleneck": "cpu",
         "measured": 100.0},
    ]  # fmt: skip
    text = pc.markdown(report(rows))
    assert "| 2 | hogwild | 180.0 | server | -10% | 190.0 | -5% | 200.0 |" in text
    assert "| 4 | sync | 150.0 | cpu | +50% | — | — | 100.0 |" in text
    assert "Largest error of the model's rates: 50%" in text
    assert "Largest error of the simulator's rates: 5%" in text


def test_a_range_counts_as_met_inside_and_to_its_nearer_end_outside() -> None:
    row = {"workers": 2, "entry": "downpour(window=10)", "predicted": 150.0,
           "predicted_staggered": 250.0, "bottleneck": "compute and exchange",
           "simulated": 145.0, "simulated_staggered": 245.0, "measured": 200.0}  # fmt: skip
    assert pc.relative_error(row, "predicted") == 0.0
    assert pc.relative_error({**row, "measured": 300.0}, "predicted") == pytest.approx(-1 / 6)
    assert pc.relative_error({**row, "measured": 100.0}, "predicted") == pytest.approx(0.5)
    text = pc.markdown(report([row], link="1gbit"))
    assert "| 150.0 to 250.0 | compute and exchange | +0% | 145.0 to 245.0 | +0% | 200.0 |" in text
    assert "nearer end" in text


def test_markers_per_link(tmp_path: Path) -> None:
    assert pc.markers(None) == ("<!-- plan check: begin -->", "<!-- plan check: end -->")
    begin, end = pc.markers("1gbit")
    doc = tmp_path / "p.md"
    doc.write_text(f"a\n{begin}\nold\n{end}\nb\n")
    pc.write(report([], "1gbit"), tmp_path, doc)
    text = doc.read_text()
    assert "old" not in text and text.startswith("a\n") and text.endswith("b\n")
    with pytest.raises(SystemExit, match="markers"):
        pc.write(report([], None), tmp_path, doc)


def test_the_simulator_reads_plans_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--assume", "--step-ms", "4", "--model-mb", "2.7", "--json", "--link", "1gbit"]
    assert cli_main([*argv, "--schemes", "hogwild,allreduce"]) == 0
    planned = json.loads(capsys.readouterr().out)
    for got in planned["predictions"]:
        rate = pc.simulated(got, planned, 2, "1gbit", 100)
        assert rate == pytest.approx(got["rate"], rel=0.25)
