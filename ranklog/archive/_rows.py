"""Rows of a compacted dataset turned back into events, in the order a rank wrote them.

The inverse of :func:`ranklog.archive._block.segment_tables`: the rows of one
segment, sorted by (incarnation, segment, seq, idx), become the events they came
from, grouped by the frame (``seq``) that held them. Rows of one Metrics event are
contiguous and carry the same key. Where the rows are, and how they are read, is
:mod:`ranklog.archive._files`.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ranklog.archive._files import KEY
from ranklog.schemas import (
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
    Table,
    Text,
    Timer,
    params_event,
)

__all__ = ["COLUMNS", "frame_events"]

Slot = tuple[int, Event]  # an event and its index in its frame


def _column_list(col: Any) -> list[Any]:
    """A column as a Python list: numbers through numpy (quicker), strings deduplicated.

    Repeated strings (metric names) become one ``str`` object each, shared by every row:
    fewer objects, and the engine's dict lookups on them are pointer compares.
    """
    if (
        col.null_count == 0
        and pa.types.is_primitive(col.type)
        and not pa.types.is_boolean(col.type)
    ):
        return list(col.to_numpy().tolist())
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        encoded = pc.dictionary_encode(col).combine_chunks()
        words = np.array([*encoded.dictionary.to_pylist(), None], dtype=object)
        codes = encoded.indices.fill_null(len(words) - 1).to_numpy()
        return list(words[codes].tolist())
    return list(col.to_pylist())


def _image(ts: float, step: int, name: str, data: bytes, fmt: str, plotly: str | None) -> Image:
    return Image(ts, step, name, data, fmt, plotly or "")  # plotly: null in an older dataset


def _cols(t: pa.Table, *names: str) -> list[list[Any]]:
    return [_column_list(t.column(n)) for n in names]


def _starts(t: pa.Table) -> Any:
    """Row numbers where a new event starts (its key differs from the row before), plus n."""
    n = t.num_rows
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for k in KEY:
        col = t[k].to_numpy()
        change |= col[1:] != col[:-1]
    return np.concatenate(([0], np.flatnonzero(change) + 1, [n]))


def _metrics(
    t: pa.Table, step_ok: Any, name_ok: Any, filtered: bool, out: dict[int, list[Slot]]
) -> None:
    """Rows back into Metrics events: rows of one event are contiguous (sorted by key)."""
    starts = _starts(t)
    bounds = starts.tolist()
    heads = t.take(pa.array(starts[:-1]))  # one row per event
    seq, idx, ts, step = _cols(heads, "seq", "idx", "ts", "step")
    name, value = _cols(t, "name", "value")
    single = pc.count_distinct(t["reduce"]).as_py() == 1
    red = [] if single else _column_list(t["reduce"])
    op = t["reduce"][0].as_py() if single else ""
    spec: str | dict[str, str]
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        s = step[e]
        if step_ok is not None and not step_ok(s):
            continue
        names, values = name[lo:hi], value[lo:hi]
        ops = None if single else red[lo:hi]
        if filtered:
            picked = [j for j, nm in enumerate(names) if name_ok(nm)]
            if not picked:
                continue
            names = [names[j] for j in picked]
            values = [values[j] for j in picked]
            ops = None if ops is None else [ops[j] for j in picked]
        if ops is None:
            spec = op
        else:
            spec = ops[0] if ops.count(ops[0]) == len(ops) else dict(zip(names, ops, strict=True))
        ev = Metrics(ts[e] / 1e6, s, dict(zip(names, values, strict=True)), spec)
        q = seq[e]
        slots = out.get(q)
        if slots is None:
            out[q] = [(idx[e], ev)]
        else:
            slots.append((idx[e], ev))


#: the columns each table is read with (besides the key and ts)
COLUMNS: Final[dict[str, list[str]]] = {
    "metrics": ["step", "name", "value", "reduce"],
    "timers": ["step", "name", "value", "reduce"],
    "text": ["step", "name", "text"],
    "histograms": ["step", "name", "values"],
    "images": ["step", "name", "data", "format", "plotly"],
    "tables": ["step", "name", "columns", "rows"],
    "params": ["name", "value"],
    "gpu": ["host", "index", "util", "mem_used", "mem_total", "temp", "power", "step", "gpu_name"],
    "ranks": ["kind", "step", "world_size", "local_rank", "host", "pid", "version", "status",
              "exit_code", "events"],
}  # fmt: skip


def frame_events(
    tables: dict[str, pa.Table | None],
    rank: int,
    run_id: str,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    cutoff: int | None = None,
) -> dict[int, list[Event]]:
    """Events rebuilt from one segment's rows (tables as
    :func:`~ranklog.archive._files.read_rows` reads them).

    Returns each frame's events (by the frame's ``seq``) in the order they were written.
    With ``cutoff``, step events and step_ends at or after it are left out (the part of an
    incarnation that a later one, resumed from a checkpoint, logged again).
    """

    def step_ok(step: int) -> bool:
        if cutoff is not None and step >= cutoff:
            return False
        if steps is None:
            return True
        lo, hi = steps
        return (lo is None or step >= lo) and (hi is None or step < hi)

    def name_ok(name: str) -> bool:
        return names is None or fnmatch.fnmatchcase(name, names)

    def keep(step: int, name: str) -> bool:
        return step_ok(step) and name_ok(name)

    out: dict[int, list[Slot]] = {}

    def put(seq: int, idx: int, ev: Event) -> None:
        slots = out.get(seq)
        if slots is None:
            out[seq] = [(idx, ev)]
        else:
            slots.append((idx, ev))

    t = tables.get("metrics")
    if t is not None:
        check = step_ok if cutoff is not None or steps is not None else None
        _metrics(t, check, name_ok, names is not None, out)
    simple: dict[str, tuple[list[str], Any]] = {  # columns in the order of the fields
        "timers": (["step", "name", "value", "reduce"], Timer),
        "text": (["step", "name", "text"], Text),
        "histograms": (["step", "name", "values"], Histogram),
        "images": (["step", "name", "data", "format", "plotly"], _image),
    }
    for table, (columns, make) in simple.items():
        t = tables.get(table)
        if t is None:
            continue
        for seq, idx, ts, *rest in zip(*_cols(t, "seq", "idx", "ts", *columns), strict=True):
            if keep(rest[0], rest[1]):
                put(seq, idx, make(ts / 1e6, *rest))
    t = tables.get("tables")
    if t is not None:
        for seq, idx, ts, step, name, columns, rows in zip(
            *_cols(t, "seq", "idx", "ts", *COLUMNS["tables"]), strict=True
        ):
            if keep(step, name):
                put(seq, idx, Table(ts / 1e6, step, name, list(columns), json.loads(rows)))
    t = tables.get("params")
    if t is not None:
        grouped: dict[tuple[int, int], tuple[float, dict[str, ParamValue]]] = {}
        for seq, idx, ts, name, value in zip(
            *_cols(t, "seq", "idx", "ts", "name", "value"), strict=True
        ):
            grouped.setdefault((seq, idx), (ts / 1e6, {}))[1][name] = json.loads(value)
        for (seq, idx), (ts, values) in grouped.items():
            put(seq, idx, params_event(ts, values))
    gpu_cols = COLUMNS["gpu"]
    t = tables.get("gpu")
    if t is not None:
        for seq, idx, ts, host, index, util, used, total, temp, power, step, gname in zip(
            *_cols(t, "seq", "idx", "ts", *gpu_cols), strict=True
        ):
            put(seq, idx, Gpu(ts / 1e6, host, index, util, used, total, temp, power, step,
                              gname or ""))  # fmt: skip
    t = tables.get("ranks")
    if t is not None:
        _ranks(t, rank, run_id, cutoff, put)
    return {seq: _in_order(slots) for seq, slots in out.items()}


def _in_order(slots: list[Slot]) -> list[Event]:
    """A frame's events by their index in the frame (tables were read one after another)."""
    if len(slots) > 1:
        slots.sort(key=_first)
    return [ev for _, ev in slots]


def _first(slot: Slot) -> int:
    return slot[0]


def _ranks(t: pa.Table, rank: int, run_id: str, cutoff: int | None, put: Any) -> None:
    """Rows of the ranks table back into step_end, rank_start, heartbeat, rank_end events."""
    rank_cols = COLUMNS["ranks"]
    for (
        inc,
        seq,
        idx,
        ts,
        kind,
        step,
        world,
        local,
        host,
        pid,
        version,
        status,
        code,
        events,
    ) in zip(*_cols(t, "incarnation", "seq", "idx", "ts", *rank_cols), strict=True):
        s = ts / 1e6
        if kind == "step_end":
            if cutoff is None or step < cutoff:
                put(seq, idx, StepEnd(s, step, -1 if events is None else events))
        elif kind == "rank_start":
            put(seq, idx, RankStart(s, run_id, rank, world, local, host or "", pid or 0, inc,
                                    version or ""))  # fmt: skip
        elif kind == "heartbeat":
            put(seq, idx, Heartbeat(s))
        elif kind == "rank_end":
            put(seq, idx, RankEnd(s, status or "", code))
