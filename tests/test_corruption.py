"""Corrupt segments: the reader never raises, yields exactly the intact frames, reports the rest."""

from __future__ import annotations

import random
import struct
import tracemalloc
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ranklog.schemas import Event
from ranklog.spool import HEADER_SIZE, SegmentReader, SpoolLayout
from ranklog.spool._format import MAX_FRAME_BYTES, SYNC

from .spoolgen import write_segment

FRAMES = 8


def _segment(spool: Path, *, seal: bool = True) -> tuple[bytes, list[list[Event]], list[int]]:
    """Bytes of a segment with FRAMES frames, their events, and each frame's start offset."""
    _, written = write_segment(spool, FRAMES, seal=seal)
    (seg,) = SpoolLayout(spool).segments(0)
    data = seg.path.read_bytes()
    res = SegmentReader(seg.path).read()
    return data, written, [f.offset for f in res.frames] + [res.frames[-1].end]


def _read(path: Path, data: bytes, *, gone: bool) -> tuple[list[list[Event]], SegmentReader]:
    path.write_bytes(data)
    reader = SegmentReader(path)
    res = reader.read(0, writer_gone=gone)
    _read.last = res  # type: ignore[attr-defined]
    return [f.events for f in res.frames], reader


class TestTruncation:
    def test_every_offset_of_the_last_frames(self, spool: Path, tmp_path: Path) -> None:
        """A tail cut at any byte is pending while the writer lives, reported once it is gone."""
        data, written, starts = _segment(spool, seal=False)
        path = tmp_path / "t.rlog"
        for cut in range(starts[FRAMES - 3], len(data) + 1):
            complete = sum(1 for end in starts[1:] if end <= cut)
            frames, _ = _read(path, data[:cut], gone=False)
            res = _read.last  # type: ignore[attr-defined]
            assert frames == written[:complete], cut
            assert res.bad == [] and res.end + res.pending == cut
            frames, _ = _read(path, data[:cut], gone=True)
            res = _read.last  # type: ignore[attr-defined]
            assert frames == written[:complete]
            if cut > starts[complete]:
                (bad,) = res.bad
                assert (bad.offset, bad.length) == (starts[complete], cut - starts[complete])
                assert bad.path == str(path)
            else:
                assert res.bad == []
            assert res.pending == 0 and res.end == cut

    def test_truncated_header(self, spool: Path, tmp_path: Path) -> None:
        """A file shorter than its header waits while the writer lives, else is reported."""
        data, _, _ = _segment(spool)
        path = tmp_path / "h.rlog"
        for cut in range(HEADER_SIZE):
            frames, reader = _read(path, data[:cut], gone=False)
            assert frames == [] and _read.last.bad == []  # type: ignore[attr-defined]
            frames, reader = _read(path, data[:cut], gone=True)
            assert frames == [] and reader.header is None
            assert _read.last.bad[0].offset == 0  # type: ignore[attr-defined]


class TestDamage:
    def test_bit_flips(self, spool: Path, tmp_path: Path) -> None:
        """A flipped bit loses only the frame it hit; the damage is reported at that frame."""
        data, written, starts = _segment(spool)
        path = tmp_path / "f.rlog"
        rng = random.Random(1234)
        for _ in range(400):
            pos = rng.randrange(HEADER_SIZE, starts[-1])
            hit = max(i for i in range(FRAMES) if starts[i] <= pos)
            damaged = bytearray(data)
            damaged[pos] ^= 1 << rng.randrange(8)
            for gone in (True, False):
                frames, _ = _read(path, bytes(damaged), gone=gone)
                res = _read.last  # type: ignore[attr-defined]
                assert frames == written[:hit] + written[hit + 1 :], (pos, gone)
                (bad,) = res.bad
                assert bad.offset == starts[hit] and bad.length == starts[hit + 1] - starts[hit]
                assert res.sealed

    def test_header_flip_keeps_frames(self, spool: Path, tmp_path: Path) -> None:
        """A damaged segment header is reported; the frames after it are still read."""
        data, written, _ = _segment(spool)
        damaged = bytearray(data)
        damaged[20] ^= 0xFF
        frames, reader = _read(tmp_path / "x.rlog", bytes(damaged), gone=True)
        assert frames == written
        assert reader.header is None and reader.header_error == "header checksum mismatch"

    def test_zero_filled_hole(self, spool: Path, tmp_path: Path) -> None:
        """A hole of zeros over frames 2-4 loses exactly those; the reader resumes after it."""
        data, written, starts = _segment(spool)
        damaged = data[: starts[2]] + bytes(starts[5] - starts[2]) + data[starts[5] :]
        frames, _ = _read(tmp_path / "z.rlog", damaged, gone=False)
        res = _read.last  # type: ignore[attr-defined]
        assert frames == written[:2] + written[5:]
        assert [(b.offset, b.length) for b in res.bad] == [(starts[2], starts[5] - starts[2])]

    def test_zero_tail_is_pending_while_writer_lives(self, spool: Path, tmp_path: Path) -> None:
        """Zeros at the end (an NFS client's unflushed pages) are waited for, not skipped."""
        data, written, _starts = _segment(spool, seal=False)
        padded = data + bytes(4096)
        frames, _ = _read(tmp_path / "p.rlog", padded, gone=False)
        res = _read.last  # type: ignore[attr-defined]
        assert frames == written and res.bad == [] and res.pending == 4096

    def test_huge_length_is_never_allocated(self, spool: Path, tmp_path: Path) -> None:
        """Frame headers claiming huge lengths are rejected or waited on, never allocated."""
        data, written, _starts = _segment(spool, seal=False)
        for length in (MAX_FRAME_BYTES, MAX_FRAME_BYTES + 1, 0xFFFFFFFF):
            head = struct.pack("<4sBBHIQ", SYNC, 1, 0, 1, length, 99)
            forged = head + struct.pack("<I", zlib.crc32(head))
            tracemalloc.start()
            frames, _ = _read(tmp_path / "l.rlog", data + forged + b"\0" * 100, gone=True)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert frames == written
            assert peak < 2 * len(data) + (1 << 20)
            assert _read.last.bad[0].offset == len(data)  # type: ignore[attr-defined]

    def test_garbage_file(self, tmp_path: Path) -> None:
        """A file of random bytes yields nothing and is reported whole."""
        rng = random.Random(7)
        junk = bytes(rng.randrange(256) for _ in range(50_000))
        frames, reader = _read(tmp_path / "g.rlog", junk, gone=True)
        assert frames == [] and reader.header is None
        res = _read.last  # type: ignore[attr-defined]
        assert res.bad[0].offset == 0 and sum(b.length for b in res.bad) == len(junk)

    def test_bytes_after_seal(self, spool: Path, tmp_path: Path) -> None:
        """Bytes after a seal frame are reported; the frames before it stand."""
        data, written, _ = _segment(spool)
        frames, _ = _read(tmp_path / "s.rlog", data + b"trailing", gone=False)
        assert frames == written
        assert _read.last.bad[0].reason == "bytes after seal"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[list[Event]]]:
    """One sealed segment's bytes and events, shared by the property test."""
    data, written, _ = _segment(tmp_path_factory.mktemp("pristine") / "spool")
    return data, written


class TestArbitraryDamage:
    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        edits=st.lists(
            st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=64)), max_size=6
        ),
        cut=st.integers(0, 10_000),
        gone=st.booleans(),
    )
    def test_never_raises_and_never_invents(
        self,
        tmp_path: Path,
        pristine: tuple[bytes, list[list[Event]]],
        edits: list[tuple[int, bytes]],
        cut: int,
        gone: bool,
    ) -> None:
        """Any overwrite and truncation: no exception, and every frame read is an original one."""
        data, written = pristine
        damaged = bytearray(data)
        for pos, blob in edits:
            pos %= len(damaged)
            damaged[pos : pos + len(blob)] = blob
        damaged = damaged[: len(damaged) - cut % len(damaged)]
        frames, _ = _read(tmp_path / "a.rlog", bytes(damaged), gone=gone)
        assert all(f in written for f in frames)
        res = _read.last  # type: ignore[attr-defined]
        covered = sum(b.length for b in res.bad)
        assert covered <= len(damaged)


@pytest.mark.parametrize("gone", [True, False])
def test_reader_reports_path_and_offset(spool: Path, tmp_path: Path, gone: bool) -> None:
    """Every reported range names the file and an offset inside it."""
    data, _, starts = _segment(spool)
    damaged = bytearray(data)
    damaged[starts[3] + 30] ^= 0x10
    path = tmp_path / "r.rlog"
    _read(path, bytes(damaged), gone=gone)
    (bad,) = _read.last.bad  # type: ignore[attr-defined]
    assert str(bad).startswith(f"{path}: ") and f"offset {starts[3]}" in str(bad)
