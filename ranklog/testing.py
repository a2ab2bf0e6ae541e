"""Helpers for tests, yours and ours: read back what ranks wrote to a spool.

>>> events = read_events(spool)                 # every event of every rank, in write order
>>> by_rank = events_by_incarnation(spool)      # {(rank, incarnation): [events]}
"""

from __future__ import annotations

import os

from ranklog.schemas import Event
from ranklog.spool import BadRange, SpoolLayout, read_segment

__all__ = ["bad_ranges", "events_by_incarnation", "read_events"]


def events_by_incarnation(
    spool: str | os.PathLike[str], *, writer_gone: bool = True
) -> dict[tuple[int, int], list[Event]]:
    """Every intact event per ``(rank, incarnation)``, in the order it was written."""
    out: dict[tuple[int, int], list[Event]] = {}
    for seg in SpoolLayout(spool).all_segments():
        res = read_segment(seg.path, writer_gone=writer_gone)
        out.setdefault((seg.rank, seg.incarnation), []).extend(res.events)
    return out


def read_events(spool: str | os.PathLike[str], *, rank: int | None = None) -> list[Event]:
    """Every intact event of ``rank`` (or of all ranks), rank by rank, in write order."""
    return [
        e
        for (r, _inc), events in sorted(events_by_incarnation(spool).items())
        if rank is None or r == rank
        for e in events
    ]


def bad_ranges(spool: str | os.PathLike[str]) -> list[BadRange]:
    """Every damaged byte range a reader would skip, with path and offset."""
    return [
        b
        for seg in SpoolLayout(spool).all_segments()
        for b in read_segment(seg.path, writer_gone=True).bad
    ]
