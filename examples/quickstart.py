"""The smallest useful ranklog program: one process logging a few steps.

    python examples/quickstart.py [SPOOL]
    ranklog inspect SPOOL

Launch it with ``torchrun --nproc_per_node 4 examples/quickstart.py SPOOL`` and the
four ranks write four rank directories of the same run.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile

import ranklog


def main(spool: str) -> None:
    """Log 100 steps of a fake training loop into ``spool``."""
    with ranklog.init(spool) as run:
        run.log_hyperparams({"optim": {"lr": 1e-3, "name": "adamw"}, "batch_size": 32})
        rng = random.Random(run.rank)
        for step in range(100):
            with run.timer("step_time", step=step):
                loss = math.exp(-step / 30) + 0.05 * rng.random()
            run.log_metrics({"loss": loss, "lr": 1e-3}, step=step, prefix="train")
            run.step_end(step)
    print(f"rank {run.rank} wrote incarnation {run.incarnation} to {spool}")
    print(f"see it with: ranklog inspect {spool}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ranklog-"))
