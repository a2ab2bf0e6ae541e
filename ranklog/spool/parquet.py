"""Compaction of a spool into a Parquet dataset: one long-format table per kind.

::

    DIR/
      _manifest.json                               what is done, per source segment
      metrics/<rank>-<inc>-<seg>-<start>-<end>.parquet
      timers/...  text/...  params/...  ranks/...  gpu/...  histograms/...  images/...

File names carry the source segment and the byte range of its frames, so a
run is incremental (a live segment is compacted up to its last complete frame
and continued next time), idempotent (the same range gives the same file) and
crash-safe (files are written tmp -> fsync -> rename, then the manifest; files
a crashed run left that the manifest does not list are removed before the
range is written again). Every table has the columns of :data:`COMMON`; see
:data:`SCHEMAS` for the rest. Rows of one event share (rank, incarnation,
segment, seq, idx), which orders every rank's events as written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog.schemas import (
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    Params,
    RankEnd,
    RankStart,
    StepEnd,
    Text,
    Timer,
)
from ranklog.spool._layout import DIR_MODE, FILE_MODE, SegmentName, SpoolLayout, fsync_dir, read_run
from ranklog.spool._reader import BadRange, Frame, SegmentReader

__all__ = [
    "COMMON",
    "SCHEMAS",
    "STEP_TABLES",
    "TABLES",
    "CompactResult",
    "Manifest",
    "compact",
    "load_manifest",
    "segment_tables",
]

log = logging.getLogger("ranklog.compact")

_TS = pa.timestamp("us", tz="UTC")
COMMON: Final = [
    ("run_id", pa.string()),
    ("rank", pa.int32()),
    ("incarnation", pa.int32()),
    ("segment", pa.int32()),
    ("seq", pa.int64()),  # frame sequence number within the incarnation
    ("idx", pa.int32()),  # event index within the frame
    ("ts", _TS),
]
#: tables whose rows belong to a step; they carry ``relogged`` last
STEP_TABLES: Final = ("metrics", "timers", "text", "histograms", "images")
SCHEMAS: Final[dict[str, pa.Schema]] = {
    name: pa.schema(COMMON + extra + ([("relogged", pa.bool_())] if name in STEP_TABLES else []))
    for name, extra in {
        "metrics": [("step", pa.int64()), ("name", pa.string()), ("value", pa.float64()),
                    ("reduce", pa.string())],
        "timers": [("step", pa.int64()), ("name", pa.string()), ("value", pa.float64()),
                   ("reduce", pa.string())],
        "text": [("step", pa.int64()), ("name", pa.string()), ("text", pa.large_string())],
        "histograms": [("step", pa.int64()), ("name", pa.string()),
                       ("values", pa.list_(pa.float64()))],
        "images": [("step", pa.int64()), ("name", pa.string()), ("format", pa.string()),
                   ("data", pa.large_binary())],
        "params": [("name", pa.string()), ("value", pa.string())],  # value: JSON text
        "gpu": [("host", pa.string()), ("index", pa.int32()), ("gpu_name", pa.string()),
                ("util", pa.float64()), ("mem_used", pa.int64()), ("mem_total", pa.int64()),
                ("temp", pa.float64()), ("power", pa.float64()), ("step", pa.int64())],
        "ranks": [("kind", pa.string()), ("step", pa.int64()), ("world_size", pa.int32()),
                  ("local_rank", pa.int32()), ("host", pa.string()), ("pid", pa.int64()),
                  ("version", pa.string()), ("status", pa.string()), ("exit_code", pa.int32())],
    }.items()
}  # fmt: skip
TABLES: Final = tuple(SCHEMAS)
MANIFEST: Final = "_manifest.json"
#: frames read per output file: bounds memory, keeps files large enough to scan fast
CHUNK_BYTES: Final = 64 * 1024 * 1024
_ROW_GROUP: Final = 1_000_000
_ENCODINGS: Final = {
    "seq": "DELTA_BINARY_PACKED",
    "idx": "DELTA_BINARY_PACKED",
    "ts": "DELTA_BINARY_PACKED",
    "value": "BYTE_STREAM_SPLIT",
}


class _Columns:
    """Column lists for one table, filled row by row (or event by event)."""

    def __init__(self, table: str) -> None:
        self.names = SCHEMAS[table].names
        self.cols: dict[str, list[Any]] = {n: [] for n in self.names}
        self._pairs = list(self.cols.items())

    def rows(self, n: int, **values: Any) -> None:
        """Append ``n`` rows; a list value gives each row its own, a scalar is repeated."""
        for name in self.names:
            v = values.get(name)
            if isinstance(v, list) and name != "values":
                self.cols[name].extend(v)
            else:
                self.cols[name].extend([v] * n)

    def row(self, values: dict[str, Any]) -> None:
        """Append one row."""
        get = values.get
        for name, col in self._pairs:
            col.append(get(name))

    def table(self, table: str) -> pa.Table:
        schema = SCHEMAS[table]
        if table in STEP_TABLES:  # relogged is added by segment_tables
            schema = schema.remove(schema.get_field_index("relogged"))
        return pa.Table.from_pydict(self.cols, schema=schema)

    def __len__(self) -> int:
        return len(self.cols["rank"])


def _us(ts: float) -> int:
    return round(ts * 1_000_000)


def segment_tables(
    run_id: str, seg: SegmentName, frames: list[Frame], relogged_upto: int = -1
) -> dict[str, pa.Table]:
    """The rows of ``frames`` (one segment's), as one Arrow table per kind (empty ones left out).

    Rows of steps up to ``relogged_upto`` (the steps an earlier incarnation of the rank had
    closed) are marked ``relogged``: training logged them again after a restart.
    """
    out = {t: _Columns(t) for t in TABLES if t != "metrics"}
    base = {"run_id": run_id, "rank": seg.rank, "incarnation": seg.incarnation,
            "segment": seg.segment}  # fmt: skip
    metrics = _MetricColumns()
    ends: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for frame in frames:
        for idx, ev in enumerate(frame.events):
            if type(ev) is Metrics:
                metrics.add(frame.seq, idx, ev)
            elif type(ev) is StepEnd:  # one per step and rank: the common case, columnar
                ends[0].append(frame.seq)
                ends[1].append(idx)
                ends[2].append(_us(ev.ts))
                ends[3].append(ev.step)
            else:
                key = base.copy()
                key["seq"], key["idx"], key["ts"] = frame.seq, idx, _us(ev.ts)
                _ADD[type(ev)](out, ev, key)
    tables = {t: c.table(t) for t, c in out.items() if len(c)}
    if metrics.rows:
        tables["metrics"] = metrics.table(run_id, seg)
    if ends[0]:
        step_ends = _step_end_table(run_id, seg, *ends)
        other = tables.get("ranks")
        merged = step_ends if other is None else pa.concat_tables([other, step_ends])
        tables["ranks"] = merged.sort_by([("seq", "ascending"), ("idx", "ascending")])
    for name in STEP_TABLES:
        t = tables.get(name)
        if t is not None:
            flag = pc.less_equal(t["step"], pa.scalar(relogged_upto, pa.int64()))
            tables[name] = t.append_column("relogged", flag)
    return {t: tables[t] for t in TABLES if t in tables}


def _step_end_table(
    run_id: str, seg: SegmentName, seq: list[int], idx: list[int], ts: list[int], step: list[int]
) -> pa.Table:
    n = len(seq)
    schema = SCHEMAS["ranks"]
    cols = {
        "run_id": pa.repeat(pa.scalar(run_id, pa.string()), n),
        "rank": pa.repeat(pa.scalar(seg.rank, pa.int32()), n),
        "incarnation": pa.repeat(pa.scalar(seg.incarnation, pa.int32()), n),
        "segment": pa.repeat(pa.scalar(seg.segment, pa.int32()), n),
        "seq": pa.array(seq, pa.int64()),
        "idx": pa.array(idx, pa.int32()),
        "ts": pa.array(ts, pa.int64()).cast(_TS),
        "kind": pa.repeat(pa.scalar("step_end", pa.string()), n),
        "step": pa.array(step, pa.int64()),
    }
    return pa.table([cols.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema)


class _MetricColumns:
    """The metrics table, built per event and expanded to one row per value in Arrow."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.idx: list[int] = []
        self.ts: list[int] = []
        self.step: list[int] = []
        self.reduce: list[str] = []
        self.row_event: list[int] = []
        self.names: list[str] = []
        self.values: list[float] = []
        self.per_name_ops: list[str] | None = None  # when some event reduces per name
        self.rows = 0

    def add(self, seq: int, idx: int, ev: Metrics) -> None:
        n = len(ev.values)
        k = len(self.seq)
        self.seq.append(seq)
        self.idx.append(idx)
        self.ts.append(_us(ev.ts))
        self.step.append(ev.step)
        red = ev.reduce
        if isinstance(red, str):
            self.reduce.append(red)
            if self.per_name_ops is not None:
                self.per_name_ops.extend([red] * n)
        else:
            self.reduce.append("")
            if self.per_name_ops is None:  # switch to one op per row
                self.per_name_ops = [self.reduce[e] for e in self.row_event]
            self.per_name_ops.extend(red.get(name, "mean") for name in ev.values)
        self.row_event.extend([k] * n)
        self.names.extend(ev.values)
        self.values.extend(ev.values.values())
        self.rows += n

    def table(self, run_id: str, seg: SegmentName) -> pa.Table:
        events = pa.table(
            {
                "seq": pa.array(self.seq, pa.int64()),
                "idx": pa.array(self.idx, pa.int32()),
                "ts": pa.array(self.ts, pa.int64()).cast(_TS),
                "step": pa.array(self.step, pa.int64()),
                "reduce": pa.array(self.reduce, pa.string()),
            }
        ).take(pa.array(self.row_event, pa.int32()))
        n = self.rows
        reduce = (
            events["reduce"]
            if self.per_name_ops is None
            else pa.array(self.per_name_ops, pa.string())
        )
        return pa.table(
            [
                pa.repeat(pa.scalar(run_id, pa.string()), n),
                pa.repeat(pa.scalar(seg.rank, pa.int32()), n),
                pa.repeat(pa.scalar(seg.incarnation, pa.int32()), n),
                pa.repeat(pa.scalar(seg.segment, pa.int32()), n),
                events["seq"],
                events["idx"],
                events["ts"],
                events["step"],
                pa.array(self.names, pa.string()),
                pa.array(self.values, pa.float64()),
                reduce,
            ],
            schema=SCHEMAS["metrics"].remove(SCHEMAS["metrics"].get_field_index("relogged")),
        )


def _timer(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, value=ev.seconds, reduce=ev.reduce)
    out["timers"].row(key)


def _text(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, text=ev.text)
    out["text"].row(key)


def _histogram(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, values=ev.values)
    out["histograms"].row(key)


def _image(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, format=ev.format, data=ev.data)
    out["images"].row(key)


def _params(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    n = len(ev.values)
    vals = [json.dumps(v) for v in ev.values.values()]
    out["params"].rows(n, **key, name=list(ev.values), value=vals)


def _gpu(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(host=ev.host, index=ev.index, gpu_name=ev.name, util=ev.util,
               mem_used=ev.mem_used, mem_total=ev.mem_total, temp=ev.temp, power=ev.power,
               step=ev.step)  # fmt: skip
    out["gpu"].row(key)


def _rank_event(kind: str) -> Callable[[dict[str, _Columns], Any, dict[str, Any]], None]:
    def add(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
        key["kind"] = kind
        if type(ev) is StepEnd:
            key["step"] = ev.step
        elif isinstance(ev, RankStart):
            key.update(world_size=ev.world_size, local_rank=ev.local_rank, host=ev.host,
                       pid=ev.pid, version=ev.version)  # fmt: skip
        elif isinstance(ev, RankEnd):
            key.update(status=ev.status, exit_code=ev.exit_code)
        out["ranks"].row(key)

    return add


_ADD: Final[dict[type, Callable[[dict[str, _Columns], Any, dict[str, Any]], None]]] = {
    Timer: _timer,
    Text: _text,
    Histogram: _histogram,
    Image: _image,
    Params: _params,
    Gpu: _gpu,
    RankStart: _rank_event("rank_start"),
    StepEnd: _rank_event("step_end"),
    Heartbeat: _rank_event("heartbeat"),
    RankEnd: _rank_event("rank_end"),
}


# -- the manifest and the compaction run ----------------------------------------------------


class SegmentEntry(msgspec.Struct, forbid_unknown_fields=False):
    """What the manifest knows of one source segment."""

    offset: int = 0  # the next byte to compact
    sealed: bool = False
    done: bool = False  # nothing more will ever come from it
    files: list[str] = msgspec.field(default_factory=list)
    rows: dict[str, int] = msgspec.field(default_factory=dict)
    verified: bool = False
    deleted: bool = False


class Manifest(msgspec.Struct, forbid_unknown_fields=False):
    """``DIR/_manifest.json``: which frames of which segment are in which files."""

    version: int = 1
    run_id: str = ""
    name: str = ""
    world_size: int | None = None
    created: float = 0.0
    segments: dict[str, SegmentEntry] = msgspec.field(default_factory=dict)
    bad: list[str] = msgspec.field(default_factory=list)
    #: "rank/incarnation" -> [closed step, highest step]: what each incarnation had closed
    marks: dict[str, list[int]] = msgspec.field(default_factory=dict)

    def relogged_upto(self, rank: int, incarnation: int) -> int:
        """The highest step an earlier incarnation of ``rank`` had closed (-1: none)."""
        best = -1
        for key, (closed, top) in self.marks.items():
            r, inc = (int(x) for x in key.split("/"))
            if r == rank and inc < incarnation:
                best = max(best, closed, top - 1)
        return best


@dataclass(slots=True)
class CompactResult:
    """What one ``compact`` run did."""

    files: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    values: int = 0
    bad: list[BadRange] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # --delete refused, with why


def load_manifest(out: Path) -> Manifest:
    """The manifest of a dataset directory (empty when there is none yet)."""
    try:
        return msgspec.json.decode((out / MANIFEST).read_bytes(), type=Manifest)
    except FileNotFoundError:
        return Manifest()


def _save_manifest(out: Path, manifest: Manifest) -> None:
    _atomic_write(out / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)))


def _atomic_write(
    path: Path, data: bytes | Callable[[str], None], *, sync_dir: bool = True
) -> None:
    """Write ``path`` via a temporary file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(data):
            data(str(tmp))
        else:
            tmp.write_bytes(data)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if sync_dir:
        fsync_dir(path.parent)


def _key(seg: SegmentName) -> str:
    return f"{seg.rank:05d}-{seg.incarnation:04d}-{seg.segment:06d}"


def _write_tables(
    out: Path, key: str, start: int, end: int, tables: dict[str, pa.Table]
) -> list[str]:
    files = []
    for table, data in tables.items():
        rel = f"{table}/{key}-{start:012d}-{end:012d}.parquet"
        path = out / rel
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _atomic_write(path, _parquet_writer(data), sync_dir=False)
        files.append(rel)
    for rel in files:  # the renames are durable before the manifest lists the files
        fsync_dir((out / rel).parent)
    return files


_DICTIONARY: Final = ("run_id", "name", "reduce", "kind", "host", "status", "format",
                      "gpu_name", "version")  # fmt: skip


def _parquet_writer(data: pa.Table) -> Callable[[str], None]:
    names = set(data.schema.names)
    encodings = {
        c: e
        for c, e in _ENCODINGS.items()
        if c in names
        and (e != "BYTE_STREAM_SPLIT" or pa.types.is_floating(data.schema.field(c).type))
    }

    def write(path: str) -> None:
        pq.write_table(
            data,
            path,
            compression="zstd",
            row_group_size=_ROW_GROUP,
            use_dictionary=[c for c in _DICTIONARY if c in names],
            column_encoding=encodings,
        )

    return write


def _remove_orphans(out: Path, key: str, entry: SegmentEntry) -> None:
    """Files of this segment that a crashed run wrote but the manifest never listed."""
    listed = set(entry.files)
    for table in TABLES:
        for path in (out / table).glob(f"{key}-*.parquet"):
            if f"{table}/{path.name}" not in listed:
                path.unlink()


def compact(
    spool: str | os.PathLike[str], out: str | os.PathLike[str], *, delete: bool = False
) -> CompactResult:
    """Compact every new complete frame of ``spool`` into the dataset at ``out``."""
    layout = SpoolLayout(spool)
    outdir = Path(out)
    outdir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    run = read_run(spool)
    manifest = load_manifest(outdir)
    if manifest.run_id and manifest.run_id != run.run_id:
        raise ValueError(f"{outdir} holds run {manifest.run_id}, not {run.run_id}")
    manifest.run_id, manifest.name = run.run_id, run.name
    manifest.world_size, manifest.created = run.world_size, run.created
    result = CompactResult()
    for rank in layout.ranks():
        segs = layout.segments(rank)
        for i, seg in enumerate(segs):
            later = i + 1 < len(segs)
            key = _key(seg)
            entry = manifest.segments.setdefault(key, SegmentEntry())
            if entry.done:
                continue
            _remove_orphans(outdir, key, entry)
            _compact_segment(run.run_id, seg, later, outdir, key, entry, result, manifest)
            _save_manifest(outdir, manifest)
    if result.bad:
        manifest.bad += [str(b) for b in result.bad]
        _save_manifest(outdir, manifest)
    if delete:
        _delete_verified(layout, run.run_id, outdir, manifest, result)
        _save_manifest(outdir, manifest)
    return result


def _compact_segment(
    run_id: str,
    seg: SegmentName,
    later: bool,
    outdir: Path,
    key: str,
    entry: SegmentEntry,
    result: CompactResult,
    manifest: Manifest,
) -> None:
    reader = SegmentReader(seg.path)
    upto = manifest.relogged_upto(seg.rank, seg.incarnation)
    mark = manifest.marks.setdefault(f"{seg.rank}/{seg.incarnation}", [-1, -1])
    while True:
        res = reader.read(entry.offset, writer_gone=later, max_bytes=CHUNK_BYTES)
        for b in res.bad:
            if b.offset >= entry.offset:
                log.warning("corrupt spool bytes skipped: %s", b)
                result.bad.append(b)
        header = reader.header
        foreign = header is not None and (header.run_id, header.rank, header.incarnation) != (
            run_id, seg.rank, seg.incarnation,
        )  # fmt: skip
        if foreign:
            assert header is not None
            why = f"{seg.path}: segment of run {header.run_id} rank {header.rank}, skipped"
            log.warning(why)
            result.bad.append(BadRange(str(seg.path), 0, res.size, why))
            entry.offset, entry.done = res.size, True
            return
        if res.frames:
            start = res.frames[0].offset
            tables = segment_tables(run_id, seg, res.frames, upto)
            _update_mark(mark, res.frames)
            files = _write_tables(outdir, key, start, res.end, tables)
            entry.files += files
            for table, data in tables.items():
                entry.rows[table] = entry.rows.get(table, 0) + data.num_rows
                result.rows[table] = result.rows.get(table, 0) + data.num_rows
            result.files += len(files)
            result.values += tables["metrics"].num_rows if "metrics" in tables else 0
        entry.offset = max(entry.offset, res.end)
        entry.sealed = entry.sealed or res.sealed
        if not res.more:
            entry.done = res.sealed or (later and res.pending == 0)
            return


def _update_mark(mark: list[int], frames: list[Frame]) -> None:
    """Raise [closed, highest step] of an incarnation by what ``frames`` hold."""
    for frame in frames:
        for ev in frame.events:
            if type(ev) is StepEnd:
                mark[0] = max(mark[0], ev.step)
            elif isinstance(ev, Metrics | Timer | Text | Histogram | Image):
                mark[1] = max(mark[1], ev.step)


def _delete_verified(
    layout: SpoolLayout, run_id: str, outdir: Path, manifest: Manifest, result: CompactResult
) -> None:
    """Delete sealed segments whose rows read back equal to a fresh read of the segment.

    A segment a shipper has not finished with (its cursor does not mark it done)
    is kept: deleting it would take data from under a live shipper.
    """
    unfinished = _unfinished_by_shippers(layout)
    for rank in layout.ranks():
        for seg in layout.segments(rank):
            key = _key(seg)
            entry = manifest.segments.get(key)
            why = _why_keep(entry, key, unfinished)
            if why is None:
                assert entry is not None
                why = _verify(run_id, seg, outdir, entry)
            if why is not None:
                result.kept.append(f"{seg.path}: {why}")
                continue
            assert entry is not None
            entry.verified = True
            seg.path.unlink()
            fsync_dir(seg.path.parent)
            entry.deleted = True
            result.deleted.append(str(seg.path))


def _why_keep(entry: SegmentEntry | None, key: str, unfinished: set[str]) -> str | None:
    if entry is None or not entry.done:
        return "not fully compacted yet"
    if not entry.sealed:
        return "not sealed (its writer may be alive, or it died without a seal)"
    shipper_key = key[:5] + "/" + key[6:]
    if shipper_key in unfinished:
        return "a shipper has not shipped all of it yet"
    return None


def _unfinished_by_shippers(layout: SpoolLayout) -> set[str]:
    keys: set[str] = set()
    if not layout.cursors_dir.is_dir():
        return keys
    for path in layout.cursors_dir.glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            cursor = json.loads(path.read_bytes())
            done = {k for k, v in cursor.get("segments", {}).items() if v.get("done")}
            for seg in layout.all_segments():
                k = f"{seg.rank:05d}/{seg.incarnation:04d}-{seg.segment:06d}"
                if k not in done:
                    keys.add(k)
    return keys


def _verify(run_id: str, seg: SegmentName, outdir: Path, entry: SegmentEntry) -> str | None:
    """None when the Parquet rows of ``seg`` equal a fresh read of it, else why not."""
    res = SegmentReader(seg.path).read(0, writer_gone=True)
    upto = load_manifest(outdir).relogged_upto(seg.rank, seg.incarnation)
    expected = segment_tables(run_id, seg, res.frames, upto)
    for table in TABLES:
        files = sorted(f for f in entry.files if f.startswith(f"{table}/"))
        want = expected.get(table)
        if not files:
            if want is not None and want.num_rows:
                return f"{table}: no Parquet file for {want.num_rows} rows"
            continue
        got = pa.concat_tables([pq.read_table(outdir / f) for f in files]).cast(SCHEMAS[table])
        if want is None or not got.equals(want):
            return f"{table}: the Parquet rows differ from the segment"
    return None
