"""A shipper's cursor: how far it got, replaced atomically after the target accepted.

``SPOOL/cursors/<name>.json`` holds, per segment, the offset below which every
event belongs to a shipped step (re-reading starts there) and the highest
offset already examined (so late events are not counted twice); per rank and
incarnation, the state read from frames before those offsets (watermark, end);
the last shipped step; the hyperparameters already shipped; counters.

It is written to a temporary file, fsync'd, renamed over the old one, and the
directory fsync'd: a crash leaves either the old cursor or the new one.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import msgspec

from ranklog.schemas import ParamValue
from ranklog.spool._layout import DIR_MODE, FILE_MODE, SpoolLayout, fsync_dir

__all__ = ["CURSOR_VERSION", "Cursor", "IncState", "SegmentCursor", "load_cursor", "save_cursor"]

CURSOR_VERSION = 1


class SegmentCursor(msgspec.Struct, forbid_unknown_fields=False):
    """Progress in one segment."""

    offset: int = 0
    seen: int = 0
    done: bool = False


class IncState(msgspec.Struct, forbid_unknown_fields=False):
    """What the shipper knows about one incarnation of one rank."""

    closed: int = -1
    max_step: int = -1
    ended: str | None = None
    world_size: int | None = None
    host: str | None = None
    started: float | None = None


class Cursor(msgspec.Struct, forbid_unknown_fields=False):
    """Everything a restarted shipper needs to carry on exactly where it committed."""

    version: int = CURSOR_VERSION
    name: str = ""
    target: str = ""
    run_id: str | None = None
    last_step: int = -1
    steps_shipped: int = 0
    updated: float = 0.0
    late_events: int = 0
    relogged_events: int = 0
    bad_ranges: int = 0
    bad_bytes: int = 0
    #: "rank/incarnation-segment" -> progress
    segments: dict[str, SegmentCursor] = msgspec.field(default_factory=dict)
    #: "rank" -> {"incarnation": state}
    ranks: dict[str, dict[str, IncState]] = msgspec.field(default_factory=dict)
    params: dict[str, ParamValue] = msgspec.field(default_factory=dict)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Cursor)


def cursor_path(spool: str | os.PathLike[str], name: str) -> Path:
    """Where the cursor of shipper ``name`` lives."""
    return SpoolLayout(spool).cursors_dir / f"{name}.json"


def load_cursor(spool: str | os.PathLike[str], name: str) -> Cursor | None:
    """The committed cursor, or None if this shipper never committed (or it is unreadable)."""
    path = cursor_path(spool, name)
    try:
        return _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
        raise ValueError(f"{path}: unreadable cursor ({exc}); move it away to start over") from exc


def save_cursor(spool: str | os.PathLike[str], cursor: Cursor) -> None:
    """Replace the cursor atomically: tmp, fsync, rename, fsync the directory."""
    path = cursor_path(spool, cursor.name)
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    cursor.updated = time.time()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        os.write(fd, _encoder.encode(cursor))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def list_cursors(spool: str | os.PathLike[str]) -> list[Cursor]:
    """Every readable cursor of a spool (for ``ranklog inspect``)."""
    out: list[Cursor] = []
    d = SpoolLayout(spool).cursors_dir
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        with contextlib.suppress(ValueError):
            c = load_cursor(spool, p.stem)
            if c is not None:
                out.append(c)
    return out
