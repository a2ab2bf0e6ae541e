"""Event schemas: what a rank writes into the spool.

The kinds and their pinned tags are in :mod:`ranklog.schemas._events`; the
reused encoder and the never-raising decoder in :mod:`ranklog.schemas._codec`.
"""

from ranklog.schemas._codec import DecodeStats, decode_events, encoder
from ranklog.schemas._events import (
    DEFAULT_METRIC_REDUCE,
    DEFAULT_TIMER_REDUCE,
    HOST_INDEX,
    KINDS,
    REDUCE_OPS,
    SCHEMA_VERSION,
    STEP_KINDS,
    Event,
    EventBase,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    Params,
    ParamValue,
    RankEnd,
    RankStart,
    StepEnd,
    StepEvent,
    Table,
    TableCell,
    Text,
    Timer,
)

__all__ = [
    "DEFAULT_METRIC_REDUCE",
    "DEFAULT_TIMER_REDUCE",
    "HOST_INDEX",
    "KINDS",
    "REDUCE_OPS",
    "SCHEMA_VERSION",
    "STEP_KINDS",
    "DecodeStats",
    "Event",
    "EventBase",
    "Gpu",
    "Heartbeat",
    "Histogram",
    "Image",
    "Metrics",
    "ParamValue",
    "Params",
    "RankEnd",
    "RankStart",
    "StepEnd",
    "StepEvent",
    "Table",
    "TableCell",
    "Text",
    "Timer",
    "decode_events",
    "encoder",
]
