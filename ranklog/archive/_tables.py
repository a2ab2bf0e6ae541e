"""The dataset's tables: one long-format Arrow schema per event kind, and events turned into rows.

Every table has the columns of :data:`COMMON` (run_id, rank, incarnation, segment,
seq, idx, ts) and its own (see :data:`SCHEMAS`); rows of one event share
(rank, incarnation, segment, seq, idx), which orders every rank's events as written.
The step tables (:data:`STEP_TABLES`) end with ``relogged``: true for a step an
earlier incarnation of the rank had already closed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import pyarrow as pa

from ranklog.schemas import (
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    MetricsRaw,
    Names,
    Params,
    RankEnd,
    RankStart,
    StepEnd,
    Table,
    Text,
    Timer,
)
from ranklog.spool import Frame

__all__ = [
    "COMMON",
    "SCHEMAS",
    "STEP_TABLES",
    "TABLES",
    "FrameEvents",
    "names_row",
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
        if table in STEP_TABLES:  # relogged is added by the Block
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
    """A frame as :class:`~ranklog.archive._block.Block` reads it (a
    :class:`~ranklog.spool.Frame` is one)."""

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
