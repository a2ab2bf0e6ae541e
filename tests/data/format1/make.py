"""Write tests/data/format1: a spool of segment format 1 (every metrics event a map of
names to values), its dataset, and what shipping it gave.

Run with the last release that wrote format 1 on ``PYTHONPATH`` (commit 031381c, schema 6)
and ``RANKLOG_CODE=0``, from outside the directory (it is made anew)::

    python make.py /tmp/format1   # then copy spool/ and dataset/ here

then ``ranklog ship SPOOL --to jsonl:expected.jsonl --once`` with it gave ``expected.jsonl``
(its replay of the dataset gave the same bytes). Each rank rolls over to a second segment
(segments of 4 KiB); rank 1 logs names only it has, and a per-name reduce map.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import ranklog


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for rank in (0, 1, 2):
        r = ranklog.init(out / "spool", rank=rank, world_size=3, name="format1",
                         handle_signals=False, max_segment_bytes=4096)  # fmt: skip
        if rank == 0:
            r.log_hyperparams({"optim": {"lr": 3e-4}, "seed": 7})
        for step in range(12):
            names = {f"layer_{i:02d}/grad_norm_mean": (i + 1) * 0.01 * (step + 1) + rank
                     for i in range(6)}  # fmt: skip
            r.log_metrics(names, step=step, prefix="train")
            r.log_metrics({"loss": 1.0 / (step + 1) + rank, "acc": 0.5 + 0.01 * step},
                          step=step, reduce=("mean", "max"))  # fmt: skip
            if rank == 1:
                r.log_metrics({"only_one": -0.0, "tokens": 100.0 * step}, step=step,
                              reduce={"tokens": "sum"})  # fmt: skip
            r.log_timing("step_time", 0.1 * (rank + 1), step=step)
            r.step_end(step)
        r.close()
    subprocess.run([sys.executable, "-m", "ranklog.cli", "compact", str(out / "spool"), "--out",
                    str(out / "dataset")], check=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
