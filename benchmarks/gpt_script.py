"""The memory and checkpoint benchmarks' user script: a GPT-2-style LM (distsgd.demo.gpt) of a
given float32 size on random byte sequences, trained with distsgd.train for a few steps.

    python benchmarks/gpt_script.py --megabytes 30 --steps 4            # alone
    distsgd run --scheme hogwild --workers 2 --ps 2 benchmarks/gpt_script.py --megabytes 30

``--size gpt2-76m`` takes a named shape instead (distsgd.demo.gpt.SIZES).
"""

from __future__ import annotations

import argparse

import torch

import distsgd
from distsgd.demo.gpt import GPT, SIZES, config_for_megabytes, lm_loss

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--megabytes", type=float, default=3.0, help="float32 size of the model")
parser.add_argument("--size", choices=sorted(SIZES), help="a named shape instead")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

config = SIZES[args.size] if args.size else config_for_megabytes(args.megabytes)
torch.manual_seed(0)
model = GPT(config)
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, config.vocab, (64, config.context + 1), generator=gen)
distsgd.train(
    model=model,
    loss_fn=lm_loss,
    train_data=(tokens[:, :-1], tokens[:, 1:]),
    config=distsgd.TrainConfig(batch_size=args.batch, steps=args.steps, lr=args.lr),
)
