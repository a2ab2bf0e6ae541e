"""Every durable target passes the same exactly-once compliance test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ranklog.shippers.targets.jsonl import JsonlTarget, read_jsonl

from .compliance import (
    Backend,
    Flaky,
    chaos,
    check,
    check_late,
    kill_and_restart,
    make_late_spool,
    run_once,
)
from .example_target.csv_target import CsvTarget


def _jsonl_back(work: Path) -> list[tuple[int, dict[str, float]]]:
    return [(x["step"], x["metrics"]) for x in read_jsonl(work / "out.jsonl") if "step" in x]


def _jsonl_params(work: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for x in read_jsonl(work / "out.jsonl"):
        merged.update(x.get("params", {}))
    return merged


def _csv_back(work: Path) -> list[tuple[int, dict[str, float]]]:
    """Steps as the CSV holds them: rows up to each step's closing row (``step,,``)."""
    out: list[tuple[int, dict[str, float]]] = []
    values: dict[str, float] = {}
    for row in (work / "out.csv").read_text().splitlines():
        step, name, value = row.split(";", 2)
        if name:
            values[name] = float(value)
        else:
            out.append((int(step), values))
            values = {}
    assert not values, "rows after the last complete step"
    return out


BACKENDS = [
    Backend("jsonl", lambda work: JsonlTarget(work / "out.jsonl"), _jsonl_back,
            read_params=_jsonl_params),
    # the example of docs/targets.md: a plug-in passes the same suite
    Backend("csv-example", lambda work: CsvTarget(work / "out.csv", ";"), _csv_back,
            late=False),
]  # fmt: skip


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param  # type: ignore[no-any-return]


class TestCompliance:
    def test_every_step_once(self, backend: Backend, made: Path, work: Path) -> None:
        """A plain run ships every step once, in order, with the reduced value."""
        run_once(made, backend.make(work))
        check(backend, work)

    def test_rerun_sends_nothing_twice(self, backend: Backend, made: Path, work: Path) -> None:
        """Shipping again without the cursor adds nothing: the target knows its last step."""
        run_once(made, backend.make(work))
        (made / "cursors" / "compliance.json").unlink()
        run_once(made, backend.make(work))
        check(backend, work)

    @pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
    @pytest.mark.parametrize(
        ("method", "n"),
        [("open", 1), ("write_params", 1), ("write", 1), ("write", 3), ("flush", 1),
         ("flush", 4), ("commit", 1), ("commit", 3)],
    )  # fmt: skip
    def test_killed_anywhere(
        self,
        backend: Backend,
        made: Path,
        work: Path,
        method: str,
        n: int,
        after: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Killed before or after any call, then restarted: each step exactly once."""
        kill_and_restart(backend, made, work, method, n, monkeypatch, after=after)
        check(backend, work)

    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_killed_again_and_again(
        self, backend: Backend, made: Path, work: Path, seed: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A dozen deaths at random calls, then a clean run: each step exactly once."""
        chaos(backend, made, work, seed, monkeypatch)
        check(backend, work)

    @pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
    @pytest.mark.parametrize(("method", "n"), [("write", 2), ("flush", 2), ("open", 1)])
    def test_failure_is_retried_without_duplicates(
        self,
        backend: Backend,
        made: Path,
        work: Path,
        method: str,
        n: int,
        after: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A call that fails (before or after it took effect) is retried; nothing twice."""
        import ranklog.shippers._engine as engine

        monkeypatch.setattr(engine, "BATCH_STEPS", 7)
        monkeypatch.setattr(engine.time, "sleep", lambda s: None)
        flaky = Flaky(backend.make(work), method, n, after=after)
        run_once(made, flaky)  # type: ignore[arg-type]
        assert flaky.failed == 1
        check(backend, work)


class TestLateCompliance:
    """``--late ship``: late values reach a target once too, whatever is killed when."""

    def test_every_late_value_once(self, backend: Backend, spool: Path, work: Path) -> None:
        """A plain run, then one without the cursor: each step's values and late values once."""
        make_late_spool(spool)
        run_once(spool, backend.make(work), "ship")
        check_late(backend, work)
        (spool / "cursors" / "compliance.json").unlink()
        run_once(spool, backend.make(work), "ship")
        check_late(backend, work)

    @pytest.mark.parametrize(
        ("method", "n", "after"),
        [("write", 3, True), ("write", 9, False), ("flush", 4, True), ("commit", 3, False),
         ("commit", 9, False)],
    )  # fmt: skip
    def test_killed_anywhere(
        self,
        backend: Backend,
        spool: Path,
        work: Path,
        method: str,
        n: int,
        after: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Killed before or after a call, then restarted: late values once, steps once."""
        make_late_spool(spool)
        kill_and_restart(backend, spool, work, method, n, monkeypatch, after=after, late="ship")
        check_late(backend, work)
