"""The benchmark suite's distsgd user script: the suite's MLP on random data, ``distsgd.train``.

    distsgd run --scheme hogwild --workers 2 --ps 1 --steps 500 --batch-size 64 --lr 0.01 \
        --threads 1 --quiet benchmarks/mlp_script.py [--hidden 512]

The command line's flags set the scheme, steps, batch size and learning rate; ``--hidden``
(a script argument) sets the MLP's width. No test set: the loop alone is what is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload

import distsgd

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=workload.HIDDEN)
parser.add_argument("--samples", type=int, default=workload.SAMPLES)
args = parser.parse_args()

model = workload.build_model(args.hidden)
x, y = workload.make_data(args.samples)
distsgd.train(
    model=model,
    loss_fn=F.cross_entropy,
    train_data=(x, y),
    config=distsgd.TrainConfig(batch_size=workload.BATCH_SIZE, lr=workload.LR, steps=100),
)
