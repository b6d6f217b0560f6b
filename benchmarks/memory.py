"""Peak memory of every process of a run against the model's size (not part of CI).

For each model size (a GPT-2-style LM of that many float32 megabytes, benchmarks/gpt_script.py)
it runs the script alone (one process: what the user's script needs by itself), then under
each scheme asked for, and reads each process's peak resident set (``VmHWM`` in
/proc/PID/status, polled every 0.1 s while the run lasts: the kernel's own high-water mark, so
no peak between two polls is missed). Each server's peak is set against its shard's bytes (its
``registered`` line in psN.log); each worker's against the script alone, in units of the
model's bytes. Prints a Markdown table and writes memory.json.

    python benchmarks/memory.py --sizes 3,30,300 --schemes hogwild,asyncdiloco
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "gpt_script.py"
MB = 1e6
SCHEMES = {
    "hogwild": ["--scheme", "hogwild", "--workers", "2", "--ps", "2"],
    "asyncdiloco": ["--scheme", "asyncdiloco", "--workers", "2", "--ps", "1", "--inner-steps", "2"],
}
"""The issue's clusters: Hogwild on 2 workers and 2 servers, AsyncDiLoCo on 2 and 1."""


def peak_kb(pid: int) -> int | None:
    """The process's peak resident set so far (kB), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else None


def alone(megabytes: float, steps: int, runs: Path) -> float:
    """Peak RSS (MB) of the script run alone, from its rusage."""
    env = {**os.environ, "DISTSGD_RUNS": str(runs)}
    cmd = [sys.executable, str(SCRIPT), "--megabytes", str(megabytes), "--steps", str(steps)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the script alone failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss * 1024 / MB


def watched(cmd: list[str], run_dir: Path) -> dict[str, float]:
    """Run ``cmd`` (a distsgd run writing ``run_dir``); each task's peak RSS (MB) by name."""
    peaks: dict[str, int] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None:
        tasks: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):  # not written yet, or half written
            tasks = json.loads((run_dir / "tasks.json").read_text())
        for name, pid in {**tasks, "launcher": proc.pid}.items():
            kb = peak_kb(pid)
            if kb is not None:
                peaks[name] = max(peaks.get(name, 0), kb)
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return {name: kb * 1024 / MB for name, kb in sorted(peaks.items())}


def shard_bytes(run_dir: Path) -> dict[str, int]:
    """Each server's shard, from its log's ``registered`` line."""
    out = {}
    for log in sorted((run_dir / "logs").glob("ps*.log")):
        found = re.search(r"registered: .*?, (\d+) bytes", log.read_text())
        if found:
            out[log.stem] = int(found.group(1))
    return out


def measure(size: float, scheme: str, steps: int, tmp: Path) -> dict[str, Any]:
    from distsgd.demo.gpt import config_for_megabytes

    model = config_for_megabytes(size).parameters * 4
    base = alone(size, steps, tmp / "runs")
    run_dir = tmp / f"{scheme}-{size:g}"
    cmd = [sys.executable, "-m", "distsgd", "run", *SCHEMES[scheme], "--quiet"]
    cmd += ["--run-dir", str(run_dir), str(SCRIPT), "--megabytes", str(size)]
    cmd += ["--steps", str(steps)]
    peaks = watched(cmd, run_dir)
    shards = shard_bytes(run_dir)
    return {
        "megabytes": size,
        "model_bytes": model,
        "scheme": scheme,
        "alone_mb": round(base, 1),
        "peaks_mb": {k: round(v, 1) for k, v in peaks.items()},
        "shard_bytes": shards,
        "server_over_shard": {k: round(peaks[k] * MB / shards[k], 2) for k in shards if k in peaks},
        "worker_over_alone_in_models": {
            k: round((v - base) * MB / model, 2) for k, v in peaks.items() if k.startswith("worker")
        },
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | scheme | alone | launcher | workers (peak MB; above alone, in models) "
        "| servers (peak MB; over the shard's bytes) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        above = r["worker_over_alone_in_models"]
        workers = ", ".join(f"{r['peaks_mb'][k]:.0f} ({v:+.2f})" for k, v in above.items())
        servers = ", ".join(
            f"{r['peaks_mb'][k]:.0f} ({v:.2f}x of {r['shard_bytes'][k] / MB:.0f} MB)"
            for k, v in r["server_over_shard"].items()
        )
        lines.append(
            f"| {r['model_bytes'] / MB:.0f} MB | {r['scheme']} | {r['alone_mb']:.0f} "
            f"| {r['peaks_mb'].get('launcher', 0):.0f} | {workers} | {servers} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="3,30,300", help="float32 megabytes, comma-separated")
    parser.add_argument("--schemes", default="hogwild,asyncdiloco")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("memory.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="distsgd-memory-") as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            for scheme in args.schemes.split(","):
                rows.append(measure(size, scheme, args.steps, Path(tmp)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    args.out.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
