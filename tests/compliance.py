"""The compliance test every target must pass: each step exactly once, whatever is killed when.

A target is described by a :class:`Backend`: how to build a fresh target object
over the same storage (a restarted shipper process builds a new one), and how
to read back what the backend durably holds. :func:`check` compares every step,
name and value read back with the oracle (:func:`expected`, the reduction of
:func:`make_spool`'s values worked out in closed form). Add new backends to
``tests/test_compliance.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ranklog.schemas import ParamValue
from ranklog.shippers import ShippedStep, Shipper, Target
from ranklog.shippers._target import target_identity
from ranklog.spool import RunInfo

from .shiphelp import rank

RANKS = 3
STEPS = 60
PARAMS = {"lr": 0.1, "nested": {"depth": 3}}
#: PARAMS as every target receives them (flattened with ".")
FLAT_PARAMS: dict[str, ParamValue] = {"lr": 0.1, "nested.depth": 3}


@dataclass
class Backend:
    """A target under test."""

    name: str
    #: build a target over the backend storage that lives in the given directory
    make: Callable[[Path], Target]
    #: (step, {name: value}) the backend durably holds, in the order it holds them
    read_back: Callable[[Path], list[tuple[int, dict[str, float]]]]
    #: the backend's name for a ranklog metric name (MLflow sanitizes some)
    key: Callable[[str], str] = field(default=lambda name: name)
    #: relative tolerance of stored values (TensorBoard stores float32); 0: exact
    rel: float = 0.0
    #: the hyperparameters the backend holds, when it keeps them
    read_params: Callable[[Path], dict[str, Any]] | None = None
    #: how the backend stores a parameter's value (MLflow: as text)
    param: Callable[[ParamValue], Any] = field(default=lambda value: value)
    #: the target takes late values (``takes_late``); else the engine leaves them out
    late: bool = True


def make_spool(spool: Path, *, late: bool = False) -> None:
    """RANKS ranks x STEPS steps: a mean, a sum and max, a max timer, params, a text.

    ``late``: values logged for steps their rank had closed, too. After closing each step
    ``s`` with ``s % 10 == 9`` every rank logs ``val/acc`` for ``s`` (the last one after
    the last step: its carrier holds nothing else); after closing step 30, ``val/old`` for
    step 5.
    """
    import warnings

    for r in range(RANKS):
        run = rank(spool, r, RANKS)
        run.log_hyperparams(PARAMS)
        for s in range(STEPS):
            run.log_metrics({"loss": r + s / 1000}, step=s)
            run.log_metrics({"tokens": 100.0 + r + s}, step=s, reduce=("sum", "max"))
            run.log_timing("step_time", 0.01 * (r + 1) + s / 1e4, step=s)
            if s == STEPS - 1:
                run.log_text("val/sample_0", "prompt -> answer", step=s)
            run.step_end(s)
            if not late:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if s % 10 == 9:
                    run.log_metrics({"val/acc": r + s}, step=s)
                if s == 30:
                    run.log_metrics({"val/old": float(r)}, step=5)
        run.close()


def make_late_spool(spool: Path) -> None:
    """:func:`make_spool`'s job with its late values."""
    make_spool(spool, late=True)


def expected_late(step: int) -> dict[str, float]:
    """The late values :func:`make_late_spool` logged for ``step``, reduced."""
    out = {}
    if step % 10 == 9:
        out["val/acc"] = math.fsum(r + step for r in range(RANKS)) / RANKS
    if step == 5:
        out["val/old"] = math.fsum(range(RANKS)) / RANKS
    return out


def check_late(backend: Backend, work: Path) -> None:
    """Each step's values and its late values exactly once, wherever the backend put them."""
    merged: dict[int, dict[str, float]] = {}
    for step, metrics in backend.read_back(work):
        into = merged.setdefault(step, {})
        twice = into.keys() & metrics.keys()
        assert not twice, f"step {step}: {sorted(twice)} held twice"
        into.update(metrics)
    assert sorted(merged) == list(range(STEPS)), sorted(merged)
    for step, metrics in merged.items():
        late = expected_late(step) if backend.late else {}
        _check_step(backend, step, metrics, expected(step) | late)


def expected(step: int) -> dict[str, float]:
    """The reduced values of ``step`` of :func:`make_spool`'s spool, worked out independently."""
    losses = [r + step / 1000 for r in range(RANKS)]
    tokens = [100.0 + r + step for r in range(RANKS)]
    times = [0.01 * (r + 1) + step / 1e4 for r in range(RANKS)]
    return {
        "loss": math.fsum(losses) / RANKS,
        "tokens/sum": math.fsum(tokens),
        "tokens/max": max(tokens),
        "timing/step_time": max(times),
        "timing/step_time/slowest_rank": float(times.index(max(times))),
    }


def expected_loss(step: int) -> float:
    return expected(step)["loss"]


def check(backend: Backend, work: Path) -> None:
    """Each step exactly once, in order, with exactly the oracle's names and values."""
    held = backend.read_back(work)
    assert [s for s, _ in held] == list(range(STEPS)), [s for s, _ in held]
    for step, metrics in held:
        _check_step(backend, step, metrics, expected(step))
    if backend.read_params is not None:
        assert backend.read_params(work) == {k: backend.param(v) for k, v in FLAT_PARAMS.items()}


def _check_step(
    backend: Backend, step: int, metrics: dict[str, float], expected: dict[str, float]
) -> None:
    """The backend holds for ``step`` exactly the ``expected`` names, with their values."""
    want = {backend.key(k): v for k, v in expected.items()}
    assert sorted(metrics) == sorted(want), f"step {step}: names {sorted(metrics)}"
    for name, value in want.items():
        assert metrics[name] == pytest.approx(value, rel=backend.rel, abs=0), (step, name)


class Killed(BaseException):
    """The shipper process 'dies' here: no cleanup runs, nothing more is sent."""


class Flaky:
    """Wraps a target; the n-th call of a method fails with OSError, before or after running."""

    def __init__(self, inner: Target, method: str, n: int, *, after: bool) -> None:
        self.inner, self.method, self.n, self.after = inner, method, n, after
        self.kind, self.spec = inner.kind, inner.spec
        self.steps_in_order = getattr(inner, "steps_in_order", False)
        self.failed = 0

    def identity(self, run: RunInfo) -> str:
        return target_identity(self.inner, run)

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
        self.takes_late = getattr(inner, "takes_late", False)
        self.steps_in_order = getattr(inner, "steps_in_order", False)
        self.method = method
        self.n = n
        self.dead = False

    def identity(self, run: RunInfo) -> str:
        return target_identity(self.inner, run)

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


def shipper(spool: Path, target: Target, late: str = "count") -> Shipper:
    return Shipper(str(spool), target, name="compliance", dead_after=3600, start_grace=0, late=late)


def run_once(spool: Path, target: Target, late: str = "count") -> None:
    shipper(spool, target, late).run_forever(once=True)


def kill_and_restart(
    backend: Backend,
    spool: Path,
    work: Path,
    method: str,
    n: int,
    monkeypatch: pytest.MonkeyPatch,
    *,
    after: bool = False,
    late: str = "count",
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
            run_once(spool, backend.make(work), late)
        monkeypatch.setattr(engine, "save_cursor", real)
    else:
        with pytest.raises(Killed):
            target = KillSwitch(backend.make(work), method, n, after=after)
            run_once(spool, target, late)  # type: ignore[arg-type]
    run_once(spool, backend.make(work), late)


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
