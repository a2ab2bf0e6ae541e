"""``ranklog inspect`` says each rank's state as a shipper decides it.

How it could lie, and what each test tries: a rank SIGKILLed on this host showed
``open`` minutes later while its pid was gone and the shipper had shipped its steps as
partial (MLflow: FAILED). Now: its process gone, it is ``dead`` (with its last closed
step) until a shipper's ``--dead-after`` of silence releases it, then ``crashed``; a
live rank stays ``open``; a rank of another host (no pid to look at) is ``open`` until
silent for ``--dead-after``, then ``crashed``; ``--json`` says the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import ranklog

from .conftest import python_env, run_python

KILLED = (
    "import os, signal, sys, ranklog\n"
    "run = ranklog.init(sys.argv[1], rank=0, world_size=2, handle_signals=False)\n"
    "for s in range(5):\n"
    "    run.log_metrics({'loss': 1.0}, step=s)\n"
    "    run.step_end(s)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def _inspect(spool: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", "inspect", str(spool), *extra],
        env=python_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _states(spool: Path, *extra: str) -> dict[int, str]:
    res = _inspect(spool, "--json", *extra)
    assert res.returncode == 0, res.stderr
    return {i["rank"]: i["state"] for i in json.loads(res.stdout)["incarnations"]}


def test_a_killed_rank_is_dead_then_crashed_and_a_live_one_open(tmp_path: Path) -> None:
    """Rank 0 SIGKILLed at step 4 on this host: ``dead`` (closed 4) while a shipper still
    waits, ``crashed`` once silent past --dead-after; rank 1, alive here, ``open``."""
    spool = tmp_path / "spool"
    proc = run_python(KILLED, str(spool))
    assert proc.returncode == -9, proc.stderr
    live = ranklog.init(spool, rank=1, world_size=2, handle_signals=False)
    live.log_metrics({"loss": 1.0}, step=0)
    live.flush()
    states = _states(spool)
    assert states[0].startswith("dead (process gone") and "closed 4" in states[0], states
    assert states[1] == "open"
    time.sleep(1.5)
    live.log_metrics({"loss": 1.0}, step=1)
    live.flush()
    states = _states(spool, "--dead-after", "1")
    assert states[0].startswith("crashed (process gone, silent") and "closed 4" in states[0]
    assert states[1] == "open"
    table = _inspect(spool, "--dead-after", "1").stdout
    assert "crashed (process gone" in table and " open" in table
    live.close()


def test_a_rank_of_another_host_is_open_until_silent(tmp_path: Path) -> None:
    """No pid to look at (another host): ``open`` until silent past --dead-after."""
    spool = tmp_path / "spool"
    run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
    run.log_metrics({"loss": 1.0}, step=0)
    run.step_end(0)
    run.flush()
    from ranklog.spool._inspect import summarize

    (inc,) = summarize(spool).incarnations
    inc.process_gone = None  # as for a process of another host
    assert inc.state == "open"
    inc.silent = 200.0
    assert inc.state.startswith("crashed (silent 200s") and "closed 0" in inc.state
    run.close()
