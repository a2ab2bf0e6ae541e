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
  corrupt length field claims;
- format 2: the reader keeps the segment's layouts (its names frames') and gives the
  Metrics events that packed ones stand for; a reader that starts past the header first
  finds the names frames before its offset by their frame headers alone.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec

from ranklog.schemas import DecodeStats, Event, Layouts, decode_events
from ranklog.spool._format import (
    FLAG_NAMES,
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

__all__ = [
    "UNDECODABLE",
    "UNRESOLVED",
    "BadRange",
    "Frame",
    "ReadResult",
    "SegmentReader",
    "read_segment",
]

CHUNK: Final = 4 * 1024 * 1024
#: the reason of a frame's :class:`BadRange` when some of its events do not decode
UNDECODABLE: Final = "undecodable events"
#: the reason of a frame's :class:`BadRange` when packed values in it have no layout (their
#: names frame lost): the whole frame is skipped, as a frame lost to damage
UNRESOLVED: Final = "packed values whose names frame is lost"
_seal_decoder: Final = msgspec.msgpack.Decoder(dict[str, object])
#: the payload a names frame is given: an empty msgpack array (its records are the reader's)
_NONE: Final = memoryview(b"\x90")


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
    checked ``payload`` for the caller to decode (with the reader's ``layouts``). A names
    frame's records are the reader's own: its events are none, its payload an empty array.
    """

    offset: int
    end: int
    seq: int
    schema: int
    events: list[Event]
    payload: memoryview | None = None
    #: a names frame (format 2): the time of its last record; None for any other frame
    names_ts: float | None = None


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
    are not looked for): for a caller that decodes them its own way. With ``rows=True``
    packed values come out as :class:`~ranklog.schemas.MetricsPacked` holding a row of
    floats; with ``packed=True`` as MetricsPacked that keep their bytes (the shipper's and
    compaction's: one unpack per step, or numpy over many).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        decode: bool = True,
        rows: bool = False,
        packed: bool = False,
        layouts: bool = True,
    ) -> None:
        self.path = Path(path)
        self.header: SegmentHeader | None = None
        self.header_error: str | None = None
        self.decode = decode
        #: the layouts of the segment's names frames read so far (format 2)
        self.layouts = Layouts(rows=rows, packed=packed)
        #: offsets of the frames read that hold names records, in file order
        self.names_at: list[int] = []
        self._names_to = HEADER_SIZE  # names frames before this offset are in layouts
        #: False: frames and seals only, no layouts looked for (packed values do not resolve)
        self._look = layouts
        self._hint: tuple[list[int], int] | None = None

    def resume_from(self, names: Sequence[int], offset: int) -> None:
        """Before the first read, which starts at ``offset``: the frames before it that hold
        names records (what :meth:`names_before` gave the reader that read them, kept in a
        cursor or manifest). They are read alone, instead of following every frame header
        from the segment's start; if one of them is not such a frame, the headers are
        followed after all."""
        self._hint = (list(names), offset)

    def names_before(self, offset: int) -> list[int]:
        """The offsets of the frames before ``offset`` that hold names records (format 2).

        Before its first read, a reader :meth:`resume_from` told of them still knows them:
        a run that reads nothing new saves them again (not an empty list, which would lose
        the names of every packed frame after them at the next run)."""
        known = set(self.names_at)
        if self._hint is not None:
            known.update(p for p in self._hint[0] if type(p) is int)
        return sorted(o for o in known if o < offset)

    def _names_frame(self, offset: int) -> None:
        """A frame holding names records was read at ``offset`` (once, if read again)."""
        if offset not in self.names_at:
            self.names_at.append(offset)
            self.names_at.sort()

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
            if self._look and res.end > self._names_to:
                self._use_hint(fd, res.end)
            if self._look and res.end > self._names_to:
                self._find_names(fd, res.end)
            limit = None if max_bytes is None else res.end + max_bytes
            self._scan(fd, size, res, writer_gone, limit)
            self._names_to = max(self._names_to, res.end)
        finally:
            os.close(fd)
        return res

    def _use_hint(self, fd: int, upto: int) -> None:
        """Read the names frames :meth:`resume_from` named, when it named them for ``upto``."""
        hint, self._hint = self._hint, None
        if hint is None or hint[1] != upto:
            return
        names = hint[0]
        if not all(type(p) is int and self._names_to <= p < upto for p in names) or any(
            a >= b for a, b in itertools.pairwise(names)
        ):
            return  # not offsets this segment could have (a damaged cursor): follow headers
        stats = DecodeStats()
        for pos in names:
            hdr = _header_at(fd, pos)
            if hdr is None or not hdr[4] & FLAG_NAMES or not self._take_names(fd, pos, hdr, stats):
                return
        self._names_to = upto

    def _find_names(self, fd: int, upto: int) -> None:
        """Keep the layouts of the names frames before ``upto`` (a read that starts there):
        frame headers are followed one by one; past damage, the bytes are scanned."""
        pos = self._names_to
        if self.header is None:
            parsed = unpack_header(os.pread(fd, HEADER_SIZE, 0))
            if not isinstance(parsed, str):
                self.header = parsed
        if self.header is not None and self.header.version < 2:  # format 1: no names frames
            pos = upto
        stats = DecodeStats()  # (what they hold was counted by the reads that consumed them)
        while pos + FRAME_HEADER <= upto:
            hdr = _header_at(fd, pos)
            if hdr is None:
                seen = ReadResult(end=pos, stats=stats)  # damage: scan, as a read would
                self._scan(fd, upto, seen, True, None, names_only=True)
                break
            total = FRAME_HEADER + hdr[2] + FRAME_TRAILER
            if hdr[4] & FLAG_NAMES and pos + total <= upto:
                self._take_names(fd, pos, hdr, stats)
            pos += total
        self._names_to = max(self._names_to, upto)

    def _take_names(
        self, fd: int, pos: int, hdr: tuple[int, int, int, int, int], stats: DecodeStats
    ) -> bool:
        """Keep the layouts of the names frame at ``pos`` (its header ``hdr``); False when it
        is not an events frame whose payload checks out."""
        kind, schema, length, _seq, _flags = hdr
        total = FRAME_HEADER + length + FRAME_TRAILER
        data = os.pread(fd, total, pos)
        if kind == FRAME_SEAL or len(data) != total or not payload_ok(data, FRAME_HEADER, length):
            return False
        decode_events(memoryview(data)[FRAME_HEADER : total - FRAME_TRAILER], schema, stats,
                      self.layouts)  # fmt: skip
        self._names_frame(pos)
        return True

    def _scan(
        self,
        fd: int,
        size: int,
        res: ReadResult,
        writer_gone: bool,
        limit: int | None,
        *,
        names_only: bool = False,
    ) -> None:
        path = str(self.path)
        pos = res.end  # absolute offset of the first byte not yet examined
        bad_start: int | None = None  # start of a bad region being skipped
        want = _want(pos, limit, 0)
        while pos < size:
            asked = min(size - pos, want)
            raw = os.pread(fd, asked, pos)
            data = memoryview(raw)  # (checksums and payloads read in place, not copied)
            n = len(raw)
            if n < asked:
                size = pos + n  # the file shrank under us: trust what is there
            if n == 0:
                break
            i = 0
            need = 0  # bytes a frame starting at pos+i needs but this buffer lacks
            while i < n:
                if bad_start is not None:
                    j = raw.find(SYNC, i)
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
                kind, schema, length, seq, flags = hdr
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
                payload = data[i + FRAME_HEADER : i + FRAME_HEADER + length]
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
                if names_only and not flags & FLAG_NAMES:
                    pass  # (finding a resumed read's layouts: only names frames matter)
                elif self.decode or (flags & FLAG_NAMES and self._look):
                    if flags & FLAG_NAMES:
                        self._names_frame(start)
                    before, lost = res.stats.invalid_events, res.stats.unresolved
                    events = decode_events(payload, schema, res.stats, self.layouts)
                    if res.stats.unresolved != lost:  # its names frame lost: the frame is too
                        res.bad.append(BadRange(path, start, total, UNRESOLVED))
                    elif res.stats.invalid_events != before and self.decode:
                        # (undecoded, the caller decodes the frame and says so itself)
                        res.bad.append(BadRange(path, start, total, UNDECODABLE))
                    if res.stats.unresolved != lost or names_only:
                        pass
                    elif events or not flags & FLAG_NAMES:
                        res.frames.append(Frame(start, start + total, seq, schema,
                                                events if self.decode else [],
                                                None if self.decode else payload))  # fmt: skip
                    else:  # names only
                        res.frames.append(Frame(start, start + total, seq, schema, [], _NONE,
                                                self.layouts.last_ts))  # fmt: skip
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


def _header_at(fd: int, pos: int) -> tuple[int, int, int, int, int] | None:
    """The valid frame header at ``pos`` (see :func:`parse_frame_header`), or None."""
    head = os.pread(fd, FRAME_HEADER, pos)
    return parse_frame_header(head, 0) if len(head) == FRAME_HEADER else None


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
