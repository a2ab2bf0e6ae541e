"""A lost frame never hides in the step it belonged to: such a step ships partial, never wrong.

Every frame of one rank's segment is damaged in turn (a flipped byte, a 4 KiB zero hole)
and the spool shipped: each step must be exactly the reduction over all ranks, or be
marked partial with the ranks it was reduced over, and hold exactly their reduction.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ranklog.archive import compact, replay
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import read_segment
from ranklog.spool._format import FLAG_NAMES

from .shiphelp import age, lines, rank, ship

RANKS = 3
STEPS = 12
DAMAGED = 1  # the rank whose frames are damaged
#: (segment file name, offset) of the damaged rank's frames that hold a layout's Names record
#: (segment format 2)
NAMES_FRAMES: set[tuple[str, int]] = set()


def _values(r: int, step: int) -> dict[str, float]:
    return {"loss": r + step / 100, "tokens": 10.0 * (r + 1)}


def oracle(step: int, ranks: list[int]) -> dict[str, float]:
    """The shipped metrics of ``step`` reduced over ``ranks``, worked out independently."""
    losses = [_values(r, step)["loss"] for r in ranks]
    out = {
        "loss": math.fsum(losses) / len(losses),
        "tokens": math.fsum(_values(r, step)["tokens"] for r in ranks),
        "timing/step_time": max(0.001 * (r + 1) for r in ranks),
        "timing/step_time/slowest_rank": float(max(ranks)),
    }
    if len(ranks) < RANKS:
        out["ranklog/ranks_reporting"] = float(len(ranks))
    return out


def _write(spool: Path, *, mode: str) -> None:
    """RANKS ranks x STEPS steps; ``mode`` "step": a frame per step; "batched": rank 1 writes
    three steps a frame and closes only every other step explicitly."""
    for r in range(RANKS):
        batched = mode == "batched" and r == DAMAGED
        run = rank(spool, r, RANKS, durability="buffered" if batched else "step")
        for step in range(STEPS):
            run.log_metrics({"loss": _values(r, step)["loss"]}, step=step)
            run.log_metrics({"tokens": _values(r, step)["tokens"]}, step=step, reduce="sum")
            run.log_timing("step_time", 0.001 * (r + 1), step=step)
            if not batched or step % 2 == 1:
                run.step_end(step)
            if batched and step % 3 == 2:
                run.flush()
        run.close()


def _frames(spool: Path) -> list[tuple[Path, int, int]]:
    """(segment, start, end) of every frame of the damaged rank, seal included."""
    out = []
    for seg in sorted((spool / "ranks" / f"{DAMAGED:05d}").iterdir()):
        res = read_segment(seg)
        out += [(seg, f.offset, f.end) for f in res.frames]
        data = seg.read_bytes()  # byte 5 of a frame: its flags (FLAG_NAMES: holds a layout)
        NAMES_FRAMES.update((seg.name, f.offset) for f in res.frames
                            if data[f.offset + 5] & FLAG_NAMES)  # fmt: skip
        last = res.frames[-1].end if res.frames else 64
        if res.size > last:
            out.append((seg, last, res.size))  # the seal frame
    return out


def _flip(seg: Path, start: int, end: int) -> None:
    data = bytearray(seg.read_bytes())
    data[(start + end) // 2] ^= 0x5A
    seg.write_bytes(bytes(data))


def _hole(seg: Path, start: int, end: int) -> None:
    data = bytearray(seg.read_bytes())
    stop = min(len(data), start + 4096)
    data[start:stop] = bytes(stop - start)
    seg.write_bytes(bytes(data))


def check_steps(got: list[dict[str, Any]]) -> list[int]:
    """Every step there, each exact or honestly partial; the partial steps."""
    assert [x["step"] for x in got] == list(range(STEPS))
    partial = []
    for x in got:
        if x["complete"]:
            assert x["ranks"] == RANKS
            assert x["metrics"] == pytest.approx(oracle(x["step"], list(range(RANKS))), abs=0)
        else:
            # reduced over the ranks it reports: without the damaged rank, or with what of
            # it arrived whole when it never closed the step (a dead rank's last steps)
            partial.append(x["step"])
            reduced = [r for r in range(RANKS) if r != DAMAGED or x["ranks"] == RANKS]
            assert x["ranks"] == len(reduced) and x["metrics"] == pytest.approx(
                {**oracle(x["step"], reduced), "ranklog/ranks_reporting": len(reduced)}, abs=0
            ), x
    return partial


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for mode in ("step", "batched"):
        spool = tmp_path_factory.mktemp(mode) / "spool"
        _write(spool, mode=mode)
        out[mode] = spool
    return out


class TestLostFrames:
    def test_undamaged_spool_is_exact(self, pristine: dict[str, Path], tmp_path: Path) -> None:
        """Without damage every step is complete and exact (the oracle agrees with the engine)."""
        for spool in pristine.values():
            out = tmp_path / f"{spool.parent.name}.jsonl"
            ship(spool, out)
            assert check_steps(lines(out)) == []

    @pytest.mark.parametrize("mode", ["step", "batched"])
    @pytest.mark.parametrize("damage", [_flip, _hole], ids=["flip", "hole"])
    def test_every_frame_damaged_in_turn(
        self,
        pristine: dict[str, Path],
        tmp_path: Path,
        mode: str,
        damage: Callable[[Path, int, int], None],
    ) -> None:
        """Whichever frame is hit, each step is exactly right or partial with its true ranks."""
        frames = _frames(pristine[mode])
        assert len(frames) >= 6
        for i, (seg, start, end) in enumerate(frames):
            spool = tmp_path / f"s{i}"
            shutil.copytree(pristine[mode], spool, ignore=shutil.ignore_patterns("cursors"))
            damage(spool / seg.relative_to(pristine[mode]), start, end)
            age(spool, DAMAGED, 7200)  # long gone: a tail wiped out (rank_end too) is not pending
            out = tmp_path / f"s{i}.jsonl"
            ship(spool, out)
            partial = check_steps(lines(out))
            if mode == "step" and damage is _flip and (seg.name, start) not in NAMES_FRAMES:
                # one frame per step, each step_end counting its step's events: the frame
                # lost is the only step marked (a frame with a Names record takes the packed
                # values of its layout in the segment: those steps are partial, never wrong)
                assert len(partial) <= 1, (i, partial)

    def test_replay_marks_the_same_steps(self, pristine: dict[str, Path], tmp_path: Path) -> None:
        """Compacted and replayed, a damaged spool ships byte for byte what live shipping did."""
        for mode, spool0 in pristine.items():
            for i, (seg, start, end) in enumerate(_frames(spool0)[::3]):
                spool = tmp_path / f"{mode}{i}"
                shutil.copytree(spool0, spool, ignore=shutil.ignore_patterns("cursors"))
                _hole(spool / seg.relative_to(spool0), start, end)
                age(spool, DAMAGED, 7200)
                live = tmp_path / f"{mode}{i}.jsonl"
                ship(spool, live)
                compact(spool, tmp_path / f"{mode}{i}.pq")
                again = tmp_path / f"{mode}{i}-replay.jsonl"
                replay(tmp_path / f"{mode}{i}.pq", JsonlTarget(again))
                assert again.read_bytes() == live.read_bytes(), (mode, i)

    def test_step_lost_whole_from_the_only_rank_still_shows(self, spool: Path, out: Path) -> None:
        """With one rank, a step whose only frame is lost ships as an empty partial step."""
        run = rank(spool, 0, 1)
        for step in range(5):
            run.log_metrics({"loss": float(step)}, step=step)
            run.step_end(step)
        run.close()
        (seg,) = (spool / "ranks" / "00000").iterdir()
        frame = next(
            f
            for f in read_segment(seg).frames
            if any(getattr(e, "step", -1) == 2 for e in f.events)
        )
        _flip(seg, frame.offset, frame.end)
        ship(spool, out)
        got = lines(out)
        assert [(x["step"], x["complete"], x["ranks"]) for x in got] == [
            (0, True, 1), (1, True, 1), (2, False, 0), (3, True, 1), (4, True, 1),
        ]  # fmt: skip
        assert got[2]["metrics"] == {"ranklog/ranks_reporting": 0.0}


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out.jsonl"
