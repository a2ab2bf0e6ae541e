"""The watermark rule: how far a rank has closed its steps.

A rank (one incarnation's stream) that calls ``step_end`` has *closed* step S once it
wrote ``step_end`` for S or a later step: only ``step_end`` closes its steps, so a value
it logs ahead (an evaluation at step 1000 while it is at step 1) holds step 1000 open
without closing steps 1..999, which ship as ``step_end`` closes them. A rank that never
calls ``step_end`` closes S with any step event (metrics, timer, text, histogram,
image, table) of a step after S: such loops log their steps in increasing order, so a
value for S+1 means S is done. A rank's watermark is the highest step it closed.
Completeness (a step ships once every rank's watermark reached it), late values (a
value for a step at or below its rank's watermark) and re-logged values (a later
incarnation logging a step an earlier one had closed) are all judged with it, by the
shipper, by replay and by compaction alike.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NO_STEP", "watermark"]

#: "no step yet": the watermark of a rank that closed nothing
NO_STEP: Final = -1


def watermark(step_end: int, max_step: int) -> int:
    """The highest step closed by a stream whose highest ``step_end`` and step event are given.

    Either may be :data:`NO_STEP` (a ``step_end`` never written: the implicit rule).
    """
    return step_end if step_end != NO_STEP else max_step - 1
