"""The watermark rule: how far a rank has closed its steps.

A rank has *closed* step S once it wrote ``step_end`` for S or a later step, or
any step event (metrics, timer, text, histogram, image) of a step after S: ranks
log their steps in increasing order, so a value for S+1 means S is done. A
rank's watermark is the highest step it closed. Completeness (a step ships once
every rank's watermark reached it), late values (a value for a step at or below
its rank's watermark) and re-logged values (a later incarnation logging a step an
earlier one had closed) are all judged with it, by the shipper, by replay and by
compaction alike.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NO_STEP", "watermark"]

#: "no step yet": the watermark of a rank that closed nothing
NO_STEP: Final = -1


def watermark(step_end: int, max_step: int) -> int:
    """The highest step closed by a stream whose highest ``step_end`` and step event are given.

    Either may be :data:`NO_STEP`.
    """
    implied = max_step - 1
    return step_end if step_end > implied else implied
