"""A read-only summary of a spool: ranks, incarnations, steps, ends and damage."""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from ranklog._proc import process_running
from ranklog.schemas import STEP_KINDS, Heartbeat, RankEnd, RankStart, StepEnd
from ranklog.spool._layout import SegmentName, SpoolLayout, read_run
from ranklog.spool._reader import BadRange, SegmentReader

#: the silence after which a shipper declares a rank dead (``ranklog ship --dead-after``)
DEAD_AFTER: Final = 120.0

__all__ = [
    "DEAD_AFTER",
    "IncarnationSummary",
    "ShipperSummary",
    "SpoolSummary",
    "format_summary",
    "summarize",
]


@dataclass(slots=True)
class IncarnationSummary:
    """What one incarnation of one rank wrote."""

    rank: int
    incarnation: int
    segments: int = 0
    sealed: bool = False
    bytes: int = 0
    frames: int = 0
    events: int = 0
    host: str | None = None
    pid: int | None = None
    world_size: int | None = None
    started: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    closed_step: int | None = None
    late_events: int = 0
    last_event: float | None = None
    last_heartbeat: float | None = None
    end_status: str | None = None
    exit_code: int | None = None
    pending_bytes: int = 0
    bad_frames: int = 0
    bad_bytes: int = 0
    unknown_kinds: int = 0
    unknown_fields: int = 0
    #: the incarnation of the same rank that started after this one (a relaunch)
    superseded_by: int | None = None
    #: it went on writing after that incarnation started: two processes had one rank id
    conflict: bool = False
    #: its process is gone: its pid is not running on this host (None: not of this host)
    process_gone: bool | None = None
    #: seconds since it last wrote (an event, a heartbeat, a byte), when inspected
    silent: float | None = None
    #: silence after which a shipper declares a rank dead and releases it (``--dead-after``)
    dead_after: float = DEAD_AFTER

    @property
    def state(self) -> str:
        """What a shipper makes of this incarnation: ``ended (status)`` once rank_end was
        read; ``crashed`` when a relaunch started without one, or once it was silent for
        ``dead_after`` (a shipper released it: its steps ship as partial); ``dead`` when its
        process is gone from this host but a shipper still waits out ``dead_after``; else
        ``open`` (it runs, or a process elsewhere may still write)."""
        later = "" if self.superseded_by is None else f", superseded by {self.superseded_by}"
        closed = "nothing closed" if self.closed_step is None else f"closed {self.closed_step}"
        if self.conflict:
            return (f"conflict: still written after incarnation {self.superseded_by} started "
                    "(two processes with one rank id?)")  # fmt: skip
        if self.end_status is not None:
            return f"ended ({self.end_status}){later}"
        if self.superseded_by is not None:
            return f"crashed{later}"
        gone = "process gone, " if self.process_gone else ""
        if self.silent is not None and self.silent > self.dead_after:
            return f"crashed ({gone}silent {self.silent:.0f}s, released; {closed})"
        if self.process_gone:
            return (f"dead (process gone; a shipper releases it once silent "
                    f"{self.dead_after:g}s; {closed})")  # fmt: skip
        return "open"


@dataclass(slots=True)
class ShipperSummary:
    """One shipper's progress (its cursor) and whether it runs (its lease)."""

    name: str
    target: str
    last_step: int
    steps_shipped: int
    lag_steps: int
    lag_bytes: int
    late_events: int
    relogged_events: int
    bad_ranges: int
    updated: float
    #: ``running (pid P)`` on this host, ``running on H (renewed Ns ago)`` elsewhere,
    #: ``silent on H for Ns`` (its lease will be taken over), or ``stopped``
    state: str = "stopped"
    #: what the target writes to (``jsonl:/real/path``)
    identity: str = ""
    #: steps left out because the target cannot write below its last (``--below-last skip``)
    skipped_below: int = 0
    #: derived names that met a logged one and shipped renamed (``name.derived``)
    name_collisions: int = 0


@dataclass(slots=True)
class SpoolSummary:
    """Everything ``ranklog inspect`` prints."""

    spool: str
    run_id: str | None
    name: str | None
    created: float | None
    world_size: int | None
    incarnations: list[IncarnationSummary] = field(default_factory=list)
    bad: list[BadRange] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    shippers: list[ShipperSummary] = field(default_factory=list)
    #: segment key ("rank/incarnation-segment") -> size in bytes
    sizes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``ranklog inspect --json``)."""
        out = asdict(self)
        for inc, d in zip(self.incarnations, out["incarnations"], strict=True):
            d["state"] = inc.state
        return out


def summarize(
    root: str | os.PathLike[str], *, now: float | None = None, dead_after: float = DEAD_AFTER
) -> SpoolSummary:
    """Read every segment of a spool (never raises on corrupt bytes); each incarnation's
    state as a shipper with ``dead_after`` judges it at ``now``."""
    now = time.time() if now is None else now
    here = socket.gethostname()
    layout = SpoolLayout(root)
    try:
        info = read_run(root)
        summary = SpoolSummary(str(root), info.run_id, info.name, info.created, info.world_size)
    except FileNotFoundError:
        summary = SpoolSummary(str(root), None, None, None, None)
    for rank in layout.ranks():
        segs = layout.segments(rank)
        summary.strays += [str(p) for p in layout.strays(rank)]
        by_inc: dict[int, list[SegmentName]] = {}
        for s in segs:
            by_inc.setdefault(s.incarnation, []).append(s)
        incs = sorted(by_inc)
        written: dict[int, float] = {}  # incarnation -> when a segment of it last grew
        for s in segs:
            st = s.path.stat(follow_symlinks=False)
            summary.sizes[s.id.key] = st.st_size
            written[s.incarnation] = max(written.get(s.incarnation, 0.0), st.st_mtime)
        ones = [
            _one(rank, inc, by_inc[inc], n + 1 < len(incs), summary.bad)
            for n, inc in enumerate(incs)
        ]
        for one in ones:
            _liveness(one, written[one.incarnation], now, here, dead_after)
        for one, after in itertools.pairwise(ones):
            one.superseded_by = after.incarnation
            # events after the next incarnation's start: both processes were writing
            one.conflict = (
                after.started is not None
                and one.last_event is not None
                and one.last_event > after.started
            )
        summary.incarnations += ones
    return summary


def _liveness(
    one: IncarnationSummary, written: float, now: float, here: str, dead_after: float
) -> None:
    """Whether ``one``'s process is gone from this host, and how long it has been silent
    (``written``: when a segment of it last grew)."""
    one.dead_after = dead_after
    if one.host == here and one.pid is not None:
        one.process_gone = not process_running(one.pid)
    last = max(t for t in (one.last_event, one.last_heartbeat, written) if t is not None)
    one.silent = max(0.0, now - last)


def _one(
    rank: int, inc: int, segs: list[SegmentName], later_inc: bool, bad: list[BadRange]
) -> IncarnationSummary:
    out = IncarnationSummary(rank, inc, segments=len(segs))
    for k, seg in enumerate(segs):
        gone = later_inc or k + 1 < len(segs) or out.end_status is not None
        res = SegmentReader(seg.path).read(0, writer_gone=gone)
        if not gone and res.pending and out.end_status is not None:
            res = SegmentReader(seg.path).read(0, writer_gone=True)
        out.bytes += res.size
        out.frames += len(res.frames)
        out.pending_bytes += res.pending
        out.sealed = res.sealed
        out.unknown_kinds += res.stats.unknown_kinds
        out.unknown_fields += res.stats.unknown_fields
        for b in res.bad:
            out.bad_frames += 1
            out.bad_bytes += b.length
            bad.append(b)
        for ev in res.events:
            out.events += 1
            out.last_event = ev.ts
            if isinstance(ev, STEP_KINDS):
                _step(out, ev.step)
            elif isinstance(ev, StepEnd):
                _step(out, ev.step)
                out.closed_step = max(out.closed_step or 0, ev.step)
            elif isinstance(ev, Heartbeat):
                out.last_heartbeat = ev.ts
            elif isinstance(ev, RankStart):
                out.host, out.pid, out.world_size, out.started = (
                    ev.host,
                    ev.pid,
                    ev.world_size,
                    ev.ts,
                )
            elif isinstance(ev, RankEnd):
                out.end_status, out.exit_code = ev.status, ev.exit_code
    return out


def _step(out: IncarnationSummary, step: int) -> None:
    if out.closed_step is not None and step <= out.closed_step:
        out.late_events += 1
    out.first_step = step if out.first_step is None else min(out.first_step, step)
    out.last_step = step if out.last_step is None else max(out.last_step, step)


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    d = max(0.0, now - ts)
    if d < 120:
        return f"{d:.0f}s ago"
    if d < 7200:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


def format_summary(s: SpoolSummary, *, now: float | None = None) -> str:
    """The human-readable table of ``ranklog inspect``."""
    now = time.time() if now is None else now
    lines = [
        f"spool   {s.spool}",
        f"run     {s.run_id or '(no run.json)'}  name={s.name}  world_size={s.world_size}",
    ]
    ranks = {i.rank for i in s.incarnations}
    ended = {i.rank for i in s.incarnations if i.end_status is not None}
    lines.append(
        f"ranks   {len(ranks)} seen, {len(ended)} ended"
        + (
            f", {len(s.incarnations) - len(ranks)} restarts"
            if len(s.incarnations) > len(ranks)
            else ""
        )
    )
    header = (
        "rank", "inc", "seg", "host", "pid", "steps", "closed", "events",
        "late", "last event", "heartbeat", "state", "bad",
    )  # fmt: skip
    rows = [header]
    for i in s.incarnations:
        steps = "-" if i.first_step is None else f"{i.first_step}..{i.last_step}"
        rows.append(
            (
                str(i.rank),
                str(i.incarnation),
                str(i.segments),
                i.host or "?",
                str(i.pid or "?"),
                steps,
                "-" if i.closed_step is None else str(i.closed_step),
                str(i.events),
                str(i.late_events),
                _ago(i.last_event, now),
                _ago(i.last_heartbeat, now),
                i.state + (f" +{i.pending_bytes}B pending" if i.pending_bytes else ""),
                f"{i.bad_frames} ({i.bad_bytes}B)" if i.bad_frames else "0",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if s.bad:
        lines.append(
            f"damage  {len(s.bad)} bad ranges, {sum(b.length for b in s.bad)} bytes skipped"
        )
        lines += [f"  {b}" for b in s.bad[:50]]
        if len(s.bad) > 50:
            lines.append(f"  ... and {len(s.bad) - 50} more (--json lists all)")
    if s.strays:
        lines.append("strays  entries that are not segments (links are never followed):")
        lines += [f"  {p}" for p in s.strays]
    for sh in s.shippers:
        skipped = f", {sh.skipped_below} left out below W&B's last" if sh.skipped_below else ""
        if sh.name_collisions:
            skipped += f", {sh.name_collisions} derived names renamed .derived"
        lines.append(
            f"shipper {sh.name} -> {sh.target}: {sh.state}; step {sh.last_step} "
            f"({sh.steps_shipped} shipped{skipped}), lag {sh.lag_steps} steps / "
            f"{sh.lag_bytes} B, late {sh.late_events}, re-logged {sh.relogged_events}, "
            f"corrupt ranges {sh.bad_ranges}, updated {_ago(sh.updated, now)}"
        )
    unknown = sum(i.unknown_kinds + i.unknown_fields for i in s.incarnations)
    if unknown:
        lines.append(f"newer   {unknown} unknown kinds/fields from a newer writer were skipped")
    return "\n".join(lines)
