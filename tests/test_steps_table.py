"""The dataset's steps table: written by compaction's engine, read back by replay.

How it could break, and the test of each:

- compaction runs while the job does: the table must not claim steps still open, and a
  later compaction must go on without writing a step twice (``TestIncremental``);
- a compaction killed at any instant of its steps (after a file is linked, before its
  cursor): the next one writes each step once (``TestIncremental``);
- a table that is not whole (the job had not ended), or does not cover every frame the
  raw tables hold (a requeue after the end; a compaction stopped before its steps), must
  not be replayed as if it were: replay goes to the raw rows and says so (``TestCovered``);
- the epilogue (``ranklog ship SPOOL``) re-creating compaction's steps target, without the
  dataset's lock or its options, or making a moved dataset's ``steps/`` again;
- the table damaged, truncated, of another run, or a stranger's file in ``steps/``
  (the dataset is shared: its files are data): replay refuses, naming the file and the
  command that writes it again (``TestHostile``); a file crafted under our name (columns
  of other types, steps out of order, a value without a name, ranks below zero, a kind
  version 1 has not): refused in one line, exit 4 (``TestCrafted``);
- a dataset of an older release (no table; layout 1; layout 2): ``compact --steps``
  writes its table from the raw rows, and replay from it gives what it gave before
  (``TestOlder``); a dataset with a table written by this release stays readable;
- steps sparse and huge (up to 2**63-1), a single step, a job of no step (``TestShapes``);
- a read-only spool (a copy compacted elsewhere): the raw tables written, the steps table
  not, said in one line with the command that writes it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ranklog
import ranklog.shippers.targets.parquet as parquet_target
from ranklog.archive import compact, replay
from ranklog.errors import ArchiveError
from ranklog.shippers.targets.jsonl import JsonlTarget

from .conftest import bindfs, python_env
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


class TestCovered:
    """The table is read only when it covers every frame the raw tables hold."""

    def test_a_requeue_after_the_end_is_not_left_out(self, spool: Path, tmp_path: Path) -> None:
        """Steps 0-3 compacted to the job's end; a requeue logs 4-6 (rank 1 leaves 4 open):
        compacted again, the table still ends with the first end, but does not cover the
        new frames: replay reads the raw rows and ships 4-6 too."""
        _steps(spool, 2, range(4))
        compact(spool, tmp_path / "pq")
        r0, r1 = rank(spool, 0, 2), rank(spool, 1, 2)
        for s in range(4, 7):
            r0.log_metrics({"loss": float(s)}, step=s)
            r0.step_end(s)
        r1.log_metrics({"loss": 4.0}, step=4)
        r0.close()
        r1.flush()
        compact(spool, tmp_path / "pq")
        got = replayed(tmp_path / "pq", tmp_path / "r.jsonl")
        assert [x["step"] for x in map(json.loads, got.splitlines()[1:]) if "step" in x] == list(
            range(7))  # fmt: skip
        r1.close()

    def test_a_compaction_stopped_before_its_steps(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A compaction whose steps failed after the raw tables were written: the table
        (whole as of the first compaction) does not cover them; replay reads the raw rows."""
        import ranklog.archive._compact as compact_mod

        runs = _steps(spool, 2, range(4), end=False)
        for run in runs:
            run.close()
        compact(spool, tmp_path / "pq")
        more = [rank(spool, r, 2) for r in range(2)]
        for s in range(4, 8):
            for run in more:
                run.log_metrics({"loss": float(s)}, step=s)
                run.step_end(s)
        for run in more:
            run.close()

        def failing(*args: Any, **kw: Any) -> Any:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(compact_mod, "ship_steps", failing)
        with pytest.raises(OSError):
            compact(spool, tmp_path / "pq")
        got = replayed(tmp_path / "pq", tmp_path / "r.jsonl")
        assert got.count(b'"step"') == 8

    def test_the_epilogue_leaves_the_steps_table_to_compact(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """`ranklog ship SPOOL` (the epilogue) re-creates the job's targets, not compaction's
        steps table: a dataset moved away is not made again, nothing is refused."""
        _steps(spool, 2, range(4))
        out = tmp_path / "out.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        compact(spool, tmp_path / "pq")
        (tmp_path / "pq").rename(tmp_path / "moved")
        done = ranklog_cmd("ship", str(spool), "--once")
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / "pq").exists()

    def test_after_delete_the_hint_is_compact_steps(self, spool: Path, tmp_path: Path) -> None:
        """Segments removed by --delete, then the steps table removed: compaction cannot
        ship them again from the spool, and says to write it from the dataset."""
        _steps(spool, 2, range(4))
        assert ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "pq"),
                           "--delete").returncode == 0  # fmt: skip
        shutil.rmtree(tmp_path / "pq" / "steps")
        done = ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "pq"))
        assert done.returncode == 3 and "compact --steps" in done.stderr, done.stderr
        fixed = ranklog_cmd("compact", "--steps", str(tmp_path / "pq"))
        assert fixed.returncode == 0, fixed.stderr
        assert replayed(tmp_path / "pq", tmp_path / "r.jsonl").count(b'"step"') == 4


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
        from ranklog.archive import load_manifest
        from ranklog.archive._steps import whole_table
        from ranklog.spool import RunInfo

        ds = tmp_path / "ds"
        shutil.copytree(DATA / "steps1" / "dataset", ds)
        m = load_manifest(ds)
        assert whole_table(ds, RunInfo(m.run_id, m.created, m.name, m.world_size), m)
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


def _rewrite(f: Path, change: Any) -> None:
    """Rewrite steps file ``f`` with ``change(table) -> table`` (its metadata kept)."""
    import pyarrow.parquet as pq

    t = pq.read_table(f)
    pq.write_table(change(t).replace_schema_metadata(t.schema.metadata), f)


class TestCrafted:
    """Steps files with the right names and crafted contents: refused in one line naming
    the file (exit 4 from the command line), never shipped as if they were ours."""

    @pytest.fixture
    def dataset(self, spool: Path, tmp_path: Path) -> Path:
        _steps(spool, 2, range(8))
        compact(spool, tmp_path / "pq")
        return tmp_path / "pq"

    @pytest.mark.parametrize(
        ("what", "match"),
        [
            ("value_as_text", "column value is string"),
            ("null_name", "without a name"),
            ("step_as_float", "column step is double"),
            ("steps_backwards", "after step"),
            ("negative_ranks", "ranks"),
            ("unknown_kind", "of kind 'later'"),
            ("null_step", "without its step"),
            ("values_first", "values before any step"),
        ],
    )
    def test_a_crafted_file_is_refused(
        self, dataset: Path, tmp_path: Path, what: str, match: str
    ) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        f = sorted((dataset / "steps").glob("*.parquet"))[0]

        def change(t: pa.Table) -> pa.Table:
            col = t.column_names.index
            kinds = pc.cast(t.column("kind"), pa.string())
            if what == "value_as_text":
                return t.set_column(col("value"), "value", pc.cast(t.column("value"), pa.string()))
            if what == "null_name":
                names = [None if k == "metric" else n
                         for k, n in zip(kinds.to_pylist(), t.column("name").to_pylist(),
                                         strict=True)]  # fmt: skip
                return t.set_column(col("name"), "name", pa.array(names, pa.string()))
            if what == "step_as_float":
                return t.set_column(col("step"), "step", pc.cast(t.column("step"), pa.float64()))
            if what == "steps_backwards":
                steps = t.column("step").to_pylist()
                return t.set_column(col("step"), "step", pa.array(
                    [None if s is None else 100 - s for s in steps], pa.int64()))  # fmt: skip
            if what == "negative_ranks":
                return t.set_column(col("ranks"), "ranks", pa.array(
                    [None if r is None else -5 for r in t.column("ranks").to_pylist()],
                    pa.int32()))  # fmt: skip
            if what == "unknown_kind":
                k = kinds.to_pylist()
                k[k.index("metric")] = "later"  # a row of a kind version 1 has not
                return t.set_column(col("kind"), "kind",
                                    pa.array(k, pa.string()).dictionary_encode())  # fmt: skip
            if what == "values_first":  # the first step's row made a value: orphan values
                k = kinds.to_pylist()
                k[0] = "metric"
                return t.set_column(col("kind"), "kind",
                                    pa.array(k, pa.string()).dictionary_encode())  # fmt: skip
            steps = t.column("step").to_pylist()
            steps[0] = None
            return t.set_column(col("step"), "step", pa.array(steps, pa.int64()))

        _rewrite(f, change)
        with pytest.raises(ArchiveError, match=match):
            replay(dataset, JsonlTarget(tmp_path / "out.jsonl"))
        done = ranklog_cmd("replay", str(dataset), "--to", f"jsonl:{tmp_path / 'cli.jsonl'}")
        assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr

    def test_a_file_of_another_run_first_is_refused(
        self, dataset: Path, tmp_path: Path, spool: Path
    ) -> None:
        """Another run's steps file put first in the table: refused (every file's run is
        checked, not the last one's)."""
        other = tmp_path / "other"
        _steps(other, 1, range(3))
        compact(other, tmp_path / "pq2")
        theirs = sorted((tmp_path / "pq2" / "steps").glob("*.parquet"))[0]
        shutil.copy(theirs, dataset / "steps" / "steps-00000000.parquet")
        with pytest.raises(ArchiveError, match="another run"):
            replay(dataset, JsonlTarget(tmp_path / "out.jsonl"))


def test_a_read_only_spool_compacts_without_its_steps(spool: Path, tmp_path: Path) -> None:
    """A spool seen read-only (a bindfs -r mount: a copy a user may compact): the raw
    tables are written, the steps table is not (a shipper keeps its cursor in the spool),
    said in one line with the command that writes it; replay reads the raw rows."""
    _steps(spool, 2, range(5))
    mnt = tmp_path / "ro"
    mnt.mkdir()
    with bindfs(spool, mnt, "-r"):
        done = ranklog_cmd("compact", str(mnt), "--out", str(tmp_path / "pq"))
        assert done.returncode == 0, done.stderr
        assert "steps table: not written" in done.stdout and "compact --steps" in done.stdout
        ship(spool, tmp_path / "live.jsonl")
        got = replayed(tmp_path / "pq", tmp_path / "r.jsonl")
        assert got == (tmp_path / "live.jsonl").read_bytes()


def test_compact_steps_mid_run_then_compaction_freezes_nothing(spool: Path, tmp_path: Path) -> None:
    """`compact --steps` on a dataset of a running job (step 5 logged by one rank of two)
    writes step 5 partial, every rank taken as ended; a later compaction of the spool adds
    the rest but leaves that table as it is and says so: replay reads the raw rows (step
    5 whole, as live shipped it); `compact --steps` again covers them."""
    from ranklog.archive import write_steps

    runs = _steps(spool, 2, range(5), end=False)
    runs[0].log_metrics({"loss": 5.0}, step=5)
    runs[0].flush()
    compact(spool, tmp_path / "pq")
    assert write_steps(tmp_path / "pq") is not None
    for s in range(5, 8):
        for r, run in enumerate(runs):
            if (s, r) != (5, 0):
                run.log_metrics({"loss": s + r / 4}, step=s)
            run.step_end(s)
    for run in runs:
        run.close()
    done = ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "pq"))
    assert done.returncode == 0 and "run it again to cover" in done.stdout, done.stdout
    ship(spool, tmp_path / "live.jsonl")
    want = (tmp_path / "live.jsonl").read_bytes()
    assert replayed(tmp_path / "pq", tmp_path / "a.jsonl") == want
    assert write_steps(tmp_path / "pq") is not None
    assert replayed(tmp_path / "pq", tmp_path / "b.jsonl").splitlines()[1:] == (
        want.splitlines()[1:])  # fmt: skip
