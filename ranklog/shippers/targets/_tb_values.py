"""TensorBoard's records as bytes: events, scalar, text, histogram, image and hparams values.

The target (:mod:`ranklog.shippers.targets.tensorboard`) writes what these make; the
protos come from the ``tensorboard`` package, imported on first use (:func:`tb_protos`).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import re
import struct
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from ranklog.errors import ExtraMissingError
from ranklog.schemas import ParamValue
from ranklog.shippers._target import ShippedStep, TableItem, TextItem
from ranklog.shippers.targets._tfrecord import varint

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

__all__ = [
    "LATE_SOURCE", "LATE_WRITER", "META_LENGTH", "SLOWEST", "Scalars", "event_record",
    "hparam_value", "media_values", "meta_digest", "meta_source", "split_slowest",
    "table_values", "tb_protos", "text_value", "text_values",
]  # fmt: skip

_F32, _F64 = (struct.Struct(f) for f in ("<f", "<d"))
_F32_INF: Final = 2.0**128 - 2.0**103  # from here on, float32 rounds to inf
_TB_MODULES: Final = (  # under tensorboard.
    "compat.proto.event_pb2 compat.proto.summary_pb2 compat.proto.tensor_pb2 compat.proto.types_pb2"
    " plugins.hparams.metadata plugins.hparams.summary_v2 plugins.text.metadata"
)


@functools.cache
def tb_protos() -> Any:
    """tensorboard's modules (``event_pb2``, ``hparams_summary_v2``, ...), imported on first use."""
    try:
        mods = {m: importlib.import_module(f"tensorboard.{m}") for m in _TB_MODULES.split()}
    except ImportError:
        raise ExtraMissingError("tensorboard", "tensorboard") from None
    return SimpleNamespace(**{"_".join(k.split(".")[-2:]).removeprefix("proto_"): v
                              for k, v in mods.items()})  # fmt: skip


def event_record(
    wall: float, step: int, summary: bytes, *, late: bool = False, source: bytes = b""
) -> bytes:
    """A serialized ``Event{1: wall_time, 2: step, 5: summary}``.

    ``late``: the record holds late values; ``source_metadata.writer`` (field 10) says so
    (:data:`LATE_WRITER`), which readers ignore and the target's scan uses. ``source``:
    another such ``source_metadata`` (:func:`meta_source`).
    """
    head = b"\x09" + _F64.pack(wall if math.isfinite(wall) else time.time()) + b"\x10"
    tail = LATE_SOURCE if late else source
    return b"".join((head, varint(step), b"\x2a", varint(len(summary)), summary, tail))


#: ``source_metadata.writer`` of a record of late values
LATE_WRITER: Final = "ranklog late"
LATE_SOURCE: Final = (
    b"\x52" + bytes([len(LATE_WRITER) + 2, 0x0A, len(LATE_WRITER)]) + (LATE_WRITER.encode())
)


#: ``source_metadata.writer`` of a run record (the code's text) is this and a 12-hex digest
#: of its text: a record of no step, which a restarted target does not write again
META_WRITER: Final = "ranklog meta "
META_LENGTH: Final = len(META_WRITER) + 12


def meta_source(digest: str) -> bytes:
    """The ``source_metadata`` of a run record whose text has ``digest`` (12 hex digits)."""
    writer = (META_WRITER + digest).encode()
    assert len(writer) == META_LENGTH
    return b"\x52" + bytes([len(writer) + 2, 0x0A, len(writer)]) + writer


def meta_digest(record_tail: bytes) -> str | None:
    """The digest of a run record, from the last bytes of its record (None: not one)."""
    writer = record_tail[-META_LENGTH:]
    if len(record_tail) < META_LENGTH + 4 or not writer.startswith(META_WRITER.encode()):
        return None
    head = record_tail[-META_LENGTH - 4 : -META_LENGTH]
    if head != b"\x52" + bytes([META_LENGTH + 2, 0x0A, META_LENGTH]):
        return None
    return writer[len(META_WRITER) :].decode("ascii", "replace")


class Scalars:
    """``Summary{1: Value{1: tag, 2: simple_value}}`` for one tuple of names, packed at once."""

    def __init__(self, names: Iterable[str]) -> None:
        fmt, self.args = ["<"], list[bytes | float]()
        for name in names:
            tag = name.encode()
            value = b"\x0a" + varint(len(tag)) + tag + b"\x15"
            entry = b"\x0a" + varint(len(value) + 4) + value
            fmt.append(f"{len(entry)}sf")
            self.args += (entry, 0.0)
        self.packer = struct.Struct("".join(fmt))

    def pack(self, values: Collection[float]) -> bytes:
        args = self.args
        args[1::2] = values
        try:
            return self.packer.pack(*args)
        except OverflowError:  # beyond float32: inf, as TensorBoard's own writer gives
            args[1::2] = [math.copysign(math.inf, v) if abs(v) >= _F32_INF else v for v in values]
            return self.packer.pack(*args)


def text_values(texts: list[TextItem]) -> bytes:
    """Text-plugin values, one per name (a markdown block per rank when several logged it)."""
    out, by_name = [], dict[str, list[TextItem]]()
    for t in texts:
        by_name.setdefault(t.name, []).append(t)
    for name, items in by_name.items():
        body = "\n\n---\n\n".join(f"**rank {t.rank}**\n\n{t.text}" for t in items)
        out.append(text_value(name, items[0].text if len(items) == 1 else body))
    return b"".join(out)


#: what a derived name of "which rank was slowest" holds (``timing/<timer>/slowest_rank``)
SLOWEST: Final = "/slowest_rank"
_SLOWEST_NAME: Final = re.compile(r"timing/.+/slowest_rank(?:\.derived)*")


def split_slowest(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(the other scalars of a step, its slowest ranks as one scalar series per rank).

    A rank index is no quantity: TensorBoard's smoothing would draw rank 2.6 between ranks
    2 and 3, and a text per step is sampled (100 a tag). So ``timing/<timer>/slowest_rank``
    of rank 3 ships as ``timing/<timer>/slowest_rank/rank00003`` = 3.0, at each step rank 3
    was the slowest: a series of one constant, which smoothing leaves as it is, and each
    step's slowest rank is the one series with a point there (TensorBoard keeps 1,000 points
    a tag). A name of that form whose value is no rank (not a whole number >= 0, as a value
    a user logged under it may be) stays the scalar it is.
    """
    if not any(SLOWEST in n for n in metrics):
        return metrics, {}
    values, slow = {}, {}
    for name, value in metrics.items():
        if _SLOWEST_NAME.fullmatch(name) and value >= 0 and float(value).is_integer():
            slow[f"{name}/rank{int(value):05d}"] = value
        else:
            values[name] = value
    return values, slow


def table_values(tables: list[TableItem]) -> bytes:
    """Text-plugin values, a Markdown table each (``name/rankNNNNN`` where ranks share it)."""
    from ranklog.shippers.targets._media import rank_tags, table_markdown

    tags = rank_tags(tables)
    return b"".join(text_value(tag, table_markdown(t)) for tag, t in zip(tags, tables, strict=True))


def text_value(tag: str, text: str) -> bytes:
    """One text-plugin summary value (a scalar string tensor: no tensor_shape)."""
    tb = tb_protos()
    meta = tb.text_metadata.create_summary_metadata(display_name=None, description=None)
    tensor = tb.tensor_pb2.TensorProto(dtype=tb.types_pb2.DT_STRING, string_val=[text.encode()])
    raw: bytes = tb.summary_pb2.Summary.Value(
        tag=tag, metadata=meta, tensor=tensor
    ).SerializeToString()
    return b"\x0a" + varint(len(raw)) + raw


def media_values(s: ShippedStep) -> bytes:
    """Histogram and image values (``histo``, ``image``) of a step."""
    from ranklog.shippers.targets._media import buckets, image_size, rank_tags

    tb, out = tb_protos(), []
    pb = tb.summary_pb2
    for name, values in s.histograms.items():
        b = buckets(values)
        if b is not None:
            histo = pb.HistogramProto(
                min=b.lo, max=b.hi, num=b.count, sum=b.total, sum_squares=b.total_sq,
                bucket_limit=b.limits, bucket=b.counts,
            )  # fmt: skip
            out.append(pb.Summary.Value(tag=name, histo=histo).SerializeToString())
    for tag, img in zip(rank_tags(s.images), s.images, strict=True):
        h, w, c = image_size(img.data)
        image = pb.Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=img.data)
        out.append(pb.Summary.Value(tag=tag, image=image).SerializeToString())
    return b"".join(b"\x0a" + varint(len(raw)) + raw for raw in out)


def hparam_value(v: ParamValue) -> str | bool | int | float:
    """A hyperparameter as TensorBoard's hparams take it: a list as its JSON text."""
    if v is None:
        return "None"
    return json.dumps(v) if isinstance(v, list) else v
