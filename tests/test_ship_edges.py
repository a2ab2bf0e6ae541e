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
    import ranklog.shippers._tail as tail

    monkeypatch.setattr(tail, "ROUND_BYTES", 4096)
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
    import ranklog.shippers._tail as tail
    from ranklog.shippers import Shipper
    from ranklog.shippers.targets.jsonl import JsonlTarget

    monkeypatch.setattr(tail, "ROUND_BYTES", 4096)
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


def test_late_is_judged_by_the_ranks_own_watermark(spool: Path, out: Path) -> None:
    """A value for a step its rank already closed is late, even if the step is not shipped."""
    a, b = rank(spool, 0, 2), rank(spool, 1, 2)
    log_steps(a, range(5))
    with pytest.warns(Warning, match="late"):
        a.log_metrics({"loss": 99.0}, step=2)  # rank 0 closed step 2 already
    log_steps(b, range(5))
    a.close(), b.close()
    shipper = ship(spool, out)
    assert lines(out)[2]["metrics"]["loss"] == pytest.approx(0.5 + 0.002)
    assert shipper.stats.late_events == 1


def test_params_land_before_the_step_they_were_logged_at(spool: Path, out: Path) -> None:
    """Params logged during step 3 are written right before step 3, however reads are chunked."""
    from ranklog.shippers.targets.jsonl import read_jsonl

    run = rank(spool, 0, 1)
    run.log_hyperparams({"lr": 0.1})
    log_steps(run, range(3))
    run.log_hyperparams({"lr": 0.05, "phase": "anneal"})
    log_steps(run, range(3, 6))
    run.log_hyperparams({"done": True})
    run.close()
    ship(spool, out)
    order = [
        ("params", x["params"]) if "params" in x else ("step", x["step"])
        for x in read_jsonl(out)
        if "ranklog" not in x
    ]
    assert order == [
        ("params", {"lr": 0.1}), ("step", 0), ("step", 1), ("step", 2),
        ("params", {"lr": 0.05, "phase": "anneal"}), ("step", 3), ("step", 4), ("step", 5),
        ("params", {"done": True}),
    ]  # fmt: skip


def test_a_rank_ended_by_sigterm_may_come_back(spool: Path, out: Path) -> None:
    """rank_end written on SIGTERM (a requeue) holds steps for dead_after, not at once."""
    a, b = rank(spool, 0, 2), rank(spool, 1, 2)
    log_steps(a, range(6))
    log_steps(b, range(3))
    b.close("signal", 143)  # requeued: SLURM sent SIGTERM
    ship(spool, out, dead_after=60)
    assert [x["step"] for x in lines(out)] == [0, 1, 2]  # steps 3..5 wait for the requeue
    again = rank(spool, 1, 2)
    log_steps(again, range(3, 6))
    again.close(), a.close()
    ship(spool, out, dead_after=60)
    got = lines(out)
    assert [x["step"] for x in got] == list(range(6)) and all(x["complete"] for x in got)


def test_a_target_that_fails_closing_lets_the_next_shipper_in(spool: Path, out: Path) -> None:
    """close() raising still releases the lease (no renewing thread left holding it)."""
    from ranklog.shippers import Shipper
    from ranklog.shippers._lease import read_leases
    from ranklog.shippers.targets.jsonl import JsonlTarget

    class FailsClosing(JsonlTarget):
        def close(self) -> None:
            was_open = self._fd is not None
            super().close()
            if was_open:
                raise Killed("close")

    run = rank(spool, 0, 1)
    log_steps(run, range(3))
    run.close()
    with pytest.raises(Killed):
        Shipper(str(spool), FailsClosing(out), name="t", dead_after=3600).run_forever(once=True)
    assert read_leases(spool) == []
    ship(spool, out)
    assert [x["step"] for x in lines(out)] == [0, 1, 2]


def test_a_shipper_that_keeps_no_cursor_writes_none(spool: Path, out: Path) -> None:
    """``keep_cursor=False`` (a replay's scratch spool) ships every step and writes no
    cursor file; a shipper that keeps one writes it."""
    from ranklog.shippers._cursor import load_cursor

    a = rank(spool, 0, 1)
    log_steps(a, range(5))
    kept = ship(spool, out, name="kept")
    assert load_cursor(spool, "kept") is not None and kept.shipped_upto == 4
    other = out.with_name("other.jsonl")
    shipper = ship(spool, other, name="memory", keep_cursor=False)
    assert [x["step"] for x in lines(other)] == list(range(5))
    assert shipper.cursor.last_step == 4  # kept in memory, as the run went
    assert load_cursor(spool, "memory") is None
