"""The event types, as tagged msgspec Structs encoded as msgpack arrays.

Evolution rules (as msgspec's ``docs/schema-evolution.rst``, for array-like structs):

- the tag string of a kind is pinned forever, never derived from the class name;
- a field is never removed, renamed, reordered or retyped;
- a new field is appended at the end of its struct, with a default, and
  :data:`SCHEMA_VERSION` is incremented;
- a new kind gets a new tag and increments :data:`SCHEMA_VERSION`.

Every event is ``[tag, ts, field, field, ...]`` on the wire. An older reader
ignores trailing fields it does not know and skips kinds it does not know,
counting both (see :mod:`ranklog.schemas._codec`).
"""

from __future__ import annotations

from typing import Final, TypeAlias

import msgspec

__all__ = [
    "DEFAULT_METRIC_REDUCE",
    "DEFAULT_TIMER_REDUCE",
    "HOST_INDEX",
    "KINDS",
    "REDUCE_OPS",
    "SCHEMA_VERSION",
    "STEP_KINDS",
    "Event",
    "EventBase",
    "Gpu",
    "Heartbeat",
    "Histogram",
    "Image",
    "Metrics",
    "MetricsRaw",
    "ParamScalar",
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
]

#: Version of the event schema written by this release. Bumped whenever a field
#: or a kind is added; a reader meeting a higher version counts what it skips.
#: 2: histogram and image kinds; 3: step_end.events; 4: table; 5: params.lists
SCHEMA_VERSION: Final = 5

#: Reductions a value may ask for (the NeMo RL timer set, plus ``last``).
REDUCE_OPS: Final = frozenset({"mean", "sum", "min", "max", "median", "std", "count", "last"})
DEFAULT_METRIC_REDUCE: Final = "mean"
DEFAULT_TIMER_REDUCE: Final = "max"

ParamScalar: TypeAlias = str | int | float | bool | None
#: a hyperparameter as shippers see it: a scalar, or a list of scalars (``Params.lists``)
ParamValue: TypeAlias = ParamScalar | list[ParamScalar]
#: what one cell of a :class:`Table` may hold
TableCell: TypeAlias = str | int | float | bool | None


class EventBase(msgspec.Struct, array_like=True, tag=True, frozen=True, gc=False):
    """Fields every event carries: ``ts``, the wall-clock time (Unix seconds) it was logged."""

    ts: float


class RankStart(EventBase, tag="rank_start", frozen=True):
    """First event of every incarnation of a rank."""

    run_id: str
    rank: int
    world_size: int | None
    local_rank: int | None
    host: str
    pid: int
    incarnation: int
    version: str


class Metrics(EventBase, tag="metrics", frozen=True):
    """Values a rank logged for a step.

    ``reduce`` is either one op spec for every value (``"mean"``, or several ops
    joined by commas: ``"mean,max"``) or a map from value name to op spec; names
    absent from the map use ``"mean"``.
    """

    step: int
    values: dict[str, float]
    reduce: str | dict[str, str] = DEFAULT_METRIC_REDUCE


class MetricsRaw(EventBase, tag="metrics", frozen=True):
    """A :class:`Metrics` event read with its values map left as msgpack bytes.

    Not an event kind of its own: what :func:`~ranklog.schemas.decode_events_raw` gives
    in place of Metrics, for a reader that turns many events' values into columns at
    once (compaction) instead of building a dict per event. Its fields mirror Metrics'
    (names, order, defaults; a test checks): change both together.
    """

    step: int
    values: msgspec.Raw
    reduce: str | dict[str, str] = DEFAULT_METRIC_REDUCE


class Timer(EventBase, tag="timer", frozen=True):
    """A duration in seconds; reduced with ``max`` across ranks unless asked otherwise."""

    step: int
    name: str
    seconds: float
    reduce: str = DEFAULT_TIMER_REDUCE


#: ``Gpu.index`` of a sample of the host's memory (``mem_used``, ``mem_total``), not a GPU's
HOST_INDEX: Final = -1


class Gpu(EventBase, tag="gpu", frozen=True):
    """One sample of one GPU (or, with index :data:`HOST_INDEX`, of the host's memory);
    only one process per host samples."""

    host: str
    index: int
    util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    temp: float | None = None
    power: float | None = None
    step: int | None = None
    name: str = ""


class Params(EventBase, tag="params", frozen=True):
    """Hyperparameters, flattened with ``.``; secrets redacted.

    ``lists`` (schema 5) holds the values that are lists of scalars; an older reader
    skips it as an unknown field and keeps ``values``.
    """

    values: dict[str, ParamScalar]
    lists: dict[str, list[ParamScalar]] = msgspec.field(default_factory=dict)

    def all(self) -> dict[str, ParamValue]:
        """Every hyperparameter of the event, scalars and lists."""
        return {**self.values, **self.lists} if self.lists else dict(self.values)


class Text(EventBase, tag="text", frozen=True):
    """Validation samples and other text logged at a step."""

    step: int
    name: str
    text: str


class Histogram(EventBase, tag="histogram", frozen=True):
    """A distribution logged at a step (raw values; ranks' values are pooled when shipped)."""

    step: int
    name: str
    values: list[float]


class Image(EventBase, tag="image", frozen=True):
    """An image (a plot, say) logged at a step: encoded bytes, ``png`` by default."""

    step: int
    name: str
    data: bytes
    format: str = "png"


class Table(EventBase, tag="table", frozen=True):
    """A table logged at a step (W&B's ``wandb.Table``): named columns, rows of cells.

    Every row has one cell per column. Tables of several ranks are not merged into one
    value: each target shows each rank's table (a ``rank`` column where ranks share a name).
    """

    step: int
    name: str
    columns: list[str]
    rows: list[list[TableCell]]


class StepEnd(EventBase, tag="step_end", frozen=True):
    """Watermark: this rank has logged everything for steps up to and including ``step``.

    ``events`` is how many step events the incarnation logged for ``step`` before closing
    it (events late by its own watermark left out), or -1 when this step_end is not the
    one that closed ``step``. A reader that counts fewer knows frames were lost.
    """

    step: int
    events: int = -1


class Heartbeat(EventBase, tag="heartbeat", frozen=True):
    """Liveness during long steps (evaluation, checkpoint save)."""


class RankEnd(EventBase, tag="rank_end", frozen=True):
    """Clean close of an incarnation: ``status`` is ``ok``, ``error``, ``signal`` or ``exit``."""

    status: str
    exit_code: int | None = None


Event: TypeAlias = (
    RankStart
    | Metrics
    | Timer
    | Gpu
    | Params
    | Text
    | StepEnd
    | Heartbeat
    | RankEnd
    | Histogram
    | Image
    | Table
)

#: Events that belong to a step a rank logs (each carries ``step``).
StepEvent: TypeAlias = Metrics | Timer | Text | Histogram | Image | Table
#: The step event kinds, for ``isinstance``.
STEP_KINDS: Final = (Metrics, Timer, Text, Histogram, Image, Table)

#: Pinned tag string -> struct type. Never rename a key.
KINDS: Final[dict[str, type[EventBase]]] = {
    "rank_start": RankStart,
    "metrics": Metrics,
    "timer": Timer,
    "gpu": Gpu,
    "params": Params,
    "text": Text,
    "step_end": StepEnd,
    "heartbeat": Heartbeat,
    "rank_end": RankEnd,
    "histogram": Histogram,
    "image": Image,
    "table": Table,
}
