"""Metrics values read in bulk (compaction's path): the same as decoding each event."""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

import ranklog.archive._compact as compaction
from ranklog.archive import compact, load_manifest
from ranklog.archive._bulk import MAX_SHAPES, bulk_values
from ranklog.schemas import (
    Metrics,
    MetricsRaw,
    StepEnd,
    Timer,
    decode_events,
    decode_events_raw,
    encoder,
    metrics_values,
)
from ranklog.spool import (
    UNDECODABLE,
    IncarnationWriter,
    SegmentReader,
    SpoolLayout,
    ensure_run,
    read_segment,
)
from ranklog.spool._format import msgpack_array_header

from .spoolgen import write_frame

_raw_of = msgspec.msgpack.Decoder(MetricsRaw)


def _raw(values: Any) -> msgspec.Raw:
    """The values map ``values`` (any msgpack-encodable map) as a MetricsRaw holds it."""
    return _raw_of.decode(encoder.encode(["metrics", 0.0, 0, values, "mean"])).values


def _hand_map(items: list[tuple[bytes, bytes]]) -> msgspec.Raw:
    """A map written byte by byte: (encoded key, encoded value) pairs, duplicates allowed."""
    body = bytes([0x80 | len(items)]) + b"".join(k + v for k, v in items)
    event = (
        msgpack_array_header(5) + encoder.encode("metrics") + encoder.encode(0.0)
        + encoder.encode(0) + body + encoder.encode("mean")
    )  # fmt: skip
    return _raw_of.decode(event).values


def _bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


def _odd_floats(rng: random.Random) -> float:
    quiet_nan = 0x7FF8_0000_0000_0000 | rng.getrandbits(51)
    nan_payload = struct.unpack("<d", struct.pack("<Q", quiet_nan))
    return rng.choice([
        rng.uniform(-1e3, 1e3), -0.0, 0.0, math.inf, -math.inf, math.nan, nan_payload[0],
        5e-324, 1.7976931348623157e308, float(rng.getrandbits(53)),
    ])  # fmt: skip


def _names(rng: random.Random) -> list[str]:
    """A set of names: short, long (str8 and str16 headers), non-ASCII; sometimes over 15."""
    pool = [
        "loss", "train/loss", "lr", "grad_norm", "é/ü", "数据/损失", "x" * 40, "y" * 300,
        *(f"metric_{i:02d}" for i in range(30)),
    ]  # fmt: skip
    return rng.sample(pool, rng.choice([0, 1, 3, 16, 20, 33]))


def _maps(rng: random.Random, n: int) -> list[dict[str, float]]:
    """``n`` maps over a few name sets (as training logs train and eval metrics)."""
    sets = [_names(rng) for _ in range(rng.randint(1, 4))]
    return [{k: _odd_floats(rng) for k in rng.choice(sets)} for _ in range(n)]


def _expected(maps: list[dict[str, float]]) -> tuple[list[str], list[str], list[int], list[int]]:
    """What decoding map by map gives: distinct names in order, each row's name and bits,
    each map's count."""
    names: dict[str, None] = {}
    rows, bits = [], []
    for m in maps:
        for k, v in m.items():
            names.setdefault(k)
            rows.append(k)
            bits.append(_bits(v))
    return list(names), rows, bits, [len(m) for m in maps]


class TestBulkValues:
    @pytest.mark.parametrize("seed", range(12))
    def test_same_as_decoding_each_map(self, seed: int) -> None:
        """Names, counts and values (bit for bit: NaN payloads, -0.0) equal map-by-map decoding."""
        rng = random.Random(seed)
        maps = _maps(rng, rng.randint(1, 300))
        raws = [_raw(m) for m in maps]
        found = bulk_values(raws)
        if found is None:  # two name sets of the same byte length: decoded one by one
            lengths = {len(r) for r in raws}
            shapes = {tuple(m) for m in maps}
            assert len(lengths) < len(shapes)
            return
        names, rows, bits, counts = _expected(maps)
        assert found.names == names
        assert [found.names[c] for c in found.codes.tolist()] == rows
        assert found.values.view("<i8").astype("u8").tolist() == bits
        assert found.counts.tolist() == counts
        assert [list(found.shapes[s]) for s in found.shape_of.tolist()] == [list(m) for m in maps]

    def test_mostly_taken_in_bulk(self) -> None:
        """The random jobs above are read in bulk, not mostly refused (the test means something)."""
        taken = sum(
            bulk_values([_raw(m) for m in _maps(random.Random(s), 50)]) is not None
            for s in range(12)
        )
        assert taken >= 9

    def test_empty_maps(self) -> None:
        """Maps without values give no rows, also among others."""
        found = bulk_values([_raw({}), _raw({"a": 1.0}), _raw({})])
        assert found is not None
        assert found.counts.tolist() == [0, 1, 0]
        assert found.values.tolist() == [1.0]
        only = bulk_values([_raw({})] * 3)
        assert only is not None and len(only.values) == 0

    @pytest.mark.parametrize(
        "raws",
        [
            [_raw({"a": 1.0}), _raw({"a": 2})],  # an int value
            [_raw({"a": True})],  # a bool
            [_hand_map([(encoder.encode("a"), b"\xca" + struct.pack(">f", 1.5))])],  # float32
            [_hand_map([(encoder.encode("a"), encoder.encode(1.0))] * 2)],  # a name twice
            [_hand_map([(encoder.encode(7), encoder.encode(1.0))])],  # an int key
            [_raw({"ab": 1.0}), _raw({"cd": 2.0})],  # other names, the same length
            [_raw({"a": 1.0, "b": 2.0}), _raw({"b": 1.0, "a": 2.0})],  # another order
            [_raw({"k" * i: 1.0}) for i in range(1, MAX_SHAPES + 2)],  # too many shapes
        ],
        ids=["int", "bool", "float32", "twice", "int-key", "same-length", "order", "shapes"],
    )
    def test_other_shapes_are_refused(self, raws: list[msgspec.Raw]) -> None:
        """A map not of the bulk shape makes the whole list decode map by map (None)."""
        assert bulk_values(raws) is None


class TestRawDecoding:
    def test_metrics_raw_mirrors_metrics(self) -> None:
        """MetricsRaw has Metrics' tag, fields (in order) and defaults: it reads its events."""
        assert MetricsRaw.__struct_config__.tag == Metrics.__struct_config__.tag
        assert MetricsRaw.__struct_fields__ == Metrics.__struct_fields__
        assert MetricsRaw.__struct_defaults__ == Metrics.__struct_defaults__

    def test_same_events_but_metrics_values(self) -> None:
        """A frame reads as decode_events reads it, Metrics as MetricsRaw holding the same map."""
        events = [
            Metrics(1.0, 3, {"a": 1.0, "b": -2.5}, {"a": "sum"}),
            Timer(1.5, 3, "fwd", 0.25),
            StepEnd(2.0, 3, 2),
        ]
        payload = encoder.encode(events)
        raw = decode_events_raw(payload)
        assert raw[1:] == decode_events(payload)[1:]
        first = raw[0]
        assert isinstance(first, MetricsRaw)
        assert (first.ts, first.step, first.reduce) == (1.0, 3, {"a": "sum"})
        assert metrics_values(first) == {"a": 1.0, "b": -2.5}

    def test_a_values_map_metrics_refuses(self) -> None:
        """A map with a str value is left raw, and metrics_values raises as Metrics would."""
        payload = encoder.encode([["metrics", 1.0, 3, {"a": "high"}, "mean"]])
        assert decode_events(payload) == []
        (raw,) = decode_events_raw(payload)
        assert isinstance(raw, MetricsRaw)
        with pytest.raises(msgspec.ValidationError):
            metrics_values(raw)

    def test_newer_schema_goes_to_decode_events(self) -> None:
        """A frame of a newer schema is decoded as decode_events does (plain Metrics)."""
        payload = encoder.encode([Metrics(1.0, 3, {"a": 1.0})])
        assert decode_events_raw(payload, schema=99) == decode_events(payload, schema=99)


def _job(spool: Path) -> None:
    """Two ranks whose frames mix name sets, int values, per-name reduce specs, empty maps,
    a values map Metrics refuses, and frames of several events."""
    info = ensure_run(spool, world_size=2)
    rng = random.Random(5)
    for r in range(2):
        w = IncarnationWriter.create(SpoolLayout(spool), info, r, max_segment_bytes=1 << 26)
        for s in range(120):
            frame: list[Any] = [Metrics(100.0 + s, s, {"loss": rng.random(), "lr": 1e-3})]
            if s % 10 == 0:
                frame.append(Metrics(100.0 + s, s, {"eval/acc": rng.random()}, {"eval/acc": "max"}))
            if s % 17 == 0:
                frame.append(Metrics(100.0 + s, s, {"count": 3}))  # an int: refused in bulk
            if s % 23 == 0:
                frame.append(Metrics(100.0 + s, s, {}))
            frame.append(StepEnd(100.5 + s, s))
            write_frame(w, frame)
            if s == 60 and r == 1:  # a frame whose first event's map Metrics refuses
                bad = encoder.encode(["metrics", 160.0, s, {"loss": "oops"}, "mean"])
                good = encoder.encode(Metrics(160.0, s, {"loss": 1.0}))
                w.write_events(2, [msgpack_array_header(2), bad + good])
        w.close()


class TestCompaction:
    def test_same_dataset_as_decoding_each_event(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Compaction reading values in bulk writes the very files (bytes) and damage reports
        that decoding every event writes, a refused map's frame included."""
        spool = tmp_path / "spool"
        _job(spool)
        bulk = compact(spool, tmp_path / "bulk")
        monkeypatch.setattr(compaction, "decode_events_raw", decode_events)
        plain = compact(spool, tmp_path / "plain")
        assert bulk.values == plain.values > 0
        assert [str(b) for b in bulk.bad] == [str(b) for b in plain.bad]
        assert any("undecodable" in str(b) for b in bulk.bad)
        files = sorted(p.relative_to(tmp_path / "plain") for p in (tmp_path / "plain").rglob("*"))
        assert files == sorted(
            p.relative_to(tmp_path / "bulk") for p in (tmp_path / "bulk").rglob("*")
        )
        for rel in files:
            if (tmp_path / "plain" / rel).is_file():
                got, want = (tmp_path / "bulk" / rel).read_bytes(), (tmp_path / "plain" / rel)
                assert got == want.read_bytes(), rel
        assert load_manifest(tmp_path / "bulk").bad == load_manifest(tmp_path / "plain").bad

    def test_refused_map_keeps_the_rest_of_its_chunk(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Where a map Metrics refuses sends a chunk back to per-event decoding, only that
        event is lost: every other value of the chunk is in the dataset."""
        spool = tmp_path / "spool"
        _job(spool)
        calls: list[bool] = []
        real = compaction._decode

        def spy(path: str, frames: Any, layouts: Any, *, raw: bool) -> Any:
            calls.append(raw)
            return real(path, frames, layouts, raw=raw)

        monkeypatch.setattr(compaction, "_decode", spy)
        result = compact(spool, tmp_path / "out")
        assert calls.count(False) == 1  # rank 1's one chunk, decoded again event by event
        logged = 2 * (120 * 2 + 12 * 1 + 8 * 1) + 1  # loss+lr, eval, count; the good event
        assert result.values == logged


class TestUndecodedFrames:
    def test_same_frames_with_their_payloads(self, tmp_path: Path) -> None:
        """A reader with decode=False finds the frames a decoding reader finds, each with the
        payload that decodes to its events, and no undecodable-events report of its own."""
        spool = tmp_path / "spool"
        _job(spool)
        seg = SpoolLayout(spool).segments(1)[0]
        plain = SegmentReader(seg.path).read(0, writer_gone=True, max_bytes=4096)
        raw = SegmentReader(seg.path, decode=False).read(0, writer_gone=True, max_bytes=4096)
        assert [(f.offset, f.end, f.seq) for f in raw.frames] == [
            (f.offset, f.end, f.seq) for f in plain.frames
        ]
        assert (raw.end, raw.more, raw.pending) == (plain.end, plain.more, plain.pending)
        assert all(f.events == [] and f.payload is not None for f in raw.frames)
        assert [decode_events(f.payload) for f in raw.frames if f.payload is not None] == [
            f.events for f in plain.frames
        ]
        whole = SegmentReader(seg.path, decode=False).read(0, writer_gone=True)
        assert not any(b.reason == UNDECODABLE for b in whole.bad)
        assert any(b.reason == UNDECODABLE for b in read_segment(seg.path).bad)
