"""What the framework adapters share (``ranklog.lightning``, ``.hf``, ``.accelerate``, ``.nemo``).

A framework logs values "at" steps it chooses and never says when a step is over; an
adapter must close steps (``step_end``) for the shipper, never go back to a closed step
(a value for it would be late) and close the last one when training ends or the
process exits. :class:`OpenStep` does that for one rank.
"""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

from ranklog.errors import ConfigError
from ranklog.producer._run import SPOOL_ENV, Reduce

if TYPE_CHECKING:
    from ranklog.producer import Run

__all__ = ["OpenStep", "Reduce", "is_scalar", "spool_of"]


def spool_of(spool: str | os.PathLike[str] | None, who: str) -> str | os.PathLike[str]:
    """``spool``, else ``$RANKLOG_SPOOL``; a ConfigError naming ``who`` when neither is set."""
    spool = spool or os.environ.get(SPOOL_ENV)
    if not spool:
        raise ConfigError(f"{who} needs a spool: pass {who}(PATH) or set ${SPOOL_ENV}")
    return spool


class OpenStep:
    """The step a rank is in: values go to it; a later step closes it; never back."""

    def __init__(self) -> None:
        #: the step values were logged at and that is not closed yet
        self.open: int | None = None
        #: the highest step this adapter closed
        self.closed = -1
        self._run: Run | None = None

    def attach(self, run: Run) -> None:
        """Follow ``run``; its open step is closed at exit, before the run itself closes."""
        self._run = run
        atexit.register(self.close)  # registered after the run's: runs before it

    def at(self, step: int | None) -> int:
        """The step to log at for ``step`` (None: the next one), closing the one left behind.

        A step below the open one (or a closed one) is logged at the open step, or at the
        next one when none is open: a framework's late value never reopens a step.
        """
        current = self.open if self.open is not None else self.closed + 1
        if step is None:
            at = current + 1 if self.open is not None else current
        else:
            at = max(int(step), current)
        if self.open is not None and at > self.open:
            self._end(self.open)
        self.open = at
        return at

    def close(self) -> None:
        """Close the open step (end of training, or exit)."""
        if self.open is not None:
            self._end(self.open)
        self.open = None

    def _end(self, step: int) -> None:
        run = self._run
        if run is not None and not run.closed:
            run.step_end(step)
        self.closed = step


def is_scalar(value: object) -> bool:
    """A one-element tensor or array (``.item()`` gives the number)."""
    size = getattr(value, "numel", None)
    n = size() if callable(size) else getattr(value, "size", None)
    return isinstance(n, int) and n == 1 and hasattr(value, "item")
