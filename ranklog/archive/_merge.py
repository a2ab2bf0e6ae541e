"""Small parts of a layout-2 dataset merged into larger ones, crash-safely.

Each compaction run writes at least one part per table, so a job compacted every hour
gathers a part an hour. When a dataset holds more than :data:`MAX_PARTS` parts, runs of
consecutive parts smaller than :data:`SMALL_BYTES` together are rewritten as one: the
part of the first of them, one generation up (``part-000003.g1.parquet`` holds what parts
3 to 9 held). Their row groups are copied one by one, so every block keeps its own row
groups, and each segment's pieces are renumbered into the merged part.

The merged files are written (tmp, fsync, rename) before the manifest that names them;
the parts they replace are removed after it. A crash in between leaves files the
manifest does not list, which the next run removes (:func:`~ranklog.archive._parts.remove_orphans`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import pyarrow.parquet as pq

from ranklog._fs import fsync_dir, fsync_file
from ranklog.archive._manifest import Manifest, save_manifest
from ranklog.archive._parts import parquet_options, part_file
from ranklog.archive._tables import TABLES
from ranklog.errors import ArchiveError

__all__ = ["MAX_PARTS", "SMALL_BYTES", "merge_parts"]

#: parts a dataset holds before small ones are merged
MAX_PARTS: Final = 8
#: a run of consecutive parts is merged while its files together stay below this
SMALL_BYTES: Final = 256 * 1024 * 1024

Part = tuple[int, int]  # (number, generation)


def _parts(manifest: Manifest) -> list[Part]:
    """The dataset's parts, in write order."""
    return sorted({(p, g) for e in manifest.segments.values()
                   for held in e.pieces.values() for p, g, _, _ in held})  # fmt: skip


def _size(out: Path, part: Part) -> int:
    paths = (out / part_file(table, *part) for table in TABLES)
    return sum(p.stat().st_size for p in paths if p.is_file())


def _runs(out: Path, parts: list[Part], small: int) -> list[list[Part]]:
    """Runs of two or more consecutive parts whose files together stay below ``small``."""
    runs: list[list[Part]] = []
    current: list[Part] = []
    held = 0
    for part in parts:
        size = _size(out, part)
        if current and held + size < small:
            current.append(part)
            held += size
            continue
        if len(current) > 1:
            runs.append(current)
        current, held = ([part], size) if size < small else ([], 0)
    if len(current) > 1:
        runs.append(current)
    return runs


def merge_parts(out: Path, manifest: Manifest) -> tuple[list[str], int]:
    """Merge runs of small parts when ``out`` holds more than :data:`MAX_PARTS`: the files
    removed (relative to ``out``), and how many were written. The manifest is saved once
    the merged files are durable."""
    parts = _parts(manifest)
    if len(parts) <= MAX_PARTS:
        return [], 0
    runs = _runs(out, parts, SMALL_BYTES)
    if not runs:
        return [], 0
    written = 0
    renumber: dict[tuple[str, int, int], tuple[int, int, int]] = {}  # old -> new, per table
    made: set[Path] = set()
    for run in runs:
        first = run[0][0]
        gen = max(g for _, g in run) + 1
        for table in TABLES:
            offsets = _copy(out, table, run, (first, gen))
            for (p, g), offset in offsets.items():
                renumber[(table, p, g)] = (first, gen, offset)
            if offsets:
                made.add((out / part_file(table, first, gen)).parent)
                written += 1
    for d in sorted(made):
        fsync_dir(d)
    gone: set[str] = set()
    for entry in manifest.segments.values():
        for table, held in entry.pieces.items():
            moved = []
            for p, g, a, b in held:
                new = renumber.get((table, p, g))
                if new is None:
                    moved.append([p, g, a, b])
                    continue
                gone.add(part_file(table, p, g))
                piece = [new[0], new[1], a + new[2], b + new[2]]
                if not moved or moved[-1] != piece:
                    moved.append(piece)
            entry.pieces[table] = moved
        names = {part_file(t, p, g) for t, held in entry.pieces.items() for p, g, _, _ in held}
        entry.files = [f for f in entry.files if f not in gone] + sorted(names - set(entry.files))
    save_manifest(out, manifest)
    for rel in sorted(gone):
        (out / rel).unlink(missing_ok=True)
    for d in sorted({(out / rel).parent for rel in gone}):
        fsync_dir(d)
    return sorted(gone), written


def _copy(out: Path, table: str, run: list[Part], into: Part) -> dict[Part, int]:
    """``table``'s files of the parts of ``run`` copied into part ``into``, row group by row
    group; where each part's groups start in it (parts without such a file left out)."""
    sources = [(part, out / part_file(table, *part)) for part in run]
    sources = [(part, path) for part, path in sources if path.is_file()]
    if not sources:
        return {}
    final = out / part_file(table, *into)
    tmp = final.with_name(f".{final.name}.tmp")
    offsets: dict[Part, int] = {}
    writer: pq.ParquetWriter | None = None
    groups = 0
    try:
        for part, path in sources:
            offsets[part] = groups
            with pq.ParquetFile(path) as pf:
                for i in range(pf.metadata.num_row_groups):
                    t = pf.read_row_group(i, use_threads=False)
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), t.schema, **parquet_options(t.schema))
                    writer.write_table(t, row_group_size=max(t.num_rows, 1))
                    groups += 1
        if writer is not None:
            writer.close()
            writer = None
        if pq.read_metadata(tmp).num_row_groups != groups:
            raise ArchiveError(f"{tmp}: the merge wrote other row groups than it read")
        fsync_file(tmp)
        os.replace(tmp, final)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return offsets
