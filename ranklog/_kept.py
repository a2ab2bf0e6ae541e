"""A map of names kept while there is room: a long-lived process's caches stay bounded.

The shipper shares one tuple per list of metric names, and the order of each such list,
across every step that logs it; replay does the same for a window's lists of names. A run
whose names change every step would make each of those a map with an entry per step, so
each is a :class:`Kept`: entries are kept until their keys hold ``limit`` names in all;
past that, new keys are not kept (their value is made again when asked: as correct,
slower) and what is kept stays.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Kept"]

K = TypeVar("K", bound=tuple[object, ...])
V = TypeVar("V")


class Kept(Generic[K, V]):
    """``key -> value``, its keys (tuples of names) holding at most ``limit`` names."""

    __slots__ = ("_held", "_items", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: dict[K, V] = {}
        self._held = 0

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def keep(self, key: K, value: V) -> V:
        """``value``, kept under ``key`` if its names fit in what is left."""
        if self._held + len(key) <= self.limit:
            self._items[key] = value
            self._held += len(key)
        return value

    @property
    def held(self) -> int:
        """Names the kept keys hold, all together."""
        return self._held

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list[V]:
        return list(self._items.values())
