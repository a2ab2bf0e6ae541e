"""docs/analysis.md's DuckDB and Polars queries, and ranklog.analysis, on a generated dataset."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ranklog.analysis import metric_band, rank_divergence, slowest_rank
from ranklog.archive import compact
from ranklog.errors import ArchiveError

from .conftest import ROOT
from .shiphelp import rank

RANKS, STEPS = 4, 10


def _loss(r: int, s: int) -> float:
    return s + r + (10.0 if r == 3 else 0.0)  # rank 3 drifts away


def _step_time(r: int, s: int) -> float:
    return 1.0 + (0.5 if r == 2 else 0.1 * r)  # rank 2 is the straggler


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("analysis")
    spool = base / "spool"
    for r in range(RANKS):
        run = rank(spool, r, RANKS)
        for s in range(STEPS):
            run.log_metrics({"loss": _loss(r, s) - 1}, step=s, prefix="train")  # two calls per
            run.log_metrics({"loss": _loss(r, s) + 1}, step=s, prefix="train")  # step: mean
            run.log_timing("step_time", _step_time(r, s), step=s)
            run.step_end(s)
        run.close()
    compact(spool, base / "pq")
    return base / "pq"


def _queries() -> dict[str, str]:
    text = (ROOT / "docs" / "analysis.md").read_text()
    found = re.findall(r"<!-- query: (\w+) -->\n```\w+\n(.*?)```", text, re.S)
    return dict(found)


def test_readme_has_the_queries() -> None:
    """docs/analysis.md shows the band, slowest-rank and divergence queries, and the Polars ones."""
    assert set(_queries()) == {"band", "slowest", "divergence", "polars", "shown"}


class TestDuckDB:
    def _run(self, name: str, dataset: Path) -> list[tuple[object, ...]]:
        import duckdb

        sql = _queries()[name].replace("DIR", str(dataset))
        return duckdb.sql(sql).fetchall()

    def test_band(self, dataset: Path) -> None:
        """Mean, min and max across ranks per step."""
        rows = self._run("band", dataset)
        assert len(rows) == STEPS
        step, mean, lo, hi, ranks = rows[3]
        assert (step, ranks) == (3, RANKS)
        assert mean == pytest.approx(sum(_loss(r, 3) for r in range(RANKS)) / RANKS)
        assert (lo, hi) == (pytest.approx(3.0), pytest.approx(3 + 3 + 10.0))

    def test_slowest(self, dataset: Path) -> None:
        """The straggler is found at every step, with its lead over the median."""
        rows = self._run("slowest", dataset)
        assert {r[1] for r in rows} == {2} and rows[0][2] == pytest.approx(1.5)
        assert rows[0][4] == pytest.approx(1.5 / 1.2)  # median of 1.0, 1.1, 1.3, 1.5

    def test_shown(self, dataset: Path) -> None:
        """The loss curve as shipped, from the steps table: the mean over ranks and calls."""
        rows = self._run("shown", dataset)
        assert [r[0] for r in rows] == list(range(STEPS))
        assert rows[3][1] == pytest.approx(sum(_loss(r, 3) for r in range(RANKS)) / RANKS)

    def test_divergence(self, dataset: Path) -> None:
        """The drifting rank comes first."""
        rows = self._run("divergence", dataset)
        assert rows[0][0] == 3 and rows[0][1] == pytest.approx(13 - (0 + 1 + 2 + 13) / 4)


class TestPolars:
    def test_queries(self, dataset: Path) -> None:
        """The Polars version gives the same answers."""
        scope: dict[str, object] = {}
        exec(_queries()["polars"].replace("DIR", str(dataset)), scope)  # docs/analysis.md
        band, slowest, divergence = scope["band"], scope["slowest"], scope["divergence"]
        assert band["lo"].to_list()[3] == pytest.approx(3.0)  # type: ignore[index]
        assert set(slowest["slowest_rank"].to_list()) == {2}  # type: ignore[index]
        assert divergence["rank"].to_list()[0] == 3  # type: ignore[index]


class TestAnalysisModule:
    def test_functions(self, dataset: Path) -> None:
        """metric_band, slowest_rank and rank_divergence agree with the queries."""
        band = metric_band(dataset, "train/loss").to_pylist()
        assert band[3]["min"] == pytest.approx(3.0) and band[3]["ranks"] == RANKS
        slow = slowest_rank(dataset).to_pylist()
        assert {r["slowest_rank"] for r in slow} == {2}
        assert slow[0]["seconds"] == pytest.approx(1.5)
        div = rank_divergence(dataset, "train/loss").to_pylist()
        assert div[0]["rank"] == 3

    def test_shipped_is_the_shown_query(self, dataset: Path) -> None:
        """analysis.shipped gives the docs' query's values, with ranks and completeness;
        a name it lacks is named with close ones; a dataset without the table says the
        command that writes it."""
        from ranklog import analysis
        from ranklog.errors import ConfigError

        got = analysis.shipped(dataset, "train/loss").to_pylist()
        assert [(r["step"], r["ranks"], r["complete"]) for r in got] == [
            (s, RANKS, True) for s in range(STEPS)]  # fmt: skip
        assert got[3]["value"] == pytest.approx(TestDuckDB()._run("shown", dataset)[3][1])
        with pytest.raises(ConfigError, match="train/loss"):
            analysis.shipped(dataset, "train/los")

    def test_missing_table(self, tmp_path: Path) -> None:
        """A dataset without the table says which one is missing."""
        with pytest.raises(ArchiveError, match="timers"):
            slowest_rank(tmp_path)


class TestUnknownNames:
    """A name the dataset does not hold is an error naming what it holds, never an empty
    table that reads as "no data"."""

    def test_a_typo_names_close_matches(self, dataset: Path) -> None:
        """``train/los``: ConfigError naming ``train/loss``."""
        from ranklog.errors import ConfigError

        with pytest.raises(ConfigError, match=r"no metrics named 'train/los'.*'train/loss'"):
            metric_band(dataset, "train/los")

    def test_a_timer_as_backends_show_it_says_where_it_is(self, dataset: Path) -> None:
        """``timing/step_time`` (TensorBoard's and MLflow's name): says to ask the timers."""
        from ranklog.errors import ConfigError

        with pytest.raises(ConfigError, match=r"timer 'step_time'.*timers"):
            metric_band(dataset, "timing/step_time")
