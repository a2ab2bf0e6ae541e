"""``ranklog demo``: a short multi-process job on this machine, then a look at its spool.

Each rank is a separate process launched the way torchrun launches workers
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in its environment), logging
synthetic training metrics, timers, hyperparameters and validation samples.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["rank_main", "run_demo"]


def rank_main(spool: str, steps: int, step_seconds: float) -> None:
    """Body of one demo rank (run in its own process)."""
    import ranklog

    run = ranklog.init(spool)
    rng = random.Random(run.rank)
    run.log_hyperparams(
        {
            "model": {"name": "tiny-gpt", "layers": 4, "hidden": 256},
            "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
            "wandb": {"api_key": "not-a-real-key"},
            "steps": steps,
        }
    )
    straggler = run.world_size is not None and run.rank == run.world_size - 1
    slow = 1.5 if straggler else 1.0
    for step in range(steps):
        with run.timer("step_time", step=step):
            with run.timer("data_wait", step=step):
                time.sleep(step_seconds * 0.1 * rng.random())
            time.sleep(step_seconds * slow * (0.8 + 0.4 * rng.random()))
        loss = 2.5 * math.exp(-step / (steps / 3)) + 0.05 * rng.gauss(0, 1) + 0.01 * run.rank
        run.log_metrics(
            {"loss": loss, "acc": 1 - loss / 3, "lr": 3e-4 * min(1.0, (step + 1) / 20)},
            step=step,
            prefix="train",
        )
        run.log_metrics(
            {"tokens": 4096.0, "grad_norm": abs(rng.gauss(1.0, 0.3))},
            step=step,
            prefix="train",
            reduce=("sum", "max"),
        )
        if step % 50 == 49:
            run.log_text(
                "val/sample_0",
                f"**prompt**: what is {step} + {run.rank}?\n\n**answer**: {step + run.rank}",
                step=step,
            )
        run.step_end(step)
    run.close()


def run_demo(spool: Path, *, ranks: int = 4, steps: int = 300, step_seconds: float = 0.01) -> int:
    """Launch ``ranks`` processes into ``spool`` with live shippers, then inspect the spool.

    Returns the exit code: 0 when every rank and every shipper succeeded.
    """
    out = spool.parent
    spool.mkdir(parents=True, exist_ok=True)
    print(f"demo: {ranks} ranks x {steps} steps into {spool}", flush=True)
    every = max(1, steps // 6)
    shipper = subprocess.Popen(
        [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--quiet", "--samples", "1",
         "--to", f"jsonl:{out / 'metrics.jsonl'}", "--to", f"console:{every}"]
    )  # fmt: skip
    procs = []
    t0 = time.monotonic()
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r))
        code = (
            "import sys; from ranklog._demo import rank_main; "
            "rank_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(spool), str(steps), str(step_seconds)], env=env
            )
        )
    codes = [p.wait() for p in procs]
    print(f"demo: ranks exited with {codes} after {time.monotonic() - t0:.1f}s", flush=True)
    shipped = shipper.wait()
    print(f"demo: shippers exited with {shipped}; reduced steps in {out / 'metrics.jsonl'}\n")
    _inspect(spool)
    return 0 if not any(codes) and shipped == 0 else 1


def _inspect(spool: Path) -> None:
    from ranklog.cli import main

    main(["inspect", str(spool)])
