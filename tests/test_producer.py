"""The producer Run: what training code calls, and what ends up in the spool."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch  # ./tools/test installs torch==2.13.0 (the CPU build)

import ranklog
from ranklog.producer import detect_rank
from ranklog.schemas import Metrics, Params, RankEnd, RankStart, StepEnd, Text, Timer
from ranklog.spool import SpoolLayout, read_run
from ranklog.testing import events_by_incarnation, read_events


def _run(spool: Path, **kw: object) -> ranklog.Run:
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return ranklog.init(spool, handle_signals=False, **kw)  # type: ignore[arg-type]


def _metrics(spool: Path) -> list[Metrics]:
    return [e for e in read_events(spool) if isinstance(e, Metrics)]


class TestInit:
    def test_writes_rank_start_at_once(self, spool: Path) -> None:
        """init writes rank_start to disk before returning, so shippers see the rank."""
        run = _run(spool, rank=2, world_size=4, local_rank=2)
        try:
            (start,) = read_events(spool)
            assert isinstance(start, RankStart)
            assert (start.rank, start.world_size, start.local_rank) == (2, 4, 2)
            assert start.run_id == run.run_id == read_run(spool).run_id
            assert start.incarnation == run.incarnation == 1
        finally:
            run.close()

    def test_spool_from_environment(self, spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a path, the spool comes from $RANKLOG_SPOOL."""
        monkeypatch.setenv("RANKLOG_SPOOL", str(spool))
        with ranklog.init(rank=0, world_size=1, handle_signals=False) as run:
            assert run.spool == spool

    def test_no_spool_is_a_clear_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """No path and no $RANKLOG_SPOOL raises ConfigError saying how to fix it."""
        monkeypatch.delenv("RANKLOG_SPOOL", raising=False)
        with pytest.raises(ranklog.ConfigError, match="RANKLOG_SPOOL"):
            ranklog.init()

    def test_bad_durability(self, spool: Path) -> None:
        """An unknown durability level is refused."""
        with pytest.raises(ranklog.ConfigError, match="durability"):
            _run(spool, durability="sometimes")

    def test_restart_is_a_new_incarnation(self, spool: Path) -> None:
        """A second init of the same rank writes incarnation 2 of the same run."""
        with _run(spool) as a:
            pass
        with _run(spool) as b:
            pass
        assert (a.incarnation, b.incarnation) == (1, 2) and a.run_id == b.run_id
        assert sorted(events_by_incarnation(spool)) == [(0, 1), (0, 2)]


class TestRankDetection:
    @pytest.mark.parametrize(
        ("env", "expected"),
        [
            ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1, "torchrun")),
            (
                {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"},
                (5, 16, 1, "slurm"),
            ),
            (
                {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
                (2, 4, 0, "openmpi"),
            ),
            ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, None, "pmi")),
            (
                {"RANK": "7", "WORLD_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
                (7, 8, None, "torchrun"),
            ),
            ({}, (0, 1, None, "default")),
        ],
    )  # fmt: skip
    def test_launchers(self, env: dict[str, str], expected: tuple[object, ...]) -> None:
        """torchrun, SLURM, Open MPI and PMI variables are read; torchrun wins over SLURM."""
        info = detect_rank(env=env)
        assert (info.rank, info.world_size, info.local_rank, info.source) == expected

    def test_arguments_win(self) -> None:
        """Explicit arguments override the environment."""
        info = detect_rank(1, 2, 0, env={"RANK": "3", "WORLD_SIZE": "8"})
        assert (info.rank, info.world_size, info.local_rank) == (1, 2, 0)

    @pytest.mark.parametrize(
        "env", [{"RANK": "x"}, {"SLURM_PROCID": "-1"}, {"RANK": "4", "WORLD_SIZE": "4"}]
    )
    def test_bad_environment_names_the_variable(self, env: dict[str, str]) -> None:
        """A malformed launcher variable is a ConfigError naming it."""
        with pytest.raises(ranklog.ConfigError, match=next(iter(env))[:4]):
            detect_rank(env=env)


class TestLogMetrics:
    def test_values_prefix_and_reduce(self, spool: Path) -> None:
        """Names are prefixed with ``prefix/``; reduce is recorded as asked."""
        with _run(spool) as run:
            run.log_metrics({"loss": 0.5, "acc": 1}, step=3, prefix="train")
            run.log_metrics({"tokens": 10}, step=3, reduce=("sum", "max"))
            run.log_metrics({"a": 1.0, "b": 2.0}, step=3, reduce={"a": "min", "b": ["median"]})
        m = _metrics(spool)
        assert m[0].values == {"train/loss": 0.5, "train/acc": 1.0} and m[0].reduce == "mean"
        assert m[1].reduce == "sum,max"
        assert m[2].reduce == {"a": "min", "b": "median"}

    def test_nan_and_inf_are_kept(self, spool: Path) -> None:
        """NaN and infinities are legal values and survive the spool."""
        with _run(spool) as run:
            run.log_metrics({"nan": math.nan, "inf": math.inf, "ninf": -math.inf}, step=0)
        (m,) = _metrics(spool)
        assert math.isnan(m.values["nan"]) and m.values["inf"] == math.inf
        assert m.values["ninf"] == -math.inf

    def test_numpy_and_torch_scalars(self, spool: Path) -> None:
        """numpy and torch scalars and one-element arrays are accepted as floats."""
        with _run(spool) as run:
            run.log_metrics(
                {
                    "np64": np.float64(1.5),
                    "np32": np.float32(2.5),
                    "npint": np.int64(3),
                    "nparr": np.array([4.5]),
                    "t0": torch.tensor(5.5),
                    "t1": torch.tensor([6.5]),
                    "tbf16": torch.tensor(7.0, dtype=torch.bfloat16),
                    "bool": True,
                },
                step=0,
            )
        (m,) = _metrics(spool)
        assert m.values == {
            "np64": 1.5, "np32": 2.5, "npint": 3.0, "nparr": 4.5,
            "t0": 5.5, "t1": 6.5, "tbf16": 7.0, "bool": 1.0,
        }  # fmt: skip
        assert all(type(v) is float for v in m.values.values())

    @pytest.mark.parametrize(
        "bad",
        ["0.5", [1.0], {"x": 1.0}, None, 1 + 2j, np.zeros(3), torch.zeros(2, 2)],
        ids=["str", "list", "dict", "none", "complex", "ndarray3", "tensor4"],
    )
    def test_non_numbers_raise_naming_the_key(self, spool: Path, bad: object) -> None:
        """A value that is not a real number raises TypeError naming the key; nothing is logged."""
        with _run(spool) as run, pytest.raises(TypeError, match="'train/bad'"):
            run.log_metrics({"good": 1.0, "bad": bad}, step=0, prefix="train")
        assert _metrics(spool) == []

    @pytest.mark.parametrize("step", [-1, 1.0, "3", None, True])
    def test_bad_step(self, spool: Path, step: object) -> None:
        """A negative or non-integer step raises ValueError."""
        with _run(spool) as run, pytest.raises(ValueError, match="step"):
            run.log_metrics({"x": 1.0}, step=step)  # type: ignore[arg-type]

    def test_numpy_step(self, spool: Path) -> None:
        """Integer-like steps (numpy ints) are accepted."""
        with _run(spool) as run:
            run.log_metrics({"x": 1.0}, step=np.int64(7))  # type: ignore[arg-type]
        assert _metrics(spool)[0].step == 7

    def test_unknown_reduce_op(self, spool: Path) -> None:
        """An unknown reduce op is refused, naming the choices."""
        with _run(spool) as run, pytest.raises(TypeError, match="average"):
            run.log_metrics({"x": 1.0}, step=0, reduce="average")

    def test_caller_dict_is_not_kept(self, spool: Path) -> None:
        """Mutating the dict after the call does not change what was logged."""
        values = {"x": 1.0}
        with _run(spool) as run:
            run.log_metrics(values, step=0)
            values["x"] = 2.0
        assert _metrics(spool)[0].values == {"x": 1.0}

    def test_late_step_is_recorded_and_warned_once(self, spool: Path) -> None:
        """A step below one already closed is written, with a single warning per rank."""
        with _run(spool) as run:
            run.step_end(10)
            with pytest.warns(ranklog.RanklogWarning, match="late"):
                run.log_metrics({"x": 1.0}, step=5)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                run.log_metrics({"x": 2.0}, step=6)
        assert [m.step for m in _metrics(spool)] == [5, 6]


class TestOtherEvents:
    def test_timer_and_timing(self, spool: Path) -> None:
        """timer() measures its block; log_timing records a duration; both default to max."""
        with _run(spool) as run:
            with run.timer("step_time", step=1) as t:
                pass
            run.log_timing("data_wait", 0.031, step=1)
            run.log_timing("io", np.float32(0.5), step=1, reduce="mean")
        timers = [e for e in read_events(spool) if isinstance(e, Timer)]
        assert [(x.name, x.reduce) for x in timers] == [
            ("step_time", "max"), ("data_wait", "max"), ("io", "mean"),
        ]  # fmt: skip
        assert timers[0].seconds == t.seconds >= 0 and timers[1].seconds == 0.031

    def test_timer_records_on_exception(self, spool: Path) -> None:
        """A timed block that raises is still timed."""
        with _run(spool) as run, pytest.raises(RuntimeError), run.timer("eval", step=2):
            raise RuntimeError("boom")
        assert [e.name for e in read_events(spool) if isinstance(e, Timer)] == ["eval"]

    def test_text(self, spool: Path) -> None:
        """log_text stores the text as given; non-str text is refused."""
        with _run(spool) as run:
            run.log_text("val/sample_0", "prompt ... answer ...", step=4)
            with pytest.raises(TypeError, match="val/bad"):
                run.log_text("val/bad", 3, step=4)  # type: ignore[arg-type]
        (t,) = [e for e in read_events(spool) if isinstance(e, Text)]
        assert (t.name, t.text, t.step) == ("val/sample_0", "prompt ... answer ...", 4)

    def test_hyperparams_flattened_and_redacted(self, spool: Path) -> None:
        """Nested dicts are flattened with '.', secret-looking keys are redacted."""
        cfg = {
            "optim": {"lr": 3e-4, "betas": (0.9, 0.95)},
            "wandb": {"api_key": "abc123", "project": "p"},
            "hf_token": "hf_xyz",
            "db": {"password": "hunter2", "secret_sauce": 1},
            "seed": np.int64(3),
            "path": Path("/data"),
        }
        with _run(spool) as run:
            run.log_hyperparams(cfg)
        (p,) = [e for e in read_events(spool) if isinstance(e, Params)]
        assert p.lists == {"optim.betas": [0.9, 0.95]}  # a list stays a list
        assert p.values == {
            "optim.lr": 3e-4,
            "wandb.api_key": "<redacted>",
            "wandb.project": "p",
            "hf_token": "<redacted>",
            "db.password": "<redacted>",
            "db.secret_sauce": "<redacted>",
            "seed": 3,
            "path": "/data",
        }

    def test_close_writes_rank_end_and_seals(self, spool: Path) -> None:
        """close() ends with rank_end and a sealed segment; closing twice is harmless."""
        run = _run(spool)
        run.step_end(0)
        run.close()
        run.close()
        events = read_events(spool)
        assert isinstance(events[-1], RankEnd) and events[-1].status == "ok"
        assert isinstance(events[-2], StepEnd)
        from ranklog.spool import read_segment

        (seg,) = SpoolLayout(spool).segments(0)
        assert read_segment(seg.path).sealed

    def test_logging_after_close_warns_once(self, spool: Path) -> None:
        """A call after close() is ignored with one warning, and raises nothing."""
        run = _run(spool)
        run.close()
        with pytest.warns(ranklog.RanklogWarning, match="after close"):
            run.log_metrics({"x": 1.0}, step=0)
            run.step_end(0)
        assert not any(isinstance(e, Metrics) for e in read_events(spool))

    def test_context_manager_records_errors(self, spool: Path) -> None:
        """Leaving the with-block by an exception records rank_end status 'error'."""
        with pytest.raises(ValueError), _run(spool):
            raise ValueError("training diverged")
        end = read_events(spool)[-1]
        assert isinstance(end, RankEnd) and (end.status, end.exit_code) == ("error", 1)


class TestDurability:
    @pytest.mark.parametrize("level", ["step", "fsync"])
    def test_step_end_writes_before_returning(self, spool: Path, level: str) -> None:
        """At durability step/fsync the step's events are in the file when step_end returns."""
        run = _run(spool, durability=level, flush_interval=3600)
        try:
            run.log_metrics({"x": 1.0}, step=0)
            run.step_end(0)
            assert [type(e) for e in read_events(spool)] == [RankStart, Metrics, StepEnd]
        finally:
            run.close()

    def test_buffered_writes_in_the_background(self, spool: Path) -> None:
        """At durability buffered, step_end does not write; the background thread does."""
        run = _run(spool, durability="buffered", flush_interval=0.05)
        try:
            run.log_metrics({"x": 1.0}, step=0)
            run.step_end(0)
            import time

            deadline = time.monotonic() + 5
            while len(read_events(spool)) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [type(e) for e in read_events(spool)] == [RankStart, Metrics, StepEnd]
        finally:
            run.close()

    def test_heartbeats_while_idle(self, spool: Path) -> None:
        """A quiet rank writes heartbeats so shippers know it is alive."""
        import time

        from ranklog.schemas import Heartbeat

        run = _run(spool, flush_interval=0.02, heartbeat_interval=0.05)
        try:
            time.sleep(0.5)
        finally:
            run.close()
        beats = [e for e in read_events(spool) if isinstance(e, Heartbeat)]
        assert 2 <= len(beats) <= 30

    def test_backpressure_waits_and_warns_once(self, spool: Path) -> None:
        """Past max_buffer_bytes a call waits for the writer (warned once); nothing is dropped."""
        run = _run(spool, durability="buffered", flush_interval=3600, max_buffer_bytes=4096)
        try:
            with pytest.warns(ranklog.RanklogWarning, match="wait"):
                for step in range(2000):
                    run.log_metrics({"loss": float(step), "pad": 1.0}, step=step)
        finally:
            run.close()
        assert [m.step for m in _metrics(spool)] == list(range(2000))

    def test_rolls_segments(self, spool: Path) -> None:
        """A long run rolls over into several sealed segments, losing nothing."""
        with _run(spool, max_segment_bytes=64 * 1024) as run:
            for step in range(3000):
                run.log_metrics({"loss": 1.0, "acc": 0.5}, step=step)
                run.step_end(step)
        segs = SpoolLayout(spool).segments(0)
        assert len(segs) > 3
        assert [m.step for m in _metrics(spool)] == list(range(3000))


class TestHistogramsAndImages:
    def test_histogram_from_lists_arrays_and_tensors(self, spool: Path) -> None:
        """Lists, numpy arrays and torch tensors become a flat list of floats."""
        from ranklog.schemas import Histogram

        with _run(spool) as run:
            run.log_histogram("w", [1, 2.5, [3, 4]], step=0)
            run.log_histogram("a", np.arange(4).reshape(2, 2), step=0)
            run.log_histogram("t", torch.tensor([0.5, 1.5]), step=0)
            with pytest.raises(TypeError, match="'bad'"):
                run.log_histogram("bad", ["x"], step=0)
        hs = {e.name: e.values for e in read_events(spool) if isinstance(e, Histogram)}
        assert hs == {"w": [1.0, 2.5, 3.0, 4.0], "a": [0.0, 1.0, 2.0, 3.0], "t": [0.5, 1.5]}

    def test_image_from_bytes_and_figure(self, spool: Path) -> None:
        """Encoded bytes are kept; a matplotlib figure is saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from ranklog.schemas import Image

        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        with _run(spool) as run:
            run.log_image("raw", b"\x89PNG-ish", step=1)
            run.log_image("plot", fig, step=1)
            with pytest.raises(TypeError, match="'nope'"):
                run.log_image("nope", 3, step=1)
        plt.close(fig)
        imgs = {e.name: e for e in read_events(spool) if isinstance(e, Image)}
        assert imgs["raw"].data == b"\x89PNG-ish"
        assert imgs["plot"].data.startswith(b"\x89PNG") and imgs["plot"].format == "png"
