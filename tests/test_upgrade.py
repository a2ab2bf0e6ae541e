"""A spool, its cursors, targets and dataset written by the previous release, carried on
by this one (tests/data/release-7f7cb21, written by its make.py with that release).

How an upgrade could break, and what the test tries: the old cursors are named after
the spec as typed; this release names them after what the target writes to and renames
each — a copy left beside (the old name still committed to) would give two cursors per
target, an epilogue that exits 2 and a ``compact --delete`` that keeps shipped segments
for ever. The job is requeued with this release, shipped to the same targets, the
epilogue run, then ``compact --delete`` and a replay: one cursor per target, every step
once, every shipped segment deleted, replay equal to live. A kill between writing the
renamed cursor and removing the old file leaves both: the next start removes the old
one (the new one is ahead of it). A hostile cursor in the spool is the epilogue's
module's attack (tests/test_epilogue.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ranklog
from ranklog.archive import replay
from ranklog.shippers.targets.jsonl import JsonlTarget

from .conftest import python_env
from .shiphelp import lines

DATA = Path(__file__).parent / "data" / "release-7f7cb21"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", *args], cwd=cwd, env=python_env(),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_an_upgrade_keeps_one_cursor_per_target(tmp_path: Path) -> None:
    """Old spool and cursors, requeued with today's code: two cursors for two targets, the
    epilogue exits 0; the old dataset (layout 1) is refused, named, a new one is written,
    compact --delete deletes every shipped segment, replay == live."""
    here = tmp_path / "job"
    shutil.copytree(DATA, here)
    spool = here / "spool"
    for r in (0, 1):  # the job requeued
        with ranklog.init(spool, rank=r, world_size=2, handle_signals=False) as run:
            for s in range(5, 10):
                run.log_metrics({"loss": r + s / 10}, step=s)
                run.step_end(s)
    for spec in ("jsonl:out/a.jsonl", "jsonl:out/b.jsonl"):
        res = _cli("ship", "spool", "--once", "--quiet", "--to", spec, cwd=here)
        assert res.returncode == 0, res.stderr
    cursors = sorted((spool / "cursors").glob("*.json"))
    assert len(cursors) == 2, [p.name for p in cursors]
    assert all(json.loads(p.read_text())["name"] == p.stem for p in cursors)
    res = _cli("ship", str(spool), "--once", "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for name in ("a", "b"):
        assert [x["step"] for x in lines(here / "out" / f"{name}.jsonl")] == list(range(10))
    res = _cli("compact", str(spool), "--out", str(here / "dataset"), "--delete", cwd=here)
    assert res.returncode == 2 and "layout 1" in res.stderr and "new directory" in res.stderr
    assert list((spool / "ranks").glob("*/*.rlog"))  # nothing deleted
    res = _cli("compact", str(spool), "--out", str(here / "dataset2"), "--delete", cwd=here)
    assert res.returncode == 0, res.stderr
    assert not list((spool / "ranks").glob("*/*.rlog"))
    again = tmp_path / "replay.jsonl"
    replay(here / "dataset2", JsonlTarget(again))
    assert lines(again) == lines(here / "out" / "a.jsonl")


def test_a_rename_killed_before_the_old_file_went_leaves_one_cursor(tmp_path: Path) -> None:
    """The old cursor written under its new name, then a kill before the old file was
    removed: the next start removes it (one cursor, the steps shipped once)."""
    here = tmp_path / "job"
    shutil.copytree(DATA, here)
    spool = here / "spool"
    cursors = spool / "cursors"
    old = next(p for p in cursors.glob("*.json") if "out/a.jsonl" in p.read_text())
    res = _cli("ship", "spool", "--once", "--quiet", "--to", "jsonl:out/a.jsonl", cwd=here)
    assert res.returncode == 0, res.stderr
    new = next(p for p in cursors.glob("*.json") if json.loads(p.read_text())["name"] == p.stem
               and "a.jsonl" in json.loads(p.read_text()).get("identity", ""))  # fmt: skip
    old.write_bytes((DATA / "spool" / "cursors" / old.name).read_bytes())  # as if killed
    with ranklog.init(spool, rank=0, world_size=2, handle_signals=False) as run:
        run.log_metrics({"loss": 9.0}, step=5)
        run.step_end(5)
    res = _cli("ship", "spool", "--once", "--quiet", "--to", "jsonl:out/a.jsonl",
               "--dead-after", "0", cwd=here)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert not old.exists() and new.exists()
    assert [x["step"] for x in lines(here / "out" / "a.jsonl")] == list(range(6))
