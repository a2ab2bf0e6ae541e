"""Per-step accumulation across ranks, and turning a complete step into a ShippedStep."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

from ranklog.schemas import DEFAULT_METRIC_REDUCE, Gpu, Histogram, Image, Metrics, Text, Timer
from ranklog.shippers._reduce import Partial, output_names, parse_ops
from ranklog.shippers._target import GpuStat, ImageItem, ShippedStep, TextItem

__all__ = ["STEP_KINDS", "Contribution", "StepAcc", "reduce_step"]

StepEvent = Metrics | Timer | Text | Histogram | Image | Gpu
#: the event kinds that belong to a step
STEP_KINDS: Final = (Metrics, Timer, Text, Histogram, Image)


@dataclass(slots=True)
class Contribution:
    """What one incarnation of one rank logged for a step."""

    incarnation: int
    events: list[StepEvent] = field(default_factory=list)


@dataclass(slots=True)
class StepAcc:
    """Everything logged for one step, per rank."""

    ranks: dict[int, Contribution] = field(default_factory=dict)


_NO_LAST: Final = (-math.inf, -1, math.nan)


def _gpu_stat(host: str, index: int, samples: list[Gpu]) -> GpuStat:
    """One GPU over a step: mean utilisation and power, peak memory and temperature."""

    def mean(xs: list[float | None]) -> float | None:
        real = [x for x in xs if x is not None and x == x]
        return math.fsum(real) / len(real) if real else None

    def peak(xs: list[Any]) -> Any:
        real = [x for x in xs if x is not None]
        return max(real) if real else None

    return GpuStat(
        host=host,
        index=index,
        name=samples[-1].name,
        samples=len(samples),
        util=mean([g.util for g in samples]),
        mem_used=peak([g.mem_used for g in samples]),
        mem_total=peak([g.mem_total for g in samples]),
        temp=peak([g.temp for g in samples]),
        power=mean([g.power for g in samples]),
    )


def _own(events: list[StepEvent]) -> dict[str, float]:
    """One rank's own values for a step (its last value per name)."""
    own: dict[str, float] = {}
    for ev in events:
        if type(ev) is Metrics:
            own.update(ev.values)
        elif type(ev) is Timer:
            own[f"timing/{ev.name}"] = ev.seconds
    return own


def _last(acc: StepAcc, order: list[int], name: str, *, timer: bool) -> tuple[float, int, float]:
    """(ts, rank, value) of the latest value logged under ``name`` (ties: highest rank)."""
    best = _NO_LAST
    for rank in order:
        for ev in acc.ranks[rank].events:
            if timer:
                if type(ev) is Timer and ev.name == name and (ev.ts, rank) >= best[:2]:
                    best = (ev.ts, rank, ev.seconds)
            elif type(ev) is Metrics and name in ev.values and (ev.ts, rank) >= best[:2]:
                best = (ev.ts, rank, ev.values[name])
    return best


def reduce_step(
    step: int,
    acc: StepAcc,
    *,
    closed: int,
    world_size: int,
    per_rank: bool = False,
) -> ShippedStep:
    """Reduce one step across ranks (in rank order, so the result never depends on timing).

    ``closed`` is how many expected ranks closed the step; it is partial when that is
    below ``world_size``, and then ``ranklog/ranks_reporting`` is added.
    """
    values: dict[str, list[float]] = {}
    specs: dict[str, str] = {}
    timers: dict[str, list[float]] = {}
    timer_specs: dict[str, str] = {}
    slowest: dict[str, tuple[float, int]] = {}
    texts: list[TextItem] = []
    histograms: dict[str, list[float]] = {}
    images: list[ImageItem] = []
    gpus: dict[tuple[str, int], list[Gpu]] = {}
    ts = 0.0
    mine: dict[int, dict[str, float]] | None = {} if per_rank else None
    order = sorted(acc.ranks)
    for rank in order:
        for ev in acc.ranks[rank].events:
            if ev.ts > ts:
                ts = ev.ts
            if type(ev) is Metrics:
                reduce = ev.reduce
                for name, v in ev.values.items():
                    lst = values.get(name)
                    if lst is None:
                        values[name] = lst = []
                        specs[name] = (
                            reduce
                            if type(reduce) is str
                            else reduce.get(name, DEFAULT_METRIC_REDUCE)  # type: ignore[union-attr]
                        )
                    lst.append(v)
            elif type(ev) is Timer:
                name = ev.name
                lst = timers.get(name)
                if lst is None:
                    timers[name] = lst = []
                    timer_specs[name] = ev.reduce
                lst.append(ev.seconds)
                best = slowest.get(name)
                if best is None or ev.seconds > best[0]:
                    slowest[name] = (ev.seconds, rank)
            elif type(ev) is Text:
                texts.append(TextItem(rank, ev.name, ev.text))
            elif type(ev) is Histogram:
                histograms.setdefault(ev.name, []).extend(ev.values)
            elif type(ev) is Image:
                images.append(ImageItem(rank, ev.name, ev.data, ev.format))
            elif type(ev) is Gpu:
                gpus.setdefault((ev.host, ev.index), []).append(ev)
        if mine is not None:
            own = _own(acc.ranks[rank].events)
            if own:
                mine[rank] = own
    out: dict[str, float] = {}
    for name, lst in values.items():
        ops = parse_ops(specs[name])
        last = _last(acc, order, name, timer=False) if "last" in ops else _NO_LAST
        part = Partial.of(lst, last=last, ops=ops)
        for out_name, op in zip(output_names(name, ops), ops, strict=True):
            out[out_name] = part.result(op)
    for name, lst in timers.items():
        ops = parse_ops(timer_specs[name])
        last = _last(acc, order, name, timer=True) if "last" in ops else _NO_LAST
        part = Partial.of(lst, last=last, ops=ops)
        for out_name, op in zip(output_names(f"timing/{name}", ops), ops, strict=True):
            out[out_name] = part.result(op)
        out[f"timing/{name}/slowest_rank"] = float(slowest[name][1])
    reporting = len(acc.ranks)
    complete = closed >= world_size
    if not complete:
        out["ranklog/ranks_reporting"] = float(max(reporting, closed))
    return ShippedStep(
        step=step,
        metrics={k: out[k] for k in sorted(out)},
        ranks=max(reporting, closed) if not complete else closed,
        world_size=world_size,
        complete=complete,
        ts=ts if ts > 0 else math.nan,
        texts=texts,
        histograms=histograms,
        images=images,
        gpu=[_gpu_stat(host, index, gpus[(host, index)]) for host, index in sorted(gpus)],
        per_rank=mine,
    )
