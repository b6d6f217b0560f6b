"""What a metrics line costs the training loop, with and without TensorBoard events (not CI).

Logs a worker's training line (the demo's fields: loss, samples, bytes, staleness, the time
split) through :class:`~distsgd.control.metrics.MetricsWriter` into a temporary run folder,
``--lines`` times per round, with TensorBoard events off (``DISTSGD_TENSORBOARD=0``) and on, in
turn for ``--rounds`` rounds, and prints the median microseconds per line of each and the
difference: what TensorBoard adds to every ``--log-every`` steps of a worker.

    python benchmarks/metrics_overhead.py [--lines 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from distsgd.control.board import ENV_VAR
from distsgd.control.metrics import MetricsWriter


def line(step: int) -> dict[str, object]:
    """A training line as a parameter-server worker logs it."""
    return {
        "step": 2 * step,
        "local_step": step,
        "progress": round(step / 100_000, 4),
        "loss": 2.302585 / (1 + step / 1000),
        "samples": 32 * step,
        "epoch": step // 50,
        "bytes_sent": 153_128 * step,
        "lost_pushes": 0,
        "nonfinite_skipped": 0,
        "mean_staleness": 0.4375,
        "dropped": 0,
        "compute_s": 0.0191 * step,
        "pull_s": 0.0056 * step,
        "push_s": 0.0078 * step,
        "wait_s": 0.0079 * step,
        "checkpoint_s": 0.0001 * step,
    }


def per_line(folder: Path, lines: int, tensorboard: bool) -> float:
    """Microseconds per ``MetricsWriter.log`` of a training line."""
    os.environ[ENV_VAR] = "1" if tensorboard else "0"
    folder.mkdir()
    writer = MetricsWriter(folder / "metrics.jsonl", "worker0")
    assert (writer.board is not None) == tensorboard, "is tensorboard installed?"
    records = [line(i) for i in range(1, lines + 1)]
    started = time.perf_counter()
    for record in records:
        writer.log(**record)
    seconds = time.perf_counter() - started
    writer.close()
    return 1e6 * seconds / lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            off.append(per_line(Path(tmp) / f"off{n}", args.lines, tensorboard=False))
            on.append(per_line(Path(tmp) / f"on{n}", args.lines, tensorboard=True))
        size = sum(p.stat().st_size for p in (Path(tmp) / "on0" / "tensorboard").rglob("*"))
    a, b = statistics.median(off), statistics.median(on)
    print(f"metrics.jsonl only:       {a:7.1f} us per line")
    print(f"with TensorBoard events:  {b:7.1f} us per line (+{b - a:.1f} us)")
    print(f"event file: {size / args.lines:.0f} bytes per line")


if __name__ == "__main__":
    main()
