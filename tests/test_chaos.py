"""``tools/chaos.py``: its oracle and faults alone, then whole chaos runs with several seeds."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklog.schemas import StepEnd
from ranklog.testing import bad_ranges, events_by_incarnation

from .conftest import ROOT, python_env
from .shiphelp import rank

sys.path.insert(0, str(ROOT / "tools"))
import chaos
from _chaos_io import compare, tear_tail

CHAOS = str(ROOT / "tools" / "chaos.py")


def _check(result: chaos.ChaosResult) -> None:
    """Nothing lost, duplicated or wrong; no process failed; each planned fault happened."""
    for t in result.trials:
        assert (t.lost, t.duplicated, t.wrong, t.errors) == (0, 0, 0, []), t.details[:20]
        assert t.faults["rank_kills"] >= 1 and t.faults["torn_tails"] >= 1, t.faults
        if not any(n.startswith("disk_full skipped") for n in t.notes):
            assert t.faults["disk_full"] == 1
    assert result.ok


# -- the parts, without a job --------------------------------------------------------------


def test_oracle_keeps_the_first_closed_values(tmp_path: Path) -> None:
    """A step re-logged by a later incarnation is expected with the first closer's values."""
    job = chaos.Job(chaos.Config(ranks=2, steps=10), tmp_path, None, None)
    for r in range(2):
        for start, stop in ((0, 6), (3, 10)) if r == 0 else ((0, 10),):
            run = rank(job.spool, r, 2)
            for s in range(start, stop):
                loss, seconds = chaos.values(r, s, run.incarnation)
                run.log_metrics({"loss": loss}, step=s, prefix="train")
                run.log_timing("step_time", seconds, step=s)
                run.step_end(s)
            run.close()
    job.printed[(0, 1)] = {0, 1, 2, 3, 4, 5, 6}  # 6 "printed" but never closed by inc 1
    details: list[str] = []
    expected, lost = chaos.oracle(job, details)
    assert lost == 1 and "lost closed steps [6]" in details[0]
    assert sorted(expected) == list(range(10))
    assert expected[5]["train/loss"] == pytest.approx((0 + 5 / 1000 + 1 + 5 / 1000) / 2)
    assert expected[6]["train/loss"] == pytest.approx((0.25 + 6 / 1000 + 1 + 6 / 1000) / 2)
    assert expected[5]["timing/step_time"] == pytest.approx(0.02 + 1e-4)


def test_compare_counts_lost_duplicated_and_wrong() -> None:
    """One step missing, one twice and one off by a little are each counted once."""
    expected = {s: {"train/loss": s / 10} for s in range(5)}
    got = {"train/loss": [(0, 0.0), (1, 0.1), (1, 0.1), (3, 0.31), (4, 0.4)]}
    details: list[str] = []
    assert compare("t", got, expected, 1e-9, details) == (1, 1, 1, 0)
    assert "t: step 3 train/loss = 0.31, expected 0.3" in details
    exact = {"train/loss": [(s, s / 10) for s in range(5)]}
    assert compare("t", exact, expected, 1e-9, []) == (0, 0, 0, 0)


def test_torn_tails_lose_nothing(tmp_path: Path) -> None:
    """Every kind of torn tail on a SIGKILLed rank's segment leaves its closed steps intact."""
    spool = tmp_path / "spool"
    cmd = [sys.executable, CHAOS, "--_rank", str(spool), "0", "1", "0", "100000", "0.001"]
    proc = subprocess.Popen(cmd, env=python_env(), stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    printed = [int(x) for x in proc.communicate(timeout=30)[0].split()[2:]]
    before = events_by_incarnation(spool)[(0, 1)]
    assert printed, "the rank printed no step before it was killed"
    assert set(printed) <= {e.step for e in before if isinstance(e, StepEnd)}
    kinds = set()
    for seed in range(12):
        kinds.add(tear_tail(spool, 0, 1, random.Random(seed)))
        assert events_by_incarnation(spool)[(0, 1)] == before
    assert kinds == {"garbage", "zeros", "torn_frame"}
    assert bad_ranges(spool), "the torn tails are reported"


# -- whole runs ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_jsonl_and_tensorboard(tmp_path: Path, seed: int) -> None:
    """Four ranks, 200 steps, kills, torn tails and a full disk: each step once, right values."""
    cfg = chaos.Config(seed, 4, 200, targets=("jsonl", "tensorboard"), step_sleep=0.03)
    _check(chaos.run_chaos(cfg, tmp_path, log=print))


@pytest.mark.slow
def test_mlflow_server_outage(tmp_path: Path) -> None:
    """With a real MLflow server killed and restarted as well, all three targets are exact."""
    cfg = chaos.Config(4, 4, 200, targets=("jsonl", "tensorboard", "mlflow"), step_sleep=0.03)
    result = chaos.run_chaos(cfg, tmp_path, log=print)
    _check(result)
    assert result.faults["backend_outage"] == 1 and result.faults["shipper_kills"] >= 1


@pytest.mark.slow
def test_command_line(tmp_path: Path) -> None:
    """The CLI prints a line per trial and the final summary line, and exits 0."""
    cmd = [sys.executable, CHAOS, "--seed", "5", "--ranks", "2", "--steps", "60"]
    cmd += ["--trials", "2", "--targets", "jsonl", "--duration", "1.5"]
    cmd += ["--workdir", str(tmp_path)]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("chaos: trial=") for line in lines) == 2
    faults = (
        r"\{rank_kills:\d+, shipper_kills:\d+, torn_tails:\d+, disk_full:\d+, backend_outage:0\}"
    )
    final = rf"chaos: trials=2 steps=120 lost=0 duplicated=0 wrong=0 order=0 faults={faults}"
    assert re.fullmatch(final, lines[-1]), lines[-1]


@pytest.mark.slow
def test_soak_short(tmp_path: Path) -> None:
    """``--soak``: small random trials, a progress line and a final line with every count."""
    cmd = [sys.executable, CHAOS, "--soak", "--trials", "4", "--seed", "2"]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    counts = r"lost=0 duplicated=0 wrong=0 order=0 faults=\{rank_kills:\d+, shipper_kills:\d+, "
    assert re.match(rf"chaos soak: trials=4 steps=\d+ {counts}", last), last
    assert "chaos soak: 4/4 trials" in done.stdout
