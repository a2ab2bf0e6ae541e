"""Whether a dataset can replay on columns, and what the engine would know of each rank.

The engine's per-event work (incarnations, late and re-logged values, lost frames,
step_end counts) decides something only when a rank's stream departs from the plain
one. :func:`plan` checks, rank by rank and on the key columns alone
(``seq``, ``idx``, ``step`` and the ranks table), that none of it applies:

- each rank has one incarnation, its segments numbered 1, 2, ... with none missing;
- its frames are numbered without a gap (the seal's number included) and its rows
  are in write order;
- every step event is for a step the rank had not closed yet (nothing late), so its
  steps never go down;
- every step_end that counts its step's events counts what the dataset holds;
- each GPU sample goes to a step its rank had not closed, its steps never going down;
- params come from one rank, or every rank that logs them logs the same ones: the
  same keys, values (as JSON text) and steps, each key once (a config logged by every
  rank at the start). Then the order the engine would read them in changes nothing;
- params apply to a step the rank had not closed, and no rank is numbered past the
  world size (the engine would not wait for it): what the engine does with those
  depends on when it reads them;
- every file has the columns read here (an older release's may not).

It then knows what the engine would end with: each rank's watermark, world size and
end, each params event's effective step and each GPU sample's step. Memory: one batch
of key columns, and one rank's event heads (a few numbers per event), at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ranklog.archive._blocks import BlockHeads, Owners
from ranklog.archive._files import GroupCache, Piece, Shared, column_names, open_file, source_rows
from ranklog.archive._manifest import Manifest
from ranklog.archive._rows import COLUMNS
from ranklog.archive._tables import SCHEMAS, TABLES
from ranklog.archive._walk import (
    GPU,
    NULL_STEP,
    PARAMS,
    STEP,
    WALK_EVENTS,
    Head,
    RankPlan,
    Walk,
    _No,
    streams,
)
from ranklog.schemas import is_meta_key
from ranklog.spool import NO_STEP, SegmentId

__all__ = [
    "ITEMS",
    "LATER",
    "READ",
    "REDUCED",
    "Plan",
    "RankPlan",
    "RowGroup",
    "check",
    "piece_rows",
    "plan",
    "scan",
]

#: tables reduced on columns (each row group is indexed by its steps)
REDUCED: Final = ("metrics", "timers")
#: tables of step events handed over one by one (texts, distributions, images, tables)
ITEMS: Final = ("text", "histograms", "images", "tables")
#: a string statistic this short is never truncated
_SHORT: Final = 64
#: tables the scan does not open and whose footers are not kept (the check reads them
#: once; the window reader does not)
_ONCE: Final = ("params", "ranks")


@dataclass(slots=True, frozen=True)
class RowGroup:
    """One row group of a metrics or timers file, with the steps it spans."""

    table: str
    rank: int
    path: Path
    index: int
    lo: int
    hi: int
    rows: int
    #: the group's size, uncompressed (a window is sized by these)
    nbytes: int
    #: the reduce spec of every row, when the statistics say there is one (None: read it)
    spec: str | None = None


Segments = list[tuple[SegmentId, dict[str, list[Piece]]]]


@dataclass(slots=True)
class Plan:
    """A dataset that replays on columns: its ranks (in rank order) and lanes.

    :func:`scan` finds the lanes (footers only); :func:`check` fills in the ranks.
    """

    ranks: list[RankPlan]
    cache: GroupCache
    #: each rank's segments and where their rows are, in write order
    segments: dict[int, Segments]
    #: the lanes of the reduced and item tables, in write order: each a block of row
    #: groups whose steps never go down (:func:`scan`)
    lanes: list[list[RowGroup]]
    #: the small tables' groups that segments share, decoded once for the check
    shared: Shared
    #: the events of each block (or file), by segment, for the check
    heads: BlockHeads

    @property
    def gpu(self) -> bool:
        """Whether the dataset holds GPU samples (their steps come from the check)."""
        return any("gpu" in tables for segs in self.segments.values() for _, tables in segs)


def plan(
    files: dict[SegmentId, dict[str, list[Piece]]], manifest: Manifest, cache: GroupCache
) -> tuple[Plan | None, str]:
    """The dataset's plan, or (None, why it needs the event path): :func:`scan`, then
    :func:`check`."""
    found, why = scan(files, cache)
    if found is not None:
        why = check(found, manifest, cache)
    return (found if not why else None), why


def scan(
    files: dict[SegmentId, dict[str, list[Piece]]], cache: GroupCache
) -> tuple[Plan | None, str]:
    """The first pass, on the files' footers: the lanes of row groups a reader reads by
    window (all it needs to start), or (None, why the dataset needs the event path).

    A lane is a block of a part (layout 2: rows of many ranks, by step), or a file of
    layout 1 (one segment's rows, in write order); lanes come in write order.
    """
    by_rank: dict[int, Segments] = {}
    for sid, tables in files.items():  # sorted: write order within a rank
        by_rank.setdefault(sid.rank, []).append((sid, tables))
    blocks: set[tuple[int, int, int, int, Path, int]] = set()
    owners: dict[tuple[Path, int, int], Owners] = {}  # each block's segments, by rank
    order = {t: i for i, t in enumerate(TABLES)}
    try:
        for rank, segs in sorted(by_rank.items()):
            _segments_ok(rank, segs)
            for sid, tables in segs:
                for table, pieces in tables.items():
                    for src in pieces:
                        owner = sid.rank if src.alone else -1
                        blocks.add((order[table], src.part, src.first, src.end, src.path, owner))
                        if not src.alone:
                            there = owners.setdefault((src.path, src.first, src.end), {})
                            had = there.setdefault(sid.rank, src.key)
                            if had != src.key:
                                there[sid.rank] = -1  # several of its segments: read them
        lanes = []
        for t, _, first, end, path, owner in sorted(blocks):  # in write order
            table = TABLES[t]
            if owner >= 0 and table in _ONCE:  # (a file of its own: opened by the check)
                continue
            pf = _open(path, table, cache, keep=owner < 0)  # (a column of a later release?)
            if table not in (*REDUCED, *ITEMS):
                continue
            meta = pf.metadata
            groups = range(first, meta.num_row_groups if end < 0 else end)
            lane = list(_groups(table, owner, path, meta, groups))
            if any(b.lo < a.hi for a, b in itertools.pairwise(lane)):
                raise _No(f"{path.name}: rows whose steps go down")
            if lane:
                lanes.append(lane)
    except _No as why:
        return None, str(why)
    ranks = [RankPlan(r, watermark=NO_STEP, ended=True, world_size=None) for r in sorted(by_rank)]
    shared = Shared(_SHARED_BYTES)
    return Plan(ranks, cache, by_rank, lanes, shared, BlockHeads(_SHARED_BYTES, owners)), ""


def _segments_ok(rank: int, segs: Segments) -> None:
    """One incarnation, its segments numbered 1, 2, ..., no table of a later release."""
    if len({sid.incarnation for sid, _ in segs}) > 1:
        raise _No(f"rank {rank} has several incarnations")
    if [sid.segment for sid, _ in segs] != list(range(1, len(segs) + 1)):
        raise _No(f"rank {rank}: a segment is missing")
    for sid, tables in segs:
        unknown = set(tables) - set(TABLES)
        if unknown:
            raise _No(f"{sid.stem} holds {', '.join(sorted(unknown))}")


#: decoded groups of part files the check keeps (GPU samples and params, split by segment;
#: the events of the other tables are read by :class:`BlockHeads`), and those events
_SHARED_BYTES: Final = 64 * 1024 * 1024


def check(found: Plan, manifest: Manifest, cache: GroupCache) -> str:
    """The second pass, on the key columns: what the engine would end with, filled into
    ``found``; '' when the dataset replays on columns, else why not."""
    try:
        batch: list[Walk] = []
        size = 0
        for rp in found.ranks:
            try:
                walk = _check_rank(rp, found.segments[rp.rank], manifest, cache, found.shared,
                                   found.heads)  # fmt: skip
            except _No:
                streams(batch)  # a rank before it may have failed first
                raise
            batch.append(walk)
            size += sum(len(h[0]) for h in walk[1])
            if size >= WALK_EVENTS:
                streams(batch)
                batch, size = [], 0
        streams(batch)
        if found.heads.unsorted is not None:  # (late values go first: they say more)
            raise _No(f"{found.heads.unsorted}: rows whose steps go down")
        ranks = found.ranks
        _one_config(ranks)
        sizes = [rp.world_size for rp in ranks if rp.world_size is not None]
        if manifest.world_size is not None:
            sizes.append(manifest.world_size)
        if sizes and ranks and ranks[-1].rank >= max(sizes):
            # not waited for by the engine: what it reads late of them depends on timing
            raise _No(f"rank {ranks[-1].rank} is outside the world size {max(sizes)}")
    except _No as why:
        return str(why)
    return ""


def _split_said(said: list[Any]) -> tuple[list[Any], bool]:
    """(a rank's params events without their run records, whether it logged any record)."""
    out, records = [], False
    for effective, items in said:
        kept = tuple((k, v) for k, v in items if not is_meta_key(k))
        records = records or len(kept) < len(items)
        if kept:
            out.append((effective, kept))
    return out, records


def _one_config(ranks: list[RankPlan]) -> None:
    """Params from several ranks: only the same ones everywhere, each key once, and run
    records (``@`` keys: the code, definitions, summary values) from the first of them
    only; then that rank's stand for all (the others change nothing, whatever the read
    order)."""
    logging = [rp for rp in ranks if rp.said]
    if len(logging) < 2:
        return
    first, _ = _split_said(logging[0].said)
    for rp in logging[1:]:
        theirs, records = _split_said(rp.said)
        if theirs != first:
            raise _No(f"params differ across {len(logging)} ranks")
        if records:
            raise _No(f"run records logged by rank {rp.rank}, besides rank {logging[0].rank}")
    keys = [k for _, items in first for k, _ in items]
    if len(keys) != len(set(keys)):
        raise _No(f"params logged again, by {len(logging)} ranks")
    for rp in logging[1:]:
        rp.params = []


def _check_rank(
    rp: RankPlan,
    segs: Segments,
    manifest: Manifest,
    cache: GroupCache,
    shared: Shared,
    blocks: BlockHeads,
) -> Walk:
    """One rank's checks of its own, and its events' heads (the walk, for
    :func:`~ranklog.archive._walk.streams`); its world size, status and GPU samples filled
    into ``rp``."""
    heads: list[Head] = []
    params: dict[tuple[int, int], list[tuple[str, str]]] = {}
    segments: list[tuple[str, int]] = []  # (stem, the seal's next frame number, 0: none)
    ended_last = False
    world: int | None = None
    status: str | None = None
    last: dict[str, tuple[int, int] | None] = {}  # per table: the last event read
    for n, (sid, tables) in enumerate(segs):
        for table in (*REDUCED, *ITEMS, "gpu"):
            for src in tables.get(table, []):
                if table != "gpu":
                    seq, idx, step = blocks.heads(src, cache.footer(src.path))  # in order
                    last[table] = _after(seq, idx, src.path, last.get(table))
                else:
                    t = piece_rows(src, table, shared)
                    seq, idx, step, last[table] = _heads_of(t, src.path, last.get(table))
                    rp.gpu_pieces.append((src, t.num_rows))
                heads.append((seq, idx, step, GPU if table == "gpu" else STEP, None, n))
        for src in tables.get("params", []):
            t = piece_rows(src, "params", shared).select(["seq", "idx", "name", "value"])
            seq, idx, _, last["params"] = _heads_of(t, src.path, last.get("params"))
            for q, i, name, value in zip(*(t[c].to_pylist() for c in t.column_names), strict=True):
                params.setdefault((q, i), []).append((name, value))
            heads.append((seq, idx, np.full(len(seq), NO_STEP), PARAMS, None, n))
        for src in tables.get("ranks", []):
            footer = cache.known(src.path)  # (a part's: kept by the scan)
            if footer is None:  # a file of its own, read once: its footer not kept
                footer = _open(src.path, "ranks", cache).metadata
            got = blocks.ranks(src, footer)  # (in order)
            heads.append((*got[:5], n))
            for k, w, st in got[5]:  # the rows other than step_ends (a few), in order
                if k == "rank_start":
                    world = w
                elif k == "rank_end":
                    status = st or ""
                    ended_last = n == len(segs) - 1
        entry = manifest.segments.get(sid.stem)
        sealed = entry is not None and entry.sealed and entry.next_seq > 0
        segments.append((sid.stem, entry.next_seq if entry is not None and sealed else 0))
    rp.world_size = world
    rp.status = status if ended_last and status is not None else "unknown"
    rp.ended = rp.status != "signal"
    return rp, heads, params, segs[0][0].key, segments


#: the columns the columnar path reads of each table, besides seq and idx (as
#: :data:`~ranklog.archive._rows.COLUMNS` names them, with ts)
READ: Final = {
    **{t: ["ts", *COLUMNS[t]] for t in (*REDUCED, *ITEMS, "gpu")},
    "params": ["name", "value"],
    "ranks": ["kind", "step", "events", "world_size", "status"],
}


#: columns added by a later release, read as nulls from a file without them (as the event
#: path reads them): such a file stays on the columnar path
LATER: Final[dict[str, set[str]]] = {"images": {"plotly"}}


def _open(path: Path, table: str, cache: GroupCache, *, keep: bool = False) -> pq.ParquetFile:
    """``path`` opened; a file an older release wrote, without a column read here, is
    left to the event path (which reads absent columns as nulls).

    The footers of the files a replay reads by window are kept (the reader needs them
    again), and those of part files (``keep``: every rank's check reads them); those of
    a layout-1 file of params or ranks are not (the check reads it once)."""
    known = cache.known(path)
    pf = open_file(path, known)
    if known is None and (keep or table not in _ONCE):  # parsed by this open: kept
        cache.footer(path, pf.metadata)
    names = set(pf.schema_arrow.names)
    missing = [c for c in ("seq", "idx", *READ[table]) if c not in names | LATER.get(table, set())]
    if missing:
        raise _No(f"{path.name} has no {', '.join(missing)} (an older release wrote it)")
    return pf


def piece_rows(piece: Piece, table: str, shared: Shared | None) -> pa.Table:
    """A piece's rows of its segment, in write order."""
    t = source_rows(piece, table, list(SCHEMAS[table].names), shared)
    # sorted by step in the part: back in write order (stable: an event's rows stay)
    return t.sort_by([("seq", "ascending"), ("idx", "ascending")])


def _heads_of(
    t: pa.Table, path: Path, last: tuple[int, int] | None
) -> tuple[Any, Any, Any, tuple[int, int] | None]:
    """(seq, idx, step) of each event of ``t`` (rows in write order; rows of one event
    share seq and idx), after ``last``, the last event of the pieces before; and the new
    last. A null step (a GPU sample's, a table without steps) reads as ``NULL_STEP``."""
    seq, idx = t["seq"].to_numpy(), t["idx"].to_numpy()
    if "step" in t.column_names:
        step = t["step"].fill_null(NULL_STEP).to_numpy()
    else:
        step = np.full(len(seq), NULL_STEP, np.int64)
    new = np.ones(len(seq), bool)
    new[1:] = (seq[1:] != seq[:-1]) | (idx[1:] != idx[:-1])
    if len(seq) and (int(seq[0]), int(idx[0])) == last:
        new[0] = False
    return seq[new], idx[new], step[new], _after(seq, idx, path, last)


def _after(seq: Any, idx: Any, path: Path, last: tuple[int, int] | None) -> tuple[int, int] | None:
    """The last event of rows in write order (``seq``, ``idx``) that follow ``last``, the
    last of the rows before; else the event path (which sorts)."""
    if not len(seq):
        return last
    if last is not None and (int(seq[0]), int(idx[0])) < last:
        raise _No(f"{path.name}: rows out of order")
    return int(seq[-1]), int(idx[-1])


def _groups(
    table: str, rank: int, path: Path, meta: Any, groups: range | None = None
) -> Iterable[RowGroup]:
    """The file's row groups (or ``groups`` of them) with the steps they span (from the
    footer's statistics)."""
    names = column_names(meta)
    col, name = names.index("step"), names.index("name")
    red = names.index("reduce") if table in REDUCED else None
    for i in range(meta.num_row_groups) if groups is None else groups:
        group = meta.row_group(i)
        if group.num_rows == 0:
            continue
        stats = group.column(col).statistics
        if stats is None or not stats.has_min_max or stats.null_count:
            raise _No(f"{path.name}: no step statistics")
        named = group.column(name).statistics
        if named is None or named.null_count != 0:
            raise _No(f"{path.name}: names without statistics")
        one = None
        if red is not None:
            specs = group.column(red).statistics
            if specs is None or specs.null_count != 0:
                raise _No(f"{path.name}: reduce specs without statistics")
            if specs.has_min_max and specs.min == specs.max and len(specs.min) < _SHORT:
                one = specs.min
        yield RowGroup(table, rank, path, i, int(stats.min), int(stats.max), group.num_rows,
                       group.total_byte_size, one)  # fmt: skip
