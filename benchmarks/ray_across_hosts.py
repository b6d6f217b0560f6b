"""``distsgd run --ray`` across nodes (root; not part of CI, several minutes): a Ray cluster of
one node per emulated host (``ray_hosts.py``: 3 hosts, 1 Gbit/s links, the head on host0), each
host with a private disk at the path of the run folders (what a task writes there only its own
host sees), and the launcher as the Ray driver on host0: the run folder it assembles is on
host0's disk.

* ``schemes``: the demo under hogwild and sync (4 workers, 2 servers), allreduce and diloco
  (4 workers); each must exit 0 at 0.95 or more, with its two servers on different nodes (their
  bound addresses in ``cluster.json``).
* ``throughput``: the Hogwild demo on Ray against the same run with the local launcher on the
  same emulated hosts and links (``--hosts 3 --link 1gbit``), A B A B (``--rounds``); all
  workers' samples per second and the ratio of the medians (Ray over local).
* ``--lose-node``: instead, the Hogwild demo on Ray loses the node of a server that is not the
  head's once a worker passed step 40: every process in that host is SIGKILLed (its Ray node,
  its tasks) and what its tasks kept on its disk is removed (the server's log, the replica it
  held). The run must finish at 0.95 or more with the server's fault record showing 0 updates
  lost (it comes back on another node from its log's replica).
* ``--kill-driver``: instead, the launcher (the Ray driver) of the Hogwild demo is SIGKILLed
  once a worker passed step 40: within 30 s no task of the run and no actor of it may be left
  on any node (Ray ends a dead driver's actors; each task's lifeline is its actor).

Prints each run and writes ``--out`` (default ``benchmarks/results/ray_across_hosts.json``,
which git ignores)::

    python benchmarks/ray_across_hosts.py [--rounds 2] [--link 1gbit] [--epochs 30]
    python benchmarks/ray_across_hosts.py --lose-node [--scheme sync]
    python benchmarks/ray_across_hosts.py --kill-driver
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ray_hosts import RayHosts, ray_on_hosts  # noqa: E402
from wal_cost import samples_per_second  # noqa: E402

DISTSGD = [sys.executable, "-m", "distsgd"]
SCHEMES = {"hogwild": 2, "sync": 2, "allreduce": 0, "diloco": 0}
"""The schemes run across nodes and their servers (4 workers each)."""


def _demo(scheme: str, run_dir: Path, epochs: int, where: list[str]) -> list[str]:
    return [
        *DISTSGD, "demo", *where, "--scheme", scheme, "--workers", "4",
        "--ps", str(SCHEMES[scheme]), "--epochs", str(epochs), "--quiet",
        "--checkpoint-every", "0", "--run-dir", str(run_dir),
    ]  # fmt: skip


def _outcome(done: subprocess.CompletedProcess[str], run_dir: Path, started: float) -> dict:
    lines = done.stdout.strip().splitlines()
    accuracy = float(lines[-1].split(":")[1]) if lines and "accuracy" in lines[-1] else None
    found = run_dir / "cluster.json"
    cluster = json.loads(found.read_text()) if found.exists() else {}
    servers = [a.rsplit(":", 1)[0] for a in cluster.get("ps", [])]
    ok = done.returncode == 0 and accuracy is not None
    return {
        "exit": done.returncode,
        "accuracy": accuracy,
        "samples_per_s": round(samples_per_second(run_dir), 1) if ok else None,
        "servers_on": servers,
        "seconds": round(time.monotonic() - started, 1),
        "error": None if ok else (done.stderr or done.stdout).strip().splitlines()[-3:],
    }


def on_ray(cluster: RayHosts, scheme: str, run_dir: Path, epochs: int) -> dict:
    """The demo with the launcher as the driver on host0."""
    started = time.monotonic()
    argv = _demo(scheme, run_dir, epochs, [f"--ray={cluster.address}"])
    done = cluster.run("host0", argv, timeout=1200)
    return _outcome(done, cluster.seen(run_dir), started)


def on_hosts(scheme: str, run_dir: Path, epochs: int, link: str) -> dict:
    """The same demo with the local launcher on 3 emulated hosts and the same links."""
    started = time.monotonic()
    argv = _demo(scheme, run_dir, epochs, ["--hosts", "3", "--link", link])
    for _ in range(30):  # the Ray cluster's emulated hosts may still be going down
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
        if "emulated hosts' network is in use" not in done.stderr:
            break
        time.sleep(2)
    return _outcome(done, run_dir, started)


def _worker_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if str(record.get("task", "")).startswith("worker") and "loss" in record:
                steps.append(int(record.get("step", 0)))
    return max(steps)


def _lose_host(cluster: RayHosts, host: str, run_dir: Path) -> dict[str, Any]:
    """SIGKILL every process in ``host``'s network namespace but its keeper; remove what the
    tasks there kept on their disk: all of its private disk where the hosts have them, else
    their server's log and the replicas they held (their reported addresses in ``run_dir``)."""
    record = json.loads((cluster.hosts_dir / "hosts.json").read_text())
    keeper = next(h["keeper"] for h in record["hosts"] if h["name"] == host)
    inode = os.stat(f"/proc/{keeper}/ns/net").st_ino
    killed = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if proc.pid != keeper and os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode:
                proc.kill()
                killed.append(proc.pid)
    address = cluster.hosts[host]
    shutil.rmtree(cluster.temp_dirs[host], ignore_errors=True)
    lost = {"host": host, "address": address, "killed": len(killed)}
    if cluster.disks is not None:
        disk = cluster.disk_of(host)
        lost["wiped"] = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file())
        for entry in list(disk.iterdir()):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        return lost
    wiped = []
    for reported in run_dir.glob("*.address"):
        if reported.read_text().strip().rpartition(":")[0] == address:
            wiped.append(reported.stem)
            shutil.rmtree(run_dir / "wal" / reported.stem, ignore_errors=True)
    lost["wiped"] = sorted(wiped)
    return lost


def _driver_until(
    cluster: RayHosts, run_dir: Path, epochs: int, at_step: int, scheme: str = "hogwild"
) -> subprocess.Popen[str]:
    """The demo on Ray, its driver on host0, returned once a worker passed ``at_step``
    (SystemExit after 300 s)."""
    argv = _demo(scheme, run_dir, epochs, [f"--ray={cluster.address}"])
    driver = subprocess.Popen(
        cluster.exec_argv("host0", argv),
        env=cluster.driver_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while _worker_step(cluster.seen(run_dir)) < at_step and driver.poll() is None:
        if time.monotonic() > deadline:
            driver.kill()
            raise SystemExit(f"no worker reached step {at_step} in 300 s")
        time.sleep(0.1)
    return driver


def lose_node(
    cluster: RayHosts, run_dir: Path, epochs: int, at_step: int = 40, scheme: str = "hogwild"
) -> dict:
    """The demo on Ray, the node of a server other than the head's lost mid-run."""
    driver = _driver_until(cluster, run_dir, epochs, at_step, scheme)
    files = cluster.seen(run_dir)
    servers = json.loads((files / "cluster.json").read_text())["ps"]
    head = cluster.hosts["host0"]
    victim = next(a.rpartition(":")[0] for a in servers if not a.startswith(head + ":"))
    host = next(name for name, address in cluster.hosts.items() if address == victim)
    step = _worker_step(files)
    lost = _lose_host(cluster, host, files)
    lost["at_step"] = step
    out, err = driver.communicate(timeout=1200)
    records = [json.loads(line) for line in (files / "metrics.jsonl").read_text().splitlines()]
    faults = [r for r in records if r.get("event") in ("fault", "ps_moved", "replica_restart")]
    lines = out.strip().splitlines()
    return {
        "exit": driver.returncode,
        "accuracy": float(lines[-1].split(":")[1]) if lines and "accuracy" in lines[-1] else None,
        "lost": lost,
        "servers": [r for r in faults if str(r.get("target", "")).startswith("ps")],
        "events": [{k: r.get(k) for k in ("event", "target", "action")} for r in faults],
        "error": None if driver.returncode == 0 else err.strip().splitlines()[-3:],
    }


def _left_of(run_dir: Path) -> list[str]:
    """The run's tasks (their titles name the run folder) and task actors still alive."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.info["cmdline"] or [])
            ours = cmdline.startswith("distsgd ") and cmdline.endswith(f" {run_dir.name}")
            if ours or cmdline.startswith("ray::TaskRunner"):
                left.append(f"{proc.pid} {cmdline[:80]}")
    return left


def kill_driver(cluster: RayHosts, run_dir: Path, epochs: int, at_step: int = 40) -> dict:
    """The Hogwild demo on Ray, its driver SIGKILLed mid-run: what is left, over time."""
    driver = _driver_until(cluster, run_dir, epochs, at_step)
    before = _left_of(run_dir)
    driver.kill()  # hosts exec execs nsenter, which execs the launcher: one PID
    driver.communicate()
    killed = time.monotonic()
    left = _left_of(run_dir)
    while left and time.monotonic() - killed < 30:
        time.sleep(0.5)
        left = _left_of(run_dir)
    return {
        "at_step": _worker_step(cluster.seen(run_dir)),
        "running_before": len(before),
        "left": left,
        "seconds_to_none": None if left else round(time.monotonic() - killed, 1),
    }


def _show(label: str, row: dict) -> None:
    print(
        f"{label:28s} exit {row['exit']} accuracy {row['accuracy']} "
        f"{row['samples_per_s']} samples/s servers on {row['servers_on']} "
        f"({row['seconds']} s){' ' + str(row['error']) if row['error'] else ''}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--cpus", type=int, default=3, help="Ray CPUs per node")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ray_across_hosts.json")
    parser.add_argument("--lose-node", action="store_true", help="only the lost-node case")
    parser.add_argument("--kill-driver", action="store_true", help="only the killed driver")
    parser.add_argument("--scheme", default="hogwild", help="--lose-node's scheme (ps ones)")
    args = parser.parse_args()
    if args.lose_node or args.kill_driver:
        case, name = (lose_node, "lose_node") if args.lose_node else (kill_driver, "kill_driver")
        if args.lose_node:
            case, name = partial(lose_node, scheme=args.scheme), f"lose_node_{args.scheme}"
        tmp = Path(tempfile.mkdtemp(prefix="ray-case-"))
        try:
            at = tmp / "at"  # each host's private disk
            with ray_on_hosts(3, link=args.link, work=tmp / "c", cpus=args.cpus, disks=at) as c:
                row = case(c, at / "run", args.epochs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(row, indent=2))
        out = args.out.with_name(f"ray_{name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(row, indent=2) + "\n")
        return
    report: dict[str, Any] = {"schemes": {}, "throughput": {"ray": [], "local": []}}
    with tempfile.TemporaryDirectory(prefix="ray-across-") as folder:
        work = Path(folder)
        for round_ in range(args.rounds):
            at = work / f"at{round_}"  # each host's private disk
            with ray_on_hosts(
                3, link=args.link, work=work / f"cluster{round_}", cpus=args.cpus, disks=at
            ) as c:
                for scheme in SCHEMES if round_ == 0 else ("hogwild",):
                    row = on_ray(c, scheme, at / f"ray-{scheme}-{round_}", args.epochs)
                    _show(f"round {round_ + 1} ray {scheme}", row)
                    if round_ == 0:
                        report["schemes"][scheme] = row
                    if scheme == "hogwild":
                        report["throughput"]["ray"].append(row)
            row = on_hosts("hogwild", work / f"local-{round_}", args.epochs, args.link)
            _show(f"round {round_ + 1} local hogwild", row)
            report["throughput"]["local"].append(row)
    rates = {k: [r["samples_per_s"] or 0.0 for r in v] for k, v in report["throughput"].items()}
    report["throughput"]["ratio"] = round(
        statistics.median(rates["ray"]) / max(statistics.median(rates["local"]), 1e-9), 4
    )
    print(f"hogwild samples/s: ray {rates['ray']} local {rates['local']} "
          f"ratio {report['throughput']['ratio']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
