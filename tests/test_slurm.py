"""ranklog under a real SLURM: a 4-rank job requeued mid-run, and one cancelled.

The cluster comes from ``tests/slurm_cluster.py`` (installed and started by the fixture);
the job is ``examples/slurm/job.sbatch`` as users would submit it: ``examples/ddp_train.py``
(torch DDP, gloo) in every task, a shipper as a background job step, compaction at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ranklog.schemas import Metrics, RankEnd, StepEnd, Timer
from ranklog.testing import events_by_incarnation

from .conftest import ROOT
from .slurm_cluster import SlurmCluster, slurm_cluster

__all__ = ["slurm_cluster"]  # the fixture, imported so that pytest finds it here

pytestmark = pytest.mark.slow

JOB = ROOT / "examples" / "slurm" / "job.sbatch"
TRAIN = ROOT / "examples" / "ddp_train.py"
RANKS = 4
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@dataclass
class Job:
    """A submitted job.sbatch and where it keeps its run."""

    cluster: SlurmCluster
    job_id: int
    run_dir: Path

    @property
    def spool(self) -> Path:
        return self.run_dir / "spool"

    @property
    def output(self) -> str:
        path = self.run_dir / "job.out"
        return path.read_text(errors="replace") if path.exists() else "(no job output)"

    def closed(self) -> dict[int, int]:
        """Per rank, the highest step any of its incarnations closed so far."""
        out: dict[int, int] = {}
        if not (self.spool / "ranks").is_dir():
            return out
        for (rank, _inc), events in events_by_incarnation(self.spool, writer_gone=False).items():
            for ev in events:
                if isinstance(ev, StepEnd):
                    out[rank] = max(out.get(rank, -1), ev.step)
        return out

    def wait_closed(self, step: int, timeout: float = 180) -> dict[int, int]:
        """Wait until every rank closed ``step``; the closed steps then."""
        deadline = time.monotonic() + timeout
        closed: dict[int, int] = {}
        while time.monotonic() < deadline:
            closed = self.closed()
            if len(closed) == RANKS and min(closed.values()) >= step:
                return closed
            if self.cluster.job(self.job_id).get("JobState") in DONE:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"ranks never all closed step {step}: {closed}\n{self.output}\n"
            + self.cluster.log_tails()
        )

    def finish(self, timeout: float = 180) -> dict[str, str]:
        """Wait for the job to end; its ``scontrol show job`` fields."""
        try:
            return self.cluster.wait_job(self.job_id, DONE, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- job output\n{self.output}") from None


@pytest.fixture(scope="module")
def cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The SLURM cluster, once the training example and torch are known to be there."""
    missing = []
    if not TRAIN.is_file():
        missing.append(str(TRAIN))
    if importlib.util.find_spec("torch") is None:
        missing.append("torch (./tools/test installs it)")
    if missing:
        msg = f"the SLURM tests need {' and '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return slurm_cluster


def submit(
    cluster: SlurmCluster,
    run_dir: Path,
    *,
    steps: int,
    ckpt_every: int,
    ship_to: str,
) -> Job:
    """``sbatch --requeue`` job.sbatch with 4 tasks, everything under ``run_dir``."""
    run_dir.mkdir(parents=True)
    env = cluster.env(
        RUN_DIR=str(run_dir),
        SHIP_TO=ship_to,
        SHIP_POLL="1",
        TRAIN=str(TRAIN),
        STEPS=str(steps),
        CKPT_EVERY=str(ckpt_every),
        PYTHON=sys.executable,
    )
    job_id = cluster.sbatch(
        JOB,
        "--requeue",
        f"--ntasks={RANKS}",
        "--nodes=1",
        f"--output={run_dir / 'job.out'}",
        f"--chdir={run_dir}",
        env=env,
    )
    return Job(cluster, job_id, run_dir)


def ship_once(spool: Path, *targets: str, name: str | None = None) -> str:
    """``ranklog ship SPOOL --to ... --once --dead-after 1``; its stderr."""
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--once", "--quiet"]
    cmd += ["--dead-after", "1"]
    for t in targets:
        cmd += ["--to", t]
    if name is not None:
        cmd += ["--name", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stderr


def jsonl_steps(path: Path) -> list[dict[str, Any]]:
    """The step lines of a JSONL target, in file order."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [d for d in lines if "step" in d]


def step_times(spool: Path) -> dict[tuple[int, int, int], float]:
    """``step_time`` of every (rank, incarnation, step) an incarnation logged and closed."""
    out: dict[tuple[int, int, int], float] = {}
    for (rank, inc), events in events_by_incarnation(spool).items():
        closed = {e.step for e in events if isinstance(e, StepEnd)}
        for e in events:
            if isinstance(e, Timer) and e.name == "step_time" and e.step in closed:
                out[rank, inc, e.step] = e.seconds
    return out


class TestRequeue:
    """``scontrol requeue`` of a running 4-rank job: it runs again and resumes."""

    STEPS = 600
    CKPT_EVERY = 250

    @pytest.fixture(scope="class")
    @classmethod
    def job(cls, cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Job:
        run_dir = tmp_path_factory.mktemp("requeue") / "run"
        job = submit(
            cluster,
            run_dir,
            steps=cls.STEPS,
            ckpt_every=cls.CKPT_EVERY,
            ship_to=f"jsonl:{run_dir / 'live.jsonl'}",
        )
        # every rank past the checkpoint of step 250, long before the next one at 500
        job.wait_closed(cls.CKPT_EVERY + 10)
        cluster.run("scontrol", "requeue", str(job.job_id))
        info = job.finish()
        assert info["JobState"] == "COMPLETED", f"{info}\n{job.output}"
        assert info.get("Restarts") == "1", info
        return job

    def test_two_incarnations_per_rank(self, job: Job) -> None:
        """Every rank wrote two incarnations, the first ended by SIGTERM, the second ok."""
        incs = events_by_incarnation(job.spool)
        assert sorted(incs) == [(r, i) for r in range(RANKS) for i in (1, 2)]
        for (rank, inc), events in incs.items():
            ends = [e for e in events if isinstance(e, RankEnd)]
            assert [e.status for e in ends] == (["signal"] if inc == 1 else ["ok"]), (rank, inc)
        out = subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "inspect", str(job.spool), "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        listed = json.loads(out.stdout)["incarnations"]
        assert sorted((i["rank"], i["incarnation"]) for i in listed) == sorted(incs)

    def test_restart_count_set_after_requeue(self, job: Job) -> None:
        """The requeued batch script saw SLURM_RESTART_COUNT=1 (the first run had none: 0)."""
        counts = [
            line.split("restart_count=")[1].split()[0]
            for line in job.output.splitlines()
            if line.startswith("ranklog-job: job=")
        ]
        assert counts == ["0", "1"], job.output

    def test_every_step_shipped_once(self, job: Job) -> None:
        """``ship --once`` after the job ships every step exactly once, complete, and so
        did the shipper that ran inside the job across the requeue."""
        ship_once(job.spool, f"jsonl:{job.run_dir / 'after.jsonl'}", name="after")
        after = jsonl_steps(job.run_dir / "after.jsonl")
        assert [d["step"] for d in after] == list(range(self.STEPS))
        assert all(d["complete"] and d["ranks"] == RANKS for d in after)
        live = jsonl_steps(job.run_dir / "live.jsonl")
        assert [d["step"] for d in live] == list(range(self.STEPS)), job.output

    def test_relogged_steps_keep_first_values(self, job: Job) -> None:
        """Steps logged again after the resume keep the first incarnation's values and are
        counted as re-logged in the cursor and in ``ranklog inspect``."""
        ship_once(job.spool, f"jsonl:{job.run_dir / 'relogged.jsonl'}", name="relogged")
        shipped = {d["step"]: d["metrics"] for d in jsonl_steps(job.run_dir / "relogged.jsonl")}
        relogged = relogged_steps(job.spool)
        assert relogged, "no rank logged a step again after the resume"
        times = step_times(job.spool)
        # re-logged timings differ from the first ones, so the check below tells them apart
        assert any(times[r, 1, s] != times[r, 2, s] for r, s in relogged)
        for step in range(self.STEPS):
            # per rank, the incarnation that closed the step first counts
            first = [times.get((r, 1, step), times.get((r, 2, step), -1.0)) for r in range(RANKS)]
            assert shipped[step]["timing/step_time"] == max(first), step
        cursor = json.loads((job.spool / "cursors" / "relogged.json").read_text())
        assert cursor["relogged_events"] > 0
        text = subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "inspect", str(job.spool)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"re-logged {cursor['relogged_events']}" in text, text

    def test_parquet_keeps_both_incarnations(self, job: Job) -> None:
        """The job's compaction kept both incarnations' rows of a re-logged step."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        assert "ranklog-job: compacted into" in job.output, job.output
        rank, step = min(relogged_steps(job.spool))
        table = pq.read_table(job.run_dir / "parquet" / "metrics")
        rows = table.filter(
            pc.and_(
                pc.and_(pc.equal(table["rank"], rank), pc.equal(table["step"], step)),
                pc.equal(table["name"], "train/loss"),
            )
        )
        assert sorted(rows["incarnation"].to_pylist()) == [1, 2]


def relogged_steps(spool: Path) -> set[tuple[int, int]]:
    """(rank, step) pairs a second incarnation logged after the first had closed them."""
    out: set[tuple[int, int]] = set()
    incs = events_by_incarnation(spool)
    for rank in range(RANKS):
        first = {e.step for e in incs[rank, 1] if isinstance(e, StepEnd)}
        again = {e.step for e in incs.get((rank, 2), []) if isinstance(e, Metrics)}
        out |= {(rank, s) for s in first & again}
    return out


class TestScancel:
    """``scancel`` of a running 4-rank job: every rank ends, nothing it closed is lost."""

    @pytest.fixture(scope="class")
    @classmethod
    def job(cls, cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Job:
        run_dir = tmp_path_factory.mktemp("scancel") / "run"
        job = submit(
            cluster,
            run_dir,
            steps=100_000,
            ckpt_every=50,
            ship_to=f"jsonl:{run_dir / 'live.jsonl'}",
        )
        job.wait_closed(20)
        cluster.run("scancel", str(job.job_id))
        info = job.finish()
        assert info["JobState"] == "CANCELLED", f"{info}\n{job.output}"
        time.sleep(2)  # longer than --dead-after 1 for a rank that was killed silently
        ship_once(
            job.spool,
            f"jsonl:{run_dir / 'live.jsonl'}",  # carries on from the in-job shipper's cursor
            f"jsonl:{run_dir / 'after.jsonl'}",  # a fresh target
        )
        return job

    def test_every_rank_ended(self, job: Job) -> None:
        """Every rank wrote rank_end with status "signal" (SIGTERM), or is declared dead."""
        out = subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "inspect", str(job.spool), "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        summary = json.loads(out.stdout)
        incs = summary["incarnations"]
        assert sorted(i["rank"] for i in incs) == list(range(RANKS))
        after = jsonl_steps(job.run_dir / "after.jsonl")
        for inc in incs:
            if inc["end_status"] is None:  # killed before it could say so: dead, shipped past
                assert after and after[-1]["step"] >= inc["closed_step"], inc
            else:
                assert (inc["end_status"], inc["exit_code"]) == ("signal", 143), inc
        # the ranks here always get to write it: SIGTERM, then SIGKILL only after KillWait
        assert all(i["end_status"] == "signal" for i in incs), incs

    def test_every_closed_step_shipped(self, job: Job) -> None:
        """Every step a rank closed reaches both targets exactly once."""
        closed = {
            e.step
            for events in events_by_incarnation(job.spool).values()
            for e in events
            if isinstance(e, StepEnd)
        }
        assert closed
        for target in ("live.jsonl", "after.jsonl"):
            steps = [d["step"] for d in jsonl_steps(job.run_dir / target)]
            assert not [s for s, n in Counter(steps).items() if n > 1], target
            assert steps == sorted(steps), target
            assert closed <= set(steps), (target, sorted(closed - set(steps)))
