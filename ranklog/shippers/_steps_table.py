"""The ``steps`` table: the calls a target received, as rows of Parquet, and back.

One engine decides what a run's steps are (:class:`~ranklog.shippers.Shipper`); this table
keeps what it decided, call by call, so that replay hands any target the same calls
without deciding anything again. The ``parquet:`` target writes it live; ``ranklog
compact`` writes it into a dataset's ``steps/`` through the same target.

Rows, in call order (``kind``):

- ``step``: one per shipped step (``step``; ``carrier`` for late values: the step they
  were shipped with), with ``ranks``, ``world_size``, ``complete``, ``ts``, and in
  ``data`` the step's other kinds when it has any (texts, distributions, images,
  tables, GPU stats: msgpack of :class:`Media`);
- ``metric``: one per reduced value of that step, right after it, in the order the
  target received them (``name``, ``value``; the step's columns repeated, so that a
  query needs no join);
- ``params``: one ``write_params``/``write_meta`` call (``data``: msgpack of the values,
  keyed as the engine keys them: run records under ``@``, ``@code/commit``; ``step``: the
  step it was written before, null when it came after the last one);
- ``end``: the job ended (``name``: ``finished``, ``failed`` or ``killed``).

A DuckDB loss curve::

    SELECT step, value FROM 'DS/steps/*.parquet'
    WHERE kind = 'metric' AND name = 'train/loss' AND carrier IS NULL ORDER BY step

Format evolution: a file's ``ranklog.steps`` metadata says its version (1). Readers take
columns by name and pass over columns they do not know; a new ``kind`` of row comes with
a new version (a reader of version 1 refuses a row of another kind, as damage: replay
then reads the raw rows of a table of another version).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ranklog.schemas import META_PREFIX, ParamValue
from ranklog.shippers._target import GpuStat, ImageItem, ShippedStep, TableItem, TextItem

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "STEPS_VERSION",
    "Call",
    "Media",
    "StepsBuffer",
    "read_calls",
    "step_files",
    "steps_schema",
]

#: the ``ranklog.steps`` metadata of a file of this table
STEPS_VERSION: Final = "1"

#: a file of the table: its number (the order it was written in)
FILE: Final = re.compile(r"steps-(\d{8,})\.parquet")


def step_files(path: Path) -> tuple[list[Path], list[str]]:
    """The steps files in ``path`` in order, and the names of other files there (a
    writer's hidden temporary files passed over); none when ``path`` does not exist."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return [], []
    files, others = [], []
    for name in names:
        if m := FILE.fullmatch(name):
            files.append((int(m.group(1)), path / name))
        elif not name.startswith("."):
            others.append(name)
    return [f for _, f in sorted(files)], sorted(others)


#: one call a target received: ("steps", [ShippedStep]), ("params", values, before),
#: ("end", status)
Call = tuple[Any, ...]


class Media(msgspec.Struct, omit_defaults=True):
    """A step's values other than metrics (its ``data``)."""

    texts: list[TextItem] = msgspec.field(default_factory=list)
    histograms: dict[str, list[float]] = msgspec.field(default_factory=dict)
    images: list[ImageItem] = msgspec.field(default_factory=list)
    gpu: list[GpuStat] = msgspec.field(default_factory=list)
    tables: list[TableItem] = msgspec.field(default_factory=list)


_ENC: Final = msgspec.msgpack.Encoder()
_MEDIA: Final = msgspec.msgpack.Decoder(Media)
_PARAMS: Final = msgspec.msgpack.Decoder(dict[str, ParamValue])
_COLUMNS: Final = ("kind", "step", "carrier", "name", "value", "ranks", "world_size",
                   "complete", "ts", "data")  # fmt: skip


def steps_schema(metadata: dict[str, str]) -> pa.Schema:
    """The table's Arrow schema, with ``metadata`` (``ranklog.*`` keys) on it."""
    import pyarrow as pa

    fields = [
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("step", pa.int64()),
        pa.field("carrier", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("ranks", pa.int32()),
        pa.field("world_size", pa.int32()),
        pa.field("complete", pa.bool_()),
        pa.field("ts", pa.float64()),
        pa.field("data", pa.binary()),
    ]
    return pa.schema(fields, metadata={"ranklog.steps": STEPS_VERSION, **metadata})


class StepsBuffer:
    """Rows of the table, added call by call, until :meth:`table` takes them."""

    def __init__(self) -> None:
        self._cols: dict[str, list[Any]] = {c: [] for c in _COLUMNS}
        #: ``params`` rows waiting for the step they are written before
        self._before: list[int] = []

    def __len__(self) -> int:
        return len(self._cols["kind"])

    def steps(self, steps: Sequence[ShippedStep]) -> None:
        """A ``write(steps)`` call."""
        c = self._cols
        kind, step, carrier, name, value = (c[k] for k in _COLUMNS[:5])
        ranks, world, complete, ts, data = (c[k] for k in _COLUMNS[5:])
        for s in steps:
            if s.carrier is None and self._before:
                for i in self._before:
                    step[i] = s.step
                self._before = []
            media = None
            if s.texts or s.histograms or s.images or s.gpu or s.tables:
                m = Media(s.texts, s.histograms, s.images, s.gpu, s.tables)
                media = _ENC.encode(m)
            n = len(s.metrics) + 1
            kind.append("step")
            kind += ["metric"] * (n - 1)
            step += [s.step] * n
            carrier += [s.carrier] * n
            name.append(None)
            name += s.metrics.keys()
            value.append(None)
            value += s.metrics.values()
            ranks += [s.ranks] * n
            world += [s.world_size] * n
            complete += [s.complete] * n
            ts += [s.ts] * n
            data.append(media)
            data += [None] * (n - 1)

    def params(self, values: Mapping[str, ParamValue], *, meta: bool = False) -> None:
        """A ``write_params`` (or, ``meta``, ``write_meta``) call: written before the next
        step, as the engine holds it (run records' keys under ``@``, a hyperparameter
        named ``@x`` as ``@@x``: :func:`~ranklog.schemas.split_meta` gives the call back)."""
        if meta:
            group = {META_PREFIX + k: v for k, v in values.items()}
        else:
            group = {META_PREFIX + k if k[:1] == META_PREFIX else k: v for k, v in values.items()}
        self._before.append(len(self))
        self._row("params", data=_ENC.encode(group))

    def end(self, status: str) -> None:
        """An ``end(status)`` call."""
        self._row("end", name=status)

    def _row(self, kind: str, **values: Any) -> None:
        for col, out in self._cols.items():
            out.append(kind if col == "kind" else values.get(col))

    def table(self, metadata: dict[str, str]) -> pa.Table:
        """The rows so far as a table; the buffer is emptied (``params`` rows whose step
        is not known yet keep null: written after the last step of the table)."""
        import pyarrow as pa

        schema = steps_schema(metadata)
        arrays = [pa.array(self._cols[f.name], f.type) for f in schema]
        self._cols = {c: [] for c in _COLUMNS}
        self._before = []
        return pa.Table.from_arrays(arrays, schema=schema)


def read_calls(table: pa.Table, *, where: str) -> Iterator[Call]:
    """The calls a table's rows hold, in order (``where``: the file, for errors).

    Consecutive steps are one ``("steps", [...])`` call; a ``params`` row is
    ``("params", values, before)`` (``before``: the step, or None); ``end`` is
    ``("end", status)``. Anything else (a column of another type, a step without its
    step, ranks above the world size, a value without a name, a row of a kind version 1
    has not) is :class:`~ranklog.errors.SpoolFormatError` naming the row: the table is
    data, never trusted. Columns are read whole (names through their
    dictionary, values as one float64 array: bits kept), a Python object made only for
    what a target receives.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from ranklog.errors import SpoolFormatError

    want = steps_schema({})
    for f in want:
        if f.name not in table.column_names:
            raise SpoolFormatError(f"{where}: not a ranklog steps table (no column {f.name})")
        got = table.schema.field(f.name).type
        if pa.types.is_dictionary(got):
            got = got.value_type
        if got != (f.type.value_type if pa.types.is_dictionary(f.type) else f.type):
            raise SpoolFormatError(f"{where}: column {f.name} is {got}, not {f.type}: not a "
                                   "steps table this release wrote")  # fmt: skip
    if table.num_rows == 0:
        return
    kinds = pc.cast(table.column("kind"), pa.string()).combine_chunks()
    heads = pc.indices_nonzero(pc.not_equal(kinds, "metric")).to_numpy()
    head = table.take(heads)
    kind = head.column("kind").to_pylist()
    step, carrier, ranks, world, complete, ts, data, label = (
        head.column(c).to_pylist()
        for c in ("step", "carrier", "ranks", "world_size", "complete", "ts", "data", "name")
    )
    names = pc.dictionary_encode(table.column("name")).combine_chunks()
    lookup = [*names.dictionary.to_pylist(), None]
    codes = pc.fill_null(names.indices, len(lookup) - 1).to_numpy()
    name = [lookup[c] for c in codes.tolist()]
    value = table.column("value").to_numpy().tolist()
    ends = [*heads.tolist()[1:], table.num_rows]
    if not len(heads) or heads[0] != 0:
        raise SpoolFormatError(f"{where}: row 0 of the steps table is damaged (values before "
                               "any step)")  # fmt: skip
    _check_rows(head, kinds, codes, len(lookup) - 1, heads, where)
    batch: list[ShippedStep] = []
    h = 0
    try:
        for h, (i, j) in enumerate(zip(heads.tolist(), ends, strict=True)):
            k = kind[h]
            if k == "step":
                metrics = dict(zip(name[i + 1 : j], value[i + 1 : j], strict=True))
                s = ShippedStep(step[h], metrics, ranks[h], world[h], complete[h], ts[h],
                                carrier=carrier[h])  # fmt: skip
                if data[h] is not None:
                    m = _MEDIA.decode(data[h])
                    s.texts, s.histograms, s.images = m.texts, m.histograms, m.images
                    s.gpu, s.tables = m.gpu, m.tables
                batch.append(s)
                continue
            if batch:
                yield ("steps", batch)
                batch = []
            if j != i + 1:
                raise SpoolFormatError(f"{where}: row {i + 1} of the steps table is damaged "
                                       f"(values after a row of kind {k!r})")  # fmt: skip
            if k == "params" and data[h] is not None:
                yield ("params", _PARAMS.decode(data[h]), step[h])
            elif k == "end" and label[h] in ("finished", "failed", "killed"):
                yield ("end", label[h])
            else:  # (version 1 has no other kind: a later one has another version)
                raise SpoolFormatError(f"{where}: row {i} of the steps table is damaged (a row "
                                       f"of kind {k!r})")  # fmt: skip
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        at = int(heads[h]) if len(heads) else 0
        raise SpoolFormatError(f"{where}: row {at} of the steps table is damaged ({exc})") from None
    if batch:
        yield ("steps", batch)


def _check_rows(head: pa.Table, kinds: pa.Array, codes: Any, null: int, heads: Any,
                where: str) -> None:  # fmt: skip
    """Refuse rows that do not hold what their kind needs, all at once (columns, not rows):
    a step without its step, time or completeness, ranks outside 0..world size; a value
    without a name."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ranklog.errors import SpoolFormatError

    is_step = pc.equal(head.column("kind").cast(pa.string()), "step")
    steps = head.filter(is_step)
    bad = pc.or_kleene(
        pc.or_kleene(pc.is_null(steps.column("step")), pc.is_null(steps.column("ts"))),
        pc.or_kleene(pc.is_null(steps.column("complete")),
                     pc.invert(pc.and_kleene(pc.greater_equal(steps.column("ranks"), 0),
                                             pc.less_equal(steps.column("ranks"),
                                                           steps.column("world_size"))))),
    )  # fmt: skip
    bad = pc.fill_null(bad, True)
    if pc.any(bad).as_py():
        at = int(heads[np.flatnonzero(is_step.to_numpy(zero_copy_only=False))[
            pc.index(bad, True).as_py()]])  # fmt: skip
        raise SpoolFormatError(f"{where}: row {at} of the steps table is damaged (a step row "
                               "without its step, time or completeness, or ranks outside 0 "
                               "to its world size)")  # fmt: skip
    metric = pc.equal(kinds, "metric").to_numpy(zero_copy_only=False)
    unnamed = np.flatnonzero(metric & (codes == null))
    if len(unnamed):
        raise SpoolFormatError(f"{where}: row {int(unnamed[0])} of the steps table is damaged "
                               "(a value without a name)")  # fmt: skip
