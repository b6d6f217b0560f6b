"""What a write-ahead log's replica on another host costs (not part of CI), side by side with
the log alone (``--wal local``), A B A B:

* ``pushes``: the server alone, in process: ``Shard.push`` of each model's payload under the
  Hogwild rule, its log in a local folder, with and without a replica (a ``distsgd server
  --job replica`` process on loopback: one host); pushes per second and their ratio.
* ``runs``: whole runs on 3 emulated hosts (root), each server's replica on the next host:
  ``distsgd demo --scheme hogwild`` (the digits CNN, 0.16 MB a push) and the benchmark suite's
  MLP (``benchmarks/mlp_script.py``, 2.7 MB a push), 4 workers and 2 servers, ``--link``
  (default 1gbit), ``--wal on`` against ``--wal local``; samples per second of all workers.

Prints a table and writes ``--out`` (default ``benchmarks/results/replica_cost.json``, which
git ignores)::

    python benchmarks/replica_cost.py [--rounds 2] [--link 1gbit] [--skip-runs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workload  # noqa: E402
from wal_cost import _shard, models, push, runs  # noqa: E402

from distsgd.ps import wal  # noqa: E402
from distsgd.ps.replica import ReplicaLink  # noqa: E402
from distsgd.transport.security import SECRET_ENV, new_secret  # noqa: E402


def _replica(folder: Path, secret: str) -> tuple[subprocess.Popen[bytes], str]:
    """A replica process on loopback, and its address once it listens."""
    address_file = folder.parent / f"{folder.name}.address"
    address_file.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "distsgd", "server", "--job", "replica", "--task", "0",
        "--run-id", "bench", "--address", "127.0.0.1:0", "--address-file", str(address_file),
        "--wal-dir", str(folder),
    ]  # fmt: skip
    env = {**os.environ, SECRET_ENV: secret}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the replica did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, address_file.read_text().strip()


def _rate(values: dict[str, np.ndarray], grads: dict[str, np.ndarray], folder: Path) -> float:
    """Pushes per second in the log's steady state (both log files written once)."""
    shard = _shard(values)
    log = wal.begin(folder, shard)
    while log.generation < wal.SLOTS:
        push(shard, grads)
    count = max(50, int(200e6 / sum(v.nbytes for v in values.values())))
    started = time.perf_counter()
    for _ in range(count):
        push(shard, grads)
    rate = count / (time.perf_counter() - started)
    log.close()
    return rate


def pushes(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    secret = new_secret()
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in models().items():
            rng = np.random.default_rng(0)
            grads = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in values.items()}
            rates: dict[str, list[float]] = {"replica": [], "local": []}
            for round_ in range(2 * args.rounds):
                for flag in ("replica", "local"):
                    folder = Path(tmp) / f"{name}-{round_}-{flag}"
                    proc = None
                    if flag == "replica":
                        proc, address = _replica(Path(tmp) / f"r-{round_}", secret)
                        link = ReplicaLink(address, run_id="bench", shard=0, secret=secret)
                        wal.replicate(folder, link)
                    try:
                        rates[flag].append(_rate(values, grads, folder))
                    finally:
                        wal.replicate(folder, None)
                        if proc is not None:
                            proc.terminate()
                            proc.wait(10)
                        shutil.rmtree(folder, ignore_errors=True)
                        shutil.rmtree(Path(tmp) / f"r-{round_}", ignore_errors=True)
            on, off = statistics.median(rates["replica"]), statistics.median(rates["local"])
            report[name] = {
                "replica": [round(r, 1) for r in rates["replica"]],
                "local": [round(r, 1) for r in rates["local"]],
                "ratio": round(on / off, 4),
                "microseconds_per_push_added": round(1e6 / on - 1e6 / off, 1),
            }
            print(f"pushes {name:12s} {report[name]}", flush=True)
    return report


def run_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    hosts = ["--workers", "4", "--ps", "2", "--hosts", "3", "--link", args.link]
    demo = ["demo", "--scheme", "hogwild", "--epochs", str(args.epochs), *hosts]
    mlp = [
        "run", "--scheme", "hogwild", *hosts, "--steps", str(args.steps),
        "--batch-size", str(workload.BATCH_SIZE), "--lr", str(workload.LR), "--threads", "1",
        str(HERE / "mlp_script.py"),
    ]  # fmt: skip
    return {"demo CNN (0.16 MB)": demo, "MLP (2.7 MB)": mlp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10, help="the demo's epochs")
    parser.add_argument("--steps", type=int, default=300, help="the MLP run's steps per worker")
    parser.add_argument("--link", default="1gbit", help="each emulated host's link")
    parser.add_argument("--skip-runs", action="store_true", help="in-process figures only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "replica_cost.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"link": args.link, "pushes": pushes(args)}
    if not args.skip_runs:
        report["runs"] = runs(args, run_commands(args), flags=("on", "local"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in report.get("runs", {}).items():
        on, off = statistics.median(row["on"]), statistics.median(row["local"])
        print(f"run    {name:20s} replica {on:8.0f}  local {off:8.0f} samples/s  {row['ratio']}")
    for name, row in report["pushes"].items():
        print(f"server {name:20s} {row}")


if __name__ == "__main__":
    main()
