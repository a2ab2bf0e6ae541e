"""The reading half of a shipper: tail rank segments into per-step contributions.

A :class:`RankTail` follows a set of ranks (all of a spool's, or one shard of
them in a fan-in), applies their events (incarnations, watermarks, ends,
late and re-logged values) and keeps, per step, what each of its ranks logged.
It ships nothing: its owner (:class:`~ranklog.shippers.Shipper`) asks it for
its ranks' state (:meth:`views`), for the mergeable partial of ready steps
(:meth:`partials`), and, once the target accepted them, for the cursor state
that covers them (:meth:`commit`). One shipper owns one tail in its own
process; the Ray fan-in owns several, one per reader actor.

Incarnations: a new incarnation ends the previous one at once. For each rank
and step the values of the first incarnation that *closed* the step count;
values re-logged by a later incarnation for such a step are counted as
re-logged and not shipped; values of an incarnation that never closed a step
are replaced by those of the later incarnation that logs it.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from ranklog.schemas import (
    STEP_KINDS,
    Event,
    Gpu,
    Params,
    RankEnd,
    RankStart,
    StepEnd,
    StepEvent,
)
from ranklog.shippers._cursor import Cursor, IncState, SegmentCursor
from ranklog.shippers._lost import LostFrames
from ranklog.shippers._ranks import (
    NO_GAP,
    ParamsRead,
    RankState,
    RankView,
    StepGap,
    TailCommit,
    TailPoll,
    check_late,
)
from ranklog.shippers._source import SegState, Source
from ranklog.shippers._steps import Contributed, Contribution, StepAcc, StepPartial
from ranklog.spool import HEADER_SIZE, NO_STEP, BadRange, RunInfo

__all__ = ["MAX_PENDING_STEPS", "ROUND_BYTES", "ROUND_TOTAL_BYTES", "RankTail"]

log = logging.getLogger("ranklog.ship")

#: bytes read from one segment per round: bounds memory whatever the spool's size
ROUND_BYTES: Final = 256 * 1024
#: bytes a tail reads per round, shared among its ranks: a round's events wait in memory
#: until their steps ship, so with many ranks each reads less (64 ranks: ROUND_BYTES each;
#: 1,024 ranks: 16 KiB each). A read always takes a whole frame, so a round may read a
#: frame more per segment; each reader of a fan-in is a tail with its own budget
ROUND_TOTAL_BYTES: Final = 16 * 1024 * 1024
#: past this many steps waiting in memory, only the ranks holding them back are read
MAX_PENDING_STEPS: Final = 1024
#: the step event types, for a set lookup by exact type (decoded events are never subclasses)
_STEP_TYPES: Final = frozenset(STEP_KINDS)


class RankTail(LostFrames):
    """Tails the segments of a set of ranks; holds their per-step contributions."""

    def __init__(
        self,
        source: Source,
        run: RunInfo,
        *,
        dead_after: float,
        shard: tuple[int, int] | None = None,
        late: str = "count",
    ) -> None:
        self.source = source
        self.run = run
        self.dead_after = dead_after
        #: ship late and re-logged values with the next step of their rank ("ship"), or
        #: only count them ("count")
        self.ship_late = check_late(late) == "ship"
        #: (i, n): this tail holds the ranks r with r % n == i (None: all ranks)
        self.shard = shard
        self._saved: dict[str, SegmentCursor] = {}
        self.ranks: dict[int, RankState] = {}
        self.steps: dict[int, StepAcc] = {}
        #: steps <= this are shipped (or held by the target): set by the owner
        self.shipped_upto = -1
        #: steps the target held beyond the cursor (shipped by a process that died)
        self.durable_gap = NO_GAP
        #: (this tail's last commit, the owner's last shipped step] when it was restored:
        #: values re-read for those steps were shipped, not late (a reader's new life)
        self.restore_gap = NO_GAP
        self._poll = TailPoll(False, [], [], [])
        self._late = self._relogged = 0
        self._bad: list[BadRange] = []
        #: (rank, incarnation) -> watermark before frames found lost, until a frame with steps
        self._damaged_from: dict[tuple[int, int], int] = {}

    def restore(self, cursor: Cursor) -> None:
        """Carry on from a committed cursor (only this tail's ranks are taken)."""
        self.shipped_upto = cursor.last_step
        for rank, incs in cursor.ranks.items():
            if self.shard is not None and int(rank) % self.shard[1] != self.shard[0]:
                continue
            # Watermarks past the last shipped step are rebuilt by re-reading: the
            # values they cover are past the committed offsets and not read yet.
            restored = {}
            for k, v in incs.items():
                v.closed = min(v.closed, cursor.last_step)
                v.max_step = min(v.max_step, cursor.last_step + 1)
                v.implied = min(v.implied, cursor.last_step)
                restored[int(k)] = v
            self.ranks[int(rank)] = RankState(restored)
        self._saved = cursor.segments

    def sync(self, shipped_upto: int, durable_gap: StepGap) -> None:
        """Learn what the owner shipped; forget steps at or below it."""
        self.shipped_upto = shipped_upto
        self.durable_gap = durable_gap
        if self.steps and min(self.steps) <= shipped_upto:
            for step in [s for s in self.steps if s <= shipped_upto]:
                del self.steps[step]

    # -- reading --------------------------------------------------------------------------

    def poll(self, floor: int | None = None) -> TailPoll:
        """Discover and read one bounded round; report what changed."""
        self._poll = TailPoll(False, [], [], [])
        self._discover()
        now = time.time()
        self._poll.progressed = self._read_round(now, floor)
        self._poll.views = self.views(time.time())
        self._poll.steps = list(self.steps)
        self._poll.lag_bytes = sum(
            max(0, s.size - s.consumed) for s in self.source.segments.values()
        )
        return self._poll

    def _discover(self) -> None:
        for seg in self.source.discover():
            saved = self._saved.get(seg.key)
            if saved is not None:
                seg.offset = seg.consumed = saved.offset
                seg.seen = saved.seen
                seg.exhausted = saved.done
                seg.next_seq = seg.consumed_seq = saved.seq if saved.seq >= 0 else None
                if saved.names is not None:
                    seg.reader.resume_from(saved.names, saved.offset)
                if saved.closed is not None and saved.max_step is not None:
                    implied = NO_STEP if saved.implied is None else saved.implied  # (load_cursor
                    # gives an older cursor's as its release judged it)
                    seg.restore_state = seg.consumed_state = (saved.closed, saved.max_step, implied)
                else:
                    seg.legacy = True
            elif seg.name.segment == 1:
                seg.next_seq = 0  # an incarnation's frames are numbered from 0
            rank = self.ranks.setdefault(seg.name.rank, RankState())
            rank.incs.setdefault(seg.name.incarnation, IncState())

    def _read_round(self, now: float, floor: int | None) -> bool:
        """Read one bounded slice of every readable segment; True if anything was read."""
        progressed = False
        readable = self._readable_ranks(now, floor)
        ranks = len(self.source.by_rank) if readable is None else len(readable)
        budget = min(ROUND_BYTES, ROUND_TOTAL_BYTES // max(ranks, 1))
        for rank, segs in self.source.by_rank.items():
            state = self.ranks[rank]
            self._probe(state, segs, now)
            if readable is not None and rank not in readable:
                state.caught_up = False
                continue
            state.caught_up = True
            for i, seg in enumerate(segs):
                if seg.exhausted:
                    continue
                later = i + 1 < len(segs)  # a later segment or incarnation: writer gone
                if seg.size <= seg.offset and not later:
                    break  # the live tail of this rank: nothing new
                res = seg.reader.read(seg.offset, writer_gone=later, max_bytes=budget)
                if res.end != seg.offset or res.frames:
                    progressed = True
                if seg.reader.header is not None and not self._identity_ok(seg):
                    continue
                if not seg.placed and seg.offset <= HEADER_SIZE:
                    self._place(rank, segs, i)
                inc = state.incs.setdefault(seg.name.incarnation, IncState())
                if seg.restore_state is not None:  # where the committed cursor left it
                    inc.closed, inc.max_step, inc.implied = seg.restore_state
                    seg.restore_state = None
                elif seg.consumed_state is None:
                    seg.consumed_state = (inc.closed, inc.max_step, inc.implied)
                for frame in res.frames:
                    self._sequence(rank, seg, frame.seq)
                    if self._damaged_from:
                        self._damage_until(rank, seg.name.incarnation, frame.events)
                    max_step, holds = self._apply(rank, seg, frame.events, frame.end)
                    seg.frames.append(
                        (
                            frame.end,
                            max_step,
                            holds,
                            seg.next_seq,
                            (inc.closed, inc.max_step, inc.implied),
                        )
                    )
                if res.bad:
                    self._report_bad(res.bad, seg)
                seg.offset = res.end
                if res.seal is not None:
                    seg.sealed = True
                    if res.seal_seq is not None:
                        self._sequence(rank, seg, res.seal_seq)
                if res.more:
                    state.caught_up = False
                    break  # budget used: the rest of this rank next round
                if seg.sealed or later:
                    seg.exhausted = True
                    if not seg.frames:
                        seg.consumed = seg.offset
                        seg.consumed_state = (inc.closed, inc.max_step, inc.implied)
                    continue
                break  # a live tail
        return progressed

    def _probe(self, state: RankState, segs: list[SegState], now: float) -> None:
        """Refresh sizes; a segment seen growing is a sign of life, on this machine's clock."""
        for seg in segs:
            if seg.exhausted:
                continue
            before = seg.size
            self.source.probe(seg)
            if before >= 0 and seg.size != before:
                state.last_activity = max(state.last_activity, now)
            state.last_activity = max(state.last_activity, seg.mtime)

    def _readable_ranks(self, now: float, floor: int | None) -> set[int] | None:
        """Ranks to read this round: all (None), unless too many steps wait in memory.

        Past ``MAX_PENDING_STEPS`` only the ranks holding the oldest steps back are
        read: reading the others would only add steps that cannot ship yet. ``floor``
        is the lowest watermark of the ranks other tails hold, in a fan-in.
        """
        if len(self.steps) <= MAX_PENDING_STEPS:
            return None
        limits = {
            r: s.watermark()
            for r, s in self.ranks.items()
            if not (s.caught_up and self.released(s, now))
        }
        if not limits:
            return set()
        low = min(limits.values())
        if floor is not None and floor < low:
            low = floor
        return {r for r, m in limits.items() if m <= low}

    def _identity_ok(self, seg: SegState) -> bool:
        """The header, not the path, is a segment's identity: refuse a foreign file."""
        h = seg.reader.header
        assert h is not None
        n = seg.name
        if (h.run_id, h.rank, h.incarnation, h.segment) == (
            self.run.run_id, n.rank, n.incarnation, n.segment,
        ):  # fmt: skip
            return True
        if not seg.exhausted:
            why = (
                f"segment of run {h.run_id}, not {self.run.run_id}"
                if h.run_id != self.run.run_id
                else f"header says rank {h.rank} incarnation {h.incarnation} segment {h.segment}"
            )
            self._report_bad([BadRange(str(n.path), 0, max(seg.size, 0), why)], seg)
            seg.exhausted = True
            seg.offset = seg.consumed = max(seg.size, seg.offset)
        return False

    def _report_bad(self, bad: list[BadRange], seg: SegState) -> None:
        for b in bad:
            if b.length and b.offset + b.length <= seg.seen:
                continue  # reported by an earlier shipper process
            self._bad.append(b)
            log.warning("corrupt spool bytes skipped: %s", b)

    def _apply(
        self, rank: int, seg: SegState, events: list[Event], frame_end: int
    ) -> tuple[int, bool]:
        """Apply one frame's events; return (highest step in it, holds params)."""
        inc_no = seg.name.incarnation
        state = self.ranks[rank]
        inc = state.incs.get(inc_no)
        if inc is None:  # (not setdefault: an IncState made per frame for nothing)
            inc = state.incs[inc_no] = IncState()
        fresh = frame_end > seg.seen  # not examined by an earlier shipper process
        carry = self.ship_late and (fresh or not seg.legacy)
        max_step = NO_STEP
        holds = False
        prev_closed: int | None = None
        shipped_upto = self.shipped_upto
        gap = self.durable_gap
        rgap = self.restore_gap
        nparams = 0  # params events in this frame so far
        steps = self.steps
        step_types = _STEP_TYPES
        verify = self.source.verify_counts
        whole = self.source.step_range is None  # every step read (not a replay's window)
        for event in events:
            kind = type(event)
            if kind in step_types:
                ev: StepEvent = event  # type: ignore[assignment]  # the set holds only those
                step = ev.step
                # inc.watermark, inlined: this runs once per event
                own = inc.closed if inc.closed > inc.implied else inc.implied
                if step > max_step:
                    max_step = step
                if step > inc.max_step:
                    # implied_after(), inlined: moving on closes the step it was in
                    if inc.closed == NO_STEP:
                        inc.implied = inc.max_step
                    inc.max_step = step
                if prev_closed is None:
                    prev_closed = state.closed_before(inc_no)
                if step <= prev_closed:  # closed by an earlier incarnation: re-logged
                    if fresh and step > gap.upto:
                        self._relogged += 1
                    if carry and (t := self._carry(rank, inc_no, ev, own, prev_closed)):
                        max_step = max(max_step, t)
                    continue
                if step <= own or step <= shipped_upto:
                    # Late: this rank had closed the step already (its own watermark: the
                    # same verdict whatever order ranks are read in), or it was shipped.
                    if fresh and not gap.holds(step) and not (step > own and rgap.holds(step)):
                        self._late += 1
                    if carry and (t := self._carry(rank, inc_no, ev, own, prev_closed)):
                        max_step = max(max_step, t)
                    continue
                # self._contribute(step, rank, inc_no, ev, counted=True), inlined
                acc = steps.get(step)
                if acc is None:
                    steps[step] = acc = StepAcc()
                contrib = acc.ranks.get(rank)
                if contrib is None:  # (the usual event: the first of its rank and step)
                    acc.ranks[rank] = Contribution(inc_no, [ev], 1)
                    continue
                if contrib.incarnation < inc_no:
                    acc.ranks[rank] = contrib = _replaced(contrib, inc_no)
                if contrib.incarnation == inc_no:
                    contrib.events.append(ev)
                    contrib.count += 1
            elif kind is StepEnd:
                end: StepEnd = event  # type: ignore[assignment]  # its exact type
                if end.events >= 0 and end.step > shipped_upto and verify:
                    if prev_closed is None:
                        prev_closed = state.closed_before(inc_no)
                    if end.step > prev_closed and (whole or self._in_range(end.step)):
                        # self._verify(rank, inc_no, end.step, end.events), its usual
                        # outcome inlined: the count matches, nothing lost
                        acc = steps.get(end.step)
                        if (
                            acc is None
                            or (contrib := acc.ranks.get(rank)) is None
                            or contrib.count != end.events
                            or contrib.incarnation != inc_no
                        ):
                            self._verify(rank, inc_no, end.step, end.events)
                        elif acc.damaged:
                            acc.damaged.discard(rank)
                if end.step > inc.closed:
                    inc.closed = end.step
                if end.step > max_step:  # a frame is consumed once its step_end is shipped too
                    max_step = end.step
            elif kind is Gpu:
                sample: Gpu = event  # type: ignore[assignment]  # its exact type
                # a sample belongs to the step this rank is in (its own stream's order)
                step = sample.step if sample.step is not None else inc.watermark + 1
                if step > shipped_upto:
                    if step > max_step:
                        max_step = step
                    self._contribute(step, rank, inc_no, sample, counted=False)
            elif kind is RankStart:
                start: RankStart = event  # type: ignore[assignment]  # its exact type
                inc.world_size = start.world_size
                inc.host = start.host
                inc.started = start.ts
            elif kind is RankEnd:
                last: RankEnd = event  # type: ignore[assignment]  # its exact type
                inc.ended = last.status
            elif kind is Params:
                params: Params = event  # type: ignore[assignment]  # its exact type
                # the step after any this rank logged or closed (in any incarnation)
                effective = max(inc.max_step, inc.watermark, state.closed_before(inc_no)) + 1
                where = f"{seg.key}@{frame_end}#{nparams}"
                nparams += 1
                self._poll.params.append(ParamsRead(effective, rank, params.all(), fresh, where))
                # the owner decides what is new; until it shipped them, keep the frame
                holds = holds or fresh or effective > shipped_upto
        return max_step, holds

    def _carry(self, rank: int, inc_no: int, ev: StepEvent, own: int, prev_closed: int) -> int:
        """Put a late value with the next step its rank closes; that step (0: none).

        The carrier is the step after the rank's watermark when it logged the value (its
        own, or the one its earlier incarnation reached): a fact of the rank's stream, so
        live shipping, a restarted shipper and replay all pick the same one. A carrier
        already shipped (the rank was released, or the carrier was shipped by a process
        that died before committing) takes nothing: the value stays counted as late.
        """
        carrier = max(own, prev_closed) + 1
        if (
            carrier <= self.shipped_upto
            or self.durable_gap.holds(carrier)
            or self.restore_gap.holds(carrier)
        ):
            return 0
        contrib = self._contribution(carrier, rank, inc_no)
        if contrib is not None:
            contrib.late.append(ev)
        return carrier

    def _contribute(
        self, step: int, rank: int, inc_no: int, ev: Contributed, *, counted: bool
    ) -> None:
        """Add ``ev`` to what ``rank`` logged for ``step``; a later incarnation replaces.

        ``counted``: a step event (its rank's step_end counts those).
        """
        contrib = self._contribution(step, rank, inc_no)
        if contrib is not None:
            contrib.events.append(ev)
            contrib.count += counted

    def _contribution(self, step: int, rank: int, inc_no: int) -> Contribution | None:
        """What incarnation ``inc_no`` of ``rank`` holds for ``step`` (a later one replaces
        an earlier one's); None when a later incarnation of the rank holds the step."""
        acc = self.steps.get(step)
        if acc is None:
            self.steps[step] = acc = StepAcc()
        contrib = acc.ranks.get(rank)
        if contrib is None or contrib.incarnation < inc_no:
            acc.ranks[rank] = contrib = _replaced(contrib, inc_no)
        return contrib if contrib.incarnation == inc_no else None

    # -- what the owner asks ----------------------------------------------------------

    def released(self, state: RankState, now: float) -> bool:
        """Ended (rank_end) or silent for dead_after; either way, only once fully read."""
        return state.released(now, self.dead_after)

    def views(self, now: float) -> list[RankView]:
        """Every rank seen with an incarnation, as completeness needs it."""
        dead_after = self.dead_after
        return [s.view(r, now, dead_after) for r, s in self.ranks.items() if s.incs]

    def partials(
        self,
        steps: list[int],
        *,
        per_rank: bool,
        exact: bool,
        specs: dict[int, dict[str, str]] | None = None,
    ) -> list[StepPartial | None]:
        """The partial of each step in ``steps`` over this tail's ranks (None: nothing).

        ``specs`` (step -> ``m:name``/``t:name`` -> reduce spec) overrides the spec of
        this tail's lowest rank: in a fan-in, the spec of the job's lowest rank wins.
        """
        out: list[StepPartial | None] = []
        for step in steps:
            acc = self.steps.get(step)
            out.append(
                None
                if acc is None
                else StepPartial.build(
                    step,
                    acc,
                    per_rank=per_rank,
                    exact=exact,
                    specs=specs.get(step) if specs else None,
                )
            )
        return out

    def commit(self, shipped_upto: int, *, params_pending: bool) -> TailCommit:
        """Mark frames whose steps are all shipped as consumed; the cursor state to save."""
        self.sync(shipped_upto, self.durable_gap)
        segments = {}
        for seg in self.source.segments.values():
            frames = seg.frames
            n = 0
            for end, max_step, holds, next_seq, marks in frames:
                if max_step > shipped_upto or (holds and params_pending):
                    break
                seg.consumed, seg.consumed_seq = end, next_seq
                seg.consumed_state = marks
                n += 1
            if n:
                del frames[:n]
            if seg.exhausted and not frames:
                seg.consumed, seg.consumed_seq = seg.offset, seg.next_seq
            state = seg.consumed_state
            segments[seg.key] = SegmentCursor(
                offset=seg.consumed,
                seen=max(seg.offset, seg.seen),
                done=seg.exhausted and not frames,
                seq=-1 if seg.consumed_seq is None else seg.consumed_seq,
                closed=None if state is None else state[0],
                max_step=None if state is None else state[1],
                implied=None if state is None else state[2],
                names=seg.reader.names_before(seg.consumed),
            )
        ranks = {
            str(r): {str(k): v for k, v in s.incs.items()} for r, s in sorted(self.ranks.items())
        }
        out = TailCommit(segments, ranks, self._late, self._relogged, self._bad)
        self._late = self._relogged = 0
        self._bad = []
        return out


def _replaced(old: Contribution | None, inc_no: int) -> Contribution:
    """A new incarnation's contribution: the step's values start again, late ones stay.

    Late values are for steps closed already: the incarnation that logged them and then
    died before closing another step still logged them, once.
    """
    return Contribution(inc_no, late=old.late if old is not None else [])
