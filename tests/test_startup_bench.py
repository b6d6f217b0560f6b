"""The report math of ``benchmarks/startup.py`` (the fork server's A B A B benchmark): paired
ratios, medians, a failed run left out of both and reported, the markdown table. No process is
started: the module is imported from its file."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest
from conftest import ROOT


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "startup_bench", ROOT / "benchmarks" / "startup.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load()


def run(
    flag: str,
    round_: int,
    *,
    wall: float,
    cpu: float,
    code: int = 0,
    case: str = "hogwild",
    peak: float = 250.0,
) -> Any:
    return bench.Run(case=case, flag=flag, round=round_, wall=wall, cpu=cpu, peak=peak, code=code)


RUNS = [
    run("on", 1, wall=6.0, cpu=9.0),
    run("off", 1, wall=8.0, cpu=12.0),
    run("on", 2, wall=5.0, cpu=8.0),
    run("off", 2, wall=10.0, cpu=16.0),
    run("on", 3, wall=7.0, cpu=10.0),
    run("off", 3, wall=7.0, cpu=10.0),
]


def test_paired_ratios_divide_each_round_on_by_the_same_round_off() -> None:
    assert bench.paired_ratios(RUNS, "hogwild", "wall") == pytest.approx([0.75, 0.5, 1.0])
    assert bench.paired_ratios(RUNS, "hogwild", "cpu") == pytest.approx([0.75, 0.5, 1.0])
    assert bench.paired_ratios(RUNS, "allreduce", "wall") == []


def test_summary_gives_medians_and_the_median_of_the_paired_ratios() -> None:
    s = bench.summarize(RUNS, "hogwild")
    assert s["wall_on_median"] == 6.0 and s["wall_off_median"] == 8.0
    assert s["cpu_on_median"] == 9.0 and s["cpu_off_median"] == 12.0
    assert s["wall_ratios"] == [0.75, 0.5, 1.0] and s["wall_ratio_median"] == 0.75
    assert s["cpu_ratio_median"] == 0.75 and s["peak_on_median"] == 250.0
    assert s["ok"] == {"on": 3, "off": 3} and s["failed"] == [] and len(s["runs"]) == 6


def test_the_ratio_is_paired_not_a_ratio_of_medians() -> None:
    runs = [
        run("on", 1, wall=1.0, cpu=1.0),
        run("off", 1, wall=2.0, cpu=2.0),
        run("on", 2, wall=9.0, cpu=9.0),
        run("off", 2, wall=10.0, cpu=10.0),
        run("on", 3, wall=10.0, cpu=10.0),
        run("off", 3, wall=20.0, cpu=20.0),
    ]
    s = bench.summarize(runs, "hogwild")
    assert s["wall_ratios"] == [0.5, 0.9, 0.5] and s["wall_ratio_median"] == 0.5
    assert s["wall_on_median"] / s["wall_off_median"] == pytest.approx(0.9)


def test_a_failed_run_is_left_out_of_medians_and_ratios_and_reported() -> None:
    runs = [*RUNS[:2], run("on", 2, wall=0.5, cpu=0.5, code=1), *RUNS[3:]]
    s = bench.summarize(runs, "hogwild")
    assert s["wall_ratios"] == pytest.approx([0.75, 1.0])  # round 2 has no pair
    assert s["wall_on_median"] == 6.5  # 6 and 7; not the failed 0.5
    assert s["wall_off_median"] == 8.0  # round 2's off ran fine: its figure counts
    assert s["ok"] == {"on": 2, "off": 3}
    assert [(f["round"], f["flag"], f["code"]) for f in s["failed"]] == [(2, "on", 1)]


def test_a_timed_out_run_counts_as_failed() -> None:
    timed = bench.Run(
        case="hogwild", flag="off", round=1, wall=300, cpu=1, peak=9, code=-9, timed_out=True
    )
    assert not timed.ok
    s = bench.summarize([RUNS[0], timed], "hogwild")
    assert s["wall_ratios"] == [] and s["wall_ratio_median"] is None
    assert s["wall_off_median"] is None


def test_the_table_has_a_row_per_case_and_names_failures() -> None:
    runs = [
        *RUNS,
        run("on", 1, wall=4.0, cpu=6.0, case="allreduce"),
        run("off", 1, wall=5.0, cpu=8.0, code=-9, case="allreduce"),
    ]
    summaries = {case: bench.summarize(runs, case) for case in ("hogwild", "allreduce")}
    commands = {"hogwild": "distsgd demo h", "allreduce": "distsgd demo a"}
    text = bench.table(summaries, commands)
    lines = text.splitlines()
    assert lines[0].startswith("| command |") and lines[1].startswith("| --- |")
    assert lines[2] == (
        "| `distsgd demo h --fork-server on` (or `off`) | 3 + 3 | 9.00 / 12.00 | 6.00 / 8.00 "
        "| 0.75, 0.75 | 250 / 250 |"
    )
    assert lines[3] == (
        "| `distsgd demo a --fork-server on` (or `off`) | 1 + 0 | n/a | n/a | n/a, n/a | n/a |"
    )
    assert lines[-1] == "- failed: allreduce round 1 off: exit code -9"


def test_each_case_runs_the_demo_with_four_workers_and_its_scheme() -> None:
    commands = bench.cases(5)
    assert set(commands) == {"hogwild", "allreduce"}
    for scheme, argv in commands.items():
        assert argv[:3] == ["demo", "--scheme", scheme]
        assert argv[argv.index("--workers") + 1] == "4" and "--quiet" in argv
        assert argv[argv.index("--epochs") + 1] == "5"
