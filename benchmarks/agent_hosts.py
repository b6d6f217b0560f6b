"""``distsgd agent`` on 3 emulated machines (root; not part of CI, about a minute): one agent per
host through ``distsgd-emulate hosts exec``, the Hogwild demo (ps0 on host0, worker0 on host1,
worker1 on host2); worker1 is SIGKILLed (its agent restarts it), then host2 is lost (its agent
and its tasks SIGKILLed). The run must end on its own: every remaining agent exits 0, the chief
writes its result without worker1, and no process of the run is left. Prints what happened::

    python benchmarks/agent_hosts.py [--epochs 40] [--link 1gbit] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "distsgd" / "demo" / "digits.py"
DISTSGD = [sys.executable, "-m", "distsgd"]
EMULATE = [sys.executable, "-m", "distsgd_emulate"]
"""``distsgd-emulate``: the emulated hosts' command."""


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def _pids(folder: Path) -> dict[str, int]:
    try:
        return json.loads((folder / "tasks.json").read_text())
    except (OSError, ValueError):
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--out", type=Path, default=None, help="keep the files here")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="agent-hosts-"))
    work.mkdir(parents=True, exist_ok=True)
    from distsgd.transport import write_secret_file

    write_secret_file(work / "run.secret")
    env = {**os.environ, "DISTSGD_SECRET_FILE": str(work / "run.secret")}
    (work / "cluster.toml").write_text(
        '[cluster]\nps = ["198.18.0.1:2222"]\nworker = ["198.18.0.2:2222", "198.18.0.3:2222"]\n'
    )
    up = subprocess.Popen(
        [*EMULATE, "hosts", "up", "3", "--link", args.link, "--dir", str(work / "hosts")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    agents: dict[str, subprocess.Popen[bytes]] = {}
    try:
        _wait(lambda: (work / "hosts" / "hosts.json").exists(), 60, "the hosts")
        train = ["--scheme", "hogwild", "--epochs", str(args.epochs), str(DEMO)]
        plan = {
            "host0": ["--tasks", "ps:0", "--evict-after", "10"],
            "host1": ["--tasks", "worker:0", "--", "--run-dir", str(work / "run"), *train],
            "host2": ["--tasks", "worker:1", "--", *train],
        }
        started = time.monotonic()
        for host, rest in plan.items():
            argv = [
                *EMULATE, "hosts", "exec", host, "--dir", str(work / "hosts"), "--", *DISTSGD,
                "agent", "--dir", str(work / f"agent-{host}"), "--cluster",
                str(work / "cluster.toml"), *rest,
            ]  # fmt: skip
            log = open(work / f"{host}.log", "wb")  # noqa: SIM115 (closed with the process)
            agents[host] = subprocess.Popen(argv, env=env, cwd=work, stdout=log, stderr=log)
        host2 = work / "agent-host2"
        _wait(lambda: "worker1" in _pids(host2), 60, "worker1")
        time.sleep(12)
        first = _pids(host2)["worker1"]
        os.kill(first, signal.SIGKILL)
        print(f"{time.monotonic() - started:5.1f} s  SIGKILL worker1 (pid {first})", flush=True)
        _wait(lambda: _pids(host2).get("worker1") not in (None, first), 30, "worker1's restart")
        print(f"{time.monotonic() - started:5.1f} s  worker1 restarted by host2's agent")
        time.sleep(6)
        lost = [agents["host2"].pid, _pids(host2)["worker1"]]
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        print(f"{time.monotonic() - started:5.1f} s  host2 lost (SIGKILL {lost})", flush=True)
        codes = {h: agents[h].wait(timeout=600) for h in ("host0", "host1")}
        print(f"{time.monotonic() - started:5.1f} s  agents ended: {codes}")
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    result = json.loads((work / "run" / "result.json").read_text())
    said = (work / "host1.log").read_text()

    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}

    def left() -> list[str]:
        return [
            f"{p.pid} {p.info['name']}"
            for p in psutil.process_iter(["cmdline", "name", "status"])
            if str(work) in " ".join(p.info["cmdline"] or [])
            and p.info["status"] != psutil.STATUS_ZOMBIE
            and p.pid not in mine
        ]

    deadline = time.monotonic() + 10  # what is ending as the hosts go down
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    remaining = left()
    print(f"test accuracy {result['test_accuracy']:.4f}; processes of the run left: {remaining}")
    print("the chief:", next(line for line in said.splitlines() if "the run ends" in line))
    if (
        codes != {"host0": 0, "host1": 0}
        or remaining
        or "continues at local step" not in (work / "host2.log").read_text()
    ):
        raise SystemExit("FAILED")
    print(f"files in {work}")


if __name__ == "__main__":
    main()
