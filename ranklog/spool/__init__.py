"""The spool: append-only segment files, one writer each, and their readers.

Byte format (all integers little-endian, checksums are CRC-32/IEEE as ``zlib.crc32``)::

    segment  := header frame* [seal]
    header   := 64 bytes
        0   8  magic            89 52 4C 4F 47 0D 0A 1A  ("\\x89RLOG\\r\\n\\x1a")
        8   2  format version   1, or 2 (metrics may be packed)
       10   2  header size      64
       12   4  rank
       16   4  incarnation      1, 2, ... per rank (a restart never reuses one)
       20   4  segment          1, 2, ... per incarnation
       24   8  created          float64 Unix seconds
       32  16  run_id           UUID bytes (run.json's run_id)
       48   4  world size       0xFFFFFFFF when unknown
       52   8  reserved         zero
       60   4  crc32 of bytes 0..60
    frame    := 24-byte frame header, payload, 4-byte crc32 of the payload
        0   4  sync marker      F3 52 4C 1F
        4   1  type             1 = events, 2 = seal
        5   1  flags            bit 0: holds a names record (format 2), else 0
        6   2  schema version   of the events (ranklog.schemas.SCHEMA_VERSION)
        8   4  payload length   at most MAX_FRAME_BYTES (16 MiB)
       12   8  sequence number  per incarnation, from 0, continuing across segments
       20   4  crc32 of bytes 0..20
    payload  := msgpack array of events (type 1) | msgpack map (type 2: reason,
                frames, events, next_segment, host, ts)

Invariants:

- one process writes a file, ever; a restarted rank claims a new incarnation
  with an exclusive create of ``<incarnation>-000001.rlog``;
- the header, not the path or inode, is the file's identity;
- a frame is written with one ``pwritev`` at the writer's own offset; a failed
  write is truncated away before anything else is written, so a good frame is
  never preceded by a torn one written by a live writer;
- a segment rolls over before a frame would take it past its size limit
  (default 64 MiB); the rolled segment ends with a seal (``next_segment`` set),
  and a closed incarnation's last segment ends with a seal of reason ``close``;
- readers trust a length only after its header checksum matched and it is at
  most ``MAX_FRAME_BYTES``; they resynchronise on the sync marker after damage.

Format 2 packs metrics (a rank's names said once per layout, values as float64 bytes):
see :mod:`ranklog.schemas._packed` and docs/formats.md. Reader rules are in
:mod:`ranklog.spool._reader`.
"""

from ranklog.spool._format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    SegmentHeader,
)
from ranklog.spool._layout import (
    DeletedSegment,
    RunInfo,
    SegmentName,
    SpoolLayout,
    default_run_name,
    deleted_segments,
    ensure_run,
    read_run,
    record_deleted,
    require_run,
)
from ranklog.spool._reader import (
    UNDECODABLE,
    UNRESOLVED,
    BadRange,
    Frame,
    ReadResult,
    SegmentReader,
    read_segment,
)
from ranklog.spool._segid import SegmentId
from ranklog.spool._watermark import NO_STEP, implied_after, legacy_implied, watermark
from ranklog.spool._writer import DEFAULT_SEGMENT_BYTES, IncarnationWriter

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_FRAME_BYTES",
    "NO_STEP",
    "UNDECODABLE",
    "UNRESOLVED",
    "BadRange",
    "DeletedSegment",
    "Frame",
    "IncarnationWriter",
    "ReadResult",
    "RunInfo",
    "SegmentHeader",
    "SegmentId",
    "SegmentName",
    "SegmentReader",
    "SpoolLayout",
    "default_run_name",
    "deleted_segments",
    "ensure_run",
    "implied_after",
    "legacy_implied",
    "read_run",
    "read_segment",
    "record_deleted",
    "require_run",
    "watermark",
]
