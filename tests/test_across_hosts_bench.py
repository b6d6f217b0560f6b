"""The planning and arithmetic of ``benchmarks/across_hosts.py`` (the benchmark across emulated
hosts): its blocks and rows, the A B A B order, steps per link, medians and paired ratios,
bytes per step, the screen's choice, the markdown. No process, socket or namespace is started
(CI does not run the benchmark): the module is imported from its file."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest
from conftest import ROOT


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "across_hosts_bench", ROOT / "benchmarks" / "across_hosts.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ah = _load()


def sample(rate: float, per_step: dict[str, float] | None = None) -> dict[str, Any]:
    return {"rate": rate, "worker_steps": 100, "per_step": per_step or {}, "load": "", "note": ""}


def block(
    name: str = "ps",
    link: str = "1gbit",
    measures: dict[str, Any] | None = None,
    reference: str | None = "tf",
) -> dict[str, Any]:
    measures = measures or {
        "hogwild": [sample(60.0, {"host0": 5.4e6}), sample(50.0, {"host0": 5.6e6})],
        "tf": [sample(30.0, {"host0": 5.4e6}), sample(40.0, {"host0": 5.4e6})],
    }
    settings = [k for k in measures if k != reference]
    labels = {k: k.capitalize() for k in measures}
    return {
        "link": link,
        "name": name,
        "reference": reference,
        "settings": settings,
        "labels": labels,
        "steps": 200,
        "load_before": "1.00 1.00 1.00",
        "load_after": "1.10 1.00 1.00",
        "measures": measures,
    }


def test_plan_has_a_ps_and_an_allreduce_block_per_link_and_one_screen() -> None:
    blocks = ah.plan(["10gbit", "1gbit", "100mbit"], "100mbit")
    assert [(b.link, b.name) for b in blocks] == [
        ("10gbit", "ps"),
        ("10gbit", "allreduce"),
        ("1gbit", "ps"),
        ("1gbit", "allreduce"),
        ("100mbit", "ps"),
        ("100mbit", "allreduce"),
        ("100mbit", "screen"),
    ]
    ps = blocks[0]
    assert ps.keys == (
        "hogwild",
        "hogwild-overlap",
        "sync",
        "downpour",
        "hogwild-bf16x2",
        "hogwild-int8-bf16",
        "tf",
    )
    assert blocks[1].keys == ("allreduce", "allreduce-bf16", "ddp")
    assert blocks[-1].reference is None and "tf" not in blocks[-1].keys
    assert ah.plan(["1gbit"], None)[-1].name == "allreduce"


def test_rounds_run_a_b_a_b() -> None:
    assert ah.order(["hogwild", "tf"], 2) == [(0, "hogwild"), (0, "tf"), (1, "hogwild"), (1, "tf")]
    assert ah.order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert ah.order(["a"], 0) == []


def test_settings_give_hosts_and_argv() -> None:
    hogwild = ah.PS_SETTINGS[0]
    assert hogwild.hosts == 3
    assert hogwild.argv() == ["--scheme", "hogwild", "--workers", "2", "--ps", "1"]
    assert ah.ALLREDUCE.hosts == 2
    assert "--ps" not in ah.ALLREDUCE.argv()  # distsgd refuses --ps with allreduce
    shards = next(c for c in ah.CANDIDATES if c.key == "hogwild-ps2")
    assert shards.hosts == 4 and shards.argv()[-2:] == ["--ps", "2"]
    downpour = next(s for s in ah.PS_SETTINGS if s.key == "downpour")
    assert downpour.argv()[-2:] == ["--window", "10"]
    keys = [s.key for s in (*ah.PS_SETTINGS, ah.ALLREDUCE, ah.ALLREDUCE_BF16, *ah.CANDIDATES)]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("rate", "steps", "expected"),
    [(10_000_000_000, 200, 200), (1_000_000_000, 200, 200), (100_000_000, 200, 40),
     (100_000_000, 1000, 100), (10_000_000, 200, 40), (100_000_000, 20, 20)],
)  # fmt: skip
def test_steps_scale_down_below_one_gigabit(rate: int, steps: int, expected: int) -> None:
    assert ah.steps_for(rate, steps) == expected


def test_paired_ratio_is_the_median_of_the_rounds_ratios() -> None:
    assert ah.paired_ratio([60.0, 50.0], [30.0, 40.0]) == pytest.approx((2.0 + 1.25) / 2)
    assert ah.paired_ratio([60.0, 50.0, 10.0], [30.0, 40.0, 10.0]) == pytest.approx(1.25)
    assert ah.paired_ratio([60.0, 50.0], [30.0]) == pytest.approx(2.0)  # rounds both measured
    assert ah.paired_ratio([60.0], []) is None
    assert ah.paired_ratio([60.0], [0.0]) is None
    assert ah.median_or_none([3.0, 1.0, 2.0]) == 2.0
    assert ah.median_or_none([]) is None


def test_bytes_per_step_sums_both_directions_per_host() -> None:
    counted = {
        "host1": {"sent": 270, "received": 270},
        "host0": {"sent": 540, "received": 540},
    }
    assert ah.bytes_per_step(counted, 100) == {"host0": 10.8, "host1": 5.4}
    assert list(ah.bytes_per_step(counted, 100)) == ["host0", "host1"]
    assert ah.bytes_per_step(counted, 0) == {}


def test_block_rows_give_medians_ranges_ratio_and_bytes() -> None:
    (row,) = ah.block_rows(block())
    assert row["key"] == "hogwild"
    assert row["ours"] == "55.0 (50.0-60.0)"
    assert row["reference"] == "35.0 (30.0-40.0)"
    assert row["ratio"] == pytest.approx(1.625)
    assert row["ours_bytes"] == "host0 5.50"
    assert row["reference_bytes"] == "host0 5.40"


def test_a_failed_reference_leaves_no_ratio() -> None:
    failed = block(measures={"hogwild": [sample(60.0)], "tf": "not measured: pass --tf-python"})
    (row,) = ah.block_rows(failed)
    assert row["ratio"] is None
    assert row["reference"].startswith("not measured")
    assert "| — |" in ah.markdown(report([failed]))


def test_the_screen_picks_the_fastest_median() -> None:
    screen = block(
        "screen",
        "100mbit",
        {"hogwild-ps2": [sample(10.0)], "downpour-w50": [sample(80.0)], "hogwild-topk": "failed"},
        reference=None,
    )
    assert ah.best_of(screen) == "downpour-w50"
    rows = ah.block_rows(screen)
    assert [r["ratio"] for r in rows] == [None, None, None]
    assert ah.best_of(block("screen", measures={"a": "failed"}, reference=None)) is None


def report(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    machine = {
        "date": "2026-12-03 21:00 UTC",
        "distsgd_commit": "abc123",
        "cpu": "AMD EPYC",
        "cores": 2,
        "load_before": "1.00 1.00 1.00",
    }
    return {
        "machine": machine,
        "command": "python benchmarks/across_hosts.py",
        "rounds": 2,
        "blocks": blocks,
        "load_after": "2.00 2.00 2.00",
    }


def test_markdown_has_a_table_per_block_and_the_targets() -> None:
    ps = block(
        measures={
            "hogwild": [sample(40.0), sample(38.0)],
            "hogwild-int8-bf16": [sample(75.0), sample(70.0)],
            "tf": [sample(37.0), sample(38.0)],
        }
    )
    ar = block(
        "allreduce",
        measures={
            "allreduce": [sample(50.0), sample(49.0)],
            "allreduce-bf16": [sample(55.0), sample(50.0)],
            "ddp": [sample(50.0), sample(50.0)],
        },
        reference="ddp",
    )
    best = block(
        "best",
        "100mbit",
        {"downpour-w50": [sample(40.0), sample(44.0)], "tf": [sample(10.0), sample(10.0)]},
    )
    text = ah.markdown(report([block(), ar, best]))
    assert "Command: `python benchmarks/across_hosts.py`" in text
    assert "load average 1.00 1.00 1.00 before, 2.00 2.00 2.00 after" in text
    assert text.count("### ") == 3
    assert "### 1gbit: 2 workers + 1 ps" in text
    assert (
        "| Hogwild | 55.0 (50.0-60.0) | 35.0 (30.0-40.0) | 1.62 | host0 5.50 | host0 5.40 |" in text
    )
    text = ah.markdown(report([ps, ar, best]))
    assert "| Hogwild ≥ 1.5x TF PSS at 1 Gbit/s | 1.93 (Hogwild-int8-bf16) | yes |" in text
    assert "| all-reduce ≥ 1.0x DDP at 1 Gbit/s | 1.05 (Allreduce-bf16) | yes |" in text
    assert "| best distsgd setting ≥ 3x TF PSS at 100 Mbit/s | 4.20 (Downpour-w50) | yes |" in text
    # the float32 rows are listed beside the targets, never judged
    assert "| Hogwild, float32: parity expected (the same bytes) | 1.04 (Hogwild) | — |" in text
    assert "| all-reduce, float32: parity expected (DDP) | 0.99 (Allreduce) | — |" in text


def test_targets_not_met_say_no() -> None:
    slow = block(measures={"hogwild-int8-bf16": [sample(40.0)], "tf": [sample(30.0)]})
    assert ah.targets(report([slow])) == [
        ("Hogwild ≥ 1.5x TF PSS at 1 Gbit/s", "1.33 (Hogwild-int8-bf16)", "no")
    ]


def test_a_busy_launcher_address_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ah.time, "sleep", lambda s: None)
    calls = []

    def measure() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("198.18.0.253 is already on a link of this machine; wait")
        if len(calls) == 2:
            raise ValueError("the emulated hosts' network is in use by pid 7 (lock L); wait")
        return "measured"

    assert ah._when_free(measure) == "measured" and len(calls) == 3

    def broken() -> Any:
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        ah._when_free(broken)


def test_the_tables_go_between_the_markers() -> None:
    page = f"# Page\n\nbefore\n{ah.BEGIN}\nold tables\n{ah.END}\nafter\n"
    assert (
        ah.put_between_markers(page, "new\n")
        == f"# Page\n\nbefore\n{ah.BEGIN}\nnew\n{ah.END}\nafter\n"
    )
    with pytest.raises(ValueError, match="markers"):
        ah.put_between_markers("# Page\n", "new\n")
