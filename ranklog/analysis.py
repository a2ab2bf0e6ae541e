"""The most asked questions about a compacted run, as Arrow tables.

>>> from ranklog.analysis import metric_band, slowest_rank, rank_divergence
>>> metric_band("runs/exp1.parquet", "train/loss")      # step, mean, min, max, ranks
>>> slowest_rank("runs/exp1.parquet")                    # step, slowest_rank, seconds, median
>>> rank_divergence("runs/exp1.parquet", "train/loss")   # rank, mean_abs_dev, max_abs_dev
>>> shipped("runs/exp1.parquet", "train/loss")           # step, value, ranks, complete

Each rank's value at a step is the mean of what it logged at that step; the
across-rank statistics are then taken over ranks. The same queries in DuckDB
and Polars are in the README.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from ranklog.errors import ArchiveError, ConfigError

__all__ = ["metric_band", "per_rank", "rank_divergence", "shipped", "slowest_rank"]


def _table(dataset: str | os.PathLike[str], kind: str, name: str) -> pa.Table:
    from ranklog.archive import SCHEMAS, check_files, load_manifest, table_files

    check_files(Path(dataset), load_manifest(dataset))  # a damaged file: named, not a traceback
    path = Path(dataset) / kind
    files = table_files(dataset, kind)
    if not path.is_dir() or not files:
        raise ArchiveError(f"{path}: no {kind} table in this dataset")
    table = ds.dataset(files, format="parquet", schema=SCHEMAS[kind])
    out = table.to_table(columns=["step", "rank", "value"], filter=ds.field("name") == name)
    if out.num_rows == 0:
        known = pc.unique(table.to_table(columns=["name"])["name"]).to_pylist()
        raise ConfigError(_unknown(name, kind, [str(n) for n in known if n is not None]))
    return out


def _unknown(name: str, kind: str, known: list[str]) -> str:
    """Why ``name`` has no rows in the ``kind`` table, with the names it has that are close
    (a timer is ``timing/<name>`` in the backends: here it is ``<name>`` of the timers)."""
    if kind == "metrics" and name.startswith("timing/"):
        return (f"{name!r} is how backends show the timer {name[len('timing/'):]!r}: ask the "
                "timers table for it (slowest_rank(dataset, timer=...), or "
                f"per_rank(dataset, {name[len('timing/'):]!r}, kind='timers'))")  # fmt: skip
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    close += [n for n in sorted(known) if name in n and n not in close][: 5 - len(close)]
    hint = (
        f"close: {', '.join(map(repr, close))}"
        if close
        else f"{len(known)} names, e.g. " + (", ".join(map(repr, sorted(known)[:5])))
    )
    return f"no {kind} named {name!r} in this dataset ({hint})"


def per_rank(dataset: str | os.PathLike[str], name: str, *, kind: str = "metrics") -> pa.Table:
    """step, rank, value: each rank's mean of ``name`` per step."""
    t = _table(dataset, kind, name)
    out = t.group_by(["step", "rank"]).aggregate([("value", "mean")])
    return out.rename_columns(["step", "rank", "value"]).sort_by(
        [("step", "ascending"), ("rank", "ascending")]
    )


def metric_band(dataset: str | os.PathLike[str], name: str) -> pa.Table:
    """step, mean, min, max, ranks: ``name`` across ranks (the curve and its min-max band)."""
    pr = per_rank(dataset, name)
    out = pr.group_by("step").aggregate(
        [("value", "mean"), ("value", "min"), ("value", "max"), ("rank", "count")]
    )
    return out.rename_columns(["step", "mean", "min", "max", "ranks"]).sort_by("step")


def slowest_rank(dataset: str | os.PathLike[str], timer: str = "step_time") -> pa.Table:
    """step, slowest_rank, seconds, median: who held each step back, and by how much."""
    pr = per_rank(dataset, timer, kind="timers")
    stats = pr.group_by("step").aggregate([("value", "max"), ("value", "approximate_median")])
    stats = stats.rename_columns(["step", "seconds", "median"])
    joined = pr.join(stats, "step")
    slow = joined.filter(pc.equal(joined["value"], joined["seconds"]))
    first = (
        slow.group_by("step").aggregate([("rank", "min")]).rename_columns(["step", "slowest_rank"])
    )
    out = first.join(stats, "step").sort_by("step")
    return out.select(["step", "slowest_rank", "seconds", "median"])


def rank_divergence(dataset: str | os.PathLike[str], name: str) -> pa.Table:
    """rank, mean_abs_dev, max_abs_dev: how far each rank strays from the across-rank mean."""
    pr = per_rank(dataset, name)
    centre = pr.group_by("step").aggregate([("value", "mean")]).rename_columns(["step", "centre"])
    joined = pr.join(centre, "step")
    dev = pc.abs(pc.subtract(joined["value"], joined["centre"]))
    joined = joined.append_column("dev", dev)
    out = joined.group_by("rank").aggregate([("dev", "mean"), ("dev", "max")])
    out = out.rename_columns(["rank", "mean_abs_dev", "max_abs_dev"])
    return out.sort_by([("mean_abs_dev", "descending"), ("rank", "ascending")])


def shipped(dataset: str | os.PathLike[str], name: str) -> pa.Table:
    """step, value, ranks, complete: ``name`` as the dashboards got it, step by step (the
    steps table: the reduced value live shipping shipped; late values left out)."""
    from ranklog.archive import require_manifest

    require_manifest(dataset)
    path = Path(dataset) / "steps"
    files = sorted(path.glob("steps-*.parquet"))
    if not files:
        raise ArchiveError(f"{path}: no steps table in this dataset (an older release's, or "
                           f"compacted before any step was complete): `ranklog compact "
                           f"--steps {dataset}` writes it")  # fmt: skip
    table = ds.dataset(files, format="parquet")
    metric = (ds.field("kind") == "metric") & ds.field("carrier").is_null()
    out = table.to_table(columns=["step", "value", "ranks", "complete"],
                         filter=metric & (ds.field("name") == name))  # fmt: skip
    if out.num_rows == 0:
        known = pc.unique(table.to_table(columns=["name"], filter=metric)["name"]).to_pylist()
        raise ConfigError(_unknown(name, "shipped metrics", [str(n) for n in known if n]))
    return out.sort_by("step")
