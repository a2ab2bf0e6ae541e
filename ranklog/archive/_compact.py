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
import pyarrow.parquet as pq

from ranklog._fs import DIR_MODE, atomic_write, fsync_dir
from ranklog.archive._block import Block
from ranklog.archive._delete import delete_verified
from ranklog.archive._lock import DatasetLock
from ranklog.archive._manifest import (
    Manifest,
    SegmentEntry,
    load_manifest,
    save_manifest,
)
from ranklog.archive._merge import merge_parts
from ranklog.archive._parts import (
    ROW_GROUP,
    Parts,
    check_files,
    parquet_options,
    remove_orphans,
    table_entries,
)
from ranklog.archive._repair import repair as repair_files
from ranklog.archive._steps import ship_steps
from ranklog.archive._tables import NamesRow, names_row
from ranklog.errors import ArchiveError, ConfigError, RunMismatchError
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
    RunInfo,
    SegmentName,
    SegmentReader,
    SpoolLayout,
    require_run,
)

__all__ = ["DEFAULT_LAYOUT", "LAYOUTS", "CompactResult", "compact"]

log = logging.getLogger("ranklog.compact")

#: layout 1: spool bytes read per output file. This bounds memory: decoded, 8 MiB of
#: metric frames take ~130 MB (peak RSS ~210 MB for a 64 MiB segment, ~530 MB with 64 MiB
#: chunks), and a file still holds ~370 K values, large enough to scan fast
CHUNK_BYTES: Final = 8 * 1024 * 1024
#: layout 2: spool bytes of one block (read in chunks of at most this much): a block's
#: tables are built at once and written while the next is gathered, so this bounds memory
#: (~60 MB a block of metrics at 2 MiB); a block holds ~200 K values, ~25 row groups
BLOCK_BYTES: Final = 2 * 1024 * 1024
#: spool bytes compacted between two saves of the manifest (and at the end of a run)
SAVE_BYTES: Final = 64 * 1024 * 1024
#: chunks written at once: the writer encodes a chunk's Parquet in ~1.5x the time the main
#: thread takes to read and build it, so a second thread keeps both cores busy
WRITERS: Final = 2
#: the dataset layouts this release reads and writes
LAYOUTS: Final = (1, 2)
#: the layout of a new dataset
DEFAULT_LAYOUT: Final = 2


@dataclass(slots=True)
class CompactResult:
    """What one ``compact`` run did."""

    files: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    values: int = 0
    bad: list[BadRange] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # --delete refused, with why
    merged: list[str] = field(default_factory=list)  # small parts merged into larger ones
    repaired: list[str] = field(default_factory=list)  # damaged files rewritten (--repair)
    #: the steps table: (steps it holds, the last step shipped into it)
    steps: tuple[int, int] = (0, -1)


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

    def __init__(
        self, out: Path, manifest: Manifest, result: CompactResult, lock: DatasetLock
    ) -> None:
        self.out, self.manifest, self.result, self.lock = out, manifest, result, lock
        self.dirs: set[Path] = set()
        self.pending = 0  # spool bytes compacted since the last save
        self._bad = 0  # damaged ranges of this run already in the manifest
        self.writer = _Writer()
        #: layout 2: the part files being written
        self.parts = Parts(out, manifest, BLOCK_BYTES, ROW_GROUP) if manifest.layout >= 2 else None

    def wrote(self, files: list[str], nbytes: int) -> None:
        self.dirs.update((self.out / rel).parent for rel in files)
        self.pending += nbytes

    def maybe(self) -> None:
        if self.pending >= SAVE_BYTES:
            self.save()

    def save(self) -> None:
        self.writer.wait()
        if self.parts is not None:
            self.result.files += len(self.parts.close_part())
        for d in sorted(self.dirs):
            fsync_dir(d)
        self.dirs.clear()
        bad = self.result.bad
        self.manifest.bad += [str(b) for b in bad[self._bad :]]
        self._bad = len(bad)
        self.lock.check()
        save_manifest(self.out, self.manifest)
        self.pending = 0

    def close(self) -> None:
        """Stop the writing threads (whatever happened)."""
        self.writer.close()
        if self.parts is not None:
            self.parts.close()


def _parquet_writer(data: pa.Table) -> Callable[[str], None]:
    def write(path: str) -> None:
        pq.write_table(data, path, row_group_size=ROW_GROUP, **parquet_options(data.schema))

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
        for table, name in table_entries(out):
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
    dataset_layout: int | None = None,
    repair: bool = False,
    dead_after: float = 120.0,
) -> CompactResult:
    """Compact every new complete frame of ``spool`` into the dataset at ``out``, and ship
    the steps complete so far into its steps table (``dead_after``: seconds of silence
    after which a rank that never ended is no longer waited for, as ``ranklog ship``).

    ``delete``: then delete sealed segments whose rows read back equal, once every
    shipper the spool knows has shipped them (``force``: whether they did or not).
    ``dataset_layout``: the layout of a new dataset (1 or 2; default
    :data:`DEFAULT_LAYOUT`); an existing dataset keeps its own. ``repair``: first rewrite
    the dataset's damaged files from the spool (:mod:`ranklog.archive._repair`). One run
    at a time per dataset (:class:`~ranklog.archive._lock.DatasetLock`).
    """
    layout = SpoolLayout(spool)
    outdir = Path(out)
    try:
        outdir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create dataset directory {outdir}: {exc}") from exc
    run = require_run(spool)
    with DatasetLock(outdir) as lock:
        return _compact_locked(layout, run, outdir, lock, delete, force, dataset_layout, repair,
                               dead_after)  # fmt: skip


def _compact_locked(
    layout: SpoolLayout,
    run: RunInfo,
    outdir: Path,
    lock: DatasetLock,
    delete: bool,
    force: bool,
    dataset_layout: int | None,
    repair: bool,
    dead_after: float,
) -> CompactResult:
    """:func:`compact`, holding the dataset's lock."""
    manifest = load_manifest(outdir)
    if manifest.run_id and manifest.run_id != run.run_id:
        raise RunMismatchError(f"{outdir} holds run {manifest.run_id}, not {run.run_id}")
    if not manifest.run_id:  # a new dataset
        manifest.layout = DEFAULT_LAYOUT if dataset_layout is None else dataset_layout
    elif dataset_layout is not None and dataset_layout != manifest.layout:
        raise ConfigError(
            f"{outdir} is a dataset of layout {manifest.layout}: compact into it without "
            f"--layout, or into a new directory with --layout {dataset_layout}"
        )
    if manifest.layout not in LAYOUTS:
        raise ArchiveError(f"{outdir}: dataset layout {manifest.layout} is newer than this "
                           "ranklog (upgrade it)")  # fmt: skip
    manifest.run_id, manifest.name = run.run_id, run.name
    manifest.world_size, manifest.created = run.world_size, run.created
    result = CompactResult()
    saver = _Saver(outdir, manifest, result, lock)
    orphans = _Orphans(outdir) if manifest.layout == 1 else None
    if orphans is None:
        remove_orphans(outdir, manifest)
    if repair:
        result.repaired = repair_files(layout, run.run_id, outdir, manifest)
    check_files(outdir, manifest, layout.root)
    # the steps table is shipped from the spool meanwhile (the engine, on a thread of its
    # own: the raw tables' encoding, compression and fsync run without the GIL)
    steps = ThreadPoolExecutor(1, thread_name_prefix="ranklog-steps")
    shipped = steps.submit(ship_steps, layout.root, outdir, dead_after=dead_after)
    try:
        _compact_raw(layout, run, outdir, lock, manifest, result, saver, orphans)
        lock.check()
        # the steps table, before --delete (which waits for every shipper, this one too)
        result.steps = shipped.result()
    finally:
        steps.shutdown(wait=True)  # the dataset stays locked until it is done, whatever
    if delete:
        lock.check()
        deleted, kept = delete_verified(layout, run.run_id, outdir, manifest, force=force)
        result.deleted += deleted
        result.kept += kept
        save_manifest(outdir, manifest)
    return result


def _compact_raw(
    layout: SpoolLayout,
    run: RunInfo,
    outdir: Path,
    lock: DatasetLock,
    manifest: Manifest,
    result: CompactResult,
    saver: _Saver,
    orphans: _Orphans | None,
) -> None:
    """The raw tables: every new complete frame of every segment, then the merge of parts."""
    try:
        for rank in layout.ranks():
            segs = layout.segments(rank)
            for i, seg in enumerate(segs):
                later = i + 1 < len(segs)
                key = seg.id.stem
                entry = manifest.segments.setdefault(key, SegmentEntry())
                if entry.done:
                    continue
                if orphans is not None:
                    orphans.remove(key, entry)
                _compact_segment(run.run_id, seg, later, outdir, key, entry, result, saver)
                saver.maybe()
        saver.save()
    finally:
        saver.close()
    if manifest.layout >= 2:
        lock.check()
        result.merged, written = merge_parts(outdir, manifest)
        result.files += written


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
        chunk = CHUNK_BYTES if saver.parts is None else min(CHUNK_BYTES, BLOCK_BYTES)
        res = reader.read(entry.offset, writer_gone=later, max_bytes=chunk)
        header = reader.header
        foreign = header is not None and (header.run_id, header.rank, header.incarnation) != (
            run_id, seg.rank, seg.incarnation,
        )  # fmt: skip
        tables: dict[str, pa.Table] = {}
        added: dict[str, int] = {}
        if res.frames and not foreign:
            layouts = reader.layouts.copy()  # as they were before these frames (for a retry)
            decoded, undecodable = _decode(str(seg.path), res.frames, reader.layouts, raw=True)
            block = saver.parts.block if saver.parts is not None else Block(run_id)
            got = block.add(seg, decoded, upto, mark)
            if got is None:  # a values map Metrics refuses: the events as the reader has them
                decoded, undecodable = _decode(str(seg.path), res.frames, layouts,
                                               raw=False)  # fmt: skip
                got = block.add(seg, decoded, upto, mark)
            assert got is not None  # decoded Metrics: no map to refuse
            added = got
            if saver.parts is None:
                tables = block.tables(dictionary=True)
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
            if saver.parts is not None:
                saver.parts.added(entry, added, res.end - entry.offset)
                saver.pending += res.end - entry.offset
            else:
                files = saver.writer.submit(outdir, key, start, res.end, tables)
                saver.wrote(files, res.end - entry.offset)
                entry.files += files
                result.files += len(files)
            for table, n in added.items():
                entry.rows[table] = entry.rows.get(table, 0) + n
                result.rows[table] = result.rows.get(table, 0) + n
            result.values += added.get("metrics", 0)
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
        saver.maybe()  # (a large segment: its part closed, the manifest saved, mid-way)


@dataclass(slots=True)
class _Decoded:
    """A frame's events, as :class:`~ranklog.archive._block.Block` reads them."""

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
