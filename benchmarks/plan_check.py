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
between the page's ``plan check`` markers. Every process is stopped by its PID in ``finally``.
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
BEGIN, END = "<!-- plan check: begin -->", "<!-- plan check: end -->"


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
        "| workers | scheme | predicted worker-steps/s | bottleneck | measured | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        error = row["predicted"] / row["measured"] - 1 if row["measured"] else None
        shown = "—" if error is None else f"{error:+.0%}"
        lines.append(
            f"| {row['workers']} | {row['entry']} | {row['predicted']:.1f} | "
            f"{row['bottleneck']} | {row['measured']:.1f} | {shown} |"
        )
    within = [r for r in report["rows"] if r["measured"]]
    worst = max((abs(r["predicted"] / r["measured"] - 1) for r in within), default=0.0)
    lines += ["", f"Largest error: {worst:.0%} (the target: within 25%)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, in turn")
    parser.add_argument("--steps", type=int, default=300, help="steps per worker of each run")
    parser.add_argument("--link", default=None, help="emulated hosts with this link (root)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--update-doc", type=Path, default=None)
    args = parser.parse_args(argv)
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
            predicted = plan(workers, args.link, 600)["predictions"]
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
                        "measured": rate,
                    }
                )
    finally:
        procs.stop_all()
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "results.md").write_text(text)
    print(text)
    if args.update_doc is not None:
        doc = args.update_doc.read_text(encoding="utf-8")
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{args.update_doc}: no {BEGIN} ... {END} markers")
        head, rest = doc.split(BEGIN, 1)
        args.update_doc.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
