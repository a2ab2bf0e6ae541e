"""Names a rank ships under, and the warning when a derived one meets one as logged.

A value ships under the name it was logged with, except where ranklog derives names:
``m`` logged with several ops ships as ``m/mean``, ``m/max``; a timer ``t`` ships as
``timing/t`` and ``timing/t/slowest_rank``. When a derived name is also a name logged as
such (``m/max`` logged on its own, a metric ``timing/t``), the shipper keeps both: the
derived value ships with ``.derived`` appended (``ranklog.shippers._finish.DERIVED``).
:class:`NameBook` sees the names of one rank as it logs them, and warns once per name
when two meet, at log time; names of different ranks or steps only the shipper sees.

Every check runs when a name (or a name with a new op spec) is first seen: the usual
call, with names it logged before, costs nothing here.
"""

from __future__ import annotations

import warnings
from typing import Final

from ranklog.errors import InvalidValueError, RanklogWarning

__all__ = ["RESERVED", "NameBook"]

#: the prefix of names ranklog ships of its own (``ranklog/ranks_reporting``)
RESERVED: Final = "ranklog/"
_BOUND: Final = 100_000  # names remembered at most: a rank logging more checks no more


class NameBook:
    """The names one rank logged and the names derived from them (see the module)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._logged: set[str] = set()
        self._derived: set[str] = set()
        #: op spec -> names already derived with it
        self._specs: dict[str, set[str]] = {}
        self._warned: set[str] = set()

    def logged(self, name: str) -> None:
        """A metric name seen for the first time (raises for ``ranklog/`` names)."""
        if name.startswith(RESERVED):
            raise InvalidValueError(
                f"metric {name!r}: names under {RESERVED!r} are ranklog's own "
                "(ranklog/ranks_reporting): choose another prefix"
            )
        if len(self._logged) < _BOUND:
            self._logged.add(name)
        if name in self._derived:
            self._warn(name)

    def several(self, names: dict[str, float], spec: str) -> None:
        """Names logged with a spec of several ops (``"mean,max"``): each derives ``name/op``."""
        seen = self._specs.get(spec)
        if seen is None:
            seen = self._specs[spec] = set()
        ops = spec.split(",")
        for name in names:
            if name not in seen:
                seen.add(name)
                self._derive([f"{name}/{op}" for op in ops])

    def timer(self, name: str) -> None:
        """A timer name seen for the first time."""
        self._derive([f"timing/{name}", f"timing/{name}/slowest_rank"])

    def _derive(self, names: list[str]) -> None:
        for name in names:
            if len(self._derived) < _BOUND:
                self._derived.add(name)
            if name in self._logged:
                self._warn(name)

    def _warn(self, name: str) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        warnings.warn(
            f"ranklog: rank {self.rank} logs {name!r} and also derives it (a timer, or a "
            f"metric with several reduce ops): both values ship, the derived one as "
            f"{name + '.derived'!r}",
            RanklogWarning,
            stacklevel=4,
        )
