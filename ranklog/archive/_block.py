"""Events turned into the dataset's rows: the reads of many segments, as one set of tables.

:class:`Block` gathers *chunks* (one read of one segment: its frames' events, and the
highest step an earlier incarnation of its rank had closed) and builds each table once
for all of them. A compaction of 4,096 small segments thus builds its tables a few
times, not 4,096 times: Arrow's cost per array (tens of microseconds) was most of the
work for a segment of a thousand values. Rows come out in the order the ranks wrote
them (rank, incarnation, segment, seq, idx): chunks are added in that order.

Per chunk, only numbers are gathered (numpy arrays: each event's seq, idx, step and
time; each value's name and reduce spec as a code into the block's own list of
strings); the other kinds' events, few, are gathered row by row.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any, Final, Self

import msgspec
import numpy as np
import pyarrow as pa

from ranklog.archive._bulk import Bulk, bulk_values, packed_values
from ranklog.archive._tables import (
    _ADD,
    _TS,
    SCHEMAS,
    STEP_TABLES,
    TABLES,
    FrameEvents,
    _Columns,
    _us,
    names_row,
)
from ranklog.schemas import (
    Histogram,
    Image,
    Metrics,
    MetricsPacked,
    MetricsRaw,
    StepEnd,
    Table,
    Text,
    Timer,
    metrics_values,
)
from ranklog.spool import NO_STEP, Frame, SegmentName, implied_after

__all__ = ["Block", "segment_tables"]

_TS_OF: Final = attrgetter("ts")
_STEP_OF: Final = attrgetter("step")
_VALUES_OF: Final = attrgetter("values")
_NAMES_OF: Final = attrgetter("names")
_PACKED_OF: Final = attrgetter("packed")
_REDUCE_OF: Final = attrgetter("reduce")
_SEQ_OF: Final = attrgetter("seq")
_EVENTS_OF: Final = attrgetter("events")

#: each event type's group: its rows built row by row (:data:`_ADD`), or gathered into
#: columns (Metrics, StepEnd); an unknown type reads as row by row (and :data:`_ADD`
#: then refuses it, as it always did)
_BY_ROW, _METRICS_GROUP, _STEP_END_GROUP = 0, 1, 2
_GROUP: Final[defaultdict[type, int]] = defaultdict(
    int,
    {Metrics: _METRICS_GROUP, MetricsRaw: _METRICS_GROUP, MetricsPacked: _METRICS_GROUP,
     StepEnd: _STEP_END_GROUP},
)  # fmt: skip
#: event types of the step tables other than metrics (they raise a rank's highest step)
_STEPPED: Final = (Timer, Text, Histogram, Image, Table)
_DICT: Final = pa.dictionary(pa.int32(), pa.string())
#: the metrics table as :class:`Block` builds it with ``dictionary``
_METRICS: Final = pa.schema(
    [f.with_type(_DICT) if f.name in ("run_id", "name", "reduce") else f
     for f in SCHEMAS["metrics"]]
)  # fmt: skip


_MOVES: Final = frozenset((Metrics, MetricsRaw, MetricsPacked, *_STEPPED))


def _implied(events: list[Any], top: int, implied: int) -> int:
    """A stream's implied close after ``events`` (:func:`ranklog.spool.implied_after`, up
    to the first step_end), from its highest step ``top`` and implied close so far."""
    for ev in events:
        kind = type(ev)
        if kind is StepEnd:
            break
        if kind in _MOVES:
            implied, top = implied_after(ev.step, NO_STEP, top, implied), max(top, ev.step)
    return implied


class _Gathered:
    """Events of a read, in write order, each with its frame's ``seq`` and its ``idx``
    in the frame (numpy arrays): gathered by C loops over all frames at once, with no
    Python code per event."""

    __slots__ = ("events", "idx", "seq")

    def __init__(self, events: list[Any], seq: np.ndarray, idx: np.ndarray) -> None:
        self.events, self.seq, self.idx = events, seq, idx

    @classmethod
    def of(cls, frames: Sequence[FrameEvents]) -> Self:
        """Every event of ``frames``."""
        lists = list(map(_EVENTS_OF, frames))
        lens = np.fromiter(map(len, lists), np.int64, len(lists))
        events = list(chain.from_iterable(lists))
        seq = np.repeat(np.fromiter(map(_SEQ_OF, frames), np.int64, len(frames)), lens)
        first = np.repeat(np.cumsum(lens) - lens, lens)  # each event's frame's first
        idx = (np.arange(len(events), dtype=np.int64) - first).astype(np.int32)
        return cls(events, seq, idx)

    @classmethod
    def part(cls, every: _Gathered, mask: np.ndarray) -> Self:
        """The events of ``every`` where ``mask`` holds, in the same order."""
        at = np.flatnonzero(mask)
        if len(at) == len(every.events):
            return cls(every.events, every.seq, every.idx)
        return cls(list(map(every.events.__getitem__, at.tolist())), every.seq[at], every.idx[at])


class _Codes:
    """Strings as codes into one list, the same for every chunk of a block."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        #: the codes of the last tuple of words asked for (a layout's names, shared by
        #: every segment that logs them: found by identity)
        self._last: tuple[tuple[str, ...], Any] | None = None

    def code(self, word: str) -> int:
        got = self.ids.get(word)
        if got is None:
            got = self.ids[word] = len(self.ids)
        return got

    def lut(self, words: Iterable[str]) -> Any:
        last = self._last
        if last is not None and last[0] is words:
            return last[1]
        codes = np.array([self.code(w) for w in words], np.int32)
        if type(words) is tuple:
            self._last = (words, codes)
        return codes

    def array(self, codes: Any) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()),
                                              pa.array(list(self.ids), pa.string()))  # fmt: skip


class Block:
    """The tables of the chunks added so far (see the module)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._rows: dict[str, _Columns] = {}
        #: per step table built row by row: the highest step an earlier incarnation had
        #: closed, per row (its rows up to it are ``relogged``)
        self._upto: dict[str, list[int]] = {}
        self._names, self._specs = _Codes(), _Codes()
        #: metrics, per chunk: per event (rank, incarnation, segment, seq, idx, ts, step,
        #: count, upto) and per value (name code, value, spec code)
        self._events: list[tuple[Any, ...]] = []
        self._values: list[tuple[Any, Any, Any]] = []
        #: step_ends, per chunk: (rank, incarnation, segment, seq, idx, ts, step, events)
        self._ends: list[tuple[Any, ...]] = []

    def add(
        self, seg: SegmentName, frames: Sequence[FrameEvents], upto: int = -1,
        mark: list[int] | None = None,
    ) -> dict[str, int] | None:  # fmt: skip
        """Add one read of ``seg`` (``upto``: the steps an earlier incarnation of the rank
        had closed): the rows it adds to each table. None (nothing added, ``mark``
        untouched) when a Metrics event's values map is one the Metrics decoder refuses:
        decode the frames with :func:`~ranklog.schemas.decode_events` (which skips that
        event) and add them again. ``mark`` ([highest step_end, highest step of any step
        event]) is raised by what ``frames`` hold."""
        every = _Gathered.of(frames)
        group = np.fromiter(map(_GROUP.__getitem__, map(type, every.events)), np.int8,
                            len(every.events))  # fmt: skip
        metrics = _Gathered.part(every, group == _METRICS_GROUP)
        found = _metric_values(metrics.events) if metrics.events else None
        if metrics.events and found is None:
            return None
        before = {t: len(c) for t, c in self._rows.items()}
        ident = (seg.rank, seg.incarnation, seg.segment)
        if metrics.events:
            assert found is not None
            self._add_metrics(ident, metrics, found, upto)
        ends = _Gathered.part(every, group == _STEP_END_GROUP)
        if ends.events:
            self._add_ends(ident, ends)
        rest = _Gathered.part(every, group == _BY_ROW)
        top = -1
        if rest.events:
            top = self._add_rows(ident, rest, upto)
        if mark is not None:
            if mark[0] == NO_STEP:  # implied_after(): moves only until the first step_end
                mark[2] = _implied(every.events, mark[1], mark[2])
            if ends.events:
                mark[0] = max(mark[0], max(map(_STEP_OF, ends.events)))
            if metrics.events:  # one with no values has no row, but has its step
                top = max(top, max(map(_STEP_OF, metrics.events)))
            mark[1] = max(mark[1], top)
        rows = {t: len(c) - before.get(t, 0) for t, c in self._rows.items()}
        if metrics.events:
            rows["metrics"] = len(self._values[-1][1])
        if ends.events:
            rows["ranks"] = rows.get("ranks", 0) + len(ends.events)
        return {t: n for t, n in rows.items() if n}

    def _add_rows(self, ident: tuple[int, int, int], rest: _Gathered, upto: int) -> int:
        """Events of the other kinds, row by row; the highest step of those of step tables."""
        base = {"run_id": self.run_id, "rank": ident[0], "incarnation": ident[1],
                "segment": ident[2]}  # fmt: skip
        out = self._rows
        lazy = _Lazy(out)
        top = -1
        for ev, seq, idx in zip(rest.events, rest.seq.tolist(), rest.idx.tolist(), strict=True):
            key = base.copy()
            key["seq"], key["idx"], key["ts"] = seq, idx, _us(ev.ts)
            _ADD[type(ev)](lazy, ev, key)
            if isinstance(ev, _STEPPED):
                top = max(top, ev.step)
        for table in STEP_TABLES:
            cols = out.get(table)
            if cols is not None:
                ups = self._upto.setdefault(table, [])
                ups.extend([upto] * (len(cols) - len(ups)))
        return top

    def _add_metrics(
        self, ident: tuple[int, int, int], metrics: _Gathered, found: Bulk | list[Any], upto: int
    ) -> None:
        evs = metrics.events
        n_ev = len(evs)
        if isinstance(found, Bulk):
            counts = found.counts
            codes = self._names.lut(found.names)[found.codes] if len(found.codes) else found.codes
            values = np.asarray(found.values, np.float64)
        else:
            counts = np.fromiter(map(len, found), np.int64, n_ev)
            codes = _name_codes(found, self._names)
            values = np.fromiter(chain.from_iterable(map(dict.values, found)), np.float64,
                                 int(counts.sum()))  # fmt: skip
        specs = _spec_codes(evs, found, counts, self._specs)
        ts = np.fromiter(map(_TS_OF, evs), np.float64, n_ev)
        steps = np.fromiter(map(_STEP_OF, evs), np.int64, n_ev)
        self._events.append((*ident, metrics.seq, metrics.idx, ts, steps, counts, upto))
        self._values.append((codes.astype(np.int32, copy=False), values, specs))

    def _add_ends(self, ident: tuple[int, int, int], ends: _Gathered) -> None:
        evs, n = ends.events, len(ends.events)
        self._ends.append((
            *ident, ends.seq, ends.idx, np.fromiter(map(_TS_OF, evs), np.float64, n),
            np.fromiter(map(_STEP_OF, evs), np.int64, n),
            np.fromiter((ev.events for ev in evs), np.int32, n),
        ))  # fmt: skip

    def tables(self, *, dictionary: bool = False, by_step: bool = False) -> dict[str, pa.Table]:
        """The tables (empty ones left out), with the types of :data:`SCHEMAS`; with
        ``dictionary`` the metrics table's strings are dictionary-encoded (compaction writes
        them so, and Parquet does not hash every string again); with ``by_step`` the step
        tables' rows are sorted by step, stably (as a part holds them)."""
        tables: dict[str, pa.Table] = {}
        for name, cols in self._rows.items():
            if len(cols):
                tables[name] = cols.table(name)
        metrics = self._metrics_table(by_step)
        if metrics is not None:
            tables["metrics"] = metrics
        if self._ends:
            ends = self._ends_table()
            other = tables.get("ranks")
            tables["ranks"] = _in_write_order(
                ends if other is None else pa.concat_tables([other, ends])
            )
        for name in STEP_TABLES:
            t = tables.get(name)
            if t is not None and name != "metrics":
                upto = np.array(self._upto[name], np.int64)
                relogged = t["step"].to_numpy() <= upto
                t = t.append_column("relogged", pa.array(relogged))
                tables[name] = _by_step(t) if by_step else t
        return {
            t: tables[t] if dictionary else tables[t].cast(SCHEMAS[t])
            for t in TABLES
            if t in tables
        }

    def _metrics_table(self, by_step: bool) -> pa.Table | None:
        if not self._events:
            return None
        parts = list(zip(*self._events, strict=True))
        counts = np.concatenate(parts[7])
        n = int(counts.sum())
        if not n:
            return None

        def each(i: int, kind: Any) -> Any:  # a per-event column, one row per value
            return np.repeat(np.concatenate(parts[i]).astype(kind, copy=False), counts)

        def chunkwise(i: int, kind: Any) -> Any:  # a per-chunk number, one row per value
            per_chunk = [np.full(len(c), v, kind) for c, v in zip(parts[7], parts[i], strict=True)]
            return np.repeat(np.concatenate(per_chunk), counts)

        step = each(6, np.int64)
        order = None  # rows by step, stably (each step's rows in write order)
        if by_step and len(step) > 1 and bool(np.any(step[1:] < step[:-1])):
            order = np.argsort(step, kind="stable")
            step = step[order]

        def put(values: Any) -> pa.Array:  # a column, in the rows' order (one at a time)
            return pa.array(values if order is None else values[order])

        codes, values, specs = (np.concatenate(col) for col in zip(*self._values, strict=True))
        micros = np.rint(np.concatenate(parts[5]) * 1_000_000).astype(np.int64)
        relogged = chunkwise(8, np.int64)
        relogged = step <= (relogged if order is None else relogged[order])
        return pa.table(
            [
                pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(n, np.int32)), pa.array([self.run_id], pa.string())
                ),
                put(chunkwise(0, np.int32)),
                put(chunkwise(1, np.int32)),
                put(chunkwise(2, np.int32)),
                put(each(3, np.int64)),
                put(each(4, np.int32)),
                put(np.repeat(micros, counts)).cast(_TS),
                pa.array(step),
                self._names.array(codes if order is None else codes[order]),
                put(values),
                self._specs.array(specs if order is None else specs[order]),
                pa.array(relogged),
            ],
            schema=_METRICS,
        )

    def _ends_table(self) -> pa.Table:
        parts = list(zip(*self._ends, strict=True))
        n = sum(len(c) for c in parts[3])

        def chunkwise(i: int) -> Any:
            return np.concatenate([np.full(len(c), v, np.int32)
                                   for c, v in zip(parts[3], parts[i], strict=True)])  # fmt: skip

        micros = np.rint(np.concatenate(parts[5]) * 1_000_000).astype(np.int64)
        cols = {
            "run_id": pa.array([self.run_id], pa.string()).take(pa.array(np.zeros(n, np.int32))),
            "rank": pa.array(chunkwise(0)),
            "incarnation": pa.array(chunkwise(1)),
            "segment": pa.array(chunkwise(2)),
            "seq": pa.array(np.concatenate(parts[3]), pa.int64()),
            "idx": pa.array(np.concatenate(parts[4]), pa.int32()),
            "ts": pa.array(micros).cast(_TS),
            "kind": pa.array(["step_end"], pa.string()).take(pa.array(np.zeros(n, np.int32))),
            "step": pa.array(np.concatenate(parts[6])),
            "events": pa.array(np.concatenate(parts[7])),
        }
        schema = SCHEMAS["ranks"]
        return pa.table([cols.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema)


class _Lazy(dict[str, _Columns]):
    """The block's row-by-row tables, each made when its first row comes."""

    def __init__(self, into: dict[str, _Columns]) -> None:
        super().__init__()
        self._into = into

    def __getitem__(self, table: str) -> _Columns:
        cols = self._into.get(table)
        if cols is None:
            cols = self._into[table] = _Columns(table)
        return cols


def _by_step(t: pa.Table) -> pa.Table:
    """``t`` (rows in write order, rank by rank) sorted by step, stably."""
    step = t["step"].to_numpy()
    if len(step) < 2 or bool(np.all(step[1:] >= step[:-1])):
        return t
    return t.take(pa.array(np.argsort(step, kind="stable")))


def _in_write_order(t: pa.Table) -> pa.Table:
    """Rows sorted by (rank, incarnation, segment, seq, idx), stably."""
    keys = [t[c].to_numpy() for c in ("idx", "seq", "segment", "incarnation", "rank")]
    order = np.lexsort(keys)
    if bool(np.all(order[1:] > order[:-1])):
        return t
    return t.take(pa.array(order))


def _metric_values(
    evs: list[Metrics | MetricsRaw | MetricsPacked],
) -> Bulk | list[dict[str, float]] | None:
    """The events' values: read in bulk when every event's map is undecoded and of a shape
    :func:`~ranklog.archive._bulk.bulk_values` takes, else one dict per event; None when
    a map is one the Metrics decoder refuses."""
    kinds = set(map(type, evs))
    if kinds == {MetricsPacked} and all(map(_PACKED_OF, evs)):  # format 2, bytes kept
        return packed_values(list(map(_NAMES_OF, evs)), list(map(_PACKED_OF, evs)))
    if kinds == {MetricsRaw}:
        found = bulk_values(list(map(_VALUES_OF, evs)))
        if found is not None:
            return found
    out = []
    for ev in evs:
        if type(ev) is Metrics or type(ev) is MetricsPacked:
            out.append(ev.values)
            continue
        try:
            out.append(metrics_values(ev))  # type: ignore[arg-type]  # the other of the two
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
    return out


def _spec_codes(
    evs: list[Metrics | MetricsRaw | MetricsPacked],
    found: Bulk | list[dict[str, float]],
    counts: Any,
    specs: _Codes,
) -> Any:
    """Every value's reduce spec, as a code (``found``: the events' values, ``counts``:
    how many each holds)."""
    reds = list(map(_REDUCE_OF, evs))
    n = int(counts.sum())
    if len(set(map(type, reds))) == 1 and type(reds[0]) is str:
        if len(set(reds)) == 1:  # one spec for the whole read: the common case
            return np.full(n, specs.code(reds[0]), np.int32)
        return np.repeat(specs.lut(reds), counts)
    # some event reduces per name: one op per row
    keys: Iterable[Iterable[str]]
    if isinstance(found, Bulk):
        keys = map(found.shapes.__getitem__, found.shape_of.tolist())
    else:
        keys = found  # iterating a dict gives its names
    per_row = [
        r if isinstance(r, str) else r.get(name, "mean")
        for names, r in zip(keys, reds, strict=True)
        for name in names
    ]
    return specs.lut(per_row)


def _name_codes(values: list[dict[str, float]], names: _Codes) -> Any:
    """The code of the name of every value of ``values`` (the events' maps), in order.

    Events of a segment mostly log the same names: each distinct tuple of names is looked
    up once and the codes are put together from those (in C, not per value).
    """
    keys = list(map(tuple, values))
    shapes: dict[tuple[str, ...], int] = {}  # each distinct tuple of names: its place
    codes: list[np.ndarray] = []  # per distinct tuple: its names' codes
    for key in dict.fromkeys(keys):
        shapes[key] = len(codes)
        codes.append(names.lut(key))
    if len(codes) == 1:
        return np.tile(codes[0], len(keys))
    which = list(map(shapes.__getitem__, keys))
    return np.concatenate([codes[w] for w in which]) if which else np.zeros(0, np.int32)


def segment_tables(
    run_id: str,
    seg: SegmentName,
    frames: Sequence[Frame],
    relogged_upto: int = -1,
    *,
    dictionary: bool = False,
) -> dict[str, pa.Table]:
    """The rows of ``frames`` (one segment's, decoded), as one Arrow table per kind (empty
    ones left out): a block of one chunk.

    Rows of steps up to ``relogged_upto`` (the steps an earlier incarnation of the rank had
    closed) are marked ``relogged``: training logged them again after a restart. Every
    table has the types of :data:`SCHEMAS`, except with ``dictionary``: the metrics
    table's strings are then dictionary-encoded.
    """
    block = Block(run_id)
    rows: list[FrameEvents] = [names_row(f) if f.names_ts is not None else f for f in frames]
    added = block.add(seg, rows, relogged_upto)
    assert added is not None  # decoded Metrics: no map to refuse
    return block.tables(dictionary=dictionary)
