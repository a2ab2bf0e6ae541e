"""Replay: a compacted Parquet dataset shipped again, through the same engine as live.

The dataset's rows are turned back into each rank's events, in the order they
were written (rank, incarnation, segment, frame, index), and written to a
scratch spool with the original run id; the ordinary shipper then ships that
spool with ``--once``. Same events, same order, same reduction and
completeness rules: the result is what live shipping gave. Every rank is
treated as ended (an incarnation that never wrote ``rank_end`` gets one, with
status ``unknown``), so nothing waits for a rank that will never write again.

Timestamps are those of the dataset, rounded to the microsecond.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

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
    encode_event,
)
from ranklog.spool._format import msgpack_array_header
from ranklog.spool._layout import RunInfo, SpoolLayout, write_run
from ranklog.spool._writer import IncarnationWriter
from ranklog.spool.parquet import TABLES, load_manifest

__all__ = ["rebuild_spool", "replay"]

_STEP_TABLES = ("metrics", "timers", "text", "histograms", "images")
Key = tuple[int, int, int, int]  # incarnation, segment, seq, idx


def _table(dataset: Path, name: str, rank: int) -> pa.Table | None:
    path = dataset / name
    if not path.is_dir() or not any(path.glob("*.parquet")):
        return None
    return ds.dataset(path, format="parquet").to_table(filter=ds.field("rank") == rank)


def _ranks(dataset: Path) -> list[int]:
    found: set[int] = set()
    for name in TABLES:
        path = dataset / name
        if path.is_dir() and any(path.glob("*.parquet")):
            col = ds.dataset(path, format="parquet").to_table(columns=["rank"]).column("rank")
            found.update(col.unique().to_pylist())
    return sorted(found)


def _rows(table: pa.Table | None, *cols: str) -> Iterator[tuple[Any, ...]]:
    if table is None or table.num_rows == 0:
        return iter(())
    lists = [table.column(c).to_pylist() for c in cols]
    return zip(*lists, strict=True)


_KEY = ("incarnation", "segment", "seq", "idx", "ts")


def rank_events(
    dataset: Path,
    rank: int,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
) -> dict[int, list[tuple[Key, Event]]]:
    """One rank's events per incarnation, in write order, rebuilt from the dataset."""
    out: dict[Key, Event] = {}

    def keep(step: int, name: str) -> bool:
        if steps is not None:
            lo, hi = steps
            if (lo is not None and step < lo) or (hi is not None and step >= hi):
                return False
        return names is None or fnmatch.fnmatchcase(name, names)

    metrics: dict[Key, tuple[float, int, dict[str, float], dict[str, str]]] = {}
    for inc, seg, seq, idx, ts, step, name, value, red in _rows(
        _table(dataset, "metrics", rank), *_KEY, "step", "name", "value", "reduce"
    ):
        if keep(step, name):
            entry = metrics.setdefault((inc, seg, seq, idx), (_s(ts), step, {}, {}))
            entry[2][name] = value
            entry[3][name] = red
    for key, (ts, step, values, reds) in metrics.items():
        ops = set(reds.values())
        out[key] = Metrics(ts, step, values, ops.pop() if len(ops) == 1 else reds)
    for *k, ts, step, name, value, red in _rows(
        _table(dataset, "timers", rank), *_KEY, "step", "name", "value", "reduce"
    ):
        if keep(step, name):
            out[tuple(k)] = Timer(_s(ts), step, name, value, red)
    for *k, ts, step, name, text in _rows(
        _table(dataset, "text", rank), *_KEY, "step", "name", "text"
    ):
        if keep(step, name):
            out[tuple(k)] = Text(_s(ts), step, name, text)
    for *k, ts, step, name, values in _rows(
        _table(dataset, "histograms", rank), *_KEY, "step", "name", "values"
    ):
        if keep(step, name):
            out[tuple(k)] = Histogram(_s(ts), step, name, values)
    for *k, ts, step, name, fmt, data in _rows(
        _table(dataset, "images", rank), *_KEY, "step", "name", "format", "data"
    ):
        if keep(step, name):
            out[tuple(k)] = Image(_s(ts), step, name, data, fmt)
    params: dict[Key, tuple[float, dict[str, ParamValue]]] = {}
    for *k, ts, name, value in _rows(_table(dataset, "params", rank), *_KEY, "name", "value"):
        fresh: dict[str, ParamValue] = {}
        params.setdefault(tuple(k), (_s(ts), fresh))[1][name] = json.loads(value)
    for pk, (pts, pvalues) in params.items():
        out[pk] = Params(pts, pvalues)
    gpu_cols = (
        "host",
        "index",
        "util",
        "mem_used",
        "mem_total",
        "temp",
        "power",
        "step",
        "gpu_name",
    )
    for *k, ts, host, index, util, used, total, temp, power, step, gname in _rows(
        _table(dataset, "gpu", rank), *_KEY, *gpu_cols
    ):
        out[tuple(k)] = Gpu(_s(ts), host, index, util, used, total, temp, power, step, gname or "")
    run_id = load_manifest(dataset).run_id
    rank_cols = ("kind", "step", "world_size", "local_rank", "host", "pid", "version", "status",
                 "exit_code")  # fmt: skip
    for *k, ts, kind, step, world, local, host, pid, version, status, code in _rows(
        _table(dataset, "ranks", rank), *_KEY, *rank_cols
    ):
        rk: Key = tuple(k)
        if kind == "rank_start":
            out[rk] = RankStart(_s(ts), run_id, rank, world, local, host or "", pid or 0, rk[0],
                                 version or "")  # fmt: skip
        elif kind == "step_end":
            out[rk] = StepEnd(_s(ts), step)
        elif kind == "heartbeat":
            out[rk] = Heartbeat(_s(ts))
        elif kind == "rank_end":
            out[rk] = RankEnd(_s(ts), status or "", code)
    by_inc: dict[int, list[tuple[Key, Event]]] = defaultdict(list)
    for key in sorted(out):
        by_inc[key[0]].append((key, out[key]))
    return dict(by_inc)


def _s(ts: Any) -> float:
    """A timestamp column value (datetime) as Unix seconds."""
    return float(ts.timestamp())


def rebuild_spool(
    dataset: str | os.PathLike[str],
    spool: str | os.PathLike[str],
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
) -> RunInfo:
    """Write the dataset's events into a fresh spool (every rank ended)."""
    dataset, spool = Path(dataset), Path(spool)
    manifest = load_manifest(dataset)
    if not manifest.run_id:
        raise ValueError(f"{dataset} is not a ranklog dataset (no {dataset / '_manifest.json'})")
    info = RunInfo(manifest.run_id, manifest.created, manifest.name, manifest.world_size)
    write_run(spool, info)
    layout = SpoolLayout(spool)
    for rank in _ranks(dataset):
        incs = rank_events(dataset, rank, steps=steps, names=names)
        for n, inc in enumerate(sorted(incs)):
            events = incs[inc]
            if n == len(incs) - 1 and not isinstance(events[-1][1], RankEnd):
                last = events[-1][0]
                events.append(
                    ((inc, last[1], last[2] + 1, 0), RankEnd(events[-1][1].ts, "unknown", None))
                )
            _write_incarnation(layout, info, rank, events)
    return info


def _write_incarnation(
    layout: SpoolLayout, info: RunInfo, rank: int, events: list[tuple[Key, Event]]
) -> None:
    writer = IncarnationWriter.create(layout, info, rank, world_size=info.world_size)
    frame: list[bytes] = []
    current: tuple[int, int] | None = None
    for key, ev in events:
        if current is not None and key[1:3] != current and frame:
            writer.write_events(len(frame), [msgpack_array_header(len(frame)), b"".join(frame)])
            frame = []
        current = key[1:3]
        frame.append(encode_event(ev))
    if frame:
        writer.write_events(len(frame), [msgpack_array_header(len(frame)), b"".join(frame)])
    writer.close(sync=False)


def replay(
    dataset: str | os.PathLike[str],
    target: Any,
    *,
    steps: tuple[int | None, int | None] | None = None,
    names: str | None = None,
    per_rank: bool = False,
    scratch: str | os.PathLike[str] | None = None,
) -> int:
    """Ship a dataset into ``target`` (a Target object) as live shipping would have."""
    from ranklog.shippers import Shipper

    tmp = Path(tempfile.mkdtemp(prefix="ranklog-replay-", dir=scratch))
    try:
        spool = tmp / "spool"
        rebuild_spool(dataset, spool, steps=steps, names=names)
        shipper = Shipper(str(spool), target, name="replay", start_grace=0, per_rank=per_rank)
        return shipper.run_forever(once=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
