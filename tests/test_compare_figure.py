"""compare.png stays readable when an entry diverges (its curves set no axis, it is dotted and
says so), and each entry's legend shows the settings it ran with: the rate as applied, and only
what its scheme uses (compare/figure.py, compare/report.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_compare import _repeat_run

from distsgd_compare.figure import axis_limits, legend_label, write_figure
from distsgd_compare.report import Context
from distsgd_compare.summary import SchemeRun

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_diverged_entry_does_not_set_the_axis() -> None:
    ok = [[2.3, 1.1, 0.4], [2.3, 0.9, 0.3]]
    low, high = axis_limits(ok, [[2.3, 40.0, 1.08e9]])  # type: ignore[misc]
    assert (low, high) == pytest.approx((0.3 - 0.1, 2.3 + 0.1))  # 5% of 2.0 either side
    assert axis_limits(ok, [[2.3, math.nan, math.inf]]) == pytest.approx((0.2, 2.4))


def test_the_axis_scales_itself_where_nothing_reaches_out() -> None:
    assert axis_limits([[2.3, 0.4]], [[2.0, 1.0]]) is None  # a failed entry within the range
    assert axis_limits([[2.3, 0.4]], []) is None
    assert axis_limits([], [[2.3, 1e9]]) is None  # nothing ended well: show what there is
    assert axis_limits([[math.nan]], [[1e9]]) is None


def test_a_flat_kept_range_still_gets_a_margin() -> None:
    assert axis_limits([[0.5, 0.5]], [[1e6]]) == pytest.approx((0.5 - 0.05, 0.5 + 0.05))


def _run(scheme: str, **fields: object) -> SchemeRun:
    """A run of ``scheme`` trained with lr 0.15, momentum 0, batch size 32 on 4 workers."""
    return _repeat_run(scheme, 0, 0.9, scheme=scheme, workers=4, **fields)


def test_asyncdiloco_shows_its_own_rates_not_lr_and_momentum() -> None:
    run = _run("asyncdiloco", status="diverged", scheme_options={"outer_lr": 0.5})
    text = legend_label([run])
    assert text.startswith("asyncdiloco (diverged): ")
    assert "lr=0.15" not in text and "momentum" not in text
    assert "inner_lr=" in text and "outer_lr=0.5" in text and "batch_size=32" in text


def test_the_legend_shows_the_rate_applied() -> None:
    scaled = _run(
        "sync",
        lr_scaling={"lr": 0.15, "rule": "linear", "workers": 4, "factor": 4.0, "effective_lr": 0.6},
    )
    assert legend_label([scaled]) == (
        "sync: lr=0.15 x 4 = 0.6 (linear), momentum=0, batch_size=32, 4 workers"
    )
    plain = _run("hogwild", lr_scaling={"lr": 0.15, "factor": 1.0, "effective_lr": 0.15})
    assert legend_label([plain]) == "hogwild: lr=0.15, momentum=0, batch_size=32, 4 workers"


def test_a_figure_with_a_blown_up_entry_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bad = _run("asyncdiloco", status="diverged")
    bad.curves.train_loss[1] = 1.08e9
    bad.curves.test_loss[1] = math.inf
    context = Context(
        command="distsgd compare",
        label="demo",
        workers=4,
        ps=None,
        seed=0,
        target=None,
        target_source="",
        eval_every=4,
        threads_per_worker=1,
        machine={"cores": 2},
    )
    write_figure(tmp_path / "c.png", context, [_run("hogwild"), bad])
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
