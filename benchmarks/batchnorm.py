"""The digits CNN with and without BatchNorm, alone and under every scheme (not part of CI).

For each model (``nobn``: the demo's CNN; ``bn``: ``DigitsCNN(batch_norm=True)``) and each
loop (``train``: the demo script, ``distsgd.train``; ``own``: tests/scripts/own_loop.py, a
loop of the user's own) it runs the script alone (``python script``: one process), then under
each scheme on each number of workers at the defaults (``distsgd run --workers N --scheme S``,
one server), and reads the accuracy each printed last. For the BatchNorm runs it also scores
the saved ``final_model.pt`` with its running statistics re-estimated over the whole training
set at its own parameters (``recal``): the accuracy those parameters can reach, so that a gap
between ``acc`` and ``recal`` is the statistics' and one between ``recal`` and alone the
parameters'. Prints a Markdown table (one row per run) and writes the rows as JSON.

    python benchmarks/batchnorm.py --models bn --loops train --workers 2
    python benchmarks/batchnorm.py                      # everything: 4 alone, 96 runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = {
    "train": (ROOT / "src" / "distsgd" / "demo" / "digits.py", {"bn": "--batch-norm"}),
    "own": (ROOT / "tests" / "scripts" / "own_loop.py", {"bn": "batch-norm"}),
}
"""Each loop's script, and the argument that turns BatchNorm on."""


def accuracy_line(out: str) -> float | None:
    lines = out.strip().splitlines()
    if not lines or not lines[-1].startswith("test accuracy: "):
        return None
    return float(lines[-1].split(":")[1])


def recalibrated(final_model: Path) -> float | None:
    """The accuracy of ``final_model``'s parameters with BatchNorm statistics re-estimated
    over the whole training set (a cumulative average of its batches' statistics)."""
    import torch
    from torch import nn

    from distsgd.demo.digits import DigitsCNN, load_digits

    if not final_model.exists():
        return None
    model = DigitsCNN(batch_norm=True)
    model.load_state_dict(torch.load(final_model, weights_only=True))
    (x, _), (tx, ty) = load_digits()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        model.train()
        for i in range(0, len(x) - 31, 32):
            model(x[i : i + 32])
        model.eval()
        return float((model(tx).argmax(1) == ty).float().mean())


def one_run(loop: str, model: str, scheme: str | None, workers: int, tmp: Path) -> dict[str, Any]:
    script, flags = SCRIPTS[loop]
    args = [flags[model]] if model in flags else []
    run_dir = tmp / f"{loop}-{model}-{scheme or 'alone'}-{workers}"
    if scheme is None:
        cmd = [sys.executable, str(script), *args]
        env = {"DISTSGD_RUNS": str(run_dir)}
    else:
        cmd = [sys.executable, "-m", "distsgd", "run", "--workers", str(workers)]
        cmd += ["--scheme", scheme, "--quiet", "--run-dir", str(run_dir), str(script), *args]
        env = {}
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    row: dict[str, Any] = {
        "loop": loop,
        "model": model,
        "scheme": scheme or "alone",
        "workers": workers,
        "rc": done.returncode,
        "accuracy": accuracy_line(done.stdout),
        "seconds": round(time.monotonic() - started, 1),
    }
    if model == "bn":
        finals = [run_dir / "final_model.pt", *run_dir.glob("*/final_model.pt")]
        found = [f for f in finals if f.exists()]
        row["recal"] = recalibrated(found[0]) if found else None
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or [""])[-1][-300:]
    return row


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def table(rows: list[dict[str, Any]]) -> str:
    alone = {(r["loop"], r["model"]): r["accuracy"] for r in rows if r["scheme"] == "alone"}
    lines = [
        "| loop | model | scheme | workers | accuracy | below alone | recalibrated | exit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        base = alone.get((r["loop"], r["model"]))
        gap = None if base is None or r["accuracy"] is None else base - r["accuracy"]
        lines.append(
            f"| {r['loop']} | {r['model']} | {r['scheme']} | {r['workers']} "
            f"| {fmt(r['accuracy'])} | {fmt(gap)} | {fmt(r.get('recal'))} | {r['rc']} |"
        )
    return "\n".join(lines)


def main() -> None:
    from distsgd import schemes

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schemes", default=",".join(schemes.names()))
    parser.add_argument("--workers", default="2,4", help="comma-separated")
    parser.add_argument("--models", default="nobn,bn", help="nobn, bn")
    parser.add_argument("--loops", default="train,own", help="train, own")
    parser.add_argument("--out", type=Path, default=Path("batchnorm.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="distsgd-batchnorm-") as name:
        tmp = Path(name)
        for loop in args.loops.split(","):
            for model in args.models.split(","):
                rows.append(one_run(loop, model, None, 1, tmp))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                for workers in (int(w) for w in args.workers.split(",")):
                    for scheme in args.schemes.split(","):
                        rows.append(one_run(loop, model, scheme, workers, tmp))
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
