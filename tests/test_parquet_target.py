"""``parquet:DIR``: the steps table written live, read back by pyarrow and DuckDB.

How it could break, and the test of each:

- a value changes on the way (NaN payloads, -0.0, infinities, 2**63-1 steps, unicode and
  long names, a name order): round-trip of every field (``TestRoundTrip``);
- a step is written twice or lost across a kill at any instant (write, flush, the link
  of a file): the shared compliance suite, kills included (``TestParquetCompliance``);
- a file that is not ours in DIR (another program's, a steps file of a later version, a
  truncated one): refused naming the file, nothing written (``TestForeign``);
- another run, or this run with another ``--names``, into the same DIR: refused;
- two writers at once on one DIR: the second's file name exists, its flush is refused
  (the lease keeps shippers apart; the link keeps them apart without it);
- the same DIR by another path (a symlink): one identity, one place;
- a reader while the writer runs: sees whole files only (hidden temporary names).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from ranklog.errors import TargetError, TargetHeldError
from ranklog.shippers import GpuStat, ImageItem, ShippedStep, TableItem, TextItem
from ranklog.shippers._steps_table import read_calls
from ranklog.shippers.targets.parquet import ParquetTarget, step_files
from ranklog.spool import RunInfo

from . import test_compliance as tc
from .compliance import Backend

RUN = RunInfo(run_id="cd" * 16, created=1_700_000_000.0, name="exp")


def calls(path: Path) -> list[tuple[Any, ...]]:
    """Every call the directory's files hold, in order."""
    out: list[tuple[Any, ...]] = []
    for f in step_files(path):
        out += read_calls(pq.read_table(f), where=str(f))
    return out


def shipped(path: Path) -> list[ShippedStep]:
    return [s for c in calls(path) if c[0] == "steps" for s in c[1]]


def _back(work: Path) -> list[tuple[int, dict[str, float]]]:
    return [(s.step, s.metrics) for s in shipped(work / "steps")]


def _params(work: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for c in calls(work / "steps"):
        if c[0] == "params":
            merged.update(c[1])
    return merged


PQ = Backend("parquet", lambda work: ParquetTarget(work / "steps"), _back, read_params=_params)


@pytest.fixture
def backend() -> Backend:
    return PQ


class TestParquetCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, for ``parquet:DIR``."""


class TestParquetLateCompliance(tc.TestLateCompliance):
    """tests/test_compliance.py's late-value tests, for ``parquet:DIR``."""


def nan(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000 | payload))[0]


def bits(v: float) -> bytes:
    return struct.pack("<d", v)


def session(path: Path, *batches: list[ShippedStep], run: RunInfo = RUN, **kw: Any) -> Any:
    t = ParquetTarget(path, **kw)
    held = t.open(run)
    for b in batches:
        t.write(b)
        t.flush()
    t.close()
    return held


class TestRoundTrip:
    def test_every_field_comes_back_bit_for_bit(self, tmp_path: Path) -> None:
        """Values (NaN payloads, -0.0, inf), name order, steps up to 2**63-1, late values,
        texts, distributions, images, tables and GPU stats read back as written."""
        odd = {"z": nan(0x1234), "a": -0.0, "ü/λ" + "x" * 300: math.inf, "m": -math.inf}
        media = ShippedStep(
            7, {"loss": 1.5}, 2, 4, False, 1.25,
            texts=[TextItem(0, "val/s", "hello **world**")],
            histograms={"h": [1.0, nan(7), -0.0]},
            images=[ImageItem(1, "img", b"\x89PNG\x00", "png", '{"data": []}')],
            gpu=[GpuStat("node", 0, "H100", 3, 50.0, 10, 20, None, 300.0)],
            tables=[TableItem(0, "t", ["a", "b"], [[1, "x"], [None, 2.5]])],
        )  # fmt: skip
        sent = [
            ShippedStep(0, odd, 1, 1, True, 0.5),
            media,
            ShippedStep(3, {"late": 2.0}, 1, 4, True, 1.5, carrier=7),
            ShippedStep(2**63 - 1, {}, 4, 4, True, 2.0),
        ]
        session(tmp_path, sent[:1], sent[1:])
        got = shipped(tmp_path)
        for g, s in zip(got, sent, strict=True):
            assert list(g.metrics) == list(s.metrics)
            assert [bits(v) for v in g.metrics.values()] == [bits(v) for v in s.metrics.values()]
            assert (g.step, g.carrier, g.ranks, g.world_size, g.complete, g.ts) == (
                s.step, s.carrier, s.ranks, s.world_size, s.complete, s.ts)  # fmt: skip
            assert (g.texts, g.images, g.gpu, g.tables) == (s.texts, s.images, s.gpu, s.tables)
            assert {k: [bits(x) for x in v] for k, v in g.histograms.items()} == {
                k: [bits(x) for x in v] for k, v in s.histograms.items()
            }

    def test_params_and_end_in_call_order(self, tmp_path: Path) -> None:
        """Params are rows before the step they were written before; the end is the last."""
        t = ParquetTarget(tmp_path)
        t.open(RUN)
        t.write_params({"lr": 0.1, "tags": ["a", None]})
        t.write([ShippedStep(5, {"x": 1.0}, 1, 1, True, 1.0)])
        t.write_meta({"code/commit": "abc"})
        t.flush()
        t.end("failed")
        t.close()
        got = calls(tmp_path)
        assert [c[0] for c in got] == ["params", "steps", "params", "end"]
        assert got[0][1:] == ({"lr": 0.1, "tags": ["a", None]}, 5)
        assert got[2][1:] == ({"@code/commit": "abc"}, None) and got[3] == ("end", "failed")

    def test_held_steps_are_the_steps_and_carriers(self, tmp_path: Path) -> None:
        """open() reports the steps written and each late value's carrier, across files."""
        session(tmp_path, [ShippedStep(1, {}, 1, 1, True, 0.0)],
                [ShippedStep(0, {"v": 1.0}, 1, 1, True, 0.0, carrier=9)])  # fmt: skip
        held = ParquetTarget(tmp_path).open(RUN)
        assert held.ranges() == [(1, 1), (9, 9)]

    def test_duckdb_reads_a_loss_curve(self, tmp_path: Path) -> None:
        """docs' one-line DuckDB query gives (step, value) of a metric, late values apart."""
        import duckdb  # (the test extra installs it)

        session(tmp_path, [ShippedStep(s, {"train/loss": s / 2}, 2, 2, True, 0.0)
                           for s in range(5)])  # fmt: skip
        q = (f"SELECT step, value FROM '{tmp_path}/*.parquet' WHERE kind = 'metric' AND "
             "name = 'train/loss' AND carrier IS NULL ORDER BY step")  # fmt: skip
        assert duckdb.sql(q).fetchall() == [(s, s / 2) for s in range(5)]


class TestForeign:
    @pytest.mark.parametrize("name", ["notes.txt", "steps-1.parquet", "data.parquet"])
    def test_a_file_not_ours_refuses_the_directory(self, tmp_path: Path, name: str) -> None:
        """Any file of another name in DIR: refused naming it, nothing written."""
        (tmp_path / name).write_bytes(b"theirs")
        with pytest.raises(TargetError, match=name):
            ParquetTarget(tmp_path).open(RUN)
        assert sorted(os.listdir(tmp_path)) == [name]

    def test_a_damaged_or_foreign_steps_file_is_refused(self, tmp_path: Path) -> None:
        """A truncated steps file, or a Parquet file of another program under our name."""
        session(tmp_path, [ShippedStep(0, {"v": 1.0}, 1, 1, True, 0.0)])
        f = tmp_path / "steps-00000001.parquet"
        f.write_bytes(f.read_bytes()[:-20])
        with pytest.raises(TargetError, match="damaged"):
            ParquetTarget(tmp_path).open(RUN)
        import pyarrow as pa

        pq.write_table(pa.table({"x": [1]}), f)
        with pytest.raises(TargetError, match="not a ranklog steps file"):
            ParquetTarget(tmp_path).open(RUN)

    def test_another_run_or_selection_is_refused(self, tmp_path: Path) -> None:
        """Another run's steps, or this run's with another --names: refused, not mixed."""
        session(tmp_path, [ShippedStep(0, {"v": 1.0}, 1, 1, True, 0.0)])
        other = RunInfo(run_id="ef" * 16, created=0.0, name="other")
        with pytest.raises(TargetHeldError, match="ef" * 16):
            ParquetTarget(tmp_path).open(other)
        with pytest.raises(TargetHeldError, match="--names"):
            ParquetTarget(tmp_path, names="train/*").open(RUN)

    def test_two_writers_never_share_a_file(self, tmp_path: Path) -> None:
        """Two targets opened on one DIR: the second one's file name is taken, refused."""
        a, b = ParquetTarget(tmp_path), ParquetTarget(tmp_path)
        a.open(RUN)
        b.open(RUN)
        a.write([ShippedStep(0, {"v": 1.0}, 1, 1, True, 0.0)])
        b.write([ShippedStep(0, {"v": 2.0}, 1, 1, True, 0.0)])
        a.flush()
        with pytest.raises(TargetHeldError, match="one writer"):
            b.flush()
        assert [s.metrics for s in shipped(tmp_path)] == [{"v": 1.0}]

    def test_a_symlink_is_the_same_directory(self, tmp_path: Path) -> None:
        """Another spelling of DIR (a symlink) has the same identity and place."""
        (tmp_path / "d").mkdir()
        os.symlink(tmp_path / "d", tmp_path / "link")
        a, b = ParquetTarget(tmp_path / "d"), ParquetTarget(tmp_path / "link")
        assert a.identity(RUN) == b.identity(RUN) and a.place(RUN) == b.place(RUN)

    def test_a_writers_temporary_file_is_passed_over(self, tmp_path: Path) -> None:
        """A hidden temporary file (a writer killed before its link) holds no step."""
        session(tmp_path, [ShippedStep(0, {"v": 1.0}, 1, 1, True, 0.0)])
        (tmp_path / ".steps-00000002.parquet.host.1.abcd").write_bytes(b"half")
        assert ParquetTarget(tmp_path).open(RUN).ranges() == [(0, 0)]
