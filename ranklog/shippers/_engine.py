"""The shipper engine: tail the spool, apply events, ship complete steps, commit the cursor.

One loop, single-threaded::

    tails: discover segments -> read a bounded slice of each (rank by rank, in write order)
           -> apply events (per-step contributions, watermarks, ends, params)
    root:  ship every step all expected ranks have closed or released
           (partials of the tails, merged, reduced) -> flush -> commit cursor

The reading half is a :class:`~ranklog.shippers._tail.RankTail`; a shipper
owns one in its own process (:class:`LocalTails`), the Ray fan-in one per
reader actor (``ranklog.shippers._fanin``). Both go through the same root.

Completeness: step S ships when every expected rank has a watermark >= S
(``step_end``, or any event of a later step), or is released: its latest
incarnation wrote ``rank_end`` (other than on SIGTERM, after which a requeue may
bring it back), or it wrote no byte for ``dead_after`` seconds (then the step is
marked partial). With a known world size, ranks that never
appeared are waited for ``start_grace`` seconds after the run was created.

Incarnations, late and re-logged values: see :mod:`ranklog.shippers._tail`.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from typing import Final

from ranklog._proc import process_running
from ranklog.errors import (
    TailRestartedError,
    TransientTargetError,
)
from ranklog.schemas import ParamValue
from ranklog.shippers._cursor import (
    Cursor,
    adopt_legacy_cursor,
    check_not_deleted,
    cursor_path,
    load_cursor,
    save_cursor,
)
from ranklog.shippers._lease import DEFAULT_TTL, Lease, LeasePair, hold
from ranklog.shippers._meta import write_params
from ranklog.shippers._params import ParamsQueue
from ranklog.shippers._progress import Progress, Status
from ranklog.shippers._ranks import NO_GAP, RankView, check_late
from ranklog.shippers._registry import default_name
from ranklog.shippers._retry import RetryClock, describe, is_permanent, permanent_error
from ranklog.shippers._source import Source, SpoolSource
from ranklog.shippers._tails import LocalTails, Tails
from ranklog.shippers._target import (
    ShippedStep,
    Target,
    job_status,
    target_identity,
    target_place,
)
from ranklog.shippers._waited import Waited, waited
from ranklog.shippers._written import BELOW_LAST, TargetHeld
from ranklog.spool import BadRange, RunInfo, read_run

__all__ = ["BELOW_LAST", "EngineStats", "LocalTails", "Shipper", "Tails"]

log = logging.getLogger("ranklog.ship")

#: steps handed to the target in one write, at most
BATCH_STEPS: Final = 5000
#: values a write holds, about: fewer steps when steps are wide (the steps of a batch are
#: held reduced until it is written; each write is flushed and committed)
BATCH_VALUES: Final = 100_000


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
        name: str | None = None,
        poll: float | None = None,
        dead_after: float = 120.0,
        start_grace: float = 60.0,
        per_rank: bool = False,
        progress: Progress | None = None,
        source: Source | None = None,
        tails: Tails | None = None,
        lease_ttl: float = DEFAULT_TTL,
        late: str = "count",
        retry_for: float | None = None,
        parent: int | None = None,
        below_last: str = "refuse",
        argv: list[str] | None = None,
        keep_cursor: bool = True,
    ) -> None:
        """``name``: the cursor's (default: derived from what the target writes to).

        ``retry_for``: seconds a transient failure is retried before giving up (None: for
        ever); ``parent``: a process whose end makes the shipper ship what is closed and
        exit; ``below_last``: ``skip`` leaves out steps a target cannot write below its
        last one, instead of refusing; ``argv``: the ``ranklog ship`` arguments that
        start this shipper again (kept in the cursor); ``keep_cursor=False``: the cursor is
        kept in memory only, never written (a replay's: its target's steps say where it
        stands, and its spool is a scratch directory thrown away).
        """
        self.spool = spool
        self.target = target
        self.name = name or ""
        self._name_given = bool(name)
        self.dead_after = dead_after
        self.start_grace = start_grace
        self.per_rank = per_rank
        self.retry_for = retry_for
        self.parent = parent
        self.argv = list(argv) if argv is not None else None
        self._keep_cursor = keep_cursor
        if tails is None:
            src = source if source is not None else SpoolSource(spool, poll=poll)
            tails = LocalTails(src, dead_after=dead_after, late=check_late(late))
        self.tails: Tails = tails
        self.progress = progress
        #: every rank seen, as of the last read round
        self.views: dict[int, RankView] = {}
        self._waited: Waited | None = None  # what they say of completeness, found once
        #: steps some tail holds and that are not shipped yet
        self.pending: set[int] = set()
        self.lag_bytes = 0
        self.stats = EngineStats()
        #: hyperparameters known, shipped, and due before a step
        self.params = ParamsQueue()
        self.shipped_upto = -1  # steps <= this are shipped (or held by the target)
        self._width = 100  # values a shipped step held, on average, in the last batch
        #: steps of this run the target held when it was last opened: never sent again
        self.held = TargetHeld(target, below_last)
        #: (fan-in) steps a reader's earlier life had shipped: none in this engine
        self._durable_gap = NO_GAP
        self.run: RunInfo | None = None
        self.identity = target.spec
        self.cursor = Cursor(name=self.name, target=target.spec)
        self._last_commit = time.monotonic()
        self._target_ok = False
        self._open_error: BaseException | None = None
        self._opened = False
        self._late_warned = False
        self._said_names: set[str] = set()
        self._meta_said: set[str] = set()  # keys of run records said left out
        self._collisions: dict[int, int] = {}  # step -> names renamed in it, until shipped
        #: the job ended and everything was shipped: the target was told (Target.end)
        self.ended: str | None = None
        #: one shipper per (spool, target): held while running (made once the run is read)
        self.lease: Lease | LeasePair | None = None
        self._lease_ttl = lease_ttl

    # -- start ----------------------------------------------------------------------------

    def _identify(self) -> None:
        """Read the run; name the cursor and the lease after what the target writes to."""
        self.run = read_run(self.spool)
        self.identity = target_identity(self.target, self.run)
        if not self._name_given:
            self.name = default_name(self.identity)
            assert self.run is not None
            adopt_legacy_cursor(self.spool, default_name(self.target.spec), self.name, self.run)
        self.cursor.name = self.name
        self.lease = Lease(
            self.spool, default_name(self.identity), target=self.identity, ttl=self._lease_ttl
        )

    def _open(self) -> None:
        if self.run is None:
            self._identify()
        assert self.run is not None
        cursor = load_cursor(self.spool, self.name)
        if cursor is not None:
            cursor.check_owner(self.run.run_id, self.identity, self.target.spec)
            cursor.name = self.name  # (committed under this name, whatever the file said)
            self.cursor = cursor
            self.shipped_upto = cursor.last_step
            self.params.restore(cursor.params)
            self.stats.steps_shipped = cursor.steps_shipped
            self.stats.late_events = cursor.late_events
            self.stats.relogged_events = cursor.relogged_events
        self.cursor.run_id = self.run.run_id
        self.cursor.identity = self.identity
        self.cursor.target = self.target.spec
        if self.argv is not None:
            self.cursor.argv, self.cursor.cwd = self.argv, ""  # (never run again: data)
        self.tails.open(self.run, self.cursor)  # the object _commit keeps current
        self._target_ok = False  # opened by the loop, with retries (a server may be down)

    def _reopen_target(self) -> None:
        """(Re-)open the target and learn which steps of this run it holds.

        Called at start and after a failed write or flush: the target may hold more
        than the cursor says (it accepted steps, then the shipper died or failed
        before committing), or steps of this run a windowed replay wrote; nothing it
        holds is sent again. A permanent failure is raised; a transient one waits.
        """
        if self._opened:
            self._opened = False
            try:
                self.target.close()
            except Exception as exc:  # the target is broken anyway; open() will tell
                log.debug("closing %s after a failure: %s", self.target.spec, exc)
        assert self.run is not None
        try:
            held = self.target.open(self.run)
        except (OSError, TransientTargetError) as exc:
            if is_permanent(exc):
                raise permanent_error(self.target.spec, exc) from exc
            self._open_error = exc  # raised by the loop: retried
            self._target_ok = False
            return
        self._open_error = None
        self._target_ok = self._opened = True
        self.held.opened(held)
        if getattr(self.target, "held_known", True):  # (the console cannot tell)
            self.held.check_kept(self.cursor, cursor_path(self.spool, self.name))
        # segments compact --delete removed before they were shipped: the target must
        # hold their steps (a replay of the dataset), else nothing more is shipped
        check_not_deleted(self.spool, self.cursor, self.target.spec, self.held.steps)

    # -- reading --------------------------------------------------------------------------

    def _read(self) -> bool:
        """One read round of the tails; take in what it found."""
        res = self.tails.poll(self.shipped_upto, self._durable_gap, self._completeness().floor)
        self.views = {v.rank: v for v in res.views}
        self.pending = {s for s in res.steps if s > self.shipped_upto}
        self.lag_bytes = res.lag_bytes
        self.params.take(res.params, self.shipped_upto)
        return res.progressed

    # -- completeness -----------------------------------------------------------------

    def _completeness(self) -> Waited:
        """What the last round's views say of completeness (found again once they change)."""
        got = self._waited
        if got is None or got.views is not self.views or got.run is not self.run:
            got = self._waited = waited(self.views, self.run)
        return got

    def world_size(self) -> int | None:
        """The job's world size, if any rank or run.json told."""
        return self._completeness().world

    def _expected(self) -> list[int]:
        return self._completeness().expected

    def _in_grace(self, now: float) -> bool:
        """Ranks not seen yet may still start (the run is younger than the start grace)."""
        created = self.run.created if self.run is not None else now
        return now - created <= self.start_grace

    def _ready_upto(self, now: float) -> tuple[int, list[int]]:
        """(highest shippable step, expected ranks)."""
        w = self._completeness()
        limit = w.limit_at(self._in_grace(now))
        top = max(self.pending, default=-1)
        return (top if limit == math.inf else int(limit)), w.expected

    def all_released(self, now: float) -> bool:
        """Every expected rank ended or dead (and at least one rank seen)."""
        if not self.views:
            return False
        return self._completeness().limit_at(self._in_grace(now)) == math.inf

    # -- shipping ---------------------------------------------------------------------

    def _ready_steps(self, now: float) -> tuple[list[ShippedStep], int]:
        """The next batch of ready steps, reduced; and the last step the batch covers."""
        upto, expected = self._ready_upto(now)
        most = min(BATCH_STEPS, max(1, BATCH_VALUES // self._width))
        ready = sorted(s for s in self.pending if self.shipped_upto < s <= upto)[:most]
        if not ready:
            return [], self.shipped_upto
        world = max(len(expected), 1)
        w = self._completeness()
        sorted_marks = w.marks
        out = []
        for step, part in zip(
            ready, self.tails.partials(ready, per_rank=self.per_rank), strict=True
        ):
            if part is None:  # a tail lost it: read again rather than ship an empty step
                raise TailRestartedError(f"step {step} is no longer held by a tail")
            # a rank that lost frames of the step is not one that closed it whole
            closed = len(sorted_marks) - bisect.bisect_left(sorted_marks, step)
            if part.damaged:
                views = self.views
                closed -= sum(1 for r in set(part.damaged)
                              if (v := views.get(r)) is not None and v.watermark >= step
                              and w.expects(r))  # fmt: skip
            # Nothing to ship of the step itself: GPU samples taken after the last step,
            # until the ranks ended (they stay in the spool and Parquet), or nothing but
            # the late values it carries
            if not ((closed == 0 or part.ranks == 0) and part.only_gpu()):
                out.append(part.finish(closed=closed, world_size=world))
            if part.late:
                if getattr(self.target, "takes_late", False):
                    out.extend(part.shipped_late(world))
                elif not self._late_warned:
                    self._late_warned = True
                    log.warning("%s does not take late values (no takes_late): they are left "
                                "out, counted as late", self.target.spec)  # fmt: skip
            if part.renamed:
                self._renamed(step, part.renamed)
        if out:
            self._width = max(1, sum(len(s.metrics) for s in out) // len(out))
        return out, ready[-1]

    def _renamed(self, step: int, renamed: list[tuple[str, str]]) -> None:
        """Names that met in a step: counted once it ships; each said once."""
        self._collisions[step] = len(renamed)
        for name, shipped in renamed:
            if name not in self._said_names:
                self._said_names.add(name)
                log.warning("step %d: %r is logged under that name and also derived (a timer, "
                            "or a metric with several reduce ops): the derived value ships "
                            "as %r (said once per name)", step, name, shipped)  # fmt: skip

    def _write_params(self, group: dict[str, ParamValue]) -> None:
        write_params(self.target, group, self._meta_said)

    def _ship(self, steps: list[ShippedStep], *, final: bool = False, through: int = -1) -> None:
        """Hand steps (and the params due before them) to the target; flush; commit.

        ``through``: the last step this batch covers (steps with nothing to ship, too).

        Params logged while a rank was at step S are written just before the first
        shipped step >= S (or at the very end): the same place live and in replay.
        Steps the target holds are not sent again; the params due before them were
        written with them.
        """
        assert self.lease is not None
        self.lease.check()  # a shipper that lost its lease sends nothing more
        due = self.params.in_order()
        sent = 0
        chunk: list[ShippedStep] = []
        written: list[ShippedStep] = []
        held = 0  # steps found held (shipped by an earlier process or replay)
        skipped = self.held.skipped_below
        for s in self.held.writable(steps):
            if s.carrier is not None:  # late values: right after their carrier
                if not self.held.holds(s):
                    chunk.append(s)
                continue
            if self.held.holds(s):
                while sent < len(due) and due[sent][0] <= s.step:
                    sent += 1  # written before this step, which the target holds
                held += 1
                continue
            group: dict[str, ParamValue] = {}
            while sent < len(due) and due[sent][0] <= s.step:
                group[due[sent][1]] = due[sent][2]
                sent += 1
            if group:
                if chunk:
                    self.target.write(chunk)
                    chunk = []
                self._write_params(group)
            chunk.append(s)
            written.append(s)
        if chunk:
            self.target.write(chunk)
        if final and sent < len(due):
            self._write_params({k: v for _, k, v in due[sent:]})
            sent = len(due)
        self.target.flush()
        # accepted: move on
        self.params.accepted(due[:sent])
        for s in steps:
            self.cursor.name_collisions += self._collisions.pop(s.step, 0)
        self.stats.steps_shipped += held  # the target holds them: shipped, as it counts
        self.held.said(held)
        self.cursor.skipped_below += self.held.skipped_below - skipped
        self.stats.steps_shipped += len(written)
        self.stats.partial_steps += sum(not s.complete for s in written)
        top = max(through, steps[-1].step if steps else -1)
        if top > self.shipped_upto:
            self.shipped_upto = top
            self.pending = {p for p in self.pending if p > top}
        self._commit()

    def _commit(self) -> None:
        assert self.lease is not None
        self.lease.check()
        state = self.tails.commit(
            self.shipped_upto, self._durable_gap, params_pending=bool(self.params.due)
        )
        c = self.cursor
        c.segments.update(state.segments)
        c.ranks.update(state.ranks)
        self.stats.late_events += state.late_events
        self.stats.relogged_events += state.relogged_events
        for b in state.bad:
            self.stats.bad.append(b)
            c.bad_ranges += 1
            c.bad_bytes += b.length
        c.last_step = self.shipped_upto
        c.steps_shipped = self.stats.steps_shipped
        c.late_events = self.stats.late_events
        c.relogged_events = self.stats.relogged_events
        c.params = dict(self.params.shipped)
        if self._keep_cursor:
            save_cursor(self.spool, c)

    # -- the loop ---------------------------------------------------------------------

    def step_once(self) -> tuple[bool, int]:
        """One round: discover, read, ship. Returns (read anything, steps shipped)."""
        progressed = self._read()
        shipped = 0
        while True:
            try:
                steps, through = self._ready_steps(time.time())
            except TailRestartedError as exc:
                log.warning("%s; reading again", exc)
                time.sleep(0.5)  # a reader restarting in a loop must not spin the root
                return True, shipped
            if steps or through > self.shipped_upto:
                self._ship(steps, through=through)
                shipped += len(steps)
                continue
            if self.params.due and not self.pending and self.all_released(time.time()):
                self._ship([], final=True)  # params logged after the last step
            break
        # Steps up to the global watermark that nobody logged anything for are done too:
        # anything that arrives for them now is late.
        upto, _ = self._ready_upto(time.time())
        held = any(self.shipped_upto < s <= upto for s in self.pending)
        if upto > self.shipped_upto and not held:
            self.shipped_upto = upto
        return progressed, shipped

    def lag(self) -> tuple[int, int]:
        """(steps closed by some rank but not shipped, bytes not yet consumed)."""
        top = max((v.watermark for v in self.views.values()), default=-1)
        return max(0, top - self.shipped_upto), self.lag_bytes

    def status(self) -> Status:
        """Where this shipper stands, for its status line."""
        live, ended, dead = Status.ranks(self.views.values(), time.time(), self.dead_after)
        lag_steps, lag_bytes = self.lag()
        return Status(
            name=self.name,
            step=self.shipped_upto,
            shipped=self.stats.steps_shipped,
            partial=self.stats.partial_steps,
            live=live,
            ended=ended,
            dead=dead,
            lag_steps=lag_steps,
            lag_bytes=lag_bytes,
            late=self.stats.late_events,
            corrupt=len(self.stats.bad),
        )

    def _final_commit(self) -> None:
        """The last cursor write; a full disk is waited out (up to a minute) before giving up."""
        backoff = 0.5
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._commit()
                return
            except OSError as exc:
                if time.monotonic() > deadline or is_permanent(exc):
                    raise
                log.warning("cannot write the cursor (%s); retrying in %.1fs",
                            describe(exc), backoff)  # fmt: skip
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _finish_job(self) -> None:
        """Every rank ended and everything is shipped: tell the target how (``Target.end``)."""
        end = getattr(self.target, "end", None)
        if self.ended is None and callable(end) and self._opened:
            # a rank the job expected that never wrote a byte did not finish either
            never = ["dead" for r in self._expected() if r not in self.views]
            status = job_status([*(v.status for v in self.views.values()), *never])
            end(status)
            self.ended = status

    def _failure(self, exc: BaseException, clock: RetryClock) -> None:
        """Raise the error that ends the shipper, or return to retry ``exc`` later."""
        clock.check(exc, self.target.spec, self.spool, f"shipped up to step {self.shipped_upto}")

    def run_forever(self, *, once: bool = False, max_seconds: float | None = None) -> int:
        """Ship until done: ``once`` drains what is ready and returns; else follows the job.

        Raises :class:`~ranklog.errors.LeaseHeldError` when another shipper ships to the
        same target from the same spool, :class:`~ranklog.errors.TargetError` on a
        permanent target failure, or a transient one that outlasted ``retry_for``.
        Once every rank ended and everything was shipped, the target is told how the
        job ended (``Target.end``).
        """
        clock = RetryClock(self.retry_for)
        try:
            self._identify()
            assert self.lease is not None and isinstance(self.lease, Lease) and self.run
            place = target_place(self.target, self.run)  # (before: it may make the file)
            self.lease = hold(self.lease, place and default_name(place), clock)
        except BaseException:
            self.tails.close()
            raise
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        backoff = 0.0
        try:
            self._open()
            while True:
                try:
                    self.lease.check()
                    if not self._target_ok:
                        self._reopen_target()
                        if not self._target_ok:
                            raise self._open_error or TransientTargetError("cannot be opened")
                    progressed, shipped = self.step_once()
                    if shipped:
                        self._last_commit = time.monotonic()
                    elif progressed and time.monotonic() - self._last_commit > 5.0:
                        self._commit()  # record frames read that hold no step (ends, seals)
                        self._last_commit = time.monotonic()
                    idle = not (progressed or shipped or self.pending)
                    if idle and self.all_released(time.time()):
                        self._finish_job()
                    backoff = 0.0
                    clock.ok()
                except (OSError, TransientTargetError) as exc:
                    # target or filesystem trouble (a full disk too): the cursor stays; retry
                    # from what the target durably holds, as a restarted shipper would
                    self._failure(exc, clock)
                    backoff = min(max(backoff * 2, 0.5), 30.0)
                    log.warning("%s: %s; retrying in %.1fs",
                                self.target.spec, describe(exc), backoff)  # fmt: skip
                    time.sleep(backoff)
                    try:
                        if self._target_ok:  # it failed writing: open it again now
                            self._reopen_target()
                    except (OSError, TransientTargetError) as again:
                        self._failure(again, clock)
                        self._target_ok = False
                    continue
                if self.progress is not None:
                    self.progress.update(self.status)
                if progressed or shipped:
                    continue
                if self.ended is not None or once:
                    break
                if self.all_released(time.time()) and not self.pending:
                    break
                if self.parent is not None and not process_running(self.parent):
                    self._orphaned()
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.tails.wait(1.0)
            self._final_commit()
        finally:
            try:
                self.tails.close()
                if self._opened:
                    self.target.close()
            finally:  # a target that fails closing still lets the next shipper in
                self.lease.release()
        if self.progress is not None:  # (a failure says what happened in its own line)
            self.progress.done(self.status())
        return 0

    def _orphaned(self) -> None:
        """The training process that started this shipper ended: say what is left."""
        top = max((v.watermark for v in self.views.values()), default=-1)
        if top > self.shipped_upto or self.pending:
            log.warning(
                "process %d (training) ended: shipped up to step %d; steps its ranks closed "
                "later ship with `ranklog ship %s --once` (or at the next start)",
                self.parent, self.shipped_upto, shlex.quote(os.path.abspath(self.spool)),
            )  # fmt: skip
        else:
            log.info("process %d (training) ended: everything it closed is shipped (step %d)",
                     self.parent, self.shipped_upto)  # fmt: skip
