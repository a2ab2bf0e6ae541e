"""The dataset's steps table: written by compaction's engine, read back by replay.

How it could break, and the test of each:

- compaction runs while the job does: the table must not claim steps still open, and a
  later compaction must go on without writing a step twice (``TestIncremental``);
- a compaction killed at any instant of its steps (after a file is linked, before its
  cursor): the next one writes each step once (``TestIncremental``);
- a table that is not whole (the job had not ended) must not be replayed as if it were:
  replay goes to the raw rows and says so;
- the table damaged, truncated, of another run, or a stranger's file in ``steps/``
  (the dataset is shared: its files are data): replay refuses, naming the file and the
  command that writes it again (``TestHostile``);
- a dataset of an older release (no table; layout 1; layout 2): ``compact --steps``
  writes its table from the raw rows, and replay from it gives what it gave before
  (``TestOlder``); a dataset with a table written by this release stays readable;
- steps sparse and huge (up to 2**63-1), a single step, a job of no step (``TestShapes``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ranklog
import ranklog.shippers.targets.parquet as parquet_target
from ranklog.archive import compact, replay
from ranklog.errors import ArchiveError
from ranklog.shippers.targets.jsonl import JsonlTarget

from .conftest import python_env
from .shiphelp import rank, ship

DATA = Path(__file__).parent / "data"


def replayed(dataset: Path, out: Path) -> bytes:
    out.unlink(missing_ok=True)
    replay(dataset, JsonlTarget(out))
    return out.read_bytes()


def ranklog_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ranklog.cli", *args], env=python_env(),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def _steps(spool: Path, world: int, steps: range, *, end: bool = True) -> list[ranklog.Run]:
    runs = [rank(spool, r, world) for r in range(world)]
    for s in steps:
        for r, run in enumerate(runs):
            run.log_metrics({"loss": s + r / 4}, step=s)
            run.step_end(s)
    if end:
        for run in runs:
            run.close()
    return runs


class TestIncremental:
    def test_a_compaction_while_the_job_runs_then_after(
        self, spool: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Compacted mid-run, the table holds the steps complete then and is not whole:
        replay reads the raw rows (said at INFO); compacted again after the end, the table
        is whole, each step once, and replays as live shipped."""
        runs = _steps(spool, 2, range(5), end=False)
        res = compact(spool, tmp_path / "pq")
        assert res.steps == (5, 4)
        with caplog.at_level("INFO", logger="ranklog.replay"):
            mid = replayed(tmp_path / "pq", tmp_path / "mid.jsonl")
        assert "ends before the job did" in caplog.text
        assert mid.count(b'"step"') == 5
        for s in range(5, 9):
            for r, run in enumerate(runs):
                run.log_metrics({"loss": s + r / 4}, step=s)
                run.step_end(s)
        for run in runs:
            run.close()
        assert compact(spool, tmp_path / "pq").steps == (9, 8)
        ship(spool, tmp_path / "live.jsonl")
        caplog.clear()
        with caplog.at_level("INFO", logger="ranklog.replay"):
            got = replayed(tmp_path / "pq", tmp_path / "again.jsonl")
        assert "through the engine" not in caplog.text
        assert got == (tmp_path / "live.jsonl").read_bytes()

    def test_a_compaction_killed_after_a_file_before_its_cursor(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Killed right after its steps file is linked (the cursor not written): the next
        compaction finds the steps in the table and writes none twice."""
        _steps(spool, 2, range(6))
        real = parquet_target.ParquetTarget.flush

        def killed(self: parquet_target.ParquetTarget) -> None:
            real(self)
            raise KeyboardInterrupt("killed")

        with monkeypatch.context() as m:
            m.setattr(parquet_target.ParquetTarget, "flush", killed)
            with pytest.raises(KeyboardInterrupt):
                compact(spool, tmp_path / "pq")
        compact(spool, tmp_path / "pq")
        ship(spool, tmp_path / "live.jsonl")
        assert replayed(tmp_path / "pq", tmp_path / "r.jsonl") == (
            tmp_path / "live.jsonl").read_bytes()  # fmt: skip


class TestHostile:
    @pytest.fixture
    def dataset(self, spool: Path, tmp_path: Path) -> Path:
        _steps(spool, 2, range(4))
        compact(spool, tmp_path / "pq")
        return tmp_path / "pq"

    def test_a_damaged_file_is_refused_naming_it(self, dataset: Path, tmp_path: Path) -> None:
        """A truncated steps file: replay refuses naming it and `compact --steps`."""
        f = sorted((dataset / "steps").glob("*.parquet"))[0]
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        with pytest.raises(ArchiveError, match=rf"{f.name}.*compact --steps"):
            replay(dataset, JsonlTarget(tmp_path / "out.jsonl"))

    def test_a_strangers_file_is_refused(self, dataset: Path, tmp_path: Path) -> None:
        """A file of another name in steps/ (the dataset is shared): refused, named."""
        (dataset / "steps" / "evil.parquet").write_bytes(b"PAR1")
        with pytest.raises(ArchiveError, match=r"evil\.parquet"):
            replay(dataset, JsonlTarget(tmp_path / "out.jsonl"))

    def test_another_runs_table_is_refused(
        self, dataset: Path, tmp_path: Path, spool: Path
    ) -> None:
        """A steps table of another run put in the dataset: refused, not replayed."""
        other = tmp_path / "other"
        _steps(other, 1, range(2))
        compact(other, tmp_path / "pq2")
        shutil.rmtree(dataset / "steps")
        shutil.copytree(tmp_path / "pq2" / "steps", dataset / "steps")
        with pytest.raises(ArchiveError, match="another run"):
            replay(dataset, JsonlTarget(tmp_path / "out.jsonl"))


class TestOlder:
    @pytest.mark.parametrize("fixture", ["layout2/dataset", "schema5/dataset"])
    def test_compact_steps_adds_the_table_and_replay_gives_the_same(
        self, tmp_path: Path, fixture: str
    ) -> None:
        """An older release's dataset (layout 2; layout 1 of schema 5): `compact --steps`
        writes its table from the raw rows; replay from it gives what it gave before."""
        ds = tmp_path / "ds"
        shutil.copytree(DATA / fixture, ds)
        before = replayed(ds, tmp_path / "before.jsonl")
        done = ranklog_cmd("compact", "--steps", str(ds))
        assert done.returncode == 0, done.stderr
        assert "steps table written from the raw rows" in done.stdout
        assert (ds / "steps").is_dir()
        assert replayed(ds, tmp_path / "after.jsonl") == before
        again = ranklog_cmd("compact", "--steps", str(ds))
        assert again.returncode == 0 and "whole already" in again.stdout

    def test_compact_steps_takes_no_spool_options(self, tmp_path: Path) -> None:
        """`compact --steps DS --out X` is refused in one line, exit 2."""
        done = ranklog_cmd("compact", "--steps", str(tmp_path), "--out", str(tmp_path / "x"))
        assert done.returncode == 2 and "takes no --out" in done.stderr

    def test_a_table_written_by_this_release(self, tmp_path: Path) -> None:
        """tests/data/steps1: replayed from its table and from its raw rows, the JSONL
        shipping its spool gave."""
        want = (DATA / "format1" / "expected.jsonl").read_bytes()
        ds = tmp_path / "ds"
        shutil.copytree(DATA / "steps1" / "dataset", ds)
        assert replayed(ds, tmp_path / "a.jsonl") == want
        shutil.rmtree(ds / "steps")
        assert replayed(ds, tmp_path / "b.jsonl").splitlines()[1:] == want.splitlines()[1:]


class TestShapes:
    @pytest.mark.parametrize(
        "steps", [[0], [4, 7, 2**62], [3, 2**63 - 1], list(range(0, 10**6, 99_991))]
    )
    def test_sparse_huge_and_single_steps(
        self, spool: Path, tmp_path: Path, steps: list[int]
    ) -> None:
        """Steps far apart, up to 2**63-1, or one: both paths replay as live shipped."""
        run = rank(spool, 0, 1)
        for s in steps:
            run.log_metrics({"loss": s / 3}, step=s)
            run.step_end(s)
        run.close()
        compact(spool, tmp_path / "pq")
        ship(spool, tmp_path / "live.jsonl")
        want = (tmp_path / "live.jsonl").read_bytes()
        assert replayed(tmp_path / "pq", tmp_path / "a.jsonl") == want
        shutil.rmtree(tmp_path / "pq" / "steps")
        assert replayed(tmp_path / "pq", tmp_path / "b.jsonl") == want

    def test_a_job_of_no_step(self, spool: Path, tmp_path: Path) -> None:
        """Ranks that log params and end without a step: the table holds the params and the
        end; replay writes the params, as live."""
        for r in range(2):
            run = rank(spool, r, 2)
            run.log_hyperparams({"lr": 0.1})
            run.close()
        compact(spool, tmp_path / "pq")
        ship(spool, tmp_path / "live.jsonl")
        got = replayed(tmp_path / "pq", tmp_path / "a.jsonl")
        assert got == (tmp_path / "live.jsonl").read_bytes() and b'"params"' in got
