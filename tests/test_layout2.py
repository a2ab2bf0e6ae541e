"""Dataset layout 2: few part files per table, rows by step, merged crash-safely, read as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from ranklog.archive import compact, load_manifest, replay
from ranklog.archive._manifest import save_manifest
from ranklog.errors import ArchiveError, ConfigError
from ranklog.shippers.targets.jsonl import JsonlTarget

from .shiphelp import log_steps, rank, raw_files, ship
from .test_parquet import _dataset, _job


def _parts(out: Path, table: str = "metrics") -> list[Path]:
    return sorted((out / table).glob("*.parquet"))


def _grow(spool: Path, out: Path, ranks: int, rounds: int, steps: int = 5) -> None:
    """Live ranks that log ``steps`` more steps before each of ``rounds`` compactions."""
    runs = [rank(spool, r, ranks) for r in range(ranks)]
    for k in range(rounds):
        for run in runs:
            log_steps(run, range(k * steps, (k + 1) * steps))
        compact(spool, out)
    for run in runs:
        run.close()
    compact(spool, out)


class TestFiles:
    def test_one_part_per_table_for_many_segments(self, spool: Path, tmp_path: Path) -> None:
        """3 ranks of many small segments: one file per table, every row once."""
        _job(spool)
        out = tmp_path / "pq"
        result = compact(spool, out)
        assert load_manifest(out).layout == 2
        segments = len(load_manifest(out).segments)
        assert segments >= 6
        for table in ("metrics", "ranks", "timers", "params"):
            assert [p.name for p in _parts(out, table)] == ["part-000000.parquet"], table
        assert result.files == len(raw_files(out))

    def test_rows_of_a_block_are_sorted_by_step_each_event_whole(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """Within a block, steps never go down; rows of one step keep the order ranks wrote
        them (rank, then seq and idx), and an event's values stay together, as logged."""
        runs = [rank(spool, r, 2) for r in range(2)]
        for s in range(30):
            for run in runs:
                run.log_metrics({"z": 1.0, "a": 2.0, "m": 3.0}, step=s)
                run.step_end(s)
        for run in runs:
            run.close()
        out = tmp_path / "pq"
        compact(spool, out)
        t = pq.read_table(_parts(out)[0]).to_pylist()
        steps = [r["step"] for r in t]
        assert steps == sorted(steps)
        assert [r["name"] for r in t[:6]] == ["z", "a", "m"] * 2  # as logged, not sorted
        assert [r["rank"] for r in t[:6]] == [0, 0, 0, 1, 1, 1]

    def test_the_manifest_names_each_segments_row_groups(self, spool: Path, tmp_path: Path) -> None:
        """Every segment's pieces hold its rows, and its rows are in no other group."""
        _job(spool)
        out = tmp_path / "pq"
        compact(spool, out)
        pf = pq.ParquetFile(_parts(out)[0])
        seen: dict[tuple[int, int, int], set[int]] = {}
        for g in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(g, columns=["rank", "incarnation", "segment"])
            for key in set(zip(*(t[c].to_pylist() for c in t.column_names), strict=True)):
                seen.setdefault(key, set()).add(g)
        for key, entry in load_manifest(out).segments.items():
            rank_, inc, seg = (int(x) for x in key.split("-"))
            groups = {g for p, _, a, b in entry.pieces.get("metrics", []) for g in range(a, b)}
            assert seen.get((rank_, inc, seg), set()) <= groups, key

    def test_a_layout_1_dataset_is_read_not_written(self, tmp_path: Path) -> None:
        """A dataset of layout 1 (tests/data/schema5, an older release's): compaction into it
        is refused in one line naming what to do (nothing written); replay and analysis
        read it; `compact --steps` adds its steps table."""
        import shutil

        from ranklog.archive import write_steps

        data = Path(__file__).parent / "data" / "schema5"
        shutil.copytree(data, tmp_path / "f")
        ds = tmp_path / "f" / "dataset"
        before = sorted(p.relative_to(ds) for p in ds.rglob("*"))
        with pytest.raises(ConfigError, match=r"layout 1 .*no longer adds to it.*new directory"):
            compact(tmp_path / "f" / "spool", ds)
        assert sorted(p.relative_to(ds) for p in ds.rglob("*") if p.name != ".compact.lock") == (
            before)  # fmt: skip
        replay(ds, JsonlTarget(tmp_path / "r.jsonl"))
        assert (tmp_path / "r.jsonl").read_bytes() == (data / "expected.jsonl").read_bytes()
        assert write_steps(ds) is not None and load_manifest(ds).layout == 1

    def test_a_newer_layout_is_refused(self, spool: Path, tmp_path: Path) -> None:
        """A dataset of a layout this release does not know is refused, not mixed into."""
        _grow(spool, tmp_path / "pq", 1, 1)
        manifest = load_manifest(tmp_path / "pq")
        manifest.layout = 3
        save_manifest(tmp_path / "pq", manifest)
        with pytest.raises(ArchiveError, match="layout 3 is newer"):
            compact(spool, tmp_path / "pq")

    def test_duckdb_and_polars_read_it(self, spool: Path, tmp_path: Path) -> None:
        """A GROUP BY step mean in DuckDB and a step-range filter in Polars give the rows."""
        _grow(spool, tmp_path / "pq", 3, 2)
        glob = str(tmp_path / "pq" / "metrics" / "*.parquet")
        means = duckdb.sql(
            f"SELECT step, avg(value) AS v FROM read_parquet('{glob}') GROUP BY step ORDER BY step"
        ).fetchall()
        assert [s for s, _ in means] == list(range(10))
        assert means[3][1] == pytest.approx((0 + 1 + 2) / 3 + 3 / 1000)
        picked = pl.scan_parquet(glob).filter(pl.col("step").is_between(4, 6)).collect()
        assert sorted(set(picked["step"].to_list())) == [4, 5, 6]
        assert picked.height == 3 * 3


class TestMerge:
    def test_small_parts_are_merged(self, spool: Path, tmp_path: Path) -> None:
        """A live job compacted 12 times: its small parts are merged into one, every row
        once, and replay ships what live shipping shipped (on columns and event by event)."""
        out = tmp_path / "pq"
        _grow(spool, out, 3, 12)
        assert len(_parts(out)) <= 8
        assert _parts(out)[0].name.startswith("part-000000.g")
        compact(spool, tmp_path / "whole")
        assert _dataset(out) == _dataset(tmp_path / "whole")
        live, again = tmp_path / "live.jsonl", tmp_path / "again.jsonl"
        ship(spool, live)
        replay(out, JsonlTarget(again))
        assert again.read_bytes() == live.read_bytes()
        listed = {f for e in load_manifest(out).segments.values() for f in e.files}
        assert listed == {p.relative_to(out).as_posix() for p in raw_files(out)}

    def test_a_merge_killed_before_its_manifest_changes_nothing(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Killed after writing the merged files, before the manifest names them: the old
        parts still hold the data; the next run removes the merged files and merges again."""
        import ranklog.archive._merge as merge_mod

        out = tmp_path / "pq"
        real = merge_mod.save_manifest

        def killed(*args: Any) -> None:
            raise KeyboardInterrupt("killed")

        monkeypatch.setattr(merge_mod, "MAX_PARTS", 100)  # no merge while growing
        _grow(spool, out, 2, 9)
        before = _dataset(out)
        monkeypatch.setattr(merge_mod, "MAX_PARTS", 8)
        monkeypatch.setattr(merge_mod, "save_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            compact(spool, out)
        assert any(".g1." in p.name for p in out.rglob("*.parquet"))  # written, not listed
        monkeypatch.setattr(merge_mod, "save_manifest", real)
        compact(spool, out)
        assert _dataset(out) == before
        assert len(_parts(out)) == 1

    def test_a_merge_killed_before_removing_the_old_parts(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Killed after the manifest names the merged files, before the old parts are gone:
        the next run removes them; nothing is read twice."""
        import ranklog.archive._merge as merge_mod

        out = tmp_path / "pq"
        monkeypatch.setattr(merge_mod, "MAX_PARTS", 100)
        _grow(spool, out, 2, 9)
        before = _dataset(out)
        monkeypatch.setattr(merge_mod, "MAX_PARTS", 8)
        monkeypatch.setattr(merge_mod.Path, "unlink", _dies_once())
        with pytest.raises(KeyboardInterrupt):
            compact(spool, out)
        monkeypatch.undo()
        compact(spool, out)
        assert _dataset(out) == before
        assert len(_parts(out)) == 1


def _dies_once() -> Any:
    """A ``Path.unlink`` that is killed the first time it is called."""
    real = Path.unlink
    state = {"dead": False}

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if not state["dead"]:
            state["dead"] = True
            raise KeyboardInterrupt("killed")
        real(self, missing_ok=missing_ok)

    return unlink


class TestSteps:
    def test_analysis_sees_every_value_once_after_a_merge(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """The rows DuckDB counts per step after merges are those logged."""
        out = tmp_path / "pq"
        _grow(spool, out, 2, 10, steps=3)
        glob = str(out / "metrics" / "*.parquet")
        counts = dict(duckdb.sql(
            f"SELECT step, count(*) FROM read_parquet('{glob}') GROUP BY step"
        ).fetchall())  # fmt: skip
        assert counts == {s: 2 for s in range(30)}


class TestKept:
    def test_a_dataset_written_by_the_first_release_of_layout_2(self, tmp_path: Path) -> None:
        """tests/data/layout2 (compacted by the first release of layout 2 from
        tests/data/format1's spool) replays what shipping that spool gave, byte for byte,
        on columns and event by event."""
        data = Path(__file__).parent / "data"
        want = (data / "format1" / "expected.jsonl").read_bytes()
        got, by_events = tmp_path / "replay.jsonl", tmp_path / "events.jsonl"
        replay(data / "layout2" / "dataset", JsonlTarget(got))
        assert got.read_bytes() == want
        replay(data / "layout2" / "dataset", JsonlTarget(by_events), per_rank=False,
               names="*")  # fmt: skip
        assert by_events.read_bytes().splitlines()[1:] == want.splitlines()[1:]


class TestReviewed:
    def test_a_large_segment_closes_its_parts_as_it_goes(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """One segment larger than the save interval is compacted into several parts, the
        manifest saved between them (memory holds a few blocks, not the segment); the rows
        are those of one read."""
        import ranklog.archive._compact as compact_mod

        run = rank(spool, 0, 1)
        log_steps(run, range(400))
        run.close()
        compact(spool, tmp_path / "whole")
        monkeypatch.setattr(compact_mod, "BLOCK_BYTES", 1024)
        monkeypatch.setattr(compact_mod, "SAVE_BYTES", 4096)
        saves = []
        real = compact_mod.save_manifest
        monkeypatch.setattr(compact_mod, "save_manifest",
                            lambda *a: (saves.append(1), real(*a)))  # fmt: skip
        out = tmp_path / "pq"
        compact(spool, out)
        assert len(load_manifest(out).segments) == 1
        assert len(_parts(out)) >= 3  # (merged down to at most 8)
        assert len(saves) >= 3
        assert _dataset(out) == _dataset(tmp_path / "whole")

    def test_delete_decodes_each_shared_group_once(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """--delete's verification of many small segments sharing a block decodes each of
        the block's row groups once, not once per segment."""
        from ranklog.archive._files import Shared

        _job(spool)
        out = tmp_path / "pq"
        compact(spool, out)
        decoded: list[tuple[str, int]] = []
        real = Shared._split

        def spy(pf: Any, table: str, g: int) -> Any:
            decoded.append((table, g))
            return real(pf, table, g)

        monkeypatch.setattr(Shared, "_split", staticmethod(spy))
        result = compact(spool, out, delete=True, force=True)
        assert len(result.deleted) >= 6
        assert len(decoded) == len(set(decoded))

    def test_readers_leave_out_what_the_manifest_does_not_list(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A merge killed before its manifest leaves a merged part beside the parts it
        holds: ranklog's analysis and report read the listed files only, each value once."""
        import ranklog.archive._merge as merge_mod
        from ranklog import analysis, report
        from ranklog.archive import table_files

        out = tmp_path / "pq"
        monkeypatch.setattr(merge_mod, "MAX_PARTS", 100)
        _grow(spool, out, 2, 9)
        monkeypatch.setattr(merge_mod, "MAX_PARTS", 8)

        def killed(*args: Any) -> None:
            raise KeyboardInterrupt("killed")

        monkeypatch.setattr(merge_mod, "save_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            compact(spool, out)
        files = table_files(out, "metrics")
        assert isinstance(files, list)
        assert len(files) < len(_parts(out))  # the merged part is there, not listed
        assert analysis._table(out, "metrics", "loss").num_rows == 2 * 9 * 5
        assert report._read(out, "metrics", ["step"]).num_rows == 2 * 9 * 5


class TestOwners:
    def test_a_rank_with_two_segments_in_a_block_is_read_by_segment(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """A rank whose segments rolled over within one compaction has two segments in
        its block: replay equals live, from the steps table and from the raw rows."""
        from ranklog.archive._manifest import require_manifest

        runs = [rank(spool, r, 2, max_segment_bytes=4096) for r in range(2)]
        for s in range(60):
            for run in runs:
                run.log_metrics({"loss": s / 10, "acc": 1 - s / 100}, step=s)
                run.step_end(s)
        for run in runs:
            run.close()
        out = tmp_path / "pq"
        compact(spool, out)
        manifest = require_manifest(out)
        assert len(manifest.segments) > 2
        live, again, raw = (tmp_path / f"{n}.jsonl" for n in ("live", "again", "raw"))
        ship(spool, live)
        replay(out, JsonlTarget(again))
        assert again.read_bytes() == live.read_bytes()
        (out / "steps").rename(tmp_path / "aside")
        replay(out, JsonlTarget(raw))
        assert raw.read_bytes() == live.read_bytes()
