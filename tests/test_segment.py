"""Segment writer and reader: framing, roll-over, seals, incarnations, run.json."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from ranklog.schemas import StepEnd
from ranklog.spool import (
    HEADER_SIZE,
    IncarnationWriter,
    SegmentReader,
    SpoolLayout,
    ensure_run,
    read_run,
    read_segment,
)
from ranklog.spool._format import MAX_FRAME_BYTES

from .spoolgen import step_events, write_frame, write_segment


class TestWriterReader:
    def test_round_trip(self, spool: Path) -> None:
        """Frames come back in order, with sequence numbers and the seal."""
        _writer, written = write_segment(spool, 20, rank=3)
        (seg,) = SpoolLayout(spool).segments(3)
        res = read_segment(seg.path)
        assert [f.events for f in res.frames] == written
        assert [f.seq for f in res.frames] == list(range(20))
        assert res.sealed and res.seal is not None and res.seal["reason"] == "close"
        assert res.bad == [] and res.pending == 0

    def test_header_is_identity(self, spool: Path) -> None:
        """The header names run, rank, incarnation and segment, whatever the path."""
        write_segment(spool, 1, rank=5)
        (seg,) = SpoolLayout(spool).segments(5)
        moved = spool / "elsewhere.bin"
        os.rename(seg.path, moved)
        reader = SegmentReader(moved)
        reader.read()
        assert reader.header is not None
        assert (reader.header.rank, reader.header.incarnation, reader.header.segment) == (5, 1, 1)
        assert reader.header.run_id == read_run(spool).run_id

    def test_incremental_reads(self, spool: Path) -> None:
        """Reading from the returned offset yields only new frames."""
        info = ensure_run(spool)
        writer = IncarnationWriter.create(SpoolLayout(spool), info, 0)
        reader = SegmentReader(writer.path)
        write_frame(writer, step_events(0))
        first = reader.read(0)
        assert len(first.frames) == 1
        write_frame(writer, step_events(1))
        write_frame(writer, step_events(2))
        second = reader.read(first.end)
        assert [f.events for f in second.frames] == [step_events(1), step_events(2)]
        assert reader.read(second.end).frames == []
        writer.close()
        last = reader.read(second.end)
        assert last.sealed and last.frames == []

    def test_reads_with_a_limit_read_each_byte_about_once(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reads of at most ``max_bytes`` read little past it: a frame cut by a buffer's
        end is read again whole, not with a chunk of the segment after it."""
        _writer, written = write_segment(spool, 2_000)
        (seg,) = SpoolLayout(spool).segments(0)
        size = seg.path.stat().st_size
        read_bytes = 0
        real = os.pread

        def counting(fd: int, n: int, offset: int) -> bytes:
            nonlocal read_bytes
            data = real(fd, n, offset)
            read_bytes += len(data)
            return data

        monkeypatch.setattr(os, "pread", counting)
        reader, offset, frames = SegmentReader(seg.path), 0, []
        while True:
            res = reader.read(offset, max_bytes=1_000)  # a dozen frames each
            frames += res.frames
            if res.sealed:
                break
            offset = res.end
        assert [f.events for f in frames] == written
        assert read_bytes < 2 * size

    def test_roll_over(self, spool: Path) -> None:
        """Past the size limit a segment is sealed and the next one continues the sequence."""
        _, written = write_segment(spool, 200, max_segment_bytes=4096)
        segs = SpoolLayout(spool).segments(0)
        assert len(segs) > 3
        seqs, events = [], []
        for n, seg in enumerate(segs, start=1):
            assert seg.segment == n and seg.path.stat().st_size <= 4096
            res = read_segment(seg.path)
            assert res.sealed and res.bad == []
            assert res.seal is not None
            assert res.seal["reason"] == ("close" if n == len(segs) else "roll")
            seqs += [f.seq for f in res.frames]
            events += [f.events for f in res.frames]
        assert events == written
        assert len(seqs) == 200 and seqs == sorted(set(seqs))  # seals take numbers too

    def test_incarnations_never_share_a_file(self, spool: Path) -> None:
        """A restarted rank writes a new incarnation, never into an old file."""
        write_segment(spool, 2, rank=1)
        write_segment(spool, 2, rank=1, seal=False)
        write_segment(spool, 2, rank=1)
        incs = [s.incarnation for s in SpoolLayout(spool).segments(1)]
        assert incs == [1, 2, 3]

    def test_file_modes(self, spool: Path) -> None:
        """Segments are created 0640 and directories 0750 (under the umask)."""
        old = os.umask(0o022)
        try:
            write_segment(spool, 1)
        finally:
            os.umask(old)
        (seg,) = SpoolLayout(spool).segments(0)
        assert stat.S_IMODE(seg.path.stat().st_mode) == 0o640
        assert stat.S_IMODE(seg.path.parent.stat().st_mode) == 0o750

    def test_frame_cap_enforced_on_write(self, spool: Path) -> None:
        """A frame over the cap is refused by the writer, nothing is written."""
        info = ensure_run(spool)
        writer = IncarnationWriter.create(SpoolLayout(spool), info, 0)
        with pytest.raises(Exception, match="cap"):
            writer.write_events(1, [b"\x91", b"\0" * (MAX_FRAME_BYTES + 1)])
        assert writer.path.stat().st_size == HEADER_SIZE
        writer.close()

    def test_symlink_is_not_followed(self, spool: Path, tmp_path: Path) -> None:
        """A symlink in a rank directory is listed as a stray, and refused when opened."""
        write_segment(spool, 1)
        outside = tmp_path / "outside.rlog"
        outside.write_bytes(b"secret")
        link = SpoolLayout(spool).rank_dir(0) / "0009-000001.rlog"
        link.symlink_to(outside)
        layout = SpoolLayout(spool)
        assert [s.incarnation for s in layout.segments(0)] == [1]
        assert link in layout.strays(0)
        res = SegmentReader(link).read()
        assert res.frames == [] and "symbolic link" in res.bad[0].reason


def _ensure(args: tuple[str, int]) -> str:
    return ensure_run(args[0], name=f"n{args[1]}").run_id


def _ensure_without_links(args: tuple[str, int]) -> str:
    """:func:`_ensure` on a file system whose link() fails with EPERM (some FUSE, SMB)."""

    def no_link(*_: object, **__: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    os.link = no_link
    return _ensure(args)


class TestRunJson:
    def test_created_once_and_agreed(self, spool: Path) -> None:
        """Many processes racing to create run.json all read the same run id."""
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(8) as pool:
            ids = pool.map(_ensure, [(str(spool), i) for i in range(16)])
        assert len(set(ids)) == 1
        assert json.loads((spool / "run.json").read_text())["run_id"] == ids[0]
        assert [p.name for p in spool.iterdir() if p.name.startswith(".run.json")] == []

    def test_created_once_without_hard_links(self, spool: Path) -> None:
        """Where link() is refused, an exclusive create still gives every rank one run id."""
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(8) as pool:
            ids = pool.map(_ensure_without_links, [(str(spool), i) for i in range(16)])
        assert len(set(ids)) == 1
        assert json.loads((spool / "run.json").read_text())["run_id"] == ids[0]
        assert [p.name for p in spool.iterdir() if p.name.startswith(".run.json")] == []

    def test_damaged_run_json_names_the_file(self, spool: Path) -> None:
        """A damaged run.json raises an error naming its path."""
        spool.mkdir()
        (spool / "run.json").write_text("{not json")
        with pytest.raises(Exception, match=r"run\.json"):
            read_run(spool)


def test_step_events_helper_is_stable() -> None:
    """The generator used by these tests closes the step it logs."""
    assert step_events(4)[-1] == StepEnd(1004.5, 4)
