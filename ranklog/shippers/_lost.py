"""Lost frames: how a tail marks the steps whose events may be missing, and clears them.

A rank's frames are numbered; a gap in the numbers (damaged bytes skipped, a segment
missing) means events were lost. They may have been for any step the incarnation had not
closed yet: from its watermark on, up to its highest step so far, and then up to the
highest step of the next frame that has one. Those steps are marked partial for that
rank (its contribution *damaged*), unless its step_end, whose count of events matches
what was read, proves a step whole again. A step_end whose count does not match marks
its step partial too.

:class:`LostFrames` holds those rules for :class:`~ranklog.shippers._tail.RankTail`
(whose state they read and mark).
"""

from __future__ import annotations

import logging
from typing import Final

from ranklog.schemas import STEP_KINDS, Event, StepEnd
from ranklog.shippers._ranks import RankState
from ranklog.shippers._source import SegState, Source
from ranklog.shippers._steps import StepAcc
from ranklog.spool import NO_STEP

__all__ = ["MAX_TAINTED_STEPS", "LostFrames"]

log = logging.getLogger("ranklog.ship")

#: at most this many steps are marked partial after one gap in a rank's frames
MAX_TAINTED_STEPS: Final = 100_000
_STEPPED: Final = (*STEP_KINDS, StepEnd)


class LostFrames:
    """A tail's rules for lost frames (see the module); the tail holds the state."""

    source: Source
    ranks: dict[int, RankState]
    steps: dict[int, StepAcc]
    shipped_upto: int
    #: (rank, incarnation) -> watermark before frames found lost, until a frame with steps
    _damaged_from: dict[tuple[int, int], int]

    def _sequence(self, rank: int, seg: SegState, seq: int) -> None:
        """Check a frame's sequence number; a gap means frames were lost to damage.

        The lost frames may have held events of any step this incarnation had not closed
        yet: from its watermark on, up to its highest step so far and then up to the highest
        step of the next frame that has one (:meth:`_damage_until`); a step_end whose event
        count matches clears a step again.
        """
        if seq < 0:  # a frame replay made up (a rank_end): it has no place in the sequence
            return
        expected, seg.next_seq = seg.next_seq, seq + 1
        if expected is not None and seq != expected:
            self._gap(rank, seg, f"frame {seq} follows frame {expected - 1}")

    def _place(self, rank: int, segs: list[SegState], i: int) -> None:
        """Start a segment's sequence where the previous one of its incarnation ended.

        A segment missing before it (deleted, or not a regular file any more) is a gap.
        """
        seg = segs[i]
        seg.placed = True
        n = seg.name
        prev = segs[i - 1] if i > 0 else None
        if prev is not None and prev.name.incarnation == n.incarnation:
            if prev.name.segment + 1 == n.segment:
                if prev.exhausted and seg.next_seq is None:
                    seg.next_seq = prev.next_seq
                return
            self._gap(rank, seg, f"segments {prev.name.segment + 1}-{n.segment - 1} missing")
        elif n.segment > 1:
            self._gap(rank, seg, f"segments 1-{n.segment - 1} missing")

    def _gap(self, rank: int, seg: SegState, why: str) -> None:
        """Frames of ``seg``'s incarnation were lost before ``seg.offset``."""
        inc_no = seg.name.incarnation
        inc = self.ranks[rank].incs[inc_no]
        watermark = inc.watermark
        key = (rank, inc_no)
        self._damaged_from[key] = min(self._damaged_from.get(key, watermark), watermark)
        self._taint(rank, watermark, inc.max_step)  # open steps it logged: at once
        log.warning("frames lost in %s before offset %d (%s): steps of rank %d after %d are "
                    "marked partial unless their counts prove them whole",
                    seg.name.path, seg.offset, why, rank, watermark)  # fmt: skip

    def _damage_until(self, rank: int, inc_no: int, events: list[Event]) -> None:
        """The first frame with steps after a gap: taint the steps up to its highest.

        Done before the frame is applied, so that its step_ends can clear what they prove.
        """
        key = (rank, inc_no)
        if key not in self._damaged_from:
            return
        top = max((ev.step for ev in events if isinstance(ev, _STEPPED)), default=NO_STEP)
        if top != NO_STEP:
            self._taint(rank, self._damaged_from.pop(key), top)

    def _verify(self, rank: int, inc_no: int, step: int, logged: int) -> None:
        """A step_end says ``rank`` logged ``logged`` step events for ``step``: compare."""
        acc = self.steps.get(step)
        contrib = acc.ranks.get(rank) if acc is not None else None
        got = contrib.count if contrib is not None and contrib.incarnation == inc_no else 0
        if got == logged:
            if acc is not None:
                acc.damaged.discard(rank)  # whole, whatever a gap before it suggested
            return
        log.warning("rank %d incarnation %d logged %d events for step %d, %d were read: "
                    "the step is marked partial", rank, inc_no, logged, step, got)  # fmt: skip
        self._taint(rank, step - 1, step)

    def _in_range(self, step: int) -> bool:
        """Whether the source reads ``step`` at all (a replay's ``--steps`` window)."""
        window = self.source.step_range
        if window is None:
            return True
        first, end = window
        return (first is None or step >= first) and (end is None or step < end)

    def _taint(self, rank: int, after: int, upto: int) -> None:
        """Mark ``rank``'s contribution to the steps ``after < s <= upto`` as incomplete."""
        lo, hi = max(after, self.shipped_upto) + 1, upto + 1
        if self.source.step_range is not None:
            first, end = self.source.step_range
            lo = lo if first is None else max(lo, first)
            hi = hi if end is None else min(hi, end)
        if hi - lo > MAX_TAINTED_STEPS:
            log.warning("rank %d: %d steps may hold lost frames; the last %d are marked",
                        rank, hi - lo, MAX_TAINTED_STEPS)  # fmt: skip
            lo = hi - MAX_TAINTED_STEPS
        for step in range(lo, hi):
            acc = self.steps.get(step)
            if acc is None:
                self.steps[step] = acc = StepAcc()
            acc.damaged.add(rank)
