"""What each push encoding costs the CPU: encode with error feedback, then decode, per piece.

    python benchmarks/codec_cost.py [--mb 2.7] [--rounds 7]

One float32 piece of ``--mb`` MB (normal values, fixed seed), pushed through
``distsgd.ps.compression.ErrorFeedback`` (the worker's side: residual added, encoded, residual
kept) and decoded with ``decode`` (the server's side), as a push does. The encodings run in
turn, A B A B, ``--rounds`` times; the table gives each one's median milliseconds and its
median ratio to int8's, paired within each round (the cost model's ``plan/choices.py``
constants are set from these ratios). Single-threaded numpy; no process is started.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from distsgd.ps.compression import ErrorFeedback, decode, encoding_for

ENTRIES = (("int8", 0.0), ("int4", 0.0), ("int2", 0.0), ("bf16", 0.0), ("float32", 0.01))


def once(piece: np.ndarray, feedback: ErrorFeedback) -> float:
    """Seconds to encode ``piece`` with ``feedback`` and decode the message."""
    began = time.perf_counter()
    message = feedback.encode("w", piece)
    decode(
        b"".join(p.tobytes() for p in message.parts),
        encoding=message.encoding,
        scale=message.scale,
        nnz=message.nnz,
        shape=piece.shape,
        dtype=piece.dtype,
    )
    return time.perf_counter() - began


def label(wire: str, topk: float) -> str:
    return f"top-{topk:g}" if topk else wire


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=2.7)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    piece = np.random.default_rng(0).normal(size=int(args.mb * 1e6 / 4)).astype(np.float32)
    coders = {label(w, k): ErrorFeedback(encoding_for(w), k) for w, k in ENTRIES}
    for coder in coders.values():
        once(piece, coder)  # warm: the residual exists from here on, as in a run
    times: dict[str, list[float]] = {name: [] for name in coders}
    for _ in range(args.rounds):
        for name, coder in coders.items():
            times[name].append(once(piece, coder))
    print(f"| encoding | ms per {args.mb:g} MB (median of {args.rounds}) | / int8 |")
    print("|---|---|---|")
    for name, got in times.items():
        ratio = statistics.median(g / b for g, b in zip(got, times["int8"], strict=True))
        print(f"| {name} | {statistics.median(got) * 1e3:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
