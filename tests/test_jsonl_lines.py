"""The JSONL target's line of a usual step, written without ``json``: the same bytes."""

from __future__ import annotations

import math
import struct
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ranklog.shippers import ShippedStep
from ranklog.shippers.targets.jsonl import _line, read_jsonl, step_bytes, step_line

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e17, 1e17),
    st.floats(-1e-3, 1e-3),
    st.sampled_from([0.0, -0.0, 1e-4, 1e16, 9999999999999998.0, 1e-5, 0.1 + 0.2]),
    st.builds(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0], st.integers(0, 2**64 - 1)),
)
NAMES = st.one_of(
    st.sampled_from(["loss", "train/m00", "timing/t/slowest_rank", "a:1e5", 'q"uote', "b\\s",
                     "ünï", "tab\there", "1e16", "x:null", "100%", "a%s%d", "x, y"]),
    st.text(min_size=1, max_size=12),
)  # fmt: skip


class TestUsualLine:
    @settings(max_examples=1000, deadline=None)
    @given(st.dictionaries(NAMES, FLOATS, max_size=25), st.integers(0, 2**62), st.booleans(),
           st.integers(1, 10**6))  # fmt: skip
    def test_same_bytes_as_json(
        self, metrics: dict[str, float], step: int, complete: bool, ranks: int
    ) -> None:
        """Any names (escapes, non-ASCII, text that looks like a value) and any floats
        (NaN, infinities, -0.0, tiny, huge, every bit pattern): ``json``'s very bytes."""
        s = ShippedStep(step=step, metrics=dict(sorted(metrics.items())), ranks=ranks,
                        world_size=ranks + 1, complete=complete, ts=1.0)  # fmt: skip
        assert step_bytes(s) == _line(step_line(s))

    def test_the_usual_line_is_plain(self) -> None:
        """A step of ordinary values takes the fast way and reads back as written."""
        import json

        s = ShippedStep(step=7, metrics={"a": 0.25, "b": -0.0, "c": 123456.789}, ranks=8,
                        world_size=8, complete=True, ts=1.0)  # fmt: skip
        line = step_bytes(s)
        back = json.loads(line)
        assert back["metrics"] == {"a": 0.25, "b": -0.0, "c": 123456.789}
        assert math.copysign(1.0, back["metrics"]["b"]) < 0
        assert line == _line(step_line(s))


def test_append_run_is_given_once(tmp_path: Path) -> None:
    """Run B appended after run A with --append-run once: B's later ships of the same
    file go on without repeating it (a third run is still refused)."""
    import subprocess
    import sys

    import ranklog

    from .conftest import python_env

    def job(spool: Path, steps: range) -> None:
        with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
            for s in steps:
                run.log_metrics({"loss": s / 10}, step=s)
                run.step_end(s)

    def ship(spool: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--once", "--quiet",
             "--to", f"jsonl:{out}", *extra],
            env=python_env(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    out = tmp_path / "all.jsonl"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    job(a, range(2))
    assert ship(a).returncode == 0
    job(b, range(2))
    assert ship(b).returncode == 5
    assert ship(b, "--append-run").returncode == 0
    job(b, range(2, 4))
    res = ship(b)
    assert res.returncode == 0, res.stderr
    job(c, range(1))
    assert ship(c).returncode == 5
    steps = [x["step"] for x in read_jsonl(out) if "step" in x]
    assert steps == [0, 1, 0, 1, 2, 3]
