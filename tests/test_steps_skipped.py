"""Steps need not be consecutive: no warning for a value at a step the rank has not passed.

How the "ahead" warning could lie, and what each test tries: a loop that logs and closes
every 10th step (``log_metrics(..., step=s); step_end(s)`` for s = 0, 10, 20, ...) was
told its values were "ahead of step 1"; nothing is ahead there. A value is ahead only
when the rank then logs or closes a lower step: an evaluation at step 1000 during step
1 (logged after its first value or before it, closed by ``step_end(1)``) is warned once,
with the name and both steps; a late value (a step already closed) is warned as late.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from .shiphelp import lines, rank, ship


def _warned(fn: object) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()  # type: ignore[operator]
    return [str(w.message) for w in got]


def test_every_tenth_step_is_no_warning(spool: Path, tmp_path: Path) -> None:
    """s = 0, 10, 20, ... logged and closed: no warning, every step ships."""
    run = rank(spool, 0, 1)

    def loop() -> None:
        for s in range(0, 100, 10):
            run.log_metrics({"loss": s / 100}, step=s)
            run.log_timing("step", 0.1, step=s)
            run.step_end(s)

    assert _warned(loop) == []
    run.close()
    out = tmp_path / "o.jsonl"
    ship(spool, out)
    assert [x["step"] for x in lines(out)] == list(range(0, 100, 10))


@pytest.mark.parametrize("order", ["after-first-value", "before-any-value"])
def test_a_value_ahead_is_warned_once_naming_both_steps(spool: Path, order: str) -> None:
    """eval at 1000 during step 1 (after x@1, or before it and closed by step_end(1)): one
    warning naming 'eval/y', 1000 and 1."""
    run = rank(spool, 0, 1)
    run.log_metrics({"x": 0.0}, step=0)
    run.step_end(0)

    def step_one() -> None:
        if order == "after-first-value":
            run.log_metrics({"x": 1.0}, step=1)
        run.log_metrics({"y": 9.0}, step=1000, prefix="eval")
        run.log_metrics({"z": 1.0}, step=1)
        run.step_end(1)
        run.log_metrics({"y": 9.5}, step=1001, prefix="eval")  # (once: no second warning)
        run.log_metrics({"x": 2.0}, step=2)
        run.step_end(2)

    said = _warned(step_one)
    assert len(said) == 1 and "'eval/y' for step 1000 ahead of step 1" in said[0], said
    run.close()
