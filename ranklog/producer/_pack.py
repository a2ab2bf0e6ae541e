"""Packing a rank's metrics calls into frames (segment format 2), off the caller's thread.

``log_metrics`` hands the sink its call as it is (time, step, values, spec): a tuple, no
encoding. Whoever writes the chunk (the background writer, or ``step_end`` at durability
``step``) turns it into frames here: the first call with a set of names and a spec
numbers a *layout* and puts its Names record just ahead of the call's Packed record, in
a frame flagged as holding one; later calls are Packed records only
(:mod:`ranklog.schemas._packed`). The layouts live here and are touched only under the
sink's I/O lock.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from ranklog.schemas import Metrics, Names, Packed
from ranklog.spool import IncarnationWriter

__all__ = ["MAX_LAYOUTS", "MAX_LAYOUT_BYTES", "PACK_MAX_NAMES", "Call", "Chunk", "Packer"]

#: layouts an incarnation packs at most, and the bytes of their Names records: past
#: either, calls are written as plain Metrics events (a run whose names change every step
#: gains nothing from packing, and each segment starts with every layout)
MAX_LAYOUTS: Final = 512
MAX_LAYOUT_BYTES: Final = 2 * 1024 * 1024
#: a call of more names is encoded at once, as a Metrics event (its size checked at the call)
PACK_MAX_NAMES: Final = 1024
#: what a call holds until it is written: (time, step, values, reduce spec)
Call = tuple[float, int, dict[str, float], str]
#: one frame: (events, their encoded bytes, whether it holds a Names record)
FrameOut = tuple[int, bytes, bool]


def call_size(values: dict[str, float]) -> int:
    """What the buffer counts a call for: the memory it holds until it is written (its dict,
    floats and tuple; ~6 times its packed size), so that ``max_buffer_bytes`` bounds memory
    as it did when calls were held encoded."""
    return 160 + 48 * len(values)


class Chunk(list[Any]):
    """Events buffered for one frame: encoded bytes, or metrics calls (:data:`Call`) packed
    when written. Once packed, its frames are kept until all are written (a write the disk
    refused is retried with the same bytes, Names records included)."""

    __slots__ = ("frames", "nbytes", "written")

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[FrameOut] | None = None
        self.nbytes = 0  # what the buffer counted it for
        self.written = 0  # frames of it written


class Packer:
    """The layouts of one incarnation, and the packing of its chunks into frames."""

    def __init__(
        self, writer: IncarnationWriter, encode: Callable[[Any], bytes], max_frame: int
    ) -> None:
        self._writer = writer
        self._encode = encode
        self._max_frame = max_frame
        #: reduce spec -> names -> (layout number, packer of the values, its record's time)
        self._layouts: dict[str, dict[tuple[str, ...], tuple[int, Any, float]]] = {}
        self._count = 0
        self._bytes = 0

    def frames(self, chunk: Chunk) -> list[FrameOut]:
        """``chunk`` as frames (one, unless its packed size passes a frame's cap), kept in
        ``chunk.frames``. All or nothing: the layouts it makes are known to later chunks
        (and to the writer, for later segments) only once the frames that hold their
        records are kept, so an exception amid it (KeyboardInterrupt) leaves no layout
        that a retry would use without its record."""
        # the usual chunk, one frame: every call of a layout known already, all of it within
        # a frame's cap (at durability ``step``, a step's calls and its step_end)
        layouts = self._layouts
        parts: list[bytes] = []
        for item in chunk:
            if type(item) is bytes:
                parts.append(item)
                continue
            _ts, _step, values, op = item
            known = layouts.get(op)
            got = None if known is None else known.get(tuple(values))
            if got is None:
                return self._frames(chunk)
            parts.append(self._record(item, got))
        body = b"".join(parts)
        if len(body) > self._max_frame:
            return self._frames(chunk)
        out = chunk.frames = [(len(parts), body, False)]
        return out

    def _frames(self, chunk: Chunk) -> list[FrameOut]:
        """:meth:`frames`, call by call: new layouts, caps, several frames."""
        out: list[FrameOut] = []
        parts: list[bytes] = []
        size, names = 0, False
        made: list[tuple[str, tuple[str, ...], tuple[int, Any, float], bytes]] = []
        records: tuple[bytes, ...]
        for item in chunk:
            if type(item) is bytes:
                records, data = (), item
            else:
                records, data = self._pack(item, made)
            more = len(data) + sum(map(len, records))
            if parts and size + more > self._max_frame:
                out.append((len(parts), b"".join(parts), names))
                parts, size, names = [], 0, False
            if records:
                parts += records
                names = True
            parts.append(data)
            size += more
        if parts:
            out.append((len(parts), b"".join(parts), names))
        chunk.frames = out
        for op, key, got, record in made:  # the writer first: a layout known only there is
            self._writer.add_names(record)  # harmless (each segment repeats its record)
            self._layouts.setdefault(op, {})[key] = got
        return out

    def _pack(
        self, call: Call, made: list[tuple[str, tuple[str, ...], tuple[int, Any, float], bytes]]
    ) -> tuple[tuple[bytes, ...], bytes]:
        """A call's Names record (when its layout is new: added to ``made``) and its Packed
        record; a plain Metrics event past the caps."""
        ts, step, values, op = call
        names = tuple(values)
        known = self._layouts.get(op)
        got = None if known is None else known.get(names)
        if got is None:
            got = next((g for o, k, g, _ in made if o == op and k == names), None)
        records: tuple[bytes, ...] = ()
        if got is None:
            new = self._new(ts, names, op)
            if new is None:
                return records, self._encode(Metrics(ts, step, values, op))
            got, record = new
            made.append((op, names, got, record))
            records = (record,)
        return records, self._record(call, got)

    def _record(self, call: Call, got: tuple[int, Any, float]) -> bytes:
        """The encoded Packed record of ``call``, of the layout ``got`` (its number, its
        values' packer, its record's time)."""
        ts, step, values, _ = call
        number, pack, base = got
        return self._encode(Packed(round((ts - base) * 1000), step, number, pack(*values.values())))

    def _new(
        self, ts: float, names: tuple[str, ...], op: str
    ) -> tuple[tuple[int, Any, float], bytes] | None:
        """Number a new layout (a number is never given twice, even if the chunk that took it
        is packed again) and encode its Names record. None past the caps."""
        if self._count >= MAX_LAYOUTS:
            return None
        record = self._encode(Names(ts, self._count, list(names), op))
        if self._bytes + len(record) > MAX_LAYOUT_BYTES:
            return None
        got = (self._count, struct.Struct(f"<{len(names)}d").pack, ts)
        self._count += 1
        self._bytes += len(record)
        return got, record
