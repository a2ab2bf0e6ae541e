"""The reading half of a shipper, as its root sees it: one local tail, or a fan-in of readers.

:class:`Tails` is what the engine (:mod:`ranklog.shippers._engine`) asks of it;
:class:`LocalTails` is one :class:`~ranklog.shippers._tail.RankTail` over every rank in
the shipper's own process, and ``ranklog.shippers._fanin.RayTails`` the same over Ray
reader actors.
"""

from __future__ import annotations

from typing import Protocol

from ranklog.shippers._cursor import Cursor
from ranklog.shippers._ranks import StepGap, TailCommit, TailPoll
from ranklog.shippers._source import Source
from ranklog.shippers._steps import StepPartial
from ranklog.shippers._tail import RankTail
from ranklog.spool import RunInfo

__all__ = ["LocalTails", "Tails"]


class Tails(Protocol):
    """The reading half as the root sees it: one local tail, or a fan-in of reader actors."""

    @property
    def mode(self) -> str:
        """How changes are noticed, for status lines."""
        ...

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        """Start reading (from ``cursor``'s offsets, if any)."""
        ...

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """One read round everywhere; ``floor``: lowest watermark of ranks waited for."""
        ...

    def partials(self, steps: list[int], *, per_rank: bool) -> list[StepPartial | None]:
        """Each step's partial over every rank."""
        ...

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        """Consume what the target accepted; the segment and rank state to save."""
        ...

    def wait(self, timeout: float) -> None:
        """Sleep until something may have changed."""
        ...

    def close(self) -> None:
        """Stop reading."""
        ...


class LocalTails:
    """One :class:`RankTail` over every rank, in the shipper's own process."""

    def __init__(self, source: Source, *, dead_after: float, late: str = "count") -> None:
        self.source = source
        self.dead_after = dead_after
        self.late = late
        self.tail: RankTail | None = None

    @property
    def mode(self) -> str:
        """The source's way of noticing changes."""
        return self.source.mode

    def open(self, run: RunInfo, cursor: Cursor | None) -> None:
        """Make the tail; restore it from ``cursor``."""
        self.tail = RankTail(self.source, run, dead_after=self.dead_after, late=self.late)
        if cursor is not None:
            self.tail.restore(cursor)

    def poll(self, shipped_upto: int, gap: StepGap, floor: int | None) -> TailPoll:
        """Read one round."""
        assert self.tail is not None
        self.tail.sync(shipped_upto, gap)
        return self.tail.poll()

    def partials(self, steps: list[int], *, per_rank: bool) -> list[StepPartial | None]:
        """Built from the tail's contributions (no merge: no need to keep sums exact)."""
        assert self.tail is not None
        return self.tail.partials(steps, per_rank=per_rank, exact=False)

    def commit(self, shipped_upto: int, gap: StepGap, *, params_pending: bool) -> TailCommit:
        """The tail's commit."""
        assert self.tail is not None
        self.tail.sync(shipped_upto, gap)
        return self.tail.commit(shipped_upto, params_pending=params_pending)

    def wait(self, timeout: float) -> None:
        """The source's wait."""
        self.source.wait(timeout)

    def close(self) -> None:
        """Close the source."""
        self.source.close()
