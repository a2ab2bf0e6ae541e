"""The segment writer: one incarnation of one rank, appending frames.

Exactly one process writes a given file. The writer keeps its own offset and
writes with ``pwritev`` at that offset, so a failed or short write (ENOSPC,
EFBIG, EIO) is undone with ``ftruncate`` and simply retried later: the file
never holds a torn frame followed by good ones.

Format 2: the layouts of packed metrics (:mod:`ranklog.schemas._packed`) are handed to
the writer as encoded Names records (:meth:`IncarnationWriter.add_names`); each segment
after the first starts with a names frame holding all of them, so every segment reads
on its own.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Final

import msgspec

from ranklog._fs import DIR_MODE, FILE_MODE, fsync_dir
from ranklog.errors import SpoolError
from ranklog.schemas import SCHEMA_VERSION
from ranklog.spool._format import (
    FLAG_NAMES,
    FRAME_EVENTS,
    FRAME_HEADER,
    FRAME_SEAL,
    FRAME_TRAILER,
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    SegmentHeader,
    crc_trailer,
    frame_header,
    msgpack_array_header,
    pack_header,
)
from ranklog.spool._layout import MAX_INCARNATION, RunInfo, SpoolLayout, deleted_incarnation

__all__ = ["DEFAULT_SEGMENT_BYTES", "IncarnationWriter"]

DEFAULT_SEGMENT_BYTES: Final = 64 * 1024 * 1024
_SEAL_RESERVE: Final = 256
_seal_encoder: Final = msgspec.msgpack.Encoder()
Buffer = bytes | bytearray | memoryview


class IncarnationWriter:
    """Appends frames to ``ranks/<rank>/<incarnation>-<segment>.rlog``, rolling over by size.

    Create it with :meth:`create`, which claims the next free incarnation number
    with an exclusive create, so two processes can never write the same file.
    """

    def __init__(
        self,
        layout: SpoolLayout,
        run: RunInfo,
        rank: int,
        incarnation: int,
        fd: int,
        *,
        world_size: int | None,
        max_segment_bytes: int,
    ) -> None:
        self.layout = layout
        self.run = run
        self.rank = rank
        self.incarnation = incarnation
        self.world_size = world_size
        self.max_segment_bytes = max_segment_bytes
        self.segment = 1
        self.seq = 0
        self.frames_in_segment = 0
        self.events_in_segment = 0
        self._fd: int | None = fd
        self._offset = 0
        self._dirty = False  # a failed write may have left bytes past _offset
        self._need_header = True  # the current file has no (complete) header yet
        self._seal_written = False  # the current file is sealed; the next is not open yet
        #: every layout's Names record so far, encoded (a new segment starts with them)
        self._names: list[bytes] = []
        self._need_names = False  # the current file lacks its names frame
        self._preamble = 0  # bytes of the current file's names frame (not counted to roll)
        self.closed = False
        self._finish_roll()

    @classmethod
    def create(
        cls,
        layout: SpoolLayout,
        run: RunInfo,
        rank: int,
        *,
        world_size: int | None = None,
        max_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> IncarnationWriter:
        """Claim the next incarnation of ``rank`` and open its first segment."""
        if max_segment_bytes < HEADER_SIZE + FRAME_HEADER + FRAME_TRAILER + _SEAL_RESERVE:
            raise SpoolError(f"max_segment_bytes={max_segment_bytes} is too small")
        rank_dir = layout.rank_dir(rank)
        rank_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        existing = [s.incarnation for s in layout.segments(rank) if s.incarnation < MAX_INCARNATION]
        # after the listing: compact --delete records a segment before removing it, so one
        # the listing missed is in deleted.json by now
        incarnation = max(max(existing, default=0), deleted_incarnation(layout.root, rank)) + 1
        while True:
            path = layout.segment_path(rank, incarnation, 1)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            except FileExistsError:
                incarnation += 1
                continue
            break
        fsync_dir(rank_dir)
        return cls(
            layout,
            run,
            rank,
            incarnation,
            fd,
            world_size=world_size,
            max_segment_bytes=max_segment_bytes,
        )

    @property
    def path(self) -> Path:
        """The segment being written."""
        return self.layout.segment_path(self.rank, self.incarnation, self.segment)

    @property
    def offset(self) -> int:
        """Bytes durably handed to the OS in the current segment."""
        return self._offset

    def _finish_roll(self) -> None:
        """Open the next segment if needed and write its header; safe to call again.

        Each step is retried after a failure (ENOSPC, EDQUOT...): a segment is sealed
        once, the next one is created once (or re-opened if a previous attempt created
        it), and its header is written at offset 0 before any frame.
        """
        if self._fd is None:
            if self.closed or not self._seal_written:
                raise SpoolError(f"segment writer for rank {self.rank} is closed")
            path = self.layout.segment_path(self.rank, self.incarnation, self.segment + 1)
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags | os.O_EXCL, FILE_MODE)
            except FileExistsError:  # created by our own failed attempt: ours alone
                fd = os.open(path, flags, FILE_MODE)
            self._fd = fd
            self.segment += 1
            self._seal_written = False
            self._need_header = True
            self.frames_in_segment = 0
            self.events_in_segment = 0
        if self._need_header:
            self._offset = 0
            self._dirty = True  # drop whatever an earlier attempt left
            self._write_header()
            self._need_header = False
            self._need_names = True
            self._preamble = 0

    def _write_header(self) -> None:
        header = SegmentHeader(
            rank=self.rank,
            incarnation=self.incarnation,
            segment=self.segment,
            created=time.time(),
            run_id=self.run.run_id,
            world_size=self.world_size,
        )
        self._offset = 0
        self._pwrite([pack_header(header)])

    def _pwrite(self, parts: list[Buffer]) -> None:
        """Write ``parts`` at the current offset, all or nothing."""
        fd = self._require_fd()
        total = sum(map(len, parts))
        if self._dirty:
            os.ftruncate(fd, self._offset)
            self._dirty = False
        done = 0
        try:
            while done < total:
                if done == 0:
                    n = os.pwritev(fd, parts, self._offset)
                else:
                    rest = b"".join(bytes(p) for p in parts)[done:]
                    n = os.pwrite(fd, rest, self._offset + done)
                if n <= 0:
                    raise OSError("short write")
                done += n
        except OSError:
            self._dirty = True
            try:
                os.ftruncate(fd, self._offset)
                self._dirty = False
            except OSError:
                pass
            raise
        self._offset += total

    def _require_fd(self) -> int:
        if self._fd is None:
            raise SpoolError(f"segment writer for rank {self.rank} is closed")
        return self._fd

    def add_names(self, record: bytes) -> None:
        """Remember an encoded Names record: each later segment starts with it. The caller
        writes it once itself, in a names frame, before any event that uses its layout."""
        self._names.append(record)

    def write_events(self, count: int, payload: list[Buffer], *, names: bool = False) -> None:
        """Append one frame of ``count`` pre-encoded events (``payload`` is a msgpack array);
        ``names``: it holds a Names record (the frame is flagged so).

        Raises OSError (nothing written, retry later) when the disk refuses.
        """
        length = sum(map(len, payload))
        if length > MAX_FRAME_BYTES:
            raise SpoolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte cap")
        if self._fd is None or self._need_header:
            self._finish_roll()
        size = FRAME_HEADER + length + FRAME_TRAILER
        if (
            self.frames_in_segment > (self._preamble > 0)  # (one frame at least, and the
            and self._offset - self._preamble + size + _SEAL_RESERVE > self.max_segment_bytes
        ):  # limit counts the frames after its names frame: layouts larger than a segment
            self.roll()  # do not make a segment a frame)
        if self._need_names:
            self._write_names()
        # self._write_frame(count, payload, flags), inlined: once per frame a rank writes
        head = frame_header(FRAME_EVENTS, SCHEMA_VERSION, length, self.seq,
                            FLAG_NAMES if names else 0)  # fmt: skip
        self._pwrite([head, *payload, crc_trailer(*payload)])
        self.seq += 1
        self.frames_in_segment += 1
        self.events_in_segment += count

    def _write_frame(self, count: int, payload: list[Buffer], flags: int) -> None:
        length = sum(map(len, payload))
        head = frame_header(FRAME_EVENTS, SCHEMA_VERSION, length, self.seq, flags)
        self._pwrite([head, *payload, crc_trailer(*payload)])
        self.seq += 1
        self.frames_in_segment += 1
        self.events_in_segment += count

    def _write_names(self) -> None:
        """Start the segment with every layout so far (none: nothing to write)."""
        records = list(self._names)
        before = self._offset
        if records:
            self._write_frame(len(records), [msgpack_array_header(len(records)), *records],
                              FLAG_NAMES)  # fmt: skip
        self._preamble = self._offset - before
        self._need_names = False

    def _write_seal(self, reason: str, next_segment: int | None) -> None:
        body = _seal_encoder.encode(
            {
                "reason": reason,
                "frames": self.frames_in_segment,
                "events": self.events_in_segment,
                "next_segment": next_segment,
                "host": socket.gethostname(),
                "ts": time.time(),
            }
        )
        head = frame_header(FRAME_SEAL, SCHEMA_VERSION, len(body), self.seq)
        self._pwrite([head, body, crc_trailer(body)])
        self.seq += 1

    def roll(self) -> None:
        """Seal the current segment and start the next one (resumable after a failure)."""
        if not self._seal_written:
            self._write_seal("roll", self.segment + 1)
            self._seal_written = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._finish_roll()

    def sync(self) -> None:
        """fsync the current segment (node-crash durability)."""
        os.fsync(self._require_fd())

    def close(self, *, seal: bool = True, sync: bool = True) -> None:
        """Seal (reason ``close``), fsync and close the segment. Idempotent."""
        if self._fd is None or self.closed:
            self.closed = True
            return
        try:
            if seal and not self._need_header:
                self._write_seal("close", None)
            if sync:
                self.sync()
        finally:
            os.close(self._fd)
            self._fd = None
            self.closed = True

    def abandon(self) -> None:
        """Close the file descriptor without sealing (tests: simulate a crash)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
