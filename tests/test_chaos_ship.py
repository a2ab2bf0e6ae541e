"""Chaos: shippers SIGKILLed and restarted again and again while 8 ranks write."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import python_env
from .shiphelp import lines

RANKS = 8
STEPS = 500

PRODUCER = """
import sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
for step in range(int(sys.argv[4])):
    run.log_metrics({"loss": run.rank + step / 1000, "acc": 0.5}, step=step, prefix="train")
    run.log_timing("step_time", 0.01 * (run.rank + 1), step=step)
    run.step_end(step)
    if step % 10 == 9:  # late: logged for a step this rank has closed
        run.log_metrics({"acc": 0.75}, step=step, prefix="val")
    time.sleep(0.02)
run.close()
"""


def _shipper(spool: Path, out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{out}"]
    cmd += ["--quiet", "--dead-after", "120", "--start-grace", "120", "--poll", "0.05"]
    cmd += ["--late", "ship"]
    return subprocess.Popen(cmd, env=python_env(), stderr=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7])
def test_shipper_killed_twenty_times(spool: Path, tmp_path: Path, seed: int) -> None:
    """Every step and every late value reach the JSONL exactly once, with the oracle's values."""
    rng = random.Random(seed)
    out = tmp_path / "out.jsonl"
    producers = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, str(spool), str(r), str(RANKS), str(STEPS)],
            env=python_env(),
        )
        for r in range(RANKS)
    ]
    kills = 0
    try:
        while kills < 20 or any(p.poll() is None for p in producers):
            proc = _shipper(spool, out)
            time.sleep(rng.uniform(0.2, 0.7))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
    finally:
        for p in producers:
            assert p.wait(timeout=120) == 0
    final = _shipper(spool, out)
    assert final.wait(timeout=120) == 0  # follows until every rank ended, then exits
    got = [x for x in lines(out) if "shipped_with" not in x]
    late = [x for x in lines(out) if "shipped_with" in x]
    assert [x["step"] for x in got] == list(range(STEPS)), f"after {kills} kills"
    assert [(x["step"], x["shipped_with"]) for x in late] == [
        (s, s + 1) for s in range(9, STEPS, 10)
    ], f"after {kills} kills"
    assert all(x["metrics"] == {"val/acc": 0.75} and x["ranks"] == RANKS for x in late)
    for x in got:
        assert x["complete"] and x["ranks"] == RANKS
        assert x["metrics"]["train/loss"] == pytest.approx((RANKS - 1) / 2 + x["step"] / 1000)
        assert x["metrics"]["timing/step_time"] == pytest.approx(0.01 * RANKS)
        assert x["metrics"]["timing/step_time/slowest_rank"] == RANKS - 1
    assert kills >= 20
