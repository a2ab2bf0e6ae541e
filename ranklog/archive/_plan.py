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
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ranklog.archive._blocks import END, OTHER, BlockHeads, Owners
from ranklog.archive._files import GroupCache, Piece, Shared, column_names, open_file, source_rows
from ranklog.archive._manifest import Manifest
from ranklog.archive._rows import COLUMNS
from ranklog.archive._tables import SCHEMAS, TABLES
from ranklog.schemas import ParamValue, is_meta_key
from ranklog.shippers._ranks import ParamsRead
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
#: a GPU sample's step when it has none (the step its rank is in)
_NULL: Final = -(2**62)
#: a string statistic this short is never truncated
_SHORT: Final = 64
#: tables the scan does not open and whose footers are not kept (the check reads them
#: once; the window reader does not)
_ONCE: Final = ("params", "ranks")
# event codes in a rank's stream
_STEP, _END, _PARAMS, _OTHER, _GPU = 0, END, 2, OTHER, 4


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


@dataclass(slots=True)
class RankPlan:
    """What the engine would end with for one rank."""

    rank: int
    watermark: int
    ended: bool
    world_size: int | None
    #: the status of its last rank_end (``unknown``: none, as the event path's stand-in)
    status: str = "unknown"
    params: list[ParamsRead] = field(default_factory=list)
    #: the params events as (effective step, ((key, value as JSON text), ...)), in order
    said: list[tuple[int, tuple[tuple[str, str], ...]]] = field(default_factory=list)
    #: where the rank's GPU samples are (in write order) and how many each piece holds,
    #: and each sample's step (from the check)
    gpu_pieces: list[tuple[Piece, int]] = field(default_factory=list)
    gpu_steps: Any = None


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


class _No(Exception):
    """The dataset needs the event path; the message says why."""


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
        batch: list[_Walk] = []
        size = 0
        for rp in found.ranks:
            try:
                walk = _check_rank(rp, found.segments[rp.rank], manifest, cache, found.shared,
                                   found.heads)  # fmt: skip
            except _No:
                _streams(batch)  # a rank before it may have failed first
                raise
            batch.append(walk)
            size += sum(len(h[0]) for h in walk[1])
            if size >= _WALK_EVENTS:
                _streams(batch)
                batch, size = [], 0
        _streams(batch)
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
) -> _Walk:
    """One rank's checks of its own, and its events' heads (the walk, for
    :func:`_streams`); its world size, status and GPU samples filled into ``rp``."""
    heads: list[_Head] = []
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
                heads.append((seq, idx, step, _GPU if table == "gpu" else _STEP, None, n))
        for src in tables.get("params", []):
            t = piece_rows(src, "params", shared).select(["seq", "idx", "name", "value"])
            seq, idx, _, last["params"] = _heads_of(t, src.path, last.get("params"))
            for q, i, name, value in zip(*(t[c].to_pylist() for c in t.column_names), strict=True):
                params.setdefault((q, i), []).append((name, value))
            heads.append((seq, idx, np.full(len(seq), NO_STEP), _PARAMS, None, n))
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


#: one table's events of one piece: (seq, idx, step, code (one for all, or one each),
#: the events each step_end counts (None: none counts), the segment's place in its rank)
_Head = tuple[Any, Any, Any, Any, Any, int]
#: one rank to walk: its plan, its events' heads per table and file, its params (by
#: (seq, idx)), where they were read (for the params' source), and its segments (stem,
#: and the frame number after its seal, 0: not sealed)
_Walk = tuple[
    RankPlan, list[_Head], dict[tuple[int, int], list[tuple[str, str]]], str, list[tuple[str, int]]
]
#: events walked at once (ranks are walked together, as one set of arrays, up to this many)
_WALK_EVENTS: Final = 1 << 20


def _streams(batch: list[_Walk]) -> None:
    """Walk ranks' events in write order, as the engine's watermarks would: every rank of
    ``batch`` at once, its rows sorted by (rank, seq, idx) and each running maximum kept
    within its rank (an offset per rank). The first rank (in order) that departs from
    the plain stream is named, with the first of its departures; a rank whose frames are
    not numbered on without a gap (:func:`_frames`) is named by that first."""
    heads = [h for w in batch for h in w[1]]
    lengths = [len(h[0]) for h in heads]
    who = np.repeat(np.arange(len(batch)), [sum(len(h[0]) for h in w[1]) for w in batch])
    if not heads or not who.size:
        frames = _frames(batch, who, np.zeros(0, np.int64), np.zeros(0, np.int64))
        if frames is not None:
            raise _No(frames[3])
        return
    seq, idx, step = (np.concatenate([h[i] for h in heads]) for i in range(3))
    code = np.repeat([h[3] if type(h[3]) is int else 0 for h in heads], lengths).astype(np.int8)
    counted = np.full(len(seq), -1, np.int64)
    at = 0
    for h, n in zip(heads, lengths, strict=True):  # (one a segment: its ranks table)
        if type(h[3]) is not int:
            code[at : at + n] = h[3]
        if h[4] is not None:
            counted[at : at + n] = h[4]
        at += n
    frames = _frames(batch, who, np.repeat([h[5] for h in heads], lengths), seq)
    order = np.lexsort((idx, seq, who))
    who, seq, idx = who[order], seq[order], idx[order]
    step, code, counted = step[order], code[order], counted[order]
    first = np.ones(len(who), bool)  # each rank's first event
    first[1:] = who[1:] != who[:-1]
    ends = np.flatnonzero(np.append(first[1:], True))  # each rank's last event
    is_end, is_step = code == _END, code == _STEP
    marked = np.where(is_end | is_step, step, NO_STEP)
    span = int(marked.max()) - NO_STEP + 1  # a rank's running maxima stay below the next's
    if span * len(batch) >= 2**62:  # (steps too far apart to offset: one rank at a time)
        for w in batch:
            _streams([w])
        return
    offset = who.astype(np.int64) * span

    def running(values: Any) -> Any:  # the running maximum within each rank
        return np.maximum.accumulate(values + offset) - offset

    def before(values: Any) -> Any:  # the value at the event before, within its rank
        out = np.empty_like(values)
        out[1:] = values[:-1]
        out[first] = NO_STEP
        return out

    closed = running(np.where(is_end, step, NO_STEP))
    top = running(np.where(is_step, step, NO_STEP))
    before_closed, before_top = before(closed), before(top)
    own = np.where(before_closed != NO_STEP, before_closed, before_top - 1)  # the watermark
    #: (rank's place, check's place, event's place, why): the first of them is named
    failed: list[tuple[int, int, int, str]] = [] if frames is None else [frames]
    late = np.flatnonzero(is_step & (step <= own))
    if len(late):
        failed.append((int(who[late[0]]), 0, 0, "logged late values"))
    checked = is_end & (counted >= 0)
    if np.any(checked):
        # each (rank, step)'s step events against what its step_end counts
        key = who.astype(np.int64) * span + (step - NO_STEP)
        keys, counts = np.unique(key[is_step], return_counts=True)
        want_key, want = key[checked], counted[checked]
        got = np.zeros(len(want_key), np.int64)
        if len(keys):
            at = np.minimum(np.searchsorted(keys, want_key), len(keys) - 1)
            got = np.where(keys[at] == want_key, counts[at], 0)
        wrong = np.flatnonzero(got != want)
        if len(wrong):
            failed.append((int(who[checked][wrong[0]]), 1, 0,
                           "a step_end counts other events than the dataset holds"))  # fmt: skip
    is_gpu = code == _GPU
    steps_of: Any = None
    if np.any(is_gpu):  # the step a sample goes to: its own, or the one its rank is in
        raw, mine, gwho = step[is_gpu], own[is_gpu], who[is_gpu]
        given = raw != _NULL
        bad = np.flatnonzero(given & (raw <= mine))
        if len(bad):
            failed.append((int(gwho[bad[0]]), 2, 0, "has GPU samples for steps it had closed"))
        steps_of = np.where(given, raw, mine + 1)
        down = np.flatnonzero((steps_of[1:] < steps_of[:-1]) & (gwho[1:] == gwho[:-1]))
        if len(down):
            failed.append((int(gwho[down[0] + 1]), 3, 0, "has GPU samples out of step order"))
    said = []  # (rank's place, effective step, seq, idx) of each params event
    for i in np.flatnonzero(code == _PARAMS).tolist():
        effective = int(before_top[i]) + 1 if before_top[i] >= 0 else 0
        place = int(who[i])
        if effective <= own[i]:  # the step they apply to may be shipped when they are read
            why = f"logged params for step {effective}, which it had closed"
            failed.append((place, 4, i, why))
        said.append((place, effective, int(seq[i]), int(idx[i])))
    if failed:
        place, check, _, why = min(failed)
        if check < 0:  # (frames: their segment named)
            raise _No(why)
        rank = batch[place][0].rank
        raise _No(f"rank {rank}: {why}" if why.startswith("a ") else f"rank {rank} {why}")
    if steps_of is not None:
        gwho = who[is_gpu]
        cut = np.flatnonzero(gwho[1:] != gwho[:-1]) + 1
        for at, part in zip(gwho[np.concatenate(([0], cut))].tolist(), np.split(steps_of, cut),
                            strict=True):  # fmt: skip
            batch[at][0].gpu_steps = part
    last_closed, last_top = closed[ends].tolist(), top[ends].tolist()
    for place, c, t in zip(who[ends].tolist(), last_closed, last_top, strict=True):
        batch[place][0].watermark = int(c if c != NO_STEP else t - 1)
    for place, effective, q, k in said:
        rp, _, params, where, _ = batch[place]
        items = params[(q, k)]
        values: dict[str, ParamValue] = {name: json.loads(text) for name, text in items}
        rp.params.append(ParamsRead(effective, rp.rank, values, True, f"{where}#{q}.{k}"))
        rp.said.append((effective, tuple(items)))


def _frames(batch: list[_Walk], who: Any, segno: Any, seq: Any) -> tuple[int, int, int, str] | None:
    """The first segment (ranks in order, a rank's segments in order) whose frames (the
    ``seq`` of its events, whatever their table) are not those that follow the segments
    before it: numbered on from where they stopped, without a gap, a sealed segment's
    seal counted (its number the one after its last frame). As (rank's place, -1, 0,
    why), or None: every segment's frames are whole. ``who``, ``segno``: each event's
    rank (place in ``batch``) and segment (place in its rank)."""
    per_rank = [len(w[4]) for w in batch]
    rank_of = np.repeat(np.arange(len(batch)), per_rank)  # each segment's rank's place
    base = np.cumsum([0, *per_rank])[:-1].astype(np.int64)  # each rank's first segment
    gid = base[who] + segno  # each event's segment, as one number for the batch
    o = np.lexsort((seq, gid))
    g, q = gid[o], seq[o]
    new = np.ones(len(g), bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    g, q = g[new], q[new]  # each segment's frames, once each, in order
    count = np.bincount(g, minlength=len(rank_of))
    lo, hi = np.zeros(len(rank_of), np.int64), np.zeros(len(rank_of), np.int64)
    if len(g):
        firsts = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
        lasts = np.append(firsts[1:] - 1, len(g) - 1)
        lo[g[firsts]], hi[g[lasts]] = q[firsts], q[lasts]
    seal = np.array([s for w in batch for _, s in w[4]], np.int64)
    taken = count + (seal > 0)  # the numbers each segment takes, its seal's included
    upto = np.concatenate(([0], np.cumsum(taken)))  # the numbers the segments before take
    start = upto[:-1] - np.repeat(upto[base], per_rank)  # where each segment's frames start
    missing = (count > 0) & ((lo != start) | (hi - lo + 1 != count))
    unsealed = ~missing & (seal > 0) & (seal - 1 != start + count)
    bad = np.flatnonzero(missing | unsealed)
    if not len(bad):
        return None
    i = int(bad[0])
    place = int(rank_of[i])
    stem = batch[place][4][i - int(base[place])][0]
    why = "frames are missing" if missing[i] else "frames before the seal are missing"
    return place, -1, 0, f"{stem}: {why}"


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
    last. A null step (a GPU sample's, a table without steps) reads as ``_NULL``."""
    seq, idx = t["seq"].to_numpy(), t["idx"].to_numpy()
    if "step" in t.column_names:
        step = t["step"].fill_null(_NULL).to_numpy()
    else:
        step = np.full(len(seq), _NULL, np.int64)
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
