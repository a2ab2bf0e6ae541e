"""Two processes given the same rank id: refused at ``init`` on one host, warned about anywhere.

A rank that starts again after a crash or a requeue is normal: it writes a new
incarnation. Two *live* processes writing the same rank are a misconfiguration
(``RANK`` unset, a copied launcher line) that would mix their values silently:

- :func:`running_writer`: before a process claims an incarnation, the rank's newest
  incarnation is looked at; if it is not sealed and its ``rank_start`` names a live
  process of this host, ``init`` raises :class:`~ranklog.errors.ConfigError`;
- :func:`later_incarnation`: the writer thread of a live rank lists its rank directory
  every heartbeat; a newer incarnation while it still runs means another process
  took the same rank id (on another host, or starting at the same moment), and it
  warns once.
"""

from __future__ import annotations

import os

from ranklog._proc import process_running
from ranklog.schemas import RankStart
from ranklog.spool import HEADER_SIZE, SegmentName, SegmentReader, SpoolLayout

__all__ = ["later_incarnation", "running_writer"]

#: how much of a segment's end is read to find its seal
_TAIL_BYTES = 8192


def running_writer(layout: SpoolLayout, rank: int, host: str) -> tuple[int, int, str] | None:
    """(incarnation, pid, path) of a live process of ``host`` writing ``rank``, if any."""
    segs = layout.segments(rank)
    if not segs:
        return None
    newest = segs[-1].incarnation
    mine = [s for s in segs if s.incarnation == newest]
    start = _rank_start(mine[0])
    if start is None or start.host != host or start.pid == os.getpid():
        return None
    if not process_running(start.pid) or _sealed(mine[-1]):
        return None
    return newest, start.pid, str(mine[-1].path)


def later_incarnation(layout: SpoolLayout, rank: int, incarnation: int) -> int | None:
    """The newest incarnation of ``rank`` if it is later than ``incarnation``."""
    segs = layout.segments(rank)
    newest = segs[-1].incarnation if segs else 0
    return newest if newest > incarnation else None


def _rank_start(seg: SegmentName) -> RankStart | None:
    res = SegmentReader(seg.path).read(0, max_bytes=4096)
    for frame in res.frames[:1]:
        for ev in frame.events:
            if isinstance(ev, RankStart):
                return ev
    return None


def _sealed(seg: SegmentName) -> bool:
    try:
        size = seg.path.stat(follow_symlinks=False).st_size
    except OSError:
        return True
    res = SegmentReader(seg.path).read(max(HEADER_SIZE, size - _TAIL_BYTES))
    return res.sealed
