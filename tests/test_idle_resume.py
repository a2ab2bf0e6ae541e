"""A shipper run that reads nothing new keeps what its cursor knew of the names frames.

How it could break: a ``--once`` run (cron, the epilogue, a compaction with nothing new)
resumes a segment of format 2 and reads no byte of it; its cursor is saved again. If it
saved what the reader had *read* of names frames (nothing) instead of what it was told,
the next run would start past them with no names, and every packed frame after them would
be "corrupt": steps dropped, exit 0. Tested through the shipper and through compaction's
steps table, both run twice with nothing new in between, then again after more steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import ranklog
from ranklog.archive import compact, replay
from ranklog.shippers.targets.jsonl import JsonlTarget

from .shiphelp import lines, rank, ship


def _log(runs: list[ranklog.Run], steps: range, *, close: bool) -> None:
    """Each rank logs ``loss`` for ``steps``, closing each; then flushes, or closes."""
    for s in steps:
        for run in runs:
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)
    for run in runs:
        if close:
            run.close()
        else:
            run.flush()


def test_a_run_with_nothing_new_keeps_the_names(spool: Path, tmp_path: Path) -> None:
    """Two runs with nothing new keep the cursor's names frames; the steps logged after
    them all ship, none skipped as corrupt."""
    runs = [rank(spool, r, 2) for r in range(2)]
    _log(runs, range(4), close=False)
    out = tmp_path / "out.jsonl"
    for _ in range(3):
        ship(spool, out)
    (cursor,) = (spool / "cursors").glob("*.json")
    names = [seg["names"] for seg in json.loads(cursor.read_text())["segments"].values()]
    assert all(n for n in names), names
    _log(runs, range(4, 7), close=True)
    ship(spool, out)
    assert [x["step"] for x in lines(out) if "step" in x] == list(range(7))


def test_compaction_with_nothing_new_keeps_its_steps(spool: Path, tmp_path: Path) -> None:
    """Compacted twice mid-run with nothing new, then after the end: the steps table holds
    every step, and replay from it gives what live shipping gave."""
    runs = [rank(spool, r, 2) for r in range(2)]
    _log(runs, range(4), close=False)
    compact(spool, tmp_path / "pq")
    compact(spool, tmp_path / "pq")
    _log(runs, range(4, 7), close=True)
    res = compact(spool, tmp_path / "pq")
    assert res.steps[1] == 6 and not res.bad
    ship(spool, tmp_path / "live.jsonl")
    replay(tmp_path / "pq", JsonlTarget(tmp_path / "again.jsonl"))
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "live.jsonl").read_bytes()
