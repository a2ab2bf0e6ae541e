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


class TestDemo:
    def test_small_demo(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The demo runs its ranks to completion and prints the inspect table."""
        assert main(["demo", "--out", str(tmp_path), "--ranks", "2", "--steps", "20"]) == 0
        out = capsys.readouterr().out
        assert "2 seen, 2 ended" in out and "0..19" in out
