"""``distsgd doctor`` against injected hangs: is the right task named, with the right frame,
and how soon?

    python benchmarks/doctor_hangs.py [--rounds 2] [--cases worker,server,partition,collective,lock]
        [--out DIR]

Each case starts a real run (``distsgd run``/``demo``, 2 workers), waits until it has stepped
(the launcher's probe says so), injects its hang, then runs ``distsgd doctor RUN`` once a
second until it names the expected task (or 10 s pass):

- ``worker``: a worker of a synchronous run stopped (SIGSTOP);
- ``server``: a parameter server of a synchronous run stopped (SIGSTOP);
- ``partition``: a worker's emulated host cut off (``--hosts``, ``partition:worker:1``; root);
- ``collective``: a worker of an all-reduce run (DDP) stopped in the all-reduce;
- ``lock``: a user's own loop blocked on a lock of its own (``benchmarks/lock_script.py``):
  the frame named must be the script's ``with held:`` line.

Writes ``results.json`` and ``results.md`` into ``--out``: per case and round, the culprit and
frame named, whether they are right, and the seconds from the injection to the verdict.
Every process is stopped by its PID (the run's process group) in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes)

from distsgd.launcher.doctor import examine, pointers  # noqa: E402
from distsgd.util.probe import ask  # noqa: E402

DISTSGD = [sys.executable, "-m", "distsgd"]
DEADLINE = 10.0
"""Seconds from the injection within which the doctor must name the culprit."""
COMMON = ["--workers", "2", "--steps", "100000", "--quiet", "--checkpoint-every", "0"]
CASES: dict[str, dict[str, Any]] = {
    "worker": {"cmd": ["demo", "--scheme", "sync", "--ps", "1"], "stop": "worker1"},
    "server": {"cmd": ["demo", "--scheme", "sync", "--ps", "2"], "stop": "ps1"},
    "partition": {
        "cmd": ["demo", "--scheme", "sync", "--ps", "1", "--hosts", "3"],
        "fault": "partition:worker:1@step=40,for=300s",
        "culprit": "worker1",
    },
    "collective": {"cmd": ["demo", "--scheme", "allreduce"], "stop": "worker1"},
    "lock": {
        "cmd": ["run", "--scheme", "sync", "--ps", "1", str(HERE / "lock_script.py")],
        "env": {"DISTSGD_LOCK_AT": "40", "DISTSGD_LOCK_WORKER": "1"},
        "culprit": "worker1",
        "frame": "lock_script.py",
    },
}


def _launcher_step(run_dir: Path) -> int:
    for pointer in pointers(run_dir):
        if pointer["task"] == "launcher":
            try:
                return int(ask(pointer["socket"])["state"]["launcher"]["step"])
            except (OSError, ValueError, KeyError):
                return 0
    return 0


def _wait_for_steps(run_dir: Path, proc: Any, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _launcher_step(run_dir) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise bench.Failed(f"the run did not reach step {steps} ({run_dir})")
        time.sleep(0.1)


def one(name: str, out: Path, procs: bench.Processes) -> dict[str, Any]:
    case = CASES[name]
    run_dir = out / f"{name}-{time.strftime('%H%M%S')}"
    cmd = [*DISTSGD, *case["cmd"][:1], *COMMON, "--run-dir", str(run_dir), *case["cmd"][1:]]
    if "fault" in case:
        cmd[len(DISTSGD) + 1 : len(DISTSGD) + 1] = ["--inject-fault", case["fault"]]
    proc = procs.start(cmd, out / f"{run_dir.name}.log", env=case.get("env"))
    try:
        _wait_for_steps(run_dir, proc, 20, 180)
        expected = case.get("culprit") or case["stop"]
        if "stop" in case:
            pid = next(int(p["pid"]) for p in pointers(run_dir) if p["task"] == case["stop"])
            os.kill(pid, signal.SIGSTOP)
        else:  # the partition and the lock land at step 40
            _wait_for_steps(run_dir, proc, 40, 60)
        injected = time.monotonic()
        found = None
        while time.monotonic() - injected < DEADLINE + 30:
            exam = examine(run_dir)
            found = exam.diagnosis
            if found.culprit == expected and case.get("frame", "") in found.frame:
                break
            time.sleep(1.0)
        assert found is not None
        took = time.monotonic() - injected
        right_frame = case.get("frame", "") in found.frame
        return {
            "case": name,
            "expected": expected,
            "culprit": found.culprit,
            "cause": found.cause,
            "frame": found.frame,
            "right": found.culprit == expected and right_frame,
            "seconds": round(took, 1),
            "within_deadline": took <= DEADLINE,
        }
    finally:
        procs.stop(proc)
        bench._stop_run_tasks(run_dir, proc.pid)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | expected | named | right | seconds | frame |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        frame = str(r["frame"]).replace("|", "\\|")[:110]
        right = "yes" if r["right"] and r["within_deadline"] else "**no**"
        lines.append(
            f"| {r['case']} | {r['expected']} | {r['culprit']} | {right} | {r['seconds']} | "
            f"`{frame}` |"
        )
    good = sum(1 for r in rows if r["right"] and r["within_deadline"])
    return "\n".join([*lines, "", f"{good} of {len(rows)} named right within {DEADLINE:.0f} s."])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=Path("/tmp/doctor-hangs"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    procs = bench.Processes()
    rows = []
    try:
        for _ in range(args.rounds):
            for name in args.cases.split(","):
                try:
                    rows.append(one(name, args.out, procs))
                except bench.Failed as exc:  # no hang injected: counted as not named
                    rows.append(
                        {
                            "case": name,
                            "expected": "",
                            "culprit": None,
                            "cause": "",
                            "frame": f"not run: {exc}",
                            "right": False,
                            "seconds": 0.0,
                            "within_deadline": False,
                        }
                    )
                print(json.dumps(rows[-1]), flush=True)
                (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    finally:
        procs.stop_all()
    (args.out / "results.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0 if all(r["right"] and r["within_deadline"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
