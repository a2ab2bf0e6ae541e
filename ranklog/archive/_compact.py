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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ranklog._fs import DIR_MODE
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
    remove_orphans,
)
from ranklog.archive._repair import repair as repair_files
from ranklog.archive._steps import mark_steps, ship_steps
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

#: spool bytes of one block (read in chunks of at most this much): a block's
#: tables are built at once and written while the next is gathered, so this bounds memory
#: (~60 MB a block of metrics at 2 MiB); a block holds ~200 K values, ~25 row groups
BLOCK_BYTES: Final = 2 * 1024 * 1024
#: spool bytes compacted between two saves of the manifest (and at the end of a run)
SAVE_BYTES: Final = 64 * 1024 * 1024
#: the dataset layouts this release reads (1: a file per segment and frame range, an older
#: release's, read but no longer written)
LAYOUTS: Final = (1, 2)
#: the layout this release writes
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
    #: why the steps table was left as it is ("" when it was shipped)
    steps_left: str = ""


class _Saver:
    """Saves the manifest every :data:`SAVE_BYTES` of spool compacted, and at the end.

    Before each save, the part being written is closed (written, fsync'd with its
    directory): the files a manifest lists are durable. A crash between saves leaves parts
    no manifest lists; the next run removes them and compacts those frames again.
    """

    def __init__(
        self, out: Path, manifest: Manifest, result: CompactResult, lock: DatasetLock
    ) -> None:
        self.out, self.manifest, self.result, self.lock = out, manifest, result, lock
        self.pending = 0  # spool bytes compacted since the last save
        self._bad = 0  # damaged ranges of this run already in the manifest
        self.parts = Parts(out, manifest, BLOCK_BYTES, ROW_GROUP)

    def maybe(self) -> None:
        if self.pending >= SAVE_BYTES:
            self.save()

    def save(self) -> None:
        self.result.files += len(self.parts.close_part())
        bad = self.result.bad
        self.manifest.bad += [str(b) for b in bad[self._bad :]]
        self._bad = len(bad)
        self.lock.check()
        save_manifest(self.out, self.manifest)
        self.pending = 0

    def close(self) -> None:
        """Stop the writing threads (whatever happened)."""
        self.parts.close()


def compact(
    spool: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    delete: bool = False,
    force: bool = False,
    repair: bool = False,
    dead_after: float = 120.0,
) -> CompactResult:
    """Compact every new complete frame of ``spool`` into the dataset at ``out``, and ship
    the steps complete so far into its steps table (``dead_after``: seconds of silence
    after which a rank that never ended is no longer waited for, as ``ranklog ship``).

    ``delete``: then delete sealed segments whose rows read back equal, once every
    shipper the spool knows has shipped them (``force``: whether they did or not).
    A dataset of layout 1 (an older release's) is refused: it is read, no longer written
    (compact into a new directory). ``repair``: first rewrite
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
        return _compact_locked(layout, run, outdir, lock, delete, force, repair, dead_after)


def _compact_locked(
    layout: SpoolLayout,
    run: RunInfo,
    outdir: Path,
    lock: DatasetLock,
    delete: bool,
    force: bool,
    repair: bool,
    dead_after: float,
) -> CompactResult:
    """:func:`compact`, holding the dataset's lock."""
    manifest = load_manifest(outdir)
    if manifest.run_id and manifest.run_id != run.run_id:
        raise RunMismatchError(f"{outdir} holds run {manifest.run_id}, not {run.run_id}")
    if not manifest.run_id:  # a new dataset
        manifest.layout = DEFAULT_LAYOUT
    elif manifest.layout == 1:
        raise ConfigError(
            f"{outdir} is a dataset of layout 1 (an older ranklog's): this release reads it "
            "(replay, analysis, report) but no longer adds to it: compact into a new "
            "directory (`ranklog compact --steps` adds its steps table)"
        )
    if manifest.layout not in LAYOUTS:
        raise ArchiveError(f"{outdir}: dataset layout {manifest.layout} is newer than this "
                           "ranklog (upgrade it)")  # fmt: skip
    manifest.run_id, manifest.name = run.run_id, run.name
    manifest.world_size, manifest.created = run.world_size, run.created
    result = CompactResult()
    saver = _Saver(outdir, manifest, result, lock)
    remove_orphans(outdir, manifest)
    if repair:
        result.repaired = repair_files(layout, run.run_id, outdir, manifest)
    check_files(outdir, manifest, layout.root)
    # the steps table is shipped from the spool meanwhile (the engine, on a thread of its
    # own: the raw tables' encoding, compression and fsync run without the GIL)
    pool = ThreadPoolExecutor(1, thread_name_prefix="ranklog-steps")
    # a table `compact --steps` wrote from the raw rows is left as it is (it treated every
    # rank as ended): the rows compacted since are not covered, replay reads them
    from_rows = manifest.steps is not None and manifest.steps.source == "rows"
    shipped = pool.submit(lambda: None if from_rows else ship_steps(
        layout.root, outdir, dead_after=dead_after))  # fmt: skip
    try:
        _compact_raw(layout, run, outdir, lock, manifest, result, saver)
        lock.check()
        # the steps table, before --delete (which waits for every shipper, this one too)
        steps = shipped.result()
        if from_rows:
            result.steps_left = (f"{outdir / 'steps'} was written from the raw rows by "
                                 f"`ranklog compact --steps {outdir}`: run it again to "
                                 "cover the rows compacted since (replay reads them "
                                 "meanwhile)")  # fmt: skip
        elif steps is None:
            result.steps_left = (f"{layout.root} is read-only (a shipper keeps its cursor "
                                 "there): replay reads the raw rows; `ranklog compact "
                                 f"--steps {outdir}` writes the steps table from them")  # fmt: skip
        else:
            result.steps = steps
            mark_steps(layout.root, outdir, manifest)  # how far the table covers the rows
            save_manifest(outdir, manifest)
    finally:
        pool.shutdown(wait=True)  # the dataset stays locked until it is done, whatever
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
                _compact_segment(run.run_id, seg, later, entry, result, saver)
                saver.maybe()
        saver.save()
    finally:
        saver.close()
    lock.check()
    result.merged, written = merge_parts(outdir, manifest)
    result.files += written


def _compact_segment(
    run_id: str,
    seg: SegmentName,
    later: bool,
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
        res = reader.read(entry.offset, writer_gone=later, max_bytes=BLOCK_BYTES)
        header = reader.header
        foreign = header is not None and (header.run_id, header.rank, header.incarnation) != (
            run_id, seg.rank, seg.incarnation,
        )  # fmt: skip
        added: dict[str, int] = {}
        if res.frames and not foreign:
            layouts = reader.layouts.copy()  # as they were before these frames (for a retry)
            decoded, undecodable = _decode(str(seg.path), res.frames, reader.layouts, raw=True)
            block = saver.parts.block
            got = block.add(seg, decoded, upto, mark)
            if got is None:  # a values map Metrics refuses: the events as the reader has them
                decoded, undecodable = _decode(str(seg.path), res.frames, layouts,
                                               raw=False)  # fmt: skip
                got = block.add(seg, decoded, upto, mark)
            assert got is not None  # decoded Metrics: no map to refuse
            added = got
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
            saver.parts.added(entry, added, res.end - entry.offset)
            saver.pending += res.end - entry.offset
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
