"""Per-step accumulation across ranks, and turning a complete step into a ShippedStep.

A step goes through two stages, so that one shipper and a fan-in of several
readers compute the very same thing::

    StepAcc (a reader's ranks) -build-> StepPartial -merge-> StepPartial -finish-> ShippedStep

:class:`StepPartial` is mergeable: merging the partials of disjoint rank sets
gives the partial of their union, and ``finish`` puts everything in rank order,
so the result never depends on which reader held which rank, nor on timing. ``finish``
(and the late values a step carries) is :mod:`ranklog.shippers._finish`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Final, cast

from ranklog.schemas import (
    Gpu,
    Histogram,
    Image,
    Metrics,
    MetricsPacked,
    StepEvent,
    Table,
    Text,
    Timer,
)
from ranklog.shippers._finish import Finishing
from ranklog.shippers._gather import (
    SUMMED_SPECS,
    Named,
    Summed,
    by_columns,
    by_rows,
    le_floats,
    merge_named,
    shared_values,
    summable,
    summed_columns,
    summed_of,
)
from ranklog.shippers._reduce import Partial, parse_ops, zero_sign
from ranklog.shippers._target import ImageItem, TableItem, TextItem

__all__ = ["Contributed", "Contribution", "StepAcc", "StepPartial"]

#: what a rank contributes to a step: its step events, and GPU samples taken during it
Contributed = StepEvent | Gpu


@dataclass(slots=True)
class Contribution:
    """What one incarnation of one rank logged for a step."""

    incarnation: int
    events: list[Contributed] = field(default_factory=list)
    #: step events among them (what the rank's step_end counts)
    count: int = 0
    #: values for steps the rank had closed, logged while it was in this one (each keeps
    #: its own step): shipped with this step when late values are shipped (``late="ship"``)
    late: list[StepEvent] = field(default_factory=list)


@dataclass(slots=True)
class StepAcc:
    """Everything logged for one step, per rank."""

    ranks: dict[int, Contribution] = field(default_factory=dict)
    #: ranks whose contribution lost frames to damage: left out, the step partial
    damaged: set[int] = field(default_factory=set)


_NO_LAST: Final = (-math.inf, -1, math.nan)
_TS: Final = attrgetter("ts")
_VALUES: Final = attrgetter("values")
_EVENTS: Final = attrgetter("events")
_LATE: Final = attrgetter("late")
#: the two forms of a Metrics event a shipper reads
_METRICS: Final = frozenset({Metrics, MetricsPacked})


def _own(events: list[Contributed]) -> dict[str, float]:
    """One rank's own values for a step (its last value per name)."""
    own: dict[str, float] = {}
    for ev in events:
        if isinstance(ev, (Metrics, MetricsPacked)):
            own.update(ev.values)
        elif type(ev) is Timer:
            own[f"timing/{ev.name}"] = ev.seconds
    return own


def _latest(acc: StepAcc, order: list[int], *, timer: bool) -> dict[str, tuple[float, int, float]]:
    """Per name, (ts, rank, value) of the latest value logged under it (ties: the highest
    rank, then the later event): every name at once, each event's values read once."""
    best: dict[str, tuple[float, int, float]] = {}
    for rank in order:
        for ev in acc.ranks[rank].events:
            if timer:
                if type(ev) is Timer and (ev.ts, rank) >= best.get(ev.name, _NO_LAST)[:2]:
                    best[ev.name] = (ev.ts, rank, ev.seconds)
            elif isinstance(ev, (Metrics, MetricsPacked)):
                at = (ev.ts, rank)
                for name, value in ev.values.items():
                    if at >= best.get(name, _NO_LAST)[:2]:
                        best[name] = (ev.ts, rank, value)
    return best


@dataclass(slots=True)
class StepPartial(Finishing):
    """What a set of ranks logged for one step, summarised and mergeable."""

    step: int
    #: ranks that logged anything for the step
    ranks: int = 0
    ts: float = 0.0
    metrics: dict[str, Named] = field(default_factory=dict)
    timers: dict[str, Named] = field(default_factory=dict)
    #: timer name -> (longest seconds, lowest rank that took that long)
    slowest: dict[str, tuple[float, int]] = field(default_factory=dict)
    texts: list[TextItem] = field(default_factory=list)
    #: name -> (rank, values) in rank order
    histograms: dict[str, list[tuple[int, list[float]]]] = field(default_factory=dict)
    images: list[ImageItem] = field(default_factory=list)
    tables: list[TableItem] = field(default_factory=list)
    #: (rank, sample) in rank order
    gpus: list[tuple[int, Gpu]] = field(default_factory=list)
    per_rank: dict[int, dict[str, float]] | None = None
    #: ranks left out because frames of theirs for the step were lost (sorted)
    damaged: list[int] = field(default_factory=list)
    #: late values that travel with this step, by the earlier step they were logged for
    late: dict[int, StepPartial] = field(default_factory=dict)
    #: (name, the name it shipped under) of derived names that met another (finish())
    renamed: list[tuple[str, str]] = field(default_factory=list)
    #: the usual step's metrics as columns, in place of ``metrics`` (:class:`Summed`)
    summed: Summed | None = None

    def named(self) -> dict[str, Named]:
        """``metrics``, with the usual step's columns (:attr:`summed`) as Named too."""
        if self.summed is not None:
            self.metrics = {**self.summed.named(), **self.metrics}
            self.summed = None
        return self.metrics

    @classmethod
    def build(
        cls,
        step: int,
        acc: StepAcc,
        *,
        per_rank: bool = False,
        exact: bool = False,
        specs: dict[str, str] | None = None,
    ) -> StepPartial:
        """Summarise ``acc`` (in rank order); ``exact`` makes it mergeable without rounding.

        ``specs`` (``m:<metric>``/``t:<timer>`` -> spec) replaces the spec of the lowest
        rank here, for names whose job-wide lowest rank is elsewhere (a fan-in).
        """
        if not (per_rank or exact) and specs is None and len(acc.ranks) == 1 and not acc.damaged:
            one = cls._one_packed(step, acc)
            if one is not None:
                return one
        values: dict[str, Sequence[float]] = {}
        named_specs: dict[str, tuple[int, str]] = {}
        timers: dict[str, Sequence[float]] = {}
        timer_specs: dict[str, tuple[int, str]] = {}
        out = cls(step, per_rank={} if per_rank else None)
        single = _one_each(acc)
        if single is not None:  # the usual step: one Metrics event per rank, nothing else
            order, logged = single
            out.ranks = len(order)
            out.ts = max(0.0, *map(_TS, logged))  # as the loop below: NaN never wins
            flat = shared_values(logged)
            if flat is not None:  # packed values of one layout: columns with no dict
                packed = cast(list[MetricsPacked], logged)  # (checked by shared_values)
                out._columns(order, packed, flat, values, named_specs, exact, specs)
            else:
                out._dicts(order, logged, values, named_specs, exact, specs)
            if out.summed is not None:
                return out  # the usual step: columns, no object per name
        else:
            order = out._gather(acc, timers, timer_specs, values, named_specs)
            if any(c.late for c in acc.ranks.values()):
                out.late = _late_partials(acc, per_rank=per_rank, exact=exact, specs=specs)
        out._reduce_rest(acc, order, values, named_specs, timers, timer_specs, exact, specs)
        return out

    @classmethod
    def _one_packed(cls, step: int, acc: StepAcc) -> StepPartial | None:
        """The usual step of one rank, at once: what :meth:`build` makes of one event of
        packed values (:meth:`_one_rank`'s Summed, with no columns gathered first); None
        for any other (the general path takes it)."""
        ((rank, contrib),) = acc.ranks.items()
        events = contrib.events
        if len(events) != 1 or contrib.late or type(events[0]) is not MetricsPacked:
            return None
        ev = events[0]
        row = ev.row or le_floats(ev.packed)
        if len(row) != len(ev.names):
            return None
        out = cls(step, ranks=1, ts=max(0.0, ev.ts))
        return out if out._one_rank(rank, ev.reduce, ev.names, row, False, None) else None

    def _columns(
        self,
        order: list[int],
        logged: list[MetricsPacked],
        flat: list[float],
        values: dict[str, Sequence[float]],
        named_specs: dict[str, tuple[int, str]],
        exact: bool,
        specs: dict[str, str] | None,
    ) -> None:
        """The usual step of packed values of one layout (``flat``: each rank's values in
        the layout's order, rank after rank): as :meth:`_dicts` does with dicts, with
        columns sliced out of ``flat`` (no dict, no tuple per rank)."""
        names, reduce = logged[0].names, logged[0].reduce
        n = len(names)
        if self.per_rank is not None:
            starts = range(0, len(flat), n)
            self.per_rank = {r: dict(zip(names, flat[i : i + n], strict=True))
                             for i, r in zip(starts, order, strict=True)}  # fmt: skip
        k = len(order)
        if k == 1 and self._one_rank(order[0], reduce, names, flat, exact, specs):
            return
        columns = [flat[i::n] for i in range(n)]
        if summable(reduce, exact, specs) and k > 1:
            self.summed = summed_of(order[0], reduce, names, columns, k)
            if self.summed is not None:
                return
        same = (order[0], reduce)  # the general path
        for name, column in zip(names, columns, strict=True):
            values[name] = column
            named_specs[name] = same

    def _dicts(
        self,
        order: list[int],
        logged: list[Metrics | MetricsPacked],
        values: dict[str, Sequence[float]],
        named_specs: dict[str, tuple[int, str]],
        exact: bool,
        specs: dict[str, str] | None,
    ) -> None:
        """The usual step of Metrics events: its :class:`Summed` when it can be; else
        ``values`` filled by columns when the ranks logged the same names, by rows if not."""
        dicts = list(map(_VALUES, logged))
        if self.per_rank is not None:
            self.per_rank = {r: dict(d) for r, d in zip(order, dicts, strict=True) if d}
        reduce = logged[0].reduce
        if len(dicts) == 1 and self._one_rank(
            order[0], reduce, tuple(dicts[0]), tuple(dicts[0].values()), exact, specs
        ):
            return
        if not by_columns(order[0], reduce, dicts, values, named_specs):
            by_rows(zip(order, logged, strict=True), values, named_specs)
        elif summable(reduce, exact, specs):
            self.summed = summed_columns(order[0], reduce, values)  # None: the general path

    def _one_rank(
        self,
        rank: int,
        reduce: str | dict[str, str],
        names: tuple[str, ...],
        row: Sequence[float],
        exact: bool,
        specs: dict[str, str] | None,
    ) -> bool:
        """One rank's usual step as :class:`Summed`: each total is its value (the sign of a
        zero kept, as zero_sign), when its values are finite; False otherwise."""
        if not row or not summable(reduce, exact, specs) or not all(map(math.isfinite, row)):
            return False
        self.summed = Summed(rank, reduce, names, [1] * len(names), list(map(float, row)), 1)
        return True

    def _reduce_rest(
        self,
        acc: StepAcc,
        order: list[int],
        values: dict[str, Sequence[float]],
        named_specs: dict[str, tuple[int, str]],
        timers: dict[str, Sequence[float]],
        timer_specs: dict[str, tuple[int, str]],
        exact: bool,
        specs: dict[str, str] | None,
    ) -> None:
        """Each name's partial, from the values gathered (the general path)."""
        latest: dict[bool, dict[str, tuple[float, int, float]]] = {}
        for timer, found, found_specs, into in (
            (False, values, named_specs, self.metrics),
            (True, timers, timer_specs, self.timers),
        ):
            for name, lst in found.items():
                first, spec = found_specs[name]
                if specs is not None:
                    spec = specs.get(f"{'t' if timer else 'm'}:{name}", spec)
                if spec in SUMMED_SPECS and not exact:  # mean, sum or count: the usual spec
                    try:
                        total = math.fsum(lst)
                        if total == 0.0:
                            total = zero_sign(total, lst)
                    except (ValueError, OverflowError):
                        total = math.nan
                    if total - total == 0.0:  # finite: the count and the sum are the partial
                        into[name] = Named(first, spec, Partial(len(lst), total))
                        continue
                ops = parse_ops(spec)
                last = _NO_LAST
                if "last" in ops:
                    if timer not in latest:
                        latest[timer] = _latest(acc, order, timer=timer)
                    last = latest[timer].get(name, _NO_LAST)
                into[name] = Named(first, spec, Partial.of(lst, last=last, ops=ops, exact=exact))

    def _gather(
        self,
        acc: StepAcc,
        timers: dict[str, Sequence[float]],
        timer_specs: dict[str, tuple[int, str]],
        values: dict[str, Sequence[float]],
        named_specs: dict[str, tuple[int, str]],
    ) -> list[int]:
        """Take in every event of ``acc``'s ranks, in rank order: the ranks taken."""
        damaged = acc.damaged
        order = sorted([r for r, c in acc.ranks.items() if c.events and r not in damaged])
        self.ranks = len(order)
        self.damaged = sorted(damaged)
        slowest = self.slowest
        ts = 0.0
        #: (rank, event) of each Metrics event, in rank order: reduced after the loop
        logged: list[tuple[int, Metrics]] = []
        for rank in order:
            events = acc.ranks[rank].events
            for ev in events:
                if ev.ts > ts:
                    ts = ev.ts
                if type(ev) in _METRICS:
                    logged.append((rank, ev))  # type: ignore[arg-type]  # of the two
                elif type(ev) is Timer:
                    name = ev.name
                    lst = timers.get(name)
                    if lst is None:
                        timers[name] = lst = []
                        timer_specs[name] = (rank, ev.reduce)
                    lst.append(ev.seconds)  # type: ignore[attr-defined]  # a list, made here
                    best = slowest.get(name)
                    if best is None or _slower(ev.seconds, best[0]):
                        slowest[name] = (ev.seconds, rank)
                else:
                    self.add(rank, ev)
            if self.per_rank is not None:
                own = _own(events)
                if own:
                    self.per_rank[rank] = own
        self.ts = ts
        if len(logged) < 2 or len({rank for rank, _ in logged}) < len(logged):
            by_rows(logged, values, named_specs)
            return order
        ranks, evs = zip(*logged, strict=True)
        if not by_columns(ranks[0], evs[0].reduce, list(map(_VALUES, evs)), values, named_specs):
            by_rows(logged, values, named_specs)
        return order

    def add(self, rank: int, ev: Contributed) -> None:
        """Take in one text, distribution, image, table or GPU sample of ``rank``'s (ranks
        in order, each rank's in the order it logged them)."""
        if type(ev) is Text:
            self.texts.append(TextItem(rank, ev.name, ev.text))
        elif type(ev) is Histogram:
            self.histograms.setdefault(ev.name, []).append((rank, list(ev.values)))
        elif type(ev) is Image:
            self.images.append(ImageItem(rank, ev.name, ev.data, ev.format, ev.plotly))
        elif type(ev) is Table:
            self.tables.append(TableItem(rank, ev.name, ev.columns, ev.rows))
        elif type(ev) is Gpu:
            self.gpus.append((rank, ev))

    def only_gpu(self) -> bool:
        """Whether GPU samples are all the step holds (no rank logged anything for it).

        A step some rank lost frames of is never "only GPU": the loss must show.
        """
        return not (
            self.metrics or self.summed or self.timers or self.texts or self.histograms
            or self.images or self.tables or self.damaged
        )  # fmt: skip

    def merge(self, other: StepPartial) -> StepPartial:
        """The partial of both rank sets together (they must be disjoint)."""
        out = StepPartial(
            self.step,
            ranks=self.ranks + other.ranks,
            ts=max(self.ts, other.ts),
            metrics=merge_named(self.named(), other.named()),
            timers=merge_named(self.timers, other.timers),
            slowest=dict(self.slowest),
            texts=sorted(self.texts + other.texts, key=lambda t: t.rank),
            images=sorted(self.images + other.images, key=lambda t: t.rank),
            tables=sorted(self.tables + other.tables, key=lambda t: t.rank),
            damaged=sorted({*self.damaged, *other.damaged}),
        )
        for name, best in other.slowest.items():
            mine = out.slowest.get(name)
            if (
                mine is None
                or _slower(best[0], mine[0])
                or (_same(best[0], mine[0]) and best[1] < mine[1])
            ):
                out.slowest[name] = best
        for name in self.histograms.keys() | other.histograms.keys():
            both = self.histograms.get(name, []) + other.histograms.get(name, [])
            out.histograms[name] = sorted(both, key=lambda h: h[0])
        out.gpus = sorted(self.gpus + other.gpus, key=lambda g: g[0])
        if self.per_rank is not None or other.per_rank is not None:
            out.per_rank = {**(self.per_rank or {}), **(other.per_rank or {})}
        out.late = dict(self.late)
        for step, part in other.late.items():
            held = out.late.get(step)
            out.late[step] = part if held is None else held.merge(part)
        return out


def _late_partials(
    acc: StepAcc, *, per_rank: bool, exact: bool, specs: dict[str, str] | None = None
) -> dict[int, StepPartial]:
    """The late values of ``acc``'s ranks, summarised per step they were logged for.

    ``specs``: as :meth:`StepPartial.build` takes them, late names keyed
    ``late:<step>:m:<name>`` (or ``t:``).
    """
    by_step: dict[int, StepAcc] = {}
    for rank in sorted(acc.ranks):
        contrib = acc.ranks[rank]
        if not contrib.late or rank in acc.damaged:
            continue
        for ev in contrib.late:
            sub = by_step.get(ev.step)
            if sub is None:
                by_step[ev.step] = sub = StepAcc()
            own = sub.ranks.get(rank)
            if own is None:
                sub.ranks[rank] = own = Contribution(contrib.incarnation)
            own.events.append(ev)

    def specs_of(step: int) -> dict[str, str] | None:
        prefix = f"late:{step}:"
        own = {k[len(prefix) :]: v for k, v in (specs or {}).items() if k.startswith(prefix)}
        return own or None

    return {
        step: StepPartial.build(step, sub, per_rank=per_rank, exact=exact, specs=specs_of(step))
        for step, sub in sorted(by_step.items())
    }


def _one_each(acc: StepAcc) -> tuple[list[int], list[Metrics | MetricsPacked]] | None:
    """(ranks in order, their events) when every rank logged one Metrics event and nothing
    else, none damaged, no late value (the usual step); None otherwise. C loops only."""
    conts = acc.ranks
    if not conts or acc.damaged:
        return None
    order = sorted(conts)
    contribs = list(map(conts.__getitem__, order))
    try:
        logged = [ev for (ev,) in map(_EVENTS, contribs)]
    except ValueError:  # a rank with no event, or several
        return None
    if not _METRICS.issuperset(map(type, logged)) or any(map(_LATE, contribs)):
        return None
    return order, logged  # Metrics only, checked above


def _slower(a: float, b: float) -> bool:
    """Whether time ``a`` beats ``b`` for the slowest rank: larger, and any number beats NaN."""
    return a > b or (b != b and a == a)


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)
