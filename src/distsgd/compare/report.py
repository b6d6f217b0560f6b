"""The tables of ``distsgd compare``: ``compare.md`` (one row per entry of ``--schemes``, then
how the numbers were made) and ``compare.json`` (the same numbers and the curves), from the
runs' summaries (:mod:`distsgd.compare.summary`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distsgd.compare.summary import SchemeRun
from distsgd.util import write_atomic


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the whole comparison was: shown above the table and in the figure's title."""

    command: str
    label: str
    workers: int
    ps: int | None
    seed: int | None
    """The seed of every run (None: unknown, or entries set their own)."""
    target: float | None
    target_source: str
    eval_every: int
    threads_per_worker: int
    machine: dict[str, Any]
    figure: bool = True
    """Whether ``compare.png`` was drawn (it needs matplotlib, the ``compare`` extra)."""


def _megabytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    mb = n / 1e6
    return f"{mb:.2f} MB" if mb < 10 else f"{mb:.1f} MB"


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _staleness(run: SchemeRun) -> str:
    if run.mean_staleness is not None:
        return f"{run.mean_staleness:.2f}"
    if run.parameter_servers == 0 and run.status == "ok":
        return "n/a (no parameter servers)"
    return "n/a"


def _steps(run: SchemeRun) -> str:
    if run.global_step is None or run.local_steps is None:
        return "n/a"
    return f"{run.global_step} / {run.local_steps}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(run: SchemeRun, target: float | None) -> str:
    if run.status not in ("ok", "diverged"):
        why = f"{run.status}: {run.reason}" if run.reason else run.status
        cells = [f"`{run.label}`", f"**{why}**", *["" for _ in range(7)]]
        return "| " + " | ".join(_cell(c) for c in cells) + " |"
    if target is None:
        reach = "n/a (no accuracy)"
    elif run.seconds_to_target is None:
        reach = "not reached"
    else:
        reach = f"{run.seconds_to_target:.1f}"
    cells = [
        f"`{run.label}`",
        "ok" if run.status == "ok" else f"**diverged**: {run.reason}",
        _number(run.final_accuracy),
        _number(run.final_test_loss),
        reach,
        _number(run.train_seconds, 1),
        _megabytes(run.bytes_sent),
        _staleness(run),
        _steps(run),
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def ps_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    counts = sorted({r.parameter_servers for r in runs if r.parameter_servers})
    if not counts:
        return "no parameter servers"
    return f"{', '.join(map(str, counts))} ps (parameter-server schemes only)"


def _seed_text(context: Context, runs: Sequence[SchemeRun]) -> str:
    if context.seed is not None:
        return f"seed {context.seed}"
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    if len(seeds) > 1:
        return f"seeds {', '.join(map(str, seeds))} (entries set their own)"
    return f"seed {seeds[0]}" if seeds else "seed n/a"


def markdown(context: Context, runs: Sequence[SchemeRun]) -> str:
    """``compare.md``: one row per entry of ``--schemes``, then how the numbers were made."""
    target = context.target
    target_head = "s to target" if target is None else f"s to {target:.2f}"
    head = [
        "scheme",
        "status",
        "final accuracy",
        "final test loss",
        target_head,
        "training s",
        "sent (all workers)",
        "mean staleness",
        "steps (global / per worker)",
    ]
    machine = context.machine
    lines = [
        f"# distsgd compare: {', '.join(r.label for r in runs)}",
        "",
        f"{context.label}; {context.workers} workers, {ps_text(context, runs)}; "
        f"{_seed_text(context, runs)}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
        *[_row(r, target) for r in runs],
        "",
        f"- command: `{context.command}`",
        f"- machine: {machine.get('cores')} cores ({machine.get('platform')}), "
        f"{context.threads_per_worker} torch threads per worker, Python "
        f"{machine.get('python')}, torch {machine.get('torch')}",
        "- target accuracy: "
        + ("n/a (the script reports no accuracy)" if target is None else f"{target:.2f} ")
        + (f"({context.target_source})" if target is not None else ""),
        f"- the chief evaluated every {context.eval_every} local steps"
        if context.eval_every
        else "- the chief evaluated only at the end",
        "- seconds count from the start of training (start-up excluded); "
        "training s ends at the final evaluation; sent = bytes all workers sent; "
        "mean staleness = updates applied between a worker's pull and its push, "
        "averaged over pushes (parameter-server schemes only); steps = global updates / "
        "local steps of worker0",
        "",
        *(["![curves](compare.png)", ""] if context.figure else []),
    ]
    return "\n".join(lines)


def write_markdown(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    write_atomic(path, markdown(context, runs))


def write_json(path: Path, context: Context, runs: Sequence[SchemeRun]) -> None:
    """``compare.json``: the context and, per entry, its label, scheme, scheme options and
    training overrides, the table's numbers and its curves."""
    data = {"version": 1, **asdict(context), "schemes": [asdict(r) for r in runs]}
    write_atomic(path, json.dumps(data, indent=1) + "\n")
