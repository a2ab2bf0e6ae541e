"""Tables (``Run.log_table``, NeMo's ``wandb.Table``): checked when logged, shipped per rank."""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ranklog.errors import InvalidValueError
from ranklog.schemas import Table
from ranklog.shippers.targets._media import rank_tags, table_markdown
from ranklog.shippers.targets.console import ConsoleTarget
from ranklog.testing import read_events

from .shiphelp import lines, live_and_replayed, rank, ship

COLUMNS = ["prompt", "score", "ok"]


def table_spool(spool: Path) -> None:
    """Two ranks: both log ``val/results`` at step 1, rank 1 alone ``val/only`` at step 2."""
    for r in range(2):
        run = rank(spool, r, 2)
        for s in range(3):
            run.log_metrics({"loss": r + s / 10}, step=s)
            if s == 1:
                rows = [[f"rank {r} | q", 0.5 + r, True], ["two\nlines", None, False]]
                run.log_table("val/results", COLUMNS, rows, step=s)
            if s == 2 and r == 1:
                run.log_table("val/only", ["n"], [[np.int64(7)], [math.nan]], step=s)
            run.step_end(s)
        run.close()


class TestLogTable:
    def test_cells_are_kept_with_their_types(self, spool: Path) -> None:
        """Strings, ints, floats, bools and None are kept; numpy scalars become Python's."""
        run = rank(spool, 0, 1)
        rows = [("x", np.float32(0.5)), [np.int64(3), None], [np.str_("s"), np.float64(0.25)],
                [np.bool_(True), np.array([2.0])]]  # fmt: skip
        run.log_table("t", ("a", "b"), rows, step=0)
        run.close()
        (table,) = [e for e in read_events(spool) if isinstance(e, Table)]
        assert (table.step, table.name, table.columns) == (0, "t", ["a", "b"])
        assert table.rows == [["x", 0.5], [3, None], ["s", 0.25], [True, 2.0]]
        assert [type(c) for row in table.rows for c in row] == [
            str,
            float,
            int,
            type(None),
            str,
            float,
            bool,
            float,
        ]

    @pytest.mark.parametrize(
        ("columns", "rows", "message"),
        [
            (["a", "b"], [["x"]], "table 'bad': row 0 must be a list of 2 cells"),
            (["a"], [[object()]], "table 'bad': row 0, column 'a': expected a str, number"),
            (["a", 1], [], "table 'bad': column 1 must be a str, got int"),
            (["a", "a"], [], "column names repeat"),
            ("ab", [], "columns must be a list of str"),
            (["a"], "rows", "rows must be a list of rows"),
            (["a"], [["ok"], [np.zeros(3)]], "row 1, column 'a'"),
            (["a"], [[2**70]], "row 0, column 'a': the integer .* does not fit in 64 bits"),
        ],
    )
    def test_bad_tables_name_the_table_and_cell(
        self, spool: Path, columns: Any, rows: Any, message: str
    ) -> None:
        """A bad table raises naming the table, row and column; nothing of it is logged."""
        run = rank(spool, 0, 1)
        with pytest.raises(InvalidValueError, match=message.replace("|", r"\|")):
            run.log_table("bad", columns, rows, step=0)
        run.close()
        assert not [e for e in read_events(spool) if isinstance(e, Table)]


class TestShipped:
    def test_jsonl_has_every_ranks_table_in_rank_order(self, spool: Path, tmp_path: Path) -> None:
        """Each step's tables are listed per rank, cells as logged (NaN as JSON's NaN)."""
        table_spool(spool)
        out = tmp_path / "out.jsonl"
        ship(spool, out)
        got = {x["step"]: x.get("tables") for x in lines(out)}
        assert got[0] is None
        assert got[1] == [
            {"rank": r, "name": "val/results", "columns": COLUMNS,
             "rows": [[f"rank {r} | q", 0.5 + r, True], ["two\nlines", None, False]]}
            for r in range(2)
        ]  # fmt: skip
        (only,) = got[2]
        assert only["rank"] == 1 and only["rows"][0] == [7] and math.isnan(only["rows"][1][0])

    def test_console_names_each_table(self, spool: Path) -> None:
        """The console target prints one line per table: its name, rank and shape."""
        from ranklog.shippers import Shipper

        table_spool(spool)
        buf = io.StringIO()
        Shipper(str(spool), ConsoleTarget(stream=buf), name="c", dead_after=3600,
                start_grace=0).run_forever(once=True)  # fmt: skip
        text = buf.getvalue()
        assert "table val/results (rank 1): 2 rows x 3 columns (prompt, score, ok)" in text
        assert "table val/only (rank 1): 2 rows x 1 columns (n)" in text

    def test_replay_gives_the_same_tables(self, spool: Path, tmp_path: Path) -> None:
        """Compacted to Parquet and replayed, the tables ship byte for byte as live."""
        table_spool(spool)
        live, again = live_and_replayed(spool, tmp_path)
        assert live.read_bytes() == again.read_bytes()
        import pyarrow.parquet as pq

        t = pq.read_table(tmp_path / "pq" / "tables")
        assert sorted(t.column("name").to_pylist()) == ["val/only", "val/results", "val/results"]


class TestForms:
    def test_markdown_escapes_pipes_and_newlines(self) -> None:
        """A cell's ``|`` and newline cannot break TensorBoard's Markdown table."""
        from ranklog.shippers import TableItem

        md = table_markdown(TableItem(0, "t", ["a|b", "c"], [["x|y", "1\n2"], [None, 3]]))
        assert md.splitlines() == ["| a\\|b | c |", "|---|---|", "| x\\|y | 1<br>2 |", "|  | 3 |"]

    def test_shared_names_get_a_rank_suffix(self) -> None:
        """Ranks that share a table name get ``name/rankNNNNN``; a name of one rank stays."""
        from ranklog.shippers import TableItem

        items = [TableItem(0, "t", [], []), TableItem(3, "t", [], []), TableItem(3, "u", [], [])]
        assert rank_tags(items) == ["t/rank00000", "t/rank00003", "u"]


class TestNemo:
    def test_wandb_table_becomes_a_table(self, tmp_path: Path) -> None:
        """NeMo's ``wandb.Table`` of JSON results is shipped as a table under its full name."""
        import wandb

        from ranklog import nemo

        from .test_nemo import no_backends

        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        full = wandb.Table(data=[['{"a":1}'], ['{"b":2}']], columns=["Full result"])
        logger.log_metrics({"agent/full_result": full, "reward": 1.0}, 0, prefix="train")
        logger.finish()
        (table,) = [e for e in read_events(tmp_path / "spool") if isinstance(e, Table)]
        assert (table.name, table.columns) == ("train/agent/full_result", ["Full result"])
        assert table.rows == [['{"a":1}'], ['{"b":2}']]

    def test_table_with_media_is_skipped_once(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A table whose cells ranklog cannot carry is skipped with one warning naming it."""
        from ranklog import nemo

        from .test_nemo import no_backends

        # a wandb.Table holding media, as far as ranklog can tell
        media = type("Table", (), {"columns": ["img"], "data": [[object()]]})
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, "ranklog.nemo"):
            for step in range(2):
                logger.log_metrics({"media": media(), "x": 1.0}, step)
        logger.finish()
        warned = [r.getMessage() for r in caplog.records if "'media'" in r.getMessage()]
        assert len(warned) == 1 and "row 0, column 'img'" in warned[0]
        assert not [e for e in read_events(tmp_path / "spool") if isinstance(e, Table)]
