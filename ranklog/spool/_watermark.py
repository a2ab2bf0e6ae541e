"""The watermark rule: how far a rank has closed its steps.

A rank (one incarnation's stream) closes its steps in two ways. Until it writes its
first ``step_end``, a step event (metrics, timer, text, histogram, image, table) of a
step above every step it logged so far closes the steps up to the highest it had logged
(the step it was in: it moved on); a jump (step 1000 logged during step 0) thus closes
step 0, not 1..999. From its first ``step_end`` on, only ``step_end`` closes: it closes
S once it wrote ``step_end`` for S or a later step, and a value it logs ahead holds its
step open without closing the steps before it. A rank's watermark is the highest step
it closed either way: it never goes down in stream order, so what a live shipper
decides on any prefix of the stream (however heartbeats and flushes cut it) is what
replay decides on the whole.
Completeness (a step ships once every rank's watermark reached it), late values (a
value for a step at or below its rank's watermark) and re-logged values (a later
incarnation logging a step an earlier one had closed) are all judged with it, by the
shipper, by replay and by compaction alike.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NO_STEP", "implied_after", "legacy_implied", "watermark"]

#: "no step yet": the watermark of a rank that closed nothing
NO_STEP: Final = -1


def watermark(step_end: int, implied: int) -> int:
    """The highest step closed by a stream whose highest ``step_end`` and implied close
    (:func:`implied_after`) are given; either may be :data:`NO_STEP`."""
    return step_end if step_end > implied else implied


def implied_after(step: int, step_end: int, max_step: int, before: int) -> int:
    """A stream's implied close after a step event of ``step``: ``before`` (its implied
    close so far) raised to ``max_step`` (its highest step so far) when ``step`` is above
    it and no ``step_end`` was written (``step_end`` is :data:`NO_STEP`)."""
    return max_step if step > max_step and step_end == NO_STEP else before


def legacy_implied(step_end: int, max_step: int) -> int:
    """The implied close a record of an earlier release stands for: it kept only the
    highest ``step_end`` and step, and judged a stream with no ``step_end`` closed up to
    the step before its highest (``max_step - 1``)."""
    return max(NO_STEP, max_step - 1) if step_end == NO_STEP else NO_STEP
