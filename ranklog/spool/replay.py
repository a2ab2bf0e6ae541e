"""Replay: a compacted Parquet dataset shipped again, through the same engine as live.

The dataset's rows are turned back into each rank's events, frame by frame, in
the order they were written (rank, incarnation, segment, seq, idx), and handed
to the ordinary shipper engine through :class:`ParquetSource`, a stand-in for
the spool directory. Same events, same order, same reduction and completeness
rules: what replay ships is what live shipping shipped (the JSONL is byte for
byte the same). Every rank is treated as ended: an incarnation that never wrote
``rank_end`` gets one (status ``unknown``), so nothing waits for a rank that
will never write again.

Timestamps are those of the dataset, rounded to the microsecond.

After a requeue, steps a rank logged twice (between its last checkpoint and the kill)
replay by default as live shipping shipped them: the first closed values
(``--relogged first``). ``--relogged last`` rebuilds the branch training actually
continued from: the later incarnation's values for those steps.
"""

from __future__ import annotations

import bisect
import fnmatch
import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ranklog.schemas import (
    SCHEMA_VERSION,
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    Params,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
    Text,
    Timer,
)
from ranklog.spool._format import HEADER_SIZE, SegmentHeader
from ranklog.spool._layout import RunInfo, SegmentName, write_run
from ranklog.spool._reader import Frame, ReadResult
from ranklog.spool.parquet import TABLES, load_manifest

__all__ = ["COLUMNS", "ParquetSource", "replay", "segment_events"]

Key = tuple[int, int, int, int]  # incarnation, segment, seq, idx
_KEY: Final = ("incarnation", "segment", "seq", "idx")
#: rows turned into events per read: the engine reads in bounded slices, as from files
_ROWS_PER_READ: Final = 8_192  # about what 256 KiB of a segment holds


SegKey = tuple[int, int, int]  # rank, incarnation, segment


def _segment_files(dataset: Path) -> dict[SegKey, dict[str, list[Path]]]:
    """(rank, incarnation, segment) -> table -> its Parquet files (names carry the segment)."""
    out: dict[SegKey, dict[str, list[Path]]] = defaultdict(lambda: defaultdict(list))
    for name in TABLES:
        for path in sorted((dataset / name).glob("*.parquet")):
            rank, inc, seg = (int(x) for x in path.name.split("-")[:3])
            out[(rank, inc, seg)][name].append(path)
    return dict(sorted(out.items()))


def _table(files: list[Path] | None, columns: list[str], where: Any = None) -> pa.Table | None:
    if not files:
        return None
    t = ds.dataset(files, format="parquet").to_table(columns=[*_KEY, "ts", *columns], filter=where)
    if t.num_rows == 0:
        return None
    t = t.sort_by([(k, "ascending") for k in _KEY])
    return t.set_column(t.schema.get_field_index("ts"), "ts", t["ts"].cast(pa.int64()))


def _cols(t: pa.Table, *names: str) -> list[list[Any]]:
    return [t.column(n).to_pylist() for n in names]


def _metrics(
    t: pa.Table, step_ok: Any, name_ok: Any, filtered: bool, out: list[tuple[Key, Event]]
) -> None:
    """Rows back into Metrics events: rows of one event are contiguous (sorted by key)."""
    n = t.num_rows
    a = [t[k] for k in _KEY]
    change = pc.or_(
        pc.or_(pc.not_equal(a[0][1:], a[0][:-1]), pc.not_equal(a[1][1:], a[1][:-1])),
        pc.or_(pc.not_equal(a[2][1:], a[2][:-1]), pc.not_equal(a[3][1:], a[3][:-1])),
    )
    starts = [0, *(x + 1 for x in pc.indices_nonzero(change).to_pylist()), n]
    heads = t.take(pa.array(starts[:-1], pa.int64()))  # one row per event
    inc, seg, seq, idx, ts, step = _cols(heads, *_KEY, "ts", "step")
    name, value = _cols(t, "name", "value")
    single = pc.count_distinct(t["reduce"]).as_py() == 1
    red = [t["reduce"][0].as_py()] * n if single else t["reduce"].to_pylist()
    for e in range(len(starts) - 1):
        lo, hi = starts[e], starts[e + 1]
        if not step_ok(step[e]):
            continue
        names, values = name[lo:hi], value[lo:hi]
        ops = red[lo:hi]
        if filtered:
            picked = [j for j, nm in enumerate(names) if name_ok(nm)]
            if not picked:
                continue
            names = [names[j] for j in picked]
            values = [values[j] for j in picked]
            ops = [ops[j] for j in picked]
        spec: str | dict[str, str] = (
            ops[0]
            if single or ops.count(ops[0]) == len(ops)
            else dict(zip(names, ops, strict=True))
        )
        ev = Metrics(ts[e] / 1e6, step[e], dict(zip(names, values, strict=True)), spec)
        out.append(((inc[e], seg[e], seq[e], idx[e]), ev))


#: the columns each table is read with (besides the key and ts)
COLUMNS: Final[dict[str, list[str]]] = {
    "metrics": ["step", "name", "value", "reduce"],
    "timers": ["step", "name", "value", "reduce"],
    "text": ["step", "name", "text"],
    "histograms": ["step", "name", "values"],
    "images": ["step", "name", "data", "format"],
    "params": ["name", "value"],
    "gpu": ["host", "index", "util", "mem_used", "mem_total", "temp", "power", "step", "gpu_name"],
    "ranks": ["kind", "step", "world_size", "local_rank", "host", "pid", "version", "status",
              "exit_code"],
}  # fmt: skip


def segment_events(
    tables: dict[str, pa.Table | None],
    rank: int,
    run_id: str,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    cutoff: int | None = None,
) -> list[tuple[Key, Event]]:
    """Events rebuilt from rows of one rank (tables as read by ``_table``), in write order.

    With ``cutoff``, step events and step_ends at or after it are left out (the part of an
    incarnation that a later one, resumed from a checkpoint, logged again).
    """

    def step_ok(step: int) -> bool:
        if cutoff is not None and step >= cutoff:
            return False
        if steps is None:
            return True
        lo, hi = steps
        return (lo is None or step >= lo) and (hi is None or step < hi)

    def name_ok(name: str) -> bool:
        return names is None or fnmatch.fnmatchcase(name, names)

    def keep(step: int, name: str) -> bool:
        return step_ok(step) and name_ok(name)

    out: list[tuple[Key, Event]] = []
    t = tables.get("metrics")
    if t is not None:
        _metrics(t, step_ok, name_ok, names is not None, out)
    simple: dict[str, tuple[list[str], Any]] = {  # columns in the order of the fields
        "timers": (["step", "name", "value", "reduce"], Timer),
        "text": (["step", "name", "text"], Text),
        "histograms": (["step", "name", "values"], Histogram),
        "images": (["step", "name", "data", "format"], Image),
    }
    for table, (columns, make) in simple.items():
        t = tables.get(table)
        if t is None:
            continue
        for inc, seg, seq, idx, ts, *rest in zip(*_cols(t, *_KEY, "ts", *columns), strict=True):
            if keep(rest[0], rest[1]):
                out.append(((inc, seg, seq, idx), make(ts / 1e6, *rest)))
    t = tables.get("params")
    if t is not None:
        grouped: dict[Key, tuple[float, dict[str, ParamValue]]] = {}
        for inc, seg, seq, idx, ts, name, value in zip(
            *_cols(t, *_KEY, "ts", "name", "value"), strict=True
        ):
            grouped.setdefault((inc, seg, seq, idx), (ts / 1e6, {}))[1][name] = json.loads(value)
        out += [(k, Params(ts, values)) for k, (ts, values) in grouped.items()]
    gpu_cols = COLUMNS["gpu"]
    t = tables.get("gpu")
    if t is not None:
        for inc, seg, seq, idx, ts, host, index, util, used, total, temp, power, step, gname in zip(
            *_cols(t, *_KEY, "ts", *gpu_cols), strict=True
        ):
            gpu = Gpu(ts / 1e6, host, index, util, used, total, temp, power, step, gname or "")
            out.append(((inc, seg, seq, idx), gpu))
    rank_cols = COLUMNS["ranks"]
    t = tables.get("ranks")
    if t is not None:
        for (
            inc,
            seg,
            seq,
            idx,
            ts,
            kind,
            step,
            world,
            local,
            host,
            pid,
            version,
            status,
            code,
        ) in zip(*_cols(t, *_KEY, "ts", *rank_cols), strict=True):
            key = (inc, seg, seq, idx)
            s = ts / 1e6
            if kind == "step_end":
                if cutoff is None or step < cutoff:
                    out.append((key, StepEnd(s, step)))
            elif kind == "rank_start":
                out.append(
                    (
                        key,
                        RankStart(
                            s, run_id, rank, world, local, host or "", pid or 0, inc, version or ""
                        ),
                    )
                )
            elif kind == "heartbeat":
                out.append((key, Heartbeat(s)))
            elif kind == "rank_end":
                out.append((key, RankEnd(s, status or "", code)))
    out.sort(key=lambda e: e[0])
    return out


class _ParquetReader:
    """Stands in for a SegmentReader: one original segment, rebuilt from its Parquet files.

    Offsets count frames (``HEADER_SIZE + i`` is the start of frame ``i``). The segment's
    rows are loaded on first use and turned into events a window of frames at a time, so
    memory holds one window of Python objects per segment, not the run.
    """

    def __init__(
        self,
        files: dict[str, list[Path]],
        header: SegmentHeader,
        *,
        last: bool,
        steps: tuple[int | None, int | None] | None,
        names: str | None,
        cutoff: int | None = None,
    ) -> None:
        self.header: SegmentHeader | None = header
        self._files, self._last, self._steps, self._names = files, last, steps, names
        self._cutoff = cutoff
        self._loaded = False
        self._tables: dict[str, tuple[pa.Table | None, list[int]]] | None = None
        self._seqs: list[int] = []
        self._rows: list[int] = []
        self._end_frame = False  # a synthetic rank_end frame closes the rank
        self.size = HEADER_SIZE

    def load(self) -> None:
        """Count the segment's frames from its ``seq`` columns alone (once)."""
        if self._loaded:
            return
        self._loaded = True
        rows: dict[int, int] = defaultdict(int)
        ended = False
        for name, files in self._files.items():
            t = ds.dataset(files, format="parquet").to_table(
                columns=["seq", "kind"] if name == "ranks" else ["seq"]
            )
            for item in pc.value_counts(t["seq"]).to_pylist():
                rows[item["values"]] += item["counts"]
            if name == "ranks":
                ended = bool(pc.any(pc.equal(t["kind"], "rank_end")).as_py())
        self._seqs = sorted(rows)
        self._rows = [rows[q] for q in self._seqs]
        self._end_frame = self._last and not ended
        self.size = HEADER_SIZE + len(self._seqs) + self._end_frame

    def _window(self, lo: int, hi: int) -> dict[str, pa.Table | None]:
        """The segment's rows of frames ``lo..hi`` (its tables are read once, then sliced)."""
        if self._tables is None:
            self._tables = {}
            for name, files in self._files.items():
                t = _table(files, COLUMNS[name])
                self._tables[name] = (t, [] if t is None else t["seq"].to_pylist())
        out: dict[str, pa.Table | None] = {}
        for name, (t, seqs) in self._tables.items():
            a, b = bisect.bisect_left(seqs, lo), bisect.bisect_right(seqs, hi)
            out[name] = None if t is None or a == b else t.slice(a, b - a)
        return out

    def read(
        self, offset: int = 0, *, writer_gone: bool = False, max_bytes: int | None = None
    ) -> ReadResult:
        self.load()
        assert self.header is not None
        start = max(offset, HEADER_SIZE) - HEADER_SIZE
        stop, budget = start, 0
        while stop < len(self._seqs) and (stop == start or budget < _ROWS_PER_READ):
            budget += self._rows[stop]
            stop += 1
        window = self._seqs[start:stop]
        frames: list[Frame] = []
        if window:
            h = self.header
            part = self._window(window[0], window[-1])
            events = segment_events(
                part, h.rank, h.run_id, steps=self._steps, names=self._names, cutoff=self._cutoff
            )
            by_seq: dict[int, list[Event]] = {seq: [] for seq in window}
            for key, ev in events:
                by_seq[key[2]].append(ev)
            for i, seq in enumerate(window):
                pos = HEADER_SIZE + start + i
                frames.append(Frame(pos, pos + 1, seq, SCHEMA_VERSION, by_seq[seq]))
        end = HEADER_SIZE + start + len(frames)
        if self._end_frame and end == self.size - 1:
            last_ts = frames[-1].events[-1].ts if frames and frames[-1].events else 0.0
            frames.append(Frame(end, end + 1, (window[-1] if window else 0) + 1, SCHEMA_VERSION,
                                [RankEnd(last_ts, "unknown", None)]))  # fmt: skip
            end += 1
        res = ReadResult(frames=frames, end=end, size=self.size)
        if end < self.size:
            res.more, res.pending = True, self.size - end
        else:
            res.seal = {"reason": "replay"}
            self._tables = None  # read to the end: let the rows go
        return res


def _cutoffs(dataset: Path) -> dict[tuple[int, int], int]:
    """(rank, incarnation) -> the step a later incarnation of the rank resumed from.

    That incarnation's values from there on are what training actually continued from;
    the earlier incarnation's values for those steps are left out (``--relogged last``).
    """
    starts: dict[tuple[int, int], int] = {}
    for name in ("metrics", "timers", "text"):
        path = dataset / name
        if not path.is_dir() or not any(path.glob("*.parquet")):
            continue
        t = ds.dataset(path, format="parquet").to_table(columns=["rank", "incarnation", "step"])
        for row in t.group_by(["rank", "incarnation"]).aggregate([("step", "min")]).to_pylist():
            key = (row["rank"], row["incarnation"])
            starts[key] = min(starts.get(key, row["step_min"]), row["step_min"])
    out: dict[tuple[int, int], int] = {}
    for (rank, inc), _ in starts.items():
        later = [s for (r, i), s in starts.items() if r == rank and i > inc]
        if later:
            out[(rank, inc)] = min(later)
    return out


class ParquetSource:
    """Stands in for a spool directory: every rank's segments, from a compacted dataset."""

    polling = True
    network = False

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        run: RunInfo,
        *,
        steps: tuple[int | None, int | None] | None = None,
        names: str | None = None,
        relogged: str = "first",
    ) -> None:
        from ranklog.shippers._source import SegState

        if relogged not in ("first", "last"):
            raise ValueError(f"relogged must be 'first' or 'last', got {relogged!r}")
        self.dataset = Path(dataset)
        self.segments: dict[str, SegState] = {}
        self.by_rank: dict[int, list[SegState]] = {}
        self._new: list[SegState] = []
        files = _segment_files(self.dataset)
        last_of_rank = {k[0]: k for k in files}  # sorted: the last key of each rank wins
        cutoffs = _cutoffs(self.dataset) if relogged == "last" else {}
        for (rank, inc, seg), tables in files.items():
            header = SegmentHeader(rank, inc, seg, run.created, run.run_id, run.world_size)
            reader = _ParquetReader(
                dict(tables), header, last=last_of_rank[rank] == (rank, inc, seg),
                steps=steps, names=names, cutoff=cutoffs.get((rank, inc)),
            )  # fmt: skip
            path = self.dataset / f"{rank:05d}-{inc:04d}-{seg:06d}"
            state = SegState(SegmentName(rank, inc, seg, path), f"{rank:05d}/{inc:04d}-{seg:06d}",
                             reader)  # fmt: skip
            self.segments[state.key] = state
            self.by_rank.setdefault(rank, []).append(state)
            self._new.append(state)

    @property
    def mode(self) -> str:
        return f"replay of {self.dataset}"

    def discover(self) -> list[Any]:
        new, self._new = self._new, []
        return new

    def probe(self, seg: Any) -> bool:
        seg.reader.load()
        seg.size = seg.reader.size
        seg.mtime = 0.0  # long silent: every rank is released once read to the end
        return bool(seg.size > seg.offset)

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


def replay(
    dataset: str | os.PathLike[str],
    target: Any,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    per_rank: bool = False,
    relogged: str = "first",
) -> int:
    """Ship a dataset into ``target`` (a Target object) as live shipping would have.

    ``relogged="last"`` rebuilds instead the branch training continued from after a
    restart: for steps a rank logged again, the later incarnation's values count.
    """
    from ranklog.shippers import Shipper

    dataset = Path(dataset)
    manifest = load_manifest(dataset)
    if not manifest.run_id:
        raise ValueError(f"{dataset} is not a ranklog dataset (no {dataset / '_manifest.json'})")
    run = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    scratch = Path(tempfile.mkdtemp(prefix="ranklog-replay-"))  # run.json and the cursor
    try:
        write_run(scratch, run)
        source = ParquetSource(dataset, run, steps=steps, names=names, relogged=relogged)
        shipper = Shipper(
            str(scratch), target, name="replay", start_grace=0, per_rank=per_rank, source=source
        )
        return shipper.run_forever(once=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
