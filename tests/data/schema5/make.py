"""Write tests/data/schema5: a spool and its dataset, as the release before schema 6 wrote them.

Run with that release on ``PYTHONPATH`` (commit 584913f) and ``RANKLOG_CODE=0``::

    python tests/data/schema5/make.py tests/data/schema5

then ``ranklog ship SPOOL --to jsonl:expected.jsonl --once`` with it gave ``expected.jsonl``
(its replay of the dataset gave the same bytes).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import ranklog

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for rank in (0, 1):
        r = ranklog.init(out / "spool", rank=rank, world_size=2, name="schema5",
                         handle_signals=False)  # fmt: skip
        if rank == 0:
            r.log_hyperparams({"optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "seed": 7,
                               "name": "gpt"})  # fmt: skip
        for step in range(3):
            r.log_metrics({"loss": 1.0 / (step + 1) + rank, "acc": 0.5 + 0.1 * step}, step=step,
                          prefix="train", reduce=("mean", "max"))  # fmt: skip
            r.log_timing("step_time", 0.1 * (rank + 1), step=step)
            r.log_text("val/sample", f"rank {rank} step {step}", step=step)
            r.log_histogram("grad", [0.1 * step, -0.2, 0.3 * rank], step=step)
            if rank == 0:
                r.log_image("plot", PNG, step=step)
                r.log_table("val/table", ["q", "score"], [["a", step], ["b", 0.5]], step=step)
            r.step_end(step)
        r.close()
    subprocess.run([sys.executable, "-m", "ranklog.cli", "compact", str(out / "spool"), "--out",
                    str(out / "dataset")], check=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
