"""Soak test (not part of CI): the same training undisturbed and under random SIGKILLs.

The demo is calibrated to take about ``--minutes`` undisturbed on this machine. Then it runs
twice with the same seed and flags: once undisturbed, once while every 20-40 seconds one task
of the run (a worker or the parameter server, chosen at random) is killed with SIGKILL, by the
PID the launcher recorded in ``tasks.json``. The launcher restarts each from its last checkpoint
with its default fault tolerance (only ``--max-restarts`` is raised: a soak kills the same task
many times, more often than a real fault would).

It prints and writes ``soak.json``: faults injected and survived (restarts the launcher
logged), updates and steps lost (as the launcher measured them), both runs' wall time and final
test accuracy, and the ratio of the wall times (the time the faults cost).

    python benchmarks/soak.py [--minutes 8] [--scheme sync] [--workers 2] [--seed 1]
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
from typing import Any

import psutil

DIGITS_TRAIN = 1437  # images in the demo's training split


def demo(scheme: str, workers: int, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "distsgd", "demo", "--scheme", scheme, "--workers", str(workers),
        "--quiet", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def calibrate(scheme: str, workers: int, run_dir: Path) -> float:
    """Samples per second of the demo on this machine (one short undisturbed run)."""
    cmd = demo(scheme, workers, run_dir, "--epochs", "6")
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    samples = [r for r in records(run_dir) if "samples" in r]
    span = max(r["time"] for r in samples) - min(r["time"] for r in samples)
    last = {r["task"]: r["samples"] for r in samples}
    return sum(last.values()) / max(span, 1e-3)


def run(cmd: list[str], run_dir: Path, rng: random.Random | None) -> dict[str, Any]:
    """One run; with ``rng``, SIGKILL a random task of it every 20-40 s. Its wall time and
    what the launcher logged."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.out", "w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        injected: list[dict[str, Any]] = []
        try:
            next_kill = time.monotonic() + (rng.uniform(20, 40) if rng else float("inf"))
            while launcher.poll() is None:
                time.sleep(0.5)
                if rng is None or time.monotonic() < next_kill:
                    continue
                next_kill = time.monotonic() + rng.uniform(20, 40)
                try:
                    pids = json.loads((run_dir / "tasks.json").read_text())
                except (FileNotFoundError, ValueError):
                    continue
                name = rng.choice(sorted(pids))
                # Only a live child of our launcher: a recorded PID may have been reused.
                ours = {p.pid for p in psutil.Process(launcher.pid).children()}
                if pids[name] not in ours:
                    continue
                try:
                    os.kill(pids[name], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                injected.append({"task": name, "at": round(time.monotonic() - started, 1)})
                print(f"[soak] {injected[-1]['at']:7.1f}s  SIGKILL {name}", flush=True)
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
                launcher.wait(timeout=60)
    seconds = time.monotonic() - started
    faults = [r for r in records(run_dir) if r.get("event") == "fault"]
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return {
        "seconds": round(seconds, 1),
        "exit_code": launcher.returncode,
        "final_accuracy": result.get("test_accuracy"),
        "faults_injected": len(injected),
        "faults_survived": sum(1 for r in faults if r.get("action", "").startswith("restart")),
        "updates_lost": sum(r.get("lost_updates", 0) for r in faults),
        "steps_lost": sum(r.get("lost_steps", 0) for r in faults),
        "injected": injected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=8.0, help="undisturbed length")
    parser.add_argument("--scheme", default="sync")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=Path("distsgd-runs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rate = calibrate(args.scheme, args.workers, args.out / "calibration")
    epochs = max(1, round(rate * args.minutes * 60 / DIGITS_TRAIN))
    print(f"calibrated {rate:.0f} samples/s: {epochs} epochs for {args.minutes} min", flush=True)
    flags = ["--epochs", str(epochs), "--max-restarts", "1000"]
    calm = run(demo(args.scheme, args.workers, args.out / "calm", *flags), args.out / "calm", None)
    print(f"undisturbed: {calm['seconds']} s, accuracy {calm['final_accuracy']}", flush=True)
    hit_dir = args.out / "faults"
    hit = run(demo(args.scheme, args.workers, hit_dir, *flags), hit_dir, random.Random(args.seed))
    report = {
        "scheme": args.scheme,
        "workers": args.workers,
        "epochs": epochs,
        "undisturbed": calm,
        "with_faults": hit,
        "time_ratio": round(hit["seconds"] / max(calm["seconds"], 1e-3), 3),
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    brief = {k: v for k, v in hit.items() if k != "injected"}
    print(json.dumps({**report, "undisturbed": calm | {"injected": []}, "with_faults": brief}))
    ok = (
        hit["exit_code"] == 0
        and hit["faults_survived"] >= hit["faults_injected"]
        and report["time_ratio"] <= 1.25
    )
    print(f"soak {'passed' if ok else 'FAILED'}: time ratio {report['time_ratio']}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
