"""The shipper engine end to end: reduction, completeness, incarnations, cursor, damage."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from ranklog.shippers import ShippedStep, Shipper, load_cursor
from ranklog.shippers._engine import LocalTails
from ranklog.shippers.targets.console import ConsoleTarget
from ranklog.shippers.targets.jsonl import JsonlTarget, read_jsonl
from ranklog.testing import crash, read_events

from .shiphelp import age, lines, log_steps, rank, ship


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out.jsonl"


class TestReducedSteps:
    def test_every_step_once_with_the_mean(self, spool: Path, out: Path) -> None:
        """Three ranks, ten steps: one line per step with the mean over ranks, complete."""
        runs = [rank(spool, r, 3) for r in range(3)]
        for run in runs:
            log_steps(run, range(10))
            run.close()
        ship(spool, out)
        got = lines(out)
        assert [x["step"] for x in got] == list(range(10))
        for x in got:
            assert x["metrics"]["loss"] == pytest.approx(1 + x["step"] / 1000)
            assert (x["ranks"], x["world_size"], x["complete"]) == (3, 3, True)
        assert list(got[0]) == ["step", "metrics", "ranks", "world_size", "complete"]

    def test_params_once_then_changes(self, spool: Path, out: Path) -> None:
        """Hyperparameters ship once; a later new key ships alone."""
        run = rank(spool, 0, 1)
        run.log_hyperparams({"lr": 0.1, "model": {"depth": 4}})
        log_steps(run, range(2))
        ship(spool, out)
        run.log_hyperparams({"lr": 0.1, "extra": "x"})
        log_steps(run, range(2, 4))
        run.close()
        ship(spool, out)
        params = [x["params"] for x in read_jsonl(out) if "params" in x]
        assert params == [{"lr": 0.1, "model.depth": 4}, {"extra": "x"}]
        assert [x["step"] for x in lines(out)] == [0, 1, 2, 3]


class TestCompleteness:
    def test_slow_rank_holds_steps_back(self, spool: Path, out: Path) -> None:
        """A live rank that has closed fewer steps holds the later steps back."""
        fast, slow = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(fast, range(10))
        log_steps(slow, range(5))
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == [0, 1, 2, 3, 4]
        log_steps(slow, range(5, 10))
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(10))
        assert all(x["complete"] for x in lines(out))
        fast.close(), slow.close()

    def test_a_later_step_is_a_watermark(self, spool: Path, out: Path) -> None:
        """Without step_end, any event of a later step closes the earlier ones."""
        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(a, range(5), close=False)
        log_steps(b, range(5), close=False)
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == [0, 1, 2, 3]
        a.close(), b.close()

    def test_rank_end_releases_at_once(self, spool: Path, out: Path) -> None:
        """A rank that wrote rank_end no longer holds steps; they ship as partial."""
        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(a, range(6))
        log_steps(b, range(3))
        b.close()
        ship(spool, out)
        got = lines(out)
        assert [x["step"] for x in got] == list(range(6))
        assert [x["complete"] for x in got] == [True] * 3 + [False] * 3
        assert got[4]["metrics"]["ranklog/ranks_reporting"] == 1
        assert got[4]["ranks"] == 1 and "ranklog/ranks_reporting" not in got[0]["metrics"]
        a.close()

    def test_dead_rank_is_released_after_dead_after(self, spool: Path, out: Path) -> None:
        """A rank silent for --dead-after seconds is declared dead; its steps ship partial."""
        a, b = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(a, range(4))
        log_steps(b, range(2))
        ship(spool, out, dead_after=60)
        assert len(lines(out)) == 2
        age(spool, 1, 120)
        ship(spool, out, dead_after=60)
        got = lines(out)
        assert [x["step"] for x in got] == [0, 1, 2, 3] and not got[3]["complete"]
        a.close(), b.close()

    def test_start_grace_waits_for_missing_ranks(self, spool: Path, out: Path) -> None:
        """With a known world size, steps wait for ranks that have not appeared, until grace."""
        runs = [rank(spool, r, 3) for r in range(2)]
        for run in runs:
            log_steps(run, range(3))
            run.close()
        ship(spool, out, start_grace=3600)
        assert lines(out) == []
        ship(spool, out, start_grace=0)
        got = lines(out)
        assert [x["step"] for x in got] == [0, 1, 2]
        assert all(not x["complete"] and x["world_size"] == 3 for x in got)

    def test_late_events_are_counted_not_shipped(self, spool: Path, out: Path) -> None:
        """Events for a step already shipped are counted as late and never shipped twice."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        ship(spool, out)
        with pytest.warns(Warning, match="late"):
            run.log_metrics({"loss": 99.0}, step=2)
        log_steps(run, range(5, 6))
        run.close()
        shipper = ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(6))
        assert lines(out)[2]["metrics"]["loss"] == pytest.approx(0.002)
        assert shipper.stats.late_events == 1
        cursor = load_cursor(spool, "t")
        assert cursor is not None and cursor.late_events == 1
        # a restarted shipper does not count it again
        assert ship(spool, out).stats.late_events == 1


class TestMemory:
    def test_a_lagging_rank_bounds_what_is_held(
        self, spool: Path, out: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Steps held back by a slow rank are capped: fast ranks are read only as it catches up."""
        import ranklog.shippers._tail as tail

        monkeypatch.setattr(tail, "ROUND_BYTES", 2048)
        monkeypatch.setattr(tail, "MAX_PENDING_STEPS", 20)
        fast, slow = rank(spool, 0, 2), rank(spool, 1, 2)
        log_steps(fast, range(500))
        log_steps(slow, range(5))
        tails = ship(spool, out).tails
        assert isinstance(tails, LocalTails) and tails.tail is not None
        assert len(tails.tail.steps) <= 20 + 40
        (fast_seg,) = [s for s in tails.source.segments.values() if s.name.rank == 0]
        assert fast_seg.offset < fast_seg.size  # not read to the end
        log_steps(slow, range(5, 500))
        fast.close(), slow.close()
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(500))

    def test_many_ranks_read_less_each_per_round(
        self, spool: Path, out: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A round reads ROUND_TOTAL_BYTES from all ranks together: with 8 ranks, each
        reads an eighth (what waits in memory does not grow with the ranks), and every
        step still ships once."""
        import ranklog.shippers._tail as tail
        from ranklog.spool import SegmentReader

        monkeypatch.setattr(tail, "ROUND_TOTAL_BYTES", 8 * 1024)
        asked: list[int | None] = []
        real = SegmentReader.read

        def spy(self: SegmentReader, offset: int = 0, **kw: Any) -> Any:
            asked.append(kw.get("max_bytes"))
            return real(self, offset, **kw)

        monkeypatch.setattr(SegmentReader, "read", spy)
        runs = [rank(spool, r, 8) for r in range(8)]
        for run in runs:
            log_steps(run, range(200))
            run.close()
        ship(spool, out)
        assert asked and set(asked) == {1024}
        assert [x["step"] for x in lines(out)] == list(range(200))


class TestIncarnations:
    def test_requeue_keeps_first_closed_values(self, spool: Path, out: Path) -> None:
        """Closed steps keep the first incarnation's values; an unclosed one takes the new."""
        other = rank(spool, 1, 2)
        first = rank(spool, 0, 2)
        log_steps(first, range(10))  # closes 0..9
        log_steps(first, range(10, 12), close=False)  # logs 10, 11 but never closes them
        crash(first)  # killed
        second = rank(spool, 0, 2)  # requeued, resumes from a checkpoint at step 8
        assert second.incarnation == 2
        for s in range(8, 15):
            second.log_metrics({"loss": 100 + s / 1000}, step=s)
            second.step_end(s)
        second.close()
        log_steps(other, range(15))
        other.close()
        shipper = ship(spool, out)
        got = {x["step"]: x["metrics"]["loss"] for x in lines(out)}
        assert sorted(got) == list(range(15))
        assert got[9] == pytest.approx((0 + 1 + 2 * 0.009) / 2)  # first incarnation's value
        # steps 10 and 11 were never closed by the first incarnation (it closes its steps with
        # step_end: logging step 11 does not close step 10): the second's values
        assert got[10] == pytest.approx((100 + 1 + 2 * 0.010) / 2)
        assert got[11] == pytest.approx((100 + 1 + 2 * 0.011) / 2)
        assert shipper.stats.relogged_events == 2  # steps 8 and 9, logged again

    def test_new_incarnation_ends_the_previous(self, spool: Path, out: Path) -> None:
        """The killed incarnation's open tail does not hold steps once a new one exists."""
        first = rank(spool, 0, 1)
        log_steps(first, range(3))
        crash(first)
        second = rank(spool, 0, 1)
        log_steps(second, range(3, 6))
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(6))
        second.close()


class TestCursor:
    def test_restart_carries_on(self, spool: Path, out: Path) -> None:
        """A new shipper process continues from the cursor: nothing twice, nothing lost."""
        run = rank(spool, 0, 1)
        for chunk in (range(50), range(50, 120), range(120, 121)):
            log_steps(run, chunk)
            ship(spool, out)
        run.close()
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(121))
        cursor = load_cursor(spool, "t")
        assert cursor is not None and cursor.last_step == 120
        (seg,) = cursor.segments.values()
        assert seg.done and seg.offset > 64

    def test_target_ahead_of_cursor(self, spool: Path, out: Path) -> None:
        """Steps the target already holds (shipped, cursor not committed) are not sent again."""
        run = rank(spool, 0, 1)
        log_steps(run, range(10))
        ship(spool, out)
        (spool / "cursors" / "t.json").unlink()  # as if killed before the first commit
        log_steps(run, range(10, 12))
        run.close()
        shipper = ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(12))
        assert shipper.stats.late_events == 0

    def test_torn_jsonl_line_is_repaired(self, spool: Path, out: Path) -> None:
        """A half-written last line (killed mid-write) is cut, and that step is written again."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        run.close()
        ship(spool, out)
        text = out.read_bytes()
        cut = text.rfind(b'{"step": 4')
        out.write_bytes(text[: cut + 20])
        (spool / "cursors" / "t.json").unlink()
        ship(spool, out)
        assert [x["step"] for x in lines(out)] == list(range(5))

    def test_cursor_of_another_run_is_refused(self, spool: Path, tmp_path: Path, out: Path) -> None:
        """A cursor copied from another run's spool is an error, not silent skipping."""
        other = tmp_path / "other"
        for s in (spool, other):
            run = rank(s, 0, 1)
            log_steps(run, range(2))
            run.close()
            ship(s, out if s == spool else tmp_path / "o.jsonl")
        (spool / "cursors" / "t.json").write_bytes((other / "cursors" / "t.json").read_bytes())
        with pytest.raises(Exception, match="belongs to run"):
            ship(spool, out)


class TestDamage:
    def test_corrupt_spool_never_crashes(self, spool: Path, out: Path, tmp_path: Path) -> None:
        """Flipped bits, garbage, links out of the spool: the intact ships, the damage is named."""
        runs = [rank(spool, r, 2, max_segment_bytes=4096) for r in range(2)]
        for run in runs:
            log_steps(run, range(200))
            run.close()
        seg = sorted((spool / "ranks" / "00001").iterdir())[2]
        data = bytearray(seg.read_bytes())
        data[300] ^= 0xFF
        seg.write_bytes(bytes(data))
        (spool / "ranks" / "00000" / "0009-000001.rlog").symlink_to(tmp_path / "x")
        (spool / "ranks" / "00002").mkdir()
        (spool / "ranks" / "00002" / "0001-000001.rlog").write_bytes(b"\x00garbage" * 100)
        shipper = ship(spool, out)
        got = lines(out)
        assert [x["step"] for x in got] == list(range(200))
        # the damaged frame held one step of rank 1: that step has rank 0's value alone,
        # and says so (partial, one rank); every other step is whole
        hit = [
            x["step"] for x in got if x["metrics"]["loss"] != pytest.approx(0.5 + x["step"] / 1000)
        ]
        assert len(hit) == 1 and got[hit[0]]["metrics"]["loss"] == pytest.approx(hit[0] / 1000)
        assert [x["step"] for x in got if not x["complete"]] == hit
        assert got[hit[0]]["ranks"] == 1 and got[hit[0]]["metrics"]["ranklog/ranks_reporting"] == 1
        reported = {b.path for b in shipper.stats.bad}
        assert str(seg) in reported
        assert str(spool / "ranks" / "00002" / "0001-000001.rlog") in reported


class TestFollow:
    def test_follows_until_every_rank_ended(self, spool: Path, out: Path) -> None:
        """Without --once the shipper follows the job and exits when every rank has ended."""
        runs = [rank(spool, r, 2, durability="step") for r in range(2)]
        shipper = Shipper(str(spool), JsonlTarget(out), name="f", dead_after=60, start_grace=0)
        t = threading.Thread(target=shipper.run_forever)
        t.start()
        for s in range(30):
            for run in runs:
                run.log_metrics({"loss": float(s)}, step=s)
                run.step_end(s)
        for run in runs:
            run.close()
        t.join(timeout=30)
        assert not t.is_alive()
        assert [x["step"] for x in lines(out)] == list(range(30))


class TestConsole:
    def test_summary_and_samples(self, spool: Path) -> None:
        """The console prints one line per step and at most N samples, boxed."""
        run = rank(spool, 0, 1)
        run.log_metrics({"loss": 0.5}, step=0)
        for i in range(4):
            run.log_text(f"val/sample_{i}", f"prompt {i}\nanswer {i}", step=0)
        with run.timer("step_time", step=0):
            pass
        run.step_end(0)
        run.close()
        buf = io.StringIO()
        Shipper(str(spool), ConsoleTarget(samples=2, stream=buf), name="c").run_forever(once=True)
        text = buf.getvalue()
        assert "step      0  ranks 1/1  loss 0.5" in text
        assert text.count("┌") == 2 and "2 more samples not shown" in text
        assert "timing/step_time" in text and "(rank 0)" in text

    def test_params_are_a_readable_block(self, spool: Path) -> None:
        """Hyperparameters print one per line, aligned, sorted; a long value is cut with a
        count of what was left out (not one line of kilobytes)."""
        run = rank(spool, 0, 1)
        run.log_hyperparams({"optim": {"lr": 0.001, "betas": [0.9, 0.95]}, "prompt": "x" * 500})
        run.log_metrics({"loss": 0.5}, step=0)
        run.step_end(0)
        run.close()
        buf = io.StringIO()
        Shipper(str(spool), ConsoleTarget(stream=buf), name="c").run_forever(once=True)
        text = buf.getvalue()
        block = text[text.index("params  ") :].split("step ")[0].splitlines()
        assert block[0] == "params  (3)"
        assert block[1:] == [
            "  optim.betas  [0.9, 0.95]",
            "  optim.lr     0.001",
            "  prompt       " + "x" * 100 + "... (400 more characters)",
        ]


def test_spool_read_back_matches(spool: Path) -> None:
    """Sanity: the helper writes what the tests assume."""
    run = rank(spool, 0, 1)
    log_steps(run, range(2))
    run.close()
    assert sum(1 for e in read_events(spool) if type(e).__name__ == "Metrics") == 2


class TestProgress:
    def test_log_lines_and_live_line(self, spool: Path, out: Path) -> None:
        """In a log: plain status lines; on a terminal: one line redrawn with a carriage return."""
        from ranklog.shippers import Progress

        class Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        run.close()
        log, tty = io.StringIO(), Tty()
        for stream in (log, tty):
            progress = Progress(stream, interval=0)
            name = f"p{id(stream)}"
            Shipper(str(spool), JsonlTarget(out), name=name, progress=progress).run_forever(
                once=True
            )
        assert "step 2 (3 shipped, 0 partial)" in log.getvalue()
        assert "ranks live 0 ended 1 dead 0" in log.getvalue() and "\r" not in log.getvalue()
        assert tty.getvalue().startswith("\r\x1b[K[p") and tty.getvalue().endswith("\n")


class TestHistogramsAndImages:
    def test_pooled_across_ranks_and_summarised_in_jsonl(self, spool: Path, out: Path) -> None:
        """Histogram values of all ranks are pooled; JSONL carries their summary and the images."""
        runs = [rank(spool, r, 2) for r in range(2)]
        for r, run in enumerate(runs):
            run.log_histogram("grad", [float(r), float(r) + 10], step=0)
            run.log_image("plot", b"img%d" % r, step=0)
            run.step_end(0)
            run.close()
        shipper = Shipper(str(spool), JsonlTarget(out), name="h", start_grace=0)
        seen: list[object] = []
        real = shipper.target.write
        shipper.target.write = lambda steps: (seen.extend(steps), real(steps))  # type: ignore[method-assign]
        shipper.run_forever(once=True)
        (step,) = seen
        assert step.histograms == {"grad": [0.0, 10.0, 1.0, 11.0]}  # type: ignore[attr-defined]
        assert [(i.rank, i.data) for i in step.images] == [(0, b"img0"), (1, b"img1")]  # type: ignore[attr-defined]
        (line,) = lines(out)
        assert line["histograms"] == {
            "grad": {
                "count": 4.0,
                "min": 0.0,
                "max": 11.0,
                "mean": 5.5,
                "std": 25.25**0.5,
                "p50": 5.5,
                "p90": 10.7,
            }
        }
        assert line["images"][1] == {"rank": 1, "name": "plot", "format": "png", "bytes": 4}


class TestMediaInBackends:
    def test_tensorboard_histogram_and_image(self, spool: Path, tmp_path: Path) -> None:
        """TensorBoard gets a histogram (pooled over ranks) and each rank's image."""
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from tensorboard.backend.event_processing.event_accumulator import (
            HISTOGRAMS,
            IMAGES,
            EventAccumulator,
        )

        from ranklog.shippers.targets.tensorboard import TensorBoardTarget

        fig, ax = plt.subplots(figsize=(2, 1))
        ax.plot([0, 1])
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        runs = [rank(spool, r, 2) for r in range(2)]
        for r, run in enumerate(runs):
            run.log_histogram("grad", [r + 0.5, r + 1.5], step=0)
            run.log_image("plot", buf.getvalue(), step=0)
            run.step_end(0)
            run.close()
        Shipper(str(spool), TensorBoardTarget(tmp_path / "tb"), name="m").run_forever(once=True)
        acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={HISTOGRAMS: 0, IMAGES: 0})
        acc.Reload()
        (h,) = acc.Histograms("grad")
        assert h.histogram_value.num == 4 and h.histogram_value.max == 2.5
        assert set(acc.Tags()["images"]) == {"plot/rank00000", "plot/rank00001"}
        img = acc.Images("plot/rank00001")[0]
        assert img.width > 0 and img.encoded_image_string == buf.getvalue()


class TestGpu:
    def test_samples_join_the_step_in_progress(
        self, spool: Path, out: Path, tmp_path: Path
    ) -> None:
        """GPU samples are aggregated per step and GPU, and named in each backend's convention."""
        from tensorboard.backend.event_processing.event_accumulator import (
            SCALARS,
            EventAccumulator,
        )

        from ranklog.schemas import Gpu
        from ranklog.shippers.targets._media import gpu_metrics
        from ranklog.shippers.targets.tensorboard import TensorBoardTarget

        runs = [rank(spool, r, 2) for r in range(2)]
        for s in range(3):
            for r, run in enumerate(runs):
                run.log_metrics({"loss": 1.0}, step=s)
                if r == 0:  # the host's sampler lives on rank 0
                    for util in (10.0 * s, 10.0 * s + 20):
                        run._sink.append(
                            Gpu(1.0, "node7", 1, util, 100 * (s + 1), 1000, 60.0, 300.0)
                        )
                run.step_end(s)
        for run in runs:
            run.close()
        shipper = Shipper(str(spool), JsonlTarget(out), name="g", start_grace=0)
        seen: list[ShippedStep] = []
        real = shipper.target.write
        shipper.target.write = lambda steps: (seen.extend(steps), real(steps))  # type: ignore[method-assign]
        shipper.run_forever(once=True)
        (g,) = seen[2].gpu
        assert (g.host, g.index, g.samples, g.util, g.mem_used) == ("node7", 1, 2, 30.0, 300)
        assert lines(out)[1]["gpu"][0]["util"] == 20.0
        assert gpu_metrics(seen[2], "wandb")["node7/gpu.1.gpu"] == 30.0
        assert gpu_metrics(seen[2], "mlflow")["system/node7/gpu_1_memory_usage_megabytes"] == 3e-4
        Shipper(str(spool), TensorBoardTarget(tmp_path / "tb"), name="t").run_forever(once=True)
        acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={SCALARS: 0})
        acc.Reload()
        assert [e.value for e in acc.Scalars("gpu/node7/1/utilization")] == [10.0, 20.0, 30.0]
        assert "gpu/all/utilization" in acc.Tags()["scalars"]

    def test_samples_after_the_last_step_make_no_step(self, spool: Path, out: Path) -> None:
        """Samples taken between the last step_end and the end of the run ship no extra step."""
        from ranklog.schemas import Gpu

        runs = [rank(spool, r, 2) for r in range(2)]
        for s in range(2):
            for run in runs:
                run.log_metrics({"loss": 1.0}, step=s)
                run.step_end(s)
        runs[0]._sink.append(Gpu(1.0, "node7", 0, 50.0))  # the sampler, still running
        for run in runs:
            run.close()
        shipper = ship(spool, out)
        assert [(x["step"], x["complete"]) for x in lines(out)] == [(0, True), (1, True)]
        cursor = load_cursor(spool, "t")
        assert cursor is not None and cursor.last_step >= 2  # the samples' step is done
        assert all(seg.done for seg in cursor.segments.values()) and shipper.lag() == (0, 0)
