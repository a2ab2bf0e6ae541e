"""One compaction at a time per dataset, and parts visible only complete.

How this could break, and what each test tries:

- two ``compact`` runs at once (a cron job overlapping the epilogue's): each lists,
  writes and removes parts the other does not know of — the second is refused in one
  line naming the holder (exit 3), nothing written;
- a run paused (SIGSTOP) after writing a part but before its manifest, another run
  meanwhile, then the first resumed and a third run: the paused run keeps its flock,
  so the second is refused, and the dataset holds every value exactly once;
- a run killed (SIGKILL) at any instant: the kernel drops the lock, the next run takes
  it, removes what the dead one left unlisted and reads back every value once;
- a lock file that is garbage or names a process long gone (the dataset is shared):
  only the flock decides; its text is only shown;
- a damaged part (cut short, overwritten): every command that reads the dataset says
  which file in one line (exit 4), never a pyarrow traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import ranklog
from ranklog.archive import compact
from ranklog.errors import LeaseHeldError

from .conftest import python_env


def _job(spool: Path, ranks: int = 4, steps: int = 400, metrics: int = 25) -> int:
    for r in range(ranks):
        with ranklog.init(spool, rank=r, world_size=ranks, handle_signals=False,
                          flush_interval=3600) as run:  # fmt: skip
            for s in range(steps):
                run.log_metrics({f"m{i}": float(r * s + i) for i in range(metrics)}, step=s)
                run.step_end(s)
    return ranks * steps * metrics


def _compact(spool: Path, ds: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ranklog.cli", "compact", str(spool), "--out", str(ds)],
        env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _metric_rows(ds: Path) -> int:
    files = sorted((ds / "metrics").glob("*.parquet"))
    return sum(pq.read_metadata(f).num_rows for f in files)


def test_a_second_compaction_is_refused_naming_the_holder(tmp_path: Path) -> None:
    """While one run holds the dataset, another is refused (LeaseHeldError: exit 3) with
    the holder's pid, and writes nothing."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    from ranklog.archive._lock import DatasetLock

    _job(spool, ranks=1, steps=5, metrics=2)
    ds.mkdir()
    with DatasetLock(ds), pytest.raises(LeaseHeldError, match=f"pid {os.getpid()} on "):
        compact(spool, ds)
    assert not (ds / "_manifest.json").exists()
    compact(spool, ds)  # released: the next run goes on
    assert _metric_rows(ds) == 10


def test_paused_compaction_then_another_then_resumed_keeps_values_once(tmp_path: Path) -> None:
    """A compact paused (SIGSTOP) once it writes a part: a second is refused (exit 3, one
    line); the first resumed and a third run leave every value once in the files."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    values = _job(spool)
    first = _compact(spool, ds)
    try:
        deadline = time.monotonic() + 60
        while not any(ds.glob("metrics/*part-*")) and first.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        os.kill(first.pid, signal.SIGSTOP)
        second = _compact(spool, ds)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 3, err
        assert f"pid {first.pid}" in err and len(err.strip().splitlines()) == 1, err
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    third = _compact(spool, ds)
    third.communicate(timeout=120)
    assert third.returncode == 0
    assert _metric_rows(ds) == values


def test_a_killed_compaction_leaves_the_lock_to_the_next(tmp_path: Path) -> None:
    """SIGKILL mid-run: the kernel drops the flock; the next run compacts every value once."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    values = _job(spool)
    first = _compact(spool, ds)
    deadline = time.monotonic() + 60
    while not any(ds.glob("metrics/*part-*")) and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    first.kill()
    first.communicate()
    (ds / ".compact.lock").write_text('{"host": "elsewhere", "pid": 1}')  # stale text: shown only
    compact(spool, ds)
    assert _metric_rows(ds) == values


def test_a_damaged_part_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A part cut short: compact and replay each say which file, in one line (exit 4)."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    _job(spool, ranks=2, steps=20, metrics=3)
    compact(spool, ds)
    part = sorted((ds / "metrics").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:-100])
    env = python_env()
    for args in (["compact", str(spool), "--out", str(ds)],
                 ["replay", str(ds), "--to", f"jsonl:{tmp_path / 'r.jsonl'}"],
                 ["report", str(ds), "--out", str(tmp_path / "r.html")]):  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "ranklog.cli", *args], env=env,
                           capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert p.returncode == 4, p.stderr
        assert str(part) in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_repair_rewrites_a_damaged_file_from_the_spool(tmp_path: Path) -> None:
    """A file cut short: ``compact --repair`` rewrites what it held from the segments (the
    damaged one moved aside), and replay then gives what live shipping gave."""
    from ranklog.archive import replay
    from ranklog.shippers.targets.jsonl import JsonlTarget

    from .shiphelp import lines, ship

    spool, ds = tmp_path / "spool", tmp_path / "ds"
    values = _job(spool, ranks=3, steps=60, metrics=4)
    compact(spool, ds)
    _job(spool, ranks=3, steps=0, metrics=0)  # (a requeue that logged nothing)
    live = tmp_path / "live.jsonl"
    ship(spool, live)
    victim = sorted((ds / "metrics").glob("*.parquet"))[-1]
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])
    res = compact(spool, ds, repair=True)
    assert res.repaired == [f"metrics/{victim.name}"]
    assert (ds / ".damaged" / "metrics" / victim.name).is_file()
    assert _metric_rows(ds) == values
    again = tmp_path / "again.jsonl"
    replay(ds, JsonlTarget(again))
    assert lines(again) == lines(live)


def test_repair_refuses_when_the_segment_is_gone(tmp_path: Path) -> None:
    """A damaged part holding rows of deleted segments: one line naming the file and a
    segment, exit 4, nothing changed."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    _job(spool, ranks=2, steps=20, metrics=3)
    compact(spool, ds, delete=True, force=True)
    part = sorted((ds / "metrics").glob("part-*.parquet"))[0]
    cut = part.read_bytes()[:-100]
    part.write_bytes(cut)
    p = subprocess.run([sys.executable, "-m", "ranklog.cli", "compact", str(spool), "--out",
                        str(ds), "--repair"], env=python_env(), capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert p.returncode == 4, p.stderr
    assert str(part) in p.stderr and "no longer in the spool" in p.stderr, p.stderr
    assert part.read_bytes() == cut


def test_compactions_racing_during_a_live_job(tmp_path: Path) -> None:
    """Pairs of ``compact`` started at once, round after round, while ranks write: each
    ends 0 or is refused (exit 3, one line), never a traceback; at the end the dataset
    holds every value once."""
    import threading

    spool, ds = tmp_path / "spool", tmp_path / "ds"
    runs = [ranklog.init(spool, rank=r, world_size=2, handle_signals=False,
                         flush_interval=0.05) for r in range(2)]  # fmt: skip
    stop = threading.Event()
    logged = [0]

    def train() -> None:
        s = 0
        while not stop.is_set():
            for run in runs:
                run.log_metrics({f"m{i}": float(s + i) for i in range(20)}, step=s)
                run.step_end(s)
            logged[0] += 40
            s += 1
            time.sleep(0.001)

    t = threading.Thread(target=train)
    t.start()
    try:
        for _ in range(6):
            pair = [_compact(spool, ds) for _ in range(2)]
            for p in pair:
                _, err = p.communicate(timeout=120)
                assert p.returncode in (0, 3), err
                assert "Traceback" not in err, err
                if p.returncode == 3:
                    assert "another compaction" in err and len(err.strip().splitlines()) == 1
    finally:
        stop.set()
        t.join()
        for run in runs:
            run.close()
    compact(spool, ds)
    assert _metric_rows(ds) == logged[0]


def test_repair_of_a_merged_part_writes_each_row_once(tmp_path: Path) -> None:
    """One segment compacted ten times while it grows, its parts merged into one holding
    several of its pieces side by side; that part cut short: the repair writes its rows
    once (adjacent damaged pieces are one run), replay ships each step once."""
    from ranklog.archive import replay
    from ranklog.shippers.targets.jsonl import JsonlTarget

    from .shiphelp import lines

    spool, ds = tmp_path / "spool", tmp_path / "ds"
    run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False, flush_interval=3600)
    step = 0
    for _ in range(10):
        for _ in range(5):
            run.log_metrics({"m": float(step)}, step=step)
            run.step_end(step)
            step += 1
        run.flush()
        compact(spool, ds)
    run.close()
    compact(spool, ds)
    victim = max((ds / "metrics").glob("*.parquet"), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert compact(spool, ds, repair=True).repaired == [f"metrics/{victim.name}"]
    assert _metric_rows(ds) == step
    out = tmp_path / "r.jsonl"
    replay(ds, JsonlTarget(out))
    assert [x["step"] for x in lines(out)] == list(range(step))


def test_repair_of_a_missing_file_and_after_a_killed_repair(tmp_path: Path) -> None:
    """A part file removed (what the refusal's message sends the user to repair, and what
    a repair killed after moving it aside leaves): --repair rewrites it."""
    spool, ds = tmp_path / "spool", tmp_path / "ds"
    values = _job(spool, ranks=2, steps=30, metrics=3)
    compact(spool, ds)
    part = sorted((ds / "metrics").glob("part-*.parquet"))[0]
    part.unlink()
    with pytest.raises(Exception, match="missing"):
        compact(spool, ds)
    assert compact(spool, ds, repair=True).repaired == [f"metrics/{part.name}"]
    assert _metric_rows(ds) == values
