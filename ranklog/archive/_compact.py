"""``ranklog compact``: a spool's events written as a Parquet dataset, incrementally and crash-safe.

::

    DIR/
      _manifest.json                               what is done, per source segment
      metrics/<rank>-<inc>-<seg>-<start>-<end>.parquet
      timers/...  text/...  params/...  ranks/...  gpu/...  histograms/...  images/...
      tables/...

File names carry the source segment and the byte range of its frames, so a run
is incremental (a live segment is compacted up to its last complete frame and
continued next time), idempotent (the same range gives the same file) and
crash-safe (files are written tmp -> fsync -> rename, then the manifest; files a
crashed run left that the manifest does not list are removed before the range is
written again). The tables are described in :mod:`ranklog.archive._tables`.

Chunks' files are written on two threads (:class:`_Writer`) while the next chunk is read
and turned into columns: Parquet encoding, compression and fsync run without the GIL.
The manifest is saved only once every file it lists is durable.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog._fs import DIR_MODE, atomic_write, fsync_dir
from ranklog.archive._manifest import (
    Manifest,
    SegmentEntry,
    load_manifest,
    save_manifest,
)
from ranklog.archive._tables import (
    SCHEMAS,
    TABLES,
    NamesRow,
    names_row,
    raw_segment_tables,
    segment_tables,
)
from ranklog.errors import ConfigError, CursorError, RunMismatchError
from ranklog.schemas import (
    DecodeStats,
    Event,
    Layouts,
    MetricsRaw,
    decode_events,
    decode_events_raw,
)
from ranklog.spool import (
    HEADER_SIZE,
    UNDECODABLE,
    UNRESOLVED,
    BadRange,
    Frame,
    SegmentId,
    SegmentName,
    SegmentReader,
    SpoolLayout,
    record_deleted,
    require_run,
)

__all__ = ["CompactResult", "compact"]

log = logging.getLogger("ranklog.compact")

#: spool bytes read per output file. This bounds memory: decoded, 8 MiB of metric
#: frames take ~130 MB (peak RSS ~210 MB for a 64 MiB segment, ~530 MB with 64 MiB chunks),
#: and a file still holds ~370 K values, large enough to scan fast
CHUNK_BYTES: Final = 8 * 1024 * 1024
#: spool bytes compacted between two saves of the manifest (and at the end of a run)
SAVE_BYTES: Final = 64 * 1024 * 1024
#: chunks written at once: the writer encodes a chunk's Parquet in ~1.5x the time the main
#: thread takes to read and build it, so a second thread keeps both cores busy
WRITERS: Final = 2
#: rows per row group: replay reads by row group, so this bounds what it decodes at once
_ROW_GROUP: Final = 8_192
_ENCODINGS: Final = {
    "seq": "DELTA_BINARY_PACKED",
    "idx": "DELTA_BINARY_PACKED",
    "ts": "DELTA_BINARY_PACKED",
    "step": "DELTA_BINARY_PACKED",
    "value": "BYTE_STREAM_SPLIT",
}


@dataclass(slots=True)
class CompactResult:
    """What one ``compact`` run did."""

    files: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    values: int = 0
    bad: list[BadRange] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # --delete refused, with why


def _file(table: str, key: str, start: int, end: int) -> str:
    """A table's file for frames [start, end) of segment ``key``, relative to the dataset."""
    return f"{table}/{key}-{start:012d}-{end:012d}.parquet"


def _write_tables(
    out: Path, key: str, start: int, end: int, tables: dict[str, pa.Table]
) -> list[str]:
    """Each table's file (written and fsync'd; its directory is fsync'd by :class:`_Saver`)."""
    files = []
    for table, data in tables.items():
        rel = _file(table, key, start, end)
        path = out / rel
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        atomic_write(path, _parquet_writer(data), sync_dir=False)
        files.append(rel)
    return files


class _Writer:
    """Writes chunks' files on :data:`WRITERS` threads while the next chunk is read and built.

    Encoding, compressing and fsync'ing Parquet run without the GIL, so they overlap
    the decoding and column building of the next chunk. At most :data:`WRITERS` chunks
    are in flight (memory stays at that many chunks' tables, and the one being built);
    :meth:`wait` returns once every submitted file is durable, and raises what a write
    raised.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="ranklog-compact")
        self._pending: deque[Future[list[str]]] = deque()

    def submit(
        self, out: Path, key: str, start: int, end: int, tables: dict[str, pa.Table]
    ) -> list[str]:
        """Start writing ``tables``; the files they will be, relative to ``out``."""
        while len(self._pending) >= WRITERS:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(_write_tables, out, key, start, end, tables))
        return [_file(table, key, start, end) for table in tables]

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Wait for the writes in flight (whatever happened) and stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Saver:
    """Saves the manifest every :data:`SAVE_BYTES` of spool compacted, and at the end.

    Before each save, the writes in flight are waited for and the directories of the
    files written since the last one are fsync'd: their renames are durable before the
    manifest lists them. A crash between
    saves leaves files no manifest lists; the next run removes them and compacts those
    frames again (:class:`_Orphans`).
    """

    def __init__(self, out: Path, manifest: Manifest, result: CompactResult) -> None:
        self.out, self.manifest, self.result = out, manifest, result
        self.dirs: set[Path] = set()
        self.pending = 0  # spool bytes compacted since the last save
        self._bad = 0  # damaged ranges of this run already in the manifest
        self.writer = _Writer()

    def wrote(self, files: list[str], nbytes: int) -> None:
        self.dirs.update((self.out / rel).parent for rel in files)
        self.pending += nbytes

    def maybe(self) -> None:
        if self.pending >= SAVE_BYTES:
            self.save()

    def save(self) -> None:
        self.writer.wait()
        for d in sorted(self.dirs):
            fsync_dir(d)
        self.dirs.clear()
        bad = self.result.bad
        self.manifest.bad += [str(b) for b in bad[self._bad :]]
        self._bad = len(bad)
        save_manifest(self.out, self.manifest)
        self.pending = 0


_DICTIONARY: Final = ("run_id", "name", "reduce", "kind", "host", "status", "format",
                      "gpu_name", "version")  # fmt: skip
#: columns written without min/max statistics: payloads no reader filters on, where
#: statistics cost more than they serve (replay plans with step, name and reduce's)
_NO_STATISTICS: Final = ("run_id", "idx", "value", "text", "values", "data", "columns", "rows")


def _parquet_writer(data: pa.Table) -> Callable[[str], None]:
    schema = data.schema
    names = set(schema.names)
    encodings = {
        c: e
        for c, e in _ENCODINGS.items()
        if c in names and (e != "BYTE_STREAM_SPLIT" or pa.types.is_floating(schema.field(c).type))
    }
    # dictionary columns (the metrics table's strings) are written as the plain strings
    # of SCHEMAS: no Arrow schema is stored, so every reader reads them back as strings
    encoded = any(pa.types.is_dictionary(f.type) for f in schema)

    def write(path: str) -> None:
        pq.write_table(
            data,
            path,
            compression="zstd",
            row_group_size=_ROW_GROUP,
            use_dictionary=[c for c in _DICTIONARY if c in names],
            column_encoding=encodings,
            write_statistics=[c for c in schema.names if c not in _NO_STATISTICS],
            store_schema=not encoded,
        )

    return write


class _Orphans:
    """Files of the dataset by source segment, listed once per run.

    A file a crashed run wrote but the manifest never listed is an orphan: it is removed
    before its segment is compacted again. Each table's directory is listed once, at the
    start of the run (one listing per segment would cost a run O(segments x files), not
    O(new data)).
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.by_key: dict[str, list[str]] = {}
        for table in TABLES:
            try:
                names = os.listdir(out / table)
            except FileNotFoundError:
                continue
            for name in names:
                parts = name.rsplit("-", 2)  # <key>-<start>-<end>.parquet
                if len(parts) == 3 and name.endswith(".parquet") and not name.startswith("."):
                    self.by_key.setdefault(parts[0], []).append(f"{table}/{name}")

    def remove(self, key: str, entry: SegmentEntry) -> None:
        listed = set(entry.files)
        for rel in self.by_key.pop(key, ()):
            if rel not in listed:
                (self.out / rel).unlink(missing_ok=True)


def compact(
    spool: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    delete: bool = False,
    force: bool = False,
) -> CompactResult:
    """Compact every new complete frame of ``spool`` into the dataset at ``out``.

    ``delete``: then delete sealed segments whose rows read back equal, once every
    shipper the spool knows has shipped them (``force``: whether they did or not).
    """
    layout = SpoolLayout(spool)
    outdir = Path(out)
    try:
        outdir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create dataset directory {outdir}: {exc}") from exc
    run = require_run(spool)
    manifest = load_manifest(outdir)
    if manifest.run_id and manifest.run_id != run.run_id:
        raise RunMismatchError(f"{outdir} holds run {manifest.run_id}, not {run.run_id}")
    manifest.run_id, manifest.name = run.run_id, run.name
    manifest.world_size, manifest.created = run.world_size, run.created
    result = CompactResult()
    saver = _Saver(outdir, manifest, result)
    orphans = _Orphans(outdir)
    try:
        for rank in layout.ranks():
            segs = layout.segments(rank)
            for i, seg in enumerate(segs):
                later = i + 1 < len(segs)
                key = seg.id.stem
                entry = manifest.segments.setdefault(key, SegmentEntry())
                if entry.done:
                    continue
                orphans.remove(key, entry)
                _compact_segment(run.run_id, seg, later, outdir, key, entry, result, saver)
                saver.maybe()
        saver.save()
    finally:
        saver.writer.close()
    if delete:
        _delete_verified(layout, run.run_id, outdir, manifest, result, force=force)
        save_manifest(outdir, manifest)
    return result


def _compact_segment(
    run_id: str,
    seg: SegmentName,
    later: bool,
    outdir: Path,
    key: str,
    entry: SegmentEntry,
    result: CompactResult,
    saver: _Saver,
) -> None:
    manifest = saver.manifest
    reader = SegmentReader(seg.path, decode=False, packed=True)  # (packed values: bytes)
    if entry.names is not None:
        reader.resume_from(entry.names, max(entry.offset, HEADER_SIZE))
    upto = manifest.relogged_upto(seg.rank, seg.incarnation)
    mark = manifest.mark(seg.id)
    while True:
        res = reader.read(entry.offset, writer_gone=later, max_bytes=CHUNK_BYTES)
        header = reader.header
        foreign = header is not None and (header.run_id, header.rank, header.incarnation) != (
            run_id, seg.rank, seg.incarnation,
        )  # fmt: skip
        tables: dict[str, pa.Table] = {}
        if res.frames and not foreign:
            layouts = reader.layouts.copy()  # as they were before these frames (for a retry)
            decoded, undecodable = _decode(str(seg.path), res.frames, reader.layouts, raw=True)
            built = raw_segment_tables(run_id, seg, decoded, upto, mark=mark, dictionary=True)
            if built is None:  # a values map Metrics refuses: the events as the reader has them
                decoded, undecodable = _decode(str(seg.path), res.frames, layouts,
                                               raw=False)  # fmt: skip
                built = raw_segment_tables(run_id, seg, decoded, upto, mark=mark, dictionary=True)
            assert built is not None  # decoded Metrics: no map to refuse
            tables = built
            res.bad = sorted(res.bad + undecodable, key=lambda b: b.offset)  # in file order
        for b in res.bad:
            if b.offset >= entry.offset:
                log.warning("corrupt spool bytes skipped: %s", b)
                result.bad.append(b)
        if foreign:
            assert header is not None
            why = f"{seg.path}: segment of run {header.run_id} rank {header.rank}, skipped"
            log.warning(why)
            result.bad.append(BadRange(str(seg.path), 0, res.size, why))
            entry.offset, entry.done = res.size, True
            return
        if res.frames:
            start = res.frames[0].offset
            files = saver.writer.submit(outdir, key, start, res.end, tables)
            saver.wrote(files, res.end - entry.offset)
            entry.files += files
            for table, data in tables.items():
                entry.rows[table] = entry.rows.get(table, 0) + data.num_rows
                result.rows[table] = result.rows.get(table, 0) + data.num_rows
            result.files += len(files)
            result.values += tables["metrics"].num_rows if "metrics" in tables else 0
        entry.offset = max(entry.offset, res.end)
        entry.names = reader.names_before(entry.offset)
        entry.sealed = entry.sealed or res.sealed
        if res.frames:
            entry.next_seq = res.frames[-1].seq + 1
        if res.seal_seq is not None:
            entry.next_seq = res.seal_seq + 1
        if not res.more:
            entry.done = res.sealed or (later and res.pending == 0)
            return


@dataclass(slots=True)
class _Decoded:
    """A frame's events, as :func:`segment_tables` reads them."""

    seq: int
    events: Sequence[Event | MetricsRaw]


def _decode(
    path: str, frames: list[Frame], layouts: Layouts, *, raw: bool
) -> tuple[list[_Decoded | NamesRow], list[BadRange]]:
    """The events of ``frames`` (read undecoded; ``layouts``: their segment's), and the frames
    some of whose events do not decode, as the reader reports them. ``raw``: Metrics values
    left undecoded."""
    stats = DecodeStats()
    decode = decode_events_raw if raw else decode_events
    out: list[_Decoded | NamesRow] = []
    bad: list[BadRange] = []
    for frame in frames:
        assert frame.payload is not None  # read with decode=False
        before = stats.invalid_events
        if frame.names_ts is not None:  # a row says the frame was there (replay counts frames)
            out.append(names_row(frame))
            continue
        lost = stats.unresolved
        events = decode(frame.payload, frame.schema, stats, layouts)
        if stats.unresolved != lost:  # as the reader does: the frame is skipped whole
            bad.append(BadRange(path, frame.offset, frame.end - frame.offset, UNRESOLVED))
            continue
        out.append(_Decoded(frame.seq, events))
        if stats.invalid_events != before:
            bad.append(BadRange(path, frame.offset, frame.end - frame.offset, UNDECODABLE))
    return out, bad


def _delete_verified(
    layout: SpoolLayout,
    run_id: str,
    outdir: Path,
    manifest: Manifest,
    result: CompactResult,
    *,
    force: bool = False,
) -> None:
    """Delete sealed segments whose rows read back equal to a fresh read of the segment.

    A segment a shipper has not finished with is kept (deleting it would take data from
    under a shipper that will ship it later): every shipper the spool knows counts, those
    with a cursor that does not mark it done and those holding a lease that have not yet
    written a cursor. ``force`` deletes anyway. The segments are listed in the spool's
    ``deleted.json`` (with the dataset) before they go, so that a shipper started later
    says where their rows are instead of shipping nothing.
    """
    unfinished, who = (set(), "") if force else _unfinished_by_shippers(layout)
    doomed: list[tuple[SegmentName, SegmentEntry]] = []
    steps: dict[SegmentId, list[tuple[int, int]]] = {}
    for rank in layout.ranks():
        for seg in layout.segments(rank):
            key = seg.id.stem
            entry = manifest.segments.get(key)
            why = _why_keep(entry, key, unfinished, who)
            if why is None:
                assert entry is not None
                why, steps[seg.id] = _verify(run_id, seg, outdir, entry)
            if why is not None:
                result.kept.append(f"{seg.path}: {why}")
                continue
            assert entry is not None
            entry.verified = True
            doomed.append((seg, entry))
    record_deleted(layout.root, outdir, [(seg.id, steps[seg.id]) for seg, _ in doomed])
    for seg, entry in doomed:
        seg.path.unlink()
        fsync_dir(seg.path.parent)
        entry.deleted = True
        result.deleted.append(str(seg.path))


def _why_keep(
    entry: SegmentEntry | None, key: str, unfinished: set[SegmentId], who: str
) -> str | None:
    if entry is None or not entry.done:
        return "not fully compacted yet"
    if not entry.sealed:
        return "not sealed (its writer may be alive, or it died without a seal)"
    if SegmentId.parse(key) in unfinished:
        return f"{who} has not shipped all of it yet (--force deletes it anyway)"
    return None


def _unfinished_by_shippers(layout: SpoolLayout) -> tuple[set[SegmentId], str]:
    """Segments some shipper has not finished with, and which shipper (for the message).

    A cursor that does not mark a segment done, and a lease whose shipper has not yet
    written a cursor (it has finished with nothing), keep it; an unreadable cursor keeps
    every segment too.
    """
    from ranklog.shippers import load_cursor  # the shipper engine: only --delete needs it
    from ranklog.shippers._lease import read_leases

    out: set[SegmentId] = set()
    segments = [seg.id for seg in layout.all_segments()]
    d = layout.cursors_dir
    names = {p.stem for p in d.glob("*.json")} if d.is_dir() else set()
    leases = {lease.key: lease for lease in read_leases(layout.root)}
    who: list[str] = []
    for name in sorted(names):
        try:
            cursor = load_cursor(layout.root, name)
        except CursorError:
            cursor = None
        left = [s for s in segments if cursor is None or not cursor.done(s)]
        if left:
            out.update(left)
            who.append(f"shipper {name}" + (f" ({cursor.target})" if cursor else ""))
    for name in sorted(set(leases) - names):
        out.update(segments)
        who.append(f"shipper of {leases[name].target} ({leases[name].state()}, no cursor yet)")
    return out, " and ".join(who[:2]) + (f" and {len(who) - 2} more" if len(who) > 2 else "")


def _verify(
    run_id: str, seg: SegmentName, outdir: Path, entry: SegmentEntry
) -> tuple[str | None, list[tuple[int, int]]]:
    """(None when the Parquet rows of ``seg`` equal a fresh read of it, else why not; the
    steps its values are for, as inclusive ranges)."""
    res = SegmentReader(seg.path).read(0, writer_gone=True)
    upto = load_manifest(outdir).relogged_upto(seg.rank, seg.incarnation)
    expected = segment_tables(run_id, seg, res.frames, upto)
    for table in TABLES:
        files = sorted(f for f in entry.files if f.startswith(f"{table}/"))
        want = expected.get(table)
        if not files:
            if want is not None and want.num_rows:
                return f"{table}: no Parquet file for {want.num_rows} rows", []
            continue
        got = pa.concat_tables([pq.read_table(outdir / f) for f in files]).cast(SCHEMAS[table])
        if want is None or not _same(got, want):
            return f"{table}: the Parquet rows differ from the segment", []
    return None, _step_ranges(expected)


def _step_ranges(tables: dict[str, pa.Table]) -> list[tuple[int, int]]:
    """The steps rows of ``tables`` hold values for (a step_end alone, or a GPU sample
    without a step, is no value of a step), as inclusive ranges."""
    cols = [t["step"] for name, t in tables.items() if name != "ranks" and "step" in t.schema.names]
    if not cols:
        return []
    steps = pc.unique(pa.chunked_array([c.cast(pa.int64()) for c in cols], pa.int64()))
    out: list[tuple[int, int]] = []
    for s in sorted(x for x in steps.to_pylist() if x is not None):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _same(a: pa.Table, b: pa.Table) -> bool:
    """Whether two tables hold the same rows, floats compared bit for bit.

    (``Table.equals`` takes NaN for unequal to itself: a segment with a NaN loss would
    never verify.)
    """
    x, y = _bits(a), _bits(b)
    return len(x) == len(y) and all(p.equals(q) for p, q in zip(x, y, strict=True))


def _bits(table: pa.Table) -> list[pa.Array]:
    """The columns of ``table``, float64 values as their bits (lists: lengths, then values)."""
    out = []
    for column in table.itercolumns():
        arr = column.combine_chunks()
        if pa.types.is_list(arr.type) and pa.types.is_float64(arr.type.value_type):
            out.append(pc.list_value_length(arr))
            arr = arr.flatten()
        out.append(arr.view(pa.int64()) if pa.types.is_float64(arr.type) else arr)
    return out
