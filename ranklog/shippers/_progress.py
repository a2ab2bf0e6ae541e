"""What a running shipper tells the person watching it.

On a terminal: one live line, redrawn at most every half second. In a log
file: a status line at most every ``interval`` seconds, and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ranklog.shippers._engine import Shipper

__all__ = ["Progress"]


class Progress:
    """Status reporting for one shipper."""

    def __init__(self, stream: TextIO | None = None, *, interval: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.5 if self.live else interval
        self._last = 0.0
        self._printed = ""

    def line(self, s: Shipper) -> str:
        """The status text."""
        now = time.time()
        live = dead = ended = 0
        for r in s.views.values():
            if r.ended:
                ended += 1
            elif now - r.last_activity > s.dead_after:
                dead += 1
            else:
                live += 1
        lag_steps, lag_bytes = s.lag()
        extra = []
        if s.stats.late_events:
            extra.append(f"late {s.stats.late_events}")
        if s.stats.bad:
            extra.append(f"corrupt ranges {len(s.stats.bad)}")
        return (
            f"[{s.name}] step {s.shipped_upto} ({s.stats.steps_shipped} shipped, "
            f"{s.stats.partial_steps} partial) | ranks live {live} ended {ended} dead {dead} | "
            f"lag {lag_steps} steps {lag_bytes} B" + ("".join(f" | {e}" for e in extra))
        )

    def update(self, s: Shipper) -> None:
        """Redraw or print if it is time."""
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self._printed = text = self.line(s)
        if self.live:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, s: Shipper) -> None:
        """The final line."""
        text = self.line(s)
        if self.live:
            self.stream.write("\r\x1b[K" + text + "\n")
        elif text != self._printed:
            self.stream.write(text + "\n")
        self.stream.flush()
