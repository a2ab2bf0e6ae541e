"""Completeness found once per round's views gives the engine the answers its loops gave."""

from __future__ import annotations

import math
import time
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from ranklog.shippers import Shipper
from ranklog.shippers._cursor import IncState
from ranklog.shippers._ranks import RankState, RankView
from ranklog.shippers._tail import RankTail
from ranklog.shippers._waited import waited
from ranklog.spool import RunInfo

_VIEW = st.builds(
    RankView,
    rank=st.integers(0, 9),
    watermark=st.integers(-1, 20),
    released=st.booleans(),
    ended=st.booleans(),
    last_activity=st.just(0.0),
    world_size=st.one_of(st.none(), st.integers(1, 12)),
)


def _loops(views: dict[int, RankView], run: RunInfo | None, grace: bool, pending: set[int]):
    """The engine's answers as it found them before: a loop over every rank each time."""
    known = [v.world_size for v in views.values() if v.world_size is not None]
    if run is not None and run.world_size is not None:
        known.append(run.world_size)
    world = max(known) if known else None
    expected = list(range(world)) if world is not None else sorted(views)
    limit = math.inf
    released = True
    for r in expected:
        view = views.get(r)
        if view is None:
            if grace:
                limit = -1
                released = False
            continue
        if not view.released:
            limit = min(limit, view.watermark)
            released = False
    top = max(pending, default=-1)
    upto = top if limit == math.inf else int(limit)
    marks = sorted(views[r].watermark for r in expected if r in views)
    floor = min((v.watermark for v in views.values() if not v.released), default=None)
    return world, expected, upto, bool(views) and released, marks, floor


class TestWaited:
    @settings(max_examples=400, deadline=None)
    @given(
        views=st.lists(_VIEW, max_size=10),
        world=st.one_of(st.none(), st.integers(1, 12)),
        grace=st.booleans(),
        pending=st.sets(st.integers(0, 25), max_size=5),
    )
    def test_answers_are_the_loops_answers(
        self, views: list[RankView], world: int | None, grace: bool, pending: set[int]
    ) -> None:
        """World size, expected ranks, the shippable step, all released, the sorted
        watermarks and the tails' floor: each as the per-question loops found it."""
        by_rank = {v.rank: v for v in views}
        now = time.time()
        run = RunInfo("0" * 32, now - (0 if grace else 1000), "r", world)
        shipper = Shipper("/nonexistent", _NoTarget(), start_grace=60.0)
        shipper.views, shipper.run, shipper.pending = by_rank, run, set(pending)
        w = waited(by_rank, run)
        want = _loops(by_rank, run, grace, pending)
        got = (
            shipper.world_size(),
            shipper._ready_upto(now)[1],
            shipper._ready_upto(now)[0],
            shipper.all_released(now),
            w.marks,
            w.floor,
        )
        assert got == want

    def test_new_views_are_answered_anew(self) -> None:
        """The answers are found again once a round brings new views, not kept."""
        shipper = Shipper("/nonexistent", _NoTarget(), start_grace=0.0)
        shipper.run = RunInfo("0" * 32, 0.0, "r", 2)
        shipper.views = {
            0: RankView(0, 3, False, False, 0.0, 2),
            1: RankView(1, 5, False, False, 0.0, 2),
        }
        shipper.pending = {4}
        assert shipper._ready_upto(time.time())[0] == 3
        shipper.views = {**shipper.views, 0: RankView(0, 7, False, False, 0.0, 2)}
        assert shipper._ready_upto(time.time())[0] == 5
        shipper.views = {k: RankView(k, 5, True, True, 0.0, 2) for k in (0, 1)}
        assert shipper.all_released(time.time())
        assert shipper._ready_upto(time.time())[0] == 4  # none waited for: what is pending


class _NoTarget:
    """A target the engine is built with and never opens."""

    spec = "none:"


_INC = st.builds(
    IncState,
    closed=st.integers(-1, 9),
    max_step=st.integers(-1, 10),
    ended=st.sampled_from([None, "ok", "error", "signal", ""]),
    world_size=st.one_of(st.none(), st.integers(1, 8)),
)
_RANK = st.builds(
    RankState,
    incs=st.dictionaries(st.integers(1, 4), _INC, max_size=3),
    last_activity=st.sampled_from([0.0, 950.0, 999.0]),
    caught_up=st.booleans(),
)


class TestViews:
    @settings(max_examples=400, deadline=None)
    @given(ranks=st.dictionaries(st.integers(0, 9), _RANK, max_size=6))
    def test_a_tails_views_are_its_ranks_states(self, ranks: dict[int, RankState]) -> None:
        """Each rank's view (one incarnation or several, ended, silent, read or not) says
        what its RankState's own methods say: watermark, released, ended, world size and
        status."""
        tail = RankTail(cast(Any, None), RunInfo("0" * 32, 0.0, "r"), dead_after=30.0)
        tail.ranks = ranks
        now = 1000.0
        want = []
        for r, s in ranks.items():
            if not s.incs:
                continue
            sizes = [i.world_size for i in s.incs.values() if i.world_size is not None]
            released = tail.released(s, now)
            status = s.incs[max(s.incs)].ended
            want.append(RankView(r, s.watermark(), released, s.ended(), s.last_activity,
                                 max(sizes) if sizes else None,
                                 (status or "dead") if released else None))  # fmt: skip
        assert tail.views(now) == want
