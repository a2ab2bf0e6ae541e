"""A 2-process Lightning DDP job on CPU (gloo) logging through ``RanklogLogger``.

``python examples/lightning_train.py --spool S --root R`` trains a linear model
for 20 steps (2 epochs of 10 batches per rank); Lightning's "ddp" launcher starts the
second process by running this script again. ``--crash-at K --crash-rank R``: rank R
SIGKILLs itself when training step K begins; ``--resume``: continue from the last
checkpoint (``ckpt_path="last"``, found through the logger's name and version).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ranklog.lightning import RanklogLogger

BATCH = 4
WORLD = 2
BATCHES_PER_EPOCH = 10


class Model(L.LightningModule):
    def __init__(self, lr: float, crash_at: int, crash_rank: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        if (
            self.global_step == self.hparams.crash_at
            and self.global_rank == self.hparams.crash_rank
        ):
            print(f"rank {self.global_rank}: crashing at step {self.global_step}", flush=True)
            time.sleep(1.0)  # the other rank reaches the next collective, as in a real crash
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)  # no sync_dist: every rank logs its own value
        self.log("train/rank", float(self.global_rank))
        return loss

    def validation_step(self, batch: Any, idx: int) -> None:
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spool", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    n = WORLD * BATCH * BATCHES_PER_EPOCH
    train = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
    val = TensorDataset(torch.randn(WORLD * BATCH * 2, 4), torch.randn(WORLD * BATCH * 2, 1))
    logger = RanklogLogger(a.spool, name="lit", save_dir=a.root, handle_signals=False)
    every = a.checkpoint_every
    callbacks = [ModelCheckpoint(save_last=True, every_n_train_steps=every)] if every else []
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=a.steps // BATCHES_PER_EPOCH,
        logger=logger, log_every_n_steps=1, num_sanity_val_steps=0, default_root_dir=a.root,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(every),
        callbacks=callbacks,
    )  # fmt: skip
    model = Model(lr=0.05, crash_at=a.crash_at, crash_rank=a.crash_rank)
    trainer.fit(
        model,
        DataLoader(train, batch_size=BATCH),
        DataLoader(val, batch_size=BATCH),
        ckpt_path="last" if a.resume else None,
    )
    print(f"rank {trainer.global_rank}: done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
