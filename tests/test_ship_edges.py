"""Edge cases found in review: revived ranks, unread backlogs, restarts, foreign files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .compliance import Killed, KillSwitch
from .shiphelp import age, lines, log_steps, rank, ship


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out.jsonl"


def test_a_dead_rank_that_comes_back_is_read_again(spool: Path, out: Path) -> None:
    """Declared dead (steps shipped partial), a rank that writes again is followed again."""
    a, b = rank(spool, 0, 2), rank(spool, 1, 2)
    log_steps(a, range(6))
    log_steps(b, range(2))
    age(spool, 1, 600)
    ship(spool, out, dead_after=60)
    assert [x["complete"] for x in lines(out)] == [True, True, False, False, False, False]
    log_steps(b, range(2, 10))  # it was only stalled
    log_steps(a, range(6, 10))
    a.close(), b.close()
    ship(spool, out, dead_after=60)
    got = lines(out)
    assert [x["step"] for x in got] == list(range(10))
    assert all(x["complete"] for x in got[6:])
    assert got[8]["metrics"]["loss"] == pytest.approx(0.5 + 0.008)


def test_an_ended_rank_is_read_to_the_end_before_it_releases(
    spool: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that ended releases steps only once its whole backlog has been read."""
    import ranklog.shippers._engine as engine

    monkeypatch.setattr(engine, "ROUND_BYTES", 4096)
    big, small = rank(spool, 0, 2), rank(spool, 1, 2)
    for s in range(40):
        big.log_text("val/sample", "x" * 2000, step=s)
        big.log_metrics({"loss": 0 + s / 1000}, step=s)
        big.step_end(s)
    log_steps(small, range(40))
    big.close(), small.close()
    age(spool, 0, 600), age(spool, 1, 600)
    shipper = ship(spool, out, dead_after=60)
    got = lines(out)
    assert [x["step"] for x in got] == list(range(40))
    assert all(x["complete"] and x["ranks"] == 2 for x in got)
    assert all(x["metrics"]["loss"] == pytest.approx(0.5 + x["step"] / 1000) for x in got)
    assert shipper.stats.late_events == 0


def test_restart_rebuilds_watermarks_by_reading(
    spool: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, steps wait until each rank's values are read again."""
    import ranklog.shippers._engine as engine
    from ranklog.shippers import Shipper
    from ranklog.shippers.jsonl import JsonlTarget

    monkeypatch.setattr(engine, "ROUND_BYTES", 4096)
    monkeypatch.setattr(engine, "BATCH_STEPS", 5)
    big, small = rank(spool, 0, 2), rank(spool, 1, 2)
    for s in range(40):
        big.log_text("val/sample", "y" * 1500, step=s)
        big.log_metrics({"loss": s / 1000}, step=s)
        big.step_end(s)
    log_steps(small, range(40))
    big.close(), small.close()
    killer = KillSwitch(JsonlTarget(out), "write", 3)
    with pytest.raises(Killed):
        Shipper(str(spool), killer, name="t", dead_after=3600).run_forever(once=True)  # type: ignore[arg-type]
    ship(spool, out)
    got = lines(out)
    assert [x["step"] for x in got] == list(range(40))
    assert all(x["complete"] and x["ranks"] == 2 for x in got)
    assert all(x["metrics"]["loss"] == pytest.approx(0.5 + x["step"] / 1000) for x in got)


def test_a_segment_of_another_run_is_refused(spool: Path, tmp_path: Path, out: Path) -> None:
    """A segment copied in from another run is reported and never shipped."""
    other = tmp_path / "other"
    intruder = rank(other, 0, 1)
    for s in range(3):
        intruder.log_metrics({"loss": 1000.0}, step=s)
        intruder.step_end(s)
    intruder.close()
    run = rank(spool, 0, 1)
    log_steps(run, range(3))
    run.close()
    src = next((other / "ranks" / "00000").iterdir())
    shutil.copy(src, spool / "ranks" / "00000" / "0007-000001.rlog")
    shipper = ship(spool, out)
    assert [x["metrics"]["loss"] for x in lines(out)] == pytest.approx([0.0, 0.001, 0.002])
    (bad,) = shipper.stats.bad
    assert "0007-000001.rlog" in bad.path and "segment of run" in bad.reason


def test_steps_nobody_logged_do_not_hold_the_cursor(spool: Path, out: Path) -> None:
    """A closed step with no values at all still lets the cursor move past it."""
    from ranklog.shippers import load_cursor

    run = rank(spool, 0, 1)
    log_steps(run, range(3))
    run.step_end(10)  # steps 3..10 closed without any value
    ship(spool, out)
    cursor = load_cursor(spool, "t")
    assert cursor is not None and cursor.last_step == 10
    run.close()
