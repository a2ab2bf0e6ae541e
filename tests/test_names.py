"""Names that meet: a derived name (``m/max``, ``timing/t``) and one logged as such both ship."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from ranklog.archive import compact, replay
from ranklog.cli import main
from ranklog.errors import InvalidValueError, RanklogWarning
from ranklog.shippers.targets.jsonl import JsonlTarget

from .shiphelp import lines, rank, ship


class TestNamesMeet:
    def test_a_metric_with_several_ops_and_one_named_like_its_output(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """``m`` (mean, max) and ``m/max`` on its own: both values ship, warned at log time."""
        run = rank(spool, 0, 1)
        run.log_metrics({"m": 1.0}, step=0, reduce=("mean", "max"))
        with pytest.warns(RanklogWarning, match=r"'m/max' and also derives it"):
            run.log_metrics({"m/max": 5.0}, step=0)
        run.step_end(0)
        run.close()
        out = tmp_path / "o.jsonl"
        ship(spool, out)
        (step,) = lines(out)
        assert step["metrics"] == {"m/max": 5.0, "m/max.derived": 1.0, "m/mean": 1.0}

    def test_a_spec_of_several_ops_checks_each_name_it_meets(self, spool: Path) -> None:
        """``"mean,max"`` used before (its check cached): a name new to it is still checked,
        also one logged before with another spec."""
        run = rank(spool, 0, 1)
        run.log_metrics({"a": 1.0, "m/max": 5.0, "k/max": 2.0}, step=0, reduce="mean,max")
        run.log_metrics({"k": 1.0}, step=0)  # "k" with the usual mean: nothing derived
        with pytest.warns(RanklogWarning, match=r"'m/max' and also derives it"):
            run.log_metrics({"a": 2.0, "m": 1.0}, step=1, reduce="mean,max")
        with pytest.warns(RanklogWarning, match=r"'k/max' and also derives it"):
            run.log_metrics({"k": 1.0}, step=1, reduce="mean,max")
        run.close()

    def test_a_timer_and_a_metric_of_its_name(self, spool: Path, tmp_path: Path) -> None:
        """A timer ``t`` and a metric ``timing/t``: the metric keeps its name, the timer's
        value ships as ``timing/t.derived``."""
        run = rank(spool, 0, 1)
        run.log_timing("t", 0.25, step=0)
        with pytest.warns(RanklogWarning, match="'timing/t'"):
            run.log_metrics({"timing/t": 7.0}, step=0)
        run.step_end(0)
        run.close()
        out = tmp_path / "o.jsonl"
        ship(spool, out)
        (step,) = lines(out)
        assert step["metrics"]["timing/t"] == 7.0
        assert step["metrics"]["timing/t.derived"] == 0.25

    def test_across_ranks_the_shipper_says_and_counts(
        self,
        spool: Path,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Rank 0 derives ``x/max``, rank 1 logs it: no rank can see it; the shipper says it
        once, counts it in the cursor and inspect, and live and replay ship the same."""
        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        for s in range(3):
            a.log_metrics({"x": 1.0 + s}, step=s, reduce="mean,max")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # rank 1 alone sees no clash
                b.log_metrics({"x/max": 10.0 + s}, step=s)
            a.step_end(s)
            b.step_end(s)
        a.close()
        b.close()
        out = tmp_path / "o.jsonl"
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            shipper = ship(spool, out)
        said = [r.getMessage() for r in caplog.records if "x/max" in r.getMessage()]
        assert len(said) == 1 and "'x/max.derived'" in said[0]  # once, for three steps
        got = [x["metrics"] for x in lines(out)]
        assert [m["x/max"] for m in got] == [10.0, 11.0, 12.0]
        assert [m["x/max.derived"] for m in got] == [1.0, 2.0, 3.0]
        assert shipper.cursor.name_collisions == 3
        capsys.readouterr()
        assert main(["inspect", str(spool), "--json"]) == 0
        (sh,) = json.loads(capsys.readouterr().out)["shippers"]
        assert sh["name_collisions"] == 3
        compact(spool, tmp_path / "pq")
        again = tmp_path / "again.jsonl"
        replay(tmp_path / "pq", JsonlTarget(again))
        assert again.read_bytes() == out.read_bytes()

    def test_ranklog_names_are_refused(self, spool: Path) -> None:
        """``ranklog/...`` names are ranklog's own: refused at the call, naming the key."""
        run = rank(spool, 0, 1)
        with pytest.raises(InvalidValueError, match="'ranklog/ranks_reporting'"):
            run.log_metrics({"ranks_reporting": 1.0}, step=0, prefix="ranklog")
        run.close()
