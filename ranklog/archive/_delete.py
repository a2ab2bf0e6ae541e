"""``ranklog compact --delete``: sealed segments deleted once their rows read back equal.

A segment goes only when every shipper the spool knows has shipped it (or ``--force``),
and after its rows in the dataset compared equal, bit for bit, to a fresh read of it;
the spool's ``deleted.json`` names it (and the dataset) before it goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

from ranklog._fs import fsync_dir
from ranklog.archive._block import segment_tables
from ranklog.archive._files import Shared, source_rows
from ranklog.archive._manifest import Manifest, SegmentEntry, load_manifest
from ranklog.archive._parts import pieces_of
from ranklog.archive._tables import SCHEMAS, TABLES
from ranklog.errors import CursorError
from ranklog.spool import SegmentId, SegmentName, SegmentReader, SpoolLayout, record_deleted

__all__ = ["delete_verified"]

#: decoded part groups kept while segments are verified (those of a block, in turn)
_SHARED_BYTES: Final = 96 * 1024 * 1024


def delete_verified(
    layout: SpoolLayout,
    run_id: str,
    outdir: Path,
    manifest: Manifest,
    *,
    force: bool = False,
) -> tuple[list[str], list[str]]:
    """Delete sealed segments whose rows read back equal to a fresh read of the segment.

    A segment a shipper has not finished with is kept (deleting it would take data from
    under a shipper that will ship it later): every shipper the spool knows counts, those
    with a cursor that does not mark it done and those holding a lease that have not yet
    written a cursor. ``force`` deletes anyway. The segments are listed in the spool's
    ``deleted.json`` (with the dataset) before they go, so that a shipper started later
    says where their rows are instead of shipping nothing.
    """
    deleted: list[str] = []
    kept: list[str] = []
    #: the part groups that segments share, decoded once for all of them (layout 2)
    shared = Shared(_SHARED_BYTES)
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
                why, steps[seg.id] = _verify(run_id, seg, outdir, entry, shared)
            if why is not None:
                kept.append(f"{seg.path}: {why}")
                continue
            assert entry is not None
            entry.verified = True
            doomed.append((seg, entry))
    record_deleted(layout.root, outdir, [(seg.id, steps[seg.id]) for seg, _ in doomed])
    for seg, entry in doomed:
        seg.path.unlink()
        fsync_dir(seg.path.parent)
        entry.deleted = True
        deleted.append(str(seg.path))
    return deleted, kept


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
    run_id: str, seg: SegmentName, outdir: Path, entry: SegmentEntry, shared: Shared
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
        got = _rows_of(outdir, table, files, entry, seg.id, shared)
        if want is None or not _same(got, want):
            return f"{table}: the Parquet rows differ from the segment", []
    return None, _step_ranges(expected)


def _rows_of(
    outdir: Path,
    table: str,
    files: list[str],
    entry: SegmentEntry,
    sid: SegmentId,
    shared: Shared,
) -> pa.Table:
    """The segment's rows of ``table`` as the dataset holds them, in write order (none when
    the manifest names no piece of it: the rows then differ, nothing is deleted)."""
    if not entry.pieces.get(table):
        return SCHEMAS[table].empty_table()
    names = list(SCHEMAS[table].names)
    pieces = pieces_of(outdir, sid, entry)[table]
    got = pa.concat_tables([source_rows(piece, table, names, shared) for piece in pieces])
    # rows sorted by step in the parts: back in write order (stable: an event's rows stay)
    return got.sort_by([("seq", "ascending"), ("idx", "ascending")])


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
