"""Helpers for tests, yours and ours: read back what ranks wrote, and crash a rank.

>>> events = read_events(spool)                 # every event of every rank, in write order
>>> by_rank = events_by_incarnation(spool)      # {(rank, incarnation): [events]}
>>> crash(run)                                  # as if the process were SIGKILLed now
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ranklog.schemas import Event
from ranklog.spool import BadRange, SpoolLayout, read_segment

if TYPE_CHECKING:
    from ranklog.producer import Run

__all__ = ["bad_ranges", "crash", "events_by_incarnation", "read_events"]


def crash(run: Run) -> None:
    """Stop ``run`` as a SIGKILL would: what its writer had handed to the OS stays, the rest
    of its buffer is lost, no ``rank_end`` or seal is written and nothing runs at exit.

    The spool is left as a killed rank leaves it, for tests of what survives a crash
    (a restarted rank then starts a new incarnation, as after a requeue).
    """
    run._crash()


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
