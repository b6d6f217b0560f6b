"""What seeing inside a run costs its training: this tree against a tree from before issue 40
(no probes, no calls-in-flight record, no metrics endpoint, no straggler watch), side by side.

    python benchmarks/observe_overhead.py [--base 0b5ae78] [--rounds 4] [--steps 1500]
        [--scheme hogwild] [--out DIR]

The base tree is a ``git worktree`` of ``--base`` (made in ``--out``, removed at the end); a run
of it has its ``src``, ``emulate`` and ``extras`` first on ``PYTHONPATH``, so every task it
starts imports that code. Each round runs the base, then this tree (A B A B ...), the same
``distsgd demo`` (``--workers 2 --ps 2``, ``--threads 1``, checkpoints off, ``--quiet``), and
takes its rate in worker-steps/s from ``metrics.jsonl`` (each worker's local steps between its
first and last training line, over that time, summed). Prints each round's pair, the median of
the paired ratios (this tree / base) and writes ``results.json`` into ``--out``. Every process
is stopped by its process group in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes)


def rate(run_dir: Path) -> float:
    """Worker-steps/s of a finished run (see the module docstring)."""
    first: dict[str, tuple[float, int]] = {}
    last: dict[str, tuple[float, int]] = {}
    for raw in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        task = str(record.get("task", ""))
        if not task.startswith("worker") or "samples" not in record or "event" in record:
            continue
        point = (float(record["time"]), int(record["local_step"]))
        first.setdefault(task, point)
        last[task] = point
    total = 0.0
    for task, (t0, s0) in first.items():
        t1, s1 = last[task]
        if t1 > t0:
            total += (s1 - s0) / (t1 - t0)
    if total <= 0:
        raise bench.Failed(f"no training lines in {run_dir}")
    return total


def one(tree: Path | None, args: argparse.Namespace, name: str, procs: bench.Processes) -> float:
    run_dir = args.out / name
    cmd = [sys.executable, "-m", "distsgd", "demo", "--scheme", args.scheme, "--workers", "2"]
    cmd += ["--ps", "2", "--steps", str(args.steps), "--threads", "1", "--quiet"]
    cmd += ["--checkpoint-every", "0", "--run-dir", str(run_dir)]
    env: dict[str, str] = {}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("src", "emulate", "extras"))
    proc = procs.start(cmd, args.out / f"{name}.log", env=env)
    codes = procs.wait([proc], timeout=600)
    if codes != [0]:
        raise bench.Failed(f"{name} exited {codes}: see {args.out / f'{name}.log'}")
    return rate(run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0b5ae78")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--scheme", default="hogwild")
    parser.add_argument("--out", type=Path, default=Path("/tmp/observe-overhead"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / "base-tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base],
        check=True,
        capture_output=True,
    )
    procs = bench.Processes()
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            before = one(base, args, f"r{r}-base", procs)
            now = one(None, args, f"r{r}-this", procs)
            rows.append(
                {
                    "round": r,
                    "base": round(before, 2),
                    "this": round(now, 2),
                    "ratio": round(now / before, 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        procs.stop_all()
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
            check=False,
            capture_output=True,
        )
    ratio = statistics.median(r["ratio"] for r in rows)
    result = {
        "base": args.base,
        "scheme": args.scheme,
        "steps": args.steps,
        "rounds": rows,
        "median_ratio": ratio,
        "command": " ".join(sys.argv),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"median this/base: {ratio:.4f} ({(ratio - 1) * 100:+.1f}%) over {len(rows)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
