"""Compaction into Parquet: every event once, with the right types, whatever is interrupted."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from ranklog.archive import SCHEMAS, TABLES, compact, load_manifest
from ranklog.schemas import Metrics, Params, Text, Timer
from ranklog.spool import SpoolLayout
from ranklog.testing import crash, events_by_incarnation

from .shiphelp import log_steps, rank, raw_files

#: every test here, for a dataset of each layout
pytestmark = pytest.mark.usefixtures("dataset_layout")


def _job(spool: Path, *, close_last: bool = True) -> None:
    """3 ranks, small segments (many per rank), a restart of rank 1, every kind of event."""
    for r in range(3):
        run = rank(spool, r, 3, max_segment_bytes=4096)
        run.log_hyperparams({"lr": 0.1, "model": {"depth": 4}, "name": "x"})
        for s in range(60):
            run.log_metrics({"loss": r + s / 1000, "nan": math.nan}, step=s, reduce=("mean", "max"))
            run.log_timing("step_time", 0.5 + r, step=s)
            if s % 20 == 19:
                run.log_text("val/sample", f"r{r} s{s}", step=s)
                run.log_histogram("w", [1.0, 2.0, r], step=s)
                run.log_image("plot", b"png%d" % s, step=s)
            run.step_end(s)
        if r == 1:
            crash(run)  # killed
            run = rank(spool, r, 3, max_segment_bytes=4096)  # requeued
            log_steps(run, range(55, 70))
        if close_last or r != 2:
            run.close()
        else:
            run.flush()


def _pieces(out: Path) -> int:
    """How many pieces of part files the manifest names (layout 2)."""
    segments = load_manifest(out).segments.values()
    return sum(len(held) for e in segments for held in e.pieces.values())


def _table(out: Path, name: str) -> pa.Table:
    return ds.dataset(out / name, format="parquet").to_table()


def _position(row: dict[str, object]) -> tuple[object, ...]:
    return (
        *(row[c] for c in ("rank", "incarnation", "segment", "seq", "idx")),
        str(row.get("name")),
    )


def _nan_safe(row: dict[str, object]) -> dict[str, object]:
    return {k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def _dataset(out: Path) -> dict[str, list[dict[str, object]]]:
    """Every table's rows, sorted by source position (for comparing two datasets)."""
    return {
        t: sorted((_nan_safe(r) for r in _table(out, t).to_pylist()), key=_position)
        for t in TABLES
        if (out / t).is_dir()
    }


class TestRoundTrip:
    def test_every_event_exactly_once(self, spool: Path, tmp_path: Path) -> None:
        """Each event of every rank, incarnation and segment is in Parquet exactly once."""
        _job(spool)
        out = tmp_path / "pq"
        result = compact(spool, out)
        assert result.bad == []
        events = events_by_incarnation(spool)
        metrics = [
            (r, i, e) for (r, i), evs in events.items() for e in evs if isinstance(e, Metrics)
        ]
        expected_values = sum(len(e.values) for _, _, e in metrics)
        table = _table(out, "metrics")
        assert table.num_rows == expected_values
        keys = set(
            zip(
                *(
                    table.column(c).to_pylist()
                    for c in ("rank", "incarnation", "segment", "seq", "idx", "name")
                ),
                strict=True,
            )
        )
        assert len(keys) == expected_values  # no duplicates
        counts = {
            "timers": sum(isinstance(e, Timer) for evs in events.values() for e in evs),
            "text": sum(isinstance(e, Text) for evs in events.values() for e in evs),
            "params": sum(
                len(e.values) for evs in events.values() for e in evs if isinstance(e, Params)
            ),
        }
        for t, n in counts.items():
            assert _table(out, t).num_rows == n, t
        assert sorted(set(_table(out, "ranks").column("kind").to_pylist())) == [
            "names", "rank_end", "rank_start", "step_end",
        ]  # fmt: skip  # (names: a names frame of segment format 2)

    def test_types_and_values(self, spool: Path, tmp_path: Path) -> None:
        """Columns have the documented types; NaN, ops, params as JSON, bytes survive."""
        _job(spool)
        out = tmp_path / "pq"
        compact(spool, out)
        for t in TABLES:
            if (out / t).is_dir():
                assert _table(out, t).schema.equals(SCHEMAS[t], check_metadata=False), t
        m = _table(out, "metrics").to_pylist()
        row = next(x for x in m if x["rank"] == 2 and x["name"] == "loss" and x["step"] == 7)
        assert row["value"] == pytest.approx(2.007) and row["reduce"] == "mean,max"
        assert all(math.isnan(x["value"]) for x in m if x["name"] == "nan")
        params = {x["name"]: x["value"] for x in _table(out, "params").to_pylist()}
        assert params == {"lr": "0.1", "model.depth": "4", "name": '"x"'}
        imgs = _table(out, "images").to_pylist()
        assert {x["data"] for x in imgs} >= {b"png19", b"png59"}
        hist = _table(out, "histograms").to_pylist()
        assert hist[0]["values"][:2] == [1.0, 2.0]

    def test_columns_are_encoded_as_documented(self, spool: Path, tmp_path: Path) -> None:
        """Row numbers, steps and timestamps are delta-encoded, values byte-stream-split,
        strings dictionary-encoded, everything zstd-compressed (formats.md)."""
        import pyarrow.parquet as pq

        _job(spool)
        out = tmp_path / "pq"
        compact(spool, out)
        for t in ("metrics", "ranks"):
            meta = pq.read_metadata(next((out / t).glob("*.parquet")))
            group = meta.row_group(0)
            cols = {
                group.column(i).path_in_schema: group.column(i) for i in range(meta.num_columns)
            }
            for name in ("seq", "idx", "ts", "step"):
                assert "DELTA_BINARY_PACKED" in cols[name].encodings, (t, name)
            assert all(c.compression == "ZSTD" for c in cols.values()), t
        meta = pq.read_metadata(next((out / "metrics").glob("*.parquet")))
        cols = {c.path_in_schema: c for c in map(meta.row_group(0).column, range(meta.num_columns))}
        assert "BYTE_STREAM_SPLIT" in cols["value"].encodings
        assert "RLE_DICTIONARY" in cols["name"].encodings

    def test_chunks_give_the_same_rows(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dataset_layout: int
    ) -> None:
        """A segment read in several chunks (several blocks of one part) gives the rows of
        one read."""
        import ranklog.archive._compact as parquet

        _job(spool)
        compact(spool, tmp_path / "whole")
        monkeypatch.setattr(parquet, "BLOCK_BYTES", 512)
        chunked = compact(spool, tmp_path / "pq")
        assert chunked.files == len(raw_files(tmp_path / "whole"))
        assert _pieces(tmp_path / "pq") > _pieces(tmp_path / "whole")
        assert _dataset(tmp_path / "pq") == _dataset(tmp_path / "whole")

    def test_twice_is_once(self, spool: Path, tmp_path: Path) -> None:
        """A second run adds nothing."""
        _job(spool)
        out = tmp_path / "pq"
        compact(spool, out)
        before = _dataset(out)
        again = compact(spool, out)
        assert again.files == 0 and _dataset(out) == before

    def test_each_value_keeps_its_name_and_op(self, spool: Path, tmp_path: Path) -> None:
        """Events with different names, name orders and reduce forms: every row its own."""
        run = rank(spool, 0, 1)
        logged = [
            ({"a": 1.0, "b": 2.0}, "mean"),
            ({"b": 3.0, "a": 4.0}, "max"),  # same names, other order, other op
            ({"c": 5.0}, {"c": "min"}),  # a map of ops
            ({"a": 6.0, "d": 7.0}, {"d": ("sum", "max")}),  # a name absent from the map
            ({"a": 8.0, "b": 9.0}, "mean"),
        ]
        for step, (values, reduce) in enumerate(logged):
            run.log_metrics(values, step=step, reduce=reduce)
            run.step_end(step)
        run.close()
        compact(spool, tmp_path / "pq")
        rows = _table(tmp_path / "pq", "metrics").to_pylist()
        got = [(x["step"], x["name"], x["value"], x["reduce"]) for x in rows]
        assert got == [
            (0, "a", 1.0, "mean"), (0, "b", 2.0, "mean"),
            (1, "b", 3.0, "max"), (1, "a", 4.0, "max"),
            (2, "c", 5.0, "min"),
            (3, "a", 6.0, "mean"), (3, "d", 7.0, "sum,max"),
            (4, "a", 8.0, "mean"), (4, "b", 9.0, "mean"),
        ]  # fmt: skip

    def test_segment_tables_types(self, spool: Path) -> None:
        """segment_tables gives the documented types; with dictionary, the same rows encoded."""
        from ranklog.archive import segment_tables
        from ranklog.spool import SegmentReader

        _job(spool)
        seg = SpoolLayout(spool).segments(0)[0]
        frames = SegmentReader(seg.path).read(0, writer_gone=True).frames
        plain = segment_tables("run", seg, frames)
        encoded = segment_tables("run", seg, frames, dictionary=True)
        assert plain.keys() == encoded.keys() and "metrics" in plain
        for t, table in plain.items():
            assert table.schema.equals(SCHEMAS[t], check_metadata=False), t
            rows = [_nan_safe(r) for r in table.to_pylist()]
            assert [_nan_safe(r) for r in encoded[t].to_pylist()] == rows, t
        assert pa.types.is_dictionary(encoded["metrics"].schema.field("name").type)


class TestIncremental:
    def test_live_segment_continues(self, spool: Path, tmp_path: Path) -> None:
        """A segment being written is compacted up to its last frame and continued later."""
        run = rank(spool, 0, 1)
        log_steps(run, range(10))
        out, whole = tmp_path / "pq", tmp_path / "whole"
        compact(spool, out)
        assert _table(out, "metrics").num_rows == 10
        log_steps(run, range(10, 25))
        run.close()
        compact(spool, out)
        compact(spool, whole)
        assert _table(out, "metrics").num_rows == 25
        assert _dataset(out) == _dataset(whole)
        entry = next(iter(load_manifest(out).segments.values()))
        assert entry.done and entry.sealed and len(entry.files) >= 4

    @pytest.mark.parametrize(("save_bytes", "dies_at"), [(0, 4), (64 << 20, 1)])
    def test_killed_mid_way(
        self,
        spool: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        save_bytes: int,
        dies_at: int,
    ) -> None:
        """Killed between its files and its manifest, then rerun: equal to an uninterrupted run.

        With a save after every segment (killed at the fourth), and with the default: one
        save at the end, so every file written is left unlisted when it dies.
        """
        import ranklog.archive._compact as parquet

        monkeypatch.setattr(parquet, "SAVE_BYTES", save_bytes)
        _job(spool)
        whole = tmp_path / "whole"
        compact(spool, whole)
        out = tmp_path / "pq"
        real = parquet.save_manifest
        calls = {"n": 0}

        def dying(*args: object) -> None:
            calls["n"] += 1
            if calls["n"] == dies_at:
                raise KeyboardInterrupt("killed")
            real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(parquet, "save_manifest", dying)
        with pytest.raises(KeyboardInterrupt):
            compact(spool, out)
        assert any(out.glob("metrics/*.parquet"))  # files were written before it died
        monkeypatch.setattr(parquet, "save_manifest", real)
        compact(spool, out)
        assert _dataset(out) == _dataset(whole)

    def test_orphans_of_a_grown_segment_are_removed(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dataset_layout: int
    ) -> None:
        """A crashed run's unlisted file of a live segment is removed once the segment grew.

        The rerun writes the segment's frames under another byte range (the segment is
        longer now): the old file would hold its rows a second time. (In layout 2 the rerun
        writes a part of the same name, the orphan removed first.)
        """
        import ranklog.archive._compact as parquet

        run = rank(spool, 0, 1)
        log_steps(run, range(10))
        run.flush()  # a live segment: no seal
        out = tmp_path / "pq"

        def dying(*args: object) -> None:
            raise KeyboardInterrupt("killed")

        real = parquet.save_manifest
        monkeypatch.setattr(parquet, "save_manifest", dying)
        with pytest.raises(KeyboardInterrupt):
            compact(spool, out)
        assert len(list((out / "metrics").glob("*.parquet"))) == 1  # written, not listed
        monkeypatch.setattr(parquet, "save_manifest", real)
        log_steps(run, range(10, 20))
        run.close()
        compact(spool, out)
        compact(spool, tmp_path / "whole")
        assert _dataset(out) == _dataset(tmp_path / "whole")
        assert _table(out, "metrics").num_rows == 20

    @pytest.mark.parametrize("save_bytes", [0, 64 << 20])
    def test_failed_write_is_raised_and_never_listed(
        self,
        spool: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        save_bytes: int,
        dataset_layout: int,
    ) -> None:
        """A write that fails on the writer thread is raised; the manifest never lists its files.

        The rerun compacts what was not listed and ends equal to an uninterrupted run.
        """
        import ranklog.archive._compact as parquet
        import ranklog.archive._parts as parts

        monkeypatch.setattr(parquet, "SAVE_BYTES", save_bytes)
        monkeypatch.setattr(parquet, "BLOCK_BYTES", 2048)  # several blocks
        _job(spool)
        whole = tmp_path / "whole"
        compact(spool, whole)
        out = tmp_path / "pq"
        owner: Any = parts._Part
        name = "write"
        real = getattr(owner, name)
        calls = {"n": 0}

        def failing(*args: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device")
            return real(*args)

        monkeypatch.setattr(owner, name, failing)
        with pytest.raises(OSError, match="No space left"):
            compact(spool, out)
        listed = {f for e in load_manifest(out).segments.values() for f in e.files}
        assert all((out / f).is_file() for f in listed)
        monkeypatch.setattr(owner, name, real)
        compact(spool, out)
        assert _dataset(out) == _dataset(whole)


class TestDelete:
    def test_only_sealed_verified_segments(self, spool: Path, tmp_path: Path) -> None:
        """--delete removes sealed, verified segments and keeps unsealed ones (named why)."""
        _job(spool, close_last=False)
        out = tmp_path / "pq"
        result = compact(spool, out, delete=True)
        layout = SpoolLayout(spool)
        left = {(s.rank, s.incarnation) for s in layout.all_segments()}
        assert (2, 1) in left  # rank 2 never closed: its last segment is unsealed
        assert (1, 1) in left  # rank 1's first incarnation was killed: unsealed tail
        assert result.deleted and all("rlog" in p for p in result.deleted)
        assert any("not sealed" in k for k in result.kept)
        # the rows are still all in Parquet
        assert _table(out, "metrics").num_rows > 0

    def test_nan_and_negative_zero_verify(self, spool: Path, tmp_path: Path) -> None:
        """Segments with NaN, -0.0 and NaN in a histogram verify and are deleted."""
        run = rank(spool, 0, 1)
        for s in range(5):
            run.log_metrics({"loss": math.nan, "zero": -0.0, "x": 1.5}, step=s)
            run.log_histogram("h", [math.nan, 1.0, -0.0], step=s)
            run.step_end(s)
        run.close()
        result = compact(spool, tmp_path / "pq", delete=True)
        assert result.kept == [] and len(result.deleted) == 1

    def test_changed_bits_are_not_trusted(self, spool: Path, tmp_path: Path) -> None:
        """A value whose bits changed in Parquet (-0.0 written as 0.0) keeps its segment."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        run = rank(spool, 0, 1)
        for s in range(3):
            run.log_metrics({"zero": -0.0, "one": 1.0}, step=s)
            run.step_end(s)
        run.close()
        out = tmp_path / "pq"
        compact(spool, out)
        (f,) = (out / "metrics").glob("*.parquet")
        t = pq.read_table(f)
        i = t.schema.get_field_index("value")
        zeroed = pc.if_else(pc.equal(t["value"], 0.0), 0.0, t["value"])  # -0.0 -> 0.0
        pq.write_table(t.set_column(i, "value", zeroed), f)
        result = compact(spool, out, delete=True)
        assert result.deleted == [] and "metrics" in result.kept[0]

    def test_corrupt_parquet_is_not_trusted(self, spool: Path, tmp_path: Path) -> None:
        """A segment whose Parquet rows do not read back equal is kept."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        run.close()
        out = tmp_path / "pq"
        compact(spool, out)
        (f,) = (out / "metrics").glob("*.parquet")
        import pyarrow.parquet as pq

        t = pq.read_table(f)
        pq.write_table(t.slice(0, 3), f)  # rows lost after compaction
        result = compact(spool, out, delete=True)
        assert result.deleted == [] and "differ" in result.kept[0]
        assert SpoolLayout(spool).all_segments()

    def test_unshipped_segments_are_kept(self, spool: Path, tmp_path: Path) -> None:
        """A segment a shipper has not finished is not deleted from under it."""
        from .shiphelp import ship

        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(a, range(5))
        log_steps(b, range(2))
        a.close()
        ship(spool, tmp_path / "o.jsonl")  # steps 2..4 wait for rank 1
        b.close()
        result = compact(spool, tmp_path / "pq", delete=True)
        assert any("shipper" in k for k in result.kept)
