"""``distsgd plan``: predict a run's worker-steps/s, bytes, bottleneck and staleness before it
starts (the cost model of ``distsgd.plan.cost``), for each scheme of ``--schemes``; with
``--simulate``, play the run event by event on the same parts instead (``distsgd.plan.simulate``):
throughput, each server's load and link, staleness, for clusters larger than one machine runs.

The model's parts are measured on this machine by short probe runs of the script
(``launcher/probe.py``) unless ``--step-ms`` and ``--model-mb`` are given; the data paths
it did not measure are taken from this project's published figures and said to be assumed.
``--sweep-ps`` and ``--sweep-workers`` simulate a grid of cluster sizes. What is printed:
:mod:`distsgd.cli.plan_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distsgd import schemes
from distsgd.cli import plan_report
from distsgd.launcher.config import DEMO_SCRIPT
from distsgd.plan.choices import (
    ASSUMED_PATHS,
    link_bytes_per_s,
    pull_encode,
    pull_factor,
    push_encode,
    push_factor,
    recommend,
)
from distsgd.plan.cost import (
    SERVER_APPLY_S_PER_BYTE,
    Cluster,
    Part,
    Path,
    Setting,
    Workload,
    predict,
    transfer_rate,
)
from distsgd.plan.simulate import Stragglers, simulate
from distsgd.schemes.entries import SchemeEntry, parse_entry, split_schemes

if TYPE_CHECKING:
    from distsgd.launcher.emulated import LinkProbe

DEFAULT_SCHEMES = "hogwild,sync,downpour(window=10),allreduce"

SIMULATOR = {
    "steps": 1000,
    "straggler_sigma": 0.1,
    "slow": None,
    "seed": 0,
    "sweep_ps": None,
    "sweep_workers": None,
}
"""The options of ``--simulate`` and their defaults (a flag not given is not in ``args``)."""


def add_command(sub: Any) -> None:
    """The ``plan`` command."""
    plan = sub.add_parser(
        "plan",
        help="predict each scheme's worker-steps/s, bytes per step, bottleneck and staleness "
        "on a cluster before running it, or play the run on the model (--simulate)",
        description="Predict a run from a cost model (docs/performance.md, 'The cost model'): "
        "the script's step time and size measured by short probe runs on this machine, or "
        "given with --step-ms and --model-mb. With --simulate, play the run event by event "
        "on the same parts (queues at servers and links, shared cores, stragglers).",
    )
    plan.add_argument(
        "--schemes",
        default=DEFAULT_SCHEMES,
        help=f"comma-separated entries as in distsgd compare, e.g. downpour(window=10) or "
        f"hogwild(wire_dtype=bf16,pull_dtype=bf16) (default {DEFAULT_SCHEMES})",
    )
    plan.add_argument("--workers", type=int, help="N (default 2; 16 with --simulate)")
    plan.add_argument("--ps", type=int, help="M servers (default 1; 2 with --simulate)")
    plan.add_argument(
        "--link",
        metavar="RATE",
        help="every host's link (1gbit, 100mbit): each task on a host of its own; default: "
        "one host, no link",
    )
    plan.add_argument(
        "--cores",
        type=float,
        help="cores the tasks share (default: this machine's without --link, none with it; "
        "give this machine's for emulated hosts, --hosts)",
    )
    plan.add_argument("--step-ms", type=float, help="a step's compute, ms")
    plan.add_argument("--model-mb", type=float, help="the model's float32 MB")
    plan.add_argument(
        "--assume",
        action="store_true",
        help="measure nothing: the paths' published figures (needs --step-ms and --model-mb)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_simulator_flags(plan)
    plan.add_argument("script", nargs="?", help="training script (default: the bundled demo)")
    plan.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_simulator_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation (16 to 256 workers in seconds)")
    sim.add_argument(
        "--simulate",
        action="store_true",
        help="play the run event by event on the model's parts: throughput, server load, "
        "staleness, the model's prediction beside it",
    )
    suppress = argparse.SUPPRESS
    sim.add_argument("--steps", type=int, default=suppress, help="steps per worker (default 1000)")
    sim.add_argument(
        "--straggler-sigma",
        type=float,
        default=suppress,
        help="log-normal sigma of each step's compute time (default 0.1)",
    )
    sim.add_argument(
        "--slow",
        default=suppress,
        metavar="K:F",
        help="K workers F times slower at every step (e.g. 2:3)",
    )
    sim.add_argument("--seed", type=int, default=suppress, help="the draws' seed (default 0)")
    sim.add_argument("--sweep-ps", default=suppress, metavar="M,M,...", help="servers to sweep")
    sim.add_argument(
        "--sweep-workers", default=suppress, metavar="N,N,...", help="workers to sweep"
    )


@dataclass(frozen=True, kw_only=True)
class Parts:
    """Everything the model takes besides a setting: the workload and each path."""

    workload: Workload
    paths: dict[str, Path]
    link: LinkProbe | None = None
    """The ``--link`` measured on emulated hosts; None: not measured (``--assume``, or no
    privilege to emulate hosts): its two ways assumed not to slow each other (``D`` 1) and
    transfers started together to share it (``Q`` 0)."""


def _probe_parts(args: argparse.Namespace, entries: Sequence[SchemeEntry]) -> Parts:
    """Measure the workload and the paths the cluster will use, with short runs; a probe that
    fails is the user's to fix (their script), told in one line."""
    from distsgd.launcher.probe import ProbeFailed

    script = args.script or str(DEMO_SCRIPT)
    try:
        return _measured_parts(args, entries, script)
    except ProbeFailed as exc:
        raise ValueError(
            f"could not measure {os.path.basename(script)} ({exc}); run it with distsgd run "
            "to see why, or give --step-ms and --model-mb"
        ) from None


def _measured_parts(args: argparse.Namespace, entries: Sequence[SchemeEntry], script: str) -> Parts:
    from distsgd.launcher.probe import probe_allreduce, probe_exchange

    across = args.link is not None
    _say(f"measuring {os.path.basename(script)}: Hogwild, 1 worker + 1 ps ...")
    got = probe_exchange(script, args.script_args, shared_memory=not across)
    measured = f"measured: {got.steps} steps of Hogwild, 1 worker + 1 ps, {got.path}"
    workload = Workload(
        param_bytes=Part(value=got.param_bytes, source=f"{measured} (bytes of a float32 push)"),
        step=Part(value=got.compute_s, source=f"{measured} (the loop outside pull and push)"),
    )
    assumed = ASSUMED_PATHS[got.path]
    latency = assumed.latency.value
    # What a push took beyond the assumed cost of moving it is the server's (its log, waits
    # for the page cache's writeback): work one push after another, not CPU of the worker's.
    beyond = max(0.0, got.push_s - latency - got.param_bytes / assumed.push.value)
    paths = dict(ASSUMED_PATHS)
    paths[got.path] = dataclasses.replace(
        assumed,
        pull=transfer_rate(
            got.param_bytes, got.pull_s, fixed=latency, assumed=assumed.pull, source=measured
        ),
        push=transfer_rate(
            got.param_bytes, got.push_s, fixed=latency, assumed=assumed.push, source=measured
        ),
        push_cpu=assumed.push,
        server=Part(
            value=SERVER_APPLY_S_PER_BYTE.value + beyond / got.param_bytes,
            source=f"{measured} (the push's time beyond the assumed transfer, and the update)",
        ),
    )
    if any(schemes.get(e.scheme).collective for e in entries) and not across:
        _say("measuring all-reduce, 2 workers ...")
        ar = probe_allreduce(script, args.script_args)
        source = f"measured: {ar.steps} steps of all-reduce, 2 workers (step beyond compute)"
        gloo = ASSUMED_PATHS["gloo"]
        # 2 workers: one all-reduce is 2 messages of the model's bytes between them
        fixed = got.compute_s + 2 * gloo.latency.value
        rate = transfer_rate(
            got.param_bytes, ar.step_s, fixed=fixed, assumed=gloo.pull, source=source
        )
        paths["gloo"] = Path(name="gloo", latency=gloo.latency, pull=rate, push=rate)
    link = _probe_link(args, got.param_bytes) if across else None
    return Parts(workload=workload, paths=paths, link=link)


def _probe_link(args: argparse.Namespace, param_bytes: int) -> LinkProbe | None:
    """The ``--link`` measured with one server's share of the model; None (said) where
    emulated hosts cannot be made here."""
    from distsgd.launcher.emulated import probe_link

    _say(f"measuring a {args.link} link on emulated hosts ...")
    try:
        return probe_link(args.link, param_bytes // max(1, args.ps), workers=args.workers)
    except ValueError as exc:
        _say(f"the link is not measured ({exc}); assuming its two ways do not slow each other")
        return None


def _given_parts(args: argparse.Namespace) -> Parts:
    if args.step_ms is None or args.model_mb is None:
        raise ValueError("--assume needs --step-ms and --model-mb (or drop --assume to measure)")
    if args.step_ms <= 0 or args.model_mb <= 0:
        raise ValueError("--step-ms and --model-mb must be > 0")
    workload = Workload(
        param_bytes=Part(value=args.model_mb * 1e6, source="given: --model-mb"),
        step=Part(value=args.step_ms / 1e3, source="given: --step-ms"),
    )
    return Parts(workload=workload, paths=dict(ASSUMED_PATHS))


def _setting(entry: SchemeEntry, workers: int) -> Setting:
    spec = schemes.get(entry.scheme)
    options = spec.parse_options(entry.options)
    spec.check(options, workers)  # the scheme's own checks of its options
    wire = str(entry.overrides.get("wire_dtype", "float32"))
    pull = str(entry.overrides.get("pull_dtype", "float32"))
    topk = float(entry.overrides.get("topk", 0.0))
    return Setting(
        label=entry.label,
        exchange=spec.exchange(options),
        push_factor=push_factor(wire, topk),
        pull_factor=pull_factor(pull),
        push_encode=push_encode(wire, topk),
        pull_encode=pull_encode(pull),
    )


def _cluster(args: argparse.Namespace, workers: int, ps: int, probe: LinkProbe | None) -> Cluster:
    link = link_bytes_per_s(args.link) if args.link is not None else None
    cores = args.cores
    if cores is None and link is None:
        cores = float(os.cpu_count() or 1)
    if link is None or probe is None:
        return Cluster(workers=workers, ps=ps, link=link, cores=cores)
    return Cluster(
        workers=workers, ps=ps, link=link, cores=cores, duplex=probe.duplex, turns=probe.turns
    )


def _path_for(parts: Parts, link: float | None, collective: bool) -> Path:
    if collective:
        return parts.paths["gloo"]
    return parts.paths["tensor socket" if link is not None else "shared memory"]


def _entries(args: argparse.Namespace) -> list[SchemeEntry]:
    """``--schemes`` parsed, with the cluster's sizes checked."""
    if args.workers < 1 or args.ps < 1:
        raise ValueError("--workers and --ps must be at least 1")
    entries = [parse_entry(text) for text in split_schemes(args.schemes)]
    if not entries:
        raise ValueError(
            "--schemes is empty; name at least one scheme (see distsgd run --help-scheme)"
        )
    return entries


def _parts(args: argparse.Namespace, entries: Sequence[SchemeEntry]) -> Parts:
    """The parts given (``--assume``, or both ``--step-ms`` and ``--model-mb``) or measured."""
    given = args.assume or (args.step_ms is not None and args.model_mb is not None)
    return _given_parts(args) if given else _probe_parts(args, entries)


def _model_inputs(
    args: argparse.Namespace, parts: Parts, entry: SchemeEntry, workers: int, ps: int
) -> tuple[Setting, Cluster, Path]:
    """What the model takes for one entry on a cluster of ``workers`` and ``ps``."""
    setting = _setting(entry, workers)
    collective = setting.exchange.kind == "collective"
    cluster = _cluster(args, workers, 0 if collective else ps, parts.link)
    return setting, cluster, _path_for(parts, cluster.link, collective)


def _resolve(args: argparse.Namespace) -> None:
    """The defaults that depend on ``--simulate``; a simulator option without it is refused."""
    given = ["--" + name.replace("_", "-") for name in SIMULATOR if name in vars(args)]
    if given and not args.simulate:
        flags = ", ".join(given)
        raise ValueError(f"{flags}: options of --simulate; add --simulate or drop {flags}")
    for name, default in SIMULATOR.items():
        vars(args).setdefault(name, default)
    if args.workers is None:
        args.workers = 16 if args.simulate else 2
    if args.ps is None:
        args.ps = 2 if args.simulate else 1


def main(args: argparse.Namespace) -> int:
    _resolve(args)
    entries = _entries(args)
    if args.simulate:
        return _simulate(args, entries)
    parts = _parts(args, entries)
    rows = []
    for entry in entries:
        setting, cluster, path = _model_inputs(args, parts, entry, args.workers, args.ps)
        collective = setting.exchange.kind == "collective"
        got = predict(setting, parts.workload, cluster, path)
        advice = None
        if not collective:
            advice = recommend(
                setting, parts.workload, cluster, lambda c: _path_for(parts, c.link, False)
            )
        rows.append((got, path, advice))
    if args.json:
        print(json.dumps(plan_report.prediction_json(parts, rows), indent=1))
    else:
        print(plan_report.prediction_table(args, parts, rows))
    return 0


def _simulate(args: argparse.Namespace, entries: Sequence[SchemeEntry]) -> int:
    """``--simulate``: play each entry on each cluster size of the sweeps."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    stragglers = _stragglers(args)
    sizes = [
        (workers, ps)
        for workers in _counts(args.sweep_workers, args.workers, "--sweep-workers")
        for ps in _counts(args.sweep_ps, args.ps, "--sweep-ps")
    ]
    parts = _parts(args, entries)
    runs: list[dict[str, Any]] = []
    for entry in entries:
        for workers, ps in sizes:
            setting, cluster, path = _model_inputs(args, parts, entry, workers, ps)
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
            took = time.perf_counter() - began
            runs.append(plan_report.simulated_run(entry.label, workers, cluster.ps, got, took))
            runs[-1]["model_rate"] = predict(setting, parts.workload, cluster, path).rate
    if args.json:
        workload = dataclasses.asdict(parts.workload)
        print(json.dumps({"workload": workload, "runs": runs}, indent=1))
    else:
        print(plan_report.simulation_table(runs))
    return 0


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


def _stragglers(args: argparse.Namespace) -> Stragglers:
    slow, factor = 0, 1.0
    if args.slow is not None:
        try:
            count, _, times = args.slow.partition(":")
            slow, factor = int(count), float(times)
        except ValueError:
            raise ValueError(f"--slow {args.slow!r}: give K:F, e.g. 2:3") from None
    return Stragglers(sigma=args.straggler_sigma, slow=slow, factor=factor)


def _say(text: str) -> None:
    print(f"distsgd plan: {text}", file=sys.stderr, flush=True)
