"""Stragglers named, with their cause: injected slow-downs against the launcher's detector.

    python benchmarks/stragglers.py [--cases compute,data,link,server] [--only ps] [--clean 10]
        [--deadline 30] [--out DIR]
    python benchmarks/stragglers.py --overhead [--pairs 2] [--before REV] [--out DIR]

The matrix (the hogwild demo, 4 workers, 2 servers): each slow-down on one task, the run
watched until the launcher's first ``straggler`` event (or ``--deadline`` seconds of training):

- ``compute``: ``delay:worker:I=100ms`` (each step of worker I), I = 0..3: worker I, compute;
- ``data``: ``delay-data:worker:I=100ms`` (its data loader), I = 0..3: worker I, data;
- ``link``: ``slow:worker:I@step=1=10mbit`` and ``slow:ps:J@step=1=10mbit`` on emulated hosts
  (``--hosts 6``, root), I = 0..3, J = 0..1: that task, link;
- ``server``: ``delay:ps:J=30ms`` (each pull and push it answers), J = 0..1: ps J, server.

That is 16 cases; then ``--clean`` runs without a fault (every other one on emulated hosts,
where root allows), each watched for ``--deadline`` + 15 s of training: none may name anyone.
A case is right when the first task named is the expected one with the expected cause, within
the deadline (seconds count from the first worker's first metrics line).

``--overhead``: throughput with the measurements and the detector (this tree, B) against
``--before`` (a commit without them, A: ``git archive`` into a temporary folder, run from
there), A B A B ... ``--pairs`` times, each a hogwild demo run of 4 workers and 2 servers; the
ratio is B's mean samples/s over A's.

Writes ``results.json`` and ``results.md`` into ``--out``. Every run is stopped by its PID
(the run's process group) in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes)

DISTSGD = [sys.executable, "-m", "distsgd"]
DEMO = ["demo", "--scheme", "hogwild", "--workers", "4", "--ps", "2", "--quiet"]
DEMO += ["--log-every", "10", "--checkpoint-every", "0"]
BEFORE = "fe8b196"
"""The commit before the data phase, the per-server seconds and the detector."""


def matrix(cases: list[str]) -> list[dict[str, Any]]:
    """The injected cases: fault, whether it needs emulated hosts, the task and cause named."""
    out: list[dict[str, Any]] = []
    for i in range(4):
        if "compute" in cases:
            out.append(_case(f"delay:worker:{i}=100ms", f"worker{i}", "compute"))
        if "data" in cases:
            out.append(_case(f"delay-data:worker:{i}=100ms", f"worker{i}", "data"))
        if "link" in cases:
            out.append(_case(f"slow:worker:{i}@step=1=10mbit", f"worker{i}", "link", hosts=True))
    for j in range(2):
        if "link" in cases:
            out.append(_case(f"slow:ps:{j}@step=1=10mbit", f"ps{j}", "link", hosts=True))
        if "server" in cases:
            out.append(_case(f"delay:ps:{j}=30ms", f"ps{j}", "server"))
    return out


def _case(fault: str, task: str, cause: str, *, hosts: bool = False) -> dict[str, Any]:
    return {"fault": fault, "task": task, "cause": cause, "hosts": hosts}


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def watch(
    procs: bench.Processes, run_dir: Path, args: list[str], *, seconds: float, stop_at_first: bool
) -> dict[str, Any]:
    """Start the run, watch its ``straggler`` events for ``seconds`` of training (from its
    first worker line; at most 120 s of start-up); its first named, all named, and when."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = procs.start(
        [*DISTSGD, *DEMO, "--steps", "100000", "--run-dir", str(run_dir), *args],
        run_dir.parent / f"{run_dir.name}.log",
    )
    started, origin = time.monotonic(), None
    named: list[dict[str, Any]] = []
    try:
        while True:
            time.sleep(0.5)
            records = _records(run_dir / "metrics.jsonl")
            lines = [r for r in records if "samples" in r and "event" not in r]
            if origin is None and lines:
                origin = min(float(r["time"]) for r in lines)
            named = [
                r for r in records if r.get("event") == "straggler" and r.get("state") == "named"
            ]
            if proc.poll() is not None:
                break
            if origin is None:
                if time.monotonic() - started > 120:
                    break
                continue
            if (stop_at_first and named) or time.time() - origin > seconds:
                break
    finally:
        procs.stop(proc)
    first = named[0] if named else None
    return {
        "named": [f"{r['target']} ({r['cause']})" for r in named],
        "first_task": None if first is None else first["target"],
        "first_cause": None if first is None else first["cause"],
        "seconds": None if first is None or origin is None else round(first["time"] - origin, 1),
        "trained": origin is not None,
    }


def run_matrix(args: argparse.Namespace, procs: bench.Processes) -> dict[str, Any]:
    root = os.geteuid() == 0
    rows = []
    for n, case in enumerate(matrix(args.cases.split(","))):
        if not case["task"].startswith(args.only):
            continue
        if case["hosts"] and not root:
            rows.append({**case, "skipped": "needs root (emulated hosts)"})
            continue
        extra = ["--inject-fault", case["fault"], *(["--hosts", "6"] if case["hosts"] else [])]
        got = watch(
            procs, args.out / "runs" / f"case{n}", extra, seconds=args.deadline, stop_at_first=True
        )
        right = (got["first_task"], got["first_cause"]) == (case["task"], case["cause"])
        ok = right and got["seconds"] is not None and got["seconds"] <= args.deadline
        rows.append({**case, **got, "right": ok})
        print(_case_line(rows[-1]), flush=True)
    clean = []
    for n in range(args.clean):
        hosts = root and n % 2 == 1
        got = watch(
            procs,
            args.out / "runs" / f"clean{n}",
            ["--hosts", "6"] if hosts else [],
            seconds=args.deadline + 15,
            stop_at_first=False,
        )
        clean.append({"run": n, "hosts": hosts, **got})
        print(f"clean {n} hosts={hosts}: named {got['named'] or 'none'}", flush=True)
    return {"cases": rows, "clean": clean, "deadline": args.deadline}


def _case_line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return (
            f"| `{row['fault']}` | {row['task']} ({row['cause']}) | skipped: {row['skipped']} | | |"
        )
    named = f"{row['first_task']} ({row['first_cause']})" if row["first_task"] else "none"
    seconds = "" if row["seconds"] is None else f"{row['seconds']:.1f}"
    mark = "yes" if row["right"] else "**no**"
    return f"| `{row['fault']}` | {row['task']} ({row['cause']}) | {named} | {seconds} | {mark} |"


def matrix_markdown(result: dict[str, Any]) -> str:
    cases, clean = result["cases"], result["clean"]
    right = sum(1 for r in cases if r.get("right"))
    ran = sum(1 for r in cases if "skipped" not in r)
    false = sum(1 for r in clean if r["named"])
    lines = [
        f"Right task and cause within {result['deadline']:.0f} s: **{right} of {ran}**; "
        f"runs without faults naming a straggler: **{false} of {len(clean)}**.",
        "",
        "| fault | expected | first named | s to name | right |",
        "|---|---|---|---|---|",
        *(_case_line(r) for r in cases),
    ]
    if clean:
        lines += ["", "| run without faults | emulated hosts | named |", "|---|---|---|"]
        lines += [
            f"| {r['run']} | {'yes' if r['hosts'] else 'no'} | {', '.join(r['named']) or 'none'} |"
            for r in clean
        ]
    return "\n".join(lines) + "\n"


def _rate(run_dir: Path) -> float | None:
    """Samples per second of all workers together between their first and last lines."""
    lines = [r for r in _records(run_dir / "metrics.jsonl") if "samples" in r and "event" not in r]
    if not lines:
        return None
    first: dict[str, dict[str, Any]] = {}
    last: dict[str, dict[str, Any]] = {}
    for r in lines:
        first.setdefault(r["task"], r)
        last[r["task"]] = r
    samples = sum(last[t]["samples"] - first[t]["samples"] for t in last)
    seconds = max(r["time"] for r in last.values()) - min(r["time"] for r in first.values())
    return samples / seconds if seconds > 0 else None


def run_overhead(args: argparse.Namespace, procs: bench.Processes) -> dict[str, Any]:
    """A B A B: ``--before`` (A) against this tree (B), the same demo run each time."""
    rates: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="distsgd-before-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(bench.ROOT), "archive", args.before, "src"],
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True, timeout=60)
        env_a = {"PYTHONPATH": str(Path(tmp) / "src")}
        (args.out / "runs").mkdir(parents=True, exist_ok=True)
        for n in range(args.pairs):
            for kind, env in (("A", env_a), ("B", {})):
                run_dir = args.out / "runs" / f"overhead-{kind}{n}"
                cmd = [*DISTSGD, *DEMO, "--steps", str(args.steps), "--run-dir", str(run_dir)]
                proc = procs.start(cmd, args.out / "runs" / f"overhead-{kind}{n}.log", env=env)
                procs.wait([proc], timeout=600)
                rate = _rate(run_dir)
                if rate is not None:
                    rates[kind].append(rate)
                print(f"{kind}{n}: {rate and round(rate)} samples/s", flush=True)
    a, b = statistics.mean(rates["A"]), statistics.mean(rates["B"])
    return {"before": args.before, "steps": args.steps, "rates": rates, "ratio": round(b / a, 4)}


def overhead_markdown(result: dict[str, Any]) -> str:
    a, b = result["rates"]["A"], result["rates"]["B"]
    return (
        f"A B A B, {len(a)} pairs, hogwild demo 4 workers 2 servers {result['steps']} steps: "
        f"A (`{result['before']}`) {', '.join(f'{x:.0f}' for x in a)} samples/s; "
        f"B (this tree) {', '.join(f'{x:.0f}' for x in b)} samples/s; "
        f"**B / A = {result['ratio']:.3f}**\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="compute,data,link,server")
    parser.add_argument("--only", default="", help="only the cases of these tasks (ps, worker1)")
    parser.add_argument("--clean", type=int, default=10, help="runs without faults (default 10)")
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--overhead", action="store_true", help="the throughput A B A B instead")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--out", type=Path, default=Path("stragglers-results"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    procs = bench.Processes()
    try:
        if args.overhead:
            result = run_overhead(args, procs)
            text = overhead_markdown(result)
        else:
            result = run_matrix(args, procs)
            text = matrix_markdown(result)
    finally:
        procs.stop_all()
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
