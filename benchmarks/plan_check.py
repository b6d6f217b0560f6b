"""The cost model against real runs: ``distsgd plan``'s predicted worker-steps/s beside the rate
``distsgd run`` measures, for Hogwild, sync, DOWNPOUR (window 10) and all-reduce on the MLP of
docs/performance.md.

    python benchmarks/plan_check.py [--workers 2,4] [--steps 300] [--link 1gbit] [--out DIR]
        [--update-doc docs/performance.md]

For each worker count: one ``distsgd plan --json`` of ``benchmarks/mlp_script.py`` (its probe
runs measure the step and the data paths on this machine), then one ``distsgd run`` per scheme
(1 ps for the parameter-server schemes, ``--threads 1``, checkpoints off), whose rate is the
sum over workers of ``local_step / seconds`` (``finished_steps``), as ``run.py`` takes it.
With ``--link RATE`` (root), every run places each task on an emulated host of its own
(``--hosts``), links shaped to RATE, and the plan is told the link and this machine's cores.
Writes ``results.json`` and ``results.md`` into ``--out``; ``--update-doc`` puts the table
between the page's ``plan check`` markers (``plan check 1gbit`` with ``--link 1gbit``);
``--render RESULTS_JSON`` does that again from an earlier run, measuring nothing. Every
process is stopped by its PID in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes, machine, script)

SCHEMES = (
    ("hogwild", "hogwild", ()),
    ("sync", "sync", ()),
    ("downpour(window=10)", "downpour", ("--window", "10")),
    ("allreduce", "allreduce", ()),
)
"""(plan entry, scheme, run flags)."""


def markers(link: str | None) -> tuple[str, str]:
    """The page's markers of the table for ``link`` (one host: ``plan check``)."""
    name = f"plan check {link}" if link else "plan check"
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def plan(workers: int, link: str | None, timeout: float) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "distsgd", "plan", "--json", "--workers", str(workers),
        "--ps", "1", "--schemes", ",".join(entry for entry, _, _ in SCHEMES),
    ]  # fmt: skip
    if link:
        cmd += ["--link", link, "--cores", str(os.cpu_count() or 1)]
    done = subprocess.run(
        [*cmd, str(bench.MLP_SCRIPT)], capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise bench.Failed(f"distsgd plan exited {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def simulated(got: dict[str, Any], planned: dict[str, Any], workers: int, link: str | None,
              steps: int, staggered: bool = False) -> float:  # fmt: skip
    """The simulator's rate for one of ``distsgd plan --json``'s predictions (its parts, the
    link as the plan measured it); ``staggered``: windowed exchanges across hosts played
    apart (the other regime)."""
    from distsgd.plan.choices import link_bytes_per_s
    from distsgd.plan.cost import Cluster, Part, Path, Setting, Workload
    from distsgd.plan.simulate import Stragglers, simulate
    from distsgd.plan.traffic import Exchange

    def part(d: dict[str, Any] | None) -> Part | None:
        return None if d is None else Part(**d)

    p = got["path"]
    path = Path(
        name=p["name"], latency=Part(**p["latency"]), pull=Part(**p["pull"]),
        push=Part(**p["push"]), encoded_pulls=p["encoded_pulls"],
        push_cpu=part(p.get("push_cpu")), server=part(p.get("server")),
    )  # fmt: skip
    s = got["setting"]
    setting = Setting(**{**s, "exchange": Exchange(**s["exchange"])})
    workload = planned["workload"]
    work = Workload(param_bytes=Part(**workload["param_bytes"]), step=Part(**workload["step"]))
    collective = s["exchange"]["kind"] == "collective"
    probe = planned.get("link") or {}
    cluster = Cluster(
        workers=workers, ps=0 if collective else 1,
        link=link_bytes_per_s(link) if link else None, cores=float(os.cpu_count() or 1),
        duplex=probe.get("duplex", 1.0), turns=probe.get("turns", 0.0),
    )  # fmt: skip
    noise = Stragglers(sigma=0.1)
    return simulate(
        setting, work, cluster, path, steps=steps, stragglers=noise, staggered=staggered
    ).rate


def measure(
    procs: bench.Processes, tmp: Path, scheme: str, flags: tuple[str, ...], workers: int,
    steps: int, link: str | None, timeout: float,
) -> float:  # fmt: skip
    run_dir = tmp / f"{scheme}-{workers}w-{len(list(tmp.iterdir()))}"
    ps = [] if scheme == "allreduce" else ["--ps", "1"]
    count = workers + (0 if scheme == "allreduce" else 1)  # a host per task
    hosts = ["--hosts", str(count), "--link", link] if link else []
    cmd = [
        sys.executable, "-m", "distsgd", "run", "--scheme", scheme, "--workers", str(workers),
        *ps, *flags, "--steps", str(steps), "--batch-size", str(bench.BATCH_SIZE),
        "--lr", str(bench.LR), "--threads", "1", "--checkpoint-every", "0",
        "--max-restarts", "0", "--quiet", *hosts, "--run-dir", str(run_dir),
        str(bench.MLP_SCRIPT),
    ]  # fmt: skip
    log = tmp / f"{run_dir.name}.log"
    proc = procs.start(cmd, log)
    try:
        (code,) = procs.wait([proc], timeout)
    finally:
        bench._stop_run_tasks(run_dir, proc.pid)
    if code not in (0, 3):
        raise bench.Failed(f"distsgd run exited {code}: {bench._tail(log)}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [
        r
        for r in records
        if r.get("event") == "finished_steps" and str(r.get("task", "")).startswith("worker")
    ]
    return sum(r["local_step"] / r["seconds"] for r in done)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    where = f"emulated hosts, links of {report['link']}" if report["link"] else "one host"
    lines = [
        f"{m['date']}, distsgd {m['distsgd_commit']}; {m['cpu']}, {m['cores']} cores; {where}; "
        f"load average {m['load_before']} before.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| workers | scheme | predicted worker-steps/s | bottleneck | error | simulated | error "
        "| measured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def error(row: dict[str, Any], key: str) -> str:
        if key not in row or not row["measured"]:
            return "—"
        return f"{relative_error(row, key):+.0%}"

    def rate(row: dict[str, Any], key: str) -> str:
        if key not in row:
            return "—"
        high = row.get(f"{key}_staggered")
        return f"{row[key]:.1f}" + ("" if high is None else f" to {high:.1f}")

    for row in report["rows"]:
        lines.append(
            f"| {row['workers']} | {row['entry']} | {rate(row, 'predicted')} | "
            f"{row['bottleneck']} | {error(row, 'predicted')} | {rate(row, 'simulated')} | "
            f"{error(row, 'simulated')} | {row['measured']:.1f} |"
        )
    probes = {r["workers"]: r["link"] for r in report["rows"] if r.get("link")}
    for workers, probe in probes.items():
        lines += [
            "",
            f"The link as `distsgd plan --workers {workers}` measured it: each way at "
            f"{probe['duplex']:.0%} while both carry transfers ({probe['peers']} hosts), "
            f"transfers started together in turn {probe['turns']:.2f} (0: sharing, 1: in "
            f"turn), {probe['nbytes'] / 1e6:.2f} MB in {probe['alone_s'] * 1e3:.0f} ms alone.",
        ]
    for key, name in (("predicted", "the model's"), ("simulated", "the simulator's")):
        rows = [r for r in report["rows"] if r["measured"] and key in r]
        worst = max((abs(relative_error(r, key)) for r in rows), default=0.0)
        lines += ["", f"Largest error of {name} rates: {worst:.0%} (the target: within 25%)."]
    if any("predicted_staggered" in r for r in report["rows"]):
        lines += [
            "",
            "A range: windowed exchanges across hosts together (sharing the servers' links) "
            "to apart; a run settles in one regime or the other, and its error is to the "
            "nearer end (0% inside the range).",
        ]
    return "\n".join(lines) + "\n"


def relative_error(row: dict[str, Any], key: str) -> float:
    """The rate's error against the measured one; for a range, to its nearer end (0 inside)."""
    low, measured = row[key], row["measured"]
    high = row.get(f"{key}_staggered")
    if high is not None and low <= measured <= high:
        return 0.0
    nearer = low if high is None or abs(low - measured) < abs(high - measured) else high
    return float(nearer / measured - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, in turn")
    parser.add_argument("--steps", type=int, default=300, help="steps per worker of each run")
    parser.add_argument("--link", default=None, help="emulated hosts with this link (root)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--update-doc", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="a results.json: no runs")
    args = parser.parse_args(argv)
    if args.render is not None:
        write(json.loads(args.render.read_text()), args.render.parent, args.update_doc)
        return 0
    out = args.out or HERE / "results" / datetime.now().strftime("plan-%Y%m%d-%H%M%S")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": bench.machine(),
        "command": shlex.join(["python", "benchmarks/plan_check.py", *(argv or sys.argv[1:])]),
        "link": args.link,
        "rows": [],
    }
    procs = bench.Processes()
    try:
        for workers in (int(w) for w in args.workers.split(",")):
            planned = plan(workers, args.link, 600)
            predicted = planned["predictions"]
            for (entry, scheme, flags), got in zip(SCHEMES, predicted, strict=True):
                rate = measure(
                    procs, out / "runs", scheme, flags, workers, args.steps, args.link, 900
                )
                print(f"  {workers} workers {entry}: predicted {got['rate']:.1f}, "
                      f"measured {rate:.1f}", flush=True)  # fmt: skip
                report["rows"].append(
                    {
                        "workers": workers,
                        "entry": entry,
                        "predicted": got["rate"],
                        "bottleneck": got["bottleneck"],
                        "simulated": simulated(got, planned, workers, args.link, args.steps),
                        "measured": rate,
                        "link": planned.get("link"),
                    }
                )
                if got.get("staggered") is not None:
                    report["rows"][-1]["predicted_staggered"] = got["staggered"]
                    report["rows"][-1]["simulated_staggered"] = simulated(
                        got, planned, workers, args.link, args.steps, staggered=True
                    )
    finally:
        procs.stop_all()
    write(report, out, args.update_doc)
    return 0


def write(report: dict[str, Any], out: Path, doc_path: Path | None) -> None:
    """results.json and results.md into ``out``; the table between the page's markers."""
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "results.md").write_text(text)
    print(text)
    if doc_path is None:
        return
    link = report["link"]
    bench.put_between_markers(doc_path, f"plan check {link}" if link else "plan check", text)


if __name__ == "__main__":
    sys.exit(main())
