"""A segment's identity as a typed value, and the one place its text forms are made and parsed.

A segment is named by (rank, incarnation, segment). Three text forms exist, each
with one use::

    key       00003/0001-000001        shippers' cursors, ``ranklog inspect``
    stem      00003-0001-000001        compacted Parquet file names, the dataset manifest
    filename  0001-000001.rlog         the file inside ``SPOOL/ranks/00003/``

and an incarnation is keyed ``3/1`` (rank/incarnation) where a run's incarnations
are listed (the manifest's marks).
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

from ranklog.errors import SpoolFormatError

__all__ = ["SegmentId"]

_TEXT: Final = re.compile(r"^(\d{5,})[/-](\d{4,})-(\d{6,})")


class SegmentId(NamedTuple):
    """(rank, incarnation, segment): sorts in write order within a rank."""

    rank: int
    incarnation: int
    segment: int

    @property
    def key(self) -> str:
        """``00003/0001-000001``: the key of a cursor's segment entry."""
        return f"{self.rank:05d}/{self.incarnation:04d}-{self.segment:06d}"

    @property
    def stem(self) -> str:
        """``00003-0001-000001``: the start of the segment's Parquet file names."""
        return f"{self.rank:05d}-{self.incarnation:04d}-{self.segment:06d}"

    @property
    def filename(self) -> str:
        """``0001-000001.rlog``: the file's name in its rank directory."""
        return f"{self.incarnation:04d}-{self.segment:06d}.rlog"

    @property
    def incarnation_key(self) -> str:
        """``3/1``: the key of the segment's incarnation."""
        return f"{self.rank}/{self.incarnation}"

    @classmethod
    def parse(cls, text: str) -> SegmentId:
        """The id in a key, a stem, or a name starting with a stem.

        :class:`~ranklog.errors.SpoolFormatError` when ``text`` names no segment.
        """
        m = _TEXT.match(text)
        if m is None:
            raise SpoolFormatError(f"{text!r} does not name a segment (expected 00003/0001-000001)")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)))
