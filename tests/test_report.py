"""The HTML report: its data functions, its page, and how it looks in a real browser."""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ranklog
from ranklog.archive import compact
from ranklog.report import (
    MAX_LINES,
    gpu_series,
    metric_curves,
    metric_names,
    step_time_matrix,
    step_timer,
    text_samples,
    timeline_bars,
    write_report,
)
from ranklog.schemas import Event, Gpu, Metrics, Params, RankEnd, RankStart, StepEnd, Timer
from ranklog.spool import IncarnationWriter, SpoolLayout, ensure_run
from ranklog.testing import crash

from .conftest import chromium, run_python
from .shiphelp import log_steps, rank
from .spoolgen import write_frame

T0 = 1_715_000_000.0
RANKS, STEPS, SLOW, KILLED, FAILED = 8, 80, 5, 2, 7


def _generated(spool: Path) -> None:
    """8 ranks on 4 hosts, a slow rank, a rank killed and requeued, one that fails; GPU samples."""
    info = ensure_run(spool, name="llama-7b-pretrain", world_size=RANKS)
    layout, rng = SpoolLayout(spool), random.Random(0)
    for r in range(RANKS):
        host, t, s = f"node{r // 2}", T0 + r * 0.3, 0

        def start(t: float, r: int = r, host: str = host) -> IncarnationWriter:
            w = IncarnationWriter.create(layout, info, r, world_size=RANKS)
            params = {"lr": 3e-4, "model.depth": 32, "optimizer": "adamw", "seed": 1234 + r % 2}
            write_frame(w, [RankStart(t, info.run_id, r, RANKS, r % 2, host, 4000 + r,
                                      w.incarnation, "test"), Params(t, params)])  # fmt: skip
            return w

        w = start(t)
        while s < STEPS:
            dt = 1.0 + 0.5 * (r == SLOW) + rng.uniform(0, 0.15) + (s % 20 == 0) * 0.4
            t += dt
            loss = 3.0 * math.exp(-s / 25) + 0.6 + rng.gauss(0, 0.04) + 0.02 * r
            values = {
                "train/loss": loss,
                "train/lr": 3e-4 * min(1.0, (s + 1) / 10),
                "grad_norm": 1.5 * math.exp(-s / 40) + rng.uniform(0, 0.3),
                "nan": math.nan,
            }
            evs: list[Event] = [Metrics(t, s, values), Timer(t, s, "step_time", dt),
                                Timer(t, s, "data_time", 0.05)]  # fmt: skip
            if s % 10 == 9:
                evs.append(Metrics(t, s, {"val/loss": loss + 0.1, "val/acc": 1 - loss / 4}))
            if r % 2 == 0:
                evs += [Gpu(t, host, i, util=85 + rng.uniform(-10, 10) - 40 * (s % 20 == 0),
                            mem_used=int((60 + 4 * i + s / 20) * 2**30), mem_total=80 * 2**30,
                            temp=60.0, power=600.0, step=s, name="NVIDIA H100 80GB HBM3")
                        for i in range(2)]  # fmt: skip
            write_frame(w, [*evs, StepEnd(t, s)])
            s += 1
            if r == KILLED and s == STEPS // 2 and w.incarnation == 1:
                w.abandon()  # SIGKILLed: no rank_end; requeued later, resumes from a checkpoint
                t, s = t + 90, s - 5
                w = start(t)
        failed = r == FAILED
        write_frame(w, [RankEnd(t + 0.5, "error" if failed else "ok", 1 if failed else 0)])
        w.close()


def _produced(spool: Path) -> None:
    """3 producer ranks logging ``loss = rank + step/1000``; rank 1 killed then requeued."""
    for r in range(3):
        run = rank(spool, r, 3)
        run.log_hyperparams({"lr": 0.1})
        for s in range(20):
            run.log_metrics({"loss": r + s / 1000}, step=s)
            run.log_timing("fwd", 0.1, step=s)
            run.step_end(s)
        run.flush()
        if r == 1:
            crash(run)  # killed
            run = rank(spool, r, 3)  # requeued
            log_steps(run, range(15, 25))
        run.close()


def _wide(spool: Path, ranks: int = 512, steps: int = 6, gpus: int = 24) -> None:
    """A wide job: ``ranks`` ranks with one slow rank, ``gpus`` GPUs sampled by the first ranks."""
    info = ensure_run(spool, name="wide", world_size=ranks)
    layout = SpoolLayout(spool)
    for r in range(ranks):
        w = IncarnationWriter.create(layout, info, r, world_size=ranks)
        t = T0 + r * 0.01
        evs: list[Event] = [RankStart(t, info.run_id, r, ranks, r % 8, f"n{r // 8}", r, 1, "t")]
        for s in range(steps):
            t += 1.0 + (r == 300)
            evs.append(Timer(t, s, "step_time", 1.0 + (r == 300)))
            if r == 0:
                evs.append(Metrics(t, s, {"train/loss": 1 / (s + 1)}))
            if r < gpus:
                evs.append(Gpu(t, f"n{r // 8}", r % 8, util=90.0 - 50 * (r == 5), mem_used=2**34))
            evs.append(StepEnd(t, s))
        write_frame(w, [*evs, RankEnd(t, "ok", 0)])
        w.close(sync=False)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compacted dataset of :func:`_generated`."""
    root = tmp_path_factory.mktemp("gen")
    _generated(root / "spool")
    compact(root / "spool", root / "pq")
    return root / "pq"


@pytest.fixture(scope="module")
def report(generated: Path) -> Path:
    """The report of the generated dataset."""
    return write_report(generated, generated.parent / "report.html")


def _self_contained(page: str) -> None:
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page, re.I)
    assert "<script" not in page and "<link" not in page


class TestPage:
    def test_renders_with_gpu(self, report: Path) -> None:
        """A dataset with GPU rows gives a self-contained page with four plots, one image each."""
        page = report.read_text()
        _self_contained(page)
        plots = re.findall(r'<figure data-plot="([a-z_]+)">\s*<img [^>]*src="data:image/png;', page)
        assert plots == ["metrics", "step_time", "gpu", "timeline"]
        assert page.count("<img") == page.count("data-plot=") == 4
        assert "llama-7b-pretrain" in page and "adamw" in page and "No GPU" not in page
        assert "8 (restarts: 1)" in page and "0 \u2013 79" in page and "Slowest rank 5" in page

    def test_renders_without_gpu(self, spool: Path, tmp_path: Path) -> None:
        """Without GPU rows there are three plots and one line saying there are no GPU samples."""
        _produced(spool)
        compact(spool, tmp_path / "pq")
        page = write_report(tmp_path / "pq", tmp_path / "sub" / "r.html").read_text()
        _self_contained(page)
        assert page.count("data-plot=") == page.count("<img") == 3
        assert page.count("No GPU samples in this run.") == 1

    def test_code_card_and_no_run_records_among_params(self, spool: Path, tmp_path: Path) -> None:
        """The code's commit, branch and dirty flag are a card; run records (``@`` rows:
        the diff, summary values) are not listed as params."""
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run.log_hyperparams({"lr": 0.1})
        run.log_summary({"best": 0.5})
        run._sink.append(
            Params(
                1.0,
                {},
                {},
                {
                    "code/commit": "4f1c2e9d8b7a6",
                    "code/branch": "main",
                    "code/dirty": True,
                    "code/diff": "+x",
                },
            )
        )
        log_steps(run, range(3))
        run.close()
        compact(spool, tmp_path / "pq")
        page = write_report(tmp_path / "pq", tmp_path / "r.html").read_text()
        assert "<b>code</b><span>4f1c2e9d8b7a on main (uncommitted changes)</span>" in page
        assert ">lr<" in page and "@" not in page.split("<h2>Params</h2>")[1]

    @pytest.mark.slow
    def test_wide_job(self, spool: Path, tmp_path: Path) -> None:
        """512 ranks and 24 GPUs render (GPUs as heatmaps); the slow rank is the hottest row."""
        _wide(spool)
        compact(spool, tmp_path / "pq")
        ranks, _, m = step_time_matrix(tmp_path / "pq")
        assert len(ranks) == 512 and ranks[int(np.argmax(m.mean(axis=1)))] == 300
        series = gpu_series(tmp_path / "pq")
        assert len(series) == 24 > MAX_LINES
        assert [(g.host, g.gpu) for g in series] == sorted((f"n{r // 8}", r % 8) for r in range(24))
        page = write_report(tmp_path / "pq", tmp_path / "r.html").read_text()
        assert page.count("data-plot=") == 4 and "mean per GPU and time bin" in page
        assert "Slowest rank 300" in page

    def test_hostile_names(self, spool: Path, tmp_path: Path) -> None:
        """Names with HTML or matplotlib math markup are shown escaped, as plain text."""
        run = rank(spool, 0, 1, name="<script>x</script>")
        run.log_hyperparams({"<marquee>": "<blink>"})
        for s in range(3):
            run.log_metrics({"train/$a_b$ <hr>": 1.0 + s}, step=s)
            run.log_timing("$t$", 0.1, step=s)
            run.step_end(s)
        run.close()
        compact(spool, tmp_path / "pq")
        page = write_report(tmp_path / "pq", tmp_path / "r.html").read_text()
        assert not any(x in page for x in ("<script", "<hr>", "<marquee>", "<blink>"))
        assert "&lt;script&gt;x&lt;/script&gt;" in page and "&lt;blink&gt;" in page
        assert page.count("data-plot=") == 3

    def test_samples_section(self, spool: Path, tmp_path: Path) -> None:
        """The latest three steps of each text name, once where ranks agree, else per rank."""
        runs = [rank(spool, r, 2, name="exp") for r in range(2)]
        for s in range(6):
            for run in runs:
                same = s % 2 == 0
                run.log_text("val/sample", f"<b>{s}</b>" if same else f"r{run.rank} {s}", step=s)
                if run.rank == 0:
                    run.log_text("val/prompt", f"prompt {s}", step=s)
                run.log_metrics({"x": 1.0}, step=s)
                run.step_end(s)
        for run in runs:
            run.close()
        compact(spool, tmp_path / "pq")
        got = [(x.name, x.step, x.rank, x.text) for x in text_samples(tmp_path / "pq")]
        assert got == [  # (val/prompt: rank 0's alone, said as rank 0's)
            ("val/prompt", 5, 0, "prompt 5"), ("val/prompt", 4, 0, "prompt 4"),
            ("val/prompt", 3, 0, "prompt 3"),
            ("val/sample", 5, 0, "r0 5"), ("val/sample", 5, 1, "r1 5"),
            ("val/sample", 4, None, "<b>4</b>"),
            ("val/sample", 3, 0, "r0 3"), ("val/sample", 3, 1, "r1 3"),
        ]  # fmt: skip
        page = write_report(tmp_path / "pq", tmp_path / "r.html").read_text()
        assert "<h2>Samples</h2>" in page and "<title>exp - ranklog</title>" in page
        assert "step 5, rank 0 of 2</p><pre>prompt 5" in page
        assert "step 4, all 2 ranks alike</p>" in page and "step 5, rank 1 of 2</p>" in page
        assert "step 2," not in page
        assert "&lt;b&gt;4&lt;/b&gt;" in page and "<b>4</b>" not in page

    def test_not_a_dataset(self, tmp_path: Path) -> None:
        """A directory that is not a compacted dataset is refused with an ArchiveError (exit 4,
        as the CLI says it), naming the command that makes one."""
        with pytest.raises(ranklog.errors.ArchiveError, match="ranklog compact SPOOL --out DIR"):
            write_report(tmp_path, tmp_path / "r.html")

    def test_matplotlib_missing(
        self, generated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without matplotlib, write_report raises ExtraMissingError naming the report extra."""
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        with pytest.raises(ranklog.ExtraMissingError) as info:
            write_report(generated, tmp_path / "r.html")
        assert info.value.extra == "report" and not (tmp_path / "r.html").exists()

    def test_lazy_import(self) -> None:
        """Neither ``import ranklog`` nor ``import ranklog.report`` imports matplotlib."""
        code = "import sys, ranklog, ranklog.report; assert 'matplotlib' not in sys.modules"
        proc = run_python(code)
        assert proc.returncode == 0, proc.stderr


class TestData:
    def test_metric_names_and_curves(self, spool: Path, tmp_path: Path) -> None:
        """Names put train/ and val/ first and skip all-NaN ones; curves hold mean, min and max."""
        _produced(spool)
        compact(spool, tmp_path / "pq")
        (curve,) = metric_curves(tmp_path / "pq")
        i = list(curve.steps).index(7)
        assert (curve.lo[i], curve.mean[i], curve.hi[i]) == pytest.approx((0.007, 1.007, 2.007))
        # steps 15..19 of rank 1 are logged twice (before and after the requeue): mean of both
        assert curve.steps.tolist() == list(range(25))
        assert curve.hi[list(curve.steps).index(22)] == pytest.approx(1.022)

    def test_metric_order(self, generated: Path) -> None:
        """train/ then val/ metrics, then loss-like, then the rest; NaN-only metrics left out."""
        assert metric_names(generated) == [
            "train/loss", "train/lr", "val/acc", "val/loss", "grad_norm",
        ]  # fmt: skip
        assert metric_names(generated, limit=2) == ["train/loss", "train/lr"]

    def test_slow_rank_is_hottest_row(self, generated: Path) -> None:
        """The deliberately slow rank has the largest step time in the heatmap matrix."""
        assert step_timer(generated) == "step_time"
        ranks, steps, m = step_time_matrix(generated)
        assert ranks == list(range(RANKS)) and m.shape == (RANKS, STEPS)
        assert steps.tolist() == list(range(STEPS))
        assert ranks[int(np.nanargmax(np.nanmean(m, axis=1)))] == SLOW
        assert np.isfinite(m).all()

    def test_heatmap_bins_many_steps(self, generated: Path) -> None:
        """With more steps than columns, steps are binned and the slow rank still stands out."""
        ranks, steps, m = step_time_matrix(generated, max_columns=16)
        assert m.shape == (RANKS, 16) and steps[:3].tolist() == [0, 5, 10]
        assert ranks[int(np.argmax(m.mean(axis=1)))] == SLOW

    def test_timer_fallback(self, spool: Path, tmp_path: Path) -> None:
        """Without step_time the timer with most rows is used; no timers give an empty matrix."""
        _produced(spool)
        compact(spool, tmp_path / "pq")
        assert step_timer(tmp_path / "pq") == "fwd"
        assert step_time_matrix(tmp_path / "pq")[2].shape == (3, 20)
        assert step_time_matrix(tmp_path / "nothing") == ([], pytest.approx([]), pytest.approx([]))

    def test_requeued_rank_has_two_bars(self, spool: Path, tmp_path: Path) -> None:
        """A rank killed then requeued gives two bars: one without rank_end, then one ending ok."""
        _produced(spool)
        compact(spool, tmp_path / "pq")
        bars = timeline_bars(tmp_path / "pq")
        assert [(b.rank, b.incarnation, b.status) for b in bars] == [
            (0, 1, "ok"), (1, 1, None), (1, 2, "ok"), (2, 1, "ok"),
        ]  # fmt: skip
        first, second = bars[1], bars[2]
        assert first.start <= first.end <= second.start <= second.end

    def test_generated_timeline(self, generated: Path) -> None:
        """Statuses and times come from rank_start and rank_end; a death ends at its last event."""
        bars = {(b.rank, b.incarnation): b for b in timeline_bars(generated)}
        assert len(bars) == RANKS + 1
        assert bars[(FAILED, 1)].status == "error" and bars[(FAILED, 1)].exit_code == 1
        died, back = bars[(KILLED, 1)], bars[(KILLED, 2)]
        assert died.status is None and back.status == "ok"
        assert back.start - died.end == pytest.approx(90, abs=0.01)
        assert bars[(0, 1)].start == pytest.approx(T0)


class TestScreenshot:
    def test_browser_screenshot(self, report: Path, tmp_path: Path) -> None:
        """Headless Chromium renders the report into a large screenshot that is not one color."""
        browser = chromium()
        png = tmp_path / "report.png"
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
               f"--screenshot={png}", "--window-size=1280,4000", report.as_uri()]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        assert png.is_file(), proc.stderr[-2000:]
        assert png.stat().st_size > 50_000
        from matplotlib.image import imread

        pixels = imread(png)[..., :3]
        assert min(pixels.shape[:2]) >= 1000
        assert pixels.std(axis=(0, 1)).max() > 0.05  # not one flat color
        assert len(np.unique(pixels.reshape(-1, 3)[::97], axis=0)) > 50


class TestStragglers:
    """A rank is flagged against the other ranks' median, so a 2-rank job shows its slow
    rank (against the median of all, which includes it, it never could)."""

    @staticmethod
    def _job(spool: Path, ranks: int, slow: int | None) -> Path:
        import ranklog

        for r in range(ranks):
            with ranklog.init(spool, rank=r, world_size=ranks, handle_signals=False,
                              flush_interval=3600) as run:  # fmt: skip
                for s in range(4):
                    run.log_timing("step_time", 1.5 if r == slow else 1.0 + 0.01 * (r % 3), step=s)
                    run.step_end(s)
        compact(spool, spool.parent / "pq")
        return spool.parent / "pq"

    @pytest.mark.parametrize("ranks", [2, 4, 64])
    def test_one_slow_rank_is_flagged(self, tmp_path: Path, ranks: int) -> None:
        """One rank 1.5x slower: the report's step-time caption names it, and only it."""
        ds = self._job(tmp_path / "spool", ranks, slow=ranks - 1)
        page = write_report(ds, tmp_path / "r.html").read_text()
        assert f"the other ranks&#x27; median: rank {ranks - 1}." in page

    @pytest.mark.parametrize("ranks", [2, 4, 64])
    def test_equal_ranks_flag_none(self, tmp_path: Path, ranks: int) -> None:
        """All ranks alike (within 2 %): no rank flagged."""
        ds = self._job(tmp_path / "spool", ranks, slow=None)
        page = write_report(ds, tmp_path / "r.html").read_text()
        assert "the other ranks&#x27; median: none." in page

    def test_median_of_others_is_exact(self) -> None:
        """The closed form equals the median of the others taken one rank at a time."""
        import numpy as np

        from ranklog.report import median_of_others

        rng = np.random.default_rng(3)
        for n in (1, 2, 3, 4, 7, 64):
            x = rng.random(n)
            x[rng.integers(n)] = np.nan if n > 3 else x[0]
            want = [np.median([v for j, v in enumerate(x) if j != i and np.isfinite(v)])
                    if np.isfinite(x[i]) and np.isfinite(np.delete(x, i)).any() else np.nan
                    for i in range(n)]  # fmt: skip
            np.testing.assert_allclose(median_of_others(x), want)
