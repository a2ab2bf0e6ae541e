"""A small real DDP training job that logs every rank through ranklog, checkpoints and resumes.

A 2-layer MLP learns a synthetic 4-class problem (fixed seed) with
``torch.nn.parallel.DistributedDataParallel`` on the CPU (gloo backend).

Run it with torchrun::

    torchrun --nproc_per_node 4 examples/ddp_train.py --spool /tmp/exp/spool \\
        --ckpt /tmp/exp/ckpt --steps 60

or with SLURM, one task per rank (no torchrun: the process group is built from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, ``MASTER_ADDR`` (default 127.0.0.1; set
it to the first node of the job on several nodes) and ``--master-port`` or ``$MASTER_PORT``)::

    srun --ntasks 4 python examples/ddp_train.py --spool ... --ckpt ... --master-port 29511

Without a launcher it runs as a single process (rank 0 of 1).

How ranklog is used: every rank calls ``ranklog.init(spool)`` (rank and world size come from
torchrun's or SLURM's variables), logs its *own* values each step -- train loss, accuracy,
learning rate, grad norm, the ``step_time`` and ``data_wait`` timers, validation metrics and a
few validation samples as text every ``--val-every`` steps, the hyperparameters once -- and
calls ``run.step_end(step)``. Nothing is reduced or gathered in the training loop: a shipper,
in another process, reduces each step across ranks and forwards it exactly once::

    ranklog ship /tmp/exp/spool --to jsonl:metrics.jsonl --to tensorboard:tb --per-rank
    ranklog compact /tmp/exp/spool --out /tmp/exp/parquet

Restarts: the job checkpoints every ``--ckpt-every`` steps (rank 0 writes ``DIR/last.pt``
atomically, every rank waits at a barrier) and resumes from it when started again with the
same arguments (a plain restart or a SLURM requeue). The restarted ranks write a new ranklog
*incarnation* in the same spool; the steps they log again (those between the checkpoint and
the crash) are counted by the shipper as re-logged and never shipped twice. The batches are a
function of the step alone, so a resumed run computes what the lost one did.

``--crash-at STEP`` makes rank ``--crash-rank`` exit abruptly at that step, before
``step_end``: for testing kills and restarts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ranklog

FEATURES, HIDDEN, CLASSES = 16, 32, 4
TRAIN_SIZE, VAL_SIZE = 4096, 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spool", required=True, help="ranklog spool directory (shared by all ranks)")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (shared by all ranks)")
    p.add_argument("--steps", type=int, default=60, help="total training steps")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--val-every", type=int, default=10, help="validate every N steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-grad-norm", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port without torchrun (default: $MASTER_PORT, else 29500)",
    )
    p.add_argument(
        "--crash-at",
        type=int,
        default=None,
        metavar="STEP",
        help="testing: os._exit(1) on --crash-rank at STEP, before step_end",
    )
    p.add_argument("--crash-rank", type=int, default=1)
    return p.parse_args(argv)


# -- distributed setup -------------------------------------------------------------------


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """Join the process group (gloo); return (rank, world size)."""
    if "RANK" in os.environ:  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group("gloo")
    else:  # srun (one task per rank), or a single process without any launcher
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        world = int(os.environ.get("SLURM_NTASKS", "1"))
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = args.master_port or int(os.environ.get("MASTER_PORT", "29500"))
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
        )
    return dist.get_rank(), dist.get_world_size()


# -- data and model ------------------------------------------------------------------------


def make_dataset(seed: int) -> tuple[torch.Tensor, ...]:
    """Gaussian blobs around 4 random centres; identical on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 1.5
    n = TRAIN_SIZE + VAL_SIZE
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + torch.randn(n, FEATURES, generator=g) * 1.5
    return x[:TRAIN_SIZE], y[:TRAIN_SIZE], x[TRAIN_SIZE:], y[TRAIN_SIZE:]


def batch_for(step: int, rank: int, world: int, args: argparse.Namespace) -> torch.Tensor:
    """This rank's sample indices for ``step``: a function of the step alone, so a resumed
    run sees the same batches as the run it replaces."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    order = torch.randperm(TRAIN_SIZE, generator=g)
    return order[rank * args.batch_size : (rank + 1) * args.batch_size]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


# -- checkpoints ---------------------------------------------------------------------------


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file, fsync, rename, fsync the dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


# -- training --------------------------------------------------------------------------------


@torch.no_grad()
def validate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int
) -> tuple[float, float, str]:
    """This rank's shard of the validation set: (loss, accuracy, a few samples as text)."""
    model.eval()
    xs, ys = x[rank::world], y[rank::world]
    logits = model(xs)
    probs = logits.softmax(dim=1)
    pred = probs.argmax(dim=1)
    lines = [
        f"sample {i * world + rank}: label {int(ys[i])}, predicted {int(pred[i])} "
        f"(p={float(probs[i, pred[i]]):.2f})"
        for i in range(3)
    ]
    loss = F.cross_entropy(logits, ys).item()
    acc = (pred == ys).float().mean().item()
    return loss, acc, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args)
    ckpt_path = Path(args.ckpt) / "last.pt"

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    start = 0
    state = load_checkpoint(ckpt_path)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = int(state["next_step"])
    ddp = DDP(model)
    x_train, y_train, x_val, y_val = make_dataset(args.seed)

    # Every rank logs into the same spool; a restart writes a new incarnation there.
    with ranklog.init(args.spool) as run:
        run.log_hyperparams(
            {
                "model": {"features": FEATURES, "hidden": HIDDEN, "classes": CLASSES},
                "optim": {"name": "sgd", "lr": args.lr, "momentum": 0.9, "schedule": "cosine"},
                "batch_size": args.batch_size,
                "world_size": world,
                "steps": args.steps,
                "seed": args.seed,
            }
        )
        if rank == 0:
            print(
                f"rank 0: world {world}, starting at step {start}, ranklog incarnation "
                f"{run.incarnation}",
                flush=True,
            )
        for step in range(start, args.steps):
            with run.timer("step_time", step=step):
                t0 = time.perf_counter()
                idx = batch_for(step, rank, world, args)
                xb, yb = x_train[idx], y_train[idx]
                run.log_timing("data_wait", time.perf_counter() - t0, step=step)

                ddp.train()
                logits = ddp(xb)
                loss = F.cross_entropy(logits, yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages the gradients across ranks here
                grad_norm = nn.utils.clip_grad_norm_(ddp.parameters(), args.max_grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()

            # This rank's own values; the shipper reduces them (mean unless told otherwise).
            acc = (logits.argmax(dim=1) == yb).float().mean()
            run.log_metrics(
                {"loss": loss.detach(), "acc": acc, "lr": lr, "grad_norm": grad_norm},
                step=step,
                prefix="train",
            )
            run.log_metrics({"samples": len(idx)}, step=step, prefix="train", reduce="sum")

            if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
                val_loss, val_acc, samples = validate(model, x_val, y_val, rank, world)
                run.log_metrics({"loss": val_loss, "acc": val_acc}, step=step, prefix="val")
                run.log_text("val/samples", samples, step=step)
                if rank == 0:
                    print(
                        f"step {step}: train loss {loss.item():.4f} val acc {val_acc:.3f}",
                        flush=True,
                    )

            if step == args.crash_at and rank == args.crash_rank:
                print(f"rank {rank}: crashing at step {step} (--crash-at)", flush=True)
                os._exit(1)  # no rank_end, no close: as a SIGKILL or a node loss would
            run.step_end(step)  # this rank is done with the step: shippers may reduce it

            if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
                if rank == 0:
                    save_checkpoint(
                        ckpt_path,
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "next_step": step + 1,
                        },
                    )
                dist.barrier()  # nobody runs ahead of a checkpoint being written
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
