"""A shipper's cursor: how far it got, replaced atomically after the target accepted.

``SPOOL/cursors/<name>.json`` holds, per segment, the offset below which every
event belongs to a shipped step (re-reading starts there) and the highest
offset already examined (so late events are not counted twice); per rank and
incarnation, the state read from frames before those offsets (watermark, end);
the last shipped step; the hyperparameters already shipped; counters.

It is written with :func:`ranklog._fs.atomic_write` (tmp, fsync, rename, fsync of
the directory): a crash leaves either the old cursor or the new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
from pathlib import Path

import msgspec

from ranklog._fs import DIR_MODE, atomic_write, fsync_dir
from ranklog.errors import ConfigError, CursorError
from ranklog.schemas import ParamValue
from ranklog.shippers._held import StepSet
from ranklog.shippers._reopen import check_name, reopen_flags
from ranklog.spool import (
    NO_STEP,
    RunInfo,
    SegmentId,
    SpoolLayout,
    deleted_segments,
    legacy_implied,
    watermark,
)

__all__ = [
    "CURSOR_VERSION",
    "Cursor",
    "IncState",
    "SegmentCursor",
    "adopt_legacy_cursor",
    "check_not_deleted",
    "cursor_path",
    "load_cursor",
    "save_cursor",
]

#: 2: incarnations and segments record ``implied`` (the watermark's close by moving on);
#: a version-1 cursor is read as its release judged (:func:`load_cursor`)
CURSOR_VERSION = 2


class SegmentCursor(msgspec.Struct, forbid_unknown_fields=False):
    """Progress in one segment."""

    offset: int = 0
    seen: int = 0
    done: bool = False
    #: the sequence number of the frame expected at ``offset`` (-1: unknown)
    seq: int = -1
    #: the incarnation's highest step_end and step event before ``offset`` (None: not
    #: saved): a restarted shipper re-reads from there with the very watermark it had
    closed: int | None = None
    max_step: int | None = None
    #: its implied close before ``offset`` (None: a cursor from before it was saved)
    implied: int | None = None
    #: offsets of the frames before ``offset`` that hold names records (segment format 2):
    #: a restarted shipper reads them alone (None: not saved; it follows frame headers)
    names: list[int] | None = None


class IncState(msgspec.Struct, forbid_unknown_fields=False):
    """What the shipper knows about one incarnation of one rank."""

    #: highest step_end read
    closed: int = NO_STEP
    #: highest step of a step event read
    max_step: int = NO_STEP
    #: the steps it closed by moving on before its first step_end (:func:`implied_after`)
    implied: int = NO_STEP
    ended: str | None = None
    world_size: int | None = None
    host: str | None = None
    started: float | None = None

    @property
    def watermark(self) -> int:
        """The highest step this incarnation closed (:func:`ranklog.spool.watermark`)."""
        return watermark(self.closed, self.implied)


class Cursor(msgspec.Struct, forbid_unknown_fields=False):
    """Everything a restarted shipper needs to carry on exactly where it committed."""

    version: int = CURSOR_VERSION
    name: str = ""
    #: the target's spec, as given
    target: str = ""
    run_id: str | None = None
    last_step: int = NO_STEP
    steps_shipped: int = 0
    updated: float = 0.0
    late_events: int = 0
    relogged_events: int = 0
    bad_ranges: int = 0
    bad_bytes: int = 0
    #: segment key (``00003/0001-000001``) -> progress
    segments: dict[str, SegmentCursor] = msgspec.field(default_factory=dict)
    #: "rank" -> {"incarnation": state}
    ranks: dict[str, dict[str, IncState]] = msgspec.field(default_factory=dict)
    params: dict[str, ParamValue] = msgspec.field(default_factory=dict)
    #: what the target writes to, canonical (``jsonl:/real/path``; "" in older cursors)
    identity: str = ""
    #: the ``ranklog ship`` arguments after SPOOL that start this shipper again, and the
    #: directory they ran in (``ranklog ship SPOOL --once`` with no ``--to`` uses them)
    argv: list[str] = msgspec.field(default_factory=list)
    cwd: str = ""
    #: steps left out because the target cannot write below its last (``--below-last skip``)
    skipped_below: int = 0
    #: derived names (``m/max``, ``timing/t``) that met another name and shipped renamed
    name_collisions: int = 0

    def done(self, seg: SegmentId) -> bool:
        """Whether this shipper has finished with ``seg`` (nothing of it is needed again)."""
        entry = self.segments.get(seg.key)
        return entry is not None and entry.done

    def check_owner(self, run_id: str, identity: str, spec: str) -> None:
        """:class:`CursorError` unless this cursor is of run ``run_id`` and of the target
        that writes to ``identity`` (an older cursor names its target by ``spec``)."""
        if self.run_id not in (None, run_id):
            theirs, ours = f"run {self.run_id}", run_id
        elif self.identity and self.identity != identity:
            theirs, ours = f"target {self.identity}", identity
        elif not self.identity and self.target not in ("", spec):
            theirs, ours = f"target {self.target}", spec
        else:
            return
        raise CursorError(
            f"cursor {self.name!r} belongs to {theirs}, not {ours}: use another --name"
        )


log = logging.getLogger("ranklog.ship")

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Cursor)


def cursor_path(spool: str | os.PathLike[str], name: str) -> Path:
    """Where the cursor of shipper ``name`` lives (a plain file name: :func:`check_name`)."""
    return SpoolLayout(spool).cursors_dir / f"{check_name(name)}.json"


def load_cursor(spool: str | os.PathLike[str], name: str) -> Cursor | None:
    """The committed cursor, or None if this shipper never committed.

    An unreadable cursor is a :class:`~ranklog.errors.CursorError` naming the file.
    """
    path = cursor_path(spool, name)
    try:
        cursor = _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
        raise CursorError(f"{path}: unreadable cursor ({exc}); move it away to start over") from exc
    if cursor.version < 2:  # no ``implied`` recorded: the close its release judged
        for incs in cursor.ranks.values():
            for inc in incs.values():
                inc.implied = legacy_implied(inc.closed, inc.max_step)
        for seg in cursor.segments.values():
            if seg.closed is not None and seg.max_step is not None:
                seg.implied = legacy_implied(seg.closed, seg.max_step)
        cursor.version = CURSOR_VERSION
    return cursor


def save_cursor(spool: str | os.PathLike[str], cursor: Cursor) -> None:
    """Replace the cursor atomically."""
    path = cursor_path(spool, cursor.name)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    cursor.updated = time.time()
    atomic_write(path, _encoder.encode(cursor))


def list_cursors(spool: str | os.PathLike[str]) -> list[Cursor]:
    """Every readable cursor of a spool (for ``ranklog inspect`` and ``compact --delete``)."""
    out: list[Cursor] = []
    d = SpoolLayout(spool).cursors_dir
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        with contextlib.suppress(CursorError):
            c = load_cursor(spool, p.stem)
            if c is not None:
                out.append(c)
    return out


def adopt_legacy_cursor(
    spool: str | os.PathLike[str], legacy: str, name: str, run: RunInfo
) -> bool:
    """Rename the cursor ``legacy`` (named by an older ranklog after the spec as typed) to
    ``name`` (named after what the target writes to); whether it did."""
    old, new = cursor_path(spool, legacy), cursor_path(spool, name)
    if legacy == name or not old.exists():
        return False
    cursor = load_cursor(spool, legacy)
    if cursor is None or cursor.run_id not in (None, run.run_id):
        return False
    if new.exists():
        there = load_cursor(spool, name)
        if there is not None and there.name == name and there.last_step >= cursor.last_step:
            # renamed already, and killed before the old file went: it goes now
            log.info("cursor %s removed (renamed %s before)", legacy, name)
            old.unlink()
            fsync_dir(old.parent)
            return True
        # a release that renamed without renaming the cursor's own name left a frozen copy
        # here, and went on committing under the old name: the old file is the live one
        if there is None or there.name != legacy or there.last_step > cursor.last_step:
            return False
    log.info("cursor %s renamed %s (named after what its target writes to)", legacy, name)
    cursor.name = name
    save_cursor(spool, cursor)  # (the new name, written whole before the old one goes)
    old.unlink()
    fsync_dir(old.parent)
    return True


def check_not_deleted(
    spool: str | os.PathLike[str], cursor: Cursor, spec: str, held: StepSet
) -> None:
    """:class:`CursorError` naming the dataset and the ``ranklog replay`` command when
    ``compact --delete`` removed segments before this cursor's shipper shipped them, and
    the target does not hold their steps (a replay of the dataset wrote them: then the
    cursor marks them done and shipping goes on)."""
    gone = []
    layout = SpoolLayout(spool)
    for d in deleted_segments(spool):
        if cursor.done(d.segment):
            continue
        if layout.segment_path(*d.segment).is_file():
            continue  # recorded, then --delete was killed before it went: read it as is
        if d.steps is not None and all(held.covers(lo, hi) for lo, hi in d.steps):
            cursor.segments[d.segment.key] = SegmentCursor(done=True)
            continue
        gone.append(d)
    if gone:
        first = gone[0]
        to = _replay_flags(cursor.identity, spec)
        raise CursorError(
            f"{len(gone)} segment(s) of this spool ({first.segment.key}, ...) were compacted "
            f"into {first.dataset} and deleted before this shipper shipped them: ship from "
            f"the dataset with `ranklog replay {shlex.quote(first.dataset)} {to}` (it writes "
            f"only the steps {spec} lacks), then start this shipper again"
        )


def _replay_flags(identity: str, spec: str) -> str:
    """The flags of a command the user runs to write into this target, from anywhere:
    its identity's (absolute), or the spec as given where the identity cannot say."""
    try:
        return shlex.join(reopen_flags(identity))
    except ConfigError:
        return shlex.join(["--to", spec])
