"""The DDP example under the real torchrun (and as srun starts it): ship, compact, check, resume."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from ranklog.schemas import Metrics, RankStart, StepEnd, Text, Timer
from ranklog.shippers import list_cursors
from ranklog.testing import events_by_incarnation

from .conftest import ROOT, python_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) for m in ("torch", "tensorboard", "pyarrow")),
        reason="needs torch, tensorboard and pyarrow",
    ),
]

EXAMPLE = ROOT / "examples" / "ddp_train.py"
WORLD = 4
STEPS = 40
CKPT_EVERY = 10
VAL_EVERY = 10
CRASH_AT, CRASH_RANK = 25, 1  # the checkpoint before it holds next_step 20
JOB_TIMEOUT = 180.0


# -- running things -------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_cmd(
    cmd: list[str], env: dict[str, str], timeout: float = JOB_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (torchrun's
    workers included) and fail."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[:4]} ran past {timeout}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def job_args(spool: Path, ckpt: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """The example's command line after the interpreter or launcher."""
    return [
        str(EXAMPLE), "--spool", str(spool), "--ckpt", str(ckpt), "--steps", str(steps),
        "--ckpt-every", str(CKPT_EVERY), "--val-every", str(VAL_EVERY), *extra,
    ]  # fmt: skip


def torchrun(spool: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node 4 examples/ddp_train.py ...`` on a free loopback port."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        *job_args(spool, ckpt, *extra),
    ]  # fmt: skip
    return run_cmd(cmd, python_env(OMP_NUM_THREADS="1"))


def ship(spool: Path, out: Path) -> tuple[Path, Path]:
    """``ranklog ship --once`` to JSONL and per-rank TensorBoard (one process per target)."""
    jsonl, tb = out / "metrics.jsonl", out / "tb"
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"jsonl:{jsonl}",
           "--to", f"tensorboard:{tb}", "--per-rank", "--once", "--quiet"]  # fmt: skip
    res = run_cmd(cmd, python_env(), timeout=120)
    assert res.returncode == 0, res.stdout
    return jsonl, tb


def compact(spool: Path, out: Path) -> Path:
    """``ranklog compact SPOOL --out PQ``."""
    pq_dir = out / "parquet"
    cmd = [sys.executable, "-m", "ranklog.cli", "compact", str(spool), "--out", str(pq_dir)]
    res = run_cmd(cmd, python_env(), timeout=120)
    assert res.returncode == 0, res.stdout
    return pq_dir


# -- reading results ------------------------------------------------------------------------


def jsonl_steps(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [d for d in lines if "step" in d]


def tb_scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard's own reader loads the run at ``path``."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def parquet_rows(pq_dir: Path, table: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(pq_dir / table).to_pylist()


def counted_values(
    pq_dir: Path, name: str
) -> tuple[dict[tuple[int, int], list[float]], dict[tuple[int, int, int], list[float]]]:
    """Per (rank, step), the values of ``name`` that count -- the first incarnation that
    closed the step wins (or the last one that logged it, if none closed it) -- and every
    value by (rank, incarnation, step)."""
    closed: dict[tuple[int, int], int] = defaultdict(lambda: -1)
    for r in parquet_rows(pq_dir, "ranks"):
        if r["kind"] == "step_end":
            key = (r["rank"], r["incarnation"])
            closed[key] = max(closed[key], r["step"])
    logged: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for r in parquet_rows(pq_dir, "metrics"):
        if r["name"] == name:
            logged[r["rank"], r["incarnation"], r["step"]].append(r["value"])
    by_rank_step: dict[tuple[int, int], dict[int, list[float]]] = defaultdict(dict)
    for (rank, inc, step), values in logged.items():
        by_rank_step[rank, step][inc] = values
    counted = {}
    for (rank, step), incs in by_rank_step.items():
        closers = [i for i in incs if closed[rank, i] >= step]
        counted[rank, step] = incs[min(closers) if closers else max(incs)]
    return counted, logged


def oracle(counted: dict[tuple[int, int], list[float]]) -> dict[int, float]:
    """Per step: the mean over ranks of each rank's mean."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for (_rank, step), values in sorted(counted.items()):
        per_step[step].append(math.fsum(values) / len(values))
    return {step: math.fsum(means) / len(means) for step, means in per_step.items()}


# -- the jobs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted 4-rank torchrun job, shipped and compacted."""
    d = tmp_path_factory.mktemp("clean")
    spool = d / "spool"
    res = torchrun(spool, d / "ckpt")
    assert res.returncode == 0, res.stdout
    jsonl, tb = ship(spool, d)
    return {"spool": spool, "jsonl": jsonl, "tb": tb, "pq": compact(spool, d)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job whose rank 1 dies at step 25, shipped, then restarted with the same command
    (without --crash-at), shipped again and compacted."""
    d = tmp_path_factory.mktemp("resumed")
    spool, ckpt = d / "spool", d / "ckpt"
    first = torchrun(spool, ckpt, "--crash-at", str(CRASH_AT), "--crash-rank", str(CRASH_RANK))
    assert first.returncode != 0, first.stdout
    assert f"rank {CRASH_RANK}: crashing at step {CRASH_AT}" in first.stdout
    import torch

    ckpt_step = torch.load(ckpt / "last.pt", weights_only=True)["next_step"]
    jsonl, tb = ship(spool, d)
    shipped_before = [s["step"] for s in jsonl_steps(jsonl)]
    second = torchrun(spool, ckpt)
    assert second.returncode == 0, second.stdout
    ship(spool, d)
    return {
        "spool": spool, "jsonl": jsonl, "tb": tb, "pq": compact(spool, d),
        "ckpt_step": ckpt_step, "shipped_before": shipped_before, "second": second.stdout,
    }  # fmt: skip


# -- the tests --------------------------------------------------------------------------------


class TestCleanRun:
    def test_every_rank_has_every_step_in_tensorboard(self, clean: dict[str, Path]) -> None:
        """Each rank's TensorBoard sub-run holds its own train/loss at every step, as logged."""
        counted, _ = counted_values(clean["pq"], "train/loss")
        for rank in range(WORLD):
            points = tb_scalars(clean["tb"] / f"rank{rank:05d}", "train/loss")
            assert [s for s, _ in points] == list(range(STEPS))
            for step, value in points:
                assert value == pytest.approx(counted[rank, step][0], rel=1e-6)
        assert [s for s, _ in tb_scalars(clean["tb"], "train/loss")] == list(range(STEPS))

    def test_reduced_values_match_the_parquet_oracle(self, clean: dict[str, Path]) -> None:
        """The JSONL's reduced train/loss is the mean over ranks of each rank's Parquet mean."""
        steps = jsonl_steps(clean["jsonl"])
        assert [s["step"] for s in steps] == list(range(STEPS))
        assert all(s["complete"] and s["ranks"] == WORLD for s in steps)
        counted, _ = counted_values(clean["pq"], "train/loss")
        assert {(r, s) for r, s in counted} == {(r, s) for r in range(WORLD) for s in range(STEPS)}
        expected = oracle(counted)
        for s in steps:
            assert s["metrics"]["train/loss"] == pytest.approx(expected[s["step"]], rel=1e-12)
            assert s["metrics"]["train/samples"] == 32 * WORLD  # reduce="sum"
        timers = parquet_rows(clean["pq"], "timers")
        slowest: dict[int, float] = defaultdict(float)
        for t in timers:
            if t["name"] == "step_time":
                slowest[t["step"]] = max(slowest[t["step"]], t["value"])
        for s in steps:
            assert s["metrics"]["timing/step_time"] == slowest[s["step"]]
            assert "timing/data_wait" in s["metrics"]

    def test_the_job_logged_what_the_example_promises(self, clean: dict[str, Path]) -> None:
        """Every rank logged params once, its metrics, both timers and val samples every K steps."""
        by_inc = events_by_incarnation(clean["spool"])
        assert sorted(by_inc) == [(r, 1) for r in range(WORLD)]
        val_steps = [s for s in range(STEPS) if (s + 1) % VAL_EVERY == 0]
        for (rank, _), events in by_inc.items():
            start = next(e for e in events if isinstance(e, RankStart))
            assert (start.world_size, start.local_rank) == (WORLD, rank)
            names = {n for e in events if isinstance(e, Metrics) for n in e.values}
            assert {"train/loss", "train/acc", "train/lr", "train/grad_norm"} <= names
            assert {"val/loss", "val/acc"} <= names
            assert {e.name for e in events if isinstance(e, Timer)} == {"step_time", "data_wait"}
            assert [e.step for e in events if isinstance(e, Text)] == val_steps
            assert [e.step for e in events if isinstance(e, StepEnd)] == list(range(STEPS))
        params = [json.loads(line)["params"] for line in clean["jsonl"].read_text().splitlines()
                  if line.startswith('{"params"')]  # fmt: skip
        assert len(params) == 1
        assert params[0]["world_size"] == WORLD
        texts = [t for s in jsonl_steps(clean["jsonl"]) for t in s.get("texts", [])]
        assert sorted({t["rank"] for t in texts}) == list(range(WORLD))
        assert len(texts) == WORLD * len(val_steps)


class TestCrashAndResume:
    def test_restart_resumes_from_the_checkpoint(self, resumed: dict[str, Any]) -> None:
        """The restarted job starts at the checkpoint's step and writes a second incarnation."""
        start = resumed["ckpt_step"]
        assert start == CRASH_AT // CKPT_EVERY * CKPT_EVERY
        assert f"starting at step {start}, ranklog incarnation 2" in resumed["second"]
        by_inc = events_by_incarnation(resumed["spool"])
        assert sorted(by_inc) == [(r, i) for r in range(WORLD) for i in (1, 2)]
        for rank in range(WORLD):
            second = [e.step for e in by_inc[rank, 2] if isinstance(e, StepEnd)]
            assert second == list(range(start, STEPS))
            first = [e.step for e in by_inc[rank, 1] if isinstance(e, StepEnd)]
            assert first[-1] >= CRASH_AT - 1
        crashed = [e.step for e in by_inc[CRASH_RANK, 1] if isinstance(e, StepEnd)]
        assert crashed == list(range(CRASH_AT))

    def test_every_step_ships_exactly_once(self, resumed: dict[str, Any]) -> None:
        """Shipped after the crash and after the restart, each step arrives once, complete."""
        assert resumed["shipped_before"] == list(range(CRASH_AT))  # rank 1 never closed 25
        steps = jsonl_steps(resumed["jsonl"])
        assert [s["step"] for s in steps] == list(range(STEPS))
        assert all(s["complete"] and s["ranks"] == WORLD for s in steps)
        assert [s for s, _ in tb_scalars(resumed["tb"], "train/loss")] == list(range(STEPS))
        for rank in range(WORLD):
            points = tb_scalars(resumed["tb"] / f"rank{rank:05d}", "train/loss")
            assert [s for s, _ in points] == list(range(STEPS))

    def test_relogged_steps_are_counted_not_shipped(self, resumed: dict[str, Any]) -> None:
        """Steps the restart logged again count as re-logged; the JSONL matches the oracle."""
        by_inc = events_by_incarnation(resumed["spool"])
        expected = 0
        for rank in range(WORLD):
            closed = max(e.step for e in by_inc[rank, 1] if isinstance(e, StepEnd))
            expected += sum(
                1
                for e in by_inc[rank, 2]
                if isinstance(e, Metrics | Timer | Text) and e.step <= closed
            )
        assert expected > 0
        cursors = list_cursors(resumed["spool"])
        kinds = sorted(c.target.partition(":")[0] for c in cursors)
        assert kinds == ["jsonl", "parquet", "tensorboard"]  # (parquet: compaction's steps)
        assert all(c.relogged_events == expected and c.late_events == 0 for c in cursors)

        counted, logged = counted_values(resumed["pq"], "train/loss")
        assert {(r, s) for r, s in counted} == {(r, s) for r in range(WORLD) for s in range(STEPS)}
        want = oracle(counted)
        for s in jsonl_steps(resumed["jsonl"]):
            assert s["metrics"]["train/loss"] == pytest.approx(want[s["step"]], rel=1e-12)
        # the batches depend on the step alone: a re-logged step repeats the lost run's value
        again = [(r, s) for (r, i, s) in logged if i == 2 and (r, 1, s) in logged]
        assert again
        for r, s in again:
            assert logged[r, 2, s] == logged[r, 1, s]


class TestSrun:
    def test_runs_from_slurm_variables(self, tmp_path: Path) -> None:
        """Started as srun would (SLURM_PROCID/NTASKS/LOCALID, no torchrun), it trains and ships."""
        spool, ckpt, port = tmp_path / "spool", tmp_path / "ckpt", free_port()
        steps = 12
        args = job_args(spool, ckpt, "--master-port", str(port), steps=steps)
        procs = [
            subprocess.Popen(
                [sys.executable, *args],
                env=python_env(
                    SLURM_PROCID=str(r), SLURM_NTASKS=str(WORLD), SLURM_LOCALID=str(r),
                    MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
                ),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )
            for r in range(WORLD)
        ]  # fmt: skip
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=JOB_TIMEOUT)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        assert [p.returncode for p in procs] == [0] * WORLD, outs
        assert f"rank 0: world {WORLD}, starting at step 0" in outs[0]
        by_inc = events_by_incarnation(spool)
        assert sorted(by_inc) == [(r, 1) for r in range(WORLD)]
        for (rank, _), events in by_inc.items():
            start = next(e for e in events if isinstance(e, RankStart))
            assert (start.world_size, start.local_rank) == (WORLD, rank)
        jsonl, _ = ship(spool, tmp_path)
        shipped = jsonl_steps(jsonl)
        assert [s["step"] for s in shipped] == list(range(steps))
        assert all(s["complete"] and s["ranks"] == WORLD for s in shipped)
