"""How a step's values are gathered across ranks: per name, by rows or by columns.

:class:`Named` is one name's partial aggregate; :class:`Summed` holds the usual step's
names as columns instead (one Named per name costs more than the step's reduction).
:func:`by_columns` transposes ranks' value dicts in C when they hold the same names;
:func:`by_rows` takes them event by event otherwise; packed values of one layout
(segment format 2) are columns at once (:func:`shared_values`). Used by
:class:`~ranklog.shippers._steps.StepPartial` and the columnar replay.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter, truediv
from typing import Final, TypeAlias, TypeGuard

from ranklog._kept import Kept
from ranklog.errors import ConfigError
from ranklog.schemas import DEFAULT_METRIC_REDUCE, Metrics, MetricsPacked
from ranklog.shippers._reduce import SUMMED_OPS, Partial, zero_sign

__all__ = [
    "SUMMED_SPECS", "Named", "Summed", "by_columns", "by_rows", "le_floats", "merge_named",
    "shared_values", "spec_of", "summable", "summed_columns", "summed_of",
]  # fmt: skip

#: specs whose partial is the count and the sum of the values alone, when they are finite
SUMMED_SPECS: Final = frozenset(op for (op,) in SUMMED_OPS)


@dataclass(slots=True)
class Named:
    """One name's values in a step: its partial, and the reduce spec of its lowest rank."""

    rank: int
    spec: str
    part: Partial

    def merge(self, other: Named) -> Named:
        """Both together; the lower rank's spec wins (as in one reader, going in rank order)."""
        first = self if self.rank <= other.rank else other
        return Named(first.rank, first.spec, self.part.merge(other.part))


@dataclass(slots=True)
class Summed:
    """The metrics of the usual step, kept as columns: every name asked for one spec of
    ``mean``, ``sum`` or ``count``, each total finite (what ``Named(first, spec,
    Partial(count, total))`` per name would hold, without an object per name)."""

    first: int
    spec: str
    names: Sequence[str]
    counts: list[int]
    totals: list[float]
    #: the count every name has, when they share one (each rank logged every name); 0: not
    #: said
    each: int = 0

    def named(self) -> dict[str, Named]:
        """The same, one :class:`Named` per name."""
        first, spec = self.first, self.spec
        return {
            name: Named(first, spec, Partial(count, total))
            for name, count, total in zip(self.names, self.counts, self.totals, strict=True)
        }

    def sorted_results(self) -> dict[str, float]:
        """Each name's reduced value, by name (what ``dict(sorted(zip(names, results())))``
        gives, with the order of a list of names found once, not per step)."""
        names = self.names
        last = _LAST_ORDER[0]  # (read once: a pair, replaced whole)
        if last is not None and last[0] is names:  # the step before's names, as a rule
            known = last[1]
        else:
            known = _order_of(names if type(names) is tuple else tuple(names))
            if type(names) is tuple:
                _LAST_ORDER[0] = (names, known)
        in_order, perm = known
        if perm is None:
            return dict(zip(in_order, self.results(), strict=True))
        results = list(self.results())
        return dict(zip(in_order, map(results.__getitem__, perm), strict=True))

    def results(self) -> Iterable[float]:
        """Each name's reduced value, as ``Partial.result(spec)`` gives it."""
        if self.spec == "mean":
            each = self.each
            if each == 1:
                return self.totals  # (x / 1 is x, bit for bit)
            if each:
                return [total / each for total in self.totals]
            return map(truediv, self.totals, self.counts)
        if self.spec == "sum":
            return self.totals
        if self.spec == "count":
            return map(float, self.counts)
        raise ConfigError(f"columns of a step with spec {self.spec!r}: not mean, sum or count")


#: a list of names sorted, and where each comes from in it (None: sorted already)
_Order: TypeAlias = tuple[tuple[str, ...], list[int] | None]

#: names of a Summed -> their :data:`_Order`, for lists of 100,000 names in all (~100
#: bytes each: names that change every step would otherwise keep an order per step)
_ORDERS: Final[Kept[tuple[str, ...], _Order]] = Kept(100_000)

#: the tuple of names sorted last, and its order (a step's tuple is shared by the steps of
#: its layout: found by identity, no hash of its names)
_LAST_ORDER: Final[list[tuple[tuple[str, ...], _Order] | None]] = [None]


def _order_of(key: tuple[str, ...]) -> _Order:
    """The :data:`_Order` of ``key``, found once."""
    known = _ORDERS.get(key)
    if known is None:
        order = sorted(range(len(key)), key=key.__getitem__)
        same = order == list(range(len(key)))
        known = _ORDERS.keep(key, (tuple(key[i] for i in order), None if same else order))
    return known


def summed_columns(first: int, spec: str, values: dict[str, Sequence[float]]) -> Summed | None:
    """The columns of a step whose names all share ``spec`` (mean, sum or count) and
    whose totals are finite; None when any is not (the general path then takes it)."""
    return summed_of(first, spec, list(values), list(values.values()))


def summed_of(
    first: int, spec: str, names: Sequence[str], cols: Sequence[Sequence[float]], each: int = 0
) -> Summed | None:
    """:func:`summed_columns` of ``names`` and their columns (``each``: the length every
    column has, when known)."""
    try:
        totals = list(map(math.fsum, cols))
    except (ValueError, OverflowError):
        return None
    if not all(map(math.isfinite, totals)):  # inf or nan among them
        return None
    if 0.0 in totals:  # IEEE's sign of a zero sum (math.fsum gives +0.0)
        totals = [zero_sign(t, c) if t == 0.0 else t for t, c in zip(totals, cols, strict=True)]
    counts = [each] * len(cols) if each else list(map(len, cols))
    return Summed(first, spec, names, counts, totals, each)


def spec_of(reduce: str | dict[str, str], name: str) -> str:
    """The reduce spec a Metrics event asks for ``name``."""
    return reduce if type(reduce) is str else reduce.get(name, DEFAULT_METRIC_REDUCE)  # type: ignore[union-attr]


def by_rows(
    logged: Iterable[tuple[int, Metrics | MetricsPacked]],
    values: dict[str, Sequence[float]],
    specs: dict[str, tuple[int, str]],
) -> None:
    """Fill ``values`` event by event, in rank order (the spec: of the lowest rank)."""
    for rank, ev in logged:
        reduce = ev.reduce
        for name, v in ev.values.items():
            lst = values.get(name)
            if lst is None:
                values[name] = lst = []
                specs[name] = (rank, spec_of(reduce, name))
            lst.append(v)  # type: ignore[attr-defined]  # a list, made here


def by_columns(
    first_rank: int,
    reduce: str | dict[str, str],
    dicts: list[dict[str, float]],
    values: dict[str, Sequence[float]],
    specs: dict[str, tuple[int, str]],
) -> bool:
    """Fill ``values`` column-wise when every rank logged the same names once (the usual step).

    ``dicts`` are the values of one Metrics event per rank, in rank order, the first one
    of ``first_rank`` logged with ``reduce``: when all hold the first one's names, each
    name's values come out in rank order, as :func:`_rows` would give them, but
    transposed in C. False (nothing filled) otherwise.
    """
    names = list(dicts[0])
    n = len(names)
    if n == 0 or list(map(len, dicts)).count(n) != len(dicts):
        return False
    try:
        if n == 1:
            (name,) = names
            values[name] = list(map(itemgetter(name), dicts))
            specs[name] = (first_rank, spec_of(reduce, name))
            return True
        rows = list(map(itemgetter(*names), dicts))
    except KeyError:
        return False
    same = (first_rank, reduce) if type(reduce) is str else None  # one spec for every name
    for name, column in zip(names, zip(*rows, strict=True), strict=True):
        values[name] = column
        specs[name] = same or (first_rank, spec_of(reduce, name))
    return True


def merge_named(a: dict[str, Named], b: dict[str, Named]) -> dict[str, Named]:
    out = dict(a)
    for name, named in b.items():
        mine = out.get(name)
        out[name] = named if mine is None else mine.merge(named)
    return out


_ROW: Final = attrgetter("row")
_PACKED: Final = attrgetter("packed")
_LITTLE: Final = sys.byteorder == "little"


def le_floats(data: bytes) -> list[float]:
    """``data``, little-endian float64s, as floats (one C call, whatever their number)."""
    if _LITTLE:
        return memoryview(data).cast("d").tolist()  # type: ignore[return-value]  # floats
    floats = array("d", data)
    floats.byteswap()
    return floats.tolist()


def summable(
    reduce: str | dict[str, str], exact: bool, specs: dict[str, str] | None
) -> TypeGuard[str]:
    """Whether a step of one spec ``reduce`` may be kept as :class:`Summed` (mean, sum or
    count, not for an exact merge, nor with specs given from elsewhere)."""
    return not exact and specs is None and type(reduce) is str and reduce in SUMMED_SPECS


def shared_values(logged: list[Metrics | MetricsPacked]) -> list[float] | None:
    """The values of every event, rank after rank (``len(names)`` each), when all are
    packed values of one list of names (one tuple, shared); None otherwise. Bytes kept
    packed (the shipper's reader) are unpacked here, all at once."""
    first = logged[0]
    if type(first) is not MetricsPacked or not first.names:
        return None
    names = first.names
    for ev in logged:
        if type(ev) is not MetricsPacked or ev.names is not names:
            return None
    if first.row:
        flat = list(chain.from_iterable(map(_ROW, logged)))
    else:
        flat = le_floats(b"".join(map(_PACKED, logged)))
    # (events of both forms, rows and bytes, would not add up: the general path takes them)
    return flat if len(flat) == len(names) * len(logged) else None
