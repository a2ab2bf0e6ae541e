"""A target that lost steps its cursor counts as shipped (deleted, moved, rolled back).

How it could break, and the test of each: the file deleted and the spool shipped again
(the cursor says done: nothing would be sent, exit 0); the file cut short (its last steps
gone); the dataset deleted and compacted again (its steps table would hold only the end);
a target that cannot say what it holds (the console) taken for one that lost everything.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ranklog.archive import compact, replay
from ranklog.shippers.targets.jsonl import JsonlTarget

from .conftest import python_env
from .shiphelp import log_steps, rank, ship


def _ship(spool: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--once", "--quiet"]
    for t in targets:
        cmd += ["--to", t]
    return subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def _job(spool: Path) -> None:
    for r in range(2):
        log_steps(rank(spool, r, 2), range(6))


def test_a_deleted_file_is_refused_then_shipped_again_once_told(
    spool: Path, tmp_path: Path
) -> None:
    """The JSONL deleted, the spool shipped again: refused in one line naming the cursor to
    remove (exit 5), nothing written; once it is removed, every step is written, once."""
    _job(spool)
    out = tmp_path / "out.jsonl"
    assert _ship(spool, f"jsonl:{out}").returncode == 0
    first = out.read_bytes()
    out.unlink()
    done = _ship(spool, f"jsonl:{out}")
    assert done.returncode == 5, done.stderr
    assert "6 fewer steps" in done.stderr and "cursors" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert out.read_bytes().count(b'"step"') == 0
    (cursor,) = (spool / "cursors").glob("*.json")
    assert str(cursor) in done.stderr
    cursor.unlink()
    assert _ship(spool, f"jsonl:{out}").returncode == 0
    assert out.read_bytes() == first


def test_a_file_cut_short_is_refused(spool: Path, tmp_path: Path) -> None:
    """The JSONL's last two steps cut off: refused, naming how many are missing."""
    _job(spool)
    out = tmp_path / "out.jsonl"
    assert _ship(spool, f"jsonl:{out}").returncode == 0
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:-2]))
    done = _ship(spool, f"jsonl:{out}")
    assert done.returncode == 5 and "2 fewer steps" in done.stderr, done.stderr


def test_the_console_is_not_taken_for_a_target_that_lost_everything(spool: Path) -> None:
    """The console holds nothing it can report: shipping to it again is no refusal."""
    _job(spool)
    assert _ship(spool, "console").returncode == 0
    assert _ship(spool, "console").returncode == 0


def test_a_dataset_deleted_and_compacted_again_has_its_steps(spool: Path, tmp_path: Path) -> None:
    """The dataset removed and compacted again: its steps table holds every step again
    (compaction's cursor was of a table that is gone), and replays as live shipped."""
    _job(spool)
    compact(spool, tmp_path / "pq")
    shutil.rmtree(tmp_path / "pq")
    assert compact(spool, tmp_path / "pq").steps == (6, 5)
    ship(spool, tmp_path / "live.jsonl")
    replay(tmp_path / "pq", JsonlTarget(tmp_path / "again.jsonl"))
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "live.jsonl").read_bytes()


def test_a_plug_in_that_says_none_holds_none(spool: Path, tmp_path: Path) -> None:
    """docs/targets.md's CSV example returns None for "holds none": its file deleted after
    shipping, the next ship is refused (TargetHeldError), not a silent nothing."""
    import pytest

    from ranklog.errors import TargetHeldError

    from .example_target.csv_target import CsvTarget

    _job(spool)
    out = tmp_path / "out.csv"
    ship_to(spool, CsvTarget(out, ";"))
    out.unlink()
    with pytest.raises(TargetHeldError, match="6 fewer steps"):
        ship_to(spool, CsvTarget(out, ";"))


def test_a_target_that_cannot_tell_is_not_refused(spool: Path, tmp_path: Path) -> None:
    """A target with ``held_known = False`` (it cannot say what it holds) is shipped to
    again without a refusal."""
    from .example_target.csv_target import CsvTarget

    class Forgetful(CsvTarget):
        held_known = False

    _job(spool)
    out = tmp_path / "out.csv"
    ship_to(spool, Forgetful(out, ";"))
    out.unlink()
    ship_to(spool, Forgetful(out, ";"))


def ship_to(spool: Path, target: object) -> None:
    from ranklog.shippers import Shipper

    Shipper(str(spool), target, name="t", dead_after=3600,  # type: ignore[arg-type]
            start_grace=0).run_forever(once=True)  # fmt: skip


def test_no_false_refusal_for_per_rank_wandb_or_left_out_steps(spool: Path, tmp_path: Path) -> None:
    """Targets whose holding is no measure of what they were sent ship again without a
    refusal: W&B offline --per-rank with a rank that stopped early (it holds what every
    run holds), and SwanLab given --leave-out texts (a step of a text alone goes out
    empty, and SwanLab records no empty step)."""
    import os

    from ranklog.shippers import Shipper

    from .shiphelp import age, build_target

    os.environ.setdefault("WANDB_SILENT", "true")
    runs = [rank(spool, r, 2) for r in range(2)]
    for s in range(3):
        for r, run in enumerate(runs):
            run.log_metrics({"loss": s + r / 4}, step=s)
            if s == 1:
                run.log_text("sample", "hello", step=s)
            run.step_end(s)
    runs[1].flush()
    for s in range(3, 6):
        runs[0].log_text("sample", "only text", step=s)
        runs[0].step_end(s)
    runs[0].close()
    age(spool, 1, 600)
    cases = [("wandb", "proj", {"mode": "offline", "dir": str(tmp_path / "wb"),
                                "per_rank": True}),
             ("swanlab", "proj", {"dir": str(tmp_path / "sw"), "leave_out": "texts"})]  # fmt: skip
    for kind, arg, opts in cases:
        for _ in range(2):
            target = build_target(kind, arg, spool, opts)
            Shipper(str(spool), target, name=kind, dead_after=60, start_grace=0,
                    per_rank=bool(opts.get("per_rank"))).run_forever(once=True)  # fmt: skip
