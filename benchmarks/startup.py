"""What the fork server saves at start-up (not part of CI): whole runs, ``--fork-server on``
against ``off``.

Each case is one whole command, run in turn A B A B ... (A: ``--fork-server on``, B: ``off``;
the machine's speed drifts, neighbours in time stay fair), ``--rounds`` times each:

* ``hogwild``: ``distsgd demo --scheme hogwild --workers 4 --quiet --epochs E`` (E default 5,
  so that start-up dominates; the parameter-server path);
* ``allreduce``: ``distsgd demo --scheme allreduce --workers 4 --quiet --epochs E`` (the
  collective path);

each with its own ``--run-dir`` under a temporary folder removed at the end. Per run: wall
seconds (``time.monotonic`` around the command), CPU seconds (user + system) of the command
and of every process it waited for, and the peak resident set of the largest of those processes
(``ru_maxrss``, what ``/usr/bin/time -v`` reports), from ``os.wait4`` on the command's own
process. That covers
the whole run because the launcher waits for what it starts: each worker and server task it
started as a process, and the fork server, which itself waits for each worker it forked (so a
forked worker's CPU time reaches the launcher through the fork server's). Each run's exit code
is kept: a failed run is reported, and no ratio is taken from it.

Report per case: the medians on and off, the paired ratios on / off (round i's A over round i's
B, a round counted only when both of its runs succeeded), their median, and every run. Prints a
markdown table and writes a JSON report (``--out``, default ``startup.json``)::

    python benchmarks/startup.py [--rounds 4] [--epochs 5] [--timeout 300] [--out startup.json]

Every command is started as ``sys.executable -m distsgd`` in a new session; on timeout this
script ends that session's process group (SIGTERM, SIGKILL 10 s later; the launcher's tasks end
with their launcher) and reaps the command. The module imports neither torch nor distsgd: its
report math is tested alone (``tests/test_startup_bench.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FLAGS = ("on", "off")
"""A then B: the fork server's settings, in the order each round runs them."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One whole command, measured."""

    case: str
    """The case's name (a key of :func:`cases`)."""
    flag: str
    """``--fork-server``'s value: ``on`` or ``off``."""
    round: int
    """The round, from 1."""
    wall: float
    """Seconds from start to exit (``time.monotonic``)."""
    cpu: float
    """User + system CPU seconds of the command and every process it waited for."""
    peak: float
    """MiB: the peak resident set of the largest of those processes (``ru_maxrss``; pages
    shared with another process count in each; never below this script's own size, which a
    forked child starts from)."""
    code: int
    """Exit code (negative: the signal that ended it, as ``Popen.returncode`` has it)."""
    timed_out: bool = False
    """True when this script ended the run at ``--timeout``."""
    tail: str = ""
    """The last lines of the command's output, kept for a failed run only."""

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.timed_out


def cases(epochs: int) -> dict[str, list[str]]:
    """Each case's ``distsgd`` arguments, less ``--fork-server`` and ``--run-dir``."""
    common = ["--workers", "4", "--quiet", "--epochs", str(epochs)]
    return {
        "hogwild": ["demo", "--scheme", "hogwild", *common],
        "allreduce": ["demo", "--scheme", "allreduce", *common],
    }


# -- the report's math (pure) -------------------------------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def paired_ratios(runs: Sequence[Run], case: str, what: str) -> list[float]:
    """Round i's on over round i's off of ``what`` (``wall`` or ``cpu``), for each round of
    ``case`` whose on and off runs both succeeded, in round order."""
    by_round: dict[int, dict[str, Run]] = {}
    for run in runs:
        if run.case == case:
            by_round.setdefault(run.round, {})[run.flag] = run
    ratios = []
    for round_ in sorted(by_round):
        pair = by_round[round_]
        if all(flag in pair and pair[flag].ok for flag in FLAGS):
            ratios.append(getattr(pair["on"], what) / getattr(pair["off"], what))
    return ratios


def summarize(runs: Sequence[Run], case: str) -> dict[str, Any]:
    """One case's figures: medians of the successful runs on and off, the paired ratios and
    their medians, the failed runs, and every run."""
    mine = [run for run in runs if run.case == case]
    summary: dict[str, Any] = {}
    for what in ("cpu", "wall", "peak"):
        for flag in FLAGS:
            values = [getattr(r, what) for r in mine if r.flag == flag and r.ok]
            summary[f"{what}_{flag}_median"] = _median(values)
        ratios = paired_ratios(mine, case, what)
        summary[f"{what}_ratios"] = [round(r, 4) for r in ratios]
        ratio = _median(ratios)
        summary[f"{what}_ratio_median"] = None if ratio is None else round(ratio, 4)
    summary["ok"] = {flag: sum(r.ok for r in mine if r.flag == flag) for flag in FLAGS}
    summary["failed"] = [asdict(r) for r in mine if not r.ok]
    summary["runs"] = [asdict(r) for r in mine]
    return summary


def _pair(summary: dict[str, Any], what: str, digits: int) -> str:
    on, off = summary[f"{what}_on_median"], summary[f"{what}_off_median"]
    if on is None or off is None:
        return "n/a"
    return f"{on:.{digits}f} / {off:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(summaries: dict[str, dict[str, Any]], commands: dict[str, str]) -> str:
    """The markdown table of :func:`summarize`'s figures, one row a case (``commands``: each
    case's command less ``--fork-server``), then a line for each failed run."""
    lines = [
        "| command | runs ok (on + off) | cpu s on / off | wall s on / off "
        "| paired on ÷ off: cpu, wall (median) | peak MiB on / off |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    failures = []
    for case, s in summaries.items():
        ratios = f"{_ratio(s['cpu_ratio_median'])}, {_ratio(s['wall_ratio_median'])}"
        ok = f"{s['ok']['on']} + {s['ok']['off']}"
        lines.append(
            f"| `{commands[case]} --fork-server on` (or `off`) | {ok} "
            f"| {_pair(s, 'cpu', 2)} | {_pair(s, 'wall', 2)} | {ratios} | {_pair(s, 'peak', 0)} |"
        )
        for run in s["failed"]:
            why = "timed out" if run["timed_out"] else f"exit code {run['code']}"
            failures.append(f"- failed: {case} round {run['round']} {run['flag']}: {why}")
    return "\n".join(lines + (["", *failures] if failures else []))


# -- running the commands -----------------------------------------------------------------------
def _reap(pid: int, timeout: float) -> tuple[int, resource.struct_rusage] | None:
    """Wait up to ``timeout`` seconds for child ``pid``: its wait status and resource usage
    (its own and that of every process it waited for), or None if it is still running."""
    deadline = time.monotonic() + timeout
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got == pid:
            return status, usage
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    """Signal the process group this script created (its id is the command's PID), no other."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _end(pid: int, grace: float = 10.0) -> tuple[int, resource.struct_rusage]:
    """End the command ``pid`` and reap it: SIGTERM to its group (the launcher then stops its
    tasks), SIGKILL after ``grace`` seconds."""
    _signal_group(pid, signal.SIGTERM)
    reaped = _reap(pid, grace)
    if reaped is None:
        _signal_group(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        reaped = status, usage
    return reaped


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What :func:`measure` saw of one command."""

    wall: float
    """Seconds from start to exit."""
    cpu: float
    """User + system CPU seconds of it and every process it waited for."""
    peak: float
    """MiB: the largest of those processes' peak resident set."""
    code: int
    """Exit code (negative: the signal that ended it)."""
    timed_out: bool
    """True when it was ended at the timeout."""


def measure(argv: list[str], log_path: Path, timeout: float) -> Measured:
    """Run ``argv`` in a new session, its output into ``log_path``, for up to ``timeout``
    seconds."""
    with log_path.open("wb") as out:
        started = time.monotonic()
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    reaped = None
    try:
        reaped = _reap(process.pid, timeout)
    finally:
        timed_out = reaped is None
        if reaped is None:
            reaped = _end(process.pid)
    wall = time.monotonic() - started
    status, usage = reaped
    code = os.waitstatus_to_exitcode(status)
    process.returncode = code  # reaped here: Popen must not wait for it again
    return Measured(
        wall=wall, cpu=usage.ru_utime + usage.ru_stime, peak=usage.ru_maxrss / 1024, code=code,
        timed_out=timed_out,
    )  # fmt: skip


def run_all(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="distsgd-startup-") as tmp:
        for round_ in range(1, args.rounds + 1):
            for case, command in cases(args.epochs).items():
                for flag in FLAGS:
                    run_dir = Path(tmp) / f"{case}-{round_}-{flag}"
                    argv = [
                        sys.executable, "-m", "distsgd", *command, "--fork-server", flag,
                        "--run-dir", str(run_dir),
                    ]  # fmt: skip
                    log_path = Path(tmp) / f"{case}-{round_}-{flag}.log"
                    m = measure(argv, log_path, args.timeout)
                    run = Run(
                        case=case, flag=flag, round=round_, wall=round(m.wall, 3),
                        cpu=round(m.cpu, 3), peak=round(m.peak, 1), code=m.code,
                        timed_out=m.timed_out,
                    )  # fmt: skip
                    if not run.ok:
                        run = dataclasses.replace(run, tail=_tail(log_path))
                    runs.append(run)
                    state = "ok" if run.ok else ("timed out" if m.timed_out else f"exit {m.code}")
                    print(
                        f"round {round_} {case:9s} fork server {flag:3s} cpu {m.cpu:6.2f} s "
                        f"wall {m.wall:6.2f} s peak {m.peak:5.0f} MiB {state}",
                        flush=True,
                    )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="A B pairs per case (default 4)")
    parser.add_argument("--epochs", type=int, default=5, help="the demo's epochs (default 5)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--out", type=Path, default=Path("startup.json"))
    args = parser.parse_args()
    if args.rounds < 1 or args.epochs < 1 or args.timeout <= 0:
        parser.error("--rounds and --epochs must be at least 1 and --timeout positive")
    runs = run_all(args)
    commands = {
        case: f"distsgd {' '.join(command)}" for case, command in cases(args.epochs).items()
    }
    summaries = {case: summarize(runs, case) for case in commands}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "command": " ".join(["python", "benchmarks/startup.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "epochs": args.epochs,
        "commands": commands,
        "cases": summaries,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(summaries, commands))
    if any(s["failed"] for s in summaries.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
