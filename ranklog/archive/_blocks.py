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

from ranklog.archive._rows import Piece, open_file
from ranklog.spool import SegmentId

__all__ = ["BlockHeads"]

_COLUMNS: Final = ("rank", "incarnation", "segment", "seq", "idx")
#: a step that is null (a table without steps)
_NULL: Final = -(2**62)

#: one segment's events: (seq, idx, step), numpy arrays in write order
Heads = tuple[Any, Any, Any]


def _key(rank: Any, incarnation: Any, segment: Any) -> Any:
    return (rank << 40) | (incarnation << 20) | segment


class BlockHeads:
    """Blocks' events split by segment, the last blocks read kept up to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._blocks: OrderedDict[tuple[Path, int, int], dict[int, Heads]] = OrderedDict()
        self._bytes = 0
        self._sizes: dict[tuple[Path, int, int], int] = {}

    def heads(self, piece: Piece, footer: Any = None) -> Heads:
        """The events of ``piece``'s segment in its block, in write order."""
        key = (piece.path, piece.first, piece.end)
        block = self._blocks.get(key)
        if block is None:
            block = self._read(piece, footer)
            self._keep(key, block)
        else:
            self._blocks.move_to_end(key)
        sid: SegmentId = piece.segment
        got = block.get(int(_key(sid.rank, sid.incarnation, sid.segment)))
        if got is None:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        return got

    @staticmethod
    def _read(piece: Piece, footer: Any) -> dict[int, Heads]:
        pf = open_file(piece.path, footer)
        names = set(pf.schema_arrow.names)
        stepped = "step" in names
        t = pf.read_row_groups(
            list(range(piece.first, piece.end)),
            columns=[*_COLUMNS, *(["step"] if stepped else [])],
            use_threads=False,
        )
        cols = [t[c].to_numpy() for c in _COLUMNS]
        if not len(cols[0]):
            return {}
        # one row per event: an event's rows are next to each other (one step, one key)
        new = np.zeros(len(cols[0]), bool)
        new[0] = True
        for c in cols:
            new[1:] |= c[1:] != c[:-1]
        rank, inc, seg, seq, idx = (c[new].astype(np.int64) for c in cols)
        step = t["step"].fill_null(_NULL).to_numpy()[new] if stepped else np.full(len(seq), _NULL)
        keys = _key(rank, inc, seg)
        order = np.argsort(keys, kind="stable")
        keys, seq, idx, step = keys[order], seq[order], idx[order], step[order]
        cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        bounds = [0, *cut.tolist(), len(keys)]
        out: dict[int, Heads] = {}
        for a, b in itertools.pairwise(bounds):
            q, i, s = seq[a:b], idx[a:b], step[a:b]
            ok = (q[1:] > q[:-1]) | ((q[1:] == q[:-1]) & (i[1:] >= i[:-1]))
            if not bool(np.all(ok)):  # steps that go down in write order (a late value)
                back = np.lexsort((i, q))
                q, i, s = q[back], i[back], s[back]
            out[int(keys[a])] = (q, i, s)
        return out

    def _keep(self, key: tuple[Path, int, int], block: dict[int, Heads]) -> None:
        size = sum(3 * len(h[0]) * 8 for h in block.values())
        self._blocks[key] = block
        self._sizes[key] = size
        self._bytes += size
        while self._bytes > self.limit and len(self._blocks) > 1:
            old, _ = self._blocks.popitem(last=False)
            self._bytes -= self._sizes.pop(old)
