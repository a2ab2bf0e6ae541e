"""Metrics values read in bulk from their msgpack bytes: names and floats, no dict per event.

A rank logs the same names in the same order step after step, so the values maps of
its Metrics events (:class:`~ranklog.schemas.MetricsRaw`) are alike byte for byte but
for their floats::

    map header | str header, name, 0xcb, 8 bytes (big-endian double) | str header, ...
    \\__________ the "skeleton": the same in every map of this shape ___/ \\_ a float _/

The maps are grouped by byte length. The first map of each length is parsed as a
template: its names, and where each float's 8 bytes are. Every map of that length is
then checked to equal the template outside those 8-byte slots (one XOR over the rows,
as 64-bit words, masked), and its floats are read out of the slots as big-endian
doubles, bit for bit what the msgpack decoder would give.

:func:`bulk_values` returns None for maps of any other shape: a value written as an
int or a float32, a name twice, two different sets of names with the same byte
length, more shapes than :data:`MAX_SHAPES`. The caller then decodes the maps one by
one (:func:`~ranklog.schemas.metrics_values`), which is always right, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np

__all__ = ["MAX_SHAPES", "Bulk", "bulk_values", "packed_values"]

#: distinct map lengths taken in bulk; past that the maps are decoded one by one
MAX_SHAPES: Final = 64
_FLOAT64: Final = 0xCB


@dataclass(slots=True)
class Bulk:
    """The values of a list of maps, in order: one row per value."""

    #: the distinct names, in order of first appearance (of one layout: its tuple)
    names: Sequence[str]
    #: per map: the index of its shape (its names) in :attr:`shapes`
    shape_of: Any
    #: per shape: its names in map order
    shapes: list[tuple[str, ...]]
    #: per map: how many values it holds
    counts: Any
    #: per row: the index of its name in :attr:`names`
    codes: Any
    #: per row: its value
    values: Any


def bulk_values(raws: list[msgspec.Raw]) -> Bulk | None:
    """The names and values of ``raws`` (msgpack maps of str to float64), or None when
    some map is not of a shape read in bulk (see the module docstring)."""
    n = len(raws)
    lengths = np.fromiter(map(len, raws), np.int64, n)
    distinct = np.unique(lengths).tolist()
    if len(distinct) > MAX_SHAPES:
        return None
    found = []  # per shape: (its first map's place, its maps, names, values)
    for length in distinct:
        rows = np.flatnonzero(lengths == length) if len(distinct) > 1 else None
        group = raws if rows is None else list(map(raws.__getitem__, rows.tolist()))
        template = _template(memoryview(group[0]))
        if template is None:
            return None
        keys, slots = template
        values = _read(group, length, slots)
        if values is None:
            return None
        found.append((0 if rows is None else int(rows[0]), rows, keys, values))
    # names numbered in order of first appearance, as a map-by-map pass would number them
    names: dict[str, int] = {}
    shapes: list[tuple[str, ...]] = []
    counts = np.zeros(n, np.int64)
    shape_of = np.zeros(n, np.int32)
    parts: list[tuple[Any, Any, Any]] = []  # per shape: (its maps, name codes, values)
    for _, rows, keys, values in sorted(found, key=lambda f: f[0]):
        codes = np.array([names.setdefault(k, len(names)) for k in keys], np.int32)
        where = slice(None) if rows is None else rows
        counts[where] = len(keys)
        shape_of[where] = len(shapes)
        shapes.append(keys)
        parts.append((rows, codes, values))
    if len(parts) == 1:
        _, codes, values = parts[0]
        out_codes, out_values = np.tile(codes, n), values.ravel()
    else:  # several shapes: each map's rows go where its place in the list puts them
        total = int(counts.sum())
        first = np.cumsum(counts) - counts
        out_codes, out_values = np.empty(total, np.int32), np.empty(total, np.float64)
        for rows, codes, values in parts:
            at = (first[rows][:, None] + np.arange(len(codes))).ravel()
            out_codes[at] = np.tile(codes, len(rows))
            out_values[at] = values.ravel()
    return Bulk(list(names), shape_of, shapes, counts, out_codes, out_values)


def packed_values(names: list[tuple[str, ...]], packed: list[bytes]) -> Bulk:
    """The values of events read packed (segment format 2: each a layout's ``names``, one
    tuple per layout, and its values as ``packed`` float64 bytes): the same :class:`Bulk`
    as their maps would give, names numbered in order of first appearance, with no
    template to check and no float object."""
    n = len(packed)
    counts = np.fromiter(map(len, names), np.int64, n)
    values = np.frombuffer(b"".join(packed), "<f8").astype(np.float64)
    keys = names[0] if n else ()
    if n and all(x is keys for x in names) and len(set(keys)) == len(keys):  # one layout
        shape = np.arange(len(keys), dtype=np.int32)  # (the rule: its names, each once)
        return Bulk(keys, np.zeros(n, np.int32), [keys], counts, np.tile(shape, n), values)
    # shapes: the layouts' tuples (one per layout: by identity), in order of first use
    ids = np.fromiter(map(id, names), np.int64, n)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    place = np.empty(len(order), np.int32)
    place[order] = np.arange(len(order), dtype=np.int32)
    shape_of = place[inverse.ravel()]
    codes_of: dict[str, int] = {}
    shapes: list[tuple[str, ...]] = []
    codes: list[Any] = []
    for at in first[order].tolist():
        keys = names[at]
        shapes.append(keys)
        codes.append(np.array([codes_of.setdefault(k, len(codes_of)) for k in keys], np.int32))
    if len(shapes) == 1:
        out_codes = np.tile(codes[0], n)
    else:
        out_codes = np.concatenate([codes[s] for s in shape_of.tolist()]) if n else codes[0]
    return Bulk(list(codes_of), shape_of, shapes, counts, out_codes, values)


def _read(group: list[msgspec.Raw], length: int, slots: list[int]) -> Any:
    """The floats of the maps of ``group`` (each ``length`` bytes), one row per map; None
    when a map differs from the first outside the float slots (at ``slots``)."""
    m, pad = len(group), -length % 8
    width = length + pad
    buf = (b"\0" * pad).join(group) + b"\0" * pad  # rows of whole 64-bit words
    rows = np.frombuffer(buf, np.uint64).reshape(m, width // 8)
    mask = np.full(width, 0xFF, np.uint8)
    for at in slots:
        mask[at : at + 8] = 0
    differs = np.bitwise_xor(rows, rows[0])
    np.bitwise_and(differs, mask.view(np.uint64), out=differs)
    if differs.any():
        return None
    out = np.empty((m, len(slots)), np.float64)
    for j, at in enumerate(slots):
        out[:, j] = np.ndarray((m,), ">f8", buf, at, (width,))
    return out


def _template(b: memoryview) -> tuple[tuple[str, ...], list[int]] | None:
    """The names of the map ``b`` and the offsets of its floats' 8 bytes; None unless it
    is a map of distinct str keys to float64 values and nothing else."""
    size = len(b)
    if not size:
        return None
    head = b[0]
    if 0x80 <= head <= 0x8F:
        count, at = head & 0x0F, 1
    elif head == 0xDE and size >= 3:
        count, at = int.from_bytes(b[1:3], "big"), 3
    elif head == 0xDF and size >= 5:
        count, at = int.from_bytes(b[1:5], "big"), 5
    else:
        return None
    keys: list[str] = []
    slots: list[int] = []
    for _ in range(count):
        if at >= size:
            return None
        head = b[at]
        if 0xA0 <= head <= 0xBF:
            n, at = head & 0x1F, at + 1
        elif head == 0xD9 and at + 2 <= size:
            n, at = b[at + 1], at + 2
        elif head == 0xDA and at + 3 <= size:
            n, at = int.from_bytes(b[at + 1 : at + 3], "big"), at + 3
        elif head == 0xDB and at + 5 <= size:
            n, at = int.from_bytes(b[at + 1 : at + 5], "big"), at + 5
        else:
            return None
        try:
            keys.append(str(b[at : at + n], "utf-8"))
        except UnicodeDecodeError:
            return None
        at += n
        if at + 9 > size or b[at] != _FLOAT64:
            return None
        slots.append(at + 1)
        at += 9
    if at != size or len(set(keys)) != count:
        return None
    return tuple(keys), slots
