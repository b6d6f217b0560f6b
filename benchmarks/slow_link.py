"""Schemes on emulated hosts joined by a slow link: training time, accuracy and bytes, A B A B.

    python benchmarks/slow_link.py [--link 5mbit] [--workers 4] [--rounds 3] [--epochs 30]
        [--entries "diloco;diloco --overlap-steps 25;..."] [--out DIR]

Root only (network namespaces; ``distsgd demo --hosts N --link RATE``: every task on a host of
its own, each host's link shaped to RATE). Each entry is a scheme and its flags (``;`` between
entries); a parameter-server entry (``--ps M`` among its flags, or a scheme that has servers)
gets a host per server as well. Each round runs every entry once, in turn (A B A B: the
machine's speed drifts, neighbours stay fair), with seed ``round``. A run's figures come from
its chief's ``result.json``: ``seconds`` (the training loop, start-up excluded), the test
accuracy, ``bytes_sent`` (the chief's, as it counted them). The table gives mean and spread
(max - min) over the rounds and each entry's time over the first entry's, paired within each
round, then the mean. Writes ``results.md`` and ``results.json`` into ``--out``. Every process
is stopped by its PID (process group) when it ends, fails or times out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Processes  # noqa: E402

DEFAULT_ENTRIES = "diloco;diloco --overlap-steps 25;diloco --wire-dtype int4 --overlap-steps 25"
PS_SCHEMES = ("sync", "hogwild", "downpour", "agn", "sagn", "easgd", "eamsgd", "dynsgd")
TIMEOUT_S = 600.0


def command(
    entry: str, *, link: str, workers: int, epochs: int, seed: int, run_dir: Path
) -> list[str]:
    """The ``distsgd demo`` command line of one entry's run."""
    flags = shlex.split(entry)
    scheme, rest = flags[0], flags[1:]
    servers = int(rest[rest.index("--ps") + 1]) if "--ps" in rest else 0
    if not servers and (scheme in PS_SCHEMES or scheme == "asyncdiloco"):
        servers = 1
    hosts = workers + servers
    return [
        *(sys.executable, "-m", "distsgd", "demo", "--scheme", scheme, *rest),
        *("--workers", str(workers), "--hosts", str(hosts), "--link", link),
        *("--epochs", str(epochs), "--seed", str(seed), "--quiet", "--run-dir", str(run_dir)),
    ]


def measure(processes: Processes, cmd: list[str], run_dir: Path) -> dict[str, float]:
    """One run: its chief's seconds, accuracy and bytes sent."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    (code,) = processes.wait([processes.start(cmd, log)], TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"exit {code}: {shlex.join(cmd)} (log {log})")
    result = json.loads((run_dir / "result.json").read_text())
    return {
        "seconds": float(result["seconds"]),
        "accuracy": float(result["test_accuracy"]),
        "bytes_sent": float(result["bytes_sent"]),
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4g} ± {max(values) - min(values):.2g}"


def table(entries: list[str], runs: dict[str, list[dict[str, float]]]) -> str:
    """The markdown table: one row per entry."""
    first = runs[entries[0]]
    lines = [
        "| entry | test accuracy | training seconds | time / first entry's | MB sent (chief) |",
        "|---|---|---|---|---|",
    ]
    for entry in entries:
        got = runs[entry]
        ratio = statistics.fmean(
            g["seconds"] / f["seconds"] for g, f in zip(got, first, strict=True)
        )
        lines.append(
            f"| `{entry}` | {_spread([g['accuracy'] for g in got])} "
            f"| {_spread([g['seconds'] for g in got])} | {ratio:.2f}x "
            f"| {statistics.fmean(g['bytes_sent'] for g in got) / 1e6:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="5mbit", help="every host's link (--link of distsgd)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--entries", default=DEFAULT_ENTRIES, help="';'-separated scheme + flags")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    entries = [e.strip() for e in args.entries.split(";") if e.strip()]
    out = args.out or Path(tempfile.mkdtemp(prefix="slow-link-"))
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in entries}
    processes = Processes()
    try:
        for round_ in range(args.rounds):
            for i, entry in enumerate(entries):
                run_dir = out / "runs" / f"r{round_}-e{i}"
                cmd = command(
                    entry,
                    link=args.link,
                    workers=args.workers,
                    epochs=args.epochs,
                    seed=round_,
                    run_dir=run_dir,
                )
                runs[entry].append(measure(processes, cmd, run_dir))
                print(f"round {round_} {entry}: {runs[entry][-1]}", flush=True)
    finally:
        processes.stop_all()
    report: dict[str, Any] = {"link": args.link, "workers": args.workers, "epochs": args.epochs}
    report["runs"] = runs
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = (
        f"{args.workers} workers, each task on an emulated host with a {args.link} link, "
        f"{args.epochs} epochs of the digits demo, {args.rounds} rounds (A B A B)\n\n"
        + table(entries, runs)
    )
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
