"""The dataset's tables: one long-format Arrow schema per event kind, and events turned into rows.

Every table has the columns of :data:`COMMON` (run_id, rank, incarnation, segment,
seq, idx, ts) and its own (see :data:`SCHEMAS`); rows of one event share
(rank, incarnation, segment, seq, idx), which orders every rank's events as written.
The step tables (:data:`STEP_TABLES`) end with ``relogged``: true for a step an
earlier incarnation of the rank had already closed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Final, Protocol, Self

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ranklog.archive._bulk import Bulk, bulk_values, packed_values
from ranklog.schemas import (
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    MetricsPacked,
    MetricsRaw,
    Names,
    Params,
    RankEnd,
    RankStart,
    StepEnd,
    Table,
    Text,
    Timer,
    metrics_values,
)
from ranklog.spool import Frame, SegmentName

__all__ = [
    "COMMON",
    "SCHEMAS",
    "STEP_TABLES",
    "TABLES",
    "FrameEvents",
    "names_row",
    "raw_segment_tables",
    "segment_tables",
]

_TS = pa.timestamp("us", tz="UTC")
COMMON: Final = [
    ("run_id", pa.string()),
    ("rank", pa.int32()),
    ("incarnation", pa.int32()),
    ("segment", pa.int32()),
    ("seq", pa.int64()),  # frame sequence number within the incarnation
    ("idx", pa.int32()),  # event index within the frame
    ("ts", _TS),
]
#: tables whose rows belong to a step; they carry ``relogged`` last
STEP_TABLES: Final = ("metrics", "timers", "text", "histograms", "images", "tables")
SCHEMAS: Final[dict[str, pa.Schema]] = {
    name: pa.schema(COMMON + extra + ([("relogged", pa.bool_())] if name in STEP_TABLES else []))
    for name, extra in {
        "metrics": [("step", pa.int64()), ("name", pa.string()), ("value", pa.float64()),
                    ("reduce", pa.string())],
        "timers": [("step", pa.int64()), ("name", pa.string()), ("value", pa.float64()),
                   ("reduce", pa.string())],
        "text": [("step", pa.int64()), ("name", pa.string()), ("text", pa.large_string())],
        "histograms": [("step", pa.int64()), ("name", pa.string()),
                       ("values", pa.list_(pa.float64()))],
        # plotly: the plot as a Plotly figure's JSON, null when none (schema 6)
        "images": [("step", pa.int64()), ("name", pa.string()), ("format", pa.string()),
                   ("data", pa.large_binary()), ("plotly", pa.large_string())],
        "params": [("name", pa.string()), ("value", pa.string())],  # value: JSON text
        "gpu": [("host", pa.string()), ("index", pa.int32()), ("gpu_name", pa.string()),
                ("util", pa.float64()), ("mem_used", pa.int64()), ("mem_total", pa.int64()),
                ("temp", pa.float64()), ("power", pa.float64()), ("step", pa.int64())],
        "ranks": [("kind", pa.string()), ("step", pa.int64()), ("world_size", pa.int32()),
                  ("local_rank", pa.int32()), ("host", pa.string()), ("pid", pa.int64()),
                  ("version", pa.string()), ("status", pa.string()), ("exit_code", pa.int32()),
                  ("events", pa.int32())],
        # rows: JSON text of the list of rows (cells: str, number, bool, null; NaN as NaN)
        "tables": [("step", pa.int64()), ("name", pa.string()),
                   ("columns", pa.list_(pa.string())), ("rows", pa.large_string())],
    }.items()
}  # fmt: skip
TABLES: Final = tuple(SCHEMAS)


class _Columns:
    """Column lists for one table, filled row by row (or event by event)."""

    def __init__(self, table: str) -> None:
        self.names = SCHEMAS[table].names
        self.cols: dict[str, list[Any]] = {n: [] for n in self.names}
        self._pairs = list(self.cols.items())

    def rows(self, n: int, **values: Any) -> None:
        """Append ``n`` rows; a list value gives each row its own, a scalar is repeated."""
        for name in self.names:
            v = values.get(name)
            if isinstance(v, list) and name != "values":
                self.cols[name].extend(v)
            else:
                self.cols[name].extend([v] * n)

    def row(self, values: dict[str, Any]) -> None:
        """Append one row."""
        get = values.get
        for name, col in self._pairs:
            col.append(get(name))

    def table(self, table: str) -> pa.Table:
        schema = SCHEMAS[table]
        if table in STEP_TABLES:  # relogged is added by segment_tables
            schema = schema.remove(schema.get_field_index("relogged"))
        cols: dict[str, Any] = dict(self.cols)
        # ints -> timestamp by a cast: converting them straight to a zoned timestamp type
        # costs a one-off ~0.2 s in pyarrow (time zone machinery)
        cols["ts"] = pa.array(cols["ts"], pa.int64()).cast(_TS)
        return pa.Table.from_pydict(cols, schema=schema)

    def __len__(self) -> int:
        return len(self.cols["rank"])


def _us(ts: float) -> int:
    return round(ts * 1_000_000)


class FrameEvents(Protocol):
    """A frame as :func:`segment_tables` reads it (a :class:`~ranklog.spool.Frame` is one)."""

    @property
    def seq(self) -> int: ...

    @property
    def events(self) -> Sequence[Event | MetricsRaw | Names]: ...


@dataclass(frozen=True, slots=True)
class NamesRow:
    """A names frame (segment format 2), as the one row of the ranks table that says it was
    there: replay counts a segment's frames from its rows."""

    seq: int
    events: tuple[Names]


def names_row(frame: Frame) -> NamesRow:
    """The row of a names frame (``frame.names_ts`` set)."""
    return NamesRow(frame.seq, (Names(frame.names_ts or 0.0, -1, []),))


def segment_tables(
    run_id: str,
    seg: SegmentName,
    frames: Sequence[Frame],
    relogged_upto: int = -1,
    *,
    mark: list[int] | None = None,
    dictionary: bool = False,
) -> dict[str, pa.Table]:
    """The rows of ``frames`` (one segment's), as one Arrow table per kind (empty ones left out).

    Rows of steps up to ``relogged_upto`` (the steps an earlier incarnation of the rank had
    closed) are marked ``relogged``: training logged them again after a restart. ``mark``
    ([highest step_end, highest step of any step event]) is raised by what ``frames`` hold.
    Every table has the types of :data:`SCHEMAS`, except with ``dictionary``: the metrics
    table's strings are then dictionary-encoded, as its columns are built (compaction writes
    them so, and Parquet does not hash every string again).
    """
    rows: list[FrameEvents] = [names_row(f) if f.names_ts is not None else f for f in frames]
    tables = raw_segment_tables(run_id, seg, rows, relogged_upto, mark=mark,
                                dictionary=dictionary)  # fmt: skip
    assert tables is not None  # decoded Metrics: no map to refuse
    return tables


def raw_segment_tables(
    run_id: str,
    seg: SegmentName,
    frames: Sequence[FrameEvents],
    relogged_upto: int = -1,
    *,
    mark: list[int] | None = None,
    dictionary: bool = False,
) -> dict[str, pa.Table] | None:
    """As :func:`segment_tables`, with Metrics events that may be
    :class:`~ranklog.schemas.MetricsRaw` (read by :func:`~ranklog.schemas.decode_events_raw`):
    the same tables come out. None (and ``mark`` untouched) when one of their maps is one the
    Metrics decoder refuses: the frames are then to be decoded by
    :func:`~ranklog.schemas.decode_events`, which skips that event.
    """
    out = {t: _Columns(t) for t in TABLES if t != "metrics"}
    base = {"run_id": run_id, "rank": seg.rank, "incarnation": seg.incarnation,
            "segment": seg.segment}  # fmt: skip
    every = _Gathered.of(frames)
    group = np.fromiter(map(_GROUP.__getitem__, map(type, every.events)), np.int8,
                        len(every.events))  # fmt: skip
    metrics = _MetricColumns.part(every, group == _METRICS_GROUP)
    ends = _Gathered.part(every, group == _STEP_END_GROUP)
    rest = _Gathered.part(every, group == _BY_ROW)
    for ev, seq, idx in zip(rest.events, rest.seq.tolist(), rest.idx.tolist(), strict=True):
        key = base.copy()  # everything else, row by row
        key["seq"], key["idx"], key["ts"] = seq, idx, _us(ev.ts)
        _ADD[type(ev)](out, ev, key)
    tables = {t: c.table(t) for t, c in out.items() if len(c)}
    if metrics.events:
        found = _values(metrics.events)
        if found is None:
            return None
        built = metrics.table(run_id, seg, found)
        if built is not None:
            tables["metrics"] = built
    if mark is not None:
        _raise_mark(mark, tables, ends.events, metrics.events)
    if ends.events:
        step_ends = _step_end_table(run_id, seg, ends)
        other = tables.get("ranks")
        merged = step_ends if other is None else pa.concat_tables([other, step_ends])
        tables["ranks"] = merged.sort_by([("seq", "ascending"), ("idx", "ascending")])
    for name in STEP_TABLES:
        t = tables.get(name)
        if t is not None:
            flag = pc.less_equal(t["step"], pa.scalar(relogged_upto, pa.int64()))
            tables[name] = t.append_column("relogged", flag)
    return {
        t: tables[t] if dictionary else tables[t].cast(SCHEMAS[t]) for t in TABLES if t in tables
    }


#: each event type's group: its rows built row by row (:data:`_ADD`), or gathered into
#: columns (Metrics, StepEnd); an unknown type reads as row by row (and :data:`_ADD`
#: then refuses it, as it always did)
_BY_ROW, _METRICS_GROUP, _STEP_END_GROUP = 0, 1, 2
_GROUP: Final[defaultdict[type, int]] = defaultdict(
    int,
    {Metrics: _METRICS_GROUP, MetricsRaw: _METRICS_GROUP, MetricsPacked: _METRICS_GROUP,
     StepEnd: _STEP_END_GROUP},
)  # fmt: skip
_SEQ_OF: Final = attrgetter("seq")
_EVENTS_OF: Final = attrgetter("events")


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


def _raise_mark(
    mark: list[int],
    tables: dict[str, pa.Table],
    ends: list[StepEnd],
    metrics: list[Metrics | MetricsRaw],
) -> None:
    """Raise [highest step_end, highest step event] by one read's events."""
    if ends:
        mark[0] = max(mark[0], max([ev.step for ev in ends]))
    if metrics:  # from the events: one with no values has no row, but has its step
        mark[1] = max(mark[1], max([ev.step for ev in metrics]))
    for name in STEP_TABLES:
        t = tables.get(name)
        if t is not None and name != "metrics" and t.num_rows:
            mark[1] = max(mark[1], pc.max(t["step"]).as_py())


def _timestamps(events: list[Any], counts: Any = None) -> pa.Array:
    """Each event's ``ts`` in whole microseconds (as ``round(ts * 1e6)``: half to even),
    ``counts[i]`` times for event ``i`` when given."""
    secs = np.fromiter(map(_TS_OF, events), np.float64, len(events))
    micros = np.rint(secs * 1_000_000).astype(np.int64)
    return pa.array(micros if counts is None else np.repeat(micros, counts)).cast(_TS)


_TS_OF: Final = attrgetter("ts")
_STEP_OF: Final = attrgetter("step")
_VALUES_OF: Final = attrgetter("values")
_NAMES_OF: Final = attrgetter("names")
_PACKED_OF: Final = attrgetter("packed")
_REDUCE_OF: Final = attrgetter("reduce")


_NUMPY: Final = {pa.int32(): np.int32, pa.int64(): np.int64}


def _constant(value: Any, type_: pa.DataType, n: int) -> pa.Array:
    """``value`` ``n`` times (built by numpy, or a take: ``pa.repeat`` of an int scalar
    costs ~1 ms for 40,000 rows, this ~10 µs)."""
    kind = _NUMPY.get(type_)
    if kind is not None:
        return pa.array(np.full(n, value, kind), type_)
    return pa.array([value], type_).take(pa.array(np.zeros(n, np.int32)))


def _step_end_table(run_id: str, seg: SegmentName, ends: _Gathered) -> pa.Table:
    evs, n = ends.events, len(ends.events)
    schema = SCHEMAS["ranks"]
    cols = {
        "run_id": _constant(run_id, pa.string(), n),
        "rank": _constant(seg.rank, pa.int32(), n),
        "incarnation": _constant(seg.incarnation, pa.int32(), n),
        "segment": _constant(seg.segment, pa.int32(), n),
        "seq": pa.array(ends.seq, pa.int64()),
        "idx": pa.array(ends.idx, pa.int32()),
        "ts": _timestamps(evs),
        "kind": _constant("step_end", pa.string(), n),
        "step": pa.array(np.fromiter(map(_STEP_OF, evs), np.int64, n)),
        "events": pa.array(np.fromiter((ev.events for ev in evs), np.int32, n)),
    }
    return pa.table([cols.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema)


_DICT: Final = pa.dictionary(pa.int32(), pa.string())
#: the metrics table as :func:`segment_tables` builds it (``relogged`` is added after)
_METRICS: Final = pa.schema(
    [
        f.with_type(_DICT) if f.name in ("run_id", "name", "reduce") else f
        for f in SCHEMAS["metrics"]
        if f.name != "relogged"
    ]
)


class _MetricColumns(_Gathered):
    """The metrics table: a read's Metrics events, turned into columns at once.

    Every column is built by one C-level pass over the events (``map`` of an attribute
    getter into ``numpy.fromiter``, no Python code per event or per value) and expanded
    to one row per value with numpy; strings come out dictionary-encoded. Events read
    with their values undecoded (:class:`~ranklog.schemas.MetricsRaw`) have their maps
    read in bulk (:mod:`ranklog.archive._bulk`): no dict nor float object per value.
    """

    __slots__ = ()

    def table(
        self, run_id: str, seg: SegmentName, found: Bulk | list[dict[str, float]]
    ) -> pa.Table | None:
        """The table, or None when no event holds a value (``found``: their values)."""
        evs = self.events
        if isinstance(found, Bulk):
            counts, n = found.counts, len(found.values)
            names = pa.DictionaryArray.from_arrays(
                pa.array(found.codes), pa.array(found.names, pa.string())
            )
            values = pa.array(found.values)
        else:
            counts = np.fromiter(map(len, found), np.int64, len(evs))
            n = int(counts.sum())
            names = _names(found, n)
            values = pa.array(np.fromiter(chain.from_iterable(map(dict.values, found)),
                                          np.float64, n))  # fmt: skip
        if not n:
            return None
        zeros = pa.array(np.zeros(n, np.int32))
        return pa.table(
            [
                pa.DictionaryArray.from_arrays(zeros, pa.array([run_id], pa.string())),
                _constant(seg.rank, pa.int32(), n),
                _constant(seg.incarnation, pa.int32(), n),
                _constant(seg.segment, pa.int32(), n),
                pa.array(np.repeat(self.seq, counts)),
                pa.array(np.repeat(self.idx, counts)),
                _timestamps(evs, counts),
                pa.array(np.repeat(np.fromiter(map(_STEP_OF, evs), np.int64, len(evs)), counts)),
                names,
                values,
                _reduce(evs, found, counts, zeros),
            ],
            schema=_METRICS,
        )


def _values(
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


def _reduce(
    evs: list[Metrics | MetricsRaw | MetricsPacked],
    found: Bulk | list[dict[str, float]],
    counts: np.ndarray,
    zeros: pa.Array,
) -> pa.Array:
    """Every row's reduce spec, dictionary-encoded (``found``: the events' values,
    ``counts``: how many each holds)."""
    reds = list(map(_REDUCE_OF, evs))
    if len(set(map(type, reds))) == 1 and type(reds[0]) is str:
        if len(set(reds)) == 1:  # one spec for the whole segment: the common case
            return pa.DictionaryArray.from_arrays(zeros, pa.array(reds[:1], pa.string()))
        row_event = np.repeat(np.arange(len(evs), dtype=np.int64), counts)
        return pa.array(reds, pa.string()).dictionary_encode().take(pa.array(row_event))
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
    return pa.array(per_row, pa.string()).dictionary_encode()


def _names(values: list[dict[str, float]], n: int) -> pa.Array:
    """The name of every value of ``values`` (the events' maps), in order, dictionary-encoded.

    Events of a segment mostly log the same names: each distinct tuple of names is looked
    up once and the column is built from indices into the names (in C, not per value).
    """
    keys = list(map(tuple, values))
    names: dict[str, int] = {}
    shapes: dict[tuple[str, ...], int] = {}  # each distinct tuple of names: its place
    codes: list[np.ndarray] = []  # per distinct tuple: its names' codes
    for key in dict.fromkeys(keys):
        shapes[key] = len(codes)
        codes.append(np.array([names.setdefault(k, len(names)) for k in key], np.int32))
    if len(codes) == 1:
        indices = np.tile(codes[0], len(keys))
    else:
        which = list(map(shapes.__getitem__, keys))
        indices = np.concatenate([codes[w] for w in which]) if which else np.zeros(0, np.int32)
    assert len(indices) == n
    return pa.DictionaryArray.from_arrays(pa.array(indices), pa.array(list(names), pa.string()))


def _timer(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, value=ev.seconds, reduce=ev.reduce)
    out["timers"].row(key)


def _text(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, text=ev.text)
    out["text"].row(key)


def _histogram(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, values=ev.values)
    out["histograms"].row(key)


def _image(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, format=ev.format, data=ev.data,
               plotly=ev.plotly or None)  # fmt: skip
    out["images"].row(key)


def _table(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(step=ev.step, name=ev.name, columns=ev.columns, rows=json.dumps(ev.rows))
    out["tables"].row(key)


def _params(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    values = ev.all()  # lists of scalars too (Params.lists): a JSON array each
    vals = [json.dumps(v) for v in values.values()]
    out["params"].rows(len(values), **key, name=list(values), value=vals)


def _gpu(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
    key.update(host=ev.host, index=ev.index, gpu_name=ev.name, util=ev.util,
               mem_used=ev.mem_used, mem_total=ev.mem_total, temp=ev.temp, power=ev.power,
               step=ev.step)  # fmt: skip
    out["gpu"].row(key)


def _rank_event(kind: str) -> Callable[[dict[str, _Columns], Any, dict[str, Any]], None]:
    def add(out: dict[str, _Columns], ev: Any, key: dict[str, Any]) -> None:
        key["kind"] = kind
        if type(ev) is StepEnd:
            key["step"], key["events"] = ev.step, ev.events
        elif isinstance(ev, RankStart):
            key.update(world_size=ev.world_size, local_rank=ev.local_rank, host=ev.host,
                       pid=ev.pid, version=ev.version)  # fmt: skip
        elif isinstance(ev, RankEnd):
            key.update(status=ev.status, exit_code=ev.exit_code)
        out["ranks"].row(key)

    return add


_ADD: Final[dict[type, Callable[[dict[str, _Columns], Any, dict[str, Any]], None]]] = {
    Timer: _timer,
    Text: _text,
    Histogram: _histogram,
    Image: _image,
    Table: _table,
    Params: _params,
    Gpu: _gpu,
    RankStart: _rank_event("rank_start"),
    StepEnd: _rank_event("step_end"),
    Heartbeat: _rank_event("heartbeat"),
    RankEnd: _rank_event("rank_end"),
    Names: _rank_event("names"),  # a names frame (format 2): a row, so replay counts the frame
}
