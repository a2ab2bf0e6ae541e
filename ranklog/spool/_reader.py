"""The segment reader: frames from an offset on, corrupt bytes counted, never raised.

Rules (see the package docstring):

- an incomplete or bad tail while the writer may be alive is *pending*: nothing
  past the last good frame is consumed, the next read tries again;
- once the writer is known gone (``writer_gone=True``: sealed, a later segment or
  incarnation exists, ``rank_end`` was read, or the rank was declared dead) a bad
  tail is reported and consumed;
- a bad region followed by a valid frame is reported with path and offset and
  skipped at once;
- no read is larger than ``max(CHUNK, MAX_FRAME_BYTES + overhead)``, whatever a
  corrupt length field claims.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec

from ranklog.schemas import DecodeStats, Event, decode_events
from ranklog.spool._format import (
    FRAME_HEADER,
    FRAME_SEAL,
    FRAME_TRAILER,
    HEADER_SIZE,
    SYNC,
    SegmentHeader,
    parse_frame_header,
    payload_ok,
    unpack_header,
)

__all__ = ["UNDECODABLE", "BadRange", "Frame", "ReadResult", "SegmentReader", "read_segment"]

CHUNK: Final = 4 * 1024 * 1024
#: the reason of a frame's :class:`BadRange` when some of its events do not decode
UNDECODABLE: Final = "undecodable events"
_seal_decoder: Final = msgspec.msgpack.Decoder(dict[str, object])


@dataclass(frozen=True, slots=True)
class BadRange:
    """Bytes a reader skipped: which file, where, how many, and why."""

    path: str
    offset: int
    length: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.length} bytes skipped at offset {self.offset} ({self.reason})"


@dataclass(slots=True)
class Frame:
    """One valid events frame: its byte range, sequence number and decoded events.

    A reader made with ``decode=False`` leaves ``events`` empty and keeps the frame's
    checked ``payload`` for the caller to decode.
    """

    offset: int
    end: int
    seq: int
    schema: int
    events: list[Event]
    payload: memoryview | None = None


@dataclass(slots=True)
class ReadResult:
    """What one :meth:`SegmentReader.read` call found."""

    frames: list[Frame] = field(default_factory=list)
    #: Next offset to read from: everything before it is consumed.
    end: int = HEADER_SIZE
    bad: list[BadRange] = field(default_factory=list)
    #: The seal frame's contents, once the segment is sealed.
    seal: dict[str, object] | None = None
    #: The seal frame's sequence number (frames of the next segment continue from it).
    seal_seq: int | None = None
    #: Bytes past ``end`` left for a later read (a tail being written).
    pending: int = 0
    size: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    #: stopped at ``max_bytes``: more complete frames may follow
    more: bool = False

    @property
    def sealed(self) -> bool:
        """Whether the segment ended with a seal frame."""
        return self.seal is not None

    @property
    def events(self) -> list[Event]:
        """Every event of every frame, in order."""
        return [e for f in self.frames for e in f.events]


class SegmentReader:
    """Reads one segment file incrementally; re-opens it on every read (NFS-safe).

    With ``decode=False`` frames keep their payload, undecoded (and undecodable events
    are not looked for): for a caller that decodes them its own way.
    """

    def __init__(self, path: str | os.PathLike[str], *, decode: bool = True) -> None:
        self.path = Path(path)
        self.header: SegmentHeader | None = None
        self.header_error: str | None = None
        self.decode = decode

    def _open(self) -> int:
        # O_NONBLOCK: a FIFO put where a segment was must not block the reader; on a
        # regular file it changes nothing
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        return os.open(self.path, flags)

    def read(
        self, offset: int = 0, *, writer_gone: bool = False, max_bytes: int | None = None
    ) -> ReadResult:
        """Read frames from ``offset`` (0 means from the header) to the end of the file.

        With ``max_bytes``, stop at the first frame boundary past that many bytes
        (``more`` is then set): callers tailing many files bound their memory so.
        """
        res = ReadResult(end=max(offset, HEADER_SIZE))
        try:
            fd = self._open()
        except OSError as exc:
            reason = "symbolic link refused" if exc.errno == errno.ELOOP else exc.strerror
            res.bad.append(BadRange(str(self.path), 0, 0, f"cannot open: {reason}"))
            return res
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                res.bad.append(BadRange(str(self.path), 0, 0, "not a regular file"))
                return res
            size = st.st_size
            res.size = size
            if offset < HEADER_SIZE:
                data = os.pread(fd, HEADER_SIZE, 0)
                if len(data) < HEADER_SIZE and not writer_gone:
                    res.end = 0
                    res.pending = len(data)
                    return res
                parsed = unpack_header(data)
                if isinstance(parsed, str):
                    self.header_error = parsed
                    res.bad.append(BadRange(str(self.path), 0, min(len(data), HEADER_SIZE), parsed))
                else:
                    self.header = parsed
                res.end = HEADER_SIZE
            limit = None if max_bytes is None else res.end + max_bytes
            self._scan(fd, size, res, writer_gone, limit)
        finally:
            os.close(fd)
        return res

    def _scan(
        self, fd: int, size: int, res: ReadResult, writer_gone: bool, limit: int | None
    ) -> None:
        path = str(self.path)
        pos = res.end  # absolute offset of the first byte not yet examined
        bad_start: int | None = None  # start of a bad region being skipped
        want = _want(pos, limit, 0)
        while pos < size:
            asked = min(size - pos, want)
            data = os.pread(fd, asked, pos)
            n = len(data)
            if n < asked:
                size = pos + n  # the file shrank under us: trust what is there
            if n == 0:
                break
            i = 0
            need = 0  # bytes a frame starting at pos+i needs but this buffer lacks
            while i < n:
                if bad_start is not None:
                    j = data.find(SYNC, i)
                    if j < 0:
                        i = max(i, n - len(SYNC) + 1)
                        break
                    i = j
                if n - i < FRAME_HEADER:
                    need = FRAME_HEADER
                    break
                hdr = parse_frame_header(data, i)
                if hdr is None:
                    bad_start = pos + i if bad_start is None else bad_start
                    i += 1
                    continue
                kind, schema, length, seq = hdr
                total = FRAME_HEADER + length + FRAME_TRAILER
                if n - i < total:
                    need = total
                    break
                if not payload_ok(data, i + FRAME_HEADER, length):
                    bad_start = pos + i if bad_start is None else bad_start
                    i += 1
                    continue
                start = pos + i
                if bad_start is not None:
                    res.bad.append(BadRange(path, bad_start, start - bad_start, "bad frame"))
                    bad_start = None
                payload = memoryview(data)[i + FRAME_HEADER : i + FRAME_HEADER + length]
                i += total
                res.end = pos + i
                if kind == FRAME_SEAL:
                    res.seal_seq = seq
                    try:
                        res.seal = _seal_decoder.decode(payload)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        res.seal = {}
                    if res.end < size:
                        res.bad.append(BadRange(path, res.end, size - res.end, "bytes after seal"))
                        res.end = size
                    return
                if self.decode:
                    before = res.stats.invalid_events
                    events = decode_events(payload, schema, res.stats)
                    if res.stats.invalid_events != before:
                        res.bad.append(BadRange(path, start, total, UNDECODABLE))
                    res.frames.append(Frame(start, start + total, seq, schema, events))
                else:
                    res.frames.append(Frame(start, start + total, seq, schema, [], payload))
                if limit is not None and res.end >= limit and bad_start is None:
                    if res.end < size:
                        res.more = True
                        res.pending = size - res.end
                    return
            if need:
                if pos + i + need > size:
                    break  # an incomplete frame (or garbage) at the end of the file
            elif pos + n >= size and i <= 0:
                break
            pos += i
            # the next buffer (a frame cut by this one's end is read again, whole): up to the
            # limit, not a chunk past it, unless bad bytes are being skipped
            want = _want(pos, limit if bad_start is None else None, need)
        if size > res.end:
            if writer_gone:
                reason = "bad frame at end" if bad_start is not None else "incomplete frame at end"
                res.bad.append(BadRange(path, res.end, size - res.end, reason))
                res.end = size
            else:
                res.pending = size - res.end


def _want(pos: int, limit: int | None, need: int) -> int:
    """Bytes to read at ``pos``: a chunk, or with a limit what is left before it (a read
    with a small limit would otherwise read a chunk to use one frame); at least ``need``,
    the frame that starts there."""
    if limit is None:
        return max(CHUNK, need)
    return max(need, FRAME_HEADER, min(CHUNK, limit - pos))


def read_segment(path: str | os.PathLike[str], *, writer_gone: bool = True) -> ReadResult:
    """Read a whole segment at once (compaction, inspection, tests)."""
    return SegmentReader(path).read(0, writer_gone=writer_gone)
