"""A value logged ahead waits, whenever it comes: the watermark rule never goes down.

How it could break, and what each test tries: a rank logs step 0 and an ``eval`` value
at step 1000, and its first ``step_end`` comes after a flush or heartbeat wrote that
prefix; a live shipper reading the prefix judged the rank at 999 (the implicit rule of a
rank that never calls ``step_end``), shipped 0 and 1000 and counted steps 1..5 late,
while replay (reading the whole stream) shipped them all. The rule is now monotone in
stream order — moving on closes the step a rank was in, until its first ``step_end``;
from then on only ``step_end`` closes — so any prefix, cut anywhere by flushes, decides
what the whole stream decides. ``run.flush()`` stands for the background writer's flush
(or a heartbeat's) during a long first step, one ``ship()`` round for the live shipper
reading it then. Loops that never call ``step_end`` keep closing by moving on.
"""

from __future__ import annotations

from pathlib import Path

from ranklog.archive import compact, replay
from ranklog.shippers.targets.jsonl import JsonlTarget

from .shiphelp import lines, rank, ship


def test_steps_logged_after_it_ship_as_they_close(spool: Path, tmp_path: Path) -> None:
    """A value at step 1000 before the first step_end, read live before step_end(0): steps
    0..5 and 1000 ship, none late, and replay ships the same bytes."""
    run = rank(spool, 0, 1)
    run.log_metrics({"x": 0.0}, step=0)
    run.log_metrics({"y": 9.0}, step=1000, prefix="eval")  # ahead, before any step_end
    run.flush()  # the background writer's flush (or a heartbeat's) during a long step 0
    live = tmp_path / "live.jsonl"
    first = ship(spool, live)  # a live shipper reads it then
    assert first.stats.late_events == 0
    run.step_end(0)
    for s in range(1, 6):
        run.log_metrics({"x": float(s)}, step=s)
        run.step_end(s)
    run.close()
    shipper = ship(spool, live)
    assert [x["step"] for x in lines(live)] == [*range(6), 1000]
    assert shipper.stats.late_events == 0
    assert all(x["metrics"] == {"x": float(x["step"])} for x in lines(live)[:-1])
    compact(spool, tmp_path / "pq")
    again = tmp_path / "again.jsonl"
    replay(tmp_path / "pq", JsonlTarget(again))
    assert lines(again) == lines(live)


def test_a_loop_without_step_end_still_closes_by_moving_on(spool: Path, tmp_path: Path) -> None:
    """The implicit rule for contiguous steps is unchanged; a jump closes the step it left."""
    run = rank(spool, 0, 1)
    for s in (0, 1, 2, 10):
        run.log_metrics({"x": float(s)}, step=s)
    run.flush()
    out = tmp_path / "o.jsonl"
    ship(spool, out)
    assert [x["step"] for x in lines(out)] == [0, 1, 2]  # 10 open; 3..9 not closed yet
    run.log_metrics({"x": 5.0}, step=5)  # not late: step 5 was never closed
    run.log_metrics({"x": 11.0}, step=11)  # moving on past 10 closes 5 and 10
    run.flush()
    shipper = ship(spool, out)
    assert [x["step"] for x in lines(out)] == [0, 1, 2, 5, 10]
    assert shipper.stats.late_events == 0
    run.close()


def test_an_older_cursor_keeps_the_watermark_its_release_judged(spool: Path) -> None:
    """A version-1 cursor (no ``implied``) of a rank that never called step_end, at step
    10: read back, its incarnation and segment stand closed up to 9, as that release
    judged (not at -1, which would hold steps back and miss re-logged values)."""
    import json

    from ranklog.shippers import load_cursor
    from ranklog.spool import SpoolLayout

    cursors = SpoolLayout(spool).cursors_dir
    cursors.mkdir(parents=True)
    body = {
        "version": 1, "name": "old", "target": "jsonl:x", "run_id": None, "last_step": 8,
        "segments": {"00000/0001-000001": {"offset": 64, "seen": 64, "done": False, "seq": 3,
                                           "closed": -1, "max_step": 10}},
        "ranks": {"0": {"1": {"closed": -1, "max_step": 10}}},
    }  # fmt: skip
    (cursors / "old.json").write_text(json.dumps(body))
    cursor = load_cursor(spool, "old")
    assert cursor is not None
    assert cursor.ranks["0"]["1"].watermark == 9
    assert cursor.segments["00000/0001-000001"].implied == 9
    (cursors / "new.json").write_text(json.dumps({**body, "version": 2, "name": "new"}))
    fresh = load_cursor(spool, "new")
    assert fresh is not None and fresh.ranks["0"]["1"].watermark == -1  # (2: as recorded)
