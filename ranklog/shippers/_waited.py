"""Completeness: what the ranks' views of one read round say about which steps may ship.

The engine asks the same questions of a round's views several times (before each batch
it ships, when the round ends, whether every rank is released), and a job of thousands
of ranks made each answer a loop over every rank. :class:`Waited` is the answers, found
once per round's views; the engine finds them again only when the views (a new round)
or the run (read at start) change.

Step S ships when every expected rank has a watermark >= S or is released. With a known
world size the expected ranks are 0 .. world - 1; ranks that never appeared are waited
for ``start_grace`` seconds after the run was created (the engine applies the time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ranklog.shippers._ranks import RankView
from ranklog.spool import RunInfo

__all__ = ["Waited", "waited"]


@dataclass(slots=True, frozen=True, eq=False)
class Waited:
    """What completeness needs of one round's rank views (see the module)."""

    #: the views and run these answers are of (compared by identity)
    views: dict[int, RankView]
    run: RunInfo | None
    #: the job's world size, if any rank or run.json told
    world: int | None
    #: the ranks a step waits for
    expected: list[int]
    #: the lowest watermark of an expected rank not released (inf: none is waited for)
    limit: float
    #: an expected rank has no view yet (it never wrote: waited for the start grace)
    missing: bool
    #: the watermarks of the expected ranks that have a view, sorted: how many ranks
    #: closed a step is a bisect
    marks: list[int]
    #: the lowest watermark of any rank not released (None: none), the tails' floor
    floor: int | None

    def limit_at(self, in_grace: bool) -> float:
        """The highest step every expected rank allows (inf: none is waited for);
        ``in_grace``: ranks not seen yet may still start (nothing ships)."""
        return min(self.limit, -1) if self.missing and in_grace else self.limit

    def expects(self, rank: int) -> bool:
        """Whether ``rank`` is one of :attr:`expected` (without a search of it)."""
        return 0 <= rank < self.world if self.world is not None else rank in self.views


def waited(views: dict[int, RankView], run: RunInfo | None) -> Waited:
    """The answers for ``views`` (one round's, by rank) of ``run``."""
    known = [v.world_size for v in views.values() if v.world_size is not None]
    if run is not None and run.world_size is not None:
        known.append(run.world_size)
    world = max(known) if known else None
    expected = list(range(world)) if world is not None else sorted(views)
    limit = math.inf
    missing = False
    marks = []
    for r in expected:
        view = views.get(r)
        if view is None:
            missing = True
            continue
        marks.append(view.watermark)
        if not view.released and view.watermark < limit:
            limit = view.watermark
    waited_for = [v.watermark for v in views.values() if not v.released]
    marks.sort()
    return Waited(
        views,
        run,
        world,
        expected,
        limit,
        missing,
        marks,
        min(waited_for) if waited_for else None,
    )
