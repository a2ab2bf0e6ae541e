"""Replay on columns: a planned dataset's steps built window by window, no engine.

:class:`ColumnarTails` is the reading half of a replay shipper for a dataset that
:func:`~ranklog.archive._plan.plan` accepted. A :class:`~ranklog.archive._windows.Loader`
(on a thread of its own: decoding Parquet releases the GIL) reads windows of steps,
about :data:`~ranklog.archive._windows.WINDOW_BYTES` each, by row group, using each
group's step statistics.
Metrics and timers are sorted by (step, name) with a stable sort, so that a group's
values stay in rank order and, within a rank, in write order, and each group is
reduced with the engine's own :class:`~ranklog.shippers._reduce.Partial`: no Python
object per value, one list of the window's values sliced per (step, name). Texts,
distributions, images, tables and GPU samples, few, are rebuilt as events and added
to their steps as the engine adds them. The shipper gets the same
:class:`~ranklog.shippers._steps.StepPartial` objects as from the event path, with the
ranks' views as the engine would have them once the window's ranks were read, so
completeness, params and targets are untouched and the output is byte for byte the
same.

A row group that spans two windows is read by both (the part after the first window
stays in the cache, up to its size); memory holds :data:`_AHEAD` windows read ahead and
the one being reduced.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np

from ranklog._kept import Kept
from ranklog.archive._plan import REDUCED, Plan
from ranklog.archive._windows import Loader, Window, Words
from ranklog.errors import ArchiveError
from ranklog.shippers._cursor import Cursor
from ranklog.shippers._gather import SUMMED_SPECS, Named, Summed
from ranklog.shippers._ranks import RankView, StepGap, TailCommit, TailPoll
from ranklog.shippers._reduce import SUMMED_OPS, Partial, fsums, parse_ops
from ranklog.shippers._steps import StepPartial, _slower
from ranklog.spool import RunInfo

__all__ = ["ColumnarTails"]

_NO_LAST: Final = (-math.inf, -1, math.nan)
#: windows read ahead of the one reduced (memory holds this many more)
_AHEAD: Final = 2


class ColumnarTails:
    """The reading half of a replay on columns (see the module)."""

    def __init__(self, plan: Plan, dataset: Path) -> None:
        self._plan = plan
        self._dataset = dataset
        self._names, self._specs = Words(), Words()
        self._loader = Loader(plan, self._names, self._specs)
        #: the next windows, read by a thread while this one is reduced (decoding Parquet
        #: releases the GIL)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ranklog-replay")
        #: windows being read, in order (the pool's one thread reads them one by one)
        self._coming: deque[Future[Window | None]] = deque()
        self._hi: int | None = None  # the end of the window reduced last (exclusive)
        self._done = False
        self._params_sent = False
        self._built: dict[int, StepPartial] = {}
        #: a step's names (their ids, in order) -> the names, one tuple for every step that
        #: logs them (what live shipping's layouts give: orders found once, no list a step)
        self._tuples: Kept[tuple[int, ...], tuple[str, ...]] = Kept(_TUPLES_NAMES)

    def start(self) -> None:
        """Start reading the first window now (the plan's check may still be running: a
        dataset with GPU samples waits for it, their steps come from it)."""
        while len(self._coming) < _AHEAD and not self._done:
            self._coming.append(self._pool.submit(self._loader.next))

    @property
    def mode(self) -> str:
        return f"replay of {self._dataset} (columnar)"

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        return None

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """Reduce the next window of steps once the last one is shipped (a failed write
        leaves its steps held: they are sent again); the ranks as the engine sees them."""
        self._drop(shipped_upto)
        progressed = False
        if not self._built and not self._done:
            self._window()
            progressed = True
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
            status = rp.status if read else None
            out.append(RankView(rp.rank, mark, read, rp.ended, 0.0, rp.world_size, status))
        return out

    def partials(self, steps: list[int], *, per_rank: bool) -> list[StepPartial | None]:
        """The window's partials (held until they are shipped)."""
        return [self._built.get(s) for s in steps]

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        """Forget what was shipped; nothing else to save (a replay's cursor is thrown away)."""
        self._drop(shipped_upto)
        return TailCommit({}, {})

    def _drop(self, shipped_upto: int) -> None:
        if self._built and min(self._built) <= shipped_upto:
            for step in [s for s in self._built if s <= shipped_upto]:
                del self._built[step]

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        self._built = {}
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._loader.close()

    # -- one window -------------------------------------------------------------------

    def _window(self) -> None:
        if not self._coming:  # the first window
            self._coming.append(self._pool.submit(self._loader.next))
        try:
            window = self._coming.popleft().result()
        except OSError as exc:  # the reader moved on: a retry could not start where it failed
            raise ArchiveError(f"replay of {self._dataset}: reading failed ({exc})") from exc
        if window is None:
            self._done = True
            return
        while not window.last and len(self._coming) < _AHEAD:
            self._coming.append(self._pool.submit(self._loader.next))
        built: dict[int, StepPartial] = {}
        for table in REDUCED:
            self._reduce(built, window.lo, window.rows[table], timers=table == "timers")
        for rank, step, ev in window.items:
            part = built.get(step)
            if part is None:
                built[step] = part = StepPartial(step)
            part.add(rank, ev)
        _ranks_and_ts(built, window.marks)
        self._hi = window.hi
        self._built = built
        self._done = window.last

    def _columns(
        self, built: dict[int, StepPartial], lo: int, width: int,
        groups: tuple[Any, Any, Any, Any], firsts: list[int], group_specs: list[int],
        totals: list[float], sums: Any,
    ) -> Any:  # fmt: skip
        """The usual steps of a metrics window as columns (:class:`Summed`): every name of
        the step with one summable spec, one lowest rank and a finite total, as the live
        engine keeps them. ``width``: the names' count the keys were made with (the loader
        thread may add names meanwhile); ``groups``: each group's key, first rank, spec id
        and count (as arrays); ``totals``: each group's total, as a list and as an array
        (``sums``). Returns which groups were so taken (a mask), or None."""
        key, first, sid, count = groups
        steps = key // width
        if not len(steps) or np.any(steps[1:] < steps[:-1]):
            return None  # (groups come step by step; anything else: the general loop)
        # the spec as written is mean, sum or count (as the live engine asks: "sum,sum" or
        # an unknown spec takes the general path there, and here)
        exact = np.array([w in SUMMED_SPECS for w in self._specs.words[: int(sid.max()) + 1]])
        ok = exact[sid] & np.isfinite(sums)
        bounds = np.concatenate(([0], np.flatnonzero(steps[1:] != steps[:-1]) + 1))
        usual = np.logical_and.reduceat(ok, bounds) & _uniform(sid, bounds)
        usual &= _uniform(first, bounds)
        if not usual.any():
            return None
        stops = np.append(bounds[1:], len(steps))
        ids = key % width
        counts = count.tolist()
        # the count every name of a step shares (every rank logged every name), else 0
        each = np.where(_uniform(count, bounds), count[bounds], 0)[usual].tolist()
        specs = self._specs.words
        a_s, b_s = bounds[usual], stops[usual]
        layout = self._layout(ids, a_s, b_s)  # the names of every step, when one list
        names = [] if layout is not None else ids.tolist()
        for a, b, s, n in zip(a_s.tolist(), b_s.tolist(), (steps[a_s] + lo).tolist(), each,
                              strict=True):  # fmt: skip
            part = built.get(s)
            if part is None:
                built[s] = part = StepPartial(s)
            at = layout if layout is not None else self._names_of(names[a:b])
            part.summed = Summed(firsts[a], specs[group_specs[a]], at, counts[a:b], totals[a:b], n)
        return np.repeat(usual, stops - bounds)

    def _layout(self, ids: Any, starts: Any, stops: Any) -> tuple[str, ...] | None:
        """The names of the steps whose groups run from ``starts`` to ``stops`` (their
        names' codes: ``ids``) when every step has the same names in the same order (one
        list, found once); None otherwise."""
        lengths = stops - starts
        width = int(lengths[0])
        if not width or np.any(lengths != width):
            return None
        first = ids[starts[0] : starts[0] + width]
        every = ids[starts[:, None] + np.arange(width)]  # a row a step
        if not (every == first).all():
            return None
        return self._names_of(first.tolist())

    def _names_of(self, ids: list[int]) -> tuple[str, ...]:
        """The names of these codes, as one tuple kept for every step that has them."""
        key = tuple(ids)
        at = self._tuples.get(key)
        if at is None:
            words = self._names.words
            at = self._tuples.keep(key, tuple(words[j] for j in key))
        return at

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
        # values in rank order, each rank's in write order (lanes come in write order; a
        # dataset of layout 2 holds a step's values of a rank in one lane, or in lanes of
        # later parts)
        order = _transposed(step, rank, name)
        if order is None:
            order = np.argsort(key * (int(rank.max()) + 1) + rank, kind="stable")
        key = key[order]
        cut = np.flatnonzero(key[1:] != key[:-1]) + 1
        starts = np.concatenate(([0], cut))
        stops = np.concatenate((cut, [n]))
        # a step's names in the order they first appear (rank order, then write order), as
        # the engine meets them: an output name two names share keeps the later one's value
        seen = np.lexsort((order[starts], rank[order[starts]], key[starts] // width))
        starts, stops = starts[seen], stops[seen]
        begins, ends = starts.tolist(), stops.tolist()
        ordered = value[order]
        values: list[float] = []  # (as a list once a group needs its values one by one)
        if len(begins) == n:  # a value a group (one rank): each is its own total
            sums = ordered[starts]
            totals = sums.tolist()
        else:  # (fsum reads the array's floats in place: no list of every value)
            flat: Any = np.ascontiguousarray(ordered, np.float64).data
            totals = fsums(flat, begins, ends) or [math.nan] * len(ends)
            sums = np.array(totals)
        ranks = rank[order]
        first_g, sid_g, key_g = ranks[starts], spec[order][starts], key[starts]
        firsts, group_specs, keys = first_g.tolist(), sid_g.tolist(), key_g.tolist()
        words, specs = self._names.words, self._specs.words
        ops_of = [parse_ops(x) for x in specs]
        #: specs whose partial is the count and the sum alone, when the values are finite
        summable = [ops in SUMMED_OPS for ops in ops_of]
        stamps: list[int] | None = None
        rank_list: list[int] | None = None
        part: StepPartial | None = None
        at = -1
        into: dict[str, Named] = {}
        rest: Iterable[tuple[Any, ...]] = zip(
            keys, begins, ends, firsts, group_specs, totals, strict=True
        )
        if not timers:
            groups = (key_g, first_g, sid_g, stops - starts)
            taken = self._columns(built, lo, width, groups, firsts, group_specs, totals, sums)
            if taken is not None:  # only the groups of the other steps remain
                left = np.flatnonzero(~taken).tolist()
                cols = (keys, begins, ends, firsts, group_specs, totals)
                cols_left = [list(map(col.__getitem__, left)) for col in cols]
                rest = zip(*cols_left, strict=True)
        for k, a, b, first, sid, total in rest:
            s, j = divmod(k, width)
            if s != at:
                at = s
                s += lo
                part = built.get(s)
                if part is None:
                    built[s] = part = StepPartial(s)
                into = part.timers if timers else part.metrics
            if summable[sid] and not timers and total - total == 0.0:  # the usual group
                into[words[j]] = Named(first, specs[sid], Partial(b - a, total))
                continue
            ops = ops_of[sid]
            if not values:
                values = ordered.tolist()
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


#: names the kept tuples of names hold at most, all together
_TUPLES_NAMES: Final = 100_000


def _transposed(step: Any, rank: Any, name: Any) -> Any:
    """The stable sort of rows by (step, name, rank) that :meth:`ColumnarTails._reduce`
    needs, found by sorting runs, not rows, when rows come as ranks usually write them:
    in runs of one rank's step, each the same names in the same order (none twice), every
    step with as many ranks, each (step, rank) one run. Runs come step by step, ranks
    ascending (one block), or so within each lane (the blocks of a window, each with
    ranks of its own): they are put in (step, rank) order, and each step's rows are then
    a (ranks x names) matrix, read column by column (the columns in name order). None
    when the rows are not so (the sort finds the order then)."""
    n = len(step)
    if not n:
        return None
    runs = np.flatnonzero((step[1:] != step[:-1]) | (rank[1:] != rank[:-1])) + 1
    width = int(runs[0]) if len(runs) else n
    if n % width or len(runs) != n // width - 1 or np.any(runs != np.arange(width, n, width)):
        return None
    names = name.reshape(-1, width)
    if not (names == names[0]).all():
        return None
    columns = np.argsort(names[0], kind="stable")
    if np.any(names[0][columns][1:] == names[0][columns][:-1]):
        return None  # a name twice in a run
    steps, ranks = step[::width], rank[::width]
    at = None  # the runs in (step, rank) order, when they are not so already
    if np.any((steps[1:] < steps[:-1]) | ((steps[1:] == steps[:-1]) & (ranks[1:] <= ranks[:-1]))):
        at = np.lexsort((ranks, steps))
        steps, ranks = steps[at], ranks[at]
        if np.any((steps[1:] == steps[:-1]) & (ranks[1:] == ranks[:-1])):
            return None  # a rank's step in two runs
    firsts = np.flatnonzero(steps[1:] != steps[:-1]) + 1
    k = int(firsts[0]) if len(firsts) else len(steps)  # ranks a step
    if (
        len(steps) % k
        or len(firsts) != len(steps) // k - 1
        or np.any(firsts != np.arange(k, len(steps), k))
    ):
        return None
    starts = np.arange(0, n, width) if at is None else at * width
    cells = (starts[:, None] + columns[None, :]).reshape(-1, k, width)
    return cells.transpose(0, 2, 1).ravel()


def _uniform(values: Any, bounds: Any) -> Any:
    """Per run of ``values`` (runs start at ``bounds``): whether all of it is one value."""
    return np.minimum.reduceat(values, bounds) == np.maximum.reduceat(values, bounds)


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


def _ranks_and_ts(built: dict[int, StepPartial], marks: list[tuple[Any, Any, Any]]) -> None:
    """Each step's count of ranks that logged for it, and its latest event time."""
    if not marks:
        return
    ranks, steps, ts = (np.concatenate(col) for col in zip(*marks, strict=True))
    if not len(steps):
        return
    order = np.lexsort((ranks, steps))
    steps, ts, ranks = steps[order], ts[order], ranks[order]
    new_step = steps[1:] != steps[:-1]
    first = np.concatenate(([0], np.flatnonzero(new_step) + 1))
    new_rank = np.ones(len(steps), np.int64)  # a (step, rank) pair not met before
    new_rank[1:] = new_step | (ranks[1:] != ranks[:-1])
    counts = np.add.reduceat(new_rank, first).tolist()
    latest = np.maximum.reduceat(ts, first).tolist()
    for s, c, t in zip(steps[first].tolist(), counts, latest, strict=True):
        part = built[s]
        part.ranks = c
        part.ts = t / 1e6 if t > 0 else 0.0  # as the engine's running max from 0.0
