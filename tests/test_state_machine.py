"""A Hypothesis state machine drives writers and checks readers against a simple model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ranklog.schemas import Event, Metrics, StepEnd, Text
from ranklog.spool import IncarnationWriter, SegmentReader, SpoolLayout, ensure_run
from ranklog.spool._format import FRAME_EVENTS, crc_trailer, frame_header, msgpack_array_header

from .spoolgen import write_frame

EVENTS = st.one_of(
    st.builds(
        Metrics,
        st.floats(0, 1e9),
        st.integers(0, 10**6),
        st.dictionaries(st.text(min_size=1, max_size=8), st.floats(allow_nan=False), max_size=4),
    ),
    st.builds(StepEnd, st.floats(0, 1e9), st.integers(0, 10**6)),
    st.builds(Text, st.floats(0, 1e9), st.integers(0, 100), st.just("t"), st.text(max_size=300)),
)


class SpoolMachine(RuleBasedStateMachine):
    """Writer operations on one rank; the model is the list of frames per incarnation."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ranklog-sm-"))
        self.layout = SpoolLayout(self.dir)
        self.info = ensure_run(self.dir)
        self.writer: IncarnationWriter | None = None
        self.model: dict[int, list[list[Event]]] = {}
        self.torn: set[int] = set()  # incarnations that crashed mid-frame

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.abandon()
        shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: self.writer is None)
    @rule(small=st.booleans())
    def open_incarnation(self, small: bool) -> None:
        """Start (or restart) the rank: a new incarnation."""
        self.writer = IncarnationWriter.create(
            self.layout, self.info, 0, max_segment_bytes=2048 if small else 1 << 20
        )
        assert self.writer.incarnation not in self.model
        self.model[self.writer.incarnation] = []

    @precondition(lambda self: self.writer is not None)
    @rule(events=st.lists(EVENTS, min_size=1, max_size=5))
    def append(self, events: list[Event]) -> None:
        """Append one frame."""
        assert self.writer is not None
        write_frame(self.writer, events)
        self.model[self.writer.incarnation].append(events)

    @precondition(lambda self: self.writer is not None)
    @rule()
    def roll(self) -> None:
        """Seal the segment and continue in the next one."""
        assert self.writer is not None
        self.writer.roll()

    @precondition(lambda self: self.writer is not None)
    @rule()
    def close(self) -> None:
        """A clean close: seal, fsync."""
        assert self.writer is not None
        self.writer.close()
        self.writer = None

    @precondition(lambda self: self.writer is not None)
    @rule(events=st.lists(EVENTS, min_size=1, max_size=3), keep=st.floats(0.0, 0.99))
    def crash_mid_frame(self, events: list[Event], keep: float) -> None:
        """The process dies while writing a frame: a prefix of it reaches the file."""
        assert self.writer is not None
        from ranklog.schemas import encoder

        body = msgpack_array_header(len(events)) + b"".join(encoder.encode(e) for e in events)
        frame = frame_header(FRAME_EVENTS, 1, len(body), self.writer.seq) + body
        frame += crc_trailer(body)
        with open(self.writer.path, "ab") as f:
            f.write(frame[: int(len(frame) * keep)])
        self.torn.add(self.writer.incarnation)
        self.writer.abandon()
        self.writer = None

    @invariant()
    def readers_agree_with_model(self) -> None:
        """Reading every segment yields the model's frames; torn tails only where crashed."""
        live = self.writer.incarnation if self.writer is not None else None
        segs = self.layout.segments(0)
        got: dict[int, list[list[Event]]] = {}
        for k, seg in enumerate(segs):
            is_last = k + 1 == len(segs) or segs[k + 1].incarnation != seg.incarnation
            gone = not (seg.incarnation == live and is_last)
            res = SegmentReader(seg.path).read(0, writer_gone=gone)
            got.setdefault(seg.incarnation, []).extend(f.events for f in res.frames)
            if gone:
                assert res.pending == 0
                if res.bad:
                    assert seg.incarnation in self.torn and is_last, res.bad
                    assert res.bad[0].offset + res.bad[0].length == os.path.getsize(seg.path)
            else:
                assert res.bad == []
        assert got == {k: v for k, v in self.model.items()}


SpoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSpoolMachine = SpoolMachine.TestCase
