"""Incarnation numbers never repeat, deleted segments included.

A restart of a rank is a new incarnation, numbered above every incarnation the spool
ever held for that rank. How this could break, and what each test tries:

- a requeue after ``compact --delete`` removed every segment of the rank: the listing
  of the rank directory is empty, so the number must come from ``deleted.json``; a
  reused number is skipped by every shipper whose cursor holds it as done (steps lost,
  exit 0) — the new steps must ship, compact and replay once;
- ``compact --delete`` killed between its record and the unlink, or running while the
  rank starts: it records a segment in
  ``deleted.json`` before it removes it, and the writer reads ``deleted.json`` after
  listing, so a segment gone from the listing is in the record;
- a ``deleted.json`` cut short or garbage (the spool is shared): the segment keys it
  still shows count; a number too high costs nothing, a reused one loses steps;
- an older release's ``deleted.json`` (version 1: segment -> dataset) counts the same;
- another rank's deletions do not move this rank's numbers;
- a hostile number (``4294967295``, which no segment header holds) in ``deleted.json`` or
  a file named like a segment in the rank directory: not followed, the rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import ranklog
from ranklog.archive import compact, replay
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import SpoolLayout, deleted_segments

from .shiphelp import lines, ship


def _steps(spool: Path, world: int, steps: range) -> None:
    for r in range(world):
        with ranklog.init(spool, rank=r, world_size=world, handle_signals=False,
                          max_segment_bytes=4096, flush_interval=3600) as run:  # fmt: skip
            for s in steps:
                run.log_metrics({"loss": r + s / 1000}, step=s)
                run.step_end(s)


def test_requeue_after_delete_ships_compacts_and_replays_every_new_step(tmp_path: Path) -> None:
    """Steps a rank logs after compact --delete removed all its segments ship, compact and
    replay once each (its new incarnation is not a number the cursor holds as done)."""
    spool, live, ds = tmp_path / "spool", tmp_path / "live.jsonl", tmp_path / "ds"
    _steps(spool, 2, range(100))
    ship(spool, live)
    res = compact(spool, ds, delete=True)
    layout = SpoolLayout(spool)
    assert res.deleted and not layout.segments(0) and not layout.segments(1)
    _steps(spool, 2, range(100, 150))  # the job requeued
    assert {s.incarnation for s in layout.segments(0)} == {2}
    ship(spool, live)
    got = [x["step"] for x in lines(live)]
    assert got == list(range(150))
    assert lines(live)[149]["metrics"]["loss"] == (0.149 + 1.149) / 2
    compact(spool, ds)
    again = tmp_path / "replay.jsonl"
    replay(ds, JsonlTarget(again))
    assert lines(again) == lines(live)


def test_a_damaged_deleted_json_still_numbers_above_what_it_shows(tmp_path: Path) -> None:
    """A deleted.json cut short: the keys it still shows count, the rank never reuses one."""
    spool = tmp_path / "spool"
    _steps(spool, 1, range(40))
    ship(spool, tmp_path / "o.jsonl")
    compact(spool, tmp_path / "ds", delete=True)
    layout = SpoolLayout(spool)
    raw = layout.deleted_json.read_bytes()
    highest = max(d.segment.incarnation for d in deleted_segments(spool))
    layout.deleted_json.write_bytes(raw[: len(raw) - 40])  # cut short: no longer JSON
    _steps(spool, 1, range(40, 45))
    assert {s.incarnation for s in layout.segments(0)} == {highest + 1}


def test_an_older_releases_deleted_json_counts(tmp_path: Path) -> None:
    """Version 1 of deleted.json (segment key -> dataset) numbers the restart above it;
    another rank's entries do not."""
    spool = tmp_path / "spool"
    _steps(spool, 1, range(2))
    layout = SpoolLayout(spool)
    body = {"segments": {"00000/0007-000001": "/data/ds", "00001/0042-000001": "/data/ds"}}
    layout.deleted_json.write_text(json.dumps(body))
    _steps(spool, 1, range(2, 4))
    assert [s.incarnation for s in layout.segments(0)] == [1, 8]


def test_delete_killed_between_its_record_and_the_unlink(tmp_path: Path) -> None:
    """compact --delete killed after deleted.json names a segment but before the file goes:
    the restart numbers above it, the segment is still shipped and compacted once, and a
    later --delete removes it."""
    from ranklog.spool import SegmentId, record_deleted

    spool, live, ds = tmp_path / "spool", tmp_path / "live.jsonl", tmp_path / "ds"
    _steps(spool, 1, range(30))
    compact(spool, ds)
    layout = SpoolLayout(spool)
    first = layout.segments(0)[0]
    record_deleted(spool, ds, [(SegmentId(0, 1, first.segment), [(0, 29)])])  # then killed
    _steps(spool, 1, range(30, 40))
    assert {s.incarnation for s in layout.segments(0)} == {1, 2}
    ship(spool, live)
    assert [x["step"] for x in lines(live)] == list(range(40))
    compact(spool, ds, delete=True)
    again = tmp_path / "replay.jsonl"
    replay(ds, JsonlTarget(again))
    assert lines(again) == lines(live)


def test_a_hostile_number_in_deleted_json_or_the_listing_is_not_followed(tmp_path: Path) -> None:
    """deleted.json (or a file in the rank directory) naming incarnation 4294967295, which
    no segment header can hold: the rank starts, numbered from what ranklog wrote."""
    spool = tmp_path / "spool"
    _steps(spool, 1, range(2))
    layout = SpoolLayout(spool)
    body = {"segments": {"00000/4294967295-000001": "/x", "00000/0003-000001": "/x"}}
    layout.deleted_json.write_text(json.dumps(body))
    (layout.rank_dir(0) / "99999999999-000001.rlog").write_bytes(b"not ours")
    _steps(spool, 1, range(2, 4))
    assert [s.incarnation for s in layout.segments(0)][:2] == [1, 4]
