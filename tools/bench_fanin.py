#!/usr/bin/env python3
"""Fan-in throughput: ``ranklog ship --ray`` with 1 and 2 reader actors vs one shipper process.

Writes a closed spool (RANKS x STEPS x 20 values, the shipper benchmark's spool) and
ships it with ``--once`` to JSONL, on a local Ray head this script starts (127.0.0.1,
``--cpus`` CPUs), modes interleaved over ``--repeat`` rounds; every output is checked
(every step complete and correctly reduced) and must equal the single shipper's
bytes. Wall time is the whole command: Python start, connecting to Ray and starting
the actors included; the fixed part is measured on a 1-step spool and subtracted
for the "shipping" rate. Medians over rounds.

    .venv/bin/python tools/bench_fanin.py                  # 64 ranks x 1,000 steps
    .venv/bin/python tools/bench_fanin.py --ranks 256 --steps 500 --cpus 4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import METRICS, check_jsonl, write_spool
from _ray_head import RayHeadProcess, ray_env

MODES = [("one process", []), ("--ray, 1 reader", ["1"]), ("--ray, 2 readers", ["2"])]


def _ship(spool: Path, out: Path, mode: list[str], address: str, name: str) -> float:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}",
           "--quiet", "--once", "--name", name]  # fmt: skip
    if mode:
        cmd += ["--ray", address, "--readers", mode[0]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return wall


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray head")
    args = parser.parse_args(argv)
    values = args.ranks * args.steps * METRICS
    head = RayHeadProcess(num_cpus=args.cpus)
    head.start()
    walls: dict[str, list[float]] = {m: [] for m, _ in MODES}
    fixed: dict[str, list[float]] = {m: [] for m, _ in MODES}
    problems: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="fanin-") as tmp:
            spool, tiny = Path(tmp) / "spool", Path(tmp) / "tiny"
            write_spool(spool, args.ranks, args.steps)
            write_spool(tiny, args.ranks, 1)
            reference = b""
            for round_ in range(args.repeat):
                order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
                for label, mode in order:
                    tag = f"r{round_}-{len(walls[label])}-{mode[0] if mode else 'one'}"
                    out = Path(tmp) / f"{tag}.jsonl"
                    walls[label].append(_ship(spool, out, mode, head.address, tag))
                    fixed[label].append(_ship(tiny, Path(tmp) / f"t{tag}.jsonl", mode,
                                              head.address, tag))  # fmt: skip
                    problem = check_jsonl(out, args.ranks, args.steps)
                    data = out.read_bytes()
                    if not reference and not mode:
                        reference = data
                    if problem:
                        problems.append(f"{label}: {problem}")
                    elif reference and data != reference:
                        problems.append(f"{label}: output differs from one process")
                    out.unlink()
    finally:
        head.stop()
    print("# ranklog ship: fan-in on Ray vs one shipper process\n")
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs"
    print(f"- machine: {machine}, Python {platform.python_version()}; "
          f"local Ray head with {args.cpus} CPUs (127.0.0.1)")  # fmt: skip
    print(f"- spool: {args.ranks} ranks x {args.steps:,} steps x {METRICS} values = "
          f"{values / 1e6:.2f} M values, closed; `ship --once` to JSONL; "
          f"{args.repeat} interleaved rounds, medians")  # fmt: skip
    print(
        "- wall: the whole command; fixed: the same on a 1-step spool (start, Ray "
        "connection, actors); shipping rate: values / (wall - fixed)\n"
    )
    print("| mode | wall s | fixed s | values/s (wall) | values/s (shipping) | vs one process |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for label, _ in MODES:
        wall, fix = statistics.median(walls[label]), statistics.median(fixed[label])
        rate = values / max(wall - fix, 1e-9)
        base = base or rate
        print(f"| {label} | {wall:.2f} | {fix:.2f} | {values / wall / 1e6:.2f} M | "
              f"{rate / 1e6:.2f} M | {rate / base:.2f}x |")  # fmt: skip
    print()
    if problems:
        for p in problems:
            print(f"- FAILED: {p}")
        return 1
    print("- every output complete, correctly reduced, and byte-equal to one process's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
