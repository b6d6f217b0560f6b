"""What the default checkpoints cost in training throughput (not part of CI).

Runs the demo with checkpoints off (``--checkpoint-every 0``), at the default cadence (no flag)
and every 5 seconds, in turn (A B C A B C ...: the machine's speed drifts, neighbours stay
fair), and reports two figures for each: training throughput (samples per second of all
workers from the first to the last metrics line, start-up excluded) relative to checkpoints
off, which is as noisy as the machine; and the share of each worker's training time spent in
checkpoints, which each worker measures itself (``checkpoint_seconds`` of its
``finished_steps`` event; the largest share over the workers, as a synchronous step waits for
the slowest). Prints a table and writes ``--out`` (default
``benchmarks/results/checkpoint_cost.json``, which git ignores).

    python benchmarks/checkpoint_cost.py [--epochs 90] [--rounds 3] [--scheme sync]

``--model gpt`` measures the GPT-2-style LM of benchmarks/gpt_script.py instead (``--size
gpt2-76m``, 313 MB, or ``--megabytes 3``) on the issue's clusters (``--scheme hogwild``: 2
workers, 2 servers; ``asyncdiloco``: 2 workers, 1 server; benchmarks/memory.py), for
``--steps`` steps, at the default cadence only (``--variants`` to choose), and also reports the
run folder's peak size (polled every 0.2 s, hard links counted once) against one complete
checkpoint's bytes (the largest manifest's worker states and shards):

    python benchmarks/checkpoint_cost.py --model gpt --size gpt2-76m --scheme hogwild \
        --steps 40 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from memory import SCHEMES, SCRIPT

from distsgd.control.checkpoint.store import MANIFEST, checkpoint_bytes

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


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``, each inode once (a checkpoint links the
    workers' state files in)."""
    seen: dict[tuple[int, int], int] = {}
    for parent, _, names in os.walk(folder):  # a folder removed meanwhile is skipped
        for name in names:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:  # renamed or pruned meanwhile
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def run_watched(cmd: list[str], run_dir: Path) -> dict[str, int]:
    """Run ``cmd``; the peak bytes of ``run_dir`` and of its checkpoints/ while it ran."""
    peaks = {"run_folder": 0, "checkpoints": 0}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.2):
            if run_dir.exists():
                peaks["run_folder"] = max(peaks["run_folder"], folder_bytes(run_dir))
                ckpts = run_dir / "checkpoints"
                peaks["checkpoints"] = max(peaks["checkpoints"], folder_bytes(ckpts))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, err = proc.communicate(timeout=3600)
    done.set()
    watcher.join()
    if proc.returncode != 0 and not diverged(run_dir):
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return peaks


def diverged(run_dir: Path) -> bool:
    """Whether the run did all its steps and failed only its loss check (random bytes at a
    scheme's default rates: what the checkpoints cost is measured all the same)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line).get("event") for line in lines]
    return "diverged" in events and "finished_steps" in events


def one_checkpoint(run_dir: Path) -> int:
    """The bytes of the largest complete checkpoint left in the run folder."""
    folders = (run_dir / "checkpoints").glob("ckpt-*")
    return max((checkpoint_bytes(f) for f in folders if (f / MANIFEST).exists()), default=0)


def command(args: argparse.Namespace, run_dir: Path, flags: list[str]) -> list[str]:
    if args.model == "demo":
        return [
            sys.executable, "-m", "distsgd", "demo", "--scheme", args.scheme,
            "--workers", str(args.workers), "--epochs", str(args.epochs), "--quiet",
            "--run-dir", str(run_dir), *flags,
        ]  # fmt: skip
    shape = ["--size", args.size] if args.size else ["--megabytes", str(args.megabytes)]
    return [
        sys.executable, "-m", "distsgd", "run", *SCHEMES[args.scheme], "--quiet",
        "--run-dir", str(run_dir), *flags, str(SCRIPT), *shape, "--steps", str(args.steps),
        "--batch", str(args.batch),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("demo", "gpt"), default="demo")
    parser.add_argument("--epochs", type=int, default=90, help="(demo)")
    parser.add_argument("--size", default="", help="(gpt) a named shape: gpt2-76m")
    parser.add_argument("--megabytes", type=float, default=3.0, help="(gpt) without --size")
    parser.add_argument("--steps", type=int, default=40, help="(gpt)")
    parser.add_argument("--batch", type=int, default=1, help="(gpt) sequences per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scheme", default="")
    parser.add_argument("--workers", type=int, default=2, help="(demo)")
    parser.add_argument("--variants", default="", help=f"comma-separated of {list(VARIANTS)}")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "checkpoint_cost.json",
    )
    args = parser.parse_args()
    args.scheme = args.scheme or ("sync" if args.model == "demo" else "hogwild")
    if args.model == "gpt" and args.scheme not in SCHEMES:
        parser.error(f"--model gpt runs the clusters of {list(SCHEMES)}, not {args.scheme!r}")
    chosen = args.variants.split(",") if args.variants else ["default"]
    if args.model == "demo" and not args.variants:
        chosen = list(VARIANTS)
    variants = {name: VARIANTS[name] for name in chosen}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    counts: dict[str, list[int]] = {name: [] for name in variants}
    shares: dict[str, list[float]] = {name: [] for name in variants}
    sizes: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="distsgd-ckpt-") as tmp:
        for round_ in range(args.rounds):
            for name, flags in variants.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '')}-{round_}"
                started = time.monotonic()
                peaks = run_watched(command(args, run_dir, flags), run_dir)
                rate, done, share = measure(run_dir)
                one = one_checkpoint(run_dir)
                sizes[name].append(
                    {
                        "one_checkpoint": one,
                        **{f"peak_{k}": v for k, v in peaks.items()},
                        **{f"{k}_over_one": round(v / max(one, 1), 2) for k, v in peaks.items()},
                    }
                )
                rates[name].append(rate)
                counts[name].append(done)
                shares[name].append(share)
                print(
                    f"round {round_ + 1} {name:9s} {rate:8.1f} samples/s, {done} checkpoints, "
                    f"{100 * share:.2f}% of training time in them, "
                    f"{time.monotonic() - started:.0f} s; one checkpoint {one / 1e6:.0f} MB, "
                    f"run folder peak {peaks['run_folder'] / 1e6:.0f} MB "
                    f"({peaks['run_folder'] / max(one, 1):.2f}x), checkpoints/ peak "
                    f"{peaks['checkpoints'] / 1e6:.0f} MB",
                    flush=True,
                )
    base = statistics.median(rates["off"]) if "off" in rates else None
    report = {
        name: {
            "samples_per_second": round(statistics.median(r), 1),
            "relative_to_off": None if base is None else round(statistics.median(r) / base, 4),
            "checkpoints": counts[name],
            "share_of_training_time": round(statistics.median(shares[name]), 5),
            "folder": sizes[name],
        }
        for name, r in rates.items()
    }
    summary = {"command": sys.argv, "scheme": args.scheme, **report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'variant':10s} {'samples/s':>10s} {'vs off':>8s} {'time in ckpt':>13s}  checkpoints")
    for name, row in report.items():
        off = row["relative_to_off"]
        print(
            f"{name:10s} {row['samples_per_second']:10.1f} {off or float('nan'):8.4f} "
            f"{100 * row['share_of_training_time']:12.2f}%  {row['checkpoints']}"
        )


if __name__ == "__main__":
    main()
