"""What a tail knows and tells of its ranks: their state, their views, what a round found.

A :class:`~ranklog.shippers._tail.RankTail` keeps a :class:`RankState` per rank (its
incarnations' watermarks and ends, its last sign of life) and reports, each round, a
:class:`TailPoll` (the ranks as :class:`RankView`, the steps held, the params read);
once its owner shipped, a :class:`TailCommit` (the cursor state of its segments).
:class:`StepGap` names the steps a process now gone had shipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, NamedTuple

import msgspec

from ranklog.errors import ConfigError
from ranklog.schemas import ParamValue
from ranklog.shippers._cursor import IncState, SegmentCursor
from ranklog.spool import NO_STEP, BadRange

__all__ = [
    "LATE_POLICIES",
    "NO_GAP",
    "ParamsRead",
    "RankState",
    "RankView",
    "StepGap",
    "TailCommit",
    "TailPoll",
    "check_late",
]

#: what a shipper does with late and re-logged values: count them only, or ship them too
LATE_POLICIES: Final = ("count", "ship")


def check_late(late: str) -> str:
    """``late`` if it is a known policy; else ConfigError."""
    if late not in LATE_POLICIES:
        raise ConfigError(f"late must be one of {', '.join(LATE_POLICIES)}, got {late!r}")
    return late


class StepGap(NamedTuple):
    """Steps ``after < step <= upto`` that were shipped by a process now gone.

    The target held them (the durable gap: shipped, but the cursor was not committed) or
    the owner had shipped them (the restore gap of a reader actor's new life): values
    re-read for them are neither shipped again nor counted as late.
    """

    after: int
    upto: int

    def holds(self, step: int) -> bool:
        """Whether ``step`` is in the gap."""
        return self.after < step <= self.upto


#: no gap
NO_GAP: Final = StepGap(NO_STEP, NO_STEP)


class ParamsRead(NamedTuple):
    """Hyperparameters read from one params event, for the owner to take in."""

    #: the first step they apply to (the one after the rank's highest step so far)
    effective: int
    rank: int
    values: dict[str, ParamValue]
    #: not examined by an earlier shipper process
    fresh: bool
    #: where they were read (segment key, frame end, index): read twice, taken once
    where: str


@dataclass(slots=True)
class RankState:
    """The shipper's view of one rank across its incarnations."""

    incs: dict[int, IncState] = field(default_factory=dict)
    #: latest sign of life: a segment's mtime, or when this shipper saw one grow
    last_activity: float = 0.0
    #: every byte this rank wrote so far has been read (nothing left but a live tail)
    caught_up: bool = False

    def watermark(self) -> int:
        """Highest step this rank has closed, over all incarnations."""
        return max((s.watermark for s in self.incs.values()), default=NO_STEP)

    def ended(self) -> bool:
        """Whether the newest incarnation wrote rank_end, and not because of a signal.

        A rank ended by SIGTERM (``status == "signal"``: a SLURM requeue or preemption,
        torchrun stopping its workers) may well come back as a new incarnation: it is
        released like a silent rank, after ``dead_after``, not at once.
        """
        if not self.incs:
            return False
        status = self.newest().ended
        return status is not None and status != "signal"

    def newest(self) -> IncState:
        """The newest incarnation's state (a rank seen with one, at least)."""
        incs = self.incs
        if len(incs) == 1:  # (the usual rank: no max of one)
            (inc,) = incs.values()
            return inc
        return incs[max(incs)]

    def released(self, now: float, dead_after: float) -> bool:
        """Ended (rank_end) or silent for ``dead_after``; either way, only once fully read."""
        return self.caught_up and (self.ended() or now - self.last_activity > dead_after)

    def view(self, rank: int, now: float, dead_after: float) -> RankView:
        """This rank as completeness needs it (a rank seen with an incarnation, at least)."""
        incs = self.incs
        if len(incs) == 1:  # (the usual rank: its one incarnation's, no max of one)
            (inc,) = incs.values()
            mark, size = inc.watermark, inc.world_size
        else:
            sizes = [i.world_size for i in incs.values() if i.world_size is not None]
            mark, size = self.watermark(), max(sizes) if sizes else None
        released = self.released(now, dead_after)
        status = (self.newest().ended or "dead") if released else None
        return RankView(rank, mark, released, self.ended(), self.last_activity, size, status)

    def closed_before(self, inc: int) -> int:
        """Highest step closed (step_end, or a later step) by an incarnation before ``inc``."""
        incs = self.incs
        if len(incs) == 1 and inc in incs:  # (the usual rank: one incarnation; per frame)
            return NO_STEP
        return max((s.watermark for k, s in incs.items() if k < inc), default=NO_STEP)


class RankView(msgspec.Struct, frozen=True, gc=False):
    """One rank as completeness needs it: how far it got and whether it is waited for.

    (A Struct: a tail makes one per rank every round, thousands at a time.)
    """

    rank: int
    watermark: int
    #: ended or silent for dead_after, and fully read: no longer waited for
    released: bool
    ended: bool
    last_activity: float
    #: the largest world size any of its incarnations announced
    world_size: int | None
    #: how its newest incarnation ended: rank_end's status (``ok``, ``error``, ``exit``,
    #: ``signal``, ...), ``dead`` when released after silence, None while it is waited for
    status: str | None = None


@dataclass(slots=True)
class TailPoll:
    """What one read round found, for the tail's owner."""

    progressed: bool
    views: list[RankView]
    #: steps held (logged by some rank, not shipped yet)
    steps: list[int]
    #: hyperparameters read, in read order
    params: list[ParamsRead]
    #: bytes written but not yet consumed (read and shipped)
    lag_bytes: int = 0


@dataclass(slots=True)
class TailCommit:
    """The cursor state of a tail's segments and ranks after a commit.

    The counters are those of the bytes read since the previous commit: they go into
    the cursor with the ``seen`` offsets that stop them from being counted again.
    """

    segments: dict[str, SegmentCursor]
    ranks: dict[str, dict[str, IncState]]
    late_events: int = 0
    relogged_events: int = 0
    bad: list[BadRange] = field(default_factory=list)
