"""A run is named after what the user named: init(name=), the launcher's job, the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ranklog
from ranklog.spool import default_run_name, read_run

from .conftest import run_python
from .shiphelp import log_steps, ship


class TestDefaultName:
    def test_the_documented_layout_is_named_after_the_experiment(self, tmp_path: Path) -> None:
        """``/nfs/runs/exp1/spool`` is run ``exp1``, never ``spool``."""
        assert default_run_name(tmp_path / "exp1" / "spool") == "exp1"
        assert default_run_name(tmp_path / "exp1" / ".ranklog-spool") == "exp1"
        assert default_run_name(tmp_path / "my-run") == "my-run"

    def test_a_slurm_job_is_named_after_the_job(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """SLURM's job name wins over the folder (not an interactive shell's ``bash``)."""
        monkeypatch.setenv("SLURM_JOB_NAME", "llama-sft")
        assert default_run_name(tmp_path / "exp1" / "spool") == "llama-sft"
        monkeypatch.setenv("SLURM_JOB_NAME", "bash")
        assert default_run_name(tmp_path / "exp1" / "spool") == "exp1"

    def test_torchrun_names_it_after_the_script(self, tmp_path: Path) -> None:
        """Under torchrun (TORCHELASTIC_RUN_ID) the run is named after the training script."""
        script = tmp_path / "train_gpt.py"
        script.write_text(
            "import sys, ranklog\n"
            "print(ranklog.init(sys.argv[1], rank=0, world_size=1).info.name)\n"
        )
        proc = run_python(
            f"import runpy, sys; sys.argv = [{str(script)!r}, {str(tmp_path / 'spool')!r}];"
            f" runpy.run_path({str(script)!r}, run_name='__main__')",
            TORCHELASTIC_RUN_ID="abc",
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "train_gpt"

    def test_init_name_wins(self, tmp_path: Path) -> None:
        """``ranklog.init(spool, name=...)`` names the run; every rank reads that name."""
        spool = tmp_path / "exp1" / "spool"
        run = ranklog.init(spool, rank=0, world_size=2, name="ablation-3", handle_signals=False)
        other = ranklog.init(spool, rank=1, world_size=2, handle_signals=False)
        assert run.info.name == other.info.name == read_run(spool).name == "ablation-3"
        run.close(), other.close()


class TestNameReachesBackends:
    def test_jsonl_mlflow_wandb_and_the_report(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With the documented layout the MLflow experiment and run, the W&B run and group,
        the JSONL run line and the report's title are all the experiment's name."""
        pytest.importorskip("mlflow")
        pytest.importorskip("wandb")
        from mlflow.tracking import MlflowClient

        from ranklog.archive import compact
        from ranklog.report import write_report
        from ranklog.shippers import Shipper, make_target
        from ranklog.shippers.targets._wandb_log import iter_records

        from .test_wandb import _offline_env

        _offline_env(monkeypatch, tmp_path)
        spool = tmp_path / "exp1" / "spool"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        log_steps(run, range(3))
        run.close()
        ship(spool, tmp_path / "o.jsonl")
        first = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
        assert first["ranklog"]["name"] == "exp1"
        uri = f"sqlite:///{tmp_path / 'm.db'}"
        for spec, opts in ((f"mlflow:{uri}", {}), ("wandb:p", {"mode": "offline",
                                                             "dir": str(tmp_path)})):  # fmt: skip
            Shipper(str(spool), make_target(spec, spool, opts), start_grace=0).run_forever(
                once=True
            )
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("exp1")
        (mrun,) = client.search_runs([exp.experiment_id])
        assert mrun.info.run_name == "exp1"
        (wrun,) = [
            rec.run
            for p in tmp_path.glob("wandb/offline-run-*/run-*.wandb")
            for rec in iter_records(p)
            if rec.WhichOneof("record_type") == "run"
        ]
        assert (wrun.display_name, wrun.run_group) == ("exp1", "exp1")
        compact(spool, tmp_path / "pq")
        page = write_report(tmp_path / "pq", tmp_path / "report.html").read_text()
        assert "<title>exp1 - ranklog</title>" in page

    def test_wandb_group_follows_run_name(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``--run-name`` names the W&B run and, without ``--group``, its group too."""
        pytest.importorskip("wandb")
        from ranklog.shippers import Shipper, make_target
        from ranklog.shippers.targets._wandb_log import iter_records

        from .test_wandb import _offline_env

        _offline_env(monkeypatch, tmp_path)
        spool = tmp_path / "exp1" / "spool"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        log_steps(run, range(2))
        run.close()
        opts = {"mode": "offline", "dir": str(tmp_path), "run_name": "lr-3e-4"}
        Shipper(str(spool), make_target("wandb:p", spool, opts), start_grace=0).run_forever(
            once=True
        )
        (wrun,) = [
            rec.run
            for p in tmp_path.glob("wandb/offline-run-*/run-*.wandb")
            for rec in iter_records(p)
            if rec.WhichOneof("record_type") == "run"
        ]
        assert (wrun.display_name, wrun.run_group) == ("lr-3e-4", "lr-3e-4")
