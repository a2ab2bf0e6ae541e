"""Event schemas: round trips, pinned tags, and forward compatibility."""

from __future__ import annotations

import math

import msgspec
import pytest

from ranklog.schemas import (
    KINDS,
    SCHEMA_VERSION,
    DecodeStats,
    Event,
    Gpu,
    Heartbeat,
    Histogram,
    Image,
    Metrics,
    Params,
    RankEnd,
    RankStart,
    StepEnd,
    Table,
    Text,
    Timer,
    decode_events,
    encoder,
)

EXAMPLES: list[Event] = [
    RankStart(1.5, "ab" * 16, 3, 8, 1, "node7", 4242, 2, "0.1.0"),
    Metrics(2.0, 10, {"train/loss": 0.25, "nan": math.nan, "inf": -math.inf}, "mean,max"),
    Metrics(2.1, 11, {"a": 1.0, "b": 2.0}, {"a": "sum", "b": "median"}),
    Timer(2.5, 10, "step_time", 1.93),
    Gpu(3.0, "node7", 0, 97.0, 10 << 30, 80 << 30, 64.0, 350.5, step=10, name="H200"),
    Params(3.5, {"optim.lr": 3e-4, "model.name": "gpt", "seed": 1, "flag": True, "none": None}),
    Text(4.0, 10, "val/sample_0", "prompt ... answer ..."),
    StepEnd(4.5, 10),
    Heartbeat(5.0),
    RankEnd(6.0, "ok", 0),
    Histogram(7.0, 10, "grad", [0.1, -2.0, math.inf]),
    Image(8.0, 10, "plot", b"\x89PNG...", "png"),
    Table(9.0, 10, "val/results", ["prompt", "score", "ok"], [["q", 0.5, True], [None, 2, False]]),
]


class TestRoundTrip:
    @pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
    def test_every_kind(self, event: Event) -> None:
        """Every kind decodes to an equal event (NaN compared by identity of kind)."""
        (back,) = decode_events(encoder.encode([event]))
        assert type(back) is type(event)
        if isinstance(event, Metrics):
            assert isinstance(back, Metrics)
            assert back.values.keys() == event.values.keys()
            for k, v in event.values.items():
                assert (math.isnan(v) and math.isnan(back.values[k])) or back.values[k] == v
            assert back.reduce == event.reduce
        else:
            assert back == event

    def test_every_kind_is_covered(self) -> None:
        """The examples cover every kind in the registry."""
        assert {type(e) for e in EXAMPLES} == set(KINDS.values())


class TestPinnedTags:
    def test_tags_are_the_designs(self) -> None:
        """Tag strings are pinned forever: they are the design's kind names."""
        assert {k: v.__struct_config__.tag for k, v in KINDS.items()} == {k: k for k in KINDS}
        assert set(KINDS) == {
            "rank_start",
            "metrics",
            "timer",
            "gpu",
            "params",
            "text",
            "step_end",
            "heartbeat",
            "rank_end",
            "histogram",
            "image",
            "table",
        }

    def test_wire_form_is_tagged_array(self) -> None:
        """An event is ``[tag, ts, fields...]`` on the wire."""
        raw = msgspec.msgpack.decode(encoder.encode([StepEnd(1.0, 7, 3)]))
        assert raw == [["step_end", 1.0, 7, 3]]

    def test_field_added_later_has_its_default(self) -> None:
        """A step_end written before ``events`` existed (schema 2) reads with events = -1."""
        old = msgspec.msgpack.encode([["step_end", 1.0, 7]])
        assert decode_events(old, 2) == [StepEnd(1.0, 7, -1)]


# A newer writer: one more field on metrics, and a kind this reader does not know.
class _Base(msgspec.Struct, array_like=True, tag=True):
    ts: float


class _MetricsV2(_Base, tag="metrics"):
    step: int
    values: dict[str, float]
    reduce: str | dict[str, str] = "mean"
    source: str = "new"


class _Audio(_Base, tag="audio"):
    step: int
    name: str
    samples: list[float]


class TestForwardCompatibility:
    def test_newer_writer_is_read_and_counted(self) -> None:
        """Unknown trailing fields and unknown kinds are skipped and counted, the rest read."""
        payload = msgspec.msgpack.encode(
            [
                _MetricsV2(1.0, 3, {"loss": 0.5}),
                _Audio(1.1, 3, "w", [0.0, 1.0]),
                _MetricsV2(1.2, 4, {"loss": 0.4}, "sum"),
            ]
        )
        stats = DecodeStats()
        events = decode_events(payload, SCHEMA_VERSION + 1, stats)
        assert events == [Metrics(1.0, 3, {"loss": 0.5}), Metrics(1.2, 4, {"loss": 0.4}, "sum")]
        assert stats.unknown_kinds == 1
        assert stats.unknown_fields == 2
        assert stats.invalid_events == 0

    def test_unknown_kind_in_current_schema_frame(self) -> None:
        """An unknown kind is skipped even in a frame claiming the current schema."""
        payload = msgspec.msgpack.encode([_Audio(1.1, 3, "w", []), StepEnd(2.0, 3)])
        stats = DecodeStats()
        assert decode_events(payload, SCHEMA_VERSION, stats) == [StepEnd(2.0, 3)]
        assert stats.unknown_kinds == 1

    @pytest.mark.parametrize(
        "payload",
        [b"", b"\xc1", b"\x91\x92\xa7metrics", msgspec.msgpack.encode({"not": "a list"})],
    )
    def test_garbage_never_raises(self, payload: bytes) -> None:
        """A payload that is not an array of events yields nothing and is counted."""
        stats = DecodeStats()
        assert decode_events(payload, SCHEMA_VERSION, stats) == []
        assert stats.invalid_events >= 1
