"""Packed metrics (segment format 2): a rank's names said once, values as float64 bytes.

A rank logs the same names step after step. In format 2 its writer says a set of names
and their reduce spec once, in a :class:`Names` record (a *layout*, numbered per
incarnation), and each metrics event is then a :class:`Packed` event: the step, the
layout's number, the values as little-endian float64 (one per name, in the layout's order)
and the time as milliseconds after the layout's record. With 24-character names that is
~9 bytes per value instead of ~35.

These are records of the spool format, not events a shipper sees: a reader keeps the
layouts of the segment it reads (:class:`Layouts`) and turns each Packed event back into
the :class:`~ranklog.schemas.Metrics` event it stands for (:func:`resolve`), bit for bit.
A Packed event whose layout the reader does not hold (its names frame lost to damage),
or whose bytes do not fit it, is an invalid event: skipped and counted, as any other.

Rules the writer keeps (and the reader relies on):

- a layout's number is never given to other names within an incarnation;
- every segment holds the Names record of each layout its Packed events use, before
  them: the records go in frames of their own (flag :data:`~ranklog.spool._format.FLAG_NAMES`
  in the frame header), and a new segment starts with one such frame holding every
  layout so far, so a reader that starts mid-segment finds them by frame headers alone;
- a metrics event whose reduce spec is a map, or past the layouts' caps, is written as a
  plain Metrics event (both kinds may meet in one segment).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from ranklog._kept import Kept
from ranklog.schemas._events import (
    DEFAULT_METRIC_REDUCE,
    Event,
    EventBase,
    Metrics,
    MetricsPacked,
)

__all__ = ["WIRE_KINDS", "Layouts", "Names", "Packed", "resolve"]


class Names(EventBase, tag="names", frozen=True):
    """A layout: ``id`` stands for these metric ``names``, in this order, each reduced with
    ``reduce`` (one op spec: ``mean``, or several ops joined by commas)."""

    id: int
    names: list[str]
    reduce: str = DEFAULT_METRIC_REDUCE


class Packed(msgspec.Struct, array_like=True, tag="mp", frozen=True, gc=False):
    """Values a rank logged for a step, in the order of the names of layout ``layout``:
    ``values`` holds one little-endian float64 each. ``ms``: when they were logged, in
    milliseconds after the layout's Names record (``ts``; negative if the clock went back).

    Not an :class:`~ranklog.schemas.EventBase`: its time is an offset (5 bytes on the wire,
    not 9), and its tag is short. 20 values cost 175 bytes with it, 8.75 a value.
    """

    ms: int
    step: int
    layout: int
    values: bytes


#: the format records, tag -> struct (beside :data:`~ranklog.schemas.KINDS`; never renamed)
WIRE_KINDS: Final[dict[str, type[msgspec.Struct]]] = {"names": Names, "mp": Packed}


#: one tuple per distinct list of names, process-wide (:class:`MetricsPacked` shares them),
#: holding at most 1,000,000 names (a shipper lives long; past it, new lists of names are
#: not shared: their steps take the dict path, as correct, slower)
_CANON: Final[Kept[tuple[str, ...], tuple[str, ...]]] = Kept(1_000_000)


def _canonical(names: list[str]) -> tuple[str, ...]:
    key = tuple(names)
    got = _CANON.get(key)
    return got if got is not None else _CANON.keep(key, key)


class Layouts:
    """The layouts a reader has met in one segment (numbers are an incarnation's own).

    ``rows``: packed values come out as :class:`MetricsPacked` with a row of floats, not
    as Metrics events with a dict each; ``packed``: as MetricsPacked that keep their bytes
    (the shipper's and compaction's readers).
    """

    __slots__ = ("_by_id", "last_ts", "packed", "rows")

    def __init__(self, *, rows: bool = False, packed: bool = False) -> None:
        self.rows = rows or packed
        self.packed = packed
        self._by_id: dict[int, tuple[tuple[str, ...], str, Any, float]] = {}
        #: the time of the last Names record met (a names frame's, for its row in a dataset)
        self.last_ts = 0.0

    def copy(self) -> Layouts:
        """The same layouts, kept apart (a second decode of frames starts where the first
        did, not with what the first learned from them)."""
        out = Layouts(rows=self.rows, packed=self.packed)
        out._by_id = dict(self._by_id)
        out.last_ts = self.last_ts
        return out

    def add(self, rec: Names) -> str | None:
        """Keep ``rec``; a string says why it is refused (its names twice, or its number
        already standing for other names)."""
        self.last_ts = rec.ts
        known = self._by_id.get(rec.id)
        if known is not None:
            if list(known[0]) == rec.names and known[1] == rec.reduce:
                return None  # said again (each segment repeats the layouts in use)
            return f"layout {rec.id} given twice, to other names"
        if len(set(rec.names)) != len(rec.names):
            return f"layout {rec.id} names a metric twice"
        fmt = struct.Struct(f"<{len(rec.names)}d")
        self._by_id[rec.id] = (_canonical(rec.names), rec.reduce, fmt, rec.ts)
        return None

    def why_not(self, ev: Packed) -> str:
        """Why ``ev`` has no Metrics event here (:func:`resolve` found none for it)."""
        known = self._by_id.get(ev.layout)
        if known is None:
            return f"packed values of step {ev.step}: layout {ev.layout} is not in this segment"
        return (
            f"packed values of step {ev.step}: {len(ev.values)} bytes for the "
            f"{len(known[0])} names of layout {ev.layout}"
        )


def resolve(events: Iterable[Any], layouts: Layouts, problems: list[str]) -> list[Event]:
    """``events`` with each Names record kept in ``layouts`` (and left out) and each Packed
    event turned into its Metrics event (a :class:`MetricsPacked` with ``layouts.rows``);
    one line per record refused goes to ``problems``."""
    out: list[Any] = []
    append = out.append
    by_id = layouts._by_id
    rows, keep = layouts.rows, layouts.packed
    for ev in events:
        kind = type(ev)
        if kind is Packed:  # (once per value set: kept inline)
            known = by_id.get(ev.layout)
            if known is None or len(ev.values) != known[2].size:
                problems.append(layouts.why_not(ev))
                continue
            names, reduce, fmt, base = known
            if keep:
                append(MetricsPacked(base + ev.ms / 1000, ev.step, names, (), reduce, ev.values))
            elif rows:
                append(MetricsPacked(base + ev.ms / 1000, ev.step, names, fmt.unpack(ev.values),
                                     reduce))  # fmt: skip
            else:
                values = dict(zip(names, fmt.unpack(ev.values), strict=True))
                append(Metrics(base + ev.ms / 1000, ev.step, values, reduce))
        elif kind is Names:
            why = layouts.add(ev)
            if why is not None:
                problems.append(why)
        else:
            append(ev)
    return out
