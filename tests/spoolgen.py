"""Writing spools with known contents, for tests."""

from __future__ import annotations

from pathlib import Path

from ranklog.schemas import Event, Metrics, StepEnd, encoder
from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run
from ranklog.spool._format import msgpack_array_header


def write_frame(writer: IncarnationWriter, events: list[Event]) -> None:
    """Append one frame holding ``events``."""
    body = b"".join(encoder.encode(e) for e in events)
    writer.write_events(len(events), [msgpack_array_header(len(events)), body])


def step_events(step: int, rank: int = 0) -> list[Event]:
    """A typical frame: one rank's metrics for ``step`` and its step_end."""
    return [
        Metrics(1000.0 + step, step, {"loss": 1.0 / (step + 1), "rank": float(rank)}),
        StepEnd(1000.5 + step, step),
    ]


def write_segment(
    spool: Path, frames: int, *, rank: int = 0, seal: bool = True, max_segment_bytes: int = 1 << 26
) -> tuple[IncarnationWriter, list[list[Event]]]:
    """A spool with one incarnation of ``rank`` holding ``frames`` step frames."""
    info = ensure_run(spool, world_size=None)
    writer = IncarnationWriter.create(
        SpoolLayout(spool), info, rank, max_segment_bytes=max_segment_bytes
    )
    written = []
    for step in range(frames):
        evs = step_events(step, rank)
        write_frame(writer, evs)
        written.append(evs)
    if seal:
        writer.close()
    else:
        writer.abandon()
    return writer, written
