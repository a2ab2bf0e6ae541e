"""Steps a target holds, kept as a set of ranges; and the refusals of what a target holds."""

from __future__ import annotations

import errno
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ranklog.errors import TargetError, TargetHeldError, TransientTargetError
from ranklog.shippers._held import ALL_NAMES, Holding, StepSet, as_step_set, refuse_other
from ranklog.shippers._retry import describe, is_permanent

steps = st.sets(st.integers(0, 400), max_size=80)


class TestStepSet:
    @given(steps, st.integers(-2, 402))
    def test_membership_is_the_set(self, held: set[int], probe: int) -> None:
        """A StepSet holds exactly the steps it was made of, in as few ranges as they allow."""
        s = StepSet(held)
        assert (probe in s) == (probe in held)
        assert len(s) == len(held)
        assert s.last == (max(held) if held else None)
        for (_, hi), (lo, _) in zip(s.ranges(), s.ranges()[1:], strict=False):
            assert lo > hi + 1  # disjoint and not adjacent: merged

    @given(steps, st.lists(st.integers(0, 400), max_size=40))
    def test_add_in_any_order(self, held: set[int], more: list[int]) -> None:
        """Adding steps one by one, in any order, gives the set of all of them."""
        s = StepSet(held)
        for m in more:
            s.add(m)
        assert s == StepSet(held | set(more))

    @given(steps, st.integers(-1, 401))
    def test_below_and_after(self, held: set[int], step: int) -> None:
        """``below`` keeps the steps under a step; ``after`` is the lowest held above it."""
        s = StepSet(held)
        assert s.below(step) == StepSet(h for h in held if h < step)
        assert s.after(step) == min((h for h in held if h > step), default=None)

    def test_int_is_a_high_water_mark(self) -> None:
        """The older ``open()`` answer, an int, means every step up to it; None, none."""
        assert as_step_set(4) == StepSet(range(5))
        assert as_step_set(None) == StepSet()
        assert StepSet.of_ranges([(0, 3), (10, 12), (4, 5)]).describe() == "0-5, 10-12"


class TestRefusals:
    MINE = Holding("run-b", "b")

    def test_another_run_is_refused_naming_both(self) -> None:
        """Steps of another run in one place: refused, naming it, its steps and the remedy."""
        theirs = Holding("run-a", "a")
        with pytest.raises(TargetHeldError, match=r"holds run run-a \(a, steps 0-9\).*run-b"):
            refuse_other("m.jsonl", theirs, self.MINE, StepSet(range(10)), remedy="do X")

    def test_append_or_nothing_held_lets_it_through(self) -> None:
        """With --append-run, or when the place holds no run at all, nothing is refused."""
        theirs = Holding("run-a", "a")
        refuse_other("m", theirs, self.MINE, StepSet(range(3)), remedy="", append=True)
        refuse_other("m", None, self.MINE, StepSet(), remedy="")

    def test_another_run_without_steps_is_refused(self) -> None:
        """Another run that opened the place but wrote no step yet still holds it."""
        theirs = Holding("run-a", "a")
        with pytest.raises(TargetHeldError, match=r"holds run run-a \(a, no step yet\)"):
            refuse_other("m", theirs, self.MINE, StepSet(), remedy="use another file")

    def test_another_selection_is_refused_even_with_append(self) -> None:
        """This run's steps written with other --names: refused (values missing or doubled)."""
        held = Holding("run-b", "b", "train/*")
        with pytest.raises(TargetHeldError, match=r"only names 'train/\*'.*--names 'train/\*'"):
            refuse_other("m", held, self.MINE, StepSet([5]), remedy="", append=True)
        assert self.MINE.names == ALL_NAMES


class TestPermanent:
    @pytest.mark.parametrize(
        "exc",
        [IsADirectoryError(errno.EISDIR, "Is a directory"), NotADirectoryError(errno.ENOTDIR, "x"),
         PermissionError(errno.EACCES, "denied"), OSError(errno.EROFS, "read-only"),
         FileNotFoundError(errno.ENOENT, "no such"), socket.gaierror(socket.EAI_NONAME, "unknown"),
         TargetError("403 forbidden")],
    )  # fmt: skip
    def test_permanent(self, exc: BaseException) -> None:
        """Failures no retry can cure are permanent."""
        assert is_permanent(exc)

    @pytest.mark.parametrize(
        "exc",
        [OSError(errno.ENOSPC, "full"), ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
         TransientTargetError("503"), OSError(errno.ESTALE, "stale"), TimeoutError("slow")],
    )  # fmt: skip
    def test_transient(self, exc: BaseException) -> None:
        """A full disk, a refused connection, a 5xx: worth retrying."""
        assert not is_permanent(exc)

    def test_a_wrapped_unknown_host_is_permanent_and_said_short(self) -> None:
        """A library's wrapped DNS failure is permanent; its retry bookkeeping is not repeated."""
        exc = TransientTargetError(
            "mlflow open: API request to http://nohost.invalid:5000/api failed with exception "
            "HTTPConnectionPool(host='nohost.invalid', port=5000): Max retries exceeded with url "
            "(Caused by NameResolutionError(\"Failed to resolve 'nohost.invalid'\"))"
        )
        assert is_permanent(exc)
        assert describe(exc) == "unknown host nohost.invalid:5000"

    def test_refused_connection_is_said_short(self) -> None:
        """A refused connection says where, without urllib3's Retry(...) text."""
        exc = TransientTargetError(
            "HTTPConnectionPool(host='127.0.0.1', port=5999): Max retries exceeded (Caused by "
            "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection "
            "refused')) Retry(total=0, connect=None)"
        )
        assert describe(exc) == "connection refused by 127.0.0.1:5999"
