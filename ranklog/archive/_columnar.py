"""Replay on columns: a planned dataset's metrics and timers reduced window by window.

:class:`ColumnarTails` is the reading half of a replay shipper for a dataset that
:func:`~ranklog.archive._plan.plan` accepted. It reads windows of steps (about
:data:`WINDOW_ROWS` rows, by row group, using each group's step statistics), sorts
each window's rows by (step, name) with a stable sort, so that a group's values stay
in rank order and, within a rank, in write order, and reduces each group with the
engine's own :class:`~ranklog.shippers._reduce.Partial`. The shipper gets the same
:class:`~ranklog.shippers._steps.StepPartial` objects as from the event path, with the
ranks' views as the engine would have them once the window's ranks were read, so
completeness, params and targets are untouched and the output is byte for byte the
same. No Python object is made per value: one list of the window's values, sliced per
(step, name).

A row group that spans two windows is read by both; memory holds one window.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ranklog.archive._plan import REDUCED, Plan, RowGroup
from ranklog.shippers._cursor import Cursor
from ranklog.shippers._reduce import Partial, parse_ops
from ranklog.shippers._steps import Named, StepPartial, _slower
from ranklog.shippers._tail import RankView, StepGap, TailCommit, TailPoll
from ranklog.spool import RunInfo

__all__ = ["WINDOW_ROWS", "ColumnarTails"]

#: rows of the metrics and timers tables reduced together (one window of steps)
WINDOW_ROWS: Final = 1 << 18
_NO_LAST: Final = (-math.inf, -1, math.nan)
_COLUMNS: Final = ["ts", "step", "name", "value", "reduce"]
_ONE_SPEC: Final = _COLUMNS[:-1]
#: Parquet files kept open between windows
_OPEN: Final = 256


class _Words:
    """Strings (names, reduce specs) as small integers, the same across files."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def codes(self, col: pa.ChunkedArray) -> Any:
        """The column's strings as codes (dictionary-encoded chunks are mapped, not read)."""
        out = []
        for chunk in col.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = pc.dictionary_encode(chunk)
            lut = np.array([self._id(w) for w in chunk.dictionary.to_pylist()], np.int64)
            out.append(lut[chunk.indices.to_numpy()] if len(lut) else np.zeros(0, np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _id(self, word: str) -> int:
        got = self.ids.get(word)
        if got is None:
            got = self.ids[word] = len(self.words)
            self.words.append(word)
        return got


class _Rows:
    """One table's rows of a window, as numpy columns (rank order, then write order)."""

    def __init__(self) -> None:
        self.parts: list[tuple[Any, ...]] = []

    def columns(self) -> tuple[Any, ...]:
        if not self.parts:
            return tuple(np.zeros(0, np.int64) for _ in range(6))
        return tuple(np.concatenate(c) for c in zip(*self.parts, strict=True))


@dataclass(slots=True)
class _Window:
    """One window's rows, as read: steps ``lo <= step < hi``."""

    lo: int
    hi: int
    #: table -> (rank, ts, step, name, value, spec) columns
    rows: dict[str, tuple[Any, ...]]
    #: rank -> (steps, latest ts of each) per part read
    marks: dict[int, list[tuple[Any, Any]]]
    #: no row is left after this window
    last: bool


class _Loader:
    """Reads a planned dataset window by window, each lane (a rank's table) in write order."""

    def __init__(self, plan: Plan, names: _Words, specs: _Words) -> None:
        self._cache = plan.cache
        self._names, self._specs = names, specs
        #: (rank, groups of one table in write order: their steps never go down)
        self._lanes: list[tuple[int, list[RowGroup]]] = []
        for rp in plan.ranks:
            for table in REDUCED:
                lane = [g for g in rp.groups if g.table == table]
                if lane:
                    self._lanes.append((rp.rank, lane))
        #: each lane's first group still needed
        self._next = [0] * len(self._lanes)
        lows = [lane[0].lo for _, lane in self._lanes]
        top = max((g.hi for _, lane in self._lanes for g in lane), default=0)
        self._span = top - min(lows, default=0) + 1
        self._width = max(1, int(WINDOW_ROWS / (max(plan.rows, 1) / self._span)))
        self._hi: int | None = None
        self._open: dict[Path, pq.ParquetFile] = {}

    def next(self) -> _Window | None:
        """The next window (None: everything was read)."""
        starts = [
            lane[i].lo
            for (_, lane), i in zip(self._lanes, self._next, strict=True)
            if i < len(lane)
        ]
        if not starts:
            return None
        lo = max(min(starts), self._hi if self._hi is not None else min(starts))
        # the width that held WINDOW_ROWS on average, fitted to the rows here (as the row
        # groups' statistics spread them): uneven steps neither blow memory up nor crawl
        width = self._width
        while width > 1 and self._estimate(lo, lo + width) > 2 * WINDOW_ROWS:
            width //= 2
        while width < self._span and self._estimate(lo, lo + width) < WINDOW_ROWS / 4:
            width *= 2
        self._width = width
        hi = lo + width
        rows = {t: _Rows() for t in REDUCED}
        marks: dict[int, list[tuple[Any, Any]]] = {}
        for k, (rank, lane) in enumerate(self._lanes):
            i = self._next[k]
            picked: list[RowGroup] = []
            while i + len(picked) < len(lane) and lane[i + len(picked)].lo < hi:
                picked.append(lane[i + len(picked)])
            while i < len(lane) and lane[i].hi < hi:  # read to its end: not needed again
                i += 1
            self._next[k] = i
            if picked:
                self._read(rank, picked, lo, hi, rows[picked[0].table], marks)
        self._hi = hi
        last = all(i >= len(lane) for (_, lane), i in zip(self._lanes, self._next, strict=True))
        return _Window(lo, hi, {t: r.columns() for t, r in rows.items()}, marks, last)

    def close(self) -> None:
        for pf in self._open.values():
            pf.close()
        self._open = {}

    def _estimate(self, lo: int, hi: int) -> float:
        """Rows for steps ``lo <= step < hi``, each group's spread evenly over its steps."""
        total = 0.0
        for (_, lane), i in zip(self._lanes, self._next, strict=True):
            while i < len(lane) and lane[i].lo < hi:
                g = lane[i]
                inside = min(g.hi, hi - 1) - max(g.lo, lo) + 1
                if inside > 0:
                    total += g.rows * inside / (g.hi - g.lo + 1)
                i += 1
        return total

    def _read(
        self,
        rank: int,
        groups: list[RowGroup],
        lo: int,
        hi: int,
        into: _Rows,
        marks: dict[int, list[tuple[Any, Any]]],
    ) -> None:
        """The rows of ``groups`` (one lane's) for steps ``lo <= step < hi``.

        What a group holds past ``hi`` stays in the cache for the next window (the cache
        drops the least recently used past its size; those are read again).
        """
        cache = self._cache
        tables = []
        for g in groups:
            key = (str(g.path), g.index)
            t = cache.get(key)
            if t is None:
                t = self._file(g.path).read_row_group(
                    g.index, columns=_COLUMNS if g.spec is None else _ONE_SPEC
                )
                if g.spec is not None:  # one spec for the group: not read, repeated
                    spec = pa.DictionaryArray.from_arrays(
                        pa.array(np.zeros(t.num_rows, np.int32)), pa.array([g.spec])
                    )
                    t = t.append_column("reduce", spec)
            step = t["step"].to_numpy()
            a, b = np.searchsorted(step, [lo, hi]).tolist()  # steps never go down in a lane
            if b < len(step):
                cache.put(key, t.slice(b))
            else:
                cache.drop(key)
            if b > a:
                tables.append(t.slice(a, b - a))
        if not tables:
            return
        t = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        step = t["step"].to_numpy()
        ts = t["ts"].to_numpy().view(np.int64)  # microseconds
        cut = np.flatnonzero(step[1:] != step[:-1]) + 1
        first = np.concatenate(([0], cut))
        marks.setdefault(rank, []).append((step[first], np.maximum.reduceat(ts, first)))
        into.parts.append((
            np.full(len(step), rank, np.int64), ts, step, self._names.codes(t["name"]),
            t["value"].to_numpy(), self._specs.codes(t["reduce"]),
        ))  # fmt: skip

    def _file(self, path: Path) -> pq.ParquetFile:
        """``path`` opened (the last :data:`_OPEN` files stay open)."""
        pf = self._open.pop(path, None)
        if pf is None:
            pf = pq.ParquetFile(
                path, metadata=self._cache.footer(path), read_dictionary=["name", "reduce"]
            )
            while len(self._open) >= _OPEN:
                self._open.pop(next(iter(self._open))).close()
        self._open[path] = pf
        return pf


class ColumnarTails:
    """The reading half of a replay on columns (see the module)."""

    def __init__(self, plan: Plan, dataset: Path) -> None:
        self._plan = plan
        self._dataset = dataset
        self._names, self._specs = _Words(), _Words()
        self._loader = _Loader(plan, self._names, self._specs)
        #: the next window, read by a thread while this one is reduced (decoding Parquet
        #: releases the GIL)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ranklog-replay")
        self._coming: Future[_Window | None] | None = None
        self._hi: int | None = None  # the end of the window reduced last (exclusive)
        self._done = False
        self._params_sent = False
        self._built: dict[int, StepPartial] = {}

    @property
    def mode(self) -> str:
        return f"replay of {self._dataset} (columnar)"

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        return None

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """Reduce the next window of steps; the ranks as the engine sees them once it is read."""
        progressed = not self._done
        if not self._done:
            self._window()
        params = []
        if not self._params_sent:
            self._params_sent = True
            params = [p for rp in self._plan.ranks for p in rp.params]
        return TailPoll(progressed, self._views(), sorted(self._built), params, 0)

    def _views(self) -> list[RankView]:
        """A rank with no row past the window is read to its end (released); the others have
        closed the window's steps, at least."""
        out = []
        for rp in self._plan.ranks:
            # every row of a rank is for a step <= its watermark + 1 (nothing late)
            read = self._done or (self._hi is not None and rp.watermark + 1 < self._hi)
            mark = rp.watermark if read or self._hi is None else min(rp.watermark, self._hi - 1)
            out.append(RankView(rp.rank, mark, read, rp.ended, 0.0, rp.world_size))
        return out

    def partials(self, steps: list[int], *, per_rank: bool) -> list[StepPartial | None]:
        """The window's partials (each handed out once)."""
        return [self._built.pop(s, None) for s in steps]

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        """Nothing to consume: a replay's cursor is thrown away."""
        return TailCommit({}, {})

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        self._built = {}
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._loader.close()

    # -- one window -------------------------------------------------------------------

    def _window(self) -> None:
        if self._coming is None:  # the first window
            self._coming = self._pool.submit(self._loader.next)
        window = self._coming.result()
        self._coming = None
        if window is None:
            self._done = True
            return
        if not window.last:
            self._coming = self._pool.submit(self._loader.next)
        built: dict[int, StepPartial] = {}
        for table in REDUCED:
            self._reduce(built, window.lo, window.rows[table], timers=table == "timers")
        _ranks_and_ts(built, window.marks)
        self._hi = window.hi
        self._built = built
        self._done = window.last

    def _reduce(
        self, built: dict[int, StepPartial], lo: int, cols: tuple[Any, ...], *, timers: bool
    ) -> None:
        """Each (step, name) of one table reduced, its values in rank order."""
        rank, ts, step, name, value, spec = cols
        n = len(step)
        if not n:
            return
        width = len(self._names.words)
        key = (step - lo) * width + name
        order = np.argsort(key, kind="stable")
        key = key[order]
        cut = np.flatnonzero(key[1:] != key[:-1]) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [n])).tolist()
        values = value[order].tolist()
        ranks = rank[order]
        firsts = ranks[starts].tolist()
        group_specs = spec[order][starts].tolist()
        keys = key[starts].tolist()
        words, specs = self._names.words, self._specs.words
        ops_of = [parse_ops(x) for x in specs]
        stamps: list[int] | None = None
        rank_list: list[int] | None = None
        part: StepPartial | None = None
        at = -1
        into: dict[str, Named] = {}
        for k, a, b, first, sid in zip(
            keys, starts.tolist(), ends, firsts, group_specs, strict=True
        ):
            s, j = divmod(k, width)
            if s != at:
                at = s
                s += lo
                part = built.get(s)
                if part is None:
                    built[s] = part = StepPartial(s)
                into = part.timers if timers else part.metrics
            ops = ops_of[sid]
            vals = values[a:b]
            last = _NO_LAST
            if timers or "last" in ops:
                if stamps is None or rank_list is None:
                    stamps, rank_list = ts[order].tolist(), ranks.tolist()
                if "last" in ops:
                    last = _last(stamps, rank_list, values, a, b)
                if timers:
                    assert part is not None
                    part.slowest[words[j]] = _slowest(vals, rank_list[a:b])
            into[words[j]] = Named(first, specs[sid], Partial.of(vals, last=last, ops=ops))


def _last(stamps: list[int], ranks: list[int], values: list[float], a: int, b: int) -> Any:
    """(ts, rank, value) of the latest value (ties: the highest rank, then the later one)."""
    best: tuple[float, int, float] = _NO_LAST
    for i in range(a, b):
        ts = stamps[i] / 1e6
        if (ts, ranks[i]) >= best[:2]:
            best = (ts, ranks[i], values[i])
    return best


def _slowest(values: list[float], ranks: list[int]) -> tuple[float, int]:
    """(longest time, the first rank that took it), NaN losing to any number."""
    best = (values[0], ranks[0])
    for v, r in zip(values, ranks, strict=True):
        if _slower(v, best[0]):
            best = (v, r)
    return best


def _ranks_and_ts(built: dict[int, StepPartial], marks: dict[int, list[tuple[Any, Any]]]) -> None:
    """Each step's count of ranks that logged for it, and its latest event time."""
    if not marks:
        return
    per_rank_steps = []
    all_steps, all_ts = [], []
    for parts in marks.values():
        steps = np.concatenate([p[0] for p in parts])
        per_rank_steps.append(np.unique(steps))
        all_steps.append(steps)
        all_ts.append(np.concatenate([p[1] for p in parts]))
    uniq, counts = np.unique(np.concatenate(per_rank_steps), return_counts=True)
    steps, ts = np.concatenate(all_steps), np.concatenate(all_ts)
    order = np.argsort(steps, kind="stable")
    steps, ts = steps[order], ts[order]
    first = np.concatenate(([0], np.flatnonzero(steps[1:] != steps[:-1]) + 1))
    latest = np.maximum.reduceat(ts, first).tolist()
    for s, c, t in zip(uniq.tolist(), counts.tolist(), latest, strict=True):
        part = built[s]
        part.ranks = c
        part.ts = t / 1e6 if t > 0 else 0.0  # as the engine's running max from 0.0
