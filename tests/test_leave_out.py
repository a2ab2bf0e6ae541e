"""What a target is given, by the user's choice: ``--leave-out KINDS`` and MLflow's
``--histogram-stats``, live and through ranklog.nemo's ``ranklog.leave_out``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ranklog
import ranklog.nemo as nemo
from ranklog.shippers.targets.jsonl import read_jsonl

from .test_everyday import ranklog_cmd
from .test_nemo import no_backends

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


def every_kind(spool: Path) -> None:
    """Two ranks, one step holding a value of every kind; rank 1 leaves step 1 partial."""
    for r in (0, 1):
        run = ranklog.init(spool, rank=r, world_size=2, handle_signals=False, code=r == 0)
        run.log_metrics({"loss": 1.0 + r}, step=0)
        run.log_timing("step", 0.1 * (r + 1), step=0)
        run.log_text("val/sample", f"rank {r}", step=0)
        run.log_histogram("grad", [0.0, 1.0, 2.0], step=0)
        run.log_table("val/t", ["a"], [[r]], step=0)
        run.log_image("plot", PNG, step=0)
        run.step_end(0)
        if r == 0:
            run.log_metrics({"loss": 0.5}, step=1)
            run.step_end(1)
        run.close()


def steps_of(path: Path) -> list[dict[str, Any]]:
    return [x for x in read_jsonl(path) if "step" in x]


class TestLeaveOut:
    def test_each_kind_is_left_out_and_nothing_else(self, tmp_path: Path) -> None:
        """--leave-out drops the kinds named; metrics, steps and params ship as without it."""
        spool = tmp_path / "spool"
        every_kind(spool)
        full, lean = tmp_path / "full.jsonl", tmp_path / "lean.jsonl"
        common = ("--once", "--dead-after", "0")
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{full}", *common).returncode == 0
        done = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{lean}", *common,
                           "--leave-out", "histograms,texts,tables,images,derived")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "leaving out derived, histograms, images, tables, texts" in done.stderr
        f0, f1 = steps_of(full)
        l0, l1 = steps_of(lean)
        assert {"texts", "histograms", "tables", "images"} <= set(f0)
        assert not {"texts", "histograms", "tables", "images"} & set(l0)
        assert "timing/step/slowest_rank" in f0["metrics"]
        assert "ranklog/ranks_reporting" in f1["metrics"]
        derived = {"timing/step/slowest_rank", "ranklog/ranks_reporting"}
        assert l0["metrics"] == {k: v for k, v in f0["metrics"].items() if k not in derived}
        assert l1["metrics"] == {k: v for k, v in f1["metrics"].items() if k not in derived}
        assert (l1["complete"], l1["ranks"]) == (f1["complete"], f1["ranks"])

    def test_derived_means_ranklogs_not_a_logged_name(self, tmp_path: Path) -> None:
        """A logged ``timing/t/slowest_rank`` is the user's and stays; the derived value,
        shipped as ``timing/t/slowest_rank.derived`` beside it, is the one left out."""
        spool, out = tmp_path / "spool", tmp_path / "o.jsonl"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run.log_timing("t", 0.5, step=0)
        run.log_metrics({"timing/t/slowest_rank": 7.0}, step=0)
        run.step_end(0)
        run.close()
        done = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once",
                           "--leave-out", "derived")  # fmt: skip
        assert done.returncode == 0, done.stderr
        (step,) = steps_of(out)
        assert step["metrics"] == {"timing/t": 0.5, "timing/t/slowest_rank": 7.0}

    def test_code_left_out(self, tmp_path: Path) -> None:
        """--leave-out code: no ``code/*`` record reaches the target; other records do."""
        spool = tmp_path / "spool"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False, code=True)
        run.log_summary({"best": 1.0})
        run.log_metrics({"x": 1.0}, step=0)
        run.close()
        out = tmp_path / "o.jsonl"
        done = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once",
                           "--leave-out", "code")  # fmt: skip
        assert done.returncode == 0, done.stderr
        meta = {k: v for x in read_jsonl(out) if "meta" in x for k, v in x["meta"].items()}
        assert meta == {"summary/best": 1.0}

    def test_a_kind_it_does_not_know_is_refused(self, tmp_path: Path) -> None:
        """An unknown kind exits 2 naming it and the kinds there are."""
        spool = tmp_path / "spool"
        every_kind(spool)
        done = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{tmp_path / 'o.jsonl'}", "--once",
                           "--leave-out", "texts,videos")  # fmt: skip
        assert done.returncode == 2
        assert (
            "videos is not one of histograms, texts, tables, images, derived, code" in done.stderr
        )


class TestHistogramStats:
    def test_mlflow_gets_the_statistics_asked_for(self, tmp_path: Path) -> None:
        """--histogram-stats picks the MLflow series a distribution becomes; default: all 7."""
        pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
        from mlflow.tracking import MlflowClient

        spool = tmp_path / "spool"
        every_kind(spool)
        got = {}
        for name, extra in (("all", ()), ("four", ("--histogram-stats", "mean,p50,p90,max"))):
            uri = f"sqlite:///{tmp_path / name}.db"
            done = ranklog_cmd("ship", str(spool), "--to", f"mlflow:{uri}", "--once", *extra)
            assert done.returncode == 0, done.stderr
            client = MlflowClient(uri)
            (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
            got[name] = {k.split("/")[-1] for k in run.data.metrics if k.startswith("grad/")}
        assert got["all"] == {"count", "min", "max", "mean", "std", "p50", "p90"}
        assert got["four"] == {"mean", "p50", "p90", "max"}

    def test_an_unknown_statistic_is_refused(self, tmp_path: Path) -> None:
        """A statistic MLflow is not given exits 2 naming it."""
        pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
        spool = tmp_path / "spool"
        every_kind(spool)
        done = ranklog_cmd("ship", str(spool), "--to", f"mlflow:sqlite:///{tmp_path / 'm.db'}",
                           "--once", "--histogram-stats", "mean,p99")  # fmt: skip
        assert done.returncode == 2 and "p99 is not one of count" in done.stderr


class TestNemo:
    def test_ranklog_leave_out_reaches_each_backends_shipper(self, tmp_path: Path) -> None:
        """``ranklog.leave_out`` per backend section (or a list for all) becomes that
        backend's --leave-out."""
        own = {"leave_out": {"tensorboard": ["histograms", "texts"]}}
        cfg = no_backends(tmp_path, tensorboard_enabled=True, mlflow_enabled=True, ranklog=own)
        cmds = {c[c.index("--to") + 1].split(":")[0]: c for c in nemo.Logger.shipper_commands(cfg)}
        tb, ml = cmds["tensorboard"], cmds["mlflow"]
        assert tb[tb.index("--leave-out") + 1] == "histograms,texts"
        assert "--leave-out" not in ml
        assert ml[ml.index("--histogram-stats") + 1] == "mean,p50,p90,max"
        cfg["ranklog"] = {"leave_out": ["code"]}
        for c in nemo.Logger.shipper_commands(cfg):
            if "--to" in c and not c[c.index("--to") + 1].startswith("console"):
                assert c[c.index("--leave-out") + 1] == "code"

    def test_a_standalone_backend_logger_takes_it_too(self, tmp_path: Path) -> None:
        """A backend class built on its own reads ``ranklog.leave_out`` from its section."""
        logger = nemo.TensorboardLogger(
            {"ranklog": {"leave_out": ["histograms"]}}, log_dir=str(tmp_path / "tb")
        )  # type: ignore[typeddict-unknown-key]
        try:
            (cmd,) = logger._session.commands
            assert cmd[cmd.index("--leave-out") + 1] == "histograms"
        finally:
            logger.finish()
