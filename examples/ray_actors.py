#!/usr/bin/env python3
"""Ray actors as training workers, each a ranklog rank; then the spool shipped with ``--ray``.

    python examples/ray_actors.py --spool /nfs/runs/exp1 --ranks 8 --steps 200
    python examples/ray_actors.py --address 127.0.0.1:6379 --spool /tmp/rl --ship

Each actor calls ``ranklog.ray.init`` with its rank: it logs under its node's IP, and
one process per node samples the GPUs (``gpu="auto"``: NVML, else the node's Ray
metrics; nothing where there is neither). With ``--ship`` the driver then runs
``ranklog ship SPOOL --ray ADDRESS --to jsonl:SPOOL/metrics.jsonl`` on the same cluster.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

import ray

import ranklog.ray


class Trainer:
    """One training worker: a toy loss, a step timer and a throughput per step."""

    def __init__(self, spool: str, rank: int, world_size: int) -> None:
        self.rank = rank
        self.run = ranklog.ray.init(spool, rank=rank, world_size=world_size, gpu="auto")

    def train(self, steps: int, step_seconds: float) -> int:
        for step in range(steps):
            with self.run.timer("step", step):
                time.sleep(step_seconds)
                loss = math.exp(-step / 50) + 0.01 * self.rank
            self.run.log_metrics({"loss": loss, "tokens_per_s": 1000.0 + self.rank}, step=step,
                                 prefix="train", reduce={"tokens_per_s": "sum"})  # fmt: skip
            self.run.step_end(step)
        return steps

    def close(self) -> None:
        self.run.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, or a local one)")
    parser.add_argument("--spool", required=True, help="the spool (shared by every node)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.01)
    parser.add_argument("--ship", action="store_true", help="then ship with --ray to JSONL")
    args = parser.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    actor: Any = ray.remote(num_cpus=0)(Trainer)
    spool = os.path.abspath(args.spool)
    trainers = [actor.remote(spool, r, args.ranks) for r in range(args.ranks)]
    ray.get([t.train.remote(args.steps, args.step_seconds) for t in trainers])
    ray.get([t.close.remote() for t in trainers])
    print(f"{args.ranks} ranks x {args.steps} steps logged to {spool}")
    try:
        if args.ship:  # while this driver holds the cluster: a local Ray ends with it
            out = os.path.join(spool, "metrics.jsonl")
            cmd = [sys.executable, "-m", "ranklog.cli", "ship", spool, "--ray", address,
                   "--to", f"jsonl:{out}", "--quiet", "--once"]  # fmt: skip
            subprocess.run(cmd, check=True, timeout=600)
            print(f"shipped with --ray: {out}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
