"""The heads of a layout-2 block's events, per segment, for the plan's check.

A block (rows of many segments, sorted by step; see :mod:`ranklog.archive._parts`) is
read once, key columns only, in one read of its row groups: its rows become events
(rows of one event are next to each other and share their key), and the events are
split by segment, each segment's in write order. The check then walks each rank's
events as it does a file's in layout 1, without decoding the block again for every
segment that shares it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ranklog.archive._files import Piece, open_file, segment_key

__all__ = ["BlockHeads", "Owners", "RanksHeads", "ranks_heads"]

_SEGMENT: Final = ("rank", "incarnation", "segment")
#: a step that is null (a table without steps)
_NULL: Final = -(2**62)

#: one segment's events: (seq, idx, step), numpy arrays in write order
Heads = tuple[Any, Any, Any]
#: one segment's rows of the ranks table, in write order: (seq, idx, step (a step_end's;
#: else none), code (step_end or other), events (-1: none)) as numpy arrays, and the
#: (kind, world_size, status) of its rows other than step_ends
RanksHeads = tuple[Any, Any, Any, Any, Any, list[tuple[Any, Any, Any]]]
#: the event codes of the plan's walk (:mod:`ranklog.archive._walk` takes them)
END, OTHER = 1, 3
_NO_STEP: Final = -1
_RANKS: Final = ("seq", "idx", "kind", "step", "events", "world_size", "status")


def ranks_heads(t: pa.Table) -> RanksHeads:
    """One segment's rows of the ranks table (``t``, in write order) as the check reads them."""
    is_end = pc.equal(t["kind"], "step_end").to_numpy(zero_copy_only=False)
    code = np.where(is_end, END, OTHER).astype(np.int8)
    step = np.where(is_end, t["step"].fill_null(_NO_STEP).to_numpy(), _NO_STEP)
    events = t["events"].fill_null(-1).to_numpy()
    other = t.filter(pc.invert(pa.chunked_array([is_end])))  # a few rows: in order
    rows = list(zip(*(other[c].to_pylist() for c in ("kind", "world_size", "status")),
                    strict=True))  # fmt: skip
    return t["seq"].to_numpy(), t["idx"].to_numpy(), step, code, events, rows


#: a block's segments by rank: rank -> the key of its one segment there (-1: several)
Owners = dict[int, int]


def _read_columns(
    piece: Piece, footer: Any, columns: list[str], owners: Owners | None = None
) -> tuple[Any, Any, Any]:
    """The piece's groups (the columns of them its file has), and each row's segment: its
    key, and None; or, for a block whose ranks have one segment each there (``owners`` say
    which), its rank, and those owners (the rank column alone is read: :func:`_keys_of`
    turns ranks into keys). A file of one segment's rows is read without its segment
    columns."""
    pf = open_file(piece.path, footer)
    have = set(pf.schema_arrow.names)
    wanted = [c for c in columns if c in have]
    if piece.alone:
        groups = piece.groups(pf.metadata)
        if groups.start == 0 and groups.stop == pf.metadata.num_row_groups:
            t = pf.read(columns=wanted, use_threads=False)
        else:
            t = pf.read_row_groups(list(groups), columns=wanted, use_threads=False)
        return t, np.full(t.num_rows, piece.key, np.int64), None
    chosen = list(piece.groups(pf.metadata))
    if owners and min(owners.values()) >= 0:
        t = pf.read_row_groups(chosen, columns=["rank", *wanted], use_threads=False)
        return t, t["rank"].to_numpy().astype(np.int64), owners
    t = pf.read_row_groups(chosen, columns=[*_SEGMENT, *wanted], use_threads=False)
    return t, segment_key(*(t[c].to_numpy().astype(np.int64) for c in _SEGMENT)), None


def _keys_of(rank: Any, owners: Owners) -> Any:
    """Each segment key of these ranks (``owners``: one segment each); -1 for a rank that
    is not one of them."""
    ranks = np.array(sorted(owners), np.int64)
    keys = np.array([owners[r] for r in ranks.tolist()], np.int64)
    at = np.clip(np.searchsorted(ranks, rank), 0, len(ranks) - 1)
    return np.where(ranks[at] == rank, keys[at], -1)


def _ranks_block(piece: Piece, footer: Any, owners: Owners | None) -> dict[int, RanksHeads]:
    """A block of the ranks table (rows in write order: segment by segment), split."""
    t, keys, by_rank = _read_columns(piece, footer, list(_RANKS), owners)
    if by_rank is not None:
        keys = _keys_of(keys, by_rank)
    if not len(keys):
        return {}
    q, i = t["seq"].to_numpy(), t["idx"].to_numpy()
    same = keys[1:] == keys[:-1]
    back = (keys[1:] < keys[:-1]) | (
        same & ((q[1:] < q[:-1]) | ((q[1:] == q[:-1]) & (i[1:] < i[:-1])))
    )
    if bool(back.any()):  # (compaction writes them in order: another writer's file)
        order = np.lexsort((i, q, keys))
        keys, t = keys[order], t.take(pa.array(order))
    seq, idx, step, code, events, rows = ranks_heads(t)
    cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    bounds = [0, *cut.tolist(), len(keys)]
    is_other = code == OTHER
    others = np.cumsum(is_other) - is_other  # each row's place among the other rows
    out: dict[int, RanksHeads] = {}
    for a, b in itertools.pairwise(bounds):
        o0 = int(others[a])
        o1 = o0 + int(is_other[a:b].sum())
        out[int(keys[a])] = (seq[a:b], idx[a:b], step[a:b], code[a:b], events[a:b], rows[o0:o1])
    return out


class BlockHeads:
    """Blocks' events split by segment, the last blocks read kept up to ``limit`` bytes."""

    def __init__(
        self, limit: int, owners: dict[tuple[Path, int, int], Owners] | None = None
    ) -> None:
        self.limit = limit
        #: each block's segments by rank (blocks not named: the segment columns are read)
        self._owners = owners or {}
        self._blocks: OrderedDict[tuple[Path, int, int], dict[int, Heads]] = OrderedDict()
        self._bytes = 0
        self._sizes: dict[tuple[Path, int, int], int] = {}
        self._ranks: OrderedDict[tuple[Path, int, int], dict[int, RanksHeads]] = OrderedDict()
        self._ranks_bytes: dict[tuple[Path, int, int], int] = {}
        #: the first file read whose rows' steps go down in its order (windows of steps
        #: cannot read it: the plan refuses the dataset once its ranks were walked)
        self.unsorted: str | None = None

    def ranks(self, piece: Piece, footer: Any = None) -> RanksHeads:
        """The rows of ``piece``'s segment in its block of the ranks table, as
        :func:`ranks_heads` gives them (the block read and split once)."""
        key = (piece.path, piece.first, piece.end)
        block = self._ranks.get(key)
        if block is None:
            block = self._ranks[key] = _ranks_block(piece, footer, self._owners.get(key))
            self._ranks_bytes[key] = size = sum(40 * len(h[0]) + 100 * len(h[5])
                                                for h in block.values())  # fmt: skip
            self._bytes += size
            self._drop()
        else:
            self._ranks.move_to_end(key)
        got = block.get(piece.key)
        if got is None:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty, np.zeros(0, np.int8), empty, []
        return got

    def heads(self, piece: Piece, footer: Any = None) -> Heads:
        """The events of ``piece``'s segment in its block, in write order."""
        key = (piece.path, piece.first, piece.end)
        block = self._blocks.get(key)
        if block is None:
            block, unsorted = self._read(piece, footer, self._owners.get(key))
            if unsorted and self.unsorted is None:
                self.unsorted = piece.path.name
            self._keep(key, block)
        else:
            self._blocks.move_to_end(key)
        got = block.get(piece.key)
        if got is None:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        return got

    @staticmethod
    def _read(piece: Piece, footer: Any, owners: Owners | None) -> tuple[dict[int, Heads], bool]:
        """The block's events by segment, and whether, in the file's order, its steps go
        down (windows of steps cannot read it)."""
        t, rows_of, by_rank = _read_columns(piece, footer, ["seq", "idx", "step"], owners)
        stepped = "step" in t.column_names
        if not len(rows_of):
            return {}, False
        cols = [rows_of, t["seq"].to_numpy(), t["idx"].to_numpy()]
        # one row per event: an event's rows are next to each other (one step, one segment)
        new = np.zeros(len(rows_of), bool)
        new[0] = True
        for c in cols:
            new[1:] |= c[1:] != c[:-1]
        keys, seq, idx = (c[new].astype(np.int64) for c in cols)
        if by_rank is not None:  # (each event's rank: its segment's key, once per event)
            keys = _keys_of(keys, by_rank)
        if stepped:
            col = t["step"]
            step = (col.fill_null(_NULL) if col.null_count else col).to_numpy()[new]
        else:
            step = np.full(len(seq), _NULL)
        unsorted = stepped and bool(np.any(step[1:] < step[:-1]))
        order = np.argsort(keys, kind="stable")
        keys, seq, idx, step = keys[order], seq[order], idx[order], step[order]
        same = keys[1:] == keys[:-1]
        back = same & ((seq[1:] < seq[:-1]) | ((seq[1:] == seq[:-1]) & (idx[1:] < idx[:-1])))
        if bool(back.any()):  # steps that go down in write order (a late value): sort
            order = np.lexsort((idx, seq, keys))
            keys, seq, idx, step = keys[order], seq[order], idx[order], step[order]
            same = keys[1:] == keys[:-1]
        bounds = [0, *(np.flatnonzero(~same) + 1).tolist(), len(keys)]
        pairs = itertools.pairwise(bounds)
        return {int(keys[a]): (seq[a:b], idx[a:b], step[a:b]) for a, b in pairs}, unsorted

    def _keep(self, key: tuple[Path, int, int], block: dict[int, Heads]) -> None:
        size = sum(3 * len(h[0]) * 8 for h in block.values())
        self._blocks[key] = block
        self._sizes[key] = size
        self._bytes += size
        self._drop()

    def _drop(self) -> None:
        """The least recently used blocks let go, of either kind, past ``limit`` bytes."""
        while self._bytes > self.limit and len(self._blocks) + len(self._ranks) > 1:
            if self._ranks and (not self._blocks or len(self._ranks) > 1):
                old = next(iter(self._ranks))
                del self._ranks[old]
                self._bytes -= self._ranks_bytes.pop(old)
            else:
                old = next(iter(self._blocks))
                del self._blocks[old]
                self._bytes -= self._sizes.pop(old)
