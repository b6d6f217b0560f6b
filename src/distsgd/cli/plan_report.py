"""What ``distsgd plan`` prints: each scheme's prediction with the parts it came from, and under
``--simulate`` each simulated run with the model's rate beside it; a table, or JSON."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distsgd.plan.choices import LINK_PAYLOAD
from distsgd.plan.cost import Path, Prediction
from distsgd.plan.simulate import SimResult, histogram_quantile

if TYPE_CHECKING:
    from distsgd.cli.plan import Parts

Row = tuple[Prediction, Path, tuple[Prediction, str] | None]
"""A scheme's prediction, its path, and the flags recommended with their prediction."""


def prediction_json(parts: Parts, rows: Sequence[Row]) -> dict[str, Any]:
    """The predictions as ``--json`` prints them."""

    def prediction(p: Prediction) -> dict[str, Any]:
        out = dataclasses.asdict(p)
        out["bounds"] = {b.name: b.rate for b in p.bounds}
        return out

    return {
        "workload": dataclasses.asdict(parts.workload),
        "link": None if parts.link is None else dataclasses.asdict(parts.link),
        "predictions": [
            {
                **prediction(got),
                "path": dataclasses.asdict(path),
                "recommended": None
                if advice is None
                else {"flags": advice[1], "rate": advice[0].rate},
            }
            for got, path, advice in rows
        ],
    }


def prediction_table(args: argparse.Namespace, parts: Parts, rows: Sequence[Row]) -> str:
    """The predictions as a table, with the parts they came from."""
    w = parts.workload
    where = (
        f"links of {args.link} ({LINK_PAYLOAD.value:.0%} of it payload: {LINK_PAYLOAD.source})"
        if args.link
        else "one host"
    )
    lines = [
        f"cluster: {args.workers} workers, {args.ps} ps (parameter-server schemes), {where}",
        f"model: {w.param_bytes.value / 1e6:.2f} MB ({w.param_bytes.source})",
        f"step compute: {w.step.value * 1e3:.2f} ms ({w.step.source})",
        *([f"link: {parts.link.describe()}"] if parts.link is not None else []),
        "",
        "| scheme | worker-steps/s | MB per worker-step | bottleneck | staleness | "
        "recommended (predicted worker-steps/s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    used: dict[str, Path] = {}
    for got, path, advice in rows:
        used[path.name] = path
        tip = "—" if advice is None else f"{advice[1]} ({advice[0].rate:.1f})"
        rate = f"{got.rate:.1f}" + ("" if got.staggered is None else f" to {got.staggered:.1f}")
        lines.append(
            f"| {got.setting.label} | {rate} | {got.bytes_per_step / 1e6:.2f} | "
            f"{got.bottleneck} | {got.staleness:.2f} | {tip} |"
        )
    lines.append("")
    if any(got.staggered is not None for got, _, _ in rows):
        lines.append(
            "A range (windowed schemes across hosts): the first rate if the workers exchange "
            "together, sharing the servers' links; the second if their exchanges fall apart. "
            "A run settles in one or the other (docs/performance.md, 'The cost model')."
        )
    for path in used.values():
        lines.append(
            f"{path.name}: pulls {path.pull.value / 1e9:.2f} GB/s ({path.pull.source}); "
            f"pushes {path.push.value / 1e9:.2f} GB/s ({path.push.source})"
        )
        if path.server is not None:
            per_push = path.server.value * w.param_bytes.value * 1e3
            lines.append(f"a server's work per push: {per_push:.2f} ms ({path.server.source})")
    return "\n".join(lines)


def simulated_run(label: str, workers: int, ps: int, got: SimResult, took: float) -> dict[str, Any]:
    """One simulated run as ``--json`` prints it (``took``: the seconds it took to play)."""
    return {
        "scheme": label,
        "workers": workers,
        "ps": ps,
        "rate": got.rate,
        "seconds": got.seconds,
        "worker_steps": got.worker_steps,
        "server_busy": list(got.server_busy),
        "link_busy": list(got.link_busy),
        "staleness": {str(k): v for k, v in got.staleness.items()},
        "staleness_mean": got.staleness_mean(),
        "wall_s": took,
    }


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{min(values):.0%}-{max(values):.0%}" if len(values) > 1 else f"{values[0]:.0%}"


def simulation_table(rows: Sequence[dict[str, Any]]) -> str:
    """The simulated runs as a table, the model's rate beside each."""
    lines = [
        "| scheme | workers | ps | worker-steps/s | model | servers busy | server links busy "
        "| staleness mean (p50, p99) | simulated in |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['scheme']} | {r['workers']} | {r['ps']} | {r['rate']:.1f} | "
            f"{r['model_rate']:.1f} | {_spread(r['server_busy'])} | {_spread(r['link_busy'])} | "
            f"{r['staleness_mean']:.1f} ({_quantiles(r['staleness'])}) | {r['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


def _quantiles(histogram: dict[str, int]) -> str:
    counts = {int(k): v for k, v in histogram.items()}
    marks = [histogram_quantile(counts, q) for q in (0.5, 0.99)]
    return "—" if marks[0] is None else ", ".join(map(str, marks))
