"""The own-loop page's gradient accumulation, loss scaling and scheduler of one's own, as one
worker script (tests/test_own_loop_features.py runs it under schemes on 2 workers).

Arguments (any of them): ``accumulate`` takes each batch of 32 in 2 micro-batches of 16;
``scaler`` scales the loss with a CPU GradScaler, and the last worker's loss at its step 3 is
made infinite, as an overflow would (that step must be skipped, the scale halved); ``frozen``
schedules the rate to 0 with a LambdaLR over ``worker.optimizer`` (the parameters must end as
they began). The chief prints its scaler's scale at the end.
"""

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

import distsgd

torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] + x[:, 1] > 0).long()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
config = distsgd.TrainConfig(batch_size=32, epochs=2, lr=0.2, log_every=1)

scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if "scaler" in sys.argv else None
worker = distsgd.Worker(model, train_data=(x, y), config=config, grad_scaler=scaler)
scheduler = None
if "frozen" in sys.argv:
    scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda step: 0.0)
last = worker.task.rank == worker.task.num_workers - 1
parts = 2 if "accumulate" in sys.argv else 1
for batch in worker.batches():
    with worker.step() as step:
        total = 0.0
        for inputs, target in step.micro_batches(batch, parts):
            loss = F.cross_entropy(worker.model(inputs), target) / parts
            if scaler is not None and worker.local_step == 3 and last:
                loss = loss * float("inf")  # as a float16 overflow would make it
            (loss if scaler is None else scaler.scale(loss)).backward()
            total += loss.item()
        if math.isfinite(total):
            step.loss = total
    if scheduler is not None:
        scheduler.step()
result = worker.finish()
if worker.task.is_chief and scaler is not None:
    print(f"scale {scaler.get_scale():g}")
