"""A spool seen through a FUSE mount, written underneath: inotify is blind, polling ships."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ranklog.shippers import Shipper
from ranklog.shippers._source import SpoolSource, filesystem_of
from ranklog.shippers.targets.jsonl import JsonlTarget

from .conftest import bindfs
from .shiphelp import lines, rank

#: The kernel's attribute cache on the mount (libfuse's default, set explicitly): a
#: segment's new size can stay hidden this long after a poll, whatever the shipper does.
ATTR_TIMEOUT = 1.0
#: Room for a loaded 2-core machine between the write, the poll and the test's look.
SLACK = 1.0


@pytest.fixture
def fuse_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(directory written by producers, the same directory seen through bindfs)."""
    under, mnt = tmp_path / "under", tmp_path / "mnt"
    under.mkdir()
    mnt.mkdir()
    with bindfs(under, mnt, "-o", f"attr_timeout={ATTR_TIMEOUT:g}"):
        yield under, mnt


def test_inotify_sees_nothing_on_the_mount(fuse_mount: tuple[Path, Path]) -> None:
    """The premise: writes made underneath never reach an inotify watch on the mount."""
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    under, mnt = fuse_mount
    seen: list[str] = []

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: object) -> None:
            seen.append(repr(event))

    observer = Observer()
    observer.schedule(Handler(), str(mnt), recursive=True)
    observer.start()
    try:
        (under / "file").write_bytes(b"x" * 1000)
        time.sleep(1.0)
    finally:
        observer.stop()
        observer.join()
    assert seen == []
    assert (mnt / "file").stat().st_size == 1000


def test_polling_ships_within_poll_plus_attribute_cache(
    fuse_mount: tuple[Path, Path], tmp_path: Path
) -> None:
    """The shipper detects the FUSE mount, polls, and ships each step within one poll
    interval plus the mount's attribute-cache time (plus slack for a loaded machine)."""
    under, mnt = fuse_mount
    spool_under, spool_mnt = under / "spool", mnt / "spool"
    out = tmp_path / "out.jsonl"
    runs = [rank(spool_under, r, 2, durability="step") for r in range(2)]
    assert filesystem_of(spool_mnt).startswith("fuse")
    source = SpoolSource(spool_mnt)
    shipper = Shipper(str(spool_mnt), JsonlTarget(out), name="fuse", dead_after=60, source=source)
    assert source.polling and source.poll_interval == 1.0
    thread = threading.Thread(target=shipper.run_forever)
    thread.start()
    closed_at: dict[int, float] = {}
    seen_at: dict[int, float] = {}
    try:
        for step in range(8):
            for run in runs:
                run.log_metrics({"loss": float(step)}, step=step)
                run.step_end(step)
            closed_at[step] = time.time()
            deadline = time.time() + 5
            while step not in seen_at and time.time() < deadline:
                for x in lines(out):
                    seen_at.setdefault(x["step"], time.time())
                time.sleep(0.02)
    finally:
        for run in runs:
            run.close()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert [x["step"] for x in lines(out)] == list(range(8))
    latency = {s: seen_at[s] - closed_at[s] for s in closed_at}
    assert max(latency.values()) <= source.poll_interval + ATTR_TIMEOUT + SLACK, latency
