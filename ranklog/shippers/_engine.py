"""The shipper engine: tail the spool, apply events, ship complete steps, commit the cursor.

One loop, single-threaded::

    discover segments -> read a bounded slice of each (rank by rank, in write order)
    -> apply events (per-step contributions, watermarks, ends, params)
    -> ship every step all expected ranks have closed or released -> flush -> commit cursor

Completeness: step S ships when every expected rank has a watermark >= S
(``step_end``, or any event of a later step), or is released: its latest
incarnation wrote ``rank_end`` (other than on SIGTERM, after which a requeue may
bring it back), or it wrote no byte for ``dead_after`` seconds (then the step is
marked partial). With a known world size, ranks that never
appeared are waited for ``start_grace`` seconds after the run was created.

Incarnations: a new incarnation ends the previous one at once. For each rank
and step the values of the first incarnation that *closed* the step count;
values re-logged by a later incarnation for such a step are counted as
re-logged and not shipped; values of an incarnation that never closed a step
are replaced by those of the later incarnation that logs it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Final

from ranklog.errors import RanklogError
from ranklog.schemas import (
    Event,
    Gpu,
    Params,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
)
from ranklog.shippers._cursor import Cursor, IncState, SegmentCursor, load_cursor, save_cursor
from ranklog.shippers._progress import Progress
from ranklog.shippers._source import SegState, Source, SpoolSource
from ranklog.shippers._steps import STEP_KINDS, Contribution, StepAcc, StepEvent, reduce_step
from ranklog.shippers._target import ShippedStep, Target, TransientTargetError
from ranklog.spool import BadRange, RunInfo, read_run

__all__ = ["EngineStats", "Shipper"]

log = logging.getLogger("ranklog.ship")

#: bytes read from one segment per round: bounds memory whatever the spool's size
ROUND_BYTES: Final = 256 * 1024
#: steps handed to the target in one write
BATCH_STEPS: Final = 1000
#: past this many steps waiting in memory, only the ranks holding them back are read
MAX_PENDING_STEPS: Final = 1024
_NO_STEP: Final = -1
_PARAMS_HOLD: Final = 1 << 62


@dataclass(slots=True)
class RankState:
    """The shipper's view of one rank across its incarnations."""

    incs: dict[int, IncState] = field(default_factory=dict)
    #: latest sign of life: a segment's mtime, or when this shipper saw one grow
    last_activity: float = 0.0
    #: every byte this rank wrote so far has been read (nothing left but a live tail)
    caught_up: bool = False

    @property
    def latest(self) -> int:
        """The newest incarnation seen."""
        return max(self.incs) if self.incs else 0

    def watermark(self) -> int:
        """Highest step this rank has closed, over all incarnations."""
        return max((max(s.closed, s.max_step - 1) for s in self.incs.values()), default=-1)

    def ended(self) -> bool:
        """Whether the newest incarnation wrote rank_end, and not because of a signal.

        A rank ended by SIGTERM (``status == "signal"``: a SLURM requeue or preemption,
        torchrun stopping its workers) may well come back as a new incarnation: it is
        released like a silent rank, after ``dead_after``, not at once.
        """
        if not self.incs:
            return False
        status = self.incs[self.latest].ended
        return status is not None and status != "signal"

    def closed_before(self, inc: int) -> int:
        """Highest step closed (step_end, or a later step) by an incarnation before ``inc``."""
        return max(
            (max(s.closed, s.max_step - 1) for k, s in self.incs.items() if k < inc), default=-1
        )


@dataclass(slots=True)
class EngineStats:
    """Counters shown in status lines and kept in the cursor."""

    steps_shipped: int = 0
    partial_steps: int = 0
    late_events: int = 0
    relogged_events: int = 0
    bad: list[BadRange] = field(default_factory=list)


class Shipper:
    """Ships one spool to one target, exactly once per step, resumable after any kill."""

    def __init__(
        self,
        spool: str,
        target: Target,
        *,
        name: str,
        poll: float | None = None,
        dead_after: float = 120.0,
        start_grace: float = 60.0,
        per_rank: bool = False,
        progress: Progress | None = None,
        source: Source | None = None,
    ) -> None:
        self.spool = spool
        self.target = target
        self.name = name
        self.dead_after = dead_after
        self.start_grace = start_grace
        self.per_rank = per_rank
        self.source: Source = source if source is not None else SpoolSource(spool, poll=poll)
        self.progress = progress
        self.ranks: dict[int, RankState] = {}
        self.steps: dict[int, StepAcc] = {}
        self.stats = EngineStats()
        self.params: dict[str, ParamValue] = {}
        self.params_shipped: dict[str, ParamValue] = {}
        #: new or changed params, in log order: (step before which to ship, key, value)
        self.params_due: list[tuple[int, str, ParamValue]] = []
        self.shipped_upto = -1  # steps <= this are shipped (or held by the target)
        self._durable_gap = (-1, -1)  # (cursor step, target step): shipped by a dead process
        self.run: RunInfo | None = None
        self.cursor = Cursor(name=name, target=target.spec)
        self._last_commit = time.monotonic()
        self._target_ok = False
        self._opened = False

    # -- start ----------------------------------------------------------------------------

    def _open(self) -> None:
        self.run = read_run(self.spool)
        cursor = load_cursor(self.spool, self.name)
        if cursor is not None:
            if cursor.run_id not in (None, self.run.run_id):
                raise RanklogError(
                    f"cursor {self.name!r} belongs to run {cursor.run_id}, "
                    f"not {self.run.run_id}: use another --name"
                )
            self.cursor = cursor
            self.shipped_upto = cursor.last_step
            self.params_shipped = dict(cursor.params)
            self.params = dict(cursor.params)
            self.stats.steps_shipped = cursor.steps_shipped
            self.stats.late_events = cursor.late_events
            self.stats.relogged_events = cursor.relogged_events
            if cursor.target not in ("", self.target.spec):
                raise RanklogError(
                    f"cursor {self.name!r} belongs to target {cursor.target}, "
                    f"not {self.target.spec}: use another --name"
                )
            for rank, incs in cursor.ranks.items():
                # Watermarks past the last shipped step are rebuilt by re-reading: the
                # values they cover are past the committed offsets and not read yet.
                restored = {}
                for k, v in incs.items():
                    v.closed = min(v.closed, cursor.last_step)
                    v.max_step = min(v.max_step, cursor.last_step + 1)
                    restored[int(k)] = v
                self.ranks[int(rank)] = RankState(restored)
        self.cursor.run_id = self.run.run_id
        self._target_ok = False  # opened by the loop, with retries (a server may be down)

    def _reopen_target(self) -> None:
        """(Re-)open the target and drop the steps it already holds.

        Called at start and after a failed write or flush: the target may hold more
        than the cursor says (it accepted steps, then the shipper died or failed
        before committing), and nothing it holds is sent again.
        """
        if self._opened:
            self._opened = False
            try:
                self.target.close()
            except Exception as exc:  # the target is broken anyway; open() will tell
                log.debug("closing %s after a failure: %s", self.target.spec, exc)
        assert self.run is not None
        try:
            durable = self.target.open(self.run)
        except (OSError, TransientTargetError) as exc:
            log.warning("re-opening %s failed (%s)", self.target.spec, exc)
            self._target_ok = False
            return
        self._target_ok = self._opened = True
        if durable is not None and durable > self.shipped_upto:
            log.info("%s already holds steps up to %d (cursor: %d); not sending them again",
                     self.target.spec, durable, self.shipped_upto)  # fmt: skip
            for step in [s for s in self.steps if s <= durable]:
                del self.steps[step]
            self._durable_gap = (self.shipped_upto, durable)
            self.shipped_upto = durable

    # -- reading --------------------------------------------------------------------------

    def _discover(self) -> None:
        for seg in self.source.discover():
            saved = self.cursor.segments.get(seg.key)
            if saved is not None:
                seg.offset = seg.consumed = saved.offset
                seg.seen = saved.seen
                seg.exhausted = saved.done
            rank = self.ranks.setdefault(seg.name.rank, RankState())
            rank.incs.setdefault(seg.name.incarnation, IncState())

    def _read_round(self) -> bool:
        """Read one bounded slice of every readable segment; True if anything was read."""
        progressed = False
        now = time.time()
        readable = self._readable_ranks(now)
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
                res = seg.reader.read(seg.offset, writer_gone=later, max_bytes=ROUND_BYTES)
                if res.end != seg.offset or res.frames:
                    progressed = True
                if seg.reader.header is not None and not self._identity_ok(seg):
                    continue
                for frame in res.frames:
                    max_step, holds = self._apply(rank, seg, frame.events, frame.end)
                    seg.frames.append((frame.end, max_step, holds))
                if res.bad:
                    self._report_bad(res.bad, seg)
                seg.offset = res.end
                if res.seal is not None:
                    seg.sealed = True
                if res.more:
                    state.caught_up = False
                    break  # budget used: the rest of this rank next round
                if seg.sealed or later:
                    seg.exhausted = True
                    if not seg.frames:
                        seg.consumed = seg.offset
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

    def _readable_ranks(self, now: float) -> set[int] | None:
        """Ranks to read this round: all (None), unless too many steps wait in memory.

        Past ``MAX_PENDING_STEPS`` only the ranks holding the oldest steps back are
        read: reading the others would only add steps that cannot ship yet.
        """
        if len(self.steps) <= MAX_PENDING_STEPS:
            return None
        limits = {
            r: s.watermark()
            for r, s in self.ranks.items()
            if not (s.caught_up and self._released(s, now))
        }
        if not limits:
            return set()
        floor = min(limits.values())
        return {r for r, m in limits.items() if m == floor}

    def _identity_ok(self, seg: SegState) -> bool:
        """The header, not the path, is a segment's identity: refuse a foreign file."""
        h = seg.reader.header
        assert h is not None and self.run is not None
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
            self.stats.bad.append(b)
            self.cursor.bad_ranges += 1
            self.cursor.bad_bytes += b.length
            log.warning("corrupt spool bytes skipped: %s", b)

    def _apply(
        self, rank: int, seg: SegState, events: list[Event], frame_end: int
    ) -> tuple[int, bool]:
        """Apply one frame's events; return (highest step in it, holds new params)."""
        inc_no = seg.name.incarnation
        state = self.ranks[rank]
        inc = state.incs.setdefault(inc_no, IncState())
        fresh = frame_end > seg.seen  # not examined by an earlier shipper process
        max_step = _NO_STEP
        holds = False
        prev_closed: int | None = None
        for ev in events:
            if isinstance(ev, STEP_KINDS):
                step = ev.step
                own = inc.closed if inc.closed > inc.max_step - 1 else inc.max_step - 1
                if step > max_step:
                    max_step = step
                if step > inc.max_step:
                    inc.max_step = step
                if prev_closed is None:
                    prev_closed = state.closed_before(inc_no)
                if step <= prev_closed:  # closed by an earlier incarnation: re-logged
                    if fresh and step > self._durable_gap[1]:
                        self.stats.relogged_events += 1
                    continue
                if step <= own or step <= self.shipped_upto:
                    # Late: this rank had closed the step already (its own watermark: the
                    # same verdict whatever order ranks are read in), or it was shipped.
                    if fresh and not (self._durable_gap[0] < step <= self._durable_gap[1]):
                        self.stats.late_events += 1
                    continue
                self._contribute(step, rank, inc_no, ev)
            elif isinstance(ev, Gpu):
                # a sample belongs to the step this rank is in (its own stream's order)
                step = ev.step if ev.step is not None else max(inc.closed, inc.max_step - 1) + 1
                if step > self.shipped_upto:
                    if step > max_step:
                        max_step = step
                    self._contribute(step, rank, inc_no, ev)
            elif isinstance(ev, StepEnd):
                if ev.step > inc.closed:
                    inc.closed = ev.step
                if ev.step > max_step:  # a frame is consumed once its step_end is shipped too
                    max_step = ev.step
            elif isinstance(ev, RankStart):
                inc.world_size = ev.world_size
                inc.host = ev.host
                inc.started = ev.ts
            elif isinstance(ev, RankEnd):
                inc.ended = ev.status
            elif isinstance(ev, Params):
                effective = inc.max_step + 1 if inc.max_step >= 0 else 0
                for k, v in ev.values.items():
                    if k not in self.params or self.params[k] != v:
                        self.params[k] = v
                        if effective <= self.shipped_upto:
                            # shipped before step `effective`, which the target holds
                            self.params_shipped[k] = v
                            continue
                        holds = True
                        self.params_due.append((effective, k, v))
        return max_step, holds

    def _contribute(self, step: int, rank: int, inc_no: int, ev: StepEvent) -> None:
        """Add ``ev`` to what ``rank`` logged for ``step``; a later incarnation replaces."""
        acc = self.steps.get(step)
        if acc is None:
            self.steps[step] = acc = StepAcc()
        contrib = acc.ranks.get(rank)
        if contrib is None or contrib.incarnation < inc_no:
            acc.ranks[rank] = contrib = Contribution(inc_no)
        if contrib.incarnation == inc_no:
            contrib.events.append(ev)

    # -- completeness -----------------------------------------------------------------

    def world_size(self) -> int | None:
        """The job's world size, if any rank or run.json told."""
        sizes = [s.world_size for r in self.ranks.values() for s in r.incs.values()]
        known = [w for w in sizes if w is not None]
        if self.run is not None and self.run.world_size is not None:
            known.append(self.run.world_size)
        return max(known) if known else None

    def _released(self, state: RankState, now: float) -> bool:
        """Ended (rank_end) or silent for dead_after; either way, only once fully read."""
        if not state.caught_up:
            return False
        return state.ended() or now - state.last_activity > self.dead_after

    def _ready_upto(self, now: float) -> tuple[int, list[int]]:
        """(highest shippable step, expected ranks)."""
        world = self.world_size()
        expected = list(range(world)) if world is not None else sorted(self.ranks)
        limit = math.inf
        created = self.run.created if self.run is not None else now
        for r in expected:
            state = self.ranks.get(r)
            if state is None or not state.incs:
                if now - created <= self.start_grace:
                    limit = -1
                continue
            if not self._released(state, now):
                limit = min(limit, state.watermark())
        top = max(self.steps, default=-1)
        return (top if limit == math.inf else int(limit)), expected

    def all_released(self, now: float) -> bool:
        """Every expected rank ended or dead (and at least one rank seen)."""
        world = self.world_size()
        expected = list(range(world)) if world is not None else sorted(self.ranks)
        created = self.run.created if self.run is not None else now
        if not self.ranks:
            return False
        for r in expected:
            state = self.ranks.get(r)
            if state is None or not state.incs:
                if now - created <= self.start_grace:
                    return False
                continue
            if not self._released(state, now):
                return False
        return True

    # -- shipping ---------------------------------------------------------------------

    def _ready_steps(self, now: float) -> list[ShippedStep]:
        upto, expected = self._ready_upto(now)
        ready = sorted(s for s in self.steps if self.shipped_upto < s <= upto)[:BATCH_STEPS]
        if not ready:
            return []
        world = max(len(expected), 1)
        marks = {r: self.ranks[r].watermark() for r in expected if r in self.ranks}
        out = []
        for step in ready:
            closed = sum(1 for m in marks.values() if m >= step)
            out.append(
                reduce_step(
                    step, self.steps[step], closed=closed, world_size=world, per_rank=self.per_rank
                )
            )
        return out

    def _ship(self, steps: list[ShippedStep], *, final: bool = False) -> None:
        """Hand steps (and the params due before them) to the target; flush; commit.

        Params logged while a rank was at step S are written just before the first
        shipped step >= S (or at the very end): the same place live and in replay.
        """
        due = sorted(self.params_due, key=lambda d: d[0])  # stable: log order kept
        sent = 0
        chunk: list[ShippedStep] = []
        for s in steps:
            group: dict[str, ParamValue] = {}
            while sent < len(due) and due[sent][0] <= s.step:
                group[due[sent][1]] = due[sent][2]
                sent += 1
            if group:
                if chunk:
                    self.target.write(chunk)
                    chunk = []
                self.target.write_params(group)
            chunk.append(s)
        if chunk:
            self.target.write(chunk)
        if final and sent < len(due):
            self.target.write_params({k: v for _, k, v in due[sent:]})
            sent = len(due)
        self.target.flush()
        # accepted: move on
        for _, k, v in due[:sent]:
            self.params_shipped[k] = v
        done = set(map(id, due[:sent]))
        self.params_due = [d for d in self.params_due if id(d) not in done]
        for s in steps:
            self.steps.pop(s.step, None)
            self.stats.steps_shipped += 1
            self.stats.partial_steps += not s.complete
        if steps:
            self.shipped_upto = steps[-1].step
        self._commit()

    def _commit(self) -> None:
        c = self.cursor
        params_pending = bool(self.params_due)
        for seg in self.source.segments.values():
            frames = seg.frames
            n = 0
            for end, max_step, holds in frames:
                if max_step > self.shipped_upto or (holds and params_pending):
                    break
                seg.consumed = end
                n += 1
            if n:
                del frames[:n]
            if seg.exhausted and not frames:
                seg.consumed = seg.offset
            c.segments[seg.key] = SegmentCursor(
                offset=seg.consumed,
                seen=max(seg.offset, seg.seen),
                done=seg.exhausted and not frames,
            )
        c.last_step = self.shipped_upto
        c.steps_shipped = self.stats.steps_shipped
        c.late_events = self.stats.late_events
        c.relogged_events = self.stats.relogged_events
        c.params = dict(self.params_shipped)
        c.ranks = {
            str(r): {str(k): v for k, v in s.incs.items()} for r, s in sorted(self.ranks.items())
        }
        save_cursor(self.spool, c)

    # -- the loop ---------------------------------------------------------------------

    def step_once(self) -> tuple[bool, int]:
        """One round: discover, read, ship. Returns (read anything, steps shipped)."""
        self._discover()
        progressed = self._read_round()
        shipped = 0
        while True:
            steps = self._ready_steps(time.time())
            if steps:
                self._ship(steps)
                shipped += len(steps)
                continue
            if self.params_due and not self.steps and self.all_released(time.time()):
                self._ship([], final=True)  # params logged after the last step
            break
        # Steps up to the global watermark that nobody logged anything for are done too:
        # anything that arrives for them now is late.
        upto, _ = self._ready_upto(time.time())
        if upto > self.shipped_upto and not any(self.shipped_upto < s <= upto for s in self.steps):
            self.shipped_upto = upto
        return progressed, shipped

    def lag(self) -> tuple[int, int]:
        """(steps closed by some rank but not shipped, bytes not yet consumed)."""
        top = max((s.watermark() for s in self.ranks.values()), default=-1)
        nbytes = sum(max(0, s.size - s.consumed) for s in self.source.segments.values())
        return max(0, top - self.shipped_upto), nbytes

    def run_forever(self, *, once: bool = False, max_seconds: float | None = None) -> int:
        """Ship until done: ``once`` drains what is ready and returns; else follows the job."""
        self._open()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        backoff = 0.0
        try:
            while True:
                try:
                    if not self._target_ok:
                        self._reopen_target()
                        if not self._target_ok:
                            raise TransientTargetError(f"{self.target.spec} cannot be opened")
                    progressed, shipped = self.step_once()
                    backoff = 0.0
                except (OSError, TransientTargetError) as exc:
                    # target or filesystem trouble: the cursor stays; retry from what the
                    # target durably holds, as a restarted shipper would
                    backoff = min(max(backoff * 2, 0.5), 30.0)
                    log.warning("shipping to %s failed (%s); retrying in %.1fs",
                                self.target.spec, exc, backoff)  # fmt: skip
                    time.sleep(backoff)
                    if self._target_ok:
                        self._reopen_target()
                    continue
                if self.progress is not None:
                    self.progress.update(self)
                if shipped:
                    self._last_commit = time.monotonic()
                elif progressed and time.monotonic() - self._last_commit > 5.0:
                    self._commit()  # record frames read that hold no step (ends, seals)
                    self._last_commit = time.monotonic()
                if progressed or shipped:
                    continue
                if once:
                    break
                if self.all_released(time.time()) and not self.steps:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.source.wait(1.0)
            self._commit()
        finally:
            self.source.close()
            if self._opened:
                self.target.close()
            if self.progress is not None:
                self.progress.done(self)
        return 0
