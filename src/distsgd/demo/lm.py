"""Train a small GPT-2-style language model on bundled text with distsgd.

The text ships inside the package (``text.txt.gz``, see ``tools/export_text.py``): distsgd's own
guide, about 520 KB of English with Markdown tables and code, read as bytes (a vocabulary of
256, nothing to download or tokenize). The first 90% is for training, the rest for test, each
cut into sequences of 64 bytes whose targets are the same bytes one further on. The model is
:mod:`distsgd.demo.gpt`'s ``tiny`` (0.44M parameters); the loss is the next-byte cross-entropy
(test loss in nats per byte; its exponential is the perplexity). ``distsgd run`` runs it::

    distsgd run --workers 2 --scheme allreduce src/distsgd/demo/lm.py
    python src/distsgd/demo/lm.py --steps 50        # alone
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np
import torch

import distsgd
from distsgd.demo.gpt import GPT, SIZES, lm_loss

TEXT = Path(__file__).with_name("text.txt.gz")
CONTEXT = 64


def load_text(
    context: int = CONTEXT, split: float = 0.9
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train inputs, targets), (test inputs, targets)): int64 (N, context) byte sequences,
    the targets shifted by one byte."""
    data = np.frombuffer(gzip.decompress(TEXT.read_bytes()), dtype=np.uint8)
    cut = int(split * len(data))

    def sequences(part: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(part) - 1) // context
        ids = torch.from_numpy(part[: n * context + 1].astype(np.int64))
        return ids[:-1].view(n, context), ids[1:].view(n, context)

    return sequences(data[:cut]), sequences(data[cut:])


def main(argv: list[str] | None = None) -> distsgd.TrainResult:
    parser = argparse.ArgumentParser(description="the bundled language model")
    parser.add_argument("--steps", type=int, default=0, help="steps per worker (0: --epochs)")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    config = distsgd.TrainConfig(
        batch_size=32,
        epochs=args.epochs,
        steps=args.steps,
        lr=0.1,
        momentum=0.9,
        lr_schedule="cosine",
        warmup=0.05,
    )
    distsgd.seed_everything(config.seed)
    train, test = load_text()
    return distsgd.train(
        model=GPT(SIZES["tiny"]),
        loss_fn=lm_loss,
        train_data=train,
        test_data=test,
        config=config,
    )


if __name__ == "__main__":
    main()
