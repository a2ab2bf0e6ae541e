"""What a target holds of a run: a set of steps kept as ranges, and the target's record of it.

A target reports the steps it durably holds when it is opened (:class:`StepSet`), read
back from its own storage (the JSONL lines, the TensorBoard records, MLflow's marker
metric, W&B's history), never from a high-water mark: after a windowed replay
(``--steps 100:200``) a full one writes steps 0..99 and 200.. and nothing twice.

A target also knows *which run* it holds. :class:`Holding` is that record, in the form
each target stores it (a line of the JSONL file, the ``SessionLog`` of TensorBoard's
session files, a tag in MLflow, the W&B run's config): the run id and the selection of
names a replay wrote (``--names``), so that another run, or the same run with another
selection, is refused (:func:`refuse_other`) instead of being skipped as "held".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Final

import msgspec

from ranklog.errors import TargetHeldError

__all__ = ["ALL_NAMES", "Holding", "StepSet", "as_step_set", "refuse_other"]

#: the selection of a shipper or a replay without ``--names``
ALL_NAMES: Final = "*"


class StepSet:
    """A set of steps, as sorted disjoint inclusive ranges ``[(lo, hi), ...]``."""

    __slots__ = ("_his", "_los")

    def __init__(self, steps: Iterable[int] = ()) -> None:
        self._los: list[int] = []
        self._his: list[int] = []
        for s in sorted(set(steps)):
            if self._his and s == self._his[-1] + 1:
                self._his[-1] = s
            else:
                self._los.append(s)
                self._his.append(s)

    @classmethod
    def upto(cls, last: int | None) -> StepSet:
        """Every step from 0 to ``last`` (a high-water mark; None: no step)."""
        out = cls()
        if last is not None and last >= 0:
            out._los, out._his = [0], [last]
        return out

    @classmethod
    def of_ranges(cls, ranges: Iterable[tuple[int, int]]) -> StepSet:
        """The union of inclusive ranges."""
        out = cls()
        for lo, hi in sorted(ranges):
            if hi < lo:
                continue
            if out._his and lo <= out._his[-1] + 1:
                out._his[-1] = max(out._his[-1], hi)
            else:
                out._los.append(lo)
                out._his.append(hi)
        return out

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        i = bisect.bisect_right(self._los, step) - 1
        return i >= 0 and step <= self._his[i]

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every step from ``lo`` to ``hi`` is held (an empty range: True)."""
        if hi < lo:
            return True
        i = bisect.bisect_right(self._los, lo) - 1
        return i >= 0 and hi <= self._his[i]

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in zip(self._los, self._his, strict=True))

    def __bool__(self) -> bool:
        return bool(self._los)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepSet) and self.ranges() == other.ranges()

    def __hash__(self) -> int:
        return hash(tuple(self.ranges()))

    def __repr__(self) -> str:
        return f"StepSet({self.describe()})"

    @property
    def last(self) -> int | None:
        """The highest step held (None: none)."""
        return self._his[-1] if self._his else None

    def ranges(self) -> list[tuple[int, int]]:
        """The inclusive ranges, in order."""
        return list(zip(self._los, self._his, strict=True))

    def add(self, step: int) -> None:
        """Hold ``step`` too (steps are usually added in increasing order: O(1) then)."""
        if self._his and step == self._his[-1] + 1:
            self._his[-1] = step
            return
        if not self._his or step > self._his[-1]:
            self._los.append(step)
            self._his.append(step)
            return
        if step in self:
            return
        merged = StepSet.of_ranges([*self.ranges(), (step, step)])
        self._los, self._his = merged._los, merged._his

    def after(self, step: int) -> int | None:
        """The lowest step held above ``step`` (None: none)."""
        i = bisect.bisect_right(self._his, step)
        if i >= len(self._los):
            return None
        return max(self._los[i], step + 1)

    def union(self, other: StepSet) -> StepSet:
        """Steps held by either."""
        return StepSet.of_ranges([*self.ranges(), *other.ranges()])

    def below(self, step: int) -> StepSet:
        """The steps lower than ``step``."""
        out = StepSet()
        for lo, hi in self.ranges():
            if lo >= step:
                break
            out._los.append(lo)
            out._his.append(min(hi, step - 1))
        return out

    def describe(self, limit: int = 4) -> str:
        """``0-99, 200, 300-399`` (the first ``limit`` ranges, then how many more)."""
        parts = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges()[:limit]]
        if len(self._los) > limit:
            parts.append(f"... ({len(self._los) - limit} more ranges)")
        return ", ".join(parts) if parts else "none"


def as_step_set(held: int | StepSet | None) -> StepSet:
    """What :meth:`Target.open` returned, as a set: an int is every step up to it."""
    if isinstance(held, StepSet):
        return held
    return StepSet.upto(held)


class Holding(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Which run a target holds, and which names of it (a replay's ``--names``)."""

    run_id: str
    name: str = ""
    #: the ``--names`` glob its steps were written with (``*``: every name)
    names: str = ALL_NAMES


def refuse_other(
    where: str,
    held: Holding | None,
    mine: Holding,
    steps: StepSet,
    *,
    remedy: str,
    append: bool = False,
) -> None:
    """Raise :class:`TargetHeldError` when ``where`` holds another run (even no step of
    it yet), or this run's steps written with another ``--names`` selection.

    ``remedy``: what the user can do about another run (one clause); ``append``: the
    user asked for another run to follow (``--append-run``, where a target allows it).
    """
    if held is None:
        return
    if held.run_id != mine.run_id:
        if append:
            return
        held_steps = f"steps {steps.describe()}" if steps else "no step yet"
        raise TargetHeldError(
            f"{where} holds run {held.run_id} ({held.name or 'unnamed'}, {held_steps}), "
            f"not this run {mine.run_id} ({mine.name or 'unnamed'}): {remedy}"
        )
    if held.names != mine.names and steps:
        what = "every name" if held.names == ALL_NAMES else f"only names {held.names!r}"
        now = "every name" if mine.names == ALL_NAMES else f"names {mine.names!r}"
        same = "no --names" if held.names == ALL_NAMES else f"--names {held.names!r}"
        raise TargetHeldError(
            f"{where} holds steps {steps.describe()} of this run written with {what}, and "
            f"this would write {now}: a target holds one selection of names (else values "
            f"would be missing or written twice); write into another place, or with {same}"
        )
