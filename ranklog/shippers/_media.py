"""Histograms and images of a shipped step, in each backend's form.

Shared by the targets: a histogram's buckets and summary statistics, an image's
size read from its PNG header, and the tag an image goes under when several
ranks logged one of the same name (``name/rank00003``).
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass

from ranklog.shippers._target import ImageItem

__all__ = ["Buckets", "buckets", "image_size", "image_tags", "summary"]

_PNG = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Buckets:
    """A histogram as TensorBoard stores it: upper edges and counts, plus statistics."""

    lo: float
    hi: float
    count: int
    total: float
    total_sq: float
    limits: list[float]
    counts: list[float]


def buckets(values: list[float], bins: int = 30) -> Buckets | None:
    """Equal-width buckets over the finite values (None when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    width = (hi - lo) / bins if hi > lo else 1.0
    counts = [0.0] * bins
    for v in finite:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    limits = [lo + width * (i + 1) for i in range(bins)]
    limits[-1] = hi if hi > lo else lo + 1.0
    return Buckets(lo, hi, len(finite), math.fsum(finite), math.fsum(v * v for v in finite),
                   limits, counts)  # fmt: skip


def summary(values: list[float]) -> dict[str, float]:
    """count, min, max, mean, std of the finite values (what MLflow gets for a histogram)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"count": float(len(values))}
    mean = math.fsum(finite) / len(finite)
    var = math.fsum((v - mean) * (v - mean) for v in finite) / len(finite)
    return {"count": float(len(finite)), "min": min(finite), "max": max(finite),
            "mean": mean, "std": math.sqrt(var)}  # fmt: skip


def image_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) from a PNG header; zeros when it is not a PNG."""
    if len(data) < 26 or not data.startswith(_PNG):
        return 0, 0, 0
    width, height = struct.unpack(">II", data[16:24])
    channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(data[25], 3)
    return height, width, channels


def image_tags(images: list[ImageItem]) -> list[str]:
    """The tag of each image: its name, or ``name/rankNNNNN`` when ranks share the name."""
    shared = Counter(i.name for i in images)
    return [i.name if shared[i.name] == 1 else f"{i.name}/rank{i.rank:05d}" for i in images]
