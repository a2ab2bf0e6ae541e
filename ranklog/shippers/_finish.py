"""Finishing a step: its partial reduced into the :class:`ShippedStep` a target receives.

:class:`Finishing` is the second half of :class:`~ranklog.shippers._steps.StepPartial`:
each name's reduced value (the ops it asked for, the derived names of several ops and
of timers, in name order), the step's completeness, GPU statistics, and the late values
it carries as steps of their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ranklog.schemas import REDUCE_OPS, Gpu
from ranklog.shippers._gather import Named, Summed
from ranklog.shippers._reduce import output_names, parse_ops
from ranklog.shippers._target import GpuStat, ImageItem, ShippedStep, TableItem, TextItem

__all__ = ["DERIVED", "Finishing"]

#: appended to a derived name (``m/max`` of ``m`` logged with mean and max, ``timing/t`` of
#: a timer) that meets a name as logged, or an earlier derived one, in the same step
DERIVED = ".derived"


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


class Finishing:
    """How a :class:`~ranklog.shippers._steps.StepPartial` is finished (see the module);
    the partial holds the state."""

    __slots__ = ()
    step: int
    ranks: int
    ts: float
    metrics: dict[str, Named]
    timers: dict[str, Named]
    slowest: dict[str, tuple[float, int]]
    texts: list[TextItem]
    histograms: dict[str, list[tuple[int, list[float]]]]
    images: list[ImageItem]
    tables: list[TableItem]
    gpus: list[tuple[int, Gpu]]
    per_rank: dict[int, dict[str, float]] | None
    #: (a StepPartial's: late values by the step they were logged for)
    late: Mapping[int, Finishing]
    renamed: list[tuple[str, str]]
    summed: Summed | None

    def shipped_late(self, world_size: int) -> list[ShippedStep]:
        """The late values this step carries, one step each, in step order."""
        out = []
        for step in sorted(self.late):
            part = self.late[step]
            shipped = part.finish(closed=world_size, world_size=world_size)
            shipped.ranks = part.ranks
            shipped.carrier = self.step
            self.renamed += part.renamed
            out.append(shipped)
        return out

    def _derive(self, out: dict[str, float], several: list[tuple[str, Named]]) -> None:
        """Add the derived names: ``name/op`` of several ops, then ``timing/<timer>`` and
        ``timing/<timer>/slowest_rank``, each in name order.

        A derived name already taken (by a name as logged, or an earlier derived one) is
        shipped with ``.derived`` appended, once more for each further clash: both values
        are kept, whatever order ranks and calls came in (:attr:`renamed` lists them).
        """
        derived: list[tuple[str, float]] = []
        for name, named in sorted(several, key=lambda item: item[0]):
            ops = parse_ops(named.spec)
            for out_name, op in zip(output_names(name, ops), ops, strict=True):
                derived.append((out_name, named.part.result(op)))
        for name in sorted(self.timers):
            named = self.timers[name]
            ops = parse_ops(named.spec)
            for out_name, op in zip(output_names(f"timing/{name}", ops), ops, strict=True):
                derived.append((out_name, named.part.result(op)))
            derived.append((f"timing/{name}/slowest_rank", float(self.slowest[name][1])))
        for name, value in derived:
            shipped = name
            while shipped in out:
                shipped += DERIVED
            if shipped != name:
                self.renamed.append((name, shipped))
            out[shipped] = value

    def finish(self, *, closed: int, world_size: int) -> ShippedStep:
        """Reduce: the values each name asked for, in rank order wherever order shows.

        ``closed`` is how many expected ranks closed the step; it is partial when that is
        below ``world_size``, and then ``ranklog/ranks_reporting`` is added.
        """
        out: dict[str, float] = {}
        summed = self.summed
        if summed is not None:
            if not (self.metrics or self.timers) and closed >= world_size and not self.gpus:
                return self._shipped(  # the usual step: its names sorted once, with values
                    summed.sorted_results(),
                    closed, world_size, closed >= world_size,
                )  # fmt: skip
            out.update(zip(summed.names, summed.results(), strict=True))
        several: list[tuple[str, Named]] = []
        for name, named in self.metrics.items():
            spec = named.spec
            if spec in REDUCE_OPS:  # the common case: one op, shipped under its own name
                out[name] = named.part.result(spec)
            else:
                several.append((name, named))
        if several or self.timers:
            self._derive(out, several)
        reporting = self.ranks
        complete = closed >= world_size
        if not complete:
            out["ranklog/ranks_reporting"] = float(max(reporting, closed))
        gpus: dict[tuple[str, int], list[Gpu]] = {}
        for _, g in self.gpus:
            gpus.setdefault((g.host, g.index), []).append(g)
        shipped = self._shipped({k: out[k] for k in sorted(out)}, closed, world_size, complete)
        shipped.gpu = [
            _gpu_stat(host, index, samples) for (host, index), samples in sorted(gpus.items())
        ]
        return shipped

    def _shipped(
        self, metrics: dict[str, float], closed: int, world_size: int, complete: bool
    ) -> ShippedStep:
        """The ShippedStep of this partial with ``metrics`` (sorted) and no GPU statistics."""
        per_rank = None
        if self.per_rank is not None:
            per_rank = {r: self.per_rank[r] for r in sorted(self.per_rank)}
        pooled = self.histograms
        return ShippedStep(
            step=self.step,
            metrics=metrics,
            ranks=closed if complete else max(self.ranks, closed),
            world_size=world_size,
            complete=complete,
            ts=self.ts if self.ts > 0 else math.nan,
            texts=self.texts,
            histograms={k: [v for _, vs in pooled[k] for v in vs] for k in sorted(pooled)}
            if pooled
            else {},
            images=self.images,
            per_rank=per_rank,
            tables=self.tables,
        )
