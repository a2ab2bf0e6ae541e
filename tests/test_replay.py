"""Replay of a compacted dataset gives exactly what live shipping gave."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ranklog.archive import compact, replay
from ranklog.cli import main
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.testing import crash

from .shiphelp import build_target, lines, live_and_replayed, log_steps, rank, ship

#: every replay here, from a dataset of each layout
pytestmark = pytest.mark.usefixtures("dataset_layout")


def _job(spool: Path) -> None:
    """4 ranks, a requeue, late and re-logged values, params mid-run, text, timers, NaN."""
    for r in range(4):
        run = rank(spool, r, 4, max_segment_bytes=8192)
        run.log_hyperparams({"lr": 0.1, "seed": r})
        for s in range(40):
            run.log_metrics({"loss": r + s / 100, "odd": math.nan if s == 7 else 1.0}, step=s)
            run.log_metrics({"tokens": 100.0 * (r + 1)}, step=s, reduce=("sum", "max", "std"))
            run.log_timing("step_time", 0.1 * (r + 1) + s / 1000, step=s)
            if s == 20:
                run.log_hyperparams({"lr": 0.05})
                run.log_text("val/sample", f"rank {r} says hi", step=s)
                run.log_table("val/results", ["q", "score"], [[f"r{r}", r / 2], [None, True]], s)
            run.step_end(s)
        if r == 2:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run.log_metrics({"loss": 1e9}, step=3)  # late
            crash(run)  # killed, then requeued from a checkpoint at step 35
            run = rank(spool, r, 4, max_segment_bytes=8192)
            for s in range(35, 45):
                run.log_metrics({"loss": 50.0 + s}, step=s)
                run.step_end(s)
        run.close()


class TestEquivalence:
    @pytest.mark.parametrize("late", ["count", "ship"])
    def test_jsonl_byte_for_byte(self, spool: Path, tmp_path: Path, late: str) -> None:
        """Live shipping and replay after compaction write the same JSONL bytes."""
        _job(spool)
        live, again = live_and_replayed(spool, tmp_path, late=late)
        assert live.read_bytes() == again.read_bytes()
        got = [x for x in lines(live) if "shipped_with" not in x]
        assert [x["step"] for x in got] == list(range(45))
        carried = [(x["step"], x["shipped_with"]) for x in lines(live) if "shipped_with" in x]
        # steps 35..39 logged again after the requeue (the late 1e9 died unflushed with rank 2)
        assert carried == ([(s, 40) for s in range(35, 40)] if late == "ship" else [])
        assert got[3]["metrics"]["loss"] == pytest.approx((0 + 1 + 2 + 3) / 4 + 0.03)  # no 1e9
        assert got[38]["metrics"]["loss"] == pytest.approx((0 + 1 + 2 + 3) / 4 + 0.38)  # first kept

    def test_minus_zero_everywhere(self, spool: Path, tmp_path: Path) -> None:
        """-0.0 on every rank ships -0.0 for mean and sum, live and replayed alike."""
        runs = [rank(spool, r, 3) for r in range(3)]
        for s in range(3):
            for run in runs:
                run.log_metrics({"z": -0.0, "w": -0.0 if run.rank else 0.0}, step=s)
                run.log_metrics({"t": -0.0}, step=s, reduce="sum")
                run.step_end(s)
        for run in runs:
            run.close()
        live, again = live_and_replayed(spool, tmp_path)
        assert live.read_bytes() == again.read_bytes()
        for x in lines(live):
            z, w, t = x["metrics"]["z"], x["metrics"]["w"], x["metrics"]["t"]
            assert math.copysign(1, z) < 0 and math.copysign(1, t) < 0  # every rank -0.0
            assert math.copysign(1, w) > 0  # one rank +0.0: +0.0, as IEEE adds them

    def test_replay_twice_adds_nothing(self, spool: Path, tmp_path: Path) -> None:
        """Replaying into a target that has everything sends nothing again."""
        _job(spool)
        compact(spool, tmp_path / "pq")
        out = tmp_path / "r.jsonl"
        replay(tmp_path / "pq", JsonlTarget(out))
        first = out.read_bytes()
        replay(tmp_path / "pq", JsonlTarget(out))
        assert out.read_bytes() == first


class TestReading:
    @pytest.mark.parametrize(("rows_per_read", "by_group"), [(8192, True), (1, False)])
    def test_small_row_groups_and_a_cache_that_holds_one(
        self,
        spool: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        rows_per_read: int,
        by_group: bool,
        dataset_layout: int,
    ) -> None:
        """Row groups of 7 rows (frames cut by their ends) replay byte for byte with a cache
        that holds one group: read by group, and, when a group is larger than four reads
        (datasets compacted with large row groups), read whole. In layout 2, blocks of a
        few frames each (groups a segment has to itself, read by group), or of every
        segment (groups they share, read whole), with a cache of shared groups that holds
        one."""
        import ranklog.archive._compact as compact_mod
        import ranklog.archive._replay as replay_mod
        from ranklog.archive._files import RowGroups

        monkeypatch.setattr(compact_mod, "ROW_GROUP", 7)
        monkeypatch.setattr(replay_mod, "_CACHE_BYTES", 1)
        monkeypatch.setattr(replay_mod, "_SHARED_BYTES", 1)
        if by_group:
            monkeypatch.setattr(compact_mod, "BLOCK_BYTES", 512)
        monkeypatch.setattr(replay_mod, "_ROWS_PER_READ", rows_per_read)
        monkeypatch.setattr(replay_mod, "whole_table", lambda *a: None)  # the raw rows
        _job(spool)
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        ship(spool, live)
        compact(spool, tmp_path / "pq")
        made: list[RowGroups | None] = []
        real_of = RowGroups.of

        def spy(*args: object, **kwargs: object) -> RowGroups | None:
            got = real_of(*args, **kwargs)  # type: ignore[arg-type]
            made.append(got)
            return got

        monkeypatch.setattr(RowGroups, "of", spy)
        replay(tmp_path / "pq", JsonlTarget(again))
        assert live.read_bytes() == again.read_bytes()
        if by_group:
            assert max(len(g.firsts) for g in made if g is not None) > 10
        else:
            assert any(g is None for g in made)  # groups of 7 rows > 4 reads of 1: whole

    def test_reads_stay_small_when_metrics_are_sparse(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A read aligned to a metrics row group still stops after 4 reads' worth of rows
        of every table (one metric every 50 steps, 6 timers every step)."""
        import ranklog.archive._replay as replay_mod
        from ranklog.archive import _rows

        monkeypatch.setattr(replay_mod, "_ROWS_PER_READ", 64)
        monkeypatch.setattr(replay_mod, "whole_table", lambda *a: None)  # the raw rows
        run = rank(spool, 0, 1)
        for s in range(400):
            if s % 50 == 0:
                run.log_metrics({"loss": float(s)}, step=s)
            for t in range(6):
                run.log_timing(f"t{t}", 0.1 * t, step=s)
            run.step_end(s)
        run.close()
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        ship(spool, live)
        compact(spool, tmp_path / "pq")
        sizes: list[int] = []
        real = _rows.frame_events

        def spy(tables: dict[str, object], *args: object, **kwargs: object) -> object:
            sizes.append(sum(t.num_rows for t in tables.values() if t is not None))  # type: ignore[attr-defined]
            return real(tables, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(replay_mod, "frame_events", spy)
        replay(tmp_path / "pq", JsonlTarget(again))
        assert live.read_bytes() == again.read_bytes()
        assert len(sizes) > 5 and max(sizes) <= 4 * 64 + 7  # + the rows of one frame

    def test_files_the_manifest_does_not_list_are_left_out(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """A file a crashed compaction wrote but never listed is not replayed."""
        _job(spool)
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        ship(spool, live)
        compact(spool, tmp_path / "pq")
        one = sorted((tmp_path / "pq" / "metrics").glob("*.parquet"))[0]
        stem, _, _ = one.stem.rpartition("-")
        (one.parent / f"{stem}-999999999999.parquet").write_bytes(one.read_bytes())
        replay(tmp_path / "pq", JsonlTarget(again))
        assert live.read_bytes() == again.read_bytes()

    def test_files_out_of_order_are_read_whole(self, spool: Path, tmp_path: Path) -> None:
        """Row groups whose seq ranges do not follow each other are not read by group."""
        from ranklog.archive._files import GroupCache, Piece, RowGroups
        from ranklog.archive._rows import COLUMNS
        from ranklog.spool import SegmentId

        run = rank(spool, 0, 1)
        for half in (range(10), range(10, 20)):  # compacted twice: two files, one segment
            for s in half:
                run.log_metrics({"loss": float(s)}, step=s)
                run.step_end(s)
            run.flush()
            compact(spool, tmp_path / "pq")
        run.close()
        paths = sorted((tmp_path / "pq" / "metrics").glob("*.parquet"))
        assert len(paths) == 2
        files = [Piece.whole(p, SegmentId(0, 1, 1)) for p in paths]
        cache = GroupCache(1 << 20)
        assert RowGroups.of(files, "metrics", COLUMNS["metrics"], cache, 1 << 20) is not None
        assert RowGroups.of(files[::-1], "metrics", COLUMNS["metrics"], cache, 1 << 20) is None


class TestSelection:
    def test_steps_and_names(
        self, spool: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """--steps A:B and --names GLOB replay a part, through the CLI."""
        runs = [rank(spool, r, 2) for r in range(2)]
        for run in runs:
            for s in range(10):
                run.log_metrics({"loss": 1.0, "acc": 0.5}, step=s, prefix="train")
                run.log_metrics({"loss": 2.0}, step=s, prefix="val")
                run.step_end(s)
            run.close()
        assert main(["compact", str(spool), "--out", str(tmp_path / "pq")]) == 0
        out = tmp_path / "part.jsonl"
        argv = ["replay", str(tmp_path / "pq"), "--to", f"jsonl:{out}", "--steps", "3:6"]
        assert main([*argv, "--names", "train/*"]) == 0
        got = lines(out)
        assert [x["step"] for x in got] == [3, 4, 5]
        assert all(set(x["metrics"]) == {"train/loss", "train/acc"} for x in got)
        assert "replayed" in capsys.readouterr().out

    def test_replay_of_a_live_run(self, spool: Path, tmp_path: Path) -> None:
        """A rank that never ended is treated as ended: its closed steps replay."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        compact(spool, tmp_path / "pq")
        out = tmp_path / "r.jsonl"
        replay(tmp_path / "pq", JsonlTarget(out))
        assert [x["step"] for x in lines(out)] == list(range(5))
        run.close()


def _tb_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same(a: dict[str, list[tuple[int, float]]], b: dict[str, list[tuple[int, float]]]) -> bool:
    def norm(x: dict[str, list[tuple[int, float]]]) -> object:
        return {t: [(s, "nan" if math.isnan(v) else v) for s, v in pts] for t, pts in x.items()}

    return norm(a) == norm(b)


class TestBackends:
    def test_tensorboard_values(self, spool: Path, tmp_path: Path) -> None:
        """Live shipping and replay give TensorBoard the same scalars at the same steps."""
        from ranklog.shippers import Shipper
        from ranklog.shippers.targets.tensorboard import TensorBoardTarget

        _job(spool)
        Shipper(
            str(spool), TensorBoardTarget(tmp_path / "live"), name="tb", start_grace=0
        ).run_forever(once=True)
        compact(spool, tmp_path / "pq")
        replay(tmp_path / "pq", TensorBoardTarget(tmp_path / "again"))
        live, again = _tb_scalars(tmp_path / "live"), _tb_scalars(tmp_path / "again")
        assert live and _same(live, again)
        assert [s for s, _ in live["loss"]] == list(range(45))

    def test_mlflow_values(self, spool: Path, tmp_path: Path) -> None:
        """Live shipping and replay give MLflow the same points."""
        from mlflow.tracking import MlflowClient

        from ranklog.shippers import Shipper

        _job(spool)
        compact(spool, tmp_path / "pq")
        got = {}
        for label in ("live", "again"):
            uri = f"sqlite:///{tmp_path / label}.db"
            target = build_target("mlflow", uri, spool, dict())
            if label == "live":
                Shipper(str(spool), target, name="ml", start_grace=0).run_forever(once=True)
            else:
                replay(tmp_path / "pq", target)
            client = MlflowClient(tracking_uri=uri)
            (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
            got[label] = {
                key: sorted(
                    (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
                )
                for key in run.data.metrics
            }
        norm = {
            k: {m: [(s, "nan" if math.isnan(v) else v) for s, v in pts] for m, pts in d.items()}
            for k, d in got.items()
        }
        assert norm["live"] == norm["again"] and len(norm["live"]["loss"]) == 45


class TestRelogged:
    def test_marked_in_parquet_and_both_branches_replay(self, spool: Path, tmp_path: Path) -> None:
        """Re-logged rows are marked in Parquet; --relogged picks the first or the last values."""
        import pyarrow.dataset as ds

        other = rank(spool, 1, 2)
        first = rank(spool, 0, 2)
        for s in range(10):
            first.log_metrics({"loss": float(s)}, step=s)
            first.step_end(s)
        crash(first)  # killed after step 9; requeued from a checkpoint at step 6
        second = rank(spool, 0, 2)
        for s in range(6, 12):
            second.log_metrics({"loss": 100.0 + s}, step=s)
            second.step_end(s)
        second.close()
        log_steps(other, range(12))
        other.close()
        compact(spool, tmp_path / "pq")
        rows = ds.dataset(tmp_path / "pq" / "metrics").to_table().to_pylist()
        marked = {(r["incarnation"], r["step"]) for r in rows if r["relogged"]}
        assert marked == {(2, 6), (2, 7), (2, 8), (2, 9)}
        for mode, expect in (("first", 8.0), ("last", 108.0)):
            out = tmp_path / f"{mode}.jsonl"
            argv = ["replay", str(tmp_path / "pq"), "--to", f"jsonl:{out}", "--relogged", mode]
            assert main(argv) == 0
            got = {x["step"]: x["metrics"]["loss"] for x in lines(out)}
            assert sorted(got) == list(range(12))
            assert got[8] == pytest.approx((expect + 1 + 0.008) / 2), mode
            assert got[11] == pytest.approx((111.0 + 1 + 0.011) / 2)


@pytest.mark.parametrize(
    ("world", "steps"),
    [(1, (4, 7, 2**62)), (1, (4, 7, 2**63 - 1)), (2, (4, 7, 2**62)), (2, (0, 2**63 - 1)),
     (1, (5,))],
    ids=["one-2**62", "one-max", "two-2**62", "two-max", "single-step"],
)  # fmt: skip
def test_sparse_and_huge_steps_replay_as_live(
    tmp_path: Path, world: int, steps: tuple[int, ...]
) -> None:
    """Steps far apart, up to 2**63-1 (the planned replay once recursed for ever, then
    overflowed): replay ships what live shipping shipped, byte for byte."""
    import ranklog

    from .shiphelp import live_and_replayed

    spool = tmp_path / "spool"
    for r in range(world):
        with ranklog.init(spool, rank=r, world_size=world, handle_signals=False) as run:
            for s in steps:
                run.log_metrics({"x": float(s % 1000) + r}, step=s)
                run.step_end(s)
    live, again = live_and_replayed(spool, tmp_path)
    assert [json.loads(x)["step"] for x in live.read_text().splitlines()[1:]] == list(steps)
    assert again.read_bytes() == live.read_bytes()
