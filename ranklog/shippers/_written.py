"""What a shipper writes of a batch, given what its target holds already.

A target reports the steps of the run it holds when it is opened (a
:class:`~ranklog.shippers.StepSet`). :class:`TargetHeld` keeps that set for the engine and
applies the two rules that follow from it:

- a step the target holds is not sent again (it counts as shipped: the target has it),
  nor are late values whose carrier it holds;
- a target that holds fewer steps than the cursor counts as shipped to it (deleted,
  moved, rolled back) is refused at open (:meth:`TargetHeld.check_kept`): shipping on
  would skip those steps;
- a target that cannot write below its last step (``steps_in_order``, W&B) and lacks a
  step below it refuses the batch before anything is written
  (:class:`~ranklog.errors.TargetHeldError`), or, with ``--below-last skip``, leaves
  such steps out, counted and said once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from ranklog.errors import ConfigError, TargetHeldError
from ranklog.shippers._held import StepSet, as_step_set
from ranklog.shippers._target import ShippedStep, Target

if TYPE_CHECKING:
    from pathlib import Path

    from ranklog.shippers._cursor import Cursor

__all__ = ["BELOW_LAST", "TargetHeld"]

log = logging.getLogger("ranklog.ship")

#: what to do with a step a target cannot write because it lies below its last one (W&B)
BELOW_LAST: Final = ("refuse", "skip")


class TargetHeld:
    """The steps of this run a target held when it was last opened, and what follows."""

    def __init__(self, target: Target, below_last: str = "refuse") -> None:
        if below_last not in BELOW_LAST:
            raise ConfigError(f"below_last must be one of {', '.join(BELOW_LAST)}")
        self.target, self.below_last = target, below_last
        self.steps = StepSet()
        #: steps left out because the target cannot write below its last one
        self.skipped_below = 0
        self._said = self._warned = False

    def opened(self, held: StepSet | int | None) -> None:
        """What ``Target.open`` answered (an int: every step up to it)."""
        self.steps = as_step_set(held)

    def check_kept(self, cursor: Cursor, path: Path) -> None:
        """Refuse a target that holds fewer steps of this run, up to the cursor's last,
        than the cursor (at ``path``) counts as shipped to it: it was deleted, moved or
        rolled back, and shipping on would skip them and exit 0."""
        last, shipped = cursor.last_step, cursor.steps_shipped
        if last < 0 or shipped <= 0:
            return
        have = sum(min(hi, last) - lo + 1 for lo, hi in self.steps.ranges() if lo <= last)
        if have < shipped:
            raise TargetHeldError(
                f"{self.target.spec} holds {shipped - have} fewer steps of this run than its "
                f"cursor says were shipped to it (up to step {last}; it holds "
                f"{self.steps.describe()}): nothing sent. To ship them into it again, remove "
                f"{path} (the steps it holds are not sent twice), or ship into a new target"
            )

    def holds(self, s: ShippedStep) -> bool:
        """Whether the target holds ``s`` (late values: whether it holds their carrier)."""
        return (s.step if s.carrier is None else s.carrier) in self.steps

    def said(self, count: int) -> None:
        """``count`` steps of a batch were found held: say so, once."""
        if count and not self._said:
            self._said = True
            log.info("%s already holds steps %s of this run: not sent again",
                     self.target.spec, self.steps.describe())  # fmt: skip

    def writable(self, steps: list[ShippedStep]) -> list[ShippedStep]:
        """``steps`` less those a target that writes in step order cannot take (or raise)."""
        last, held = self.steps.last, self.steps
        if last is None or not getattr(self.target, "steps_in_order", False):
            return steps
        below = [s for s in steps if s.carrier is None and s.step < last and s.step not in held]
        if not below:
            return steps
        spec = self.target.spec
        if self.below_last != "skip":
            raise TargetHeldError(
                f"{spec} holds steps {held.describe()} of this run and cannot write below its "
                f"last step ({last}): step {below[0].step} would be lost; write into a new run "
                "(--run-id), or pass --below-last skip to leave those steps out"
            )
        if not self._warned:
            self._warned = True
            log.warning("%s: steps below %d it does not hold are left out (--below-last skip), "
                        "from step %d on", spec, last, below[0].step)  # fmt: skip
        self.skipped_below += len(below)
        gone = {s.step for s in below}
        return [s for s in steps if (s.step if s.carrier is None else s.carrier) not in gone]
