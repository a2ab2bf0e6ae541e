"""Check the NVML GPU sampler on a machine with an NVIDIA GPU (a script, not a test).

    .venv/bin/pip install 'ranklog[gpu]' torch   # a CUDA build of torch
    .venv/bin/python tools/gpu_check.py [--seconds 20] [--interval 1]

It runs a producer with ``gpu="nvml"`` for ``--seconds`` while a background thread keeps
the first GPU busy with matrix multiplications (torch), compacts the spool, and prints the
``gpu`` table's utilisation column per GPU over time. The loaded GPU must show the load
(the script exits 1 if its median utilisation stays under 30 %). CI has no GPU: everything
else about GPU sampling is tested without one (tests/test_gpu.py, a fake pynvml).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def _load(stop: threading.Event) -> None:
    """Matrix multiplications on cuda:0 until ``stop`` is set."""
    import torch

    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)

    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    import ranklog
    from ranklog.archive import compact

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        spool, out = Path(tmp) / "spool", Path(tmp) / "pq"
        stop = threading.Event()
        loader = threading.Thread(target=_load, args=(stop,), daemon=True)
        run = ranklog.init(spool, rank=0, world_size=1, local_rank=0, gpu="nvml",
                           gpu_interval=args.interval)  # fmt: skip
        time.sleep(2 * args.interval)  # idle baseline
        loader.start()
        for step in range(int(args.seconds)):
            run.log_metrics({"step_seconds": 1.0}, step=step)
            run.step_end(step)
            time.sleep(1.0)
        stop.set()
        loader.join(timeout=30)
        run.close()
        compact(spool, out)
        if not (out / "gpu").is_dir():
            print("gpu-check: no gpu rows: NVML found no GPU here", file=sys.stderr)
            return 1
        table = ds.dataset(out / "gpu", format="parquet").to_table()
        table = table.sort_by([("index", "ascending"), ("ts", "ascending")])
        print(f"{'gpu':>4} {'time':>26} {'util %':>7} {'mem GiB':>8} {'name'}")
        for row in table.to_pylist():
            mem = (row["mem_used"] or 0) / 2**30
            print(f"{row['index']:>4} {row['ts']!s:>26} {row['util']!s:>7} {mem:8.1f} "
                  f"{row['gpu_name']}")  # fmt: skip
        first = table.filter(pc.equal(table["index"], 0))["util"].to_pylist()
        busy = statistics.median(u for u in first[2:] if u is not None) if len(first) > 2 else 0
        print(f"gpu-check: median utilisation of GPU 0 under load: {busy:.0f} %")
        return 0 if busy >= 30 else 1


if __name__ == "__main__":
    sys.exit(main())
