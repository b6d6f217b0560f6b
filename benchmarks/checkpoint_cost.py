"""What the default checkpoints cost in training throughput (not part of CI).

Runs the demo with checkpoints off (``--checkpoint-every 0``), at the default cadence (no flag)
and every 5 seconds, in turn (A B C A B C ...: the machine's speed drifts, pairs stay fair),
and compares training throughput: samples per second of all workers from the first to the last
metrics line (start-up excluded). Prints a table and writes ``checkpoint_cost.json``.

    python benchmarks/checkpoint_cost.py [--epochs 120] [--rounds 2] [--scheme sync]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"off": ["--checkpoint-every", "0"], "default": [], "every 5s": ["--checkpoint-every", "5s"]}


def throughput(run_dir: Path) -> tuple[float, int]:
    """(samples per second of all workers, checkpoints completed) of one finished run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in records if "samples" in r and r["task"].startswith("worker")]
    span = max(r["time"] for r in samples) - min(r["time"] for r in samples)
    last: dict[str, int] = {}
    for r in samples:
        last[r["task"]] = r["samples"]
    checkpoints = run_dir / "checkpoints"
    done = len(list(checkpoints.glob("ckpt-*/MANIFEST.json"))) if checkpoints.exists() else 0
    return sum(last.values()) / max(span, 1e-3), done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scheme", default="sync")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("checkpoint_cost.json"))
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    counts: dict[str, list[int]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, flags in VARIANTS.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '')}-{round_}"
                cmd = [
                    sys.executable, "-m", "distsgd", "demo", "--scheme", args.scheme,
                    "--workers", str(args.workers), "--epochs", str(args.epochs), "--quiet",
                    "--run-dir", str(run_dir), *flags,
                ]  # fmt: skip
                started = time.monotonic()
                subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
                rate, done = throughput(run_dir)
                rates[name].append(rate)
                counts[name].append(done)
                print(
                    f"round {round_ + 1} {name:9s} {rate:8.0f} samples/s, {done} checkpoints, "
                    f"{time.monotonic() - started:.0f} s",
                    flush=True,
                )
    base = statistics.median(rates["off"])
    report = {
        name: {
            "samples_per_second": round(statistics.median(r), 1),
            "relative_to_off": round(statistics.median(r) / base, 4),
            "checkpoints": counts[name],
        }
        for name, r in rates.items()
    }
    args.out.write_text(json.dumps({"epochs": args.epochs, "scheme": args.scheme, **report}, indent=2) + "\n")
    print(f"{'variant':10s} {'samples/s':>10s} {'vs off':>8s}  checkpoints per run")
    for name, row in report.items():
        print(f"{name:10s} {row['samples_per_second']:10.0f} {row['relative_to_off']:8.4f}  {row['checkpoints']}")


if __name__ == "__main__":
    main()
