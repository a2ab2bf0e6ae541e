"""A 2-process Hugging Face ``Trainer`` job on CPU (gloo) logging through ``RanklogCallback``.

``torchrun --nproc_per_node 2 examples/hf_train.py --spool S --out O`` trains a
linear model for 20 optimizer steps (2 epochs of 10 per process), evaluating after each
epoch. ``--report-to``: the callback comes from ``report_to=["ranklog"]`` (spool from
``$RANKLOG_SPOOL``) instead of ``callbacks=[...]``. ``--crash-at K --crash-rank R``:
process R SIGKILLs itself when optimizer step K + 1 begins.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from ranklog.hf import RanklogCallback

BATCH = 4
WORLD = 2
STEPS_PER_EPOCH = 10
SECRET = "hf_SECRET_TOKEN_never_logged"


class Data(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Crash(TrainerCallback):
    def __init__(self, at: int, rank: int) -> None:
        self.at, self.rank = at, rank

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and args.process_index == self.rank:
            print(f"rank {self.rank}: crashing after step {self.at}", flush=True)
            time.sleep(1.0)  # the other process reaches the next collective, as in a real crash
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spool", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report-to", action="store_true")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=-1)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, num_train_epochs=2, logging_steps=1,
        eval_strategy="epoch", save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, learning_rate=0.05, run_name="hf",
        report_to=["ranklog"] if a.report_to else "none", hub_token=SECRET,
    )  # fmt: skip
    callbacks: list[TrainerCallback] = [] if a.report_to else [RanklogCallback(a.spool)]
    if a.crash_at >= 0:
        callbacks.append(Crash(a.crash_at, a.crash_rank))
    trainer = Trainer(
        model=Net(), args=args, train_dataset=Data(WORLD * BATCH * STEPS_PER_EPOCH, 0),
        eval_dataset=Data(WORLD * BATCH * 2, 1), callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    print(f"rank {args.process_index}: done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
