"""Encoding and decoding of frame payloads (msgpack arrays of events).

One :class:`msgspec.msgpack.Encoder` and one typed decoder are built once and
reused. Decoding takes a fast path (one typed decode of the whole payload) and
falls back to decoding event by event when the fast path fails or when the frame
was written by a newer schema; the slow path skips and counts unknown kinds,
unknown trailing fields and events that do not validate, and never raises.

:func:`decode_events_raw` is the same with each Metrics event's values map left as
msgpack bytes (:class:`~ranklog.schemas.MetricsRaw`); its fast path checks everything
but those maps, and any frame it cannot take goes to :func:`decode_events` whole, so
the two agree on every frame whose maps are valid. :func:`metrics_values` decodes one
map as the Metrics decoder would, raising where it would have refused the event.

Both decoders read the format records of segment format 2 too
(:mod:`ranklog.schemas._packed`): given a reader's :class:`~ranklog.schemas.Layouts`, they
keep its Names records and turn its Packed events into Metrics events; a record they
refuse is an invalid event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Union, cast, get_args

import msgspec

from ranklog.schemas._events import KINDS, SCHEMA_VERSION, Event, Metrics, MetricsRaw
from ranklog.schemas._packed import WIRE_KINDS, Layouts, Names, Packed, resolve

__all__ = ["DecodeStats", "decode_events", "decode_events_raw", "encoder", "metrics_values"]

#: The process-wide encoder. msgspec encoders are not thread-safe for concurrent
#: ``encode_into`` on the *same buffer*, but are safe to share otherwise.
encoder: Final = msgspec.msgpack.Encoder()
#: what a frame's array may hold: an Event, or a format record (a Names or Packed)
_WIRE: Any = Union[(*get_args(Event), Names, Packed)]
_list_decoder: Final = msgspec.msgpack.Decoder(list[_WIRE])
_raw_decoder: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_one_decoder: Final = msgspec.msgpack.Decoder(_WIRE)
_any_decoder: Final = msgspec.msgpack.Decoder()
#: the same, with MetricsRaw in place of Metrics
_RAW_WIRE: Any = Union[tuple(MetricsRaw if k is Metrics else k for k in get_args(_WIRE))]  # noqa: UP007
_raw_list_decoder: Final = msgspec.msgpack.Decoder(list[_RAW_WIRE])
_values_decoder: Final = msgspec.msgpack.Decoder(dict[str, float])
_ALL_KINDS: Final = {**KINDS, **WIRE_KINDS}
_FIELD_COUNT: Final = {tag: len(cls.__struct_fields__) for tag, cls in _ALL_KINDS.items()}
_RECORDS: Final = frozenset((Names, Packed))


@dataclass(slots=True)
class DecodeStats:
    """What a decode skipped: counts that readers accumulate and report."""

    unknown_kinds: int = 0
    unknown_fields: int = 0
    invalid_events: int = 0
    #: of those, packed values whose layout is missing or does not fit them (format 2): a
    #: reader drops their whole frame, as if it were lost (a names frame lost to damage)
    unresolved: int = 0
    #: First few reasons an event was skipped, with its index in the frame.
    reasons: list[str] | None = None

    def note(self, reason: str) -> None:
        """Remember a skip reason (the first ten are kept)."""
        if self.reasons is None:
            self.reasons = []
        if len(self.reasons) < 10:
            self.reasons.append(reason)


def decode_events(
    payload: bytes | memoryview,
    schema: int = SCHEMA_VERSION,
    stats: DecodeStats | None = None,
    layouts: Layouts | None = None,
) -> list[Event]:
    """Decode a frame payload into events; never raises on bad bytes.

    ``schema`` is the version recorded in the frame header. Events this reader
    cannot use are skipped and counted in ``stats``. ``layouts``: the segment's layouts
    so far (format 2), which this frame's Names records join; without it, only the
    frame's own are known.
    """
    out: list[Any] | None = None
    if schema <= SCHEMA_VERSION:
        try:  # (not contextlib.suppress: a context manager per frame costs ~0.5 us)
            out = _list_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            out = None
    if out is None:
        stats = stats if stats is not None else DecodeStats()
        out = _decode_slow(payload, schema, stats)
    if any(map(_RECORDS.__contains__, map(type, out))):
        return _resolve(out, layouts, stats)
    return out


def decode_events_raw(
    payload: bytes | memoryview,
    schema: int = SCHEMA_VERSION,
    stats: DecodeStats | None = None,
    layouts: Layouts | None = None,
) -> list[Event | MetricsRaw]:
    """As :func:`decode_events`, with Metrics events as :class:`MetricsRaw` (values undecoded).

    A frame the raw decode cannot take (a newer schema, an event that does not validate)
    is decoded by :func:`decode_events` instead: its Metrics events are then plain ones,
    as are those that Packed events stand for.
    """
    if schema <= SCHEMA_VERSION:
        try:
            got: list[Any] = _raw_list_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            if any(map(_RECORDS.__contains__, map(type, got))):
                return cast(list[Event | MetricsRaw], _resolve(got, layouts, stats))
            return cast(list[Event | MetricsRaw], got)
    out: list[Event | MetricsRaw] = []
    out += decode_events(payload, schema, stats, layouts)
    return out


def _resolve(events: list[Any], layouts: Layouts | None, stats: DecodeStats | None) -> list[Event]:
    problems: list[str] = []
    out = resolve(events, Layouts() if layouts is None else layouts, problems)
    if problems and stats is not None:
        stats.invalid_events += len(problems)
        stats.unresolved += len(problems)
        for why in problems:
            stats.note(why)
    return out


def metrics_values(event: MetricsRaw) -> dict[str, float]:
    """``event``'s values, as :class:`~ranklog.schemas.Metrics` decodes them.

    Raises :class:`msgspec.ValidationError` or :class:`msgspec.DecodeError` where the
    Metrics decoder would have refused the event.
    """
    return _values_decoder.decode(event.values)


def _decode_slow(payload: bytes | memoryview, schema: int, stats: DecodeStats) -> list[Any]:
    try:
        raws = _raw_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        stats.invalid_events += 1
        stats.note(f"payload is not a msgpack array: {exc}")
        return []
    out: list[Any] = []
    for i, raw in enumerate(raws):
        try:
            out.append(_one_decoder.decode(raw))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            generic: Any = _generic(raw)
            tag = generic[0] if isinstance(generic, list) and generic else None
            if isinstance(tag, str) and tag not in _ALL_KINDS:
                stats.unknown_kinds += 1
                stats.note(f"event {i}: unknown kind {tag!r} skipped")
            else:
                stats.invalid_events += 1
                stats.note(f"event {i}: {exc}")
            continue
        if schema > SCHEMA_VERSION:
            generic = _generic(raw)
            known = _FIELD_COUNT[generic[0]] + 1  # the tag is element 0
            if len(generic) > known:
                stats.unknown_fields += len(generic) - known
    return out


def _generic(raw: msgspec.Raw) -> Any:
    try:
        return _any_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
