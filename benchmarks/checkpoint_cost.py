"""What the default checkpoints cost in training throughput (not part of CI).

Runs the demo with checkpoints off (``--checkpoint-every 0``), at the default cadence (no flag)
and every 5 seconds, in turn (A B C A B C ...: the machine's speed drifts, neighbours stay
fair), and reports two figures for each: training throughput (samples per second of all
workers from the first to the last metrics line, start-up excluded) relative to checkpoints
off, which is as noisy as the machine; and the share of each worker's training time spent in
checkpoints, which each worker measures itself (``checkpoint_seconds`` of its
``finished_steps`` event; the largest share over the workers, as a synchronous step waits for
the slowest). Prints a table and writes ``checkpoint_cost.json``.

    python benchmarks/checkpoint_cost.py [--epochs 90] [--rounds 3] [--scheme sync]
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

VARIANTS = {
    "off": ["--checkpoint-every", "0"],
    "default": [],
    "every 5s": ["--checkpoint-every", "5s"],
}


def measure(run_dir: Path) -> tuple[float, int, float]:
    """(samples per second of all workers, checkpoints per worker, share of each worker's
    training time spent checkpointing) of one finished run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in records if "samples" in r and r["task"].startswith("worker")]
    span = max(r["time"] for r in samples) - min(r["time"] for r in samples)
    last: dict[str, int] = {}
    for r in samples:
        last[r["task"]] = r["samples"]
    done = [r for r in records if r.get("event") == "finished_steps"]
    count = max(r["checkpoints"] for r in done)
    share = max(r["checkpoint_seconds"] / max(r["seconds"], 1e-9) for r in done)
    return sum(last.values()) / max(span, 1e-3), count, share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scheme", default="sync")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("checkpoint_cost.json"))
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    counts: dict[str, list[int]] = {name: [] for name in VARIANTS}
    shares: dict[str, list[float]] = {name: [] for name in VARIANTS}
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
                rate, done, share = measure(run_dir)
                rates[name].append(rate)
                counts[name].append(done)
                shares[name].append(share)
                print(
                    f"round {round_ + 1} {name:9s} {rate:8.0f} samples/s, {done} checkpoints, "
                    f"{100 * share:.2f}% of training time in them, "
                    f"{time.monotonic() - started:.0f} s",
                    flush=True,
                )
    base = statistics.median(rates["off"])
    report = {
        name: {
            "samples_per_second": round(statistics.median(r), 1),
            "relative_to_off": round(statistics.median(r) / base, 4),
            "checkpoints": counts[name],
            "share_of_training_time": round(statistics.median(shares[name]), 5),
        }
        for name, r in rates.items()
    }
    summary = {"epochs": args.epochs, "scheme": args.scheme, **report}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'variant':10s} {'samples/s':>10s} {'vs off':>8s} {'time in ckpt':>13s}  checkpoints")
    for name, row in report.items():
        print(
            f"{name:10s} {row['samples_per_second']:10.0f} {row['relative_to_off']:8.4f} "
            f"{100 * row['share_of_training_time']:12.2f}%  {row['checkpoints']}"
        )


if __name__ == "__main__":
    main()
