"""What a running shipper tells the person watching it.

On a terminal: one live line, redrawn at most every half second. In a log
file: a status line at most every ``interval`` seconds, and one at the end.
The engine hands over a :class:`Status`, built only when a line is due.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ranklog.shippers._ranks import RankView

__all__ = ["Progress", "Status"]


@dataclass(frozen=True, slots=True)
class Status:
    """A shipper's state, as a status line shows it."""

    name: str
    #: steps up to this one are shipped
    step: int
    shipped: int
    partial: int
    live: int
    ended: int
    dead: int
    lag_steps: int
    lag_bytes: int
    late: int = 0
    corrupt: int = 0

    @staticmethod
    def ranks(views: Iterable[RankView], now: float, dead_after: float) -> tuple[int, int, int]:
        """(live, ended, dead) ranks among ``views``: dead once silent for ``dead_after``."""
        live = dead = ended = 0
        for r in views:
            if r.ended:
                ended += 1
            elif now - r.last_activity > dead_after:
                dead += 1
            else:
                live += 1
        return live, ended, dead

    def line(self) -> str:
        """The status text."""
        extra = ""
        if self.late:
            extra += f" | late {self.late}"
        if self.corrupt:
            extra += f" | corrupt ranges {self.corrupt}"
        return (
            f"[{self.name}] step {self.step} ({self.shipped} shipped, {self.partial} partial) | "
            f"ranks live {self.live} ended {self.ended} dead {self.dead} | "
            f"lag {self.lag_steps} steps {self.lag_bytes} B{extra}"
        )


class Progress:
    """Status reporting for one shipper."""

    def __init__(self, stream: TextIO | None = None, *, interval: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.5 if self.live else interval
        self._last = 0.0
        self._printed = ""

    def update(self, status: Callable[[], Status]) -> None:
        """Redraw or print if it is time (``status`` is only called then)."""
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self._printed = text = status().line()
        if self.live:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, status: Status) -> None:
        """The final line."""
        text = status.line()
        if self.live:
            self.stream.write("\r\x1b[K" + text + "\n")
        elif text != self._printed:
            self.stream.write(text + "\n")
        self.stream.flush()
