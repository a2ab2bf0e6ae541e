"""Rows of a compacted dataset turned back into events, in the order a rank wrote them.

The inverse of :func:`ranklog.archive._tables.segment_tables`: the rows of one
segment (as :func:`read_rows` reads them, sorted by (incarnation, segment, seq,
idx)) become the events they came from, each keyed by where it was in the
segment. Rows of one Metrics event are contiguous and carry the same key.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ranklog.archive._tables import SCHEMAS
from ranklog.schemas import (
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    Params,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
    Text,
    Timer,
)

__all__ = ["COLUMNS", "Key", "read_rows", "segment_events"]

Key = tuple[int, int, int, int]  # incarnation, segment, seq, idx
_KEY: Final = ("incarnation", "segment", "seq", "idx")


def read_rows(
    files: list[Path] | None, table: str, columns: list[str], where: Any = None
) -> pa.Table | None:
    """The rows of ``files`` (one segment's, of ``table``), sorted in write order; None if none.

    Columns a file written by an older release lacks are read as nulls.
    """
    if not files:
        return None
    dataset = ds.dataset(files, format="parquet", schema=SCHEMAS[table])
    t = dataset.to_table(columns=[*_KEY, "ts", *columns], filter=where)
    if t.num_rows == 0:
        return None
    if not _in_key_order(t):  # compaction writes rows in key order: usually nothing to do
        t = t.sort_by([(k, "ascending") for k in _KEY])
    return t.set_column(t.schema.get_field_index("ts"), "ts", t["ts"].cast(pa.int64()))


def _in_key_order(t: pa.Table) -> bool:
    """Whether the rows are in (incarnation, segment, seq, idx) order, checked columnar."""
    if t.num_rows < 2:
        return True
    ok: Any = None  # row i <= row i+1 on the keys seen so far (from the last one)
    for k in reversed(_KEY):
        col = t[k]
        lo, hi = col.slice(0, len(col) - 1), col.slice(1)
        ok = (
            pc.less_equal(lo, hi)
            if ok is None
            else pc.or_(pc.less(lo, hi), pc.and_(pc.equal(lo, hi), ok))
        )
    return bool(pc.all(ok).as_py())


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
        words = encoded.dictionary.to_pylist()
        return [words[i] if i is not None else None for i in encoded.indices.to_pylist()]
    return list(col.to_pylist())


def _cols(t: pa.Table, *names: str) -> list[list[Any]]:
    return [_column_list(t.column(n)) for n in names]


def _metrics(
    t: pa.Table, step_ok: Any, name_ok: Any, filtered: bool, out: list[tuple[Key, Event]]
) -> None:
    """Rows back into Metrics events: rows of one event are contiguous (sorted by key)."""
    n = t.num_rows
    a = [t[k] for k in _KEY]
    change = pc.or_(
        pc.or_(pc.not_equal(a[0][1:], a[0][:-1]), pc.not_equal(a[1][1:], a[1][:-1])),
        pc.or_(pc.not_equal(a[2][1:], a[2][:-1]), pc.not_equal(a[3][1:], a[3][:-1])),
    )
    starts = [0, *(x + 1 for x in pc.indices_nonzero(change).to_pylist()), n]
    heads = t.take(pa.array(starts[:-1], pa.int64()))  # one row per event
    inc, seg, seq, idx, ts, step = _cols(heads, *_KEY, "ts", "step")
    name, value = _cols(t, "name", "value")
    single = pc.count_distinct(t["reduce"]).as_py() == 1
    red = [t["reduce"][0].as_py()] * n if single else t["reduce"].to_pylist()
    for e in range(len(starts) - 1):
        lo, hi = starts[e], starts[e + 1]
        if not step_ok(step[e]):
            continue
        names, values = name[lo:hi], value[lo:hi]
        ops = red[lo:hi]
        if filtered:
            picked = [j for j, nm in enumerate(names) if name_ok(nm)]
            if not picked:
                continue
            names = [names[j] for j in picked]
            values = [values[j] for j in picked]
            ops = [ops[j] for j in picked]
        spec: str | dict[str, str] = (
            ops[0]
            if single or ops.count(ops[0]) == len(ops)
            else dict(zip(names, ops, strict=True))
        )
        ev = Metrics(ts[e] / 1e6, step[e], dict(zip(names, values, strict=True)), spec)
        out.append(((inc[e], seg[e], seq[e], idx[e]), ev))


#: the columns each table is read with (besides the key and ts)
COLUMNS: Final[dict[str, list[str]]] = {
    "metrics": ["step", "name", "value", "reduce"],
    "timers": ["step", "name", "value", "reduce"],
    "text": ["step", "name", "text"],
    "histograms": ["step", "name", "values"],
    "images": ["step", "name", "data", "format"],
    "params": ["name", "value"],
    "gpu": ["host", "index", "util", "mem_used", "mem_total", "temp", "power", "step", "gpu_name"],
    "ranks": ["kind", "step", "world_size", "local_rank", "host", "pid", "version", "status",
              "exit_code", "events"],
}  # fmt: skip


def segment_events(
    tables: dict[str, pa.Table | None],
    rank: int,
    run_id: str,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    cutoff: int | None = None,
) -> list[tuple[Key, Event]]:
    """Events rebuilt from one rank's rows (tables as :func:`read_rows` reads them), in order.

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

    out: list[tuple[Key, Event]] = []
    t = tables.get("metrics")
    if t is not None:
        _metrics(t, step_ok, name_ok, names is not None, out)
    simple: dict[str, tuple[list[str], Any]] = {  # columns in the order of the fields
        "timers": (["step", "name", "value", "reduce"], Timer),
        "text": (["step", "name", "text"], Text),
        "histograms": (["step", "name", "values"], Histogram),
        "images": (["step", "name", "data", "format"], Image),
    }
    for table, (columns, make) in simple.items():
        t = tables.get(table)
        if t is None:
            continue
        for inc, seg, seq, idx, ts, *rest in zip(*_cols(t, *_KEY, "ts", *columns), strict=True):
            if keep(rest[0], rest[1]):
                out.append(((inc, seg, seq, idx), make(ts / 1e6, *rest)))
    t = tables.get("params")
    if t is not None:
        grouped: dict[Key, tuple[float, dict[str, ParamValue]]] = {}
        for inc, seg, seq, idx, ts, name, value in zip(
            *_cols(t, *_KEY, "ts", "name", "value"), strict=True
        ):
            grouped.setdefault((inc, seg, seq, idx), (ts / 1e6, {}))[1][name] = json.loads(value)
        out += [(k, Params(ts, values)) for k, (ts, values) in grouped.items()]
    gpu_cols = COLUMNS["gpu"]
    t = tables.get("gpu")
    if t is not None:
        for inc, seg, seq, idx, ts, host, index, util, used, total, temp, power, step, gname in zip(
            *_cols(t, *_KEY, "ts", *gpu_cols), strict=True
        ):
            gpu = Gpu(ts / 1e6, host, index, util, used, total, temp, power, step, gname or "")
            out.append(((inc, seg, seq, idx), gpu))
    rank_cols = COLUMNS["ranks"]
    t = tables.get("ranks")
    if t is not None:
        for (
            inc,
            seg,
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
        ) in zip(*_cols(t, *_KEY, "ts", *rank_cols), strict=True):
            key = (inc, seg, seq, idx)
            s = ts / 1e6
            if kind == "step_end":
                if cutoff is None or step < cutoff:
                    out.append((key, StepEnd(s, step, -1 if events is None else events)))
            elif kind == "rank_start":
                out.append(
                    (
                        key,
                        RankStart(
                            s, run_id, rank, world, local, host or "", pid or 0, inc, version or ""
                        ),
                    )
                )
            elif kind == "heartbeat":
                out.append((key, Heartbeat(s)))
            elif kind == "rank_end":
                out.append((key, RankEnd(s, status or "", code)))
    out.sort(key=lambda e: e[0])
    return out
