"""Windows of steps read from a planned dataset: each rank's rows, by row group.

:class:`Loader` walks *lanes* (one rank's metrics, timers, texts, distributions,
images or tables files, in write order: their steps never go down, the plan made
sure) and each rank's GPU samples (whose steps the plan worked out). Each
:meth:`Loader.next` picks the next window of steps, about :data:`WINDOW_BYTES` of row
groups as their statistics spread them over their steps, and returns its rows:
metrics and timers as numpy columns (names and reduce specs as small integers, the
same across files), the other tables' rows rebuilt as events (they are few).

A metrics or timers row group is decoded once, by the first window that needs it: the
rows it holds for later windows are kept as a :class:`~ranklog.archive._spill.Rest`
(memory, then temporary files). A row group of the other tables that spans two windows
is read by both; the part after the first window stays in the cache, up to its size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog.archive._files import Piece, column_names, open_file
from ranklog.archive._plan import ITEMS, READ, REDUCED, Plan, RowGroup, piece_rows
from ranklog.archive._rows import frame_events
from ranklog.archive._spill import ROW, Rest, Spill
from ranklog.archive._tables import SCHEMAS
from ranklog.errors import ArchiveError
from ranklog.schemas import Gpu, StepEvent
from ranklog.shippers._steps import Contributed

__all__ = ["WINDOW_BYTES", "WINDOW_STEPS", "Loader", "Window", "Words"]

#: row-group bytes (uncompressed, as the footers count them) of one window of steps: about
#: 400 K rows of metrics (two windows in flight: ~230 MB peak on the bench spool); a
#: table of images or tables counts by its bytes too
WINDOW_BYTES: Final = 12 << 20
#: steps of one window at most: each becomes the engine's objects (a few KB per step of 20
#: metrics), so a job with few ranks (many steps in WINDOW_BYTES) is bounded too (one rank's
#: 64 MiB segment: ~425 MB peak without this bound)
WINDOW_STEPS: Final = 2_048
_COLUMNS: Final = READ["metrics"]  # timers' too
#: the columns the item tables are read with (as frame_events takes them)
_ITEM_COLUMNS: Final = {t: ["seq", "idx", *READ[t]] for t in (*ITEMS, "gpu")}
_ONE_SPEC: Final = _COLUMNS[:-1]
_FIELDS: Final = tuple(ROW.names or ())
#: string columns of the reduced tables read as dictionaries (mapped to codes, not read)
_WORDS: Final = ("name", "reduce")
#: Parquet files kept open between windows
_OPEN: Final = 256
#: a row group is decoded on threads (a column each) past this size; below, handing the
#: columns out costs more than it gains
_THREADS: Final = 1 << 20


class Words:
    """Strings (names, reduce specs) as small integers, the same across files."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []
        self._last: tuple[Any, Any] | None = None  # the last dictionary mapped, its codes

    def codes(self, col: pa.ChunkedArray) -> Any:
        """The column's strings as codes (dictionary-encoded chunks are mapped, not read)."""
        out = []
        for chunk in col.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = pc.dictionary_encode(chunk)
            words = chunk.dictionary
            if self._last is not None and self._last[0].equals(words):
                lut = self._last[1]  # the next row group's dictionary, as a rule
            else:
                lut = np.array([self._id(w) for w in words.to_pylist()], np.int32)
                self._last = (words, lut)
            out.append(lut[chunk.indices.to_numpy()] if len(lut) else np.zeros(0, np.int32))
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    def code(self, word: str) -> int:
        """The code of one string."""
        return self._id(word)

    def _id(self, word: str) -> int:
        got = self.ids.get(word)
        if got is None:
            got = self.ids[word] = len(self.words)
            self.words.append(word)
        return got


#: one table's rows as the columnar reduce takes them: (rank, ts, step, name, value, spec)
#: numpy columns of the dtypes :data:`ROW` gives its fields
Columns = tuple[Any, ...]


class _Rows:
    """One table's rows of a window (rank order, then write order), as numpy columns."""

    def __init__(self) -> None:
        self.parts: list[Columns] = []

    def columns(self) -> Columns:
        if not self.parts:
            return tuple(np.zeros(0, ROW[f]) for f in _FIELDS)
        if len(self.parts) == 1:
            return self.parts[0]
        return tuple(np.concatenate(c) for c in zip(*self.parts, strict=True))


def _records(cols: Columns) -> Any:
    """Columns as :data:`ROW` records (what a rest keeps)."""
    out = np.empty(len(cols[0]), ROW)
    for f, c in zip(_FIELDS, cols, strict=True):
        out[f] = c
    return out


def _fields(rows: Any) -> Columns:
    """:data:`ROW` records as columns, copied (views would keep every record, and hand the
    reduction strided columns)."""
    return tuple(rows[f].copy() for f in _FIELDS)


@dataclass(slots=True)
class Window:
    """One window's rows, as read: steps ``lo <= step < hi``."""

    lo: int
    hi: int
    #: table -> (rank, ts, step, name, value, spec) columns
    rows: dict[str, tuple[Any, ...]]
    #: (ranks, steps, latest ts) per part read: each (rank, step) and its latest time stamp
    marks: list[tuple[Any, Any, Any]]
    #: no row is left after this window
    last: bool
    #: texts, distributions, images, tables and GPU samples: (rank, step, event), in rank
    #: order, each rank's in write order
    items: list[tuple[int, int, Contributed]]


@dataclass(slots=True)
class _GpuLane:
    """One rank's GPU samples: where they are (pieces, in write order, and how many each
    holds), each one's step (from the plan's check)."""

    rank: int
    steps: Any
    pieces: list[tuple[Piece, int]]
    #: the piece read last and its rows (a window takes the samples of a few steps)
    held: tuple[int, Any] | None = None
    #: the next row to read
    next: int = 0


def _by_rank(t: pa.Table) -> list[tuple[int, pa.Table]]:
    """Rows of many ranks (a block's, by step) split by rank, each rank's in their order."""
    ranks = t["rank"].to_numpy()
    order = np.argsort(ranks, kind="stable")
    ranks = ranks[order]
    cut = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
    t = t.take(pa.array(order)).drop_columns(["rank"])
    bounds = [0, *cut.tolist(), len(ranks)]
    return [(int(ranks[a]), t.slice(a, b - a)) for a, b in itertools.pairwise(bounds)]


class Loader:
    """Reads a planned dataset window by window, each lane (a rank's table) in write order."""

    def __init__(self, plan: Plan, names: Words, specs: Words) -> None:
        self._cache = plan.cache
        self._names, self._specs = names, specs
        #: (rank, groups of one table in write order: their steps never go down)
        #: (the rank of a lane's rows, -1 when they are of many ranks; its groups in write
        #: order: their steps never go down)
        self._lanes: list[tuple[int, list[RowGroup]]] = [
            (lane[0].rank, lane) for lane in plan.lanes
        ]
        #: each lane's first group still needed (metrics and timers: not decoded yet)
        self._next = [0] * len(self._lanes)
        #: metrics and timers lanes: the rows of their last group decoded still to come
        self._rests: list[Rest | None] = [None] * len(self._lanes)
        self._spill = Spill()
        self._plan = plan
        #: ranks with GPU samples: the samples' files, steps, and the next row to read (their
        #: steps come from the plan's check, done by the first read)
        self._gpu: list[_GpuLane] | None = None
        self._span = self._width = 1
        self._hi: int | None = None
        self._open: dict[Path, pq.ParquetFile] = {}

    def _start(self) -> list[_GpuLane]:
        """The GPU samples' lanes, and the first window's width (once)."""
        gpu = [_GpuLane(rp.rank, rp.gpu_steps, rp.gpu_pieces)
               for rp in self._plan.ranks if rp.gpu_steps is not None]  # fmt: skip
        lows = [lane[0].lo for _, lane in self._lanes] + [int(g.steps[0]) for g in gpu]
        top = max([g.hi for _, lane in self._lanes for g in lane]
                  + [int(g.steps[-1]) for g in gpu], default=0)  # fmt: skip
        self._span = top - min(lows, default=0) + 1
        total = sum(g.nbytes for _, lane in self._lanes for g in lane)
        self._width = max(1, int(WINDOW_BYTES / (max(total, 1) / self._span)))
        self._gpu = gpu
        return gpu

    def next(self) -> Window | None:
        """The next window (None: everything was read)."""
        gpu = self._gpu if self._gpu is not None else self._start()
        starts = [
            rest.first if rest is not None else lane[i].lo
            for (_, lane), i, rest in zip(self._lanes, self._next, self._rests, strict=True)
            if rest is not None or i < len(lane)
        ] + [int(g.steps[g.next]) for g in gpu if g.next < len(g.steps)]
        if not starts:
            return None
        lo = max(min(starts), self._hi if self._hi is not None else min(starts))
        # the width that held WINDOW_BYTES on average, fitted to the bytes here (as the row
        # groups' statistics spread them): uneven steps neither blow memory up nor crawl
        width = self._width
        while width > 1 and self._estimate(lo, lo + width) > 2 * WINDOW_BYTES:
            width //= 2
        while width < self._span and self._estimate(lo, lo + width) < WINDOW_BYTES / 4:
            width *= 2
        width = self._width = min(width, WINDOW_STEPS)
        hi = lo + width
        rows = {t: _Rows() for t in REDUCED}
        marks: list[tuple[Any, Any, Any]] = []
        other: dict[int, dict[str, pa.Table]] = {}  # rank -> item table -> its rows
        for k, (rank, lane) in enumerate(self._lanes):
            if lane[0].table in REDUCED:
                self._reduced(k, rank, hi, rows[lane[0].table], marks)
                continue
            i = self._next[k]
            picked: list[RowGroup] = []
            while i + len(picked) < len(lane) and lane[i + len(picked)].lo < hi:
                picked.append(lane[i + len(picked)])
            while i < len(lane) and lane[i].hi < hi:  # read to its end: not needed again
                i += 1
            self._next[k] = i
            if not picked:
                continue
            table = picked[0].table
            t = self._rows(picked, lo, hi, _ITEM_COLUMNS[table] + (["rank"] if rank < 0 else []))
            if t is not None:
                for r, part in _by_rank(t) if rank < 0 else [(rank, t)]:
                    had = other.setdefault(r, {}).get(table)
                    other[r][table] = part if had is None else pa.concat_tables([had, part])
        gpu_steps: dict[int, Any] = {}
        for g in gpu:
            end = int(np.searchsorted(g.steps, hi))
            if end > g.next:
                other.setdefault(g.rank, {})["gpu"] = self._gpu_rows(g, end)
                gpu_steps[g.rank] = g.steps[g.next : end]
                g.next = end
        self._hi = hi
        last = all(
            i >= len(lane) and rest is None
            for (_, lane), i, rest in zip(self._lanes, self._next, self._rests, strict=True)
        ) and all(g.next >= len(g.steps) for g in gpu)
        items = self._items(other, gpu_steps, marks)
        return Window(lo, hi, {t: r.columns() for t, r in rows.items()}, marks, last, items)

    def _items(
        self,
        other: dict[int, dict[str, pa.Table]],
        gpu_steps: dict[int, Any],
        marks: list[tuple[Any, Any, Any]],
    ) -> list[tuple[int, int, Contributed]]:
        """The window's events of the item tables, rebuilt (they are few), with their steps."""
        items: list[tuple[int, int, Contributed]] = []
        for rank in sorted(other):
            tables = other[rank]
            for name, t in tables.items():
                steps = gpu_steps[rank] if name == "gpu" else t["step"].to_numpy()
                ts = t["ts"].to_numpy()
                marks.append((np.full(len(ts), rank), steps, ts))
            sampled = iter(gpu_steps.get(rank, ()).tolist() if rank in gpu_steps else ())
            events = frame_events(dict(tables), rank, "")
            for seq in sorted(events):
                for ev in events[seq]:
                    item = cast(Contributed, ev)  # only item tables were read
                    step = next(sampled) if type(item) is Gpu else cast(StepEvent, item).step
                    items.append((rank, step, item))
        return items

    def close(self) -> None:
        for pf in self._open.values():
            pf.close()
        self._open = {}
        self._spill.close()

    @property
    def spilled(self) -> int:
        """Bytes of rows kept on disk so far (:mod:`ranklog.archive._spill`)."""
        return self._spill.spilled

    def _estimate(self, lo: int, hi: int) -> float:
        """Bytes for steps ``lo <= step < hi``, each group's spread evenly over its steps."""
        total = 0.0
        for (_, lane), i, rest in zip(self._lanes, self._next, self._rests, strict=True):
            if rest is not None and rest.first < hi:  # its rows spread evenly over its steps
                inside = min(rest.last, hi - 1) - max(rest.first, lo) + 1
                if inside > 0:
                    total += rest.left_bytes() * inside / (rest.last - rest.first + 1)
            while i < len(lane) and lane[i].lo < hi:
                g = lane[i]
                inside = min(g.hi, hi - 1) - max(g.lo, lo) + 1
                if inside > 0:
                    total += g.nbytes * inside / (g.hi - g.lo + 1)
                i += 1
        return total

    def _reduced(
        self, k: int, rank: int, hi: int, into: _Rows, marks: list[tuple[Any, Any, Any]]
    ) -> None:
        """Lane ``k``'s metrics or timers for steps below ``hi`` (the window's first step is
        its first row not taken yet) into ``into``, and each step's latest time stamp into
        ``marks``: what its rest holds, then its next groups, each decoded once."""
        lane = self._lanes[k][1]
        parts: list[Columns] = []
        rest = self._rests[k]
        if rest is not None:
            got = self._spill.take(rest, hi)
            if got is not None:
                parts.append(_fields(got))
            if rest.at == rest.count:
                rest = self._rests[k] = None
        i = self._next[k]
        while rest is None and i < len(lane) and lane[i].lo < hi:
            # the groups this window needs, read at once where they share a file and how
            # their spec is found (only the last may hold rows past the window: steps never
            # go down in a lane)
            j = i + 1
            while (j < len(lane) and lane[j].lo < hi and lane[j].path == lane[i].path
                   and (lane[j].spec is None) == (lane[i].spec is None)):  # fmt: skip
                j += 1
            groups = lane[i:j]
            cols = self._decode(rank, groups)
            i = j
            n = len(cols[0])
            b = int(np.searchsorted(cols[2], hi))
            if b:  # a small part copied: a slice would hold its whole group
                parts.append(cols if b == n else tuple(
                    c[:b] if 2 * b >= n else c[:b].copy() for c in cols))  # fmt: skip
            if b < n:
                nbytes = sum(g.nbytes for g in groups)
                rest = self._rests[k] = self._spill.keep(
                    _records(tuple(c[b:] for c in cols)), nbytes * (n - b) / n
                )
        self._next[k] = i
        for part in parts:
            step = part[2]
            new = np.ones(len(step), bool)
            new[1:] = step[1:] != step[:-1]
            if rank < 0:  # rows of many ranks (layout 2): by step, then rank
                ranks = part[0]
                new[1:] |= ranks[1:] != ranks[:-1]
            first = np.flatnonzero(new)
            latest = np.maximum.reduceat(part[1], first)
            marks.append((part[0][first], step[first], latest))
            into.parts.append(part)

    def _decode(self, rank: int, groups: list[RowGroup]) -> Columns:
        """Metrics or timers row groups of ``rank``'s (of one file, consecutive in its
        lane, each with a spec of its own or none), as columns."""
        first = groups[0]
        columns = (_COLUMNS if first.spec is None else _ONE_SPEC) + (["rank"] if rank < 0 else [])
        t = self._file(first.path).read_row_groups(
            [g.index for g in groups], columns=columns,
            use_threads=sum(g.nbytes for g in groups) > _THREADS,
        )  # fmt: skip
        n = t.num_rows
        step = t["step"].to_numpy()
        if rank < 0 and bool(np.any(step[1:] < step[:-1])):  # (compaction sorts them)
            which = ", ".join(str(g.index) for g in groups)
            raise ArchiveError(f"{first.path}: row groups {which} are not sorted by step")
        if first.spec is None:
            spec = self._specs.codes(t["reduce"])
        else:  # one spec a group (its statistics say so): not read
            spec = np.repeat(np.array([self._specs.code(cast(str, g.spec)) for g in groups],
                                      np.int32), [g.rows for g in groups])  # fmt: skip
        return (
            np.full(n, rank, np.int32) if rank >= 0 else t["rank"].to_numpy().astype(np.int32),
            t["ts"].to_numpy().view(np.int64),  # microseconds
            step.astype(np.int64, copy=False),
            self._names.codes(t["name"]),
            t["value"].to_numpy(),
            spec,
        )

    def _rows(
        self, groups: list[RowGroup], lo: int, hi: int, columns: list[str]
    ) -> pa.Table | None:
        """The rows of ``groups`` (one lane's) for steps ``lo <= step < hi``, ts as int.

        What a group holds past ``hi`` stays in the cache for the next window, if it fits
        (else it is read again).
        """
        cache = self._cache
        tables = []
        for g in groups:
            key = (str(g.path), g.index)
            t = cache.get(key)
            if t is None:
                pf = self._file(g.path)
                have = set(pf.schema_arrow.names)
                t = pf.read_row_group(
                    g.index, columns=[c for c in columns if c in have],
                    use_threads=g.nbytes > _THREADS,
                )  # fmt: skip
                for c in (c for c in columns if c not in have):  # a column of a later release
                    kind = SCHEMAS[g.table].field(c).type
                    t = t.append_column(pa.field(c, kind), pa.nulls(t.num_rows, kind))
                # ts as int, as frame_events takes it
                t = t.set_column(t.schema.get_field_index("ts"), "ts", t["ts"].cast(pa.int64()))
                steps = t["step"].to_numpy()
                if g.rank < 0 and bool(np.any(steps[1:] < steps[:-1])):  # (compaction sorts)
                    raise ArchiveError(f"{g.path}: row group {g.index} is not sorted by step")
            step = t["step"].to_numpy()
            a, b = np.searchsorted(step, [lo, hi]).tolist()  # steps never go down in a lane
            part = cache.cut(key, t, a, b)
            if part is not None:
                tables.append(part)
        if not tables:
            return None
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    @staticmethod
    def _gpu_rows(lane: _GpuLane, b: int) -> pa.Table:
        """The rank's GPU samples from its next one to row ``b`` (read a piece at a time),
        ts as int."""
        a, base, parts = lane.next, 0, []
        for k, (piece, n) in enumerate(lane.pieces):
            first, end = max(a - base, 0), min(b - base, n)
            base += n
            if first >= end:
                continue
            if lane.held is None or lane.held[0] != k:
                rows = piece_rows(piece, "gpu", None).select(_ITEM_COLUMNS["gpu"])
                lane.held = (k, rows)
            parts.append(lane.held[1].slice(first, end - first))
        t = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return t.set_column(t.schema.get_field_index("ts"), "ts", t["ts"].cast(pa.int64()))

    def _file(self, path: Path) -> pq.ParquetFile:
        """``path`` opened (the last :data:`_OPEN` files stay open)."""
        pf = self._open.pop(path, None)
        if pf is None:
            meta = self._cache.footer(path)
            names = set(column_names(meta))
            pf = open_file(path, meta, [c for c in _WORDS if c in names])
            while len(self._open) >= _OPEN:
                self._open.pop(next(iter(self._open))).close()
        self._open[path] = pf
        return pf
