"""What the parameter servers' write-ahead log costs (not part of CI): throughput and recovery.

Three measurements, each side by side with the log off:

* ``runs``: whole runs, in turn A B A B (the machine's speed drifts, neighbours stay fair):
  ``distsgd demo --scheme hogwild`` (the digits CNN, 0.16 MB a push) and the benchmark suite's
  MLP (``benchmarks/mlp_script.py``, 2.7 MB a push), each with ``--wal on`` and ``--wal off``.
  Throughput: samples per second of all workers from the first to the last metrics line
  (start-up excluded), and the chief's training time (``result.json``'s ``seconds``); the
  report gives the medians and their ratios.
* ``pushes``: the server alone, in process: ``Shard.push`` of each model's payload under the
  Hogwild rule, with and without a log (A B A B), the log in its steady state (both log files
  written once, a new generation with its snapshot whenever one is due); pushes per second and
  their ratio. This is the log's whole cost per push; in a run it hides partly behind the
  network and the workers' compute, which is what ``runs`` shows.
* ``recovery``: a folder whose log is as long as it gets before a new generation starts
  (:func:`distsgd.ps.wal.compact_bound`), rebuilt by :func:`distsgd.ps.wal.recover`: seconds.

Prints a table and writes ``--out`` (default ``benchmarks/results/wal_cost.json``, which git
ignores)::

    python benchmarks/wal_cost.py [--rounds 2] [--epochs 10] [--steps 300] [--skip-runs]
"""

from __future__ import annotations

import argparse
import json
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

from distsgd.ps import wal  # noqa: E402
from distsgd.ps.rules import PushMeta  # noqa: E402
from distsgd.ps.shard import Shard  # noqa: E402
from distsgd.schemes import make_server_rule  # noqa: E402

OPTIONS = {"lr": 0.01, "momentum": 0.0}


def samples_per_second(run_dir: Path) -> float:
    """All workers' samples per second from the first to the last metrics line."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in records if "samples" in r and r["task"].startswith("worker")]
    span = max(r["time"] for r in samples) - min(r["time"] for r in samples)
    last: dict[str, int] = {}
    for r in samples:
        last[r["task"]] = r["samples"]
    return sum(last.values()) / max(span, 1e-3)


def run_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    demo = ["demo", "--scheme", "hogwild", "--epochs", str(args.epochs)]
    mlp = [
        "run", "--scheme", "hogwild", "--workers", "2", "--ps", "1", "--steps", str(args.steps),
        "--batch-size", str(workload.BATCH_SIZE), "--lr", str(workload.LR), "--threads", "1",
        str(HERE / "mlp_script.py"),
    ]  # fmt: skip
    return {"demo CNN (0.16 MB)": demo, "MLP (2.7 MB)": mlp}


def runs(
    args: argparse.Namespace,
    commands: dict[str, list[str]] | None = None,
    flags: tuple[str, str] = ("on", "off"),
) -> dict[str, Any]:
    """Whole runs of each command, ``--wal`` each of ``flags`` in turn, ``args.rounds`` times;
    per command each flag's rates and the ratio of the first flag's median to the second's."""
    a, b = flags
    rates: dict[str, dict[str, list[float]]] = {}
    seconds: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for case, (name, command) in enumerate((commands or run_commands(args)).items()):
                for flag in flags:
                    run_dir = Path(tmp) / f"{case}-{round_}-{flag}"
                    cmd = [
                        sys.executable, "-m", "distsgd", *command[:1], "--wal", flag,
                        "--checkpoint-every", "0", "--quiet", "--run-dir", str(run_dir),
                        *command[1:],
                    ]  # fmt: skip
                    started = time.monotonic()
                    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
                    rate = samples_per_second(run_dir)
                    trained = json.loads((run_dir / "result.json").read_text())["seconds"]
                    shutil.rmtree(run_dir)  # its log's dirty pages do not weigh on the next run
                    rates.setdefault(name, {a: [], b: []})[flag].append(rate)
                    seconds.setdefault(name, {a: [], b: []})[flag].append(trained)
                    print(
                        f"round {round_ + 1} {name:20s} wal {flag:3s} {rate:8.0f} samples/s, "
                        f"chief trained {trained:.1f} s, run {time.monotonic() - started:.0f} s",
                        flush=True,
                    )
    return {
        name: {
            a: [round(r, 1) for r in r_[a]],
            b: [round(r, 1) for r in r_[b]],
            "ratio": round(statistics.median(r_[a]) / statistics.median(r_[b]), 4),
            f"seconds_{a}": [round(t, 2) for t in seconds[name][a]],
            f"seconds_{b}": [round(t, 2) for t in seconds[name][b]],
            "seconds_ratio": round(
                statistics.median(seconds[name][a]) / statistics.median(seconds[name][b]), 4
            ),
        }
        for name, r_ in rates.items()
    }


def _shard(values: dict[str, np.ndarray]) -> Shard:
    return Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps(OPTIONS),
        num_workers=2,
        values=values,
        rule=make_server_rule("hogwild", OPTIONS, 2),
    )


def models() -> dict[str, dict[str, np.ndarray]]:
    from distsgd.demo.digits import DigitsCNN

    cnn = {k: v.detach().numpy().copy() for k, v in DigitsCNN().state_dict().items()}
    cnn = {k: v for k, v in cnn.items() if v.dtype == np.float32}
    mlp = {
        k: v.detach().numpy().copy()
        for k, v in workload.build_model(workload.HIDDEN).named_parameters()
    }
    return {"demo CNN": cnn, "MLP 2.7 MB": mlp}


def push(shard: Shard, grads: dict[str, np.ndarray]) -> None:
    """One push, and the new generation the server's ticker would start when it is due."""
    shard.push(grads, PushMeta(worker=0, incarnation=1, base_version=shard.version))
    if shard.wal is not None:
        shard.wal.maybe_compact(shard)


def pushes(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in models().items():
            nbytes = sum(v.nbytes for v in values.values())
            rng = np.random.default_rng(0)
            grads = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in values.items()}
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for round_ in range(2 * args.rounds):
                for flag in ("on", "off"):
                    shard = _shard(values)
                    if flag == "on":  # steady state: both log files written once already
                        log = wal.WriteAheadLog.start(Path(tmp) / f"{name}-{round_}", shard)
                        while log.generation < wal.SLOTS:
                            push(shard, grads)
                    count = max(50, int(200e6 / nbytes))
                    started = time.perf_counter()
                    for _ in range(count):
                        push(shard, grads)
                    rates[flag].append(count / (time.perf_counter() - started))
                    if shard.wal is not None:
                        shard.wal.close()
                        for path in shard.wal.folder.iterdir():
                            path.unlink()
            on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
            report[name] = {
                "bytes": nbytes,
                "pushes_per_second_on": round(on, 1),
                "pushes_per_second_off": round(off, 1),
                "ratio": round(on / off, 4),
                "microseconds_per_push_added": round(1e6 / on - 1e6 / off, 1),
            }
            print(f"pushes {name:12s} {report[name]}", flush=True)
    return report


def recovery() -> dict[str, Any]:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in models().items():
            nbytes = sum(v.nbytes for v in values.values())
            folder = Path(tmp) / name
            shard = _shard(values)
            log = wal.WriteAheadLog.start(folder, shard)
            grads = {k: np.full_like(v, 1e-3) for k, v in values.items()}
            while log.size + nbytes < log.bound:
                shard.push(grads, PushMeta(worker=0, incarnation=1, base_version=shard.version))
            log.close()
            started = time.perf_counter()
            recovered = wal.recover(folder, make_server_rule)
            seconds = time.perf_counter() - started
            assert recovered is not None and recovered.shard.version == shard.version
            report[name] = {
                "records": recovered.records,
                "log_bytes": log.size,
                "seconds": round(seconds, 3),
            }
            print(f"recovery {name:12s} {report[name]}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10, help="the demo's epochs")
    parser.add_argument("--steps", type=int, default=300, help="the MLP run's steps per worker")
    parser.add_argument("--skip-runs", action="store_true", help="in-process figures only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "wal_cost.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"pushes": pushes(args), "recovery": recovery()}
    if not args.skip_runs:
        report["runs"] = runs(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in report.get("runs", {}).items():
        on, off = statistics.median(row["on"]), statistics.median(row["off"])
        print(
            f"run    {name:20s} on {on:8.0f}  off {off:8.0f} samples/s  ratio {row['ratio']}; "
            f"chief's training time on/off {row['seconds_ratio']}"
        )
    for name, row in report["pushes"].items():
        print(
            f"server {name:20s} on {row['pushes_per_second_on']:8.0f}  "
            f"off {row['pushes_per_second_off']:8.0f} pushes/s  ratio {row['ratio']}"
        )
    for name, row in report["recovery"].items():
        print(
            f"recover {name:19s} {row['records']} records, {row['log_bytes'] / 1e6:.0f} MB: "
            f"{row['seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
