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
"""

from __future__ import annotations

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

__all__ = ["ParquetSource", "rank_events", "replay"]

Key = tuple[int, int, int, int]  # incarnation, segment, seq, idx
_KEY: Final = ("incarnation", "segment", "seq", "idx")
#: frames handed to the engine per read (it reads in bounded slices, as from files)
_FRAMES_PER_READ: Final = 512


def _rank_files(dataset: Path) -> dict[str, dict[int, list[Path]]]:
    """table -> rank -> its Parquet files (a file's name starts with its rank)."""
    out: dict[str, dict[int, list[Path]]] = {}
    for name in TABLES:
        per_rank: dict[int, list[Path]] = defaultdict(list)
        for path in sorted((dataset / name).glob("*.parquet")):
            per_rank[int(path.name.split("-", 1)[0])].append(path)
        out[name] = dict(per_rank)
    return out


def _table(files: list[Path] | None, columns: list[str]) -> pa.Table | None:
    if not files:
        return None
    t = ds.dataset(files, format="parquet").to_table(columns=[*_KEY, "ts", *columns])
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


def rank_events(
    files: dict[str, dict[int, list[Path]]],
    rank: int,
    run_id: str,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
) -> list[tuple[Key, Event]]:
    """One rank's events, in write order, rebuilt from the dataset (selections applied)."""

    def step_ok(step: int) -> bool:
        if steps is None:
            return True
        lo, hi = steps
        return (lo is None or step >= lo) and (hi is None or step < hi)

    def name_ok(name: str) -> bool:
        return names is None or fnmatch.fnmatchcase(name, names)

    def keep(step: int, name: str) -> bool:
        return step_ok(step) and name_ok(name)

    out: list[tuple[Key, Event]] = []
    t = _table(files["metrics"].get(rank), ["step", "name", "value", "reduce"])
    if t is not None:
        _metrics(t, step_ok, name_ok, names is not None, out)
    simple: dict[str, tuple[list[str], Any]] = {  # columns in the order of the fields
        "timers": (["step", "name", "value", "reduce"], Timer),
        "text": (["step", "name", "text"], Text),
        "histograms": (["step", "name", "values"], Histogram),
        "images": (["step", "name", "data", "format"], Image),
    }
    for table, (columns, make) in simple.items():
        t = _table(files[table].get(rank), columns)
        if t is None:
            continue
        for inc, seg, seq, idx, ts, *rest in zip(*_cols(t, *_KEY, "ts", *columns), strict=True):
            if keep(rest[0], rest[1]):
                out.append(((inc, seg, seq, idx), make(ts / 1e6, *rest)))
    t = _table(files["params"].get(rank), ["name", "value"])
    if t is not None:
        grouped: dict[Key, tuple[float, dict[str, ParamValue]]] = {}
        for inc, seg, seq, idx, ts, name, value in zip(
            *_cols(t, *_KEY, "ts", "name", "value"), strict=True
        ):
            grouped.setdefault((inc, seg, seq, idx), (ts / 1e6, {}))[1][name] = json.loads(value)
        out += [(k, Params(ts, values)) for k, (ts, values) in grouped.items()]
    gpu_cols = [
        "host",
        "index",
        "util",
        "mem_used",
        "mem_total",
        "temp",
        "power",
        "step",
        "gpu_name",
    ]
    t = _table(files["gpu"].get(rank), gpu_cols)
    if t is not None:
        for inc, seg, seq, idx, ts, host, index, util, used, total, temp, power, step, gname in zip(
            *_cols(t, *_KEY, "ts", *gpu_cols), strict=True
        ):
            gpu = Gpu(ts / 1e6, host, index, util, used, total, temp, power, step, gname or "")
            out.append(((inc, seg, seq, idx), gpu))
    rank_cols = [
        "kind",
        "step",
        "world_size",
        "local_rank",
        "host",
        "pid",
        "version",
        "status",
        "exit_code",
    ]
    t = _table(files["ranks"].get(rank), rank_cols)
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
    """Stands in for a SegmentReader: one original segment's frames, rebuilt from Parquet.

    Offsets count frames (``HEADER_SIZE + i`` is the start of frame ``i``).
    """

    def __init__(self, header: SegmentHeader, frames: list[Frame], path: Path) -> None:
        self.header: SegmentHeader | None = header
        self.frames = frames
        self.size = HEADER_SIZE + len(frames)

    def read(
        self, offset: int = 0, *, writer_gone: bool = False, max_bytes: int | None = None
    ) -> ReadResult:
        start = max(offset, HEADER_SIZE) - HEADER_SIZE
        chunk = self.frames[start : start + _FRAMES_PER_READ]
        end = HEADER_SIZE + start + len(chunk)
        res = ReadResult(frames=chunk, end=end, size=self.size)
        if end < self.size:
            res.more = True
            res.pending = self.size - end
        else:
            res.seal = {"reason": "replay"}
        return res


class ParquetSource:
    """Stands in for a spool directory: every rank's events, from a compacted dataset."""

    polling = True
    network = False

    def __init__(
        self,
        dataset: str | os.PathLike[str],
        run: RunInfo,
        *,
        steps: tuple[int | None, int | None] | None = None,
        names: str | None = None,
    ) -> None:
        from ranklog.shippers._source import SegState

        self.dataset = Path(dataset)
        self.segments: dict[str, SegState] = {}
        self.by_rank: dict[int, list[SegState]] = {}
        self._new: list[SegState] = []
        files = _rank_files(self.dataset)
        for rank in sorted({r for per_rank in files.values() for r in per_rank}):
            events = rank_events(files, rank, run.run_id, steps=steps, names=names)
            for (inc, seg), frames in _frames(events, rank).items():
                header = SegmentHeader(rank, inc, seg, run.created, run.run_id, run.world_size)
                path = self.dataset / f"{rank:05d}-{inc:04d}-{seg:06d}"
                state = SegState(
                    SegmentName(rank, inc, seg, path),
                    f"{rank:05d}/{inc:04d}-{seg:06d}",
                    _ParquetReader(header, frames, path),
                )
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
        seg.size = seg.reader.size
        seg.mtime = 0.0  # long silent: every rank is released once read to the end
        return bool(seg.size > seg.offset)

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


def _frames(events: list[tuple[Key, Event]], rank: int) -> dict[tuple[int, int], list[Frame]]:
    """Events grouped into frames per (incarnation, segment); the last incarnation ends."""
    grouped: dict[tuple[int, int], list[Frame]] = defaultdict(list)
    current: tuple[int, int, int] | None = None
    for key, ev in events:
        if key[:3] != current:
            current = key[:3]
            frames = grouped[key[:2]]
            pos = HEADER_SIZE + len(frames)
            frames.append(Frame(pos, pos + 1, key[2], SCHEMA_VERSION, []))
        grouped[key[:2]][-1].events.append(ev)
    if events and not isinstance(events[-1][1], RankEnd):
        last_key, last = events[-1]
        frames = grouped[last_key[:2]]
        pos = HEADER_SIZE + len(frames)
        end = RankEnd(last.ts, "unknown", None)
        frames.append(Frame(pos, pos + 1, last_key[2] + 1, SCHEMA_VERSION, [end]))
    return dict(sorted(grouped.items()))


def replay(
    dataset: str | os.PathLike[str],
    target: Any,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    per_rank: bool = False,
) -> int:
    """Ship a dataset into ``target`` (a Target object) as live shipping would have."""
    from ranklog.shippers import Shipper

    dataset = Path(dataset)
    manifest = load_manifest(dataset)
    if not manifest.run_id:
        raise ValueError(f"{dataset} is not a ranklog dataset (no {dataset / '_manifest.json'})")
    run = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    scratch = Path(tempfile.mkdtemp(prefix="ranklog-replay-"))  # run.json and the cursor
    try:
        write_run(scratch, run)
        source = ParquetSource(dataset, run, steps=steps, names=names)
        shipper = Shipper(
            str(scratch), target, name="replay", start_grace=0, per_rank=per_rank, source=source
        )
        return shipper.run_forever(once=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
