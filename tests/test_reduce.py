"""Reduction across ranks against a numpy oracle, and merging of partial aggregates."""

from __future__ import annotations

import math
import struct
from typing import Final

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ranklog.schemas import Metrics, Text, Timer
from ranklog.shippers import Partial
from ranklog.shippers._reduce import output_names, parse_ops
from ranklog.shippers._steps import Contribution, StepAcc

from .shiphelp import reduce_step

OPS = ("mean", "sum", "min", "max", "median", "std", "count", "last")
FLOATS = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0]),
)


def oracle(values: list[float], op: str) -> float:
    """numpy's answer (population std, NaN-propagating)."""
    a = np.array(values, dtype=np.float64)
    with np.errstate(all="ignore"):
        return float(
            {
                "mean": np.mean,
                "sum": np.sum,
                "min": np.min,
                "max": np.max,
                "median": np.median,
                "std": np.std,
                "count": len,
                "last": lambda x: x[-1],
            }[op](a)
        )


def same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


class TestPartial:
    @settings(max_examples=300, deadline=None)
    @given(st.lists(FLOATS, min_size=1, max_size=40), st.sampled_from(OPS))
    def test_matches_numpy(self, values: list[float], op: str) -> None:
        """Every op on one partial equals numpy's result, NaN and inf included."""
        p = Partial.of(values, last=(float(len(values)), 0, values[-1]), ops=(op,))
        assert same(p.result(op), oracle(values, op)), (values, op)

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.lists(FLOATS, min_size=1, max_size=10), min_size=1, max_size=6),
        st.sampled_from(OPS),
    )
    def test_merge_equals_whole(self, shards: list[list[float]], op: str) -> None:
        """Merging the partials of shards gives the partial of all values (fan-in)."""
        ops = (op,)
        ts = 0.0
        parts = []
        for shard in shards:
            ts += 1
            parts.append(Partial.of(shard, last=(ts, 0, shard[-1]), ops=ops))
        merged = parts[0]
        for p in parts[1:]:
            merged = merged.merge(p)
        flat = [v for s in shards for v in s]
        expected = oracle(flat, op)
        if op in ("sum", "mean") and all(math.isfinite(v) for v in flat):
            assert math.isclose(merged.result(op), expected, rel_tol=1e-9, abs_tol=1e-6)
        elif op == "std" and all(math.isfinite(v) for v in flat):
            assert math.isclose(merged.result(op), expected, rel_tol=1e-6, abs_tol=1e-3)
        else:
            assert same(merged.result(op), expected)

    def test_sum_is_order_independent(self) -> None:
        """fsum makes a sum exact, so the arrival order of ranks never changes a result."""
        values = [1e16, 1.0, -1e16, 1.0] * 10
        a = Partial.of(values, last=(0, 0, 0), ops=("sum",)).result("sum")
        b = Partial.of(sorted(values), last=(0, 0, 0), ops=("sum",)).result("sum")
        assert a == b == 20.0


class TestOps:
    def test_parse_and_names(self) -> None:
        """One op ships under the plain name; several under name/op; junk falls back to mean."""
        assert parse_ops("mean,max") == ("mean", "max")
        assert parse_ops("bogus") == ("mean",)
        assert output_names("loss", ("mean",)) == ["loss"]
        assert output_names("loss", ("mean", "max")) == ["loss/mean", "loss/max"]


def _acc(per_rank: dict[int, list[object]]) -> StepAcc:
    return StepAcc({r: Contribution(1, list(evs)) for r, evs in per_rank.items()})  # type: ignore[arg-type]


class TestReduceStep:
    @settings(max_examples=150, deadline=None)
    @given(
        st.dictionaries(
            st.integers(0, 15),
            st.lists(st.lists(FLOATS, min_size=1, max_size=3), min_size=1, max_size=3),
            min_size=1,
            max_size=8,
        ),
        st.sampled_from(OPS),
    )
    def test_every_value_of_every_rank(self, data: dict[int, list[list[float]]], op: str) -> None:
        """All values of all ranks and calls in a step are reduced with the op asked for."""
        acc = _acc(
            {
                r: [Metrics(10.0 * r + i, 5, {"x": v[0]}, op) for i, v in enumerate(calls)]
                for r, calls in data.items()
            }
        )
        shipped = reduce_step(5, acc, closed=len(data), world_size=len(data))
        flat = [calls[0] for r in sorted(data) for calls in data[r]]
        if op == "last":
            r = max(data)
            expected = data[r][-1][0]
        else:
            expected = oracle(flat, op)
        assert same(shipped.metrics["x"], expected)
        assert shipped.complete and shipped.ranks == len(data)

    def test_timers_max_and_slowest_rank(self) -> None:
        """Timers reduce with max by default and name the slowest rank."""
        acc = _acc({r: [Timer(1.0, 3, "step_time", s)] for r, s in enumerate([1.0, 3.5, 2.0])})
        s = reduce_step(3, acc, closed=3, world_size=3)
        assert s.metrics == {"timing/step_time": 3.5, "timing/step_time/slowest_rank": 1.0}

    def test_several_ops_and_partial(self) -> None:
        """Several ops give name/op; a step missing ranks reports ranklog/ranks_reporting."""
        acc = _acc(
            {
                0: [Metrics(1.0, 0, {"t": 2.0}, "sum,max")],
                1: [Metrics(1.0, 0, {"t": 5.0}, "sum,max")],
            }
        )
        s = reduce_step(0, acc, closed=2, world_size=4)
        assert s.metrics == {"ranklog/ranks_reporting": 2.0, "t/max": 5.0, "t/sum": 7.0}
        assert not s.complete and (s.ranks, s.world_size) == (2, 4)

    def test_texts_pass_through_in_rank_order(self) -> None:
        """Text events are not reduced: every rank's text is kept, in rank order."""
        acc = _acc({1: [Text(1.0, 0, "val/s", "b")], 0: [Text(2.0, 0, "val/s", "a")]})
        s = reduce_step(0, acc, closed=2, world_size=2)
        assert [(t.rank, t.text) for t in s.texts] == [(0, "a"), (1, "b")] and s.metrics == {}

    def test_per_rank_values(self) -> None:
        """With per_rank, each rank's own values travel with the step."""
        acc = _acc({0: [Metrics(1.0, 0, {"x": 1.0})], 1: [Metrics(1.0, 0, {"x": 3.0})]})
        s = reduce_step(0, acc, closed=2, world_size=2, per_rank=True)
        assert s.per_rank == {0: {"x": 1.0}, 1: {"x": 3.0}} and s.metrics == {"x": 2.0}

    @settings(max_examples=200, deadline=None)
    @given(
        st.dictionaries(
            st.integers(0, 63),
            st.tuples(
                st.one_of(st.floats(0, 100), st.just(math.nan)),
                st.dictionaries(st.sampled_from("abcd"), FLOATS, max_size=4),
                st.one_of(
                    st.sampled_from(OPS),
                    st.dictionaries(st.sampled_from("abcd"), st.sampled_from(OPS), max_size=2),
                ),
            ),
            min_size=1,
            max_size=12,
        )
    )
    def test_one_event_per_rank(
        self, data: dict[int, tuple[float, dict[str, float], str | dict[str, str]]]
    ) -> None:
        """A step of one Metrics event per rank (the usual one, gathered column-wise) reduces
        each name over the ranks that logged it, with the lowest such rank's op."""
        acc = _acc({r: [Metrics(ts, 7, values, op)] for r, (ts, values, op) in data.items()})
        shipped = reduce_step(7, acc, closed=len(data), world_size=len(data), per_rank=True)
        expected: dict[str, float] = {}
        for name in sorted({n for _, values, _ in data.values() for n in values}):
            ranks = [r for r in sorted(data) if name in data[r][1]]
            op = data[ranks[0]][2]
            op = op if isinstance(op, str) else op.get(name, "mean")
            if op == "last":  # the latest timestamp wins (ties: the highest rank); NaN never
                timed = [r for r in ranks if data[r][0] == data[r][0]]
                last = max(timed, key=lambda r: (data[r][0], r)) if timed else None
                expected[name] = math.nan if last is None else data[last][1][name]
            else:
                expected[name] = oracle([data[r][1][name] for r in ranks], op)
        assert shipped.metrics.keys() == expected.keys()
        for name, value in expected.items():
            assert same(shipped.metrics[name], value), name
        top = 0.0
        for r in sorted(data):
            top = data[r][0] if data[r][0] > top else top
        assert same(shipped.ts, top if top > 0 else math.nan)
        assert shipped.per_rank == {r: v for r, (_, v, _) in sorted(data.items()) if v}


@pytest.mark.parametrize("op", OPS)
def test_single_rank(op: str) -> None:
    """A single rank's single value reduces to itself (count to 1, std to 0)."""
    s = reduce_step(0, _acc({0: [Metrics(1.0, 0, {"x": 4.0}, op)]}), closed=1, world_size=1)
    assert s.metrics["x"] == {"count": 1.0, "std": 0.0}.get(op, 4.0)


def test_std_of_huge_values_does_not_overflow() -> None:
    """Squares past the float range give inf, as numpy does, instead of an exception."""
    p = Partial.of([1e160, 3e160], last=(0, 0, 0), ops=("std",))
    assert p.result("std") == oracle([1e160, 3e160], "std") == math.inf


class TestSignedZero:
    """IEEE's sign of zero: values that are all -0.0 sum (and average) to -0.0."""

    @pytest.mark.parametrize("exact", [False, True])
    @pytest.mark.parametrize(
        ("values", "negative"),
        [([-0.0], True), ([-0.0, -0.0, -0.0], True), ([-0.0, 0.0], False), ([1.0, -1.0], False),
         ([0.0], False)],
    )  # fmt: skip
    def test_one_partial(self, values: list[float], negative: bool, exact: bool) -> None:
        """mean and sum of a partial keep the sign IEEE addition gives."""
        for op in ("mean", "sum"):
            p = Partial.of(values, last=(1.0, 0, values[-1]), ops=(op,), exact=exact)
            got = p.result(op)
            assert got == 0.0 and (math.copysign(1.0, got) < 0) == negative, (values, op)

    def test_merged_partials(self) -> None:
        """Merged exactly (a fan-in), -0.0 from every reader stays -0.0; one +0.0 makes +0.0."""
        neg = [Partial.of([-0.0, -0.0], last=(1.0, r, -0.0), ops=("sum",), exact=True)
               for r in range(3)]  # fmt: skip
        total = neg[0].merge(neg[1]).merge(neg[2]).result("sum")
        assert math.copysign(1.0, total) < 0
        pos = Partial.of([0.0], last=(1.0, 9, 0.0), ops=("sum",), exact=True)
        assert math.copysign(1.0, neg[0].merge(pos).result("sum")) > 0

    def test_every_rank_logs_minus_zero(self) -> None:
        """A step where every rank logged -0.0 ships -0.0 for mean and sum, as for min and max."""
        acc = _acc({r: [Metrics(1.0, 0, {"z": -0.0}, "mean,sum,min,max")] for r in range(4)})
        shipped = reduce_step(0, acc, closed=4, world_size=4)
        for op in ("mean", "sum", "min", "max"):
            value = shipped.metrics[f"z/{op}"]
            assert value == 0.0 and math.copysign(1.0, value) < 0, op
        acc = _acc({r: [Metrics(1.0, 0, {"z": -0.0})] for r in range(4)})  # the usual mean
        value = reduce_step(0, acc, closed=4, world_size=4).metrics["z"]
        assert math.copysign(1.0, value) < 0

    @pytest.mark.parametrize("order", [(0.0, -0.0), (-0.0, 0.0)], ids=["plus-first", "minus-first"])
    @pytest.mark.parametrize("exact", [False, True])
    def test_min_and_max_of_both_zeros_ignore_order(
        self, order: tuple[float, float], exact: bool
    ) -> None:
        """min of 0.0 and -0.0 is -0.0, max is 0.0, in one partial or merged, either order."""
        one = Partial.of(list(order), last=(1.0, 0, order[-1]), ops=("min", "max"), exact=exact)
        a, b = (Partial.of([v], last=(1.0, r, v), ops=("min", "max"), exact=exact)
                for r, v in enumerate(order))  # fmt: skip
        for p in (one, a.merge(b)):
            lo, hi = p.result("min"), p.result("max")
            assert math.copysign(1.0, lo) < 0 and math.copysign(1.0, hi) > 0, (lo, hi)


def _bits(metrics: dict[str, float]) -> dict[str, bytes]:
    """Each value's float64 bits (NaN, -0.0 and 0.0 told apart exactly)."""
    import struct

    return {k: struct.pack("<d", v) for k, v in metrics.items()}


#: what ranks log in one step: 1-5 ranks, each 1-4 of a few names, any float
RANK_VALUES: Final = st.lists(
    st.dictionaries(st.sampled_from(["a", "b", "c/d", "e"]), FLOATS | st.floats(),
                    min_size=1, max_size=4),
    min_size=1, max_size=5,
)  # fmt: skip


class TestUsualStepColumns:
    """The usual step (one Metrics event per rank, one spec of mean, sum or count) is reduced
    on columns, without an object per name: the same bits as the general path."""

    @settings(max_examples=300, deadline=None)
    @given(
        RANK_VALUES,
        st.sampled_from(["mean", "sum", "count"]),
        st.booleans(),
    )  # fmt: skip
    def test_same_bits_as_the_general_path(
        self, ranks: list[dict[str, float]], spec: str, same_names: bool
    ) -> None:
        """For any values (NaN, infinities, -0.0, huge), any number of ranks, the same or
        other names per rank: the columns give what the general path gives, bit for bit."""
        from ranklog.shippers._steps import StepPartial

        if same_names:
            ranks = [{k: r.get(k, 1.0) for k in ranks[0]} for r in ranks]
        acc = _acc({i: [Metrics(1.0 + i, 0, dict(v), spec)] for i, v in enumerate(ranks)})
        fast = StepPartial.build(0, acc)
        general = StepPartial.build(0, acc, specs={})  # specs given: the general path
        n = len(ranks)
        got = fast.finish(closed=n, world_size=n)
        want = general.finish(closed=n, world_size=n)
        assert _bits(got.metrics) == _bits(want.metrics)
        assert general.summed is None
        merged = fast.merge(StepPartial(0)).finish(closed=n, world_size=n)
        assert _bits(merged.metrics) == _bits(want.metrics)

    @settings(max_examples=300, deadline=None)
    @given(
        RANK_VALUES,
        st.sampled_from(["mean", "sum", "count", "max", "mean,max", "median", "last", "mean,last"]),
        st.booleans(),
        st.booleans(),
    )  # fmt: skip
    def test_packed_rows_give_what_dicts_give(
        self, ranks: list[dict[str, float]], spec: str, same_names: bool, per_rank: bool
    ) -> None:
        """Values a shipper read packed (MetricsPacked: one names tuple per layout, the
        values as rows or still as their little-endian bytes, as the shipper's reader keeps
        them) reduce to the same bits as the same values read as Metrics events, for any
        spec, names in any order and per-rank values: live shipping of format 2 equals its
        replay."""
        from ranklog.schemas import MetricsPacked
        from ranklog.shippers._steps import StepPartial

        if same_names:
            ranks = [{k: r.get(k, 1.0) for k in ranks[0]} for r in ranks]
        canon: dict[tuple[str, ...], tuple[str, ...]] = {}
        rows, packed, plain = {}, {}, {}
        for i, v in enumerate(ranks):
            names = canon.setdefault(tuple(v), tuple(v))
            values = tuple(v.values())
            rows[i] = [MetricsPacked(1.0 + i, 0, names, values, spec)]
            data = struct.pack(f"<{len(values)}d", *values)
            packed[i] = [MetricsPacked(1.0 + i, 0, names, (), spec, data)]
            plain[i] = [Metrics(1.0 + i, 0, dict(v), spec)]
        n = len(ranks)
        for exact in (False, True):
            b = StepPartial.build(0, _acc(plain), per_rank=per_rank, exact=exact)
            want = b.finish(closed=n, world_size=n)
            theirs = {r: _bits(d) for r, d in (want.per_rank or {}).items()}
            for form in (rows, packed):
                a = StepPartial.build(0, _acc(form), per_rank=per_rank, exact=exact)
                got = a.finish(closed=n, world_size=n)
                assert _bits(got.metrics) == _bits(want.metrics)
                assert list(got.metrics) == sorted(got.metrics)
                mine = got.per_rank or {}
                assert {r: _bits(d) for r, d in mine.items()} == theirs
                assert bool(mine) == (per_rank and any(ranks))

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.25, 1e300, math.inf, math.nan, 3.0]),
                 min_size=0, max_size=4),
        st.sampled_from(["mean", "sum", "count", "max", "mean,max", "last"]),
        st.floats(allow_nan=True),
        st.booleans(),
    )  # fmt: skip
    def test_one_rank_at_once_is_the_general_path(
        self, row: list[float], spec: str, ts: float, as_bytes: bool
    ) -> None:
        """One rank's step of packed values (the shortcut of StepPartial._one_packed) ships
        what the general path ships: the same metrics bit for bit, ranks and time; values
        that are not finite, other specs and no names take the general path."""
        from ranklog.schemas import MetricsPacked
        from ranklog.shippers._steps import StepPartial

        names = tuple(f"m{i}" for i in range(len(row)))
        ev = (
            MetricsPacked(ts, 0, names, (), spec, struct.pack(f"<{len(row)}d", *row))
            if as_bytes
            else MetricsPacked(ts, 0, names, tuple(row), spec)
        )
        quick = StepPartial._one_packed(0, _acc({3: [ev]}))
        general = StepPartial.build(0, _acc({3: [ev]}), specs={})  # specs given: general
        want = general.finish(closed=1, world_size=1)
        if quick is None:
            assert (
                not row or spec not in ("mean", "sum", "count") or not all(map(math.isfinite, row))
            )
            return
        got = quick.finish(closed=1, world_size=1)
        assert _bits(got.metrics) == _bits(want.metrics)
        assert list(got.metrics) == list(want.metrics)
        assert (got.ranks, got.complete) == (want.ranks, want.complete)
        assert struct.pack("<d", got.ts) == struct.pack("<d", want.ts)

    def test_one_rank_with_late_values_is_not_taken_at_once(self) -> None:
        """A rank's step that carries late values (or holds two events) is left to the
        general path, which ships them."""
        from ranklog.schemas import MetricsPacked
        from ranklog.shippers._steps import StepPartial

        ev = MetricsPacked(1.0, 5, ("a",), (1.0,), "mean")
        late = _acc({0: [ev]})
        late.ranks[0].late.append(MetricsPacked(1.0, 2, ("a",), (7.0,), "mean"))  # type: ignore[arg-type]
        assert StepPartial._one_packed(5, late) is None
        assert StepPartial.build(5, late).late
        assert StepPartial._one_packed(5, _acc({0: [ev, ev]})) is None

    def test_packed_rows_and_bytes_in_one_step(self) -> None:
        """A step whose ranks hold packed values in both forms (a row, and bytes) reduces
        as the same values read as Metrics events: the columns are not misaligned."""
        from ranklog.schemas import MetricsPacked
        from ranklog.shippers._steps import StepPartial

        names = ("a", "b", "c")
        vals = [(1.0, 2.0, 3.0), (4.0, 8.0, 16.0), (0.5, -1.0, 2.5)]
        mixed = {
            0: [MetricsPacked(1.0, 0, names, vals[0])],
            1: [MetricsPacked(1.0, 0, names, (), "mean", struct.pack("<3d", *vals[1]))],
            2: [MetricsPacked(1.0, 0, names, vals[2])],
        }
        plain = {r: [Metrics(1.0, 0, dict(zip(names, v, strict=True)))] for r, v in enumerate(vals)}
        got = StepPartial.build(0, _acc(mixed)).finish(closed=3, world_size=3)
        want = StepPartial.build(0, _acc(plain)).finish(closed=3, world_size=3)
        assert _bits(got.metrics) == _bits(want.metrics)
        assert got.metrics["c"] == (3.0 + 16.0 + 2.5) / 3

    def test_the_orders_of_names_kept_are_bounded(self) -> None:
        """Names that change every step (a new list each time) keep no more than
        ``_ORDERS.limit`` names in the cache of sort orders, and every step is still shipped
        with its names in order."""
        from ranklog.shippers import _gather
        from ranklog.shippers._gather import Summed

        n = 1_000
        for s in range(2 * _gather._ORDERS.limit // n + 3):
            names = [f"eval/{s}/m{(i * 7919) % n:04d}" for i in range(n)]  # not sorted
            got = Summed(0, "mean", names, [2] * n, [float(i) for i in range(n)], 2)
            out = got.sorted_results()
            assert list(out) == sorted(names)
            assert out[names[5]] == 2.5
            assert _gather._ORDERS.held <= _gather._ORDERS.limit

    def test_the_usual_step_takes_the_columns(self) -> None:
        """One rank or several, finite values: the step is kept as columns (no Named)."""
        from ranklog.shippers._steps import StepPartial

        for n in (1, 3):
            acc = _acc({r: [Metrics(1.0, 0, {"a": 1.0, "b": -0.0}, "mean")] for r in range(n)})
            part = StepPartial.build(0, acc)
            assert part.summed is not None and part.metrics == {}
            shipped = part.finish(closed=n, world_size=n).metrics
            assert shipped["a"] == 1.0 and math.copysign(1.0, shipped["b"]) < 0
