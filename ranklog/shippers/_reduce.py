"""Reduction across ranks: mergeable partial aggregates and the ops computed from them.

A :class:`Partial` summarises the values one reader saw for one (step, name):
count, sum, sum of squares, min, max, NaN count, the last value with its
timestamp and rank, and the values themselves when a ``median`` (or an exact
``std``) is asked for. Partials from several readers :meth:`merge` into the
partial of their union, so the same code serves one shipper and a fan-in.
A partial made to be merged (``exact=True``) also keeps its sum exactly, as a
few floats (:func:`exact_parts`): merged, they give the same correctly rounded
sum as ``math.fsum`` over all the values at once, so a fan-in's result is bit
for bit the single shipper's.

Results follow numpy's conventions: any NaN makes ``mean``, ``sum``, ``min``,
``max``, ``median`` and ``std`` NaN; ``std`` is the population standard
deviation (``ddof=0``); ``count`` counts every value, NaN included; ``last``
is the value with the latest timestamp (ties: the highest rank). Sums use
``math.fsum``, so a result does not depend on the order values arrived in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from ranklog.errors import ConfigError
from ranklog.schemas import REDUCE_OPS

__all__ = [
    "SUMMED_OPS",
    "Partial",
    "exact_parts",
    "fsums",
    "output_names",
    "parse_ops",
    "zero_sign",
]

_NEEDS_VALUES: Final = frozenset({"median", "std"})
#: ops whose partial is the count and the sum alone (when every value is finite)
SUMMED_OPS: Final = frozenset({("mean",), ("sum",), ("count",)})
_op_cache: dict[str, tuple[str, ...]] = {}


def parse_ops(spec: str) -> tuple[str, ...]:
    """The ops of an op spec (``"mean,max"``); unknown ops are dropped, ``mean`` if none remain."""
    ops = _op_cache.get(spec)
    if ops is None:
        ops = tuple(o for o in dict.fromkeys(spec.split(",")) if o in REDUCE_OPS) or ("mean",)
        if len(_op_cache) < 4096:
            _op_cache[spec] = ops
    return ops


def output_names(name: str, ops: tuple[str, ...]) -> list[str]:
    """Names a reduced value is shipped under: ``name`` for one op, ``name/op`` for several."""
    return [name] if len(ops) == 1 else [f"{name}/{op}" for op in ops]


@dataclass(slots=True)
class Partial:
    """Mergeable summary of values for one (step, name)."""

    count: int = 0
    total: float = 0.0
    sumsq: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nans: int = 0
    nonfinite: int = 0
    last_ts: float = -math.inf
    last_rank: int = -1
    last: float = math.nan
    values: list[float] | None = field(default=None)
    #: the exact sum as non-overlapping floats (finite values only), kept to be merged
    parts: list[float] | None = field(default=None)

    @classmethod
    def of(
        cls,
        values: Sequence[float],
        *,
        last: tuple[float, int, float],
        ops: tuple[str, ...],
        exact: bool = False,
    ) -> Partial:
        """Summarise ``values`` for ``ops``; ``last`` is (ts, rank, value) of the latest one.

        ``exact`` keeps the sum mergeable without a rounding step (see the module).
        """
        try:
            total = math.fsum(values)
            finite = math.isfinite(total)
            if total == 0.0:
                total = zero_sign(total, values)
        except (ValueError, OverflowError):  # inf + -inf, or an intermediate overflow
            finite = False
        if finite and not exact:
            summed = cls.summed(len(values), total, ops)
            if summed is not None:
                return summed
        keep = needs_values(ops)
        if finite:  # the common case: no NaN, no inf
            return cls(
                count=len(values),
                total=total,
                sumsq=math.fsum(v * v for v in values) if "std" in ops else 0.0,
                # only the ops asked for: partials merged are built for the same ops
                lo=_least(values) if "min" in ops else math.inf,
                hi=_most(values) if "max" in ops else -math.inf,
                last_ts=last[0],
                last_rank=last[1],
                last=last[2],
                values=list(values) if keep else None,
                parts=exact_parts(values) if exact else None,
            )
        real = [v for v in values if v == v]
        fin = [v for v in real if math.isfinite(v)]
        try:
            total = math.fsum(real)
        except ValueError:
            total = math.nan
        except OverflowError:
            total = sum(real)
        return cls(
            count=len(values),
            total=total if len(real) == len(values) else math.nan,
            sumsq=math.fsum(v * v for v in fin) if "std" in ops else 0.0,
            lo=_least(real),
            hi=_most(real),
            nans=len(values) - len(real),
            nonfinite=len(values) - len(fin),
            last_ts=last[0],
            last_rank=last[1],
            last=last[2],
            values=list(values) if keep else None,
        )

    @classmethod
    def summed(cls, count: int, total: float, ops: tuple[str, ...]) -> Partial | None:
        """The partial of ``count`` values whose ``math.fsum`` is ``total``, when ``ops``
        need nothing else (mean, sum or count of finite values: the usual case); None
        otherwise (then :meth:`of` takes the values themselves). Not mergeable exactly.
        """
        if ops in SUMMED_OPS and total - total == 0.0:  # finite
            return cls(count, total)  # (no ``last``: these ops never read it)
        return None

    def merge(self, other: Partial) -> Partial:
        """The partial of both inputs' values together."""
        if (other.last_ts, other.last_rank) > (self.last_ts, self.last_rank):
            last = (other.last_ts, other.last_rank, other.last)
        else:
            last = (self.last_ts, self.last_rank, self.last)
        values = None
        if self.values is not None and other.values is not None:
            values = self.values + other.values
        parts = None
        total = math.nan
        if self.parts is not None and other.parts is not None:
            parts = self.parts + other.parts
            try:
                total = zero_sign(math.fsum(parts), parts)
            except OverflowError:  # the exact sum itself overflows
                parts = None
        if parts is None:
            total = _add(self.total, other.total)
        return Partial(
            count=self.count + other.count,
            total=total,
            sumsq=_add(self.sumsq, other.sumsq),
            lo=_least((self.lo, other.lo)),
            hi=_most((self.hi, other.hi)),
            nans=self.nans + other.nans,
            nonfinite=self.nonfinite + other.nonfinite,
            last_ts=last[0],
            last_rank=last[1],
            last=last[2],
            values=values,
            parts=parts,
        )

    def result(self, op: str) -> float:
        """The reduced value for ``op``."""
        if op == "count":
            return float(self.count)
        if op == "last":
            return self.last
        if self.count == 0:
            return math.nan
        if self.nans:
            return math.nan
        if op == "mean":
            return self.total / self.count
        if op == "sum":
            return self.total
        if op == "min":
            return self.lo
        if op == "max":
            return self.hi
        if op == "median":
            return _median(self.values) if self.values is not None else math.nan
        if op == "std":
            return self._std()
        raise ConfigError(f"unknown reduce op {op!r}")

    def _std(self) -> float:
        if self.nonfinite:
            return math.nan
        mean = self.total / self.count
        if self.values is not None:  # exact two-pass form
            sq = [(v - mean) * (v - mean) for v in self.values]  # inf, never OverflowError
            try:
                return math.sqrt(math.fsum(sq) / self.count)
            except OverflowError:
                return math.inf
        return math.sqrt(max(0.0, self.sumsq / self.count - mean * mean))


def fsums(values: Sequence[float], starts: list[int], ends: list[int]) -> list[float] | None:
    """``math.fsum`` of each ``values[a:b]`` (a list, or a memoryview of float64s), in one C
    loop; None if one raises (inf - inf, an intermediate overflow): then
    :meth:`Partial.of` takes those values one by one.

    With such a sum, :meth:`Partial.summed` may be all a group's partial needs.
    """
    if len(starts) == len(values):  # a value a group (one rank): each is its own sum
        return list(map(float, map(values.__getitem__, starts)))  # (zero_sign keeps -0.0)
    try:
        out = list(map(math.fsum, map(values.__getitem__, map(slice, starts, ends))))
    except (ValueError, OverflowError):
        return None
    if 0.0 in out:  # (rare) a sum of zeros: its sign, as IEEE gives it
        for i, total in enumerate(out):
            if total == 0.0:
                out[i] = zero_sign(total, values[starts[i] : ends[i]])
    return out


def _least(values: Sequence[float]) -> float:
    """``min(values)`` (inf if none), -0.0 below 0.0 whatever their order (IEEE 754's
    minimum): live, fan-in and replay meet the ranks' values in different orders."""
    lo = min(values, default=math.inf)
    if lo == 0.0:
        return -0.0 if any(v == 0.0 and math.copysign(1.0, v) < 0 for v in values) else 0.0
    return lo


def _most(values: Sequence[float]) -> float:
    """``max(values)`` (-inf if none), 0.0 above -0.0 whatever their order."""
    hi = max(values, default=-math.inf)
    if hi == 0.0:
        return 0.0 if any(v == 0.0 and math.copysign(1.0, v) > 0 for v in values) else -0.0
    return hi


def zero_sign(total: float, values: Sequence[float]) -> float:
    """``total``, the ``math.fsum`` of ``values``, with IEEE's sign of zero.

    ``math.fsum`` returns ``+0.0`` for any zero sum; IEEE addition gives ``-0.0`` when
    every value is ``-0.0`` (and ``+0.0`` when values cancel). Only a zero ``total`` is
    looked at again.
    """
    if total == 0.0 and values and all(v == 0.0 and math.copysign(1.0, v) < 0.0 for v in values):
        return -0.0
    return total


def _add(a: float, b: float) -> float:
    """a + b, exactly rounded where both are finite (fsum raises on inf - inf)."""
    if math.isfinite(a) and math.isfinite(b):
        try:
            return zero_sign(math.fsum((a, b)), (a, b))
        except OverflowError:
            return a + b
    return a + b


def exact_parts(values: Sequence[float]) -> list[float]:
    """Floats whose exact sum is the exact sum of the finite ``values``.

    ``math.fsum`` rounds the exact sum once; what the rounding lost is found with
    another ``fsum`` over the values and the negated parts so far, until nothing is
    left (two or three rounds in practice; every round keeps 53 more bits). So
    ``math.fsum`` over the parts of several groups is ``math.fsum`` over all their
    values at once, correctly rounded, whatever the grouping.
    """
    parts: list[float] = []
    more = list(values)
    while True:
        r = math.fsum(more)  # the exact sum of values minus parts, rounded
        if r == 0.0:  # exact: a sum of doubles is a multiple of 2**-1074, never rounded to 0
            return parts or [zero_sign(r, values)]  # a zero sum: IEEE's sign of zero
        parts.append(r)
        more.append(-r)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


_needs_cache: dict[tuple[str, ...], bool] = {}


def needs_values(ops: tuple[str, ...]) -> bool:
    """Whether these ops need the values kept (median, exact std)."""
    keep = _needs_cache.get(ops)
    if keep is None:
        keep = not _NEEDS_VALUES.isdisjoint(ops)
        if len(_needs_cache) < 4096:
            _needs_cache[ops] = keep
    return keep
