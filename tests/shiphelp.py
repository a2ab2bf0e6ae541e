"""Helpers for shipper tests: ranks written in-process, and a shipper run to completion."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ranklog
from ranklog.shippers import ShippedStep, Shipper, Target, make_target
from ranklog.shippers._steps import StepAcc, StepPartial
from ranklog.shippers.targets.jsonl import JsonlTarget, read_jsonl


def rank(spool: Path, r: int, world: int | None, **kw: Any) -> ranklog.Run:
    """A producer for rank ``r`` in this process (no signal handlers)."""
    kw.setdefault("flush_interval", 3600)
    return ranklog.init(spool, rank=r, world_size=world, handle_signals=False, **kw)


def log_steps(run: ranklog.Run, steps: range, *, close: bool = True) -> None:
    """Log ``loss = rank + step/1000`` for each step, closing each."""
    for s in steps:
        run.log_metrics({"loss": run.rank + s / 1000}, step=s)
        if close:
            run.step_end(s)
    run.flush()


def ship(spool: Path, out: Path, *, name: str = "t", **kw: Any) -> Shipper:
    """Run a shipper to JSONL once (drain what is ready) and return it."""
    kw.setdefault("dead_after", 3600)
    kw.setdefault("start_grace", 0)
    shipper = Shipper(str(spool), JsonlTarget(out), name=name, **kw)
    shipper.run_forever(once=True)
    return shipper


def live_and_replayed(spool: Path, tmp: Path, **kw: Any) -> tuple[Path, Path]:
    """``spool`` shipped live to ``tmp/live.jsonl``, compacted to ``tmp/pq`` and replayed
    from there to ``tmp/replay.jsonl`` (``kw``: for both, ``late=``...): the two files."""
    from ranklog.archive import compact, replay

    live, again = tmp / "live.jsonl", tmp / "replay.jsonl"
    ship(spool, live, **kw)
    compact(spool, tmp / "pq")
    replay(tmp / "pq", JsonlTarget(again), **kw)
    return live, again


def lines(out: Path) -> list[dict[str, Any]]:
    """Step lines of a JSONL target (params lines left out)."""
    return [x for x in read_jsonl(out) if "step" in x] if out.exists() else []


def age(spool: Path, rank_: int, seconds: float) -> None:
    """Make a rank's files look ``seconds`` old (as if it stopped writing then)."""
    t = time.time() - seconds
    for p in (spool / "ranks" / f"{rank_:05d}").iterdir():
        os.utime(p, (t, t))


def build_target(kind: str, arg: str, spool: Path, opts: dict[str, Any] | None = None) -> Target:
    """The target of spec ``kind:arg`` with option values (``per_rank`` among them)."""
    values = dict(opts or {})
    per_rank = bool(values.pop("per_rank", False))
    return make_target(f"{kind}:{arg}", spool, values, per_rank=per_rank)


def reduce_step(
    step: int, acc: StepAcc, *, closed: int, world_size: int, per_rank: bool = False
) -> ShippedStep:
    """One step reduced across the ranks of ``acc``, as one shipper does it."""
    part = StepPartial.build(step, acc, per_rank=per_rank)
    return part.finish(closed=closed, world_size=world_size)


def raw_files(dataset: Path) -> list[Path]:
    """The Parquet files of a dataset's raw tables (its steps table left out)."""
    return sorted(p for p in dataset.rglob("*.parquet") if p.parent.name != "steps")
