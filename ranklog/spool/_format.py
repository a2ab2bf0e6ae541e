"""Byte layout of segment headers and frames, and the pure functions that pack them.

See the package docstring of :mod:`ranklog.spool` for the format description.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FLAG_NAMES",
    "FORMAT_VERSION",
    "FRAME_EVENTS",
    "FRAME_HEADER",
    "FRAME_SEAL",
    "FRAME_TRAILER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "SYNC",
    "SegmentHeader",
    "frame_header",
    "msgpack_array_header",
    "pack_header",
    "unpack_header",
]

MAGIC: Final = b"\x89RLOG\r\n\x1a"
#: 1: every metrics event a map of names to values; 2: metrics may be packed (names frames,
#: :mod:`ranklog.schemas._packed`). A reader reads both.
FORMAT_VERSION: Final = 2
HEADER_SIZE: Final = 64
SYNC: Final = b"\xf3RL\x1f"
FRAME_EVENTS: Final = 1
FRAME_SEAL: Final = 2
#: frame header flag: an events frame that holds a Names record (format 2): a new
#: segment's first frame holds only those, a frame of events may hold one ahead of the
#: first event of its layout
FLAG_NAMES: Final = 1
#: Hard cap on a frame's payload, enforced by writer and reader alike.
MAX_FRAME_BYTES: Final = 16 * 1024 * 1024

# magic, version, header size, rank, incarnation, segment, created, run_id, world, reserved
_HEADER: Final = struct.Struct("<8sHHIIId16sI8s")
_HEADER_CRC: Final = struct.Struct("<I")
# sync, type, flags, schema, payload length, sequence number
_FRAME: Final = struct.Struct("<4sBBHIQ")
FRAME_HEADER: Final = _FRAME.size + 4  # plus the header checksum
FRAME_TRAILER: Final = 4  # payload checksum
_U32: Final = struct.Struct("<I")
_NO_WORLD: Final = 0xFFFFFFFF

assert _HEADER.size + _HEADER_CRC.size == HEADER_SIZE


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """Identity of a segment file, read from its first 64 bytes."""

    rank: int
    incarnation: int
    segment: int
    created: float
    run_id: str
    world_size: int | None
    version: int = FORMAT_VERSION


def pack_header(h: SegmentHeader) -> bytes:
    """The 64 header bytes of a segment."""
    body = _HEADER.pack(
        MAGIC,
        h.version,
        HEADER_SIZE,
        h.rank,
        h.incarnation,
        h.segment,
        h.created,
        uuid.UUID(hex=h.run_id).bytes,
        _NO_WORLD if h.world_size is None else h.world_size,
        b"\0" * 8,
    )
    return body + _HEADER_CRC.pack(zlib.crc32(body))


def unpack_header(data: bytes) -> SegmentHeader | str:
    """Parse 64 header bytes; a string says why they are not a valid header."""
    if len(data) < HEADER_SIZE:
        return f"header truncated ({len(data)} of {HEADER_SIZE} bytes)"
    if data[:8] != MAGIC:
        return "not a ranklog segment (bad magic)"
    body = data[: _HEADER.size]
    (crc,) = _HEADER_CRC.unpack_from(data, _HEADER.size)
    if zlib.crc32(body) != crc:
        return "header checksum mismatch"
    _, version, size, rank, inc, seg, created, run_id, world, _ = _HEADER.unpack(body)
    if size != HEADER_SIZE:
        return f"unsupported header size {size}"
    return SegmentHeader(
        rank=rank,
        incarnation=inc,
        segment=seg,
        created=created,
        run_id=uuid.UUID(bytes=run_id).hex,
        world_size=None if world == _NO_WORLD else world,
        version=version,
    )


def frame_header(kind: int, schema: int, length: int, seq: int, flags: int = 0) -> bytes:
    """The 24 bytes that precede a frame's payload."""
    head = _FRAME.pack(SYNC, kind, flags, schema, length, seq)
    return head + _U32.pack(zlib.crc32(head))


def parse_frame_header(data: bytes | memoryview, pos: int) -> tuple[int, int, int, int, int] | None:
    """``(kind, schema, length, seq, flags)`` of a valid frame header at ``pos``, else None.

    The caller guarantees ``FRAME_HEADER`` bytes are available at ``pos``.
    """
    sync, kind, flags, schema, length, seq = _FRAME.unpack_from(data, pos)
    if sync != SYNC:
        return None
    (crc,) = _U32.unpack_from(data, pos + _FRAME.size)
    if zlib.crc32(data[pos : pos + _FRAME.size]) != crc:
        return None
    if length > MAX_FRAME_BYTES or kind not in (FRAME_EVENTS, FRAME_SEAL):
        return None
    return kind, schema, length, seq, flags


def payload_ok(data: bytes | memoryview, start: int, length: int) -> bool:
    """Whether the payload at ``start`` matches the checksum that follows it."""
    crc: int = _U32.unpack_from(data, start + length)[0]
    return zlib.crc32(data[start : start + length]) == crc


def crc_trailer(*parts: bytes | bytearray | memoryview) -> bytes:
    """The 4-byte checksum trailer of a payload given in parts."""
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return _U32.pack(crc)


def msgpack_array_header(n: int) -> bytes:
    """The msgpack array header for ``n`` elements (the events follow, pre-encoded)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")
