"""The compliance test every target must pass: each step exactly once, whatever is killed when.

A target is described by a :class:`Backend`: how to build a fresh target object
over the same storage (a restarted shipper process builds a new one), and how
to read back what the backend durably holds. Add new backends to
``tests/test_compliance.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ranklog.schemas import ParamValue
from ranklog.shippers import ShippedStep, Shipper, Target
from ranklog.spool import RunInfo

from .shiphelp import log_steps, rank

RANKS = 3
STEPS = 60


@dataclass
class Backend:
    """A target under test."""

    name: str
    #: build a target over the backend storage that lives in the given directory
    make: Callable[[Path], Target]
    #: (step, metrics) the backend durably holds, in the order it holds them
    read_back: Callable[[Path], list[tuple[int, dict[str, float]]]]


class Killed(BaseException):
    """The shipper process 'dies' here: no cleanup runs, nothing more is sent."""


class Flaky:
    """Wraps a target; the n-th call of a method fails with OSError, before or after running."""

    def __init__(self, inner: Target, method: str, n: int, *, after: bool) -> None:
        self.inner, self.method, self.n, self.after = inner, method, n, after
        self.kind, self.spec = inner.kind, inner.spec
        self.failed = 0

    def _call(self, method: str, *args: Any) -> Any:
        if method == self.method:
            self.n -= 1
            if self.n == 0:
                self.failed += 1
                if self.after:
                    getattr(self.inner, method)(*args)
                raise OSError(f"injected failure of {method}")
        return getattr(self.inner, method)(*args)

    def open(self, run: RunInfo) -> int | None:
        return self._call("open", run)  # type: ignore[no-any-return]

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._call("write_params", params)

    def write(self, steps: list[ShippedStep]) -> None:
        self._call("write", steps)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")


class KillSwitch:
    """Wraps a target and dies at the n-th call of a given method, before or after it runs."""

    def __init__(self, inner: Target, method: str, n: int, *, after: bool = False) -> None:
        self.inner = inner
        self.after = after
        self.kind = inner.kind
        self.spec = inner.spec
        self.method = method
        self.n = n
        self.dead = False

    def _call(self, method: str, *args: Any) -> Any:
        if self.dead:
            return None
        if method == self.method:
            self.n -= 1
            if self.n <= 0:
                self.dead = True
                if self.after:
                    getattr(self.inner, method)(*args)
                raise Killed(method)
        return getattr(self.inner, method)(*args)

    def open(self, run: RunInfo) -> int | None:
        return self._call("open", run)  # type: ignore[no-any-return]

    def write_params(self, params: dict[str, ParamValue]) -> None:
        self._call("write_params", params)

    def write(self, steps: list[ShippedStep]) -> None:
        self._call("write", steps)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        if not self.dead:
            self.inner.close()


def make_spool(spool: Path) -> None:
    """RANKS ranks x STEPS steps of ``loss = rank + step/1000``, with params and text."""
    for r in range(RANKS):
        run = rank(spool, r, RANKS)
        run.log_hyperparams({"lr": 0.1, "nested": {"depth": 3}})
        log_steps(run, range(STEPS - 1))
        run.log_text("val/sample_0", "prompt -> answer", step=STEPS - 1)
        log_steps(run, range(STEPS - 1, STEPS))
        run.close()


def expected_loss(step: int) -> float:
    return sum(r + step / 1000 for r in range(RANKS)) / RANKS


def check(backend: Backend, work: Path) -> None:
    """Each step exactly once, in order, with the right value."""
    held = backend.read_back(work)
    assert [s for s, _ in held] == list(range(STEPS)), [s for s, _ in held]
    for step, metrics in held:
        assert metrics["loss"] == pytest.approx(expected_loss(step))


def shipper(spool: Path, target: Target) -> Shipper:
    return Shipper(str(spool), target, name="compliance", dead_after=3600, start_grace=0)


def run_once(spool: Path, target: Target) -> None:
    shipper(spool, target).run_forever(once=True)


def kill_and_restart(
    backend: Backend,
    spool: Path,
    work: Path,
    method: str,
    n: int,
    monkeypatch: pytest.MonkeyPatch,
    *,
    after: bool = False,
) -> None:
    """Ship with small batches, die at the n-th ``method`` call, restart, finish."""
    import ranklog.shippers._engine as engine

    monkeypatch.setattr(engine, "BATCH_STEPS", 7)
    if method == "commit":
        real = engine.save_cursor
        calls = {"n": n}

        def dying_save(*args: Any) -> None:
            calls["n"] -= 1
            if calls["n"] <= 0:
                raise Killed("commit")
            real(*args)

        monkeypatch.setattr(engine, "save_cursor", dying_save)
        with pytest.raises(Killed):
            run_once(spool, backend.make(work))
        monkeypatch.setattr(engine, "save_cursor", real)
    else:
        with pytest.raises(Killed):
            target = KillSwitch(backend.make(work), method, n, after=after)
            run_once(spool, target)  # type: ignore[arg-type]
    run_once(spool, backend.make(work))


def chaos(
    backend: Backend, spool: Path, work: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Die at random calls, many times over, then finish: still each step exactly once."""
    import ranklog.shippers._engine as engine

    monkeypatch.setattr(engine, "BATCH_STEPS", 5)
    rng = random.Random(seed)
    for _ in range(12):
        method = rng.choice(["write", "flush", "write_params"])
        target = KillSwitch(backend.make(work), method, rng.randint(1, 4), after=rng.random() < 0.5)
        try:
            run_once(spool, target)  # type: ignore[arg-type]
        except Killed:
            continue
    run_once(spool, backend.make(work))
