"""Replay gives what live shipping gave, byte for byte, by both of its paths.

A dataset ``ranklog compact`` wrote holds the steps as shipped (``DS/steps``): replay
hands them to the engine again. Without that table (an older dataset; ``--per-rank``)
replay runs the engine over the raw rows. Each test here writes a job, ships it live,
compacts it and replays it both ways: JSONL bytes and every call a target receives
are the same three times (time stamps too: to the bit from the steps table, which keeps
live's; to the microsecond the raw rows keep).

How it could break, and the tests: values that change on the way (NaN, inf, -0.0, huge
and tiny, ties); names one rank logs, derived names that clash; params every rank logs
alike or not, again, after a closed step; late values and GPU samples for closed steps;
ranks that stop early, die, are signalled, never start, or sit outside the world size;
a requeued rank; lost frames and wrong counts; a dataset of an older release; a target
that fails half way (``TestFailures``).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ranklog.archive import compact, load_manifest, replay
from ranklog.archive._steps import whole_table
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
    compact(spool, spool.parent / "pq", dead_after=0)  # every rank written: none waited for
    return steps


def read_manifest_run(dataset: Path) -> RunInfo:
    m = load_manifest(dataset)
    return RunInfo(m.run_id, m.created, m.name, m.world_size)


class _Recorder:
    """A target that keeps every call, each step encoded whole (its time stamp apart)."""

    kind = "record"
    spec = "record:"
    takes_late = True

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        #: each step's time stamp (the raw rows hold them to the microsecond)
        self.times: list[float] = []

    def open(self, run: RunInfo) -> int | None:
        return None

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self.calls.append(msgspec.msgpack.encode({"params": params}))

    def write_meta(self, meta: dict[str, ParamValue]) -> None:
        self.calls.append(msgspec.msgpack.encode({"meta": meta}))

    def write(self, steps: list[ShippedStep]) -> None:
        self.calls.extend(msgspec.msgpack.encode(msgspec.structs.replace(s, ts=0.0)) for s in steps)
        self.times.extend(s.ts for s in steps)

    def end(self, status: str) -> None:
        self.calls.append(msgspec.msgpack.encode({"end": status}))

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def _replays(dataset: Path, out: Path, **kw: Any) -> bytes:
    """The JSONL of a replay from the steps table, checked equal to the raw rows' (and
    every call the target got, time stamps too); returned."""
    assert whole_table(dataset, read_manifest_run(dataset), load_manifest(dataset)) is not None
    fast, slow = out / "steps.jsonl", out / "events.jsonl"
    fast_rec, slow_rec = _Recorder(), _Recorder()
    for f in (fast, slow):
        f.unlink(missing_ok=True)
    replay(dataset, JsonlTarget(fast), **kw)
    replay(dataset, fast_rec, **kw)
    (dataset / "steps").rename(out / "steps-aside")
    try:
        replay(dataset, JsonlTarget(slow), **kw)
        replay(dataset, slow_rec, **kw)
    finally:
        (out / "steps-aside").rename(dataset / "steps")
    assert fast.read_bytes() == slow.read_bytes()
    assert fast_rec.calls == slow_rec.calls
    assert len(fast_rec.times) == len(slow_rec.times)
    for a, b in zip(fast_rec.times, slow_rec.times, strict=True):
        assert abs(a - b) <= 1e-6 or (math.isnan(a) and math.isnan(b)), (a, b)
    return fast.read_bytes()


def _live_and_both(spool: Path, tmp_path: Path, **kw: Any) -> bytes:
    """The spool (compacted already) shipped live, and replayed both ways: all the same."""
    got = _replays(tmp_path / "pq", tmp_path, **kw)
    live = tmp_path / "live.jsonl"
    live.unlink(missing_ok=True)
    ship(spool, live, dead_after=0, **kw)  # (every rank written: none is waited for)
    assert got == live.read_bytes()
    return got


class TestSameBytes:
    @pytest.mark.parametrize("seed", range(12))
    def test_random_plain_jobs(self, spool: Path, tmp_path: Path, seed: int) -> None:
        """Random jobs (NaN, inf, -0.0, ties, mixed specs, several events and segments,
        params, texts, distributions, images, tables, GPU samples)."""
        _job(spool, seed)
        assert _live_and_both(spool, tmp_path)

    def test_usual_and_unusual_steps(self, spool: Path, tmp_path: Path) -> None:
        """Steps of one summable spec among steps that are not (a name only a later rank
        logs, a NaN, an infinity, -0.0 everywhere, ``max``, a timer)."""
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
        for run in runs:
            run.close()
        compact(spool, tmp_path / "pq", dead_after=0)
        got = _live_and_both(spool, tmp_path)
        (z,) = [x["metrics"]["z"] for x in map(json.loads, got.splitlines()) if x.get("step") == 13]
        assert math.copysign(1.0, z) < 0

    @pytest.mark.parametrize("seed", range(100, 108))
    def test_ranks_that_stop_early_die_or_are_signalled(
        self, spool: Path, tmp_path: Path, seed: int
    ) -> None:
        """Ranks that stop early, end on a signal, die unsealed or never start, a world size
        known from rank_start alone: partial steps, ``ranks_reporting`` and the job's end."""
        _job(spool, seed, ends="mixed")
        _replays(tmp_path / "pq", tmp_path)

    @pytest.mark.parametrize("late", ["count", "ship"])
    def test_late_values_as_asked(self, spool: Path, tmp_path: Path, late: str) -> None:
        """Late values (and GPU samples of a closed step) counted or shipped, as asked."""
        extra = {2: [Metrics(T0 + 9, 1, {"m0": 5.0}), *_gpu(random.Random(0), 0)]}
        _job(spool, 3, extra=extra, phases=1, world=3)
        _live_and_both(spool, tmp_path, late=late)


CONFIG: list[dict[str, Any]] = [
    {"model": "tiny", "layers": 4},
    {"optim.lr": 3e-4, "tags": "a,b", "seed": None},
]


class TestParams:
    @pytest.mark.parametrize(
        "config",
        [
            {r: CONFIG for r in range(2)},
            {0: CONFIG, 1: [{"model": "tiny", "layers": 4.0}, CONFIG[1]]},  # 4.0 is not 4
            {0: CONFIG, 1: [*CONFIG, {"layers": 5}]},
            {0: [*CONFIG, {"layers": 4}], 1: [*CONFIG, {"layers": 4}]},
            {0: [{"@x": 1, "lr": 0.1}], 1: [{"lr": 0.2}]},
        ],
        ids=["same", "4.0", "changed", "again", "differ"],
    )
    def test_configs(self, spool: Path, tmp_path: Path, config: dict[int, Any]) -> None:
        """Configs every rank logs alike, or not (4 against 4.0, changed, logged again,
        a key named ``@x``): params lines where and as live shipping wrote them."""
        _job(spool, 400, params_ranks=0, config=config, phases=1, world=2)
        got = _live_and_both(spool, tmp_path)
        assert b'"params": {' in got

    def test_params_for_a_step_already_closed(self, spool: Path, tmp_path: Path) -> None:
        """Params logged after a step_end of a step with no values apply to a closed step."""
        _one_rank(spool, [
            [StepEnd(T0, 0, 0), StepEnd(T0 + 1, 1, 0)],
            [Params(T0 + 2, {"lr": 0.1})],
            [Metrics(T0 + 2, 2, {"x": 1.0}), StepEnd(T0 + 2, 2, 1)],
            [Params(T0 + 3, {"lr": 0.2})],
        ])  # fmt: skip
        compact(spool, tmp_path / "pq", dead_after=0)
        got = _live_and_both(spool, tmp_path)
        assert got.count(b'"params"') == 2


def _one_rank(spool: Path, frames: list[list[Event]], world: int | None = 1) -> None:
    info = ensure_run(spool, world_size=world)
    w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=world)
    for frame in frames:
        write_frame(w, frame)
    write_frame(w, [RankEnd(T0 + 100, "ok", 0)])
    w.close()


class TestRanks:
    def test_a_requeued_rank(self, spool: Path, tmp_path: Path) -> None:
        """Two incarnations of a rank: the steps the first closed are its."""
        info = ensure_run(spool, world_size=1)
        for inc_steps in (range(5), range(3, 8)):
            w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=1)
            for s in inc_steps:
                write_frame(w, [Metrics(T0 + s, s, {"x": float(s)}), StepEnd(T0 + s, s, 1)])
            w.close()
        compact(spool, tmp_path / "pq", dead_after=0)
        _live_and_both(spool, tmp_path)

    def test_lost_frames_and_wrong_counts(self, spool: Path, tmp_path: Path) -> None:
        """A frame with no values (the raw rows hold no row of it) and a step_end counting
        other events: the steps table ships what live shipping shipped (step 1 whole, step
        2 partial); the raw rows alone, without the empty frame, mark step 1 partial too."""
        info = ensure_run(spool, world_size=1)
        w = IncarnationWriter.create(SpoolLayout(spool), info, 0, world_size=1)
        write_frame(w, [Metrics(T0, 0, {"x": 1.0}), StepEnd(T0, 0, 1)])
        write_frame(w, [Metrics(T0 + 1, 1, {})])  # no values: no row, its frame unseen
        write_frame(w, [Metrics(T0 + 1, 1, {"x": 2.0}), StepEnd(T0 + 1, 1, 2)])
        write_frame(w, [Metrics(T0 + 2, 2, {"x": 1.0}), StepEnd(T0 + 2, 2, 3)])
        w.close()
        compact(spool, tmp_path / "pq", dead_after=0)
        live, again, raw = (tmp_path / f"{n}.jsonl" for n in ("live", "again", "raw"))
        ship(spool, live, dead_after=0)
        replay(tmp_path / "pq", JsonlTarget(again))
        assert again.read_bytes() == live.read_bytes()
        assert [x["complete"] for x in lines(live) if "step" in x] == [True, True, False]
        (tmp_path / "pq" / "steps").rename(tmp_path / "aside")
        replay(tmp_path / "pq", JsonlTarget(raw))
        assert [x["complete"] for x in lines(raw) if "step" in x] == [True, False, False]

    def test_a_rank_outside_the_world_size(self, spool: Path, tmp_path: Path) -> None:
        """A rank numbered past the world size is not waited for."""
        info = ensure_run(spool, world_size=2)
        for r in range(3):
            w = IncarnationWriter.create(SpoolLayout(spool), info, r, world_size=None)
            for s in range(3):
                write_frame(w, [Metrics(T0 + s, s, {"x": float(r)}), StepEnd(T0 + s, s, 1)])
            w.close()
        compact(spool, tmp_path / "pq", dead_after=0)
        _live_and_both(spool, tmp_path)

    def test_an_output_name_two_names_share(self, spool: Path, tmp_path: Path) -> None:
        """``x`` reduced by mean and max derives ``x/max``, also logged on its own: both
        ship, the derived one as ``x/max.derived``."""
        _one_rank(spool, [
            [Metrics(T0, 0, {"x/max": 5.0}), StepEnd(T0, 0, 1)],
            [Metrics(T0 + 1, 1, {"x": 1.0}, "mean,max"), Metrics(T0 + 1, 1, {"x/max": 7.0}),
             StepEnd(T0 + 1, 1, 2)],
            [Metrics(T0 + 2, 2, {"x/max": 9.0}), Metrics(T0 + 2, 2, {"x": 2.0}, "mean,max"),
             StepEnd(T0 + 2, 2, 2)],
        ])  # fmt: skip
        compact(spool, tmp_path / "pq", dead_after=0)
        out = _live_and_both(spool, tmp_path)
        got = [x["metrics"] for x in map(json.loads, out.splitlines()) if "metrics" in x]
        assert [m["x/max"] for m in got] == [5.0, 7.0, 9.0]
        assert [m.get("x/max.derived") for m in got] == [None, 1.0, 2.0]

    def test_a_dataset_from_an_older_release(self, spool: Path, tmp_path: Path) -> None:
        """Ranks files without the ``events`` column (an older release), and no steps table:
        the raw rows replay as live shipped."""
        _job(spool, 5, phases=1)
        for path in (tmp_path / "pq" / "ranks").glob("*.parquet"):
            t = pq.read_table(path)
            pq.write_table(t.drop_columns(["events"]), path)
        _live_and_both(spool, tmp_path)


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
        """The target fails mid-replay: the shipper retries from what the target holds,
        every step once."""
        monkeypatch.setattr(time, "sleep", lambda s: None)  # the retry's back-off
        _job(spool, 11)
        want = _replays(tmp_path / "pq", tmp_path)
        out = tmp_path / "retried.jsonl"
        replay(tmp_path / "pq", _FailsOnce(out))
        assert _FailsOnce.writes > 2
        assert out.read_bytes() == want


class TestGenerated:
    @settings(max_examples=12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
    @given(seed=st.integers(0, 2**32), ends=st.sampled_from(["ok", "mixed"]),
           damage=st.none() | st.tuples(st.floats(0.1, 0.95), st.integers(1, 64)))  # fmt: skip
    def test_generated_spools_replay_as_live(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        seed: int,
        ends: str,
        damage: tuple[float, int] | None,
    ) -> None:
        """Generated jobs (values, names, specs, params, ranks that stop, die or are
        signalled), some with bytes of a segment overwritten: live shipping, replay from the
        steps table and replay from the raw rows give the same bytes; nothing raises."""
        d = tmp_path_factory.mktemp("gen")
        spool = d / "spool"
        _job(spool, seed, ends=ends, phases=1)
        if damage is not None:
            at, length = damage
            seg = max((p for p in spool.rglob("*") if p.is_file() and p.parent.name.isdigit()
                       and p.stat().st_size > 200), key=lambda p: p.stat().st_size)  # fmt: skip
            data = bytearray(seg.read_bytes())
            start = int(len(data) * at)
            data[start : start + length] = bytes(0xA5 for _ in data[start : start + length])
            seg.write_bytes(bytes(data))
            shutil.rmtree(d / "pq")
            compact(spool, d / "pq", dead_after=0)
        _live_and_both(spool, d)
