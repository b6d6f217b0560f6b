"""The bundled LM's test loss against batch size at equal samples, in one process (not CI).

A synchronous scheme on N workers (sync, allreduce) takes, at equal samples, N times fewer
steps of an N times larger batch at the rate its rule gives. This trains the model of
``src/distsgd/demo/lm.py`` exactly so in one process, with no distsgd run around it, to tell
what the batch size costs by itself from what a scheme adds: each run is a batch size, a
learning rate, a warm-up and a number of epochs; everything else is the script's (SGD,
momentum 0.9, cosine schedule, seed 0). Prints a Markdown table and writes the rows as JSON.

    python benchmarks/lm_batch.py                                  # the guide's table
    python benchmarks/lm_batch.py --runs 32:0.1,128:0.2:0.2:6      # batch:lr[:warm-up[:epochs]]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from distsgd.control.config import lr_factor
from distsgd.demo.gpt import GPT, SIZES, lm_loss
from distsgd.demo.lm import load_text

DEFAULT_RUNS = (
    "32:0.1,64:0.1414,128:0.2,128:0.1,128:0.2:0.2,64:0.1414:0.2,"
    "8:0.05,16:0.0707,16:0.1:0.1,32:0.2:0.2,32:0.1:0.05:6,128:0.2:0.05:6"
)
"""Alone (32, lr 0.1); 2 and 4 workers at the sqrt rule (64 and 128); the same with other rates
and warm-ups; a smaller batch alone (8) and its 2- and 4-fold; 6 epochs instead of 2."""


def run(batch: int, lr: float, warmup: float, epochs: int) -> dict[str, float]:
    """Train the script's model on ``batch``-sized batches: its test loss and the curve."""
    torch.manual_seed(0)
    (x, y), (tx, ty) = load_text()
    model = GPT(SIZES["tiny"])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    per_epoch = len(x) // batch
    total = epochs * per_epoch
    order = torch.Generator().manual_seed(0)
    began, step, curve = time.perf_counter(), 0, []
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=order)
        for i in range(per_epoch):
            idx = perm[i * batch : (i + 1) * batch]
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor("cosine", step, total, warmup)
            loss = lm_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % max(1, total // 8) == 0:
                curve.append(round(test_loss(model, tx[:512], ty[:512]), 3))
    return {
        "batch": batch,
        "lr": lr,
        "warmup": warmup,
        "epochs": epochs,
        "steps": total,
        "test_loss": round(test_loss(model, tx, ty), 4),
        "curve": curve,
        "seconds": round(time.perf_counter() - began, 1),
    }


@torch.no_grad()
def test_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    total = sum(float(lm_loss(model(x[i : i + 512]), y[i : i + 512])) * len(x[i : i + 512])
                for i in range(0, len(x), 512))  # fmt: skip
    return total / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="batch:lr[:warm-up[:epochs]],...")
    parser.add_argument("--out", type=Path, default=Path("lm_batch.json"))
    args = parser.parse_args()
    rows = []
    print("| batch | lr | warm-up | epochs | steps | test loss | curve (every 1/8) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.runs.split(","):
        batch, lr, *rest = spec.split(":")
        warmup = float(rest[0]) if rest else 0.05
        epochs = int(rest[1]) if len(rest) > 1 else 2
        row = run(int(batch), float(lr), warmup, epochs)
        rows.append(row)
        curve = " ".join(f"{v:.2f}" for v in row["curve"])
        print(f"| {batch} | {lr} | {warmup} | {epochs} | {row['steps']} | "
              f"{row['test_loss']:.3f} | {curve} |", flush=True)  # fmt: skip
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
