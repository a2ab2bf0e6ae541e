"""Replay on columns gives byte for byte what the event path and live shipping give."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ranklog.archive._columnar as columnar_mod
import ranklog.archive._compact as compact_mod
import ranklog.archive._replay as replay_mod
import ranklog.archive._spill as spill_mod
import ranklog.archive._windows as windows_mod
from ranklog._kept import Kept
from ranklog.archive import compact, replay
from ranklog.archive._files import GroupCache
from ranklog.archive._manifest import load_manifest
from ranklog.archive._plan import plan
from ranklog.archive._replay import _segment_files
from ranklog.archive._spill import ROW, Spill
from ranklog.errors import ArchiveError
from ranklog.schemas import (
    Event,
    Gpu,
    Histogram,
    Image,
    Metrics,
    Params,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
    Table,
    Text,
    Timer,
)
from ranklog.shippers import ShippedStep
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import IncarnationWriter, RunInfo, SpoolLayout, ensure_run

from .shiphelp import lines, ship
from .spoolgen import write_frame

#: every dataset here, in each layout
pytestmark = pytest.mark.usefixtures("dataset_layout")

T0 = 1_000_000.0  # exact in microseconds, as every offset below
SPECS = ["mean", "sum", "min", "max", "last", "median", "std", "count", "mean,max", "last,min"]
STEP_EVENTS = (Metrics, Timer, Text, Histogram, Image, Table)
SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e16, 1.0]


def _value(rng: random.Random) -> float:
    if rng.random() < 0.08:
        return rng.choice(SPECIAL)
    return rng.choice([rng.uniform(-1e3, 1e3), float(rng.randrange(-5, 5)), rng.random() * 1e-9])


def _step_events(rng: random.Random, step: int, names: list[str]) -> list[Event]:
    """One rank's events for a step: one to three Metrics (names may repeat), timers."""
    out: list[Event] = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        picked = rng.sample(names, rng.randrange(1, len(names) + 1))
        reduce: str | dict[str, str] = rng.choice(SPECS[:3]) if rng.random() < 0.8 else {
            n: rng.choice(SPECS) for n in picked if rng.random() < 0.7
        }  # fmt: skip
        ts = T0 + step + rng.choice([0.0, 0.25, 0.5])  # ties across ranks, for `last`
        out.append(Metrics(ts, step, {n: _value(rng) for n in picked}, reduce))
    for name in rng.sample(["fwd", "bwd"], rng.randrange(0, 3)):
        seconds = rng.choice([0.5, 0.25, rng.random(), math.nan])
        out.append(Timer(T0 + step + 0.5, step, name, seconds, rng.choice(["mean", "max,min"])))
    ts = T0 + step + 0.5
    if rng.random() < 0.1:
        out.append(Text(ts, step, "val/sample", f"step {step} says {rng.random()}"))
    if rng.random() < 0.1:
        out.append(Histogram(ts, step, "grads", [_value(rng) for _ in range(rng.randrange(4))]))
    if rng.random() < 0.05:
        out.append(Image(ts, step, "plot", bytes([step % 256]) * 3, "png"))
    if rng.random() < 0.05:
        out.append(
            Table(ts, step, "val/results", ["q", "score"], [[f"q{step}", 0.5], [None, True]])
        )
    return out


def _gpu(rng: random.Random, step: int | None) -> list[Event]:
    """Samples of two GPUs (a field missing now and then), for ``step`` or the current one."""
    ts = T0 + (step or 0) + rng.choice([0.125, 0.875])
    return [
        Gpu(ts, "node", i, util=rng.choice([None, 50.0, 99.5]), mem_used=1000 + i,
            mem_total=4000, temp=rng.choice([None, 60.0]), power=300.0, step=step, name="H200")
        for i in range(2)
    ]  # fmt: skip


def _writer(
    spool: Path, rank: int, world: int, rng: random.Random, *, known: bool = True
) -> IncarnationWriter:
    info = ensure_run(spool, world_size=world if known else None)
    w = IncarnationWriter.create(
        SpoolLayout(spool), info, rank, world_size=world,
        max_segment_bytes=rng.choice([1500, 4096, 1 << 20]),
    )  # fmt: skip
    start = RankStart(T0, info.run_id, rank, world, rank, "node", 100 + rank, w.incarnation, "t")
    write_frame(w, [start])
    return w


def _job(spool: Path, seed: int, *, ends: str = "ok", params_ranks: int = 1,
         extra: dict[int, list[Event]] | None = None, phases: int = 2,
         config: dict[int, list[dict[str, Any]]] | None = None,
         world: int | None = None) -> int:  # fmt: skip
    """A job whose ranks log in order (random names, specs, frames); returns its steps.

    ``ends``: "ok" (every rank writes rank_end ok), or "mixed" (some end by a signal,
    some die without an end, some stop early). ``extra``: events appended to rank 0's
    frame of step 2 (to break the plan). ``config``: rank -> params events it logs before
    its first step. ``world``: how many ranks (else a random 1 to 5). Compacted after each
    of ``phases`` parts.
    """
    rng = random.Random(seed)
    world = world or rng.randrange(1, 6)
    steps = rng.randrange(4, 40)
    names = [f"m{i}" for i in range(rng.randrange(1, 6))]
    stops = {r: steps for r in range(world)}
    if ends == "mixed":
        for r in range(world):
            if rng.random() < 0.4:
                stops[r] = rng.randrange(1, steps)
    declared, known = world, True
    if ends == "mixed":  # a rank that never starts; the world size from rank_start alone
        declared, known = world + rng.randrange(2), bool(seed % 2)
    writers = {r: _writer(spool, r, declared, rng, known=known) for r in range(world)}
    for r, w in writers.items():
        for values in (config or {}).get(r, []):
            write_frame(w, [Params(T0, values)])
    for phase in range(phases):
        lo, hi = steps * phase // phases, steps * (phase + 1) // phases
        for r, w in writers.items():
            frame: list[Event] = []
            for s in range(lo, min(hi, stops[r])):
                evs = _step_events(rng, s, names)
                if r < params_ranks and rng.random() < 0.15:
                    evs.insert(rng.randrange(len(evs) + 1),
                               Params(T0 + s, {"lr": rng.random(), f"p{s % 3}": s}))  # fmt: skip
                if r == 0 and s == 2 and extra:
                    evs.extend(extra.get(s, []))
                counted = sum(1 for e in evs if isinstance(e, STEP_EVENTS))
                evs.append(StepEnd(T0 + s + 0.75, s, counted if rng.random() < 0.7 else -1))
                if r % 2 == 0 and rng.random() < 0.3:  # GPU samples between steps
                    evs.extend(_gpu(rng, s + 1 if rng.random() < 0.2 else None))
                frame.extend(evs)
                if rng.random() < 0.6:
                    write_frame(w, frame)
                    frame = []
            if frame:
                write_frame(w, frame)
        compact(spool, spool.parent / "pq")
    for w in writers.values():
        how = "ok" if ends == "ok" else rng.choice(["ok", "signal", "none"])
        if how == "none":
            w.abandon()
            continue
        write_frame(w, [*_gpu(rng, None), RankEnd(T0 + steps + 1, how, 0)])
        w.close()
    compact(spool, spool.parent / "pq")
    return steps


def _planned(dataset: Path) -> tuple[bool, str]:
    manifest = load_manifest(dataset)
    found, why = plan(_segment_files(dataset, manifest), manifest, GroupCache(1 << 20))
    return found is not None, why


class _Recorder:
    """A target that keeps every call, each step encoded whole (its time stamp included)."""

    kind = "record"
    spec = "record:"
    takes_late = True

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def open(self, run: RunInfo) -> int | None:
        return None

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self.calls.append(msgspec.msgpack.encode({"params": params}))

    def write(self, steps: list[ShippedStep]) -> None:
        self.calls.extend(msgspec.msgpack.encode(s) for s in steps)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def _replays(dataset: Path, out: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> bytes:
    """The JSONL of a replay on columns, checked equal to the event path's (and every
    field of every step the target got, time stamps too); returned."""
    fast, slow = out / "columnar.jsonl", out / "events.jsonl"
    fast_rec, slow_rec = _Recorder(), _Recorder()
    replay(dataset, JsonlTarget(fast), **kw)
    replay(dataset, fast_rec, **kw)
    with monkeypatch.context() as m:
        m.setattr(replay_mod, "scan", lambda *a, **k: (None, "the event path, for comparison"))
        replay(dataset, JsonlTarget(slow), **kw)
        replay(dataset, slow_rec, **kw)
    assert fast.read_bytes() == slow.read_bytes()
    assert fast_rec.calls == slow_rec.calls
    return fast.read_bytes()


def _event_path(dataset: Path, out: Path, monkeypatch: pytest.MonkeyPatch, why: str) -> bytes:
    """The plan refuses ``dataset`` for ``why``; its replay (event by event) is returned."""
    planned, reason = _planned(dataset)
    assert not planned
    assert why in reason
    return _replays(dataset, out, monkeypatch)


def _closed_replayed_live(
    runs: list[Any], spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> bytes:
    """``runs`` closed, their spool compacted and planned on columns, and replayed (both
    ways, the same bytes) as live shipping ships it; the JSONL."""
    for run in runs:
        run.close()
    compact(spool, tmp_path / "pq")
    assert _planned(tmp_path / "pq") == (True, "")
    got = _replays(tmp_path / "pq", tmp_path, monkeypatch)
    live = tmp_path / "live.jsonl"
    ship(spool, live)
    assert got == live.read_bytes()
    return got


class TestSameBytes:
    @pytest.mark.parametrize("seed", range(12))
    def test_random_plain_jobs(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
    ) -> None:
        """Random jobs (NaN, inf, -0.0, ties, mixed specs, several events and segments,
        params, texts, distributions, images, tables, GPU samples): the columnar replay
        writes the event path's bytes and live shipping's."""
        _job(spool, seed)
        assert _planned(tmp_path / "pq") == (True, "")
        got = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert got == live.read_bytes()
        assert lines(live)

    def test_usual_steps_as_columns_beside_the_others(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Usual steps (one summable spec, one lowest rank, finite totals: reduced as
        columns) among steps that are not (a name only a later rank logs, a NaN, an
        infinity, -0.0 everywhere, ``max``, a timer), in one window: the bytes of the event
        path and of live shipping."""
        import ranklog

        runs = [ranklog.init(spool, rank=r, world_size=3, handle_signals=False) for r in range(3)]
        for step in range(40):
            for r, run in enumerate(runs):
                values = {"a": step + r / 4, "b": 1e300 * (r + 1) if step == 21 else -r}
                spec = "sum" if step % 7 == 0 else "max" if step == 11 else "mean"
                if step == 5 and r == 1:
                    values["c"] = 2.0  # its lowest rank is 1, not 0
                if step == 9:
                    values["a"] = math.nan
                if step == 10:
                    values["a"] = math.inf if r == 2 else 1.0
                if step == 13:
                    values = {"z": -0.0}
                run.log_metrics(values, step=step, reduce=spec)
                if step == 15:
                    run.log_timing("fwd", 0.1 * r, step=step)
                run.step_end(step)
        got = _closed_replayed_live(runs, spool, tmp_path, monkeypatch)
        (z,) = [x["metrics"]["z"] for x in map(json.loads, got.splitlines()) if x.get("step") == 13]
        assert math.copysign(1.0, z) < 0

    @pytest.mark.parametrize("seed", range(100, 108))
    def test_ranks_that_stop_early_die_or_are_signalled(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
    ) -> None:
        """Ranks that stop early, end on a signal, die unsealed or never start, a world size
        known from rank_start alone: partial steps and ``ranks_reporting`` as on the event
        path."""
        _job(spool, seed, ends="mixed")
        assert _planned(tmp_path / "pq") == (True, "")
        _replays(tmp_path / "pq", tmp_path, monkeypatch)

    @pytest.mark.parametrize("stops", [(4, 2), (2, 4), (6, 3, 1), (5, 5, 2, 5)])
    def test_ranks_of_one_list_of_names_that_stop_early(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stops: tuple[int, ...]
    ) -> None:
        """Ranks that log the same names every step, some stopping before the others (steps
        of a window with fewer ranks than its first): the columnar replay writes live
        shipping's bytes (it raised, before the transposed order checked its step counts)."""
        import ranklog

        world = len(stops)
        runs = [ranklog.init(spool, rank=r, world_size=world, handle_signals=False)
                for r in range(world)]  # fmt: skip
        for step in range(max(stops)):
            for r, run in enumerate(runs):
                if step < stops[r]:
                    run.log_metrics({"a": 1.0 + step, "b": 2.0 * r}, step=step)
                    run.step_end(step)
        got = _closed_replayed_live(runs, spool, tmp_path, monkeypatch)
        assert len(got.splitlines()) == max(stops) + 1  # (and the run's line)

    @pytest.mark.parametrize("seed", range(200, 204))
    def test_tiny_windows_row_groups_and_cache(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
    ) -> None:
        """Windows of a step over row groups of 5 rows, with a cache that holds nothing:
        groups are read by several windows and their steps still reduce together."""
        monkeypatch.setattr(compact_mod, "ROW_GROUP", 5)
        monkeypatch.setattr(windows_mod, "WINDOW_BYTES", 1)  # a step or so a window
        monkeypatch.setattr(replay_mod, "_CACHE_BYTES", 1)
        monkeypatch.setattr(windows_mod, "_OPEN", 1)
        _job(spool, seed)
        assert _planned(tmp_path / "pq") == (True, "")
        got = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert got == live.read_bytes()

    def test_late_ship_and_relogged_last_change_nothing(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With nothing late and one incarnation per rank, ``late="ship"`` and
        ``relogged="last"`` replay on columns too, the same bytes."""
        _job(spool, 7)
        plain = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        for kw in ({"late": "ship"}, {"relogged": "last"}):
            assert _replays(tmp_path / "pq", tmp_path, monkeypatch, **kw) == plain


class TestParams:
    CONFIG: ClassVar = [
        {"model": "tiny", "layers": 4},
        {"optim.lr": 3e-4, "tags": "a,b", "seed": None},
    ]

    @pytest.mark.parametrize("seed", [300, 301, 302])
    def test_one_config_logged_by_every_rank(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
    ) -> None:
        """Every rank logs the same config at the start (as most scripts do): replayed on
        columns, params lines where and as live shipping wrote them."""
        _job(spool, seed, params_ranks=0, config={r: self.CONFIG for r in range(6)})
        assert _planned(tmp_path / "pq") == (True, "")
        got = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert got == live.read_bytes()
        assert b'"params": {"model": "tiny"' in got

    @pytest.mark.parametrize(
        ("other", "why"),
        [
            ([{"model": "tiny", "layers": 4.0}, CONFIG[1]], "params differ"),  # 4.0 is not 4
            ([*CONFIG, {"layers": 5}], "params differ"),
            ([*CONFIG, {"layers": 4}], "params logged again"),
        ],
    )
    def test_configs_that_differ_go_event_by_event(
        self,
        spool: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        other: list[dict[str, Any]],
        why: str,
    ) -> None:
        """Ranks whose params differ (even as 4 against 4.0), or that log a key again: what
        the engine ships depends on the order it reads them in, so the event path decides."""
        config = {0: other, 1: other} if "again" in why else {0: self.CONFIG, 1: other}
        _job(spool, 400, params_ranks=0, config=config, phases=1, world=2)
        _event_path(tmp_path / "pq", tmp_path, monkeypatch, why)


class TestEventPath:
    @pytest.mark.parametrize(
        ("extra", "config", "why"),
        [
            ({2: [Metrics(T0 + 9, 1, {"m0": 5.0})]}, None, "late values"),
            ({2: _gpu(random.Random(0), 0)}, None, "GPU samples for steps it had closed"),
            (None, {0: [{"lr": 0.1}], 1: [{"lr": 0.2}]}, "params differ"),
        ],
    )
    def test_departures_go_event_by_event(
        self,
        spool: Path,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        extra: dict[int, list[Event]] | None,
        config: dict[int, list[dict[str, Any]]] | None,
        why: str,
    ) -> None:
        """A late value, a GPU sample for a closed step, params that differ between ranks:
        the plan says why, and replay (event by event) still equals live shipping."""
        _job(spool, 3, params_ranks=0, extra=extra, phases=1, config=config, world=3)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert _event_path(tmp_path / "pq", tmp_path, monkeypatch, why) == live.read_bytes()

    def test_a_requeued_rank(self, spool: Path, tmp_path: Path) -> None:
        """Two incarnations of a rank: the event path decides which values count."""
        info = ensure_run(spool, world_size=1)
        for inc_steps in (range(5), range(3, 8)):
            w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=1)
            for s in inc_steps:
                write_frame(w, [Metrics(T0 + s, s, {"x": float(s)}), StepEnd(T0 + s, s, 1)])
            w.close()
        compact(spool, tmp_path / "pq")
        assert _planned(tmp_path / "pq") == (False, "rank 0 has several incarnations")

    def test_lost_frames_and_wrong_counts(self, spool: Path, tmp_path: Path) -> None:
        """A frame with no rows (numbers skip) or a step_end counting other events than
        the dataset holds: the event path marks the steps partial, so the plan refuses."""
        info = ensure_run(spool, world_size=1)
        w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=1)
        write_frame(w, [Metrics(T0, 0, {"x": 1.0}), StepEnd(T0, 0, 1)])
        write_frame(w, [Metrics(T0 + 1, 1, {})])  # no values: no row, its frame unseen
        write_frame(w, [Metrics(T0 + 1, 1, {"x": 2.0}), StepEnd(T0 + 1, 1, 2)])
        w.close()
        compact(spool, tmp_path / "pq")
        planned, why = _planned(tmp_path / "pq")
        assert not planned and "frames are missing" in why
        spool2, pq2 = tmp_path / "s2", tmp_path / "pq2"
        info = ensure_run(spool2, world_size=1)
        w = IncarnationWriter.create(SpoolLayout(spool2), info, 0, world_size=1)
        write_frame(w, [Metrics(T0, 0, {"x": 1.0}), StepEnd(T0, 0, 3)])
        w.close()
        compact(spool2, pq2)
        planned, why = _planned(pq2)
        assert not planned and "counts other events" in why


class TestWindows:
    def test_windows_fit_uneven_steps(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Steps crowded at the start and a few far away: each window holds about
        WINDOW_BYTES (never the crowd at once), and the result is the event path's."""
        monkeypatch.setattr(compact_mod, "ROW_GROUP", 50)
        info = ensure_run(spool, world_size=2)
        for r in range(2):
            w = IncarnationWriter.create(SpoolLayout(spool), info, r, world_size=2)
            steps = [*range(300), 100_000, 100_001, 5_000_000]
            for s in steps:
                values = {f"m{k}": float(s * k + r) for k in range(10 if s < 300 else 1)}
                write_frame(w, [Metrics(T0 + s, s, values), StepEnd(T0 + s, s, 1)])
            w.close()
        compact(spool, tmp_path / "pq")
        meta = pq.ParquetFile(sorted((tmp_path / "pq" / "metrics").glob("*.parquet"))[0]).metadata
        per_row = meta.row_group(0).total_byte_size / meta.row_group(0).num_rows
        monkeypatch.setattr(windows_mod, "WINDOW_BYTES", int(200 * per_row))  # ~200 rows
        sizes: list[int] = []
        real = columnar_mod.ColumnarTails._reduce

        def spy(self: Any, built: Any, lo: int, cols: Any, *, timers: bool) -> None:
            sizes.append(len(cols[2]))
            real(self, built, lo, cols, timers=timers)

        monkeypatch.setattr(columnar_mod.ColumnarTails, "_reduce", spy)
        assert _planned(tmp_path / "pq") == (True, "")
        _replays(tmp_path / "pq", tmp_path, monkeypatch)
        assert sum(sizes) == 2 * (2 * (300 * 10 + 3))  # both replays: every row once
        assert max(sizes) <= 2 * 200 + 2 * 50  # + what one group per lane may overshoot
        assert len([n for n in sizes if n]) >= 2 * 6

    def test_windows_hold_at_most_window_steps(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """One rank with many small steps: WINDOW_BYTES would take them all at once, each
        window takes at most WINDOW_STEPS, and the result is the event path's."""
        monkeypatch.setattr(compact_mod, "ROW_GROUP", 50)
        info = ensure_run(spool, world_size=1)
        w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=1)
        for s in range(500):
            write_frame(w, [Metrics(T0 + s, s, {"a": s / 3, "b": -s}), StepEnd(T0 + s, s, 1)])
        w.close()
        compact(spool, tmp_path / "pq")
        monkeypatch.setattr(windows_mod, "WINDOW_STEPS", 64)
        spans: list[int] = []
        real = windows_mod.Loader.next

        def spy(self: Any) -> Any:
            window = real(self)
            if window is not None:
                spans.append(window.hi - window.lo)
            return window

        monkeypatch.setattr(windows_mod.Loader, "next", spy)
        assert _planned(tmp_path / "pq") == (True, "")
        _replays(tmp_path / "pq", tmp_path, monkeypatch)
        assert spans and max(spans) <= 64 and len(spans) >= 500 // 64


class TestDecodedOnce:
    @staticmethod
    def _tiny(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
        """Row groups of 50 rows, windows of a step or so; the groups decoded, recorded."""
        monkeypatch.setattr(compact_mod, "ROW_GROUP", 50)
        monkeypatch.setattr(windows_mod, "WINDOW_BYTES", 1)
        decoded: list[tuple[str, int]] = []
        real = windows_mod.Loader._decode

        def spy(self: Any, rank: int, groups: Any) -> Any:
            decoded.extend((g.path.name, g.index) for g in groups)
            return real(self, rank, groups)

        monkeypatch.setattr(windows_mod.Loader, "_decode", spy)
        return decoded

    def test_each_group_is_decoded_once(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Windows much narrower than a row group: every metrics and timers row group is
        decoded by one window, the others take its rows from what it left, and the result
        is live shipping's."""
        decoded = self._tiny(monkeypatch)
        _job(spool, 7, world=4)
        dataset = tmp_path / "pq"
        groups = [
            (f.name, i)
            for table in ("metrics", "timers")
            for f in sorted((dataset / table).glob("*.parquet"))
            for i in range(pq.ParquetFile(f).metadata.num_row_groups)
            if pq.ParquetFile(f).metadata.row_group(i).num_rows
        ]
        assert _planned(dataset) == (True, "")
        replay(dataset, JsonlTarget(tmp_path / "once.jsonl"))
        assert sorted(decoded) == sorted(groups)
        spans = [
            (st.max - st.min + 1)
            for f in sorted((dataset / "metrics").glob("*.parquet"))
            for i in range(pq.ParquetFile(f).metadata.num_row_groups)
            if (st := pq.ParquetFile(f).metadata.row_group(i).column(7).statistics) is not None
        ]
        assert max(spans) >= 3  # a group serves three windows or more (a step each)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert (tmp_path / "once.jsonl").read_bytes() == live.read_bytes()

    @pytest.mark.parametrize("seed", range(300, 303))
    def test_rows_kept_on_disk(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
    ) -> None:
        """No memory for rests and spill files of a few rows (a new one every write):
        the rows come back from disk in order, and the result is live shipping's."""
        self._tiny(monkeypatch)
        monkeypatch.setattr(spill_mod, "MEMORY_BYTES", 0)
        monkeypatch.setattr(spill_mod, "FILE_BYTES", 3 * ROW.itemsize)
        spilled: list[int] = []
        real = windows_mod.Loader.close

        def spy(self: Any) -> None:
            spilled.append(self.spilled)
            real(self)

        monkeypatch.setattr(windows_mod.Loader, "close", spy)
        _job(spool, seed, world=3)
        assert _planned(tmp_path / "pq") == (True, "")
        got = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        live = tmp_path / "live.jsonl"
        ship(spool, live)
        assert got == live.read_bytes()
        assert spilled and all(n > 0 for n in spilled)


class TestSpill:
    @staticmethod
    def _rows(steps: list[int], rank: int = 3) -> Any:
        rows = np.zeros(len(steps), ROW)
        rows["rank"] = rank
        rows["step"] = steps
        rows["value"] = np.arange(len(steps)) / 7
        rows["ts"] = np.arange(len(steps)) * 1_000_003
        return rows

    def test_taken_by_step_in_memory(self) -> None:
        """Under its budget a rest stays in memory (a copy, not a view of its group); each
        take hands out the rows of the steps below its bound, in order, and the memory is
        given back when the last row is taken."""
        group = self._rows([5, 5, 6, 6, 6, 9, 12, 12])
        spill = Spill(memory_bytes=1 << 20)
        rest = spill.keep(group[2:], nbytes=600.0)
        assert rest.file is None and rest.rows.base is None
        assert spill.in_memory == 6 * ROW.itemsize and spill.spilled == 0
        assert (rest.first, rest.last, rest.left_bytes()) == (6, 12, 600.0)
        assert spill.take(rest, 6) is None  # nothing below step 6
        got = spill.take(rest, 10)
        assert got is not None and got.tobytes() == group[2:6].tobytes()
        assert (rest.first, rest.left_bytes()) == (12, 200.0)
        assert spill.take(rest, 11) is None
        last = spill.take(rest, 100)
        assert last is not None and last.tobytes() == group[6:].tobytes()
        assert rest.at == rest.count and spill.in_memory == 0

    def test_over_budget_goes_to_disk(self) -> None:
        """Past its memory budget a rest is written to a temporary file and read back the
        same; a full file is followed by a new one, and a file whose rests are all taken
        is closed (its space freed) once another is being written."""
        spill = Spill(memory_bytes=0, file_bytes=4 * ROW.itemsize)
        a, b = self._rows([1, 2, 2, 3]), self._rows([4, 4, 5], rank=9)
        ra, rb = spill.keep(a, 40.0), spill.keep(b, 30.0)
        assert ra.file is not None and rb.file is not None and ra.file is not rb.file
        assert spill.spilled == 7 * ROW.itemsize and spill.in_memory == 0
        first = ra.file.handle
        got = spill.take(ra, 3)
        assert got is not None and got.tobytes() == a[:3].tobytes()
        assert not first.closed
        got = spill.take(ra, 4)
        assert got is not None and got.tobytes() == a[3:].tobytes()
        assert first.closed  # used up, and no longer the file written to
        got = spill.take(rb, 6)
        assert got is not None and got.tobytes() == b.tobytes()
        assert not rb.file.handle.closed  # still the file written to
        spill.close()
        assert rb.file.handle.closed

    def test_a_long_lived_rest_does_not_hold_a_used_up_file(self) -> None:
        """When a new file is started, an older one less than half still waiting has its
        rows not taken yet copied into the new one and is closed: disk use follows the
        rows waiting, not the longest-lived rest."""
        spill = Spill(memory_bytes=0, file_bytes=4 * ROW.itemsize)
        a, b = self._rows([1, 2]), self._rows([3, 3], rank=5)
        ra, rb = spill.keep(a, 20.0), spill.keep(b, 20.0)
        old = ra.file
        assert old is not None and rb.file is old  # one full file
        got = spill.take(ra, 2)
        assert got is not None and got.tobytes() == a[:1].tobytes()
        assert spill.take(rb, 4) is not None  # b used up: a quarter of the file waits
        assert not old.handle.closed
        rc = spill.keep(self._rows([7]), 10.0)  # a new file: ``a``'s last row moved to it
        assert old.handle.closed and ra.file is rc.file and ra.file is not old
        got = spill.take(ra, 100)
        assert got is not None and got.tobytes() == a[1:].tobytes()
        assert spill.spilled == 6 * ROW.itemsize  # a's and b's rows, c's, a's row moved
        spill.close()


class TestGroupCache:
    @staticmethod
    def _group(n: int = 1_000) -> pa.Table:
        return pa.table({"a": np.arange(n, dtype=np.int64)})  # 8 bytes a row

    def test_a_full_cache_keeps_what_it_holds(self) -> None:
        """An entry that does not fit is turned away and what the cache holds stays
        (lanes are read in turn: the oldest entry is the next one needed)."""
        cache = GroupCache(10_000)
        cache.put(("a", 0), self._group())
        cache.put(("b", 0), self._group())
        assert cache.get(("a", 0)) is not None
        assert cache.get(("b", 0)) is None
        cache.put(("a", 0), self._group(100))  # in place of the old: fits
        got = cache.get(("a", 0))
        assert got is not None and got.num_rows == 100

    def test_cut_copies_a_small_part_and_keeps_the_rest(self) -> None:
        """A part under half of the group is a copy (it does not hold the group's
        buffers); the rows past it are kept under the key until a cut reaches the end."""
        cache = GroupCache(1 << 20)
        part = cache.cut(("f", 0), self._group(), 0, 100)
        assert part is not None and part["a"].to_pylist() == list(range(100))
        assert part.get_total_buffer_size() == 100 * 8
        rest = cache.get(("f", 0))
        assert rest is not None and rest["a"].to_pylist() == list(range(100, 1_000))
        assert cache.cut(("f", 0), rest, 0, 0) is None  # no row: the rest stays
        assert cache.get(("f", 0)) is rest
        last = cache.cut(("f", 0), rest, 0, rest.num_rows)
        assert last is not None and last.num_rows == 900
        assert cache.get(("f", 0)) is None

    def test_footers_are_parsed_once_while_there_is_room(self, tmp_path: Path) -> None:
        """A footer is kept and handed out again; past ``footers`` files, each call
        parses the file again and keeps nothing."""
        paths = [tmp_path / f"{k}.parquet" for k in range(2)]
        for path in paths:
            pq.write_table(self._group(10), path)
        cache = GroupCache(1 << 20, footers=1)
        first = cache.footer(paths[0])
        assert cache.footer(paths[0]) is first and cache.known(paths[0]) is first
        other = cache.footer(paths[1])
        assert other.num_rows == 10 and cache.known(paths[1]) is None
        assert cache.footer(paths[1]) is not other

    def test_latest_keeps_the_footers_used_last(self, tmp_path: Path) -> None:
        """With ``latest`` (the event path, which reads each file through once), a new
        footer takes the place of the least recently used."""
        paths = [tmp_path / f"{k}.parquet" for k in range(3)]
        for path in paths:
            pq.write_table(self._group(10), path)
        cache = GroupCache(1 << 20, footers=2, latest=True)
        first = cache.footer(paths[0])
        cache.footer(paths[1])
        assert cache.footer(paths[0]) is first  # used again: now the latest
        cache.footer(paths[2])
        assert cache.known(paths[1]) is None
        assert cache.known(paths[0]) is first and cache.known(paths[2]) is not None

    def test_column_names_leave_no_cycle_behind(self, tmp_path: Path) -> None:
        """column_names gives each leaf column's top-level name, in row-group order, and
        a footer read for it is freed when dropped (``meta.schema`` would leave it to the
        garbage collector, which a replay of thousands of files piles up)."""
        import gc

        from ranklog.archive._files import column_names

        path = tmp_path / "h.parquet"
        pq.write_table(pa.table({"step": [1, 2], "values": [[1.0], [2.0, 3.0]], "x": [0, 1]}),
                       path)  # fmt: skip
        empty = tmp_path / "e.parquet"
        pq.ParquetWriter(empty, pa.schema([("a", pa.int64())])).close()  # no row group
        gc.collect()
        gc.disable()
        try:
            assert column_names(pq.read_metadata(path)) == ["step", "values", "x"]
            assert column_names(pq.read_metadata(empty)) == ["a"]  # no row group: the schema
            assert gc.collect() == 2  # the empty file's footer and its schema
            for _ in range(3):
                column_names(pq.read_metadata(path))
            assert gc.collect() == 0
            pq.read_metadata(path).schema  # noqa: B018  # what column_names avoids
            assert gc.collect() == 2
        finally:
            gc.enable()

    def test_the_plan_keeps_the_footers_the_reader_needs(
        self, spool: Path, dataset_layout: int
    ) -> None:
        """Planning a replay keeps the footers of the files read by window (metrics), not
        those of layout 1 it reads once (ranks, params); a part's are kept (every rank's
        check reads the same few)."""
        _job(spool, 3)
        dataset = spool.parent / "pq"
        manifest = load_manifest(dataset)
        cache = GroupCache(1 << 20)
        found, why = plan(_segment_files(dataset, manifest), manifest, cache)
        assert found is not None, why
        once = dataset_layout == 2
        for table, kept in (("metrics", True), ("ranks", once), ("params", once)):
            files = sorted((dataset / table).glob("*.parquet"))
            assert files, table
            assert all((cache.known(f) is not None) is kept for f in files), table


class _FailsOnce(JsonlTarget):
    """A JSONL target whose second write fails before writing anything (a full disk)."""

    writes = 0

    def write(self, steps: list[ShippedStep]) -> None:
        type(self).writes += 1
        if type(self).writes == 2:
            raise OSError(28, "No space left on device")
        super().write(steps)


class TestFailures:
    def test_a_failed_write_is_sent_again(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The target fails mid-replay: the shipper retries, and the window's steps it had
        not written are still held and sent (every step once, as the event path gives)."""
        monkeypatch.setattr(windows_mod, "WINDOW_BYTES", 1)
        monkeypatch.setattr(time, "sleep", lambda s: None)  # the retry's back-off
        _job(spool, 11)
        want = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        out = tmp_path / "retried.jsonl"
        replay(tmp_path / "pq", _FailsOnce(out))
        assert _FailsOnce.writes > 2
        assert out.read_bytes() == want

    def test_a_failed_read_stops_the_replay(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A window the reader thread cannot read ends the replay with an ArchiveError
        naming the dataset, instead of a retry that would skip the window's rows."""
        _job(spool, 12)
        calls = []
        real = windows_mod.Loader.next

        def flaky(self: windows_mod.Loader) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise OSError(5, "Input/output error")
            return real(self)

        def no_retry(seconds: float) -> None:
            raise AssertionError("the replay retried a read the reader had moved past")

        monkeypatch.setattr(windows_mod, "WINDOW_BYTES", 1)
        monkeypatch.setattr(windows_mod.Loader, "next", flaky)
        monkeypatch.setattr(time, "sleep", no_retry)
        with pytest.raises(ArchiveError, match="reading failed"):
            replay(tmp_path / "pq", JsonlTarget(tmp_path / "out.jsonl"))


class TestMoreDepartures:
    def _one_rank(self, spool: Path, frames: list[list[Event]], world: int | None = 1) -> None:
        info = ensure_run(spool, world_size=world)
        w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=world)
        for frame in frames:
            write_frame(w, frame)
        w.close()

    def test_params_for_a_step_already_closed(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Params logged after a step_end of a step with no values apply to a closed step:
        whether the engine writes them depends on when it reads them, so the event path."""
        self._one_rank(spool, [
            [StepEnd(T0, 0, 0), StepEnd(T0 + 1, 1, 0)],
            [Params(T0 + 2, {"lr": 0.1})],
            [Metrics(T0 + 2, 2, {"x": 1.0}), StepEnd(T0 + 2, 2, 1)],
        ])  # fmt: skip
        compact(spool, tmp_path / "pq")
        _event_path(tmp_path / "pq", tmp_path, monkeypatch, "which it had closed")

    def test_a_rank_outside_the_world_size(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A rank numbered past the world size is not waited for: the event path decides."""
        info = ensure_run(spool, world_size=2)
        for r in range(3):
            w = IncarnationWriter.create(SpoolLayout(spool), info, r, world_size=None)
            for s in range(3):
                write_frame(w, [Metrics(T0 + s, s, {"x": float(r)}), StepEnd(T0 + s, s, 1)])
            w.close()
        compact(spool, tmp_path / "pq")
        _event_path(tmp_path / "pq", tmp_path, monkeypatch, "outside the world size 2")

    @pytest.mark.parametrize("dataset_layout", [1], indirect=True)
    def test_a_dataset_from_an_older_release(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dataset_layout: int
    ) -> None:
        """Ranks files without the ``events`` column (an older release): the event path,
        which reads absent columns as nulls, replays them; no crash."""
        _job(spool, 5, phases=1)
        for path in (tmp_path / "pq" / "ranks").glob("*.parquet"):
            t = pq.read_table(path)
            pq.write_table(t.drop_columns(["events"]), path)
        _event_path(tmp_path / "pq", tmp_path, monkeypatch, "has no events")

    def test_an_output_name_two_names_share(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``x`` reduced by mean and max derives ``x/max``, a name also logged on its own:
        both values ship, the derived one as ``x/max.derived``, on columns as in the engine."""
        self._one_rank(spool, [
            [Metrics(T0, 0, {"x/max": 5.0}), StepEnd(T0, 0, 1)],
            [Metrics(T0 + 1, 1, {"x": 1.0}, "mean,max"), Metrics(T0 + 1, 1, {"x/max": 7.0}),
             StepEnd(T0 + 1, 1, 2)],
            [Metrics(T0 + 2, 2, {"x/max": 9.0}), Metrics(T0 + 2, 2, {"x": 2.0}, "mean,max"),
             StepEnd(T0 + 2, 2, 2)],
        ])  # fmt: skip
        compact(spool, tmp_path / "pq")
        assert _planned(tmp_path / "pq") == (True, "")
        out = _replays(tmp_path / "pq", tmp_path, monkeypatch)
        got = [x["metrics"] for x in map(json.loads, out.splitlines()) if "metrics" in x]
        assert [m["x/max"] for m in got] == [5.0, 7.0, 9.0]
        assert [m.get("x/max.derived") for m in got] == [None, 1.0, 2.0]


class TestUsualStepsReduced:
    """The columnar replay's usual steps (:class:`~ranklog.shippers._gather.Summed`),
    reduced straight from a window's rows, against the live engine's steps."""

    @staticmethod
    def replay(
        rows: list[tuple[int, int, str, float, str]], grow: bool = False, kept: Any = None
    ) -> Any:
        """(rank, step, name, value, spec) rows reduced as one window; ``grow``: the loader
        thread meets a new name (for a later window) while this one is reduced; ``kept``: a
        list the tails are put in."""
        from ranklog.archive._windows import Words

        tails = object.__new__(columnar_mod.ColumnarTails)
        if kept is not None:
            kept.append(tails)
        tails._names, tails._specs = Words(), Words()
        tails._tuples = Kept(columnar_mod._TUPLES_NAMES)
        names = np.array([tails._names.code(r[2]) for r in rows])
        specs = np.array([tails._specs.code(r[4]) for r in rows])
        cols = (
            np.array([r[0] for r in rows]), np.ones(len(rows), np.int64),
            np.array([r[1] for r in rows]), names, np.array([r[3] for r in rows], float), specs,
        )  # fmt: skip
        real = columnar_mod.fsums

        def fsums(*args: Any) -> Any:
            if grow:
                tails._names.code("later/name")
            return real(*args)

        built: dict[int, Any] = {}
        with pytest.MonkeyPatch.context() as m:
            m.setattr(columnar_mod, "fsums", fsums)
            tails._reduce(built, 0, cols, timers=False)
        for part in built.values():
            part.ranks = 1
        return {s: built[s].finish(closed=1, world_size=1).metrics for s in sorted(built)}

    @staticmethod
    def live(rows: list[tuple[int, int, str, float, str]]) -> Any:
        from ranklog.shippers._steps import Contribution, StepAcc, StepPartial

        out = {}
        for s in sorted({r[1] for r in rows}):
            acc = StepAcc()
            for rank, step, name, value, spec in rows:
                if step == s:
                    acc.ranks.setdefault(rank, Contribution(0)).events.append(
                        Metrics(1.0, s, {name: value}, spec)
                    )
            out[s] = StepPartial.build(s, acc).finish(closed=1, world_size=1).metrics
        return out

    def test_a_name_met_meanwhile_changes_nothing(self) -> None:
        """The loader thread adding a name while a window is reduced moves no value to
        another step or name (the window keeps the names' count its keys were made with)."""
        rows = [(0, s, n, float(s * 10 + i), "mean") for s in range(3)
                for i, n in enumerate(["a", "b"])]  # fmt: skip
        assert self.replay(rows, grow=True) == self.live(rows) == self.replay(rows)

    def test_names_of_a_step_are_one_tuple_and_stay_bounded(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Steps that log the same names share one tuple of them (their order is found once
        when shipped); names that change every step are not all kept; the output is live's
        either way, for one rank and for several."""
        monkeypatch.setattr(columnar_mod, "_TUPLES_NAMES", 6)
        same = [(r, s, n, float(s + r), "mean") for s in range(4) for r in range(2)
                for n in ("b", "a")]  # fmt: skip
        kept: list[Any] = []
        assert self.replay(same, kept=kept) == self.live(same)
        (tails,) = kept
        assert list(tails._tuples.values()) == [("b", "a")]
        changing = [(0, s, f"m{s}/{n}", 1.5 * s, "mean") for s in range(10) for n in "xyz"]
        kept.clear()
        assert self.replay(changing, kept=kept) == self.live(changing)
        assert kept[0]._tuples.held <= 6

    @pytest.mark.parametrize("spec", ["bogus", "sum,sum", "mean, mean", ""])
    def test_a_spec_not_written_as_one_op_is_reduced_as_live(self, spec: str) -> None:
        """A spec that is not exactly mean, sum or count (a foreign spool's) is reduced as the
        live engine reduces it, not taken for a count."""
        rows = [(0, 0, "a", 2.0, spec), (0, 0, "a", 4.0, spec), (0, 0, "b", 4.0, spec)]
        assert self.replay(rows) == self.live(rows)


def _sorted_as_rows(step: Any, rank: Any, name: Any) -> bool:
    """Whether :func:`_transposed` gave an order (False: it left the rows to the sort), and
    when it did, that it is the stable sort of the rows by (step, name, rank)."""
    got = columnar_mod._transposed(step, rank, name)
    if got is None:
        return False
    assert np.array_equal(got, np.argsort((step * 1000 + name) * 100 + rank, kind="stable"))
    return True


class TestTransposed:
    def test_the_order_without_a_sort_is_the_sort(self) -> None:
        """Rows as ranks write them (step by step, ranks ascending, the same names in each
        rank's run) give, without sorting, the very order the stable sort by (step, name,
        rank) gives; any other rows (swapped, cut, a name twice, ranks out of order) are
        left to the sort."""
        rng = np.random.default_rng(7)
        taken = left = 0
        for _ in range(2_000):
            steps = np.sort(rng.choice(100, size=int(rng.integers(1, 4)), replace=False))
            ranks = np.sort(rng.choice(50, size=int(rng.integers(1, 5)), replace=False))
            width = int(rng.integers(1, 6))
            names = (rng.permutation(np.arange(10, 999))[:width] if rng.random() < 0.8
                     else rng.integers(0, 3, size=width))  # fmt: skip
            step = np.repeat(steps, len(ranks) * width)
            rank = np.tile(np.repeat(ranks, width), len(steps))
            name = np.tile(names, len(steps) * len(ranks))
            if rng.random() < 0.3:
                i, j = rng.integers(len(step), size=2)
                for col in (step, rank, name):
                    col[i], col[j] = col[j], col[i]
            if rng.random() < 0.1:
                cut = int(rng.integers(1, len(step) + 1))
                step, rank, name = step[:cut], rank[:cut], name[:cut]
            if rng.random() < 0.2:  # a rank that stopped before the last step
                keep = ~((step == steps[-1]) & (rank == ranks[0]))
                step, rank, name = step[keep], rank[keep], name[keep]
            if _sorted_as_rows(step, rank, name):
                taken += 1
            else:
                left += 1
        assert taken > 1_000 and left > 100

    def test_lanes_of_ranks_give_the_order_of_the_sort(self) -> None:
        """A window's rows from several lanes (blocks of ranks of their own, each step by
        step) give, by sorting runs, the order the stable sort of rows gives; a rank's step
        in two runs, or steps with other ranks, are left to the sort."""
        rng = np.random.default_rng(11)
        taken = left = 0
        for _ in range(2_000):
            steps = np.sort(rng.choice(100, size=int(rng.integers(1, 5)), replace=False))
            ranks = np.sort(rng.choice(60, size=int(rng.integers(2, 9)), replace=False))
            width = int(rng.integers(1, 6))
            names = rng.permutation(np.arange(10, 999))[:width]
            parts = min(int(rng.integers(0, 3)), len(ranks) - 1)  # lanes: parts + 1
            cuts = np.sort(rng.choice(np.arange(1, len(ranks)), size=parts, replace=False))
            lanes = np.split(ranks, cuts)
            if rng.random() < 0.3:
                rng.shuffle(lanes)  # (lanes in another order than their ranks)
            rows = [(s, r) for lane in lanes for s in steps for r in lane]
            if rng.random() < 0.15:  # a rank's step again, in a run of its own
                rows.append(rows[int(rng.integers(len(rows)))])
            if rng.random() < 0.15:  # a rank that stopped before the last step
                rows = [x for x in rows if x != (steps[-1], ranks[0])]
            step = np.repeat([x[0] for x in rows], width)
            rank = np.repeat([x[1] for x in rows], width)
            name = np.tile(names, len(rows))
            if _sorted_as_rows(step, rank, name):
                taken += 1
            else:
                left += 1
        assert taken > 1_000 and left > 100


def _frames_one_by_one(segments: list[list[tuple[str, list[int], int]]]) -> str | None:
    """The check of frames as it was made rank by rank, segment by segment: the first
    segment whose frames do not follow, named as the plan names it."""
    for rank in segments:
        expected = 0
        for stem, frames, seal in rank:
            got = sorted(set(frames))
            if got != list(range(expected, expected + len(got))):
                return f"{stem}: frames are missing"
            expected += len(got)
            if seal > 0:
                if seal - 1 != expected:
                    return f"{stem}: frames before the seal are missing"
                expected += 1
    return None


class TestFrames:
    def test_frames_of_every_rank_at_once_are_checked_as_one_by_one(self) -> None:
        """Frames checked for a batch of ranks at once (numbered on across a rank's
        segments, seals counted, gaps, repeats, empty and sealed-only segments) name the
        segment the rank-by-rank check named, or none."""
        from ranklog.archive._walk import RankPlan, frame_gaps

        rng = random.Random(11)
        named = 0
        for _ in range(3_000):
            segments: list[list[tuple[str, list[int], int]]] = []
            for r in range(rng.randrange(1, 5)):
                rank, at = [], 0
                for n in range(rng.randrange(1, 4)):
                    count = rng.choice([0, 1, 2, 5])
                    frames = list(range(at, at + count))
                    if frames and rng.random() < 0.15:
                        frames[rng.randrange(count)] += rng.choice([-1, 1, 2])  # a gap
                    frames += rng.sample(frames, min(len(frames), rng.randrange(3)))  # repeats
                    at += count
                    seal = 0
                    if rng.random() < 0.4:
                        seal = at + 1 + (rng.random() < 0.1)  # the seal's, or one off
                        at += 1
                    rank.append((f"{r}-1-{n + 1}", frames, seal))
                segments.append(rank)
            batch = [
                (RankPlan(r, -1, True, None), [], {}, "x", [(s, q) for s, _, q in segs])
                for r, segs in enumerate(segments)
            ]
            rows = [(r, n, f) for r, segs in enumerate(segments)
                    for n, (_, fs, _) in enumerate(segs) for f in fs]  # fmt: skip
            rng.shuffle(rows)
            who, segno, seq = (np.array([row[i] for row in rows], np.int64) for i in range(3))
            got = frame_gaps(batch, who, segno, seq)
            want = _frames_one_by_one(segments)
            assert (got[3] if got else None) == want
            if got is not None:
                named += 1
                assert segments[got[0]][0][0].startswith(f"{got[0]}-")
        assert 300 < named < 2_700
