"""``distsgd simulate``: play a run of many workers and servers event by event on the cost
model's parts (``distsgd.plan.simulate``): throughput, each server's load and link, staleness.

The parts are those of ``distsgd plan`` (measured by probe runs of the script, or given with
``--step-ms`` and ``--model-mb``). ``--sweep-ps`` and ``--sweep-workers`` play a grid of cluster
sizes and print worker-steps/s for each, the analytic model's prediction beside it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from distsgd.cli.plan import add_model_flags, entries_of, model_inputs, parts_of
from distsgd.plan.cost import predict
from distsgd.plan.simulate import SimResult, Stragglers, simulate


def add_command(sub: Any) -> None:
    """The ``simulate`` command."""
    sim = sub.add_parser(
        "simulate",
        help="play a run of many workers and servers on the cost model: throughput, server "
        "load, staleness (16 to 256 workers in seconds)",
        description="Play a run event by event (queues at servers and links, shared cores, "
        "stragglers) on the parts distsgd plan measures or is given.",
    )
    add_model_flags(sim, workers=16, ps=2)
    sim.add_argument("--steps", type=int, default=1000, help="steps per worker (default 1000)")
    sim.add_argument(
        "--straggler-sigma",
        type=float,
        default=0.1,
        help="log-normal sigma of each step's compute time (default 0.1)",
    )
    sim.add_argument(
        "--slow",
        default=None,
        metavar="K:F",
        help="K workers F times slower at every step (e.g. 2:3)",
    )
    sim.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    sim.add_argument("--sweep-ps", default=None, metavar="M,M,...", help="servers to sweep")
    sim.add_argument("--sweep-workers", default=None, metavar="N,N,...", help="workers to sweep")
    sim.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _counts(text: str | None, default: int, flag: str) -> list[int]:
    if text is None:
        return [default]
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give counts like 1,2,4") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: give counts of at least 1, like 1,2,4")
    return values


def stragglers_of(args: argparse.Namespace) -> Stragglers:
    slow, factor = 0, 1.0
    if args.slow is not None:
        try:
            count, _, times = args.slow.partition(":")
            slow, factor = int(count), float(times)
        except ValueError:
            raise ValueError(f"--slow {args.slow!r}: give K:F, e.g. 2:3") from None
    return Stragglers(sigma=args.straggler_sigma, slow=slow, factor=factor)


def main(args: argparse.Namespace) -> int:
    entries = entries_of(args)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    stragglers = stragglers_of(args)
    parts = parts_of(args, entries)
    rows: list[dict[str, Any]] = []
    for entry in entries:
        for workers in _counts(args.sweep_workers, args.workers, "--sweep-workers"):
            for ps in _counts(args.sweep_ps, args.ps, "--sweep-ps"):
                setting, cluster, path = model_inputs(args, parts, entry, workers, ps)
                began = time.perf_counter()
                got = simulate(
                    setting,
                    parts.workload,
                    cluster,
                    path,
                    steps=args.steps,
                    stragglers=stragglers,
                    seed=args.seed,
                )
                rows.append(
                    _row(entry.label, workers, cluster.ps, got, time.perf_counter() - began)
                )
                rows[-1]["model_rate"] = predict(setting, parts.workload, cluster, path).rate
    if args.json:
        print(json.dumps({"workload": _workload(parts), "runs": rows}, indent=1))
    else:
        print(_table(rows))
    return 0


def _workload(parts: Any) -> dict[str, Any]:
    w = parts.workload
    return {
        "param_bytes": {"value": w.param_bytes.value, "source": w.param_bytes.source},
        "step": {"value": w.step.value, "source": w.step.source},
    }


def _row(label: str, workers: int, ps: int, got: SimResult, took: float) -> dict[str, Any]:
    busy = got.server_busy
    links = got.link_busy
    return {
        "scheme": label,
        "workers": workers,
        "ps": ps,
        "rate": got.rate,
        "seconds": got.seconds,
        "worker_steps": got.worker_steps,
        "server_busy": list(busy),
        "link_busy": list(links),
        "staleness": {str(k): v for k, v in got.staleness.items()},
        "staleness_mean": got.staleness_mean(),
        "wall_s": took,
    }


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{min(values):.0%}-{max(values):.0%}" if len(values) > 1 else f"{values[0]:.0%}"


def _table(rows: Sequence[dict[str, Any]]) -> str:
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
    total = sum(histogram.values())
    if not total:
        return "—"
    out, seen = [], 0
    marks = iter((0.5, 0.99))
    mark: float | None = next(marks)
    for key, count in sorted(((int(k), v) for k, v in histogram.items())):
        seen += count
        while mark is not None and seen >= mark * total:
            out.append(str(key))
            mark = next(marks, None)
    return ", ".join(out)
