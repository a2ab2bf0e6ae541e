"""``--late ship``: values logged for a closed step reach the targets once, at their step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from ranklog.cli import main
from ranklog.errors import ConfigError
from ranklog.shippers import ShippedStep, Shipper, load_cursor
from ranklog.shippers.targets.jsonl import JsonlTarget, read_jsonl
from ranklog.spool import RunInfo
from ranklog.testing import crash

from .shiphelp import lines, log_steps, rank, ship


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out.jsonl"


def _late(run: Any, values: dict[str, float], step: int) -> None:
    """Log ``values`` at a step ``run`` has closed (its warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.log_metrics(values, step=step)


def _steps(out: Path) -> list[tuple[int, int | None]]:
    """(step, shipped_with) of every step line, in file order."""
    return [(x["step"], x.get("shipped_with")) for x in lines(out)]


class TestShipped:
    def test_after_the_step_their_ranks_were_in(self, spool: Path, out: Path) -> None:
        """Late values of two ranks are reduced together and follow the next step they close."""
        runs = [rank(spool, r, 2) for r in range(2)]
        for run in runs:
            log_steps(run, range(5))
        _late(runs[0], {"val/acc": 0.5}, 2)
        _late(runs[1], {"val/acc": 0.7, "val/loss": 3.0}, 2)
        for run in runs:
            log_steps(run, range(5, 7))
            run.close()
        shipper = ship(spool, out, late="ship")
        assert _steps(out) == [(0, None), (1, None), (2, None), (3, None), (4, None), (2, 5),
                               (5, None), (6, None)]  # fmt: skip
        late = lines(out)[5]
        assert late["metrics"] == pytest.approx({"val/acc": 0.6, "val/loss": 3.0})
        assert (late["ranks"], late["world_size"], late["complete"]) == (2, 2, True)
        assert list(late) == ["step", "metrics", "ranks", "world_size", "complete", "shipped_with"]
        assert "val/acc" not in lines(out)[2]["metrics"]
        assert shipper.stats.late_events == 2
        assert shipper.stats.steps_shipped == 7

    def test_by_default_they_are_only_counted(self, spool: Path, out: Path) -> None:
        """Without ``--late ship`` the same job ships no late line (the design's default)."""
        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        _late(run, {"val/acc": 0.5}, 2)
        run.close()
        assert ship(spool, out).stats.late_events == 1
        assert _steps(out) == [(0, None), (1, None), (2, None)]

    def test_after_the_last_step(self, spool: Path, out: Path) -> None:
        """Validation logged at the last step after it closed ships alone when the rank ends."""
        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        _late(run, {"val/acc": 0.5}, 2)
        ship(spool, out, late="ship")
        assert _steps(out) == [(0, None), (1, None), (2, None)]  # the rank may log step 3 yet
        run.close()
        ship(spool, out, late="ship")
        assert _steps(out) == [(0, None), (1, None), (2, None), (2, 3)]
        assert lines(out)[-1]["metrics"] == {"val/acc": 0.5}

    def test_restarted_shippers_never_ship_them_twice(self, spool: Path, out: Path) -> None:
        """Killed before its cursor commit or after: a new shipper sends each late value once."""
        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        _late(run, {"val/acc": 0.5}, 1)
        log_steps(run, range(3, 4))
        ship(spool, out, late="ship")
        (spool / "cursors" / "t.json").unlink()  # as if killed before the first commit
        _late(run, {"val/acc": 0.25}, 3)
        run.close()
        ship(spool, out, late="ship")
        ship(spool, out, late="ship")
        assert _steps(out) == [(0, None), (1, None), (2, None), (1, 3), (3, None), (3, 4)]
        cursor = load_cursor(spool, "t")
        assert cursor is not None and cursor.last_step == 4

    def test_a_relaunch_logging_its_resume_steps_again(self, spool: Path, out: Path) -> None:
        """Steps a requeued rank logs again ship as late values after its first new step."""
        first = rank(spool, 0, 1)
        log_steps(first, range(10))
        _late(first, {"val/acc": 0.5}, 9)  # then killed before closing another step
        first.flush()
        crash(first)
        second = rank(spool, 0, 1)  # resumes from a checkpoint at step 8
        for s in range(8, 12):
            second.log_metrics({"loss": 100 + s}, step=s)
            second.step_end(s)
        second.close()
        shipper = ship(spool, out, late="ship")
        got = _steps(out)
        assert got == [*((s, None) for s in range(10)), (8, 10), (9, 10), (10, None), (11, None)]
        by = {(x["step"], x.get("shipped_with")): x["metrics"] for x in lines(out)}
        assert by[(9, None)] == {"loss": pytest.approx(0.009)}  # the first closed values
        assert by[(8, 10)] == {"loss": 108.0}
        assert by[(9, 10)] == {"loss": 109.0, "val/acc": 0.5}  # the dead one's late value too
        assert shipper.stats.relogged_events == 2

    def test_released_ranks_values_stay_counted(self, spool: Path, out: Path) -> None:
        """A carrier step shipped already (its rank was released as dead) takes nothing."""
        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(a, range(3))
        log_steps(b, range(1))
        a.close()
        from .shiphelp import age

        age(spool, 1, 3600)
        ship(spool, out, late="ship", dead_after=60)
        assert [s for s, _ in _steps(out)] == [0, 1, 2]
        _late(b, {"loss": 7.0}, 0)
        log_steps(b, range(1, 2))
        b.close()
        shipper = ship(spool, out, late="ship")
        assert [s for s, w in _steps(out)] == [0, 1, 2]
        assert shipper.stats.late_events >= 1

    def test_a_cursor_of_an_older_version_ships_nothing_twice(self, spool: Path, out: Path) -> None:
        """Re-read below a cursor without the saved watermark, shipped values are not late."""
        import json

        run = rank(spool, 0, 1)
        log_steps(run, range(4))
        run.log_metrics({"loss": 4.0}, step=4)
        run.log_metrics({"loss": 5.0}, step=5)  # one frame: step 4 (shipped), step 5 (not)
        run.step_end(4)
        run.flush()
        ship(spool, out, late="ship")
        path = spool / "cursors" / "t.json"
        cursor = json.loads(path.read_text())
        for seg in cursor["segments"].values():  # as an older version wrote it
            seg.pop("closed", None)
            seg.pop("max_step", None)
        path.write_text(json.dumps(cursor))
        _late(run, {"val/acc": 0.5}, 4)
        run.step_end(5)
        run.close()
        ship(spool, out, late="ship")
        assert _steps(out) == [(0, None), (1, None), (2, None), (3, None), (4, None), (4, 5),
                               (5, None)]  # fmt: skip
        assert lines(out)[-2]["metrics"] == {"val/acc": 0.5}  # not loss 4.0 a second time

    def test_unknown_policy_is_refused(self, spool: Path, out: Path) -> None:
        """A policy other than count or ship is a ConfigError naming the choices."""
        with pytest.raises(ConfigError, match="count, ship"):
            Shipper(str(spool), JsonlTarget(out), name="t", late="drop")


class TestCommandLine:
    def test_ship_and_replay_agree(self, spool: Path, tmp_path: Path) -> None:
        """``ranklog ship --late ship`` and ``ranklog replay --late ship`` write the same JSONL."""
        run = rank(spool, 0, 1)
        log_steps(run, range(4))
        _late(run, {"val/acc": 0.5}, 3)
        run.close()
        live, again = tmp_path / "live.jsonl", tmp_path / "again.jsonl"
        assert main(["ship", str(spool), "--to", f"jsonl:{live}", "--once", "--quiet",
                     "--late", "ship"]) == 0  # fmt: skip
        assert main(["compact", str(spool), "--out", str(tmp_path / "pq")]) == 0
        assert main(["replay", str(tmp_path / "pq"), "--to", f"jsonl:{again}",
                     "--late", "ship"]) == 0  # fmt: skip
        assert live.read_bytes() == again.read_bytes()
        assert [x.get("shipped_with") for x in read_jsonl(live) if "step" in x][-1] == 4


def _shipped(step: int, carrier: int | None = None, **metrics: float) -> ShippedStep:
    return ShippedStep(step, dict(metrics), 1, 1, True, 1.0, carrier=carrier)


RUN = RunInfo(run_id="ab" * 16, created=1_700_000_000.0, name="exp")


class TestTornJsonl:
    #: own 10; late 5 and 7 with own 12; late 8 with 13, which holds nothing of its own
    BATCH = (_shipped(10, x=1.0), _shipped(12, x=2.0), _shipped(5, 12, v=3.0),
             _shipped(7, 12, v=4.0), _shipped(8, 13, v=5.0))  # fmt: skip

    def test_late_lines_come_before_the_line_that_ends_their_group(self, tmp_path: Path) -> None:
        """Late lines, then the carrier's own line, or ``{"shipped_with": T}`` if it has none."""
        target = JsonlTarget(tmp_path / "o.jsonl")
        target.open(RUN)
        target.write(list(self.BATCH))
        target.close()
        got = [
            (x.get("step"), x.get("shipped_with"))
            for x in read_jsonl(tmp_path / "o.jsonl")
            if "ranklog" not in x
        ]
        assert got == [(10, None), (5, 12), (7, 12), (12, None), (8, 13), (None, 13)]

    def test_every_tear_leaves_whole_groups(self, tmp_path: Path) -> None:
        """Torn at any byte, open() cuts an incomplete group and reports what is whole."""
        path = tmp_path / "o.jsonl"
        target = JsonlTarget(path)
        target.open(RUN)
        target.write(list(self.BATCH))
        target.close()
        full = path.read_bytes()
        ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]  # the run line first
        whole = {ends[0]: None, ends[1]: 10, ends[4]: 12, ends[6]: 13}  # a group (or 10) ends
        for cut in range(len(full) + 1):
            path.write_bytes(full[:cut])
            held = JsonlTarget(path).open(RUN)
            kept = max((e for e in whole if e <= cut), default=0)
            assert (held.last, path.stat().st_size) == (whole.get(kept), kept), cut


class TestAhead:
    """A value logged for a step ahead of the one a rank is in closes nothing before it."""

    def _job(self, spool: Path, *, end: bool = True) -> Any:
        run = rank(spool, 0, 1)
        run.log_metrics({"x": 0.0}, step=0)
        run.step_end(0)
        with pytest.warns(Warning, match=r"'eval/y' for step 1000 ahead of step 1"):
            run.log_metrics({"y": 9.0}, step=1000, prefix="eval")  # (known ahead at step 1)
            for s in range(1, 10):
                run.log_metrics({"x": float(s)}, step=s)
                run.step_end(s)
        run.flush()
        if end:
            run.close()
        return run

    def test_steps_before_it_ship_as_they_close(self, spool: Path, tmp_path: Path) -> None:
        """Steps 1..9 ship as step_end closes them; step 1000 once the rank ends; each once."""
        run = self._job(spool, end=False)
        out = tmp_path / "o.jsonl"
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(10))  # 1000 still open
        run.close()
        ship(spool, out)
        got = lines(out)
        assert [x["step"] for x in got] == [*range(10), 1000]
        assert got[-1]["metrics"]["eval/y"] == 9.0  # (partial: no step_end ever closed it)
        assert all(x["metrics"] == {"x": float(x["step"])} for x in got[:-1])

    def test_live_and_replay_agree(self, spool: Path, tmp_path: Path) -> None:
        """Replay (on columns and event by event) ships what live shipping shipped."""
        from ranklog.archive import compact, replay

        self._job(spool)
        live = tmp_path / "live.jsonl"
        shipper = ship(spool, live)
        assert shipper.stats.late_events == 0
        compact(spool, tmp_path / "pq")
        again = tmp_path / "again.jsonl"
        replay(tmp_path / "pq", JsonlTarget(again))
        assert again.read_bytes() == live.read_bytes()
        windowed = tmp_path / "win.jsonl"
        replay(tmp_path / "pq", JsonlTarget(windowed), steps=(0, 2000))  # the event path
        assert [x["step"] for x in lines(windowed)] == [*range(10), 1000]
