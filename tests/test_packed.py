"""Segment format 2: metrics packed (names said once per layout, values as float64 bytes).

What a rank logged reads back bit for bit, from any segment alone and from any offset; a
lost names record makes steps partial, never wrong; a spool of format 1 ships as before.
"""

from __future__ import annotations

import errno
import math
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ranklog.archive import compact, replay
from ranklog.producer import _pack
from ranklog.schemas import (
    DecodeStats,
    Metrics,
    Names,
    Packed,
    RankEnd,
    StepEnd,
    decode_events,
    encoder,
)
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import (
    UNRESOLVED,
    IncarnationWriter,
    SegmentReader,
    SpoolLayout,
    ensure_run,
    read_segment,
)
from ranklog.spool._format import FLAG_NAMES, HEADER_SIZE, msgpack_array_header

from .conftest import run_python
from .shiphelp import lines, live_and_replayed, rank, ship
from .test_everyday import ranklog_cmd

DATA = Path(__file__).parent / "data"


def metrics_of(spool: Path, r: int = 0) -> list[Metrics]:
    """Every Metrics event rank ``r`` wrote, segment after segment, each segment read alone."""
    out: list[Metrics] = []
    for seg in SpoolLayout(spool).segments(r):
        res = read_segment(seg.path)
        assert res.bad == [] and res.stats.invalid_events == 0, res.bad
        out += [e for e in res.events if isinstance(e, Metrics)]
    return out


def bits(values: dict[str, float]) -> dict[str, bytes]:
    """Each value's eight bytes (NaN payloads and the sign of zero included)."""
    return {k: struct.pack("<d", v) for k, v in values.items()}


def raw_events(path: Path) -> list[Any]:
    """Every record of a segment as written, Names and Packed included (not resolved)."""
    data = path.read_bytes()
    pos, out = HEADER_SIZE, []
    while pos + 24 <= len(data):
        length = int.from_bytes(data[pos + 8 : pos + 12], "little")
        kind = data[pos + 4]
        if kind == 1:
            out += msgspec.msgpack.decode(data[pos + 24 : pos + 24 + length])
        pos += 24 + length + 4
    return out


class TestRoundTrip:
    @settings(max_examples=40, deadline=None)
    @given(
        st.lists(
            st.dictionaries(
                st.sampled_from(["loss", "lr", "grad/norm", "a" * 24, "é/ü", "x y"]),
                st.floats(allow_nan=True, allow_infinity=True, width=64),
                min_size=1,
            ),
            min_size=1,
            max_size=6,
        )
    )
    def test_values_read_back_bit_for_bit(self, calls: list[dict[str, float]]) -> None:
        """Whatever floats and names are logged, the reader gives the same Metrics events,
        names in the order logged and every value's bits (NaN, -0.0, infinities) kept."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            spool = Path(tmp) / "spool"
            run = rank(spool, 0, 1, code=False)
            for step, values in enumerate(calls):
                run.log_metrics(values, step=step)
                run.step_end(step)
            run.close()
            got = metrics_of(spool)
        assert [(m.step, list(m.values), bits(m.values), m.reduce) for m in got] == [
            (s, list(v), bits(v), "mean") for s, v in enumerate(calls)
        ]

    def test_packed_where_it_can_be(self, spool: Path) -> None:
        """One spec for the call: packed; a reduce map: a plain Metrics event; several ops:
        packed with the spec joined; the same names again reuse their layout."""
        run = rank(spool, 0, 1, code=False)
        for step in range(3):
            run.log_metrics({"loss": 1.0, "acc": 0.5}, step=step)
            run.log_metrics({"loss2": 2.0}, step=step, reduce=("mean", "max"))
            run.log_metrics({"tok": 3.0}, step=step, reduce={"tok": "sum"})
            run.step_end(step)
        run.close()
        (seg,) = SpoolLayout(spool).segments(0)
        recs = raw_events(seg.path)
        names = [r for r in recs if r[0] == "names"]
        assert [(r[2], r[3], r[4]) for r in names] == [
            (0, ["loss", "acc"], "mean"), (1, ["loss2"], "mean,max"),
        ]  # fmt: skip
        kinds = [r[0] for r in recs if r[0] in ("mp", "metrics")]
        assert kinds == ["mp", "mp", "metrics"] * 3
        got = metrics_of(spool)
        assert [(m.step, m.values, m.reduce) for m in got] == [
            (s, v, red)
            for s in range(3)
            for v, red in (
                ({"loss": 1.0, "acc": 0.5}, "mean"),
                ({"loss2": 2.0}, "mean,max"),
                ({"tok": 3.0}, {"tok": "sum"}),
            )
        ]

    def test_bytes_per_value(self, spool: Path) -> None:
        """20 values of 24-character names a step: at most 10 spool bytes a value (format 1
        took ~35)."""
        names = [f"train/layer_{i:02d}/grad_norm" for i in range(20)]
        assert {len(n) for n in names} == {24}
        run = rank(spool, 0, 1, code=False, durability="buffered")
        for step in range(2000):
            run.log_metrics({n: step * 0.001 + i for i, n in enumerate(names)}, step=step)
            run.step_end(step)
        run.close()
        size = sum(s.path.stat().st_size for s in SpoolLayout(spool).segments(0))
        assert size / (2000 * 20) <= 10

    def test_every_segment_reads_alone(self, spool: Path) -> None:
        """Segments of 4 KiB: each later segment starts with a names frame holding every
        layout so far, so each reads with no other (and no value is unresolved)."""
        run = rank(spool, 0, 1, code=False, max_segment_bytes=4096)
        for step in range(120):
            run.log_metrics({f"m{i}": step + i / 10 for i in range(8)}, step=step)
            if step >= 60:  # a layout first logged in a later segment
                run.log_metrics({"late": -0.0}, step=step, reduce="sum")
            run.step_end(step)
        run.close()
        segs = SpoolLayout(spool).segments(0)
        assert len(segs) >= 4
        got = metrics_of(spool)  # asserts nothing bad, each segment alone
        assert [m.step for m in got if "m0" in m.values] == list(range(120))
        assert [m.step for m in got if "late" in m.values] == list(range(60, 120))
        assert all(math.copysign(1, m.values["late"]) < 0 for m in got if "late" in m.values)
        for seg in segs[1:]:
            data = seg.path.read_bytes()
            assert data[HEADER_SIZE + 5] & FLAG_NAMES  # its first frame: the layouts

    def test_threads_never_use_a_layout_before_its_names(self, spool: Path) -> None:
        """Four threads logging the same new names at once: every packed value resolves."""
        run = rank(spool, 0, 1, code=False)
        barrier = threading.Barrier(4)

        def log(t: int) -> None:
            barrier.wait()
            for i in range(200):
                run.log_metrics({f"n{i % 50}": float(t)}, step=0)

        threads = [threading.Thread(target=log, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        run.step_end(0)
        run.close()
        assert len(metrics_of(spool)) == 800

    def test_past_the_caps_metrics_are_plain(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Past MAX_LAYOUTS name sets, values are written as plain Metrics events: all ship."""
        monkeypatch.setattr(_pack, "MAX_LAYOUTS", 5)
        run = rank(spool, 0, 1, code=False)
        for step in range(12):
            run.log_metrics({f"only_at_{step}": float(step)}, step=step)
            run.step_end(step)
        run.close()
        (seg,) = SpoolLayout(spool).segments(0)
        kinds = [r[0] for r in raw_events(seg.path) if r[0] in ("mp", "metrics")]
        assert kinds == ["mp"] * 5 + ["metrics"] * 7
        out = spool.parent / "o.jsonl"
        ship(spool, out)
        assert [x["metrics"] for x in lines(out)] == [{f"only_at_{s}": float(s)} for s in range(12)]


def _logged(spool: Path, steps: range, *, alive: bool = False, run: Any = None) -> Any:
    run = run or rank(spool, 0, 1, code=False, max_segment_bytes=1 << 20)
    for step in steps:
        run.log_metrics({"loss": step / 7, "acc": 1 - step / 100}, step=step)
        run.log_metrics({f"eval/x{step // 10}": float(step)}, step=step)  # new layouts as it goes
        run.step_end(step)
    run.flush()
    if not alive:
        run.close()
    return run


class TestResume:
    def test_reader_started_mid_segment_finds_the_layouts(self, spool: Path) -> None:
        """A fresh reader started at any frame boundary gives what a reader from the header
        gave from there on, packed values resolved."""
        _logged(spool, range(30))
        (seg,) = SpoolLayout(spool).segments(0)
        whole = read_segment(seg.path)
        for frame in whole.frames[1:]:
            res = SegmentReader(seg.path).read(frame.offset, writer_gone=True)
            assert res.bad == []
            want = [e for f in whole.frames if f.offset >= frame.offset for e in f.events]
            assert res.events == want

    def test_reader_started_past_damage_still_finds_the_layouts(self, spool: Path) -> None:
        """Damage between the header and the offset (not in a frame holding names): the
        reader scans past it for the names frames, and resolves what follows."""
        _logged(spool, range(30))
        (seg,) = SpoolLayout(spool).segments(0)
        whole = read_segment(seg.path)
        data = bytearray(seg.path.read_bytes())
        plain = [f for f in whole.frames if not data[f.offset + 5] & FLAG_NAMES]
        victim, start = plain[3], plain[-3]
        data[victim.offset + 2] ^= 0xFF  # its sync marker
        seg.path.write_bytes(bytes(data))
        res = SegmentReader(seg.path).read(start.offset, writer_gone=True)
        assert res.bad == [] and res.stats.invalid_events == 0
        assert res.events == [e for f in whole.frames if f.offset >= start.offset for e in f.events]

    def test_told_where_the_names_frames_are(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Told the names frames before its offset (a cursor's), a reader reads those alone
        and follows no frame header; told wrong, it follows them after all; both resolve."""
        _logged(spool, range(30))
        (seg,) = SpoolLayout(spool).segments(0)
        whole = SegmentReader(seg.path)
        everything = whole.read(0, writer_gone=True)
        start = everything.frames[-5].offset
        names = whole.names_before(start)
        assert len(names) == 3  # loss+acc, then eval/x0, x1, x2 as they come
        want = [e for f in everything.frames if f.offset >= start for e in f.events]
        followed: list[int] = []
        real = SegmentReader._find_names

        def spy(self: SegmentReader, fd: int, upto: int) -> None:
            followed.append(upto)
            real(self, fd, upto)

        monkeypatch.setattr(SegmentReader, "_find_names", spy)
        told = SegmentReader(seg.path)
        told.resume_from(names, start)
        assert told.read(start, writer_gone=True).events == want and followed == []
        wrong = SegmentReader(seg.path)
        wrong.resume_from([names[0], names[1] + 1], start)
        assert wrong.read(start, writer_gone=True).events == want and followed == [start]

    def test_shipper_restarted_mid_segment(self, spool: Path, tmp_path: Path) -> None:
        """A shipper that stopped mid-segment, restarted from its cursor, ships the rest; the
        file equals one shipping the whole spool at once."""
        run = _logged(spool, range(25), alive=True)
        first = tmp_path / "a.jsonl"
        ship(spool, first)
        assert [x["step"] for x in lines(first)] == list(range(25))
        _logged(spool, range(25, 50), run=run)
        saved = msgspec.json.decode((spool / "cursors" / "t.json").read_bytes())
        (seg,) = saved["segments"].values()
        assert seg["offset"] > HEADER_SIZE and len(seg["names"]) == 3
        ship(spool, first)  # the same name: resumes from its cursor, mid-segment
        whole = tmp_path / "b.jsonl"
        ship(spool, whole, name="other")
        assert first.read_bytes() == whole.read_bytes()
        assert [x["step"] for x in lines(first)] == list(range(50))

    def test_compaction_resumed_mid_segment(self, spool: Path, tmp_path: Path) -> None:
        """Compaction that read part of a live segment, run again after more was written,
        gives a dataset whose replay is the live shipping, byte for byte."""
        run = _logged(spool, range(25), alive=True)
        ds = tmp_path / "ds"
        compact(spool, ds)
        (entry,) = msgspec.json.decode((ds / "_manifest.json").read_bytes())["segments"].values()
        assert entry["offset"] > HEADER_SIZE and len(entry["names"]) == 3  # read alone next time
        _logged(spool, range(25, 50), run=run)
        compact(spool, ds)
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        ship(spool, live)
        replay(ds, JsonlTarget(again))
        assert again.read_bytes() == live.read_bytes()
        assert [x["step"] for x in lines(live)] == list(range(50))


def _writer(spool: Path) -> IncarnationWriter:
    info = ensure_run(spool, world_size=1)
    return IncarnationWriter.create(SpoolLayout(spool), info, 0)


def _frame(w: IncarnationWriter, events: list[Any], *, names: bool = False) -> None:
    body = b"".join(encoder.encode(e) for e in events)
    w.write_events(len(events), [msgpack_array_header(len(events)), body], names=names)


class TestBadRecords:
    def test_packed_values_without_their_layout(self, spool: Path) -> None:
        """A packed event whose layout is not in the segment, or whose bytes do not fit it:
        its frame is skipped and reported (never raised), the others read."""
        w = _writer(spool)
        _frame(w, [Names(1.0, 0, ["a", "b"], "mean")], names=True)
        _frame(w, [Packed(0, 0, 0, struct.pack("<2d", 1.0, 2.0)), StepEnd(1.0, 0)])
        _frame(w, [Packed(0, 1, 7, struct.pack("<2d", 1.0, 2.0)), StepEnd(1.0, 1)])
        _frame(w, [Packed(0, 2, 0, struct.pack("<3d", 1.0, 2.0, 3.0)), StepEnd(1.0, 2)])
        _frame(w, [Packed(0, 3, 0, struct.pack("<2d", 3.0, 4.0)), StepEnd(1.0, 3)])
        w.close()
        res = read_segment(w.path)
        assert [r.reason for r in res.bad] == [UNRESOLVED, UNRESOLVED]
        assert [(e.step, e.values) for e in res.events if isinstance(e, Metrics)] == [
            (0, {"a": 1.0, "b": 2.0}), (3, {"a": 3.0, "b": 4.0}),
        ]  # fmt: skip
        assert [f.seq for f in res.frames] == [0, 1, 4]  # (seq 2, 3: as if lost)

    def test_a_layout_naming_a_metric_twice_or_renumbered(self) -> None:
        """A Names record that names a metric twice, or gives a number to other names, is
        refused; the first meaning of a number stands."""
        payload = encoder.encode([
            Names(1.0, 0, ["a", "a"], "mean"),
            Names(1.0, 1, ["b"], "mean"),
            Names(1.0, 1, ["c"], "mean"),
            Packed(0, 0, 1, struct.pack("<d", 5.0)),
        ])  # fmt: skip
        stats = DecodeStats()
        got = decode_events(payload, stats=stats)
        assert [(e.step, e.values) for e in got if isinstance(e, Metrics)] == [(0, {"b": 5.0})]
        assert stats.invalid_events == 2 and stats.reasons is not None
        assert any("twice" in r for r in stats.reasons)


class TestFormat1:
    def test_format1_spool_and_dataset_ship_as_then(self, tmp_path: Path) -> None:
        """tests/data/format1 (written by the release before format 2): today's shipper and
        replay write what that release wrote from it, byte for byte; compacted again today,
        it replays the same."""
        shutil.copytree(DATA / "format1", tmp_path / "f")
        want = (DATA / "format1" / "expected.jsonl").read_bytes()
        spool = tmp_path / "f" / "spool"
        live, again, fresh = (tmp_path / f"{n}.jsonl" for n in ("live", "replay", "fresh"))
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{live}", "--once").returncode == 0
        ds = str(tmp_path / "f" / "dataset")
        assert ranklog_cmd("replay", ds, "--to", f"jsonl:{again}").returncode == 0
        assert live.read_bytes() == want
        assert again.read_bytes() == want
        compact(spool, tmp_path / "ds2")
        replay(tmp_path / "ds2", JsonlTarget(fresh))
        assert fresh.read_bytes() == want

    def test_format1_segment_read_from_an_offset(self) -> None:
        """A format 1 segment read from mid-file (a resumed shipper) gives the same events
        as a whole read from there: no names to look for."""
        seg = next(iter(sorted((DATA / "format1" / "spool" / "ranks" / "00001").iterdir())))
        whole = read_segment(seg)
        mid = whole.frames[len(whole.frames) // 2]
        res = SegmentReader(seg).read(mid.offset, writer_gone=True)
        assert res.events == [e for f in whole.frames if f.offset >= mid.offset for e in f.events]
        assert any(isinstance(e, Metrics) for e in res.events)


class TestWriting:
    def test_a_refused_write_is_retried_with_its_names(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The disk refuses the frame that holds a new layout's record: the retry writes the
        same bytes, record included, and every value resolves."""

        run = rank(spool, 0, 1, code=False, durability="buffered")
        sink = run._sink
        real = sink.writer.write_events
        refused: list[bool] = []

        def once(count: int, payload: Any, *, names: bool = False) -> None:
            if names and not refused:
                refused.append(True)
                raise OSError(errno.ENOSPC, "No space left on device")
            real(count, payload, names=names)

        monkeypatch.setattr(sink.writer, "write_events", once)
        with pytest.warns(Warning, match="cannot write"):
            run.log_metrics({"a": 1.0, "b": 2.0}, step=0)
            run.step_end(0)
            assert not sink.flush()
        assert sink.flush()
        run.close()
        assert refused and [(m.step, m.values) for m in metrics_of(spool)] == [
            (0, {"a": 1.0, "b": 2.0})
        ]

    def test_close_from_a_signal_handler_amid_a_write(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A handler that closes the run while this thread is writing a chunk (it interrupts
        the write) closes it right after the write: nothing written twice, every packed
        value resolves, the rank_end written and the segment sealed."""
        run = rank(spool, 0, 1, code=False, durability="buffered")
        sink = run._sink
        real = sink.writer.write_events
        writes: list[int] = []

        def interrupted(count: int, payload: Any, *, names: bool = False) -> None:
            if not writes:
                writes.append(0)
                run.close()  # what the handler does, on this thread
                assert not sink.writer.closed  # (nothing written by it: after the write)
            real(count, payload, names=names)

        monkeypatch.setattr(sink.writer, "write_events", interrupted)
        for step in range(3):
            run.log_metrics({"a": float(step)}, step=step)
            run.step_end(step)
        assert sink.flush()
        got = [(m.step, m.values) for m in metrics_of(spool)]
        assert got == [(s, {"a": float(s)}) for s in range(3)]
        res = read_segment(SpoolLayout(spool).segments(0)[0].path)
        assert res.sealed and [e.status for e in res.events if isinstance(e, RankEnd)] == ["ok"]


SIGTERM_JOB = """
import os, signal, sys
import ranklog
{handler}
run = ranklog.init(sys.argv[1], rank=0, world_size=1, code=False, durability="step")
real, calls = run._sink.writer.write_events, []

def write(count, payload, *, names=False):
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGTERM)  # lands amid the write of step 2's frame
    real(count, payload, names=names)

run._sink.writer.write_events = write
for step in range(5):
    run.log_metrics({{"a": float(step), "b": 2.0}}, step=step)
    run.step_end(step)
print("went on", flush=True)
"""


class TestSignals:
    @pytest.mark.parametrize("chained", [False, True], ids=["default", "a handler of its own"])
    def test_sigterm_amid_step_end(self, spool: Path, chained: bool) -> None:
        """SIGTERM (SLURM's preemption) lands while step_end writes its frame: ranklog's
        handler closes the rank right after that write. Every step up to it is there once,
        the rank ends 'signal' and its segment is sealed; a handler of the job's own still
        runs (and the job goes on, as it chose)."""
        own = "signal.signal(signal.SIGTERM, lambda *a: print('own handler', flush=True))"
        res = run_python(SIGTERM_JOB.format(handler=own if chained else ""), str(spool))
        if chained:
            assert res.returncode == 0 and "own handler" in res.stdout, res.stderr
        else:
            assert res.returncode == -15, res.stderr
        (seg,) = SpoolLayout(spool).segments(0)
        got = read_segment(seg.path)
        assert got.sealed and got.bad == []
        steps = [e.step for e in got.events if isinstance(e, Metrics)]
        assert steps == sorted(set(steps)) and steps[:3] == [0, 1, 2]
        ends = [e for e in got.events if isinstance(e, RankEnd)]
        assert [(e.status, e.exit_code) for e in ends] == [("signal", 128 + 15)]

    def test_keyboard_interrupt_amid_packing(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ctrl-C while step_end packs a chunk that makes two new layouts: the retry (at
        close) packs it again with both layouts' records; every value resolves."""
        run = rank(spool, 0, 1, code=False, durability="buffered")
        packer = run._sink._packer
        real = packer._pack
        calls: list[int] = []

        def pack(call: Any, made: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(call, made)

        monkeypatch.setattr(packer, "_pack", pack)
        run.log_metrics({"a": 1.0}, step=0)
        run.log_metrics({"b": 2.0}, step=0)
        run.step_end(0)
        with pytest.raises(KeyboardInterrupt):
            run._sink.flush()
        run.close()
        got = [(m.step, m.values) for m in metrics_of(spool)]
        assert got == [(0, {"a": 1.0}), (0, {"b": 2.0})]


class TestReviewed:
    def test_layouts_larger_than_a_segment(self, spool: Path) -> None:
        """Layouts whose records outgrow max_segment_bytes: each segment holds its names
        frame and at least one frame more (not a segment a frame), and all resolves."""
        run = rank(spool, 0, 1, code=False, max_segment_bytes=256 * 1024)  # a frame a step
        for k in range(500):
            run.log_metrics({f"layout_{k:03d}/a_rather_long_metric_name_{i:02d}": 1.0
                             for i in range(20)}, step=0)  # fmt: skip
        run.step_end(0)
        for step in range(1, 101):
            run.log_metrics({"loss": float(step)}, step=step)
            run.step_end(step)
        run.close()
        assert len(SpoolLayout(spool).segments(0)) < 10  # was a segment a step
        assert len(metrics_of(spool)) == 600

    def test_a_wrong_hint_never_raises(self, spool: Path) -> None:
        """Offsets a damaged cursor or manifest gives (negative, huge, not ints, unsorted):
        ignored, the frame headers are followed, the values resolve."""
        _logged(spool, range(30))
        (seg,) = SpoolLayout(spool).segments(0)
        whole = read_segment(seg.path)
        start = whole.frames[-3].offset
        want = [e for f in whole.frames if f.offset >= start for e in f.events]
        for hint in ([-1], [2**63], ["64"], [200, 100], [start + 1], [HEADER_SIZE, HEADER_SIZE]):
            reader = SegmentReader(seg.path)
            reader.resume_from(hint, start)  # type: ignore[arg-type]
            assert reader.read(start, writer_gone=True).events == want, hint

    def test_compaction_says_an_undecodable_frame_once(self, spool: Path, tmp_path: Path) -> None:
        """A frame with a layout's record and an event that does not decode: compaction
        reports it once, and keeps the rest of the frame."""
        w = _writer(spool)
        bad = encoder.encode(["metrics", 1.0, 0, {"x": "oops"}, "mean"])
        good = [Names(1.0, 0, ["a"], "mean"), Packed(0, 0, 0, struct.pack("<d", 1.0))]
        body = b"".join(encoder.encode(e) for e in good) + bad
        w.write_events(3, [msgpack_array_header(3), body], names=True)
        _frame(w, [StepEnd(1.0, 0)])
        w.close()
        result = compact(spool, tmp_path / "ds")
        assert [b.reason for b in result.bad] == ["undecodable events"]
        assert result.values == 1

    def test_last_reads_each_events_values_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A spec with 'last' over packed values: each event's values are made once per
        step, not once per name (that was names x ranks dicts a step)."""
        from ranklog.schemas import MetricsPacked
        from ranklog.shippers._steps import Contribution, StepAcc, StepPartial

        made: list[int] = []
        real = MetricsPacked.values

        def values(self: MetricsPacked) -> dict[str, float]:
            made.append(1)
            return real.fget(self)  # type: ignore[attr-defined, no-any-return]

        monkeypatch.setattr(MetricsPacked, "values", property(values))
        names = tuple(f"n{i}" for i in range(50))
        acc = StepAcc()
        for r in range(4):
            c = acc.ranks[r] = Contribution(1)
            c.events.append(MetricsPacked(1.0 + r, 0, names, tuple([float(r)] * 50), "last"))
            c.count = 1
        got = StepPartial.build(0, acc).finish(closed=4, world_size=4).metrics
        assert got == {n: 3.0 for n in names}
        assert len(made) <= 4

    def test_a_rank_restarted_reads_no_layouts_at_init(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """init's look at whether the rank's last segment is sealed (a killed incarnation,
        producer/_dupes.py) reads its tail only: it follows no frame headers from the
        segment's start (the caller's thread, a 64 MiB segment: a second)."""
        from ranklog.producer import _dupes

        run = rank(spool, 0, 1, code=False)
        for step in range(400):
            run.log_metrics({"a": float(step)}, step=step)
            run.step_end(step)
        run._sink.abandon()  # killed: unsealed
        run._detach("killed")
        run._release_claim()
        (seg,) = SpoolLayout(spool).segments(0)
        assert seg.path.stat().st_size > 2 * _dupes._TAIL_BYTES
        followed: list[int] = []
        monkeypatch.setattr(SegmentReader, "_find_names", lambda *a: followed.append(1))
        assert not _dupes._sealed(seg)
        assert followed == []


class TestCompaction:
    def test_packed_rows_make_the_rows_a_decoded_read_makes(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """Compaction takes packed values in bulk (their layouts' rows, no dict): its rows
        equal, bit for bit, those of each event decoded to a Metrics dict (what `compact
        --delete` verifies before it deletes), with several layouts, plain Metrics events
        (a reduce map), NaN, -0.0 and infinities, and segments rolled over."""
        run = rank(spool, 0, 1, code=False, max_segment_bytes=4096)
        for step in range(60):
            run.log_metrics({"loss": step / 3, "nan": math.nan, "neg": -0.0}, step=step)
            run.log_metrics({f"eval/x{step // 20}": math.inf, "y": -1e300}, step=step,
                            reduce=("mean", "max"))  # fmt: skip
            run.log_metrics({"tok": 1.0}, step=step, reduce={"tok": "sum"})
            run.step_end(step)
        run.close()
        segments = len(SpoolLayout(spool).segments(0))
        assert segments > 2
        result = compact(spool, tmp_path / "ds", delete=True, force=True)
        assert result.kept == [] and len(result.deleted) == segments  # each verified
        assert result.rows["metrics"] == 60 * (3 + 2 + 1)

    def test_a_retried_decode_starts_from_the_layouts_before_it(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """A chunk decoded twice (a values map Metrics refuses sends it back event by event)
        decodes the second time with the layouts it started with: a packed value ahead of
        its layout (foreign bytes) stays unresolved, as the live shipper has it, and replay
        equals live."""
        w = _writer(spool)
        _frame(w, [Names(1.0, 0, ["a"], "mean")], names=True)
        _frame(w, [Packed(0, 0, 0, struct.pack("<d", 1.0)), StepEnd(1.0, 0)])
        _frame(w, [Packed(0, 1, 9, struct.pack("<d", 7.0)), StepEnd(1.0, 1)])
        _frame(w, [Names(2.0, 9, ["c"], "mean")])  # (after its use, in a plain frame)
        bad = encoder.encode(["metrics", 3.0, 2, {"x": "oops"}, "mean"])
        w.write_events(2, [msgpack_array_header(2), bad + encoder.encode(StepEnd(3.0, 2))])
        _frame(w, [Packed(0, 3, 0, struct.pack("<d", 3.0)), StepEnd(3.0, 3)])
        w.close()
        live, again = live_and_replayed(spool, tmp_path)
        assert again.read_bytes() == live.read_bytes()
        assert [x["metrics"].get("c") for x in lines(live)] == [None] * 4
