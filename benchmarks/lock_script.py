"""A training script with its own loop that hangs on a lock of its own (for
``benchmarks/doctor_hangs.py``): at local step ``$DISTSGD_LOCK_AT`` worker ``$DISTSGD_LOCK_WORKER``
waits for a lock that a thread of its own holds forever, as a loop that waits on its own data
thread, a logger or a callback would.

    distsgd run --scheme sync --workers 2 --ps 1 benchmarks/lock_script.py
"""

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

import distsgd

torch.manual_seed(0)
x = torch.randn(512, 20)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
worker = distsgd.Worker(
    model,
    train_data=(x, y),
    config=distsgd.TrainConfig(batch_size=16, steps=100_000, lr=0.05),
)
at = int(os.environ.get("DISTSGD_LOCK_AT", "0"))
mine = worker.task.rank == int(os.environ.get("DISTSGD_LOCK_WORKER", "1"))
held = threading.Lock()
for step, (inputs, target) in enumerate(worker.batches(), start=1):
    with worker.step() as s:
        loss = F.cross_entropy(worker.model(inputs), target)
        loss.backward()
        s.loss = loss
    if mine and step == at:
        threading.Thread(target=held.acquire, daemon=True).start()  # taken, never given back
        while not held.locked():
            pass
        with held:  # the hang the doctor must name: this line
            pass
worker.finish()
