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

import struct
from typing import Final, TypeAlias

import msgspec

__all__ = [
    "DEFAULT_METRIC_REDUCE",
    "DEFAULT_TIMER_REDUCE",
    "HOST_INDEX",
    "KINDS",
    "META_PREFIX",
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
    "MetricsPacked",
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
    "is_meta_key",
    "params_event",
    "split_meta",
]

#: Version of the event schema written by this release. Bumped whenever a field
#: or a kind is added; a reader meeting a higher version counts what it skips.
#: 2: histogram and image kinds; 3: step_end.events; 4: table; 5: params.lists;
#: 6: params.meta (run records: metric definitions, summary values, code provenance),
#: image.plotly; 7: the format records ``names`` and ``mp`` (segment format 2,
#: :mod:`ranklog.schemas._packed`)
SCHEMA_VERSION: Final = 7

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


class MetricsPacked(msgspec.Struct, frozen=True, gc=False):
    """A :class:`Metrics` event as the shipper's reader gives packed values (segment format
    2): the layout's ``names`` (one tuple per distinct list of names, shared by every rank
    and segment, so ``is`` compares them) and their values in that order, with no dict.

    Not an event kind of its own, and never written: ``values`` makes the dict on demand,
    for the paths that want one; the usual step takes the values as columns instead.
    """

    ts: float
    step: int
    names: tuple[str, ...]
    row: tuple[float, ...]
    reduce: str = DEFAULT_METRIC_REDUCE
    #: the values still packed (little-endian float64), ``row`` left empty: the shipper
    #: unpacks a step's at once, compaction hands the bytes of many events to numpy
    packed: bytes = b""

    @property
    def values(self) -> dict[str, float]:
        """The names and values, as :attr:`Metrics.values` holds them."""
        row = self.row if self.row or not self.packed else _unpack(self.packed)
        return dict(zip(self.names, row, strict=True))


def _unpack(data: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(data) // 8}d", data)


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


#: the first character of a run record's key where records travel with hyperparameters
#: (a hyperparameter's name never starts with it: the producer refuses one that does)
META_PREFIX: Final = "@"


class Params(EventBase, tag="params", frozen=True):
    """Hyperparameters, flattened with ``.``; secrets redacted.

    ``lists`` (schema 5) holds the values that are lists of scalars; an older reader
    skips it as an unknown field and keeps ``values``. ``meta`` (schema 6) holds *run
    records*, which are not hyperparameters: ``define/<glob>`` (a metric definition, its
    options as JSON), ``summary/<key>`` (a summary value), ``code/<field>`` (the code the
    run came from); an older reader skips it. Shippers carry records beside the
    hyperparameters under :data:`META_PREFIX` (see :meth:`all`, :func:`params_event`).
    """

    values: dict[str, ParamScalar]
    lists: dict[str, list[ParamScalar]] = msgspec.field(default_factory=dict)
    meta: dict[str, ParamScalar] = msgspec.field(default_factory=dict)

    def all(self) -> dict[str, ParamValue]:
        """Every value of the event: scalars, lists and records (``@``-prefixed keys).

        A hyperparameter whose own name starts with ``@`` (legal before schema 6; the
        producer now refuses one) is given one more ``@``, so it is never taken for a record.
        """
        if not self.lists and not self.meta and not any(k[:1] == META_PREFIX for k in self.values):
            return dict(self.values)
        out: dict[str, ParamValue] = {}
        for k, v in (*self.values.items(), *self.lists.items()):
            out[META_PREFIX + k if k[:1] == META_PREFIX else k] = v
        for k, v in self.meta.items():
            out[META_PREFIX + k] = v
        return out


def is_meta_key(key: str) -> bool:
    """Whether a key of :meth:`Params.all` names a run record (``@code/commit``), not a
    hyperparameter (``lr``, or ``@@x``: a hyperparameter named ``@x``)."""
    return key[:1] == META_PREFIX and key[1:2] != META_PREFIX


def params_event(ts: float, flat: dict[str, ParamValue]) -> Params:
    """The :class:`Params` event whose :meth:`Params.all` is ``flat``."""
    values: dict[str, ParamScalar] = {}
    lists: dict[str, list[ParamScalar]] = {}
    meta: dict[str, ParamScalar] = {}
    for k, v in flat.items():
        if is_meta_key(k):
            if not isinstance(v, list):
                meta[k[1:]] = v
            continue
        name = k[1:] if k[:1] == META_PREFIX else k  # "@@x": the hyperparameter "@x"
        if isinstance(v, list):
            lists[name] = v
        else:
            values[name] = v
    return Params(ts, values, lists, meta)


def split_meta(
    params: dict[str, ParamValue],
) -> tuple[dict[str, ParamValue], dict[str, ParamScalar]]:
    """Hyperparameters (by their own names) and run records (keys without their ``@``) of
    one map as :meth:`Params.all` gives it."""
    if not any(k[:1] == META_PREFIX for k in params):
        return params, {}
    user: dict[str, ParamValue] = {}
    meta: dict[str, ParamScalar] = {}
    for k, v in params.items():
        if is_meta_key(k):
            if not isinstance(v, list):
                meta[k[1:]] = v
        else:
            user[k[1:] if k[:1] == META_PREFIX else k] = v
    return user, meta


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
    """An image (a plot, say) logged at a step: encoded bytes, ``png`` by default.

    ``plotly`` (schema 6): the same plot as a Plotly figure's JSON, when the producer
    could make one (a matplotlib figure, plotly installed), for the targets that show
    interactive charts (W&B); "" otherwise. Every target can fall back to ``data``.
    """

    step: int
    name: str
    data: bytes
    format: str = "png"
    plotly: str = ""


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
StepEvent: TypeAlias = Metrics | MetricsPacked | Timer | Text | Histogram | Image | Table
#: The step event kinds, for ``isinstance`` (with the form a shipper reads packed values in).
STEP_KINDS: Final = (Metrics, MetricsPacked, Timer, Text, Histogram, Image, Table)

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
