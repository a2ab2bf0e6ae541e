"""The ``ranklog`` command: inspect and demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ranklog
from ranklog.cli import main

from .spoolgen import write_segment


def _job(spool: Path) -> None:
    for rank in range(2):
        with ranklog.init(spool, rank=rank, world_size=3, handle_signals=False) as run:
            for step in range(5):
                run.log_metrics({"loss": 1.0}, step=step)
                run.step_end(step)
            run.step_end(2)  # a late step_end, reported as late
    # rank 2 never closes: killed mid-run
    run = ranklog.init(spool, rank=2, world_size=3, handle_signals=False)
    run.log_metrics({"loss": 1.0}, step=0)
    run.step_end(0)
    run._sink.flush()
    run._sink.abandon()  # as if SIGKILLed


class TestInspect:
    def test_json(self, spool: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--json lists every incarnation with steps, end status and damage."""
        with pytest.warns(ranklog.RanklogWarning):
            _job(spool)
        assert main(["inspect", str(spool), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        incs = {i["rank"]: i for i in out["incarnations"]}
        assert out["world_size"] == 3 and sorted(incs) == [0, 1, 2]
        assert incs[0]["first_step"] == 0 and incs[0]["last_step"] == 4
        assert incs[0]["end_status"] == "ok" and incs[0]["state"] == "ended (ok)"
        assert incs[2]["end_status"] is None and incs[2]["state"] == "open"
        assert out["bad"] == []

    def test_table_reports_damage_with_path_and_offset(
        self, spool: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The table names each damaged file and offset."""
        write_segment(spool, 5)
        seg = next((spool / "ranks" / "00000").iterdir())
        data = bytearray(seg.read_bytes())
        data[200] ^= 0xFF
        seg.write_bytes(bytes(data))
        assert main(["inspect", str(spool)]) == 0
        out = capsys.readouterr().out
        assert "damage  1 bad ranges" in out and f"{seg}: " in out and "at offset" in out

    def test_missing_spool(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A path that is not a directory exits 2 with a message."""
        assert main(["inspect", str(tmp_path / "nope")]) == 2
        assert "not a directory" in capsys.readouterr().err


class TestShipAndInspect:
    def test_ship_once_then_inspect_shows_the_cursor(
        self, spool: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`ranklog ship --once` drains what is ready; inspect shows last step and lag."""
        a = ranklog.init(spool, rank=0, world_size=2, handle_signals=False)
        b = ranklog.init(spool, rank=1, world_size=2, handle_signals=False)
        for step in range(6):
            a.log_metrics({"loss": 1.0}, step=step)
            a.step_end(step)
        for step in range(3):
            b.log_metrics({"loss": 3.0}, step=step)
            b.step_end(step)
        out = tmp_path / "o.jsonl"
        assert main(["ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet"]) == 0
        assert len(out.read_text().splitlines()) == 3
        capsys.readouterr()
        assert main(["inspect", str(spool), "--json"]) == 0
        (sh,) = json.loads(capsys.readouterr().out)["shippers"]
        assert sh["target"] == f"jsonl:{out}" and sh["last_step"] == 2
        assert sh["lag_steps"] == 3 and sh["lag_bytes"] > 0
        a.close(), b.close()

    def test_several_targets_one_process_each(self, spool: Path, tmp_path: Path) -> None:
        """Two --to targets ship independently, each with its own cursor."""
        with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
            for step in range(4):
                run.log_metrics({"loss": 1.0}, step=step)
                run.step_end(step)
        a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        argv = ["ship", str(spool), "--to", f"jsonl:{a}", "--to", f"jsonl:{b}", "--once"]
        assert main([*argv, "--quiet"]) == 0
        assert a.read_text() == b.read_text() and len(a.read_text().splitlines()) == 4
        assert len(list((spool / "cursors").glob("*.json"))) == 2

    def test_unknown_target(self, spool: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown target kind exits 2 naming the kinds there are."""
        ranklog.init(spool, rank=0, handle_signals=False).close()
        assert main(["ship", str(spool), "--to", "carrier-pigeon:x", "--once"]) == 2
        assert "jsonl:" in capsys.readouterr().err


class TestDemo:
    def test_small_demo(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The demo runs its ranks to completion and prints the inspect table."""
        assert main(["demo", "--out", str(tmp_path), "--ranks", "2", "--steps", "20"]) == 0
        out = capsys.readouterr().out
        assert "2 seen, 2 ended" in out and "0..19" in out
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 21  # params + 20
        assert (tmp_path / "report.html").stat().st_size > 10_000
        assert (tmp_path / "parquet" / "_manifest.json").is_file()
        for opener in ("tensorboard --logdir", "mlflow ui --backend-store-uri", "wandb sync"):
            assert opener in out
