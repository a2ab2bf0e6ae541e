"""A reader of W&B's ``.wandb`` transaction log, the file an offline (or online) run writes.

wandb >= 0.30 writes it from its Go service (``wandb-core``) and ships no Python
reader; the W&B target needs one to learn, after a crash, which steps the log
durably holds. The format, as written by wandb 0.31:

* a 7-byte file header: ``b":W&B"``, the magic ``0xBEE1`` (u16, little-endian)
  and the store version ``0`` (u8);
* then a LevelDB log (``leveldb/doc/log_format.md``): 32 KiB blocks, the header
  counting as the start of block 0; each chunk is ``crc u32, length u16, type u8``
  (little-endian) and ``length`` bytes; ``type`` is FULL (1), or FIRST (2),
  MIDDLE (3) ... LAST (4) for a record spread over several blocks; fewer than 7
  bytes left in a block are zero padding. The checksum is plain CRC-32/IEEE
  (``zlib.crc32``), unmasked, of the type byte followed by the data;
* each record is a serialized ``wandb.proto.wandb_internal_pb2.Record``; history
  rows are ``Record.history`` with ``step.num`` and items whose value is JSON
  (``value_json``) or, from newer writers, typed (``number``, ``integer``, ...).

The reader never raises on damage: a torn tail (a crash, or a writer still
writing) ends the records read, a bad chunk followed by later blocks is skipped
to the next block, as LevelDB does, and only complete, checksummed records are
returned. :class:`LogReader` reads incrementally, so a writer's progress can be
followed cheaply.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

__all__ = [
    "HEADER",
    "LogReader",
    "fsync_log",
    "history_rows",
    "iter_records",
    "last_step",
    "read_payloads",
    "writers",
]

#: the file header: ident, magic, version
HEADER: Final = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK: Final = 32 * 1024
CHUNK_HEADER: Final = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CHUNK = struct.Struct("<IHB")


def read_payloads(data: bytes, start: int = len(HEADER)) -> tuple[list[bytes], int]:
    """Complete record payloads in ``data[start:]``, and the offset to resume from.

    ``data`` is the file from offset 0 (or at least from ``start``'s block on:
    only offsets matter). ``start`` must be a chunk boundary. The returned offset
    is the end of the last complete record: the next call continues there.
    """
    out: list[bytes] = []
    pos = resume = start
    parts: list[bytes] = []
    size = len(data)
    while True:
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # block trailer: zero padding
            pos += room
            if not parts:
                resume = min(pos, size)
            continue
        if pos + CHUNK_HEADER > size:
            break  # torn or not written yet
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        end = pos + CHUNK_HEADER + length
        if length > room - CHUNK_HEADER or kind not in (FULL, FIRST, MIDDLE, LAST):
            if not _skip_block(data, pos):
                break
            pos, parts = pos + room, []  # damaged (or zero-filled): resynchronize at the next block
            resume = pos
            continue
        if end > size:
            break  # torn or not written yet
        chunk = data[pos + CHUNK_HEADER : end]
        if zlib.crc32(chunk, zlib.crc32(bytes((kind,)))) != crc:
            if not _skip_block(data, pos):
                break
            pos, parts = pos + room, []
            resume = pos
            continue
        pos = end
        if kind == FULL:
            parts = []
            out.append(chunk)
            resume = pos
        elif kind == FIRST:
            parts = [chunk]
        elif not parts:  # MIDDLE/LAST without FIRST: the rest of a record lost to damage
            resume = pos
        elif kind == MIDDLE:
            parts.append(chunk)
        else:
            out.append(b"".join((*parts, chunk)))
            parts = []
            resume = pos
    return out, resume


def _skip_block(data: bytes, pos: int) -> bool:
    """A bad chunk is skipped only when a later block exists: at the tail it may be torn."""
    return len(data) > pos + (BLOCK - pos % BLOCK)


@functools.cache
def _record_type() -> Any:
    return importlib.import_module("wandb.proto.wandb_internal_pb2").Record


def _parse(payload: bytes) -> Any | None:
    rec = _record_type()()
    try:
        rec.ParseFromString(payload)
    except Exception:  # a checksummed record that does not parse: skip it, never raise
        return None
    return rec


class LogReader:
    """Follows one ``.wandb`` file: each :meth:`read` returns the records added since."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.offset = 0  # 0: header not checked yet
        self.valid = True

    def read(self) -> list[Any]:
        """Parsed ``Record`` messages completed since the last call (none if not a .wandb file)."""
        if not self.valid:
            return []
        try:
            with open(self.path, "rb") as f:
                if self.offset == 0:
                    head = f.read(len(HEADER))
                    if len(head) < len(HEADER):
                        return []
                    if head != HEADER:
                        self.valid = False
                        return []
                    self.offset = len(HEADER)
                base = self.offset - self.offset % BLOCK
                f.seek(base)
                data = f.read()
        except OSError:
            return []
        payloads, resume = read_payloads(data, self.offset - base)
        self.offset = base + resume
        return [r for r in map(_parse, payloads) if r is not None]


def iter_records(path: str | os.PathLike[str]) -> Iterator[Any]:
    """Every complete record of a ``.wandb`` file, parsed."""
    yield from LogReader(path).read()


def _item_value(item: Any) -> Any:
    """A history item's value: typed (newer writers) or JSON."""
    kind = item.WhichOneof("value")
    if kind is None:
        return json.loads(item.value_json) if item.value_json else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def history_row(rec: Any) -> dict[str, Any]:
    """A history record as ``{"_step": N, key: value, ...}`` (nested keys joined with ``.``)."""
    row: dict[str, Any] = {}
    for item in rec.history.item:
        key = item.key or ".".join(item.nested_key)
        row[key] = _item_value(item)
    if rec.history.HasField("step"):
        row["_step"] = rec.history.step.num
    return row


def history_rows(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The history rows of a ``.wandb`` file, in the order they were written."""
    for rec in iter_records(path):
        if rec.WhichOneof("record_type") == "history":
            yield history_row(rec)


def last_step(path: str | os.PathLike[str]) -> int | None:
    """The highest history step a ``.wandb`` file durably holds (None: none)."""
    steps = [r["_step"] for r in history_rows(path) if isinstance(r.get("_step"), int)]
    return max(steps, default=None)


def fsync_log(path: Path | None) -> None:
    """fsync a log file and its directory (a read-only descriptor suffices on Linux)."""
    if path is None:
        return
    for p in (path, path.parent):
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def writers(paths: set[str]) -> set[int]:
    """Processes that hold one of ``paths`` open (only those /proc lets us see)."""
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(fd.path) in paths:
                            found.add(int(entry.name))
    return found
