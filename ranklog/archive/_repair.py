"""``ranklog compact SPOOL --out DIR --repair``: damaged files rewritten from the spool.

A file the manifest lists can be damaged after compaction wrote it (cut by a full
disk, overwritten by hand, a bad copy): readers then refuse the dataset, naming the file
(:func:`~ranklog.archive._parts.check_files`). Repair rewrites what the file held for
each segment from the segment itself, while the spool still has it:

- layout 2: a part holds pieces of many segments. For each segment with a piece in the
  damaged file, its rows of that table are rebuilt from the segment's frames the
  manifest marks compacted, less the rows its other (sound) pieces hold (a frame's rows
  are in one piece: kept pieces are told apart by ``seq``). Each run of adjacent damaged
  pieces (a merged part holds several pieces of one segment side by side) becomes one
  block of a new part, in its place in the segment's write order: each row once.

A dataset of layout 1 (an older release's) is read, no longer written: compaction, and so
repair, refuses it before this runs.

The new files are written (tmp, fsync, rename) before the manifest names them; the
damaged ones are then moved to ``DIR/.damaged/`` (kept, never deleted; a missing one, or
one a repair killed midway moved already, is rewritten the same way). When a segment
with rows in a damaged file is gone from the spool (``compact --delete``), nothing is
changed: :class:`ArchiveError` names the file and the segments whose rows it alone held.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog._fs import DIR_MODE, fsync_dir, fsync_file
from ranklog.archive._block import segment_tables
from ranklog.archive._files import Piece, source_rows
from ranklog.archive._manifest import Manifest, SegmentEntry, save_manifest
from ranklog.archive._parts import ROW_GROUP, damaged_files, parquet_options, part_file
from ranklog.archive._tables import STEP_TABLES
from ranklog.errors import ArchiveError
from ranklog.spool import SegmentId, SegmentName, SegmentReader, SpoolLayout

__all__ = ["repair"]


def repair(layout: SpoolLayout, run_id: str, out: Path, manifest: Manifest) -> list[str]:
    """Rewrite the damaged files of the dataset at ``out`` from ``layout``'s segments; the
    files repaired (relative to ``out``). Nothing is changed when one cannot be."""
    damaged = {rel: why for rel, why in damaged_files(out, manifest)}
    if not damaged:
        return []
    affected = [(SegmentId.parse(key), entry) for key, entry in sorted(manifest.segments.items())
                if any(f in damaged for f in entry.files)]  # fmt: skip
    gone = [sid for sid, _ in affected if not layout.segment_path(*sid).is_file()]
    if gone:
        first = next(iter(damaged))
        raise ArchiveError(
            f"{out / first}: {damaged[first]}; it holds rows of {len(gone)} segment(s) no "
            f"longer in the spool ({gone[0].key}, ...), which cannot be rewritten: restore "
            "the file from a copy (nothing was changed)"
        )
    writer = _NewPart(out, manifest.parts)
    for sid, entry in affected:
        seg = SegmentName(sid.rank, sid.incarnation, sid.segment, layout.segment_path(*sid))
        frames = SegmentReader(seg.path).read(0, writer_gone=True).frames
        upto = manifest.relogged_upto(sid.rank, sid.incarnation)
        for table, held in list(entry.pieces.items()):
            if not any(part_file(table, p, g) in damaged for p, g, _, _ in held):
                continue
            done = [f for f in frames if f.end <= entry.offset]
            want = segment_tables(run_id, seg, done, upto, dictionary=True).get(table)
            entry.pieces[table] = _rebuilt(out, sid, table, held, want, damaged, writer)
        if entry.pieces:  # the damaged parts out, the new part in
            entry.files = [f for f in entry.files if f not in damaged]
            entry.files += [f for f in writer.files if f not in entry.files and _holds(entry, f)]
    new = writer.close()
    if new:
        manifest.parts += 1
    aside = out / ".damaged"
    for rel in damaged:
        if not (out / rel).exists():  # missing (or moved aside by a repair killed after)
            continue
        (aside / rel).parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.replace(out / rel, aside / rel)  # (kept: a file is never deleted by a repair)
    for d in sorted({(out / f).parent for f in [*new, *damaged]}):
        fsync_dir(d)
    save_manifest(out, manifest)
    return sorted(damaged)


def _holds(entry: SegmentEntry, rel: str) -> bool:
    """Whether ``entry``'s pieces name the part file ``rel``."""
    return any(part_file(t, p, g) == rel for t, held in entry.pieces.items() for p, g, _, _ in held)


def _rebuilt(
    out: Path,
    sid: SegmentId,
    table: str,
    held: list[list[int]],
    want: pa.Table | None,
    damaged: dict[str, str],
    writer: _NewPart,
) -> list[list[int]]:
    """``held`` with each run of adjacent damaged pieces replaced by one block of the new
    part holding the rows they held: the rows of ``want`` (the segment's rows of
    ``table``) between the ``seq`` of the sound pieces before the run and after it."""
    spans: list[tuple[int, int] | None] = []  # per piece: its (first, last) seq; None: damaged
    for p, g, a, b in held:
        if part_file(table, p, g) in damaged:
            spans.append(None)
            continue
        piece = Piece(out / part_file(table, p, g), a, b, sid, p)
        seqs = source_rows(piece, table, ["seq"])["seq"]
        spans.append((pc.min(seqs).as_py(), pc.max(seqs).as_py()) if len(seqs) else None)
    result: list[list[int]] = []
    seq = want["seq"] if want is not None else None
    i = 0
    while i < len(held):
        p, g, a, b = held[i]
        if part_file(table, p, g) not in damaged:
            result.append([p, g, a, b])
            i += 1
            continue
        end = i  # the run of adjacent damaged pieces: [i, end]
        while end + 1 < len(held) and part_file(table, *held[end + 1][:2]) in damaged:
            end += 1
        if want is None or seq is None:
            raise ArchiveError(f"{out / part_file(table, p, g)}: segment {sid.key} holds no "
                               f"{table} rows for it any more")  # fmt: skip
        lo = max((s[1] for s in spans[:i] if s is not None), default=-1)
        hi = min((s[0] for s in spans[end + 1 :] if s is not None), default=2**62)
        rows = want.filter(pc.and_(pc.greater(seq, lo), pc.less(seq, hi)))
        if table in STEP_TABLES:
            rows = rows.take(pc.sort_indices(rows, [("step", "ascending")]))
        result.append(writer.add(table, rows))
        i = end + 1
    return result


class _NewPart:
    """The part a repair writes: one block per damaged piece, each its own row groups."""

    def __init__(self, out: Path, number: int) -> None:
        self.out, self.number = out, number
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.groups: dict[str, int] = {}

    @property
    def files(self) -> list[str]:
        return [part_file(table, self.number) for table in self.writers]

    def _tmp(self, table: str) -> Path:
        final = self.out / part_file(table, self.number)
        return final.with_name(f".{final.name}.tmp")

    def add(self, table: str, rows: pa.Table) -> list[int]:
        """Write ``rows`` as a block; its piece ``[part, 0, first group, end group]``."""
        writer = self.writers.get(table)
        if writer is None:
            self._tmp(table).parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            writer = pq.ParquetWriter(str(self._tmp(table)), rows.schema,
                                      **parquet_options(rows.schema))  # fmt: skip
            self.writers[table] = writer
        first = self.groups.get(table, 0)
        if rows.num_rows:
            writer.write_table(rows, row_group_size=ROW_GROUP)
        end = self.groups[table] = first + -(-rows.num_rows // ROW_GROUP)
        return [self.number, 0, first, end]

    def close(self) -> list[str]:
        """Finish every file (fsync'd, renamed); their names, relative to the dataset."""
        files = []
        for table, writer in self.writers.items():
            writer.close()
            tmp = self._tmp(table)
            if pq.read_metadata(tmp).num_row_groups != self.groups[table]:
                raise ArchiveError(f"{tmp}: the repair wrote other row groups than it counted")
            fsync_file(tmp)
            rel = part_file(table, self.number)
            os.replace(tmp, self.out / rel)
            files.append(rel)
        return files


def _write(path: Path, data: pa.Table) -> None:
    """A layout-1 file written again (tmp, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(data, str(tmp), row_group_size=ROW_GROUP, **parquet_options(data.schema))
    fsync_file(tmp)
    os.replace(tmp, path)
