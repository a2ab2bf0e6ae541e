"""A 2-process Accelerate job on CPU (gloo) logging through ``RanklogTracker``.

``torchrun --nproc_per_node 2 examples/accelerate_train.py --spool S`` trains a
linear model for 20 steps, each process on its own batches, and logs every step from
every process with ``ranklog.accelerate.log``. ``--crash-at K --crash-rank R``: process
R SIGKILLs itself when step K begins.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from accelerate import Accelerator

from ranklog.accelerate import RanklogTracker, log

BATCH = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spool", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=-1)
    a = p.parse_args()
    tracker = RanklogTracker(a.spool, run_name="acc")
    accelerator = Accelerator(cpu=True, log_with=[tracker])  # cpu=True: gloo, not 2 x rank 0
    accelerator.init_trackers("acc", config={"lr": 0.05, "batch": BATCH, "hub_token": "SECRET"})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    for step in range(a.steps):
        if step == a.crash_at and rank == a.crash_rank:
            print(f"rank {rank}: crashing at step {step}", flush=True)
            time.sleep(1.0)  # the other process reaches the next collective, as in a real crash
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        log(accelerator, {"train/loss": loss.item(), "train/rank": float(rank)}, step=step)
        log(accelerator, {"train/samples": BATCH}, step=step,
            log_kwargs={"ranklog": {"reduce": "sum"}})  # fmt: skip
    accelerator.end_training()
    print(f"rank {rank}: done at step {a.steps}", flush=True)


if __name__ == "__main__":
    main()
