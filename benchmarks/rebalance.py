"""Live re-balancing against none, side by side: ``--rebalance auto`` against ``off`` on a
deliberately unbalanced placement (``benchmarks/unbalanced_script.py``: one large parameter and
32 small ones, dealt round-robin to 2 servers, about 3:1 in bytes).

    python benchmarks/rebalance.py [--link 1gbit] [--rounds 2] [--steps 600] [--out DIR]
        [--update-doc docs/performance.md] [--render RESULTS_JSON]

Each round runs ``off`` then ``auto`` (A B A B ...), Hogwild, 2 workers, 2 ps, ``--threads 1``,
checkpoints off. With ``--link RATE`` (root) each task is on an emulated host of its own, links
shaped to RATE: the servers' links are then the bottleneck, as across real hosts. On one host
(``--link ''``) the servers are a small share of the work and re-balancing has little to win.

For each run it takes the rate (worker-steps/s: the sum over workers of ``local_step /
seconds``), the moves (``rebalance`` events) and the updates each piece took, summed over the
servers (``result.json`` ``rebalance``), which must all equal workers x steps: no update lost.
For ``auto`` runs it also reads the servers' pushes/s before and after the first move
(``shard_load`` events). Writes ``results.json`` and ``results.md`` into ``--out``;
``--update-doc`` puts the table between the page's ``rebalance LINK`` markers (``rebalance
one host`` without a link). Every process is
stopped by its PID in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes, machine, script)

SCRIPT = HERE / "unbalanced_script.py"
WORKERS, SERVERS = 2, 2
TARGET = 1.2
"""The issue's bar: auto's rate at least this times off's, in the same benchmark run."""


def measure(
    procs: bench.Processes, tmp: Path, mode: str, steps: int, link: str | None, timeout: float
) -> dict[str, Any]:
    """One ``distsgd run``: its rate, moves, updates per piece and (auto) pushes/s around
    the first move."""
    run_dir = tmp / f"{mode}-{len(list(tmp.iterdir()))}"
    hosts = ["--hosts", str(WORKERS + SERVERS), "--link", link] if link else []
    cmd = [
        sys.executable, "-m", "distsgd", "run", "--scheme", "hogwild",
        "--workers", str(WORKERS), "--ps", str(SERVERS), "--param-placement", "round-robin",
        "--rebalance", mode, "--steps", str(steps), "--batch-size", str(bench.BATCH_SIZE),
        "--lr", str(bench.LR), "--threads", "1", "--checkpoint-every", "0",
        "--max-restarts", "0", "--quiet", *hosts, "--run-dir", str(run_dir), str(SCRIPT),
    ]  # fmt: skip
    log = tmp / f"{run_dir.name}.log"
    proc = procs.start(cmd, log)
    try:
        (code,) = procs.wait([proc], timeout)
    finally:
        bench._stop_run_tasks(run_dir, proc.pid)
    if code != 0:
        raise bench.Failed(f"distsgd run exited {code}: {bench._tail(log)}")
    return read_run(run_dir, steps)


def read_run(run_dir: Path, steps: int) -> dict[str, Any]:
    """What one run's folder says (see :func:`measure`)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [
        r
        for r in records
        if r.get("event") == "finished_steps" and str(r.get("task", "")).startswith("worker")
    ]
    moves = [r for r in records if r.get("event") == "rebalance"]
    result = json.loads((run_dir / "result.json").read_text())
    row: dict[str, Any] = {
        "rate": sum(r["local_step"] / r["seconds"] for r in done),
        "moves": sum(1 for r in moves if r.get("ok")),
        "failed_moves": sum(1 for r in moves if not r.get("ok")),
        "expected_updates": WORKERS * steps,
        "updates_per_piece": None,
    }
    summary = result.get("rebalance")
    if summary is not None:
        row["updates_per_piece"] = [summary["applies_min"], summary["applies_max"]]
    steps = [r for r in records if "event" not in r and str(r.get("task", "")).startswith("worker")]
    start = min((r["time"] for r in steps), default=0.0)
    row["series"] = {}
    for r in steps:
        row["series"].setdefault(r["task"], []).append(
            [round(r["time"] - start, 3), r["local_step"]]
        )
    first = next((r for r in moves if r.get("ok")), None)
    if first is not None:
        row["move"] = {k: first[k] for k in ("pieces", "bytes", "pause_s", "version")}
        row["move"]["before_mb_per_s"] = first["before_mb_per_s"]
        row["move"]["after_mb_per_s"] = first["after_mb_per_s"]
        row["move"]["at_s"] = round(first["time"] - start, 3)
    return row


def rate_between(series: dict[str, list[list[float]]], begin: float, end: float) -> float | None:
    """Worker-steps/s between two times (seconds from the run's first step record): each
    worker's steps between its first and last record inside, over that time, summed."""
    total = 0.0
    for points in series.values():
        inside = [p for p in points if begin <= p[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        total += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    return total


def phases(rows: list[dict[str, Any]]) -> None:
    """Each round's rates before and after its auto run's move, for both runs of the round
    over the same stretches of time (the off run has no move: its rate is the same in both)."""
    for round_ in {r["round"] for r in rows}:
        pair = {r["mode"]: r for r in rows if r["round"] == round_}
        move = pair.get("auto", {}).get("move")
        if move is None:
            continue
        for row in pair.values():
            row["before_move"] = rate_between(row["series"], 0.0, move["at_s"])
            row["after_move"] = rate_between(row["series"], move["at_s"] + 1.0, 1e9)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    where = f"emulated hosts, links of {report['link']}" if report["link"] else "one host"
    lines = [
        f"{m['date']}, distsgd {m['distsgd_commit']}; {m['cpu']}, {m['cores']} cores; {where}; "
        f"load average {m['load_before']} before.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| round | --rebalance | worker-steps/s | moves (at) | pause | ps0 MB/s before -> after "
        "(predicted) | worker-steps/s before -> after the move's time | updates per piece "
        "(expected) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        move = row.get("move")
        pause = f"{move['pause_s'] * 1000:.0f} ms" if move else "—"
        loads = (
            f"{move['before_mb_per_s'][0]:.0f} -> {move['after_mb_per_s'][0]:.0f}" if move else "—"
        )
        phase = (row.get("before_move"), row.get("after_move"))
        pushes_text = f"{phase[0]:.1f} -> {phase[1]:.1f}" if None not in phase else "—"
        moves = f"{row['moves']} ({move['at_s']:.1f} s)" if move else str(row["moves"])
        got = row["updates_per_piece"]
        updates = "—" if got is None else f"{got[0]}..{got[1]} ({row['expected_updates']})"
        lines.append(
            f"| {row['round']} | {row['mode']} | {row['rate']:.1f} | {moves} | {pause} | "
            f"{loads} | {pushes_text} | {updates} |"
        )
    ratio, after = report["ratio"], report.get("ratio_after_move")
    lines += [
        "",
        f"auto / off, the median of the rounds' ratios of whole runs: **{ratio:.2f}x** (the "
        f"target: at least {TARGET}x); {'met' if ratio >= TARGET else 'not met'}.",
    ]
    if after is not None:
        lines[-1] += f" After the move (from 1 s past it to the end): {after:.2f}x."
    return "\n".join(lines) + "\n"


def ratio_of(rows: list[dict[str, Any]], key: str = "rate") -> float | None:
    """The median over rounds of auto's ``key`` / off's (None: no round has both)."""
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        if row.get(key) is not None:
            by_round.setdefault(row["round"], {})[row["mode"]] = row[key]
    ratios = [r["auto"] / r["off"] for r in by_round.values() if len(r) == 2]
    return statistics.median(ratios) if ratios else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="1gbit", help="emulated hosts' links (root); '' none")
    parser.add_argument("--rounds", type=int, default=2, help="off, auto pairs")
    parser.add_argument("--steps", type=int, default=600, help="steps per worker of each run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--update-doc", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="a results.json: no runs")
    args = parser.parse_args(argv)
    if args.render is not None:
        write(json.loads(args.render.read_text()), args.render.parent, args.update_doc)
        return 0
    out = args.out or HERE / "results" / datetime.now().strftime("rebalance-%Y%m%d-%H%M%S")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": bench.machine(),
        "command": shlex.join(["python", "benchmarks/rebalance.py", *(argv or sys.argv[1:])]),
        "link": args.link or None,
        "rows": [],
    }
    procs = bench.Processes()
    try:
        for round_ in range(1, args.rounds + 1):
            for mode in ("off", "auto"):
                row = measure(procs, out / "runs", mode, args.steps, args.link or None, 900)
                row.update(round=round_, mode=mode)
                print(f"  round {round_} {mode}: {row['rate']:.1f} worker-steps/s, "
                      f"{row['moves']} move(s)", flush=True)  # fmt: skip
                report["rows"].append(row)
    finally:
        procs.stop_all()
    phases(report["rows"])
    report["ratio"] = ratio_of(report["rows"])
    report["ratio_after_move"] = ratio_of(report["rows"], "after_move")
    write(report, out, args.update_doc)
    return 0


def write(report: dict[str, Any], out: Path, doc_path: Path | None) -> None:
    """results.json and results.md into ``out``; the table between the page's markers."""
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "results.md").write_text(text)
    print(text)
    if doc_path is not None:
        link = report["link"]
        bench.put_between_markers(doc_path, f"rebalance {link or 'one host'}", text)


if __name__ == "__main__":
    sys.exit(main())
