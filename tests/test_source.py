"""Discovery and tailing: filesystem detection, racy directory mtimes, growth probes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ranklog.shippers._source import SpoolSource, filesystem_of, is_network_fs

from .spoolgen import write_segment


class TestFilesystem:
    def test_longest_mount_wins(self, tmp_path: Path) -> None:
        """The type is that of the deepest mount point holding the path."""
        mounts = tmp_path / "mounts"
        mounts.write_text(
            "/dev/vda / ext4 rw 0 0\n"
            "server:/export /nfs nfs4 rw,actimeo=1 0 0\n"
            "lustre@tcp:/fs /nfs/scratch lustre rw 0 0\n"
            "bindfs /mnt/with\\040space fuse rw 0 0\n"
        )
        assert filesystem_of("/nfs/runs/exp1", str(mounts)) == "nfs4"
        assert filesystem_of("/nfs/scratch/x", str(mounts)) == "lustre"
        assert filesystem_of("/nfsother", str(mounts)) == "ext4"
        assert filesystem_of("/mnt/with space/s", str(mounts)) == "fuse"

    @pytest.mark.parametrize(
        ("fstype", "network"),
        [("nfs", True), ("nfs4", True), ("lustre", True), ("gpfs", True), ("cifs", True),
         ("fuse.sshfs", True), ("fuse", True), ("ext4", False), ("xfs", False), ("tmpfs", False)],
    )  # fmt: skip
    def test_network_types(self, fstype: str, network: bool) -> None:
        """NFS, Lustre, GPFS, CIFS and FUSE are polled; local filesystems are watched."""
        assert is_network_fs(fstype) is network

    def test_poll_flag_forces_polling(self, spool: Path) -> None:
        """--poll makes a local spool polled too."""
        write_segment(spool, 1)
        assert SpoolSource(spool, poll=0.5).polling
        assert not SpoolSource(spool).polling  # this machine's /tmp is local


class TestDiscovery:
    def test_file_created_in_the_same_clock_tick(self, spool: Path) -> None:
        """A segment created within the directory's mtime tick is still discovered."""
        write_segment(spool, 1, rank=0)
        source = SpoolSource(spool)
        assert len(source.discover()) == 1
        rank_dir = spool / "ranks" / "00000"
        st = os.stat(rank_dir)
        write_segment(spool, 1, rank=0)  # a new incarnation, same directory
        os.utime(rank_dir, ns=(st.st_atime_ns, st.st_mtime_ns))  # same coarse mtime
        found = source.discover()
        assert [s.name.incarnation for s in found] == [2]

    def test_quiet_directories_are_not_listed_again(self, spool: Path) -> None:
        """Directories unchanged for over a second are not listed on every poll."""
        write_segment(spool, 1, rank=0)
        old = os.stat(spool / "ranks").st_mtime - 10
        for d in (spool / "ranks", spool / "ranks" / "00000"):
            os.utime(d, (old, old))
        source = SpoolSource(spool)
        source.discover()
        calls = []
        real = source.layout.segments
        source.layout.segments = lambda r: calls.append(r) or real(r)  # type: ignore[method-assign]
        assert source.discover() == [] and calls == []

    def test_probe_sees_growth(self, spool: Path) -> None:
        """probe() reports a segment with bytes beyond what was read."""
        write_segment(spool, 3)
        source = SpoolSource(spool)
        (seg,) = source.discover()
        assert source.probe(seg) and seg.size > 0
        seg.offset = seg.size
        assert not source.probe(seg)


def test_an_empty_rank_directory_is_watched(spool: Path) -> None:
    """A rank directory left empty (crash between mkdir and create) is listed again later."""
    write_segment(spool, 1, rank=0)
    (spool / "ranks" / "00001").mkdir()
    old = os.stat(spool / "ranks").st_mtime - 10
    source = SpoolSource(spool)
    os.utime(spool / "ranks", (old, old))
    source.discover()
    source.discover()
    write_segment(spool, 1, rank=1)
    os.utime(spool / "ranks", (old, old))  # the ranks directory itself did not change
    assert [s.name.rank for s in source.discover()] == [1]
