"""Where a segment's rows are in a dataset, and how they are read with bounded memory.

A segment's rows of a table are in *pieces* (:class:`Piece`): a file of its own (layout
1), or row groups of a part file that it shares with other segments (layout 2). They
are read whole (:func:`read_rows`, :func:`source_rows`), or by row group when the
statistics show them in write order (:class:`RowGroups`). Decoded row groups and parsed
footers are kept in caches of bounded size (:class:`GroupCache`; :class:`Shared` for a
part's row groups, split by segment once for all the segments that share them).
Columns a file written by an older release lacks are read as nulls.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog.archive._tables import SCHEMAS
from ranklog.errors import ArchiveError
from ranklog.spool import SegmentId

__all__ = [
    "KEY",
    "GroupCache",
    "Piece",
    "RowGroups",
    "Shared",
    "column_names",
    "open_file",
    "read_rows",
    "segment_key",
    "source_rows",
]

#: the columns that put a segment's rows in write order
KEY: Final = ("incarnation", "segment", "seq", "idx")
_SEGMENT: Final = ("rank", "incarnation", "segment")


def column_names(meta: Any) -> list[str]:
    """The top-level name of each leaf column of a parsed footer, in the order of a row
    group's columns (a list column's leaf is named after the column).

    Read from the first row group: ``meta.schema`` would tie the footer and its schema
    into a reference cycle that only the garbage collector frees, and a replay that
    parses thousands of footers would pile them up (~22 KB each). A file without row
    groups has no rows to read; its names come from the schema.
    """
    if meta.num_row_groups == 0:
        return list(meta.schema.to_arrow_schema().names)
    group = meta.row_group(0)
    return [group.column(i).path_in_schema.split(".")[0] for i in range(group.num_columns)]


def open_file(
    path: Path, metadata: Any = None, read_dictionary: list[str] | None = None
) -> pq.ParquetFile:
    """``path`` opened for reads of a few columns (``metadata``: its footer, parsed).

    Without pre-buffering: its I/O threads cost more than reading a small file (a rank's
    ten steps: about twice as long), and column chunks are read whole anyway.
    """
    return pq.ParquetFile(
        path, metadata=metadata, read_dictionary=read_dictionary, pre_buffer=False
    )


def _read(pf: pq.ParquetFile, table: str, wanted: list[str], group: int | None = None) -> pa.Table:
    """The ``wanted`` columns of ``table`` from ``pf`` (one row group, or all of it)."""
    have = set(pf.schema_arrow.names)
    cols = [c for c in wanted if c in have]
    if group is None:
        t = pf.read(columns=cols, use_threads=False)
    else:
        t = pf.read_row_group(group, columns=cols, use_threads=False)
    return _conform(t, table, wanted)


def _conform(t: pa.Table, table: str, wanted: list[str]) -> pa.Table:
    """``t`` with the ``wanted`` columns of ``table``'s schema: absent ones as nulls."""
    schema = SCHEMAS[table]
    for c in wanted:
        if c not in t.column_names:
            t = t.append_column(schema.field(c), pa.nulls(t.num_rows, schema.field(c).type))
    return t.select(wanted).cast(pa.schema([schema.field(c) for c in wanted]))


def _ordered(t: pa.Table) -> pa.Table:
    """Rows sorted in key order (compaction writes them so: usually nothing to do), ts as int."""
    if not _in_key_order(t):
        t = t.sort_by([(k, "ascending") for k in KEY])
    return t.set_column(t.schema.get_field_index("ts"), "ts", t["ts"].cast(pa.int64()))


@dataclass(frozen=True, slots=True)
class Piece:
    """Where a segment's rows of a table are: row groups ``first <= group < end`` of a
    file (``end`` -1: to its last). In a part file (dataset layout 2) the groups hold other
    segments' rows too; a file of layout 1 (``alone``) holds only this segment's."""

    path: Path
    first: int
    end: int
    segment: SegmentId
    #: the part's number (parts in this order hold rows in the order ranks wrote them)
    part: int = 0
    #: the file holds no other segment's rows (layout 1)
    alone: bool = False
    #: its segment's key (:func:`segment_key`)
    key: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sid = self.segment
        object.__setattr__(self, "key", int(segment_key(sid.rank, sid.incarnation, sid.segment)))

    @classmethod
    def whole(cls, path: Path, segment: SegmentId) -> Piece:
        """A file of layout 1: all of it, one segment's rows."""
        return cls(path, 0, -1, segment, 0, alone=True)

    def groups(self, meta: Any) -> range:
        """Its row groups, given its file's footer."""
        return range(self.first, meta.num_row_groups if self.end < 0 else self.end)


#: the bits an incarnation's and a segment's numbers take in a segment's key
_BITS: Final = 21


def segment_key(rank: Any, incarnation: Any, segment: Any) -> Any:
    """One integer per (rank, incarnation, segment), numbers or numpy arrays alike
    (:class:`~ranklog.errors.ArchiveError` for numbers past what the key holds)."""
    if type(rank) is int and type(incarnation) is int and type(segment) is int:
        top, most = max(incarnation, segment), rank  # (one segment: no numpy)
    else:
        top = max(int(np.max(incarnation, initial=0)), int(np.max(segment, initial=0)))
        most = int(np.max(rank, initial=0))
    if top >= 1 << _BITS or most >= 1 << (62 - 2 * _BITS):
        raise ArchiveError(f"a segment numbered past the dataset reader's range ({top})")
    return (rank << (2 * _BITS)) | (incarnation << _BITS) | segment


#: a row group sorted by segment, and where each segment's rows are
_Split = tuple[pa.Table, dict[int, tuple[int, int]]]


class Shared:
    """Row groups of part files, decoded once and split by segment, kept up to ``limit``
    bytes (least recently used first out).

    The segments of a block share its row groups (rows sorted by step): each segment
    read takes its slice of every group of the block, so the block is decoded once for
    all of them while readers go through its segments in turn.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[tuple[Path, int], _Split]
        self._items = OrderedDict()
        self._bytes = 0

    def rows(self, piece: Piece, table: str, footer: Any = None) -> pa.Table | None:
        """The piece's rows of its segment, in file order, with every column of ``table``
        decoded (absent ones as nulls); None if none."""
        key = piece.key
        parts = []
        pf: pq.ParquetFile | None = None
        for g in range(piece.first, piece.end):
            item = self._items.get((piece.path, g))
            if item is None:
                if pf is None:
                    pf = open_file(piece.path, footer)
                item = self._split(pf, table, g)
                self._put((piece.path, g), item)
            else:
                self._items.move_to_end((piece.path, g))
            t, at = item
            span = at.get(key)
            if span is not None:
                parts.append(t.slice(span[0], span[1] - span[0]))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    @staticmethod
    def _split(pf: pq.ParquetFile, table: str, g: int) -> _Split:
        t = _read(pf, table, list(SCHEMAS[table].names), g)
        keys = segment_key(*(t[c].to_numpy().astype(np.int64) for c in _SEGMENT))
        if len(keys) > 1 and not bool(np.all(keys[1:] >= keys[:-1])):
            order = np.argsort(keys, kind="stable")  # a segment's rows stay in file order
            keys = keys[order]
            t = t.take(pa.array(order))
        cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        starts = np.concatenate(([0], cut)).tolist()
        stops = np.concatenate((cut, [len(keys)])).tolist()
        at = {int(keys[a]): (a, b) for a, b in zip(starts, stops, strict=True)}
        return t, at

    def _put(self, key: tuple[Path, int], item: _Split) -> None:
        self._items[key] = item
        self._bytes += item[0].nbytes
        while self._bytes > self.limit and len(self._items) > 1:
            _, (old, _) = self._items.popitem(last=False)
            self._bytes -= old.nbytes


def source_rows(
    source: Piece, table: str, columns: list[str], shared: Shared | None = None
) -> pa.Table:
    """A segment's rows of one piece, in file order, with ``columns`` (absent ones as
    nulls): a file of its own, or the segment's rows of a part's groups."""
    if source.alone:
        pf = open_file(source.path)
        if source.first == 0 and source.end < 0:
            return _read(pf, table, columns)
        have = set(pf.schema_arrow.names)
        groups = list(source.groups(pf.metadata))
        t = pf.read_row_groups(groups, columns=[c for c in columns if c in have], use_threads=False)
        return _conform(t, table, columns)
    t = (shared if shared is not None else Shared(0)).rows(source, table)
    if t is None:
        return _empty(table, columns)
    return t.select(columns)


def _empty(table: str, columns: list[str]) -> pa.Table:
    schema = SCHEMAS[table]
    return pa.schema([schema.field(c) for c in columns]).empty_table()


def read_rows(
    files: list[Piece] | None, table: str, columns: list[str], shared: Shared | None = None
) -> pa.Table | None:
    """The rows of ``files`` (one segment's, of ``table``), sorted in write order; None if none.

    Columns a file written by an older release lacks are read as nulls. Files are read
    one by one with ``pyarrow.parquet`` (no dataset discovery, no pandas import).
    """
    if not files:
        return None
    wanted = [*KEY, "ts", *columns]
    parts = [source_rows(src, table, wanted, shared) for src in files]
    t = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
    return None if t.num_rows == 0 else _ordered(t)


class RowGroups:
    """One segment's rows of one table, read by Parquet row group, in ``seq`` order.

    For files whose row groups follow each other in ``seq`` (what compaction writes,
    known from the row groups' statistics alone): :meth:`rows` reads only the row groups
    that hold the frames asked for. Decoded row groups are shared through a cache of
    bounded size, so memory stays flat whatever the number of segments.
    """

    def __init__(self, table: str, columns: list[str], cache: GroupCache) -> None:
        self._table, self._cache = table, cache
        self._wanted = [*KEY, "ts", *columns]
        #: per row group, in order: its file, its index there, first and last seq, rows
        self.paths: list[Path] = []
        self.index: list[int] = []
        self.firsts: list[int] = []
        self.lasts: list[int] = []
        self.sizes: list[int] = []

    @classmethod
    def of(
        cls,
        files: list[Piece],
        table: str,
        columns: list[str],
        cache: GroupCache,
        most: int,
    ) -> RowGroups | None:
        """The row groups of ``files``; None when their statistics do not show them in
        ``seq`` order, a group has more than ``most`` rows, or holds other segments' rows
        too (read such files whole)."""
        out = cls(table, columns, cache)
        prev = -1
        for src in files:
            path = src.path
            meta = cache.footer(path)
            names = column_names(meta)
            col = names.index("seq")
            groups = src.groups(meta)
            if not src.alone and not _exclusive(meta, names, groups, src.segment):
                return None
            for i in groups:
                group = meta.row_group(i)
                stats = group.column(col).statistics
                if stats is None or not stats.has_min_max or stats.min < prev:
                    return None
                if group.num_rows > most:
                    return None
                out.paths.append(path)
                out.index.append(i)
                out.firsts.append(stats.min)
                out.lasts.append(stats.max)
                out.sizes.append(group.num_rows)
                prev = stats.max
        return out

    def end_of_group(self, seq: int) -> int | None:
        """The last ``seq`` to read with ``seq`` so that a read ends where a row group does.

        That is the last frame of the row group holding ``seq``, or the one before it when
        that frame goes on into the next group; a read that starts with such a frame takes
        the next group too. None when no group holds ``seq``.
        """
        firsts, lasts = self.firsts, self.lasts
        k = bisect.bisect_left(lasts, seq)  # the first group that ends at or after seq
        if k == len(lasts) or firsts[k] > seq:
            return None
        last = lasts[k]
        while k + 1 < len(lasts) and firsts[k + 1] == last:  # frame `last` spans groups
            if last - 1 >= seq:
                return last - 1
            k += 1  # the read starts with the spanning frame: on to the next group
            last = lasts[k]
        return last

    def _decode(self, k: int) -> pa.Table:
        path = self.paths[k]
        pf = open_file(path, self._cache.footer(path))
        return _ordered(_read(pf, self._table, self._wanted, self.index[k]))

    def rows(self, lo: int, hi: int) -> pa.Table | None:
        """The rows of frames ``lo..hi`` (by ``seq``), in write order; None if none.

        Reads go forward: what a group holds past ``hi`` is kept in the cache for the next
        read (usually a few rows: a frame cut by the group's end), the rest let go.
        """
        parts = []
        k = bisect.bisect_left(self.lasts, lo)
        while k < len(self.lasts) and self.firsts[k] <= hi:
            key = (str(self.paths[k]), self.index[k])
            t = self._cache.get(key)
            if t is None:
                t = self._decode(k)
            a, b = np.searchsorted(t["seq"].to_numpy(), [lo, hi + 1]).tolist()
            part = self._cache.cut(key, t, a, b)
            if part is not None:
                parts.append(part)
            k += 1
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _exclusive(meta: Any, names: list[str], groups: range, sid: SegmentId) -> bool:
    """Whether the statistics show every row of ``groups`` to be of segment ``sid``."""
    want = (sid.rank, sid.incarnation, sid.segment)
    cols = [names.index(c) for c in _SEGMENT]
    for i in groups:
        group = meta.row_group(i)
        for c, v in zip(cols, want, strict=True):
            stats = group.column(c).statistics
            if stats is None or not stats.has_min_max or not stats.min == stats.max == v:
                return False
    return True


#: parsed footers kept at most: about 22 KB each (a table's dozen columns, one row group),
#: so ~22 MB; a dataset of more files (a job of 4,096 ranks has a metrics file per rank)
#: parses the others again at each use (~0.1 ms each: a few percent of such a replay,
#: where keeping them all held ~90 MB at 4,096 ranks and more beyond)
FOOTERS: Final = 1_024


class GroupCache:
    """Decoded row groups (the rows a read left for the next), up to ``limit`` bytes, and
    parsed footers, up to ``footers`` files.

    What does not fit is not kept, rather than dropping what is: readers take their
    lanes (a rank's files) in turn, so the oldest entry is the next one needed, and
    dropping it would make every read miss once the lanes' rows outgrow the cache. The
    same goes for footers, unless ``latest`` (a reader that goes through each file once
    keeps the footers it used last). Without ``latest`` the footers may be shared by two
    threads (a replay's plan check and its reader): each is kept once, never dropped.
    """

    def __init__(self, limit: int, footers: int = FOOTERS, *, latest: bool = False) -> None:
        self.limit = limit
        self._items: dict[tuple[str, int], pa.Table] = {}
        self._bytes = 0
        self._footers: dict[Path, Any] = {}
        self._most_footers = footers
        self._latest = latest

    def footer(self, path: Path, parsed: Any = None) -> Any:
        """``path``'s parsed footer (``parsed``, when given, is it), kept if there is room
        (a re-parsed footer costs a replay of many small files more time and memory than
        keeping it: parsing churns the heap)."""
        kept = self._footers
        meta = kept.pop(path, None) if self._latest else kept.get(path)
        if meta is not None and not self._latest:
            return meta
        if meta is None:
            meta = parsed if parsed is not None else pq.read_metadata(path)
        if self._latest:  # room made: the least recently used go
            while len(kept) >= self._most_footers:
                del kept[next(iter(kept))]
        if len(kept) < self._most_footers:
            kept[path] = meta
        return meta

    def known(self, path: Path) -> Any:
        """``path``'s footer if it is kept (None: it is not)."""
        return self._footers.get(path)

    def get(self, key: tuple[str, int]) -> pa.Table | None:
        return self._items.get(key)

    def drop(self, key: tuple[str, int]) -> None:
        t = self._items.pop(key, None)
        if t is not None:
            self._bytes -= t.nbytes

    def put(self, key: tuple[str, int], t: pa.Table) -> None:
        """Keep ``t`` under ``key`` (in place of what was), if it fits."""
        self.drop(key)
        if self._items and self._bytes + t.nbytes > self.limit:
            return
        self._items[key] = t
        self._bytes += t.nbytes

    def cut(self, key: tuple[str, int], t: pa.Table, a: int, b: int) -> pa.Table | None:
        """Rows ``a <= row < b`` of ``t``, a group read (or its cached rest) under ``key``
        (None: no row); the rows past ``b`` kept for the next read, if they fit."""
        if b < t.num_rows:
            self.put(key, _rows_of(t, b, t.num_rows))
        else:
            self.drop(key)
        return _rows_of(t, a, b) if b > a else None


def _rows_of(t: pa.Table, a: int, b: int) -> pa.Table:
    """Rows ``a <= row < b`` of ``t``: a slice, or a copy where they are less than half of
    it (a slice keeps all of ``t``'s buffers: a window's slices of many groups would hold
    every group it touched)."""
    if a == 0 and b == t.num_rows:
        return t
    if 2 * (b - a) < t.num_rows:
        return t.take(pa.array(np.arange(a, b)))
    return t.slice(a, b - a)


def _in_key_order(t: pa.Table) -> bool:
    """Whether the rows are in (incarnation, segment, seq, idx) order, checked columnar."""
    if t.num_rows < 2:
        return True
    ok: Any = None  # row i <= row i+1 on the keys seen so far (from the last one)
    for k in reversed(KEY):
        col = t[k]
        lo, hi = col.slice(0, len(col) - 1), col.slice(1)
        ok = (
            pc.less_equal(lo, hi)
            if ok is None
            else pc.or_(pc.less(lo, hi), pc.and_(pc.equal(lo, hi), ok))
        )
    return bool(pc.all(ok).as_py())
