"""Soak test (not part of CI): train for about 10 minutes while killing random tasks.

Every 20-40 seconds one task of the run (a worker or a parameter server, chosen at random) is
killed with SIGKILL, by the PID the launcher recorded in ``tasks.json``. The launcher restarts
it from the last checkpoint. At the end this prints and writes ``soak.json``:
faults injected, faults survived (restarts the launcher logged), updates and steps lost (as the
launcher measured them), and the final test accuracy.

    python benchmarks/soak.py [--minutes 10] [--scheme hogwild] [--workers 2] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

DIGITS_TRAIN = 1437  # images in the demo's training split


def calibrate(scheme: str, workers: int, run_dir: Path) -> float:
    """Samples per second of the demo on this machine (one short undisturbed run)."""
    cmd = [sys.executable, "-m", "distsgd", "demo", "--scheme", scheme, "--workers", str(workers),
           "--quiet", "--run-dir", str(run_dir), "--epochs", "6"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in records if "samples" in r]
    span = max(r["time"] for r in samples) - min(r["time"] for r in samples)
    last = {r["task"]: r["samples"] for r in samples}
    return sum(last.values()) / max(span, 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--scheme", default="hogwild")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("distsgd-runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    rate = calibrate(args.scheme, args.workers, args.out / "calibration")
    # Faults cost time (restarts, redone steps): aim the undisturbed length at 80% of the budget.
    epochs = max(1, round(0.8 * rate * args.minutes * 60 / DIGITS_TRAIN))
    run_dir = args.out / "run"
    cmd = [sys.executable, "-m", "distsgd", "demo", "--scheme", args.scheme, "--workers", str(args.workers),
           "--quiet", "--run-dir", str(run_dir), "--epochs", str(epochs), "--checkpoint-every", "10s",
           "--max-restarts", "1000"]
    print(f"calibrated {rate:.0f} samples/s; running {epochs} epochs with random kills", flush=True)
    started = time.monotonic()
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    injected: list[dict] = []
    try:
        next_kill = time.monotonic() + rng.uniform(20, 40)
        while launcher.poll() is None:
            time.sleep(0.5)
            if time.monotonic() < next_kill:
                continue
            next_kill = time.monotonic() + rng.uniform(20, 40)
            try:
                pids = json.loads((run_dir / "tasks.json").read_text())
            except (FileNotFoundError, ValueError):
                continue
            name = rng.choice(sorted(pids))
            # Only a live child of our launcher: a recorded PID may already have been reused.
            ours = {p.pid for p in psutil.Process(launcher.pid).children()}
            if pids[name] not in ours:
                continue
            try:
                os.kill(pids[name], signal.SIGKILL)
            except ProcessLookupError:
                continue
            injected.append({"task": name, "at": round(time.monotonic() - started, 1)})
            print(f"[soak] {injected[-1]['at']:7.1f}s  SIGKILL {name} (pid {pids[name]})", flush=True)
        output = launcher.stdout.read() if launcher.stdout else ""
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=60)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    faults = [r for r in records if r.get("event") == "fault"]
    report = {
        "scheme": args.scheme, "workers": args.workers, "minutes": round((time.monotonic() - started) / 60, 2),
        "exit_code": launcher.returncode, "faults_injected": len(injected),
        "faults_survived": sum(1 for r in faults if r.get("action", "").startswith("restart")),
        "updates_lost": sum(r.get("lost_updates", 0) for r in faults),
        "steps_lost": sum(r.get("lost_steps", 0) for r in faults),
        "final_accuracy": json.loads((run_dir / "result.json").read_text()).get("test_accuracy")
        if (run_dir / "result.json").exists() else None,
        "injected": injected,
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(output[-3000:])
    print(json.dumps({k: v for k, v in report.items() if k != "injected"}, indent=2))


if __name__ == "__main__":
    main()
