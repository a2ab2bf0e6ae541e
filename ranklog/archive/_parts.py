"""Dataset layout 2: the rows of many segments in a few files per table, sorted by step.

A compaction run writes *parts*: ``<table>/part-<n:06d>.parquet``, one file per table
for every :data:`~ranklog.archive._compact.SAVE_BYTES` of spool compacted (and one at
the end of the run). A part is a sequence of *blocks*: the rows of the chunks read since
the block before (one chunk of a large segment, or the whole of many small ones, about
:data:`~ranklog.archive._compact.BLOCK_BYTES` of spool). Within a block, rows of the
step tables are sorted by step; rows of one step keep the order ranks wrote them in
(rank, incarnation, segment, seq, idx), so an event's values stay together and in the
order they were logged. The other tables (params, ranks, GPU samples) keep that write
order. A block is written as row groups of its own (none holds two blocks' rows), so
the manifest can name, per segment and table, the row groups that hold its rows: its
*pieces*, ``[part, generation, first group, end group]``.

Parts are written on a thread of their own (Parquet encoding, compression and fsync
release the GIL) while the next chunk is read: to a temporary name, fsync'd and renamed
when the part closes, before the manifest that lists them is saved. A crash leaves files
the manifest does not list; the next run removes them before writing parts again.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from ranklog._fs import DIR_MODE, fsync_dir, fsync_file
from ranklog.archive._block import Block
from ranklog.archive._files import Piece
from ranklog.archive._manifest import Manifest, SegmentEntry
from ranklog.archive._tables import TABLES
from ranklog.errors import ArchiveError
from ranklog.spool import SegmentId

__all__ = [
    "PART",
    "ROW_GROUP",
    "Parts",
    "check_files",
    "damaged_files",
    "parquet_options",
    "part_file",
    "pieces_of",
    "remove_orphans",
    "table_entries",
]

#: rows per row group: replay reads by row group, so this bounds what it decodes at once
ROW_GROUP: Final = 8_192
#: tables' writes queued at most (a block is one per table: one block waits to be written
#: while the next is gathered)
_IN_FLIGHT: Final = 9
#: the name of a part's file in its table's directory
PART: Final = re.compile(r"part-(\d{6,})(\.g\d+)?\.parquet")

_ENCODINGS: Final = {
    "seq": "DELTA_BINARY_PACKED",
    "idx": "DELTA_BINARY_PACKED",
    "ts": "DELTA_BINARY_PACKED",
    "step": "DELTA_BINARY_PACKED",
    "value": "BYTE_STREAM_SPLIT",
}
_DICTIONARY: Final = ("run_id", "name", "reduce", "kind", "host", "status", "format",
                      "gpu_name", "version")  # fmt: skip
#: columns written without min/max statistics: payloads no reader filters on, where
#: statistics cost more than they serve (replay plans with step, name and reduce's)
_NO_STATISTICS: Final = ("run_id", "idx", "value", "text", "values", "data", "columns", "rows")


def part_file(table: str, part: int, gen: int = 0) -> str:
    """A part's file of ``table``, relative to the dataset (``gen``: how many merges made
    it; a merge of parts ``a..b`` is part ``a`` of a higher generation)."""
    return f"{table}/part-{part:06d}{f'.g{gen}' if gen else ''}.parquet"


def pieces_of(dataset: Path, sid: SegmentId, entry: SegmentEntry) -> dict[str, list[Piece]]:
    """Where the manifest says ``entry``'s segment has rows, per table, in write order."""
    return {
        table: [Piece(_part_path(dataset, table, p, g), a, b, sid, p) for p, g, a, b in held]
        for table, held in entry.pieces.items()
        if held
    }


@functools.lru_cache(maxsize=4096)
def _part_path(dataset: Path, table: str, part: int, gen: int) -> Path:
    """A part's path, one object for every segment it holds (the readers' maps of files
    then find it by identity, not by comparing paths)."""
    return dataset / part_file(table, part, gen)


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How compaction writes a table of ``schema`` (both layouts): zstd, dictionaries for
    strings, delta and byte-stream-split encodings, statistics where readers filter."""
    names = set(schema.names)
    encodings = {
        c: e
        for c, e in _ENCODINGS.items()
        if c in names and (e != "BYTE_STREAM_SPLIT" or pa.types.is_floating(schema.field(c).type))
    }
    # dictionary columns (the metrics table's strings) are written as the plain strings
    # of SCHEMAS: no Arrow schema is stored, so every reader reads them back as strings
    encoded = any(pa.types.is_dictionary(f.type) for f in schema)
    return {
        "compression": "zstd",
        "use_dictionary": [c for c in _DICTIONARY if c in names],
        "column_encoding": encodings,
        "write_statistics": [c for c in schema.names if c not in _NO_STATISTICS],
        "store_schema": not encoded,
    }


class _Part:
    """One part being written: a Parquet writer per table, on the writer thread only."""

    def __init__(self, out: Path, number: int, row_group: int) -> None:
        self.out, self.number, self.row_group = out, number, row_group
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.groups: dict[str, int] = {}  # row groups written so far, per table

    def tmp(self, table: str) -> Path:
        final = self.out / part_file(table, self.number)
        return final.with_name(f".{final.name}.tmp")

    def write(self, table: str, data: pa.Table) -> None:
        writer = self.writers.get(table)
        if writer is None:
            path = self.tmp(table)
            path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            writer = pq.ParquetWriter(str(path), data.schema, **parquet_options(data.schema))
            self.writers[table] = writer
        writer.write_table(data, row_group_size=self.row_group)

    def abandon(self) -> None:
        """Close what is open (a failed run: the files stay unlisted, removed next run)."""
        for writer in self.writers.values():
            writer.close()
        self.writers = {}

    def close(self) -> list[str]:
        """Finish every file: fsync'd and renamed to its name (directories: the caller's)."""
        files = []
        writers, self.writers = self.writers, {}
        with ExitStack() as closing:  # (one failed: the others closed all the same)
            for writer in writers.values():
                closing.callback(writer.close)
        for table in writers:
            tmp, rel = self.tmp(table), part_file(table, self.number)
            groups = pq.read_metadata(tmp).num_row_groups
            if groups != self.groups[table]:  # the pieces the manifest lists would be wrong
                raise ArchiveError(f"{tmp}: {groups} row groups written, not {self.groups[table]}")
            fsync_file(tmp)
            os.replace(tmp, self.out / rel)
            files.append(rel)
        return files


class Parts:
    """The blocks of a compaction run, written as parts (see the module)."""

    def __init__(
        self, out: Path, manifest: Manifest, block_bytes: int, row_group: int = ROW_GROUP
    ) -> None:
        self.out, self.manifest = out, manifest
        self._block_bytes, self._row_group = block_bytes, row_group
        #: the block being gathered, and which segment added rows to which tables
        self.block = Block(manifest.run_id)
        self._chunks: list[tuple[SegmentEntry, dict[str, int]]] = []
        self._pending = 0  # spool bytes of those chunks
        self._part: _Part | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranklog-compact")
        self._writes: list[Future[None]] = []

    def added(self, entry: SegmentEntry, rows: dict[str, int], nbytes: int) -> None:
        """A chunk of ``entry``'s segment was added to :attr:`block` (``rows``: per table);
        the block is written once it holds ``block_bytes`` of spool."""
        self._chunks.append((entry, rows))
        self._pending += nbytes
        if self._pending >= self._block_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the block gathered so far, and name its pieces."""
        chunks, self._chunks, self._pending = self._chunks, [], 0
        block, self.block = self.block, Block(self.manifest.run_id)
        if not chunks:
            return
        if self._part is None:
            self._part = _Part(self.out, self.manifest.parts, self._row_group)
            self.manifest.parts += 1
        part = self._part
        for table, data in block.tables(dictionary=True, by_step=True).items():
            first = part.groups.get(table, 0)
            end = part.groups[table] = first + -(-data.num_rows // self._row_group)
            rel = part_file(table, part.number)
            piece = [part.number, 0, first, end]
            for entry, rows in chunks:
                if not rows.get(table):
                    continue
                held = entry.pieces.setdefault(table, [])
                if not held or held[-1] != piece:
                    held.append(piece)
                if rel not in entry.files:
                    entry.files.append(rel)
            self._writes.append(self._pool.submit(part.write, table, data))
        while len(self._writes) > _IN_FLIGHT:  # memory: a few blocks' tables at most
            self._writes.pop(0).result()

    def close_part(self) -> list[str]:
        """The blocks gathered written, and the part closed: its files, durable (their
        directories fsync'd), relative to the dataset."""
        self.flush()
        self._wait()
        part, self._part = self._part, None
        if part is None:
            return []
        files = self._pool.submit(part.close).result()
        for d in sorted({(self.out / f).parent for f in files}):
            fsync_dir(d)
        return files

    def _wait(self) -> None:
        writes, self._writes = self._writes, []
        for w in writes:
            w.result()

    def close(self) -> None:
        """Stop the thread (whatever happened); a part left open stays unlisted."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._part is not None:
            self._part.abandon()
            self._part = None


def remove_orphans(out: Path, manifest: Manifest) -> None:
    """Remove the part files (and temporary files) of ``out`` that ``manifest`` does not
    list: what a crashed run left."""
    listed = {f for entry in manifest.segments.values() for f in entry.files}
    for table, name in table_entries(out):
        tmp = name.startswith(".part-") and name.endswith(".tmp")
        if tmp or (PART.fullmatch(name) and f"{table}/{name}" not in listed):
            (out / table / name).unlink(missing_ok=True)


def check_files(out: Path, manifest: Manifest, spool: str | os.PathLike[str] | None = None) -> None:
    """:class:`ArchiveError` naming the first file the manifest lists that is missing or
    damaged (no Parquet footer; fewer row groups than the manifest's pieces name), so a
    reader says which file, not a traceback from deep inside pyarrow; with the command
    that rewrites it from ``spool`` where it is known."""
    for rel, why in damaged_files(out, manifest):
        fix = (
            f"`ranklog compact {shlex.quote(os.path.abspath(spool))} --out "
            f"{shlex.quote(str(out.resolve()))} --repair` rewrites it from the spool"
            if spool is not None
            else "`ranklog compact SPOOL --out DIR --repair` rewrites it from its spool"
        )
        raise ArchiveError(f"{out / rel}: {why}; the dataset cannot be read whole: {fix}")


def damaged_files(out: Path, manifest: Manifest) -> list[tuple[str, str]]:
    """(file, why) of every file the manifest lists that is missing or damaged."""
    groups: dict[str, int] = {}  # file -> row groups the manifest's pieces need
    for entry in manifest.segments.values():
        for table, held in entry.pieces.items():
            for p, g, _, end in held:
                rel = part_file(table, p, g)
                groups[rel] = max(groups.get(rel, 0), end)
        for rel in entry.files:
            groups.setdefault(rel, 0)
    out_: list[tuple[str, str]] = []
    for rel in sorted(groups):
        why = _damage(out / rel, groups[rel])
        if why is not None:
            out_.append((rel, why))
    return out_


def _damage(path: Path, groups: int) -> str | None:
    """Why the file at ``path`` cannot hold ``groups`` row groups (None: it can)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 12 or (f.seek(size - 4), f.read(4))[1] != b"PAR1":
                return "damaged (no Parquet footer)"
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if groups:
        try:
            got = pq.read_metadata(path).num_row_groups
        except (OSError, pa.ArrowException) as exc:
            return f"damaged ({exc})"
        if got < groups:
            return f"damaged ({got} row groups, the manifest names {groups})"
    return None


def table_entries(out: Path) -> list[tuple[str, str]]:
    """(table, file name) of every entry of the dataset's table directories (listed once)."""
    found = []
    for table in TABLES:
        try:
            names = os.listdir(out / table)
        except FileNotFoundError:
            continue
        found += [(table, name) for name in names]
    return found
