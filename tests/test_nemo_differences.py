"""docs/nemo.md's differences from NeMo RL's logger, each written through ranklog.nemo and
read back from TensorBoard (EventAccumulator), MLflow (MlflowClient) and W&B (its offline
file): what ranklog adds, the switch that takes each addition away, and what differs."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ranklog.nemo as nemo
from ranklog.shippers.targets._wandb_log import history_rows, iter_records
from ranklog.shippers.targets.tensorboard import HPARAMS_FILE

from .test_nemo import no_backends

pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")
pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")

#: every kind ranklog adds to TensorBoard and MLflow, taken away by ``ranklog.leave_out``
EVERY_ADDITION = ["histograms", "texts", "tables", "derived", "code"]


class Table:
    """What NeMo-Gym hands the logger: a ``wandb.Table``'s columns and data."""

    def __init__(self, columns: list[str], data: list[list[Any]]) -> None:
        self.columns, self.data = columns, data


class Job:
    """A finished two-rank job: where its backends are."""

    def __init__(self, logs: Path, uri: str) -> None:
        self.logs, self.uri = logs, uri

    def tb(self) -> Any:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        sizes = {"scalars": 0, "tensors": 0, "histograms": 0, "images": 0}
        acc = EventAccumulator(str(self.logs / "tensorboard"), size_guidance=sizes)
        acc.Reload()
        return acc

    def mlflow(self) -> tuple[Any, Any]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        return client, run

    def artifacts(self, path: str = "") -> set[str]:
        client, run = self.mlflow()
        out: set[str] = set()
        todo = [path]
        while todo:
            for a in client.list_artifacts(run.info.run_id, todo.pop()):
                (todo.append(a.path) if a.is_dir else out.add(a.path))
        return out

    def wandb_file(self) -> Path:
        (path,) = sorted((self.logs / "wandb").rglob("run-*.wandb"))
        return path

    def wandb_keys(self) -> set[str]:
        return {k.split(".")[0] for r in history_rows(self.wandb_file()) for k in r}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The job's working directory: a git repository with an uncommitted change; code
    provenance on (the suite turns it off elsewhere)."""
    root = tmp_path_factory.mktemp("nemo-diff-repo")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}  # fmt: skip
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "x"]):
        if cmd[0] == "add":
            (root / "train.py").write_text("steps = 1\n")
        subprocess.run(["git", *cmd], cwd=root, env=env, check=True)
    (root / "train.py").write_text("steps = 2\n")
    here, code = os.getcwd(), os.environ.get("RANKLOG_CODE")
    os.chdir(root)
    os.environ["RANKLOG_CODE"] = "1"
    try:
        yield root
    finally:
        os.chdir(here)
        if code is None:
            os.environ.pop("RANKLOG_CODE", None)
        else:
            os.environ["RANKLOG_CODE"] = code


def run_job(root: Path, own: dict[str, Any]) -> Job:
    """Two ranks (a Logger each, in this process): step 0 with a value of every kind, step 1
    closed by rank 0 only (rank 1 ends first: a partial step), NeMo's GPU monitor."""
    job = Job(root / "logs", f"sqlite:///{root / 'mlflow.db'}")
    loggers = []
    for rank in (0, 1):
        cfg = no_backends(
            job.logs, wandb_enabled=True, tensorboard_enabled=True, mlflow_enabled=True,
            wandb={"project": "diff", "name": "diff", "mode": "offline"},
            mlflow={"experiment_name": "diff", "tracking_uri": job.uri},
            ranklog={**own, "rank": rank, "world_size": 2},
        )  # fmt: skip
        loggers.append(nemo.Logger(cfg))  # type: ignore[arg-type]
    try:
        for rank, lg in enumerate(loggers):
            lg.log_hyperparams({"model": {"name": "m", "dropout": None}, "lr": 0.1})
            values = {"loss": 1.0 + rank, "nested": {"a": 2.0}, "note": "hello",
                      "dist": [1.0, 2.0, 3.0], "nothing": None,
                      "table": Table(["q", "score"], [["a", rank]])}  # fmt: skip
            lg.log_metrics(values, step=0, prefix="train")
            lg.log_histogram([1.0, 2.0, 3.0], step=0, name="train/hist")
        monitor = nemo.RayGpuMonitorLogger(1, 10, "ray", "ray/ray_step", parent_logger=loggers[0])
        monitor.metrics_buffer = [{"step": 7, "metrics": {"node.0.gpu.0.util": 50.0}}]
        monitor.flush()
        for lg in loggers:
            lg.log_metrics({"total": 1.0}, step=0, prefix="timing/train")  # closes step 0
        loggers[1].finish()
        loggers[0].log_metrics({"loss": 0.5}, step=1, prefix="train")
    finally:
        for lg in loggers:
            lg.finish()
    return job


@pytest.fixture(scope="module")
def job(repo: Path) -> Job:
    """The job with ranklog's defaults under NeMo."""
    return run_job(repo / "default", {})


@pytest.fixture(scope="module")
def lean(repo: Path) -> Job:
    """The same job with every addition taken away from TensorBoard and MLflow."""
    kinds = {"tensorboard": EVERY_ADDITION, "mlflow": EVERY_ADDITION}
    return run_job(repo / "lean", {"leave_out": kinds})


class TestAdditions:
    def test_histograms_in_tensorboard_and_mlflow(self, job: Job, lean: Job) -> None:
        """Numeric lists and ``log_histogram`` are TensorBoard histograms and MLflow's
        /mean,/p50,/p90,/max (NeMo: neither in TensorBoard; in MLflow the lists only);
        ``leave_out: [histograms]`` takes them away."""
        tags = job.tb().Tags()["histograms"]
        assert {"train/dist", "train/hist"} <= set(tags)
        _, run = job.mlflow()
        assert {f"train/hist/{s}" for s in ("mean", "p50", "p90", "max")} <= set(run.data.metrics)
        assert not lean.tb().Tags()["histograms"]
        assert not [k for k in lean.mlflow()[1].data.metrics if k.startswith("train/hist")]

    def test_texts_in_tensorboard_and_mlflow(self, job: Job, lean: Job) -> None:
        """Strings are TensorBoard text and MLflow ``text/<name>/step_N.md``; ``leave_out:
        [texts]`` takes them away."""
        (entry,) = job.tb().Tensors("train/note")
        assert entry.tensor_proto.string_val[0].startswith(b"**rank 0**")
        assert "text/train/note/step_00000000.md" in job.artifacts("text")
        assert "train/note" not in lean.tb().Tags()["tensors"]
        assert not lean.artifacts("text")

    def test_tables_in_tensorboard_and_mlflow(self, job: Job, lean: Job) -> None:
        """A ``wandb.Table`` is a Markdown table in TensorBoard and a JSON artifact in
        MLflow (NeMo: W&B only); ``leave_out: [tables]`` takes them away."""
        tags = job.tb().Tags()["tensors"]
        assert {"train/table/rank00000", "train/table/rank00001"} <= set(tags)
        assert any(p.startswith("tables/step_00000000/") for p in job.artifacts("tables"))
        assert not [t for t in lean.tb().Tags()["tensors"] if t.startswith("train/table")]
        assert not lean.artifacts("tables")

    def test_ranks_reporting_on_a_partial_step(self, job: Job, lean: Job) -> None:
        """A step not every rank closed carries ``ranklog/ranks_reporting``; ``leave_out:
        [derived]`` takes it away (the step itself still ships)."""
        assert [(e.step, e.value) for e in job.tb().Scalars("ranklog/ranks_reporting")] == [(1, 1)]
        assert "ranklog/ranks_reporting" not in lean.tb().Tags()["scalars"]
        assert [e.step for e in lean.tb().Scalars("train/loss")] == [0, 1]

    def test_code_in_tensorboard_and_mlflow(self, job: Job, lean: Job) -> None:
        """The code's git state is TensorBoard text ``code/git`` and MLflow's git tags and
        ``code/`` artifacts; ``leave_out: [code]`` (or RANKLOG_CODE=0) takes it away."""
        assert "code/git" in job.tb().Tags()["tensors"]
        _, run = job.mlflow()
        assert "mlflow.source.git.commit" in run.data.tags
        assert "code/uncommitted_changes_diff.txt" in job.artifacts("code")
        assert "code/git" not in lean.tb().Tags()["tensors"]
        assert "mlflow.source.git.commit" not in lean.mlflow()[1].data.tags

    def test_bookkeeping_is_tags_never_metrics(self, job: Job) -> None:
        """ranklog's bookkeeping is MLflow tags (``ranklog.run_id``, ``ranklog.steps`` ...)
        and W&B's hidden config, never a metric: no ``ranklog/step`` anywhere."""
        _, run = job.mlflow()
        assert {"ranklog.run_id", "ranklog.role", "ranklog.steps"} <= set(run.data.tags)
        assert [k for k in run.data.metrics if k.startswith("ranklog/")] == [
            "ranklog/ranks_reporting"
        ]
        assert "ranklog/step" not in job.wandb_keys()
        assert "ranklog/step" not in job.tb().Tags()["scalars"]


class TestDifferences:
    def test_every_rank_reduced_by_mean(self, job: Job) -> None:
        """Both ranks' values reach each backend as their mean (NeMo logs the driver's)."""
        assert [(e.step, e.value) for e in job.tb().Scalars("train/loss")] == [(0, 1.5), (1, 0.5)]
        client, run = job.mlflow()
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert {m.step: m.value for m in history} == {0: 1.5, 1: 0.5}
        rows = {r["_step"]: r for r in history_rows(job.wandb_file())}
        assert rows[0]["train/loss"] == 1.5

    def test_nested_dicts_flattened_with_slash(self, job: Job) -> None:
        """A nested dict is ``train/nested/a`` in every backend (NeMo hands W&B the dict)."""
        assert "train/nested/a" in job.tb().Tags()["scalars"]
        assert "train/nested/a" in job.mlflow()[1].data.metrics
        assert "train/nested/a" in job.wandb_keys()

    def test_strings_in_wandb_are_a_samples_table(self, job: Job) -> None:
        """A string reaches W&B in the ``samples`` table, not as a value of its own key."""
        rows = list(history_rows(job.wandb_file()))
        assert rows[0]["samples._type"] == "table-file"
        assert "train/note" not in job.wandb_keys()

    def test_none_values_are_skipped(self, job: Job) -> None:
        """A None value reaches no backend (NeMo hands it to W&B)."""
        assert "train/nothing" not in job.tb().Tags()["scalars"]
        assert "train/nothing" not in job.mlflow()[1].data.metrics
        assert "train/nothing" not in job.wandb_keys()

    def test_the_step_metric_keeps_its_name_everywhere(self, job: Job) -> None:
        """``ray/ray_step`` under prefix ``ray`` stays ``ray/ray_step`` in every backend
        (NeMo: in W&B; its TensorBoard and MLflow loggers write ``ray/ray/ray_step``)."""
        for keys in (set(job.tb().Tags()["scalars"]), set(job.mlflow()[1].data.metrics),
                     job.wandb_keys()):  # fmt: skip
            assert "ray/ray_step" in keys and "ray/ray/ray_step" not in keys

    def test_gpu_series_at_the_training_step(self, job: Job) -> None:
        """The monitor's samples (its step: 7 s) reach TensorBoard and MLflow at the training
        step they were logged in (0), with ``ray/ray_step`` = 7 beside them."""
        scalars = job.tb().Scalars
        assert [(e.step, e.value) for e in scalars("ray/node.0.gpu.0.util")] == [(0, 50.0)]
        assert [(e.step, e.value) for e in scalars("ray/ray_step")] == [(0, 7.0)]
        client, run = job.mlflow()
        history = client.get_metric_history(run.info.run_id, "ray/node.0.gpu.0.util")
        assert [m.step for m in history] == [0]

    def test_tensorboard_hparams_in_the_main_run_without_none(self, job: Job) -> None:
        """TensorBoard's hparams are in the main run (NeMo: a timestamped sub-run), a None
        left out as both write it; MLflow keeps it as ``None`` as NeMo's logger does."""
        from tensorboard.plugins.hparams import plugin_data_pb2

        assert (job.logs / "tensorboard" / HPARAMS_FILE).exists()
        assert [p for p in (job.logs / "tensorboard").iterdir() if p.is_dir()] == []
        content = job.tb().summary_metadata["_hparams_/session_start_info"].plugin_data.content
        ssi = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        assert set(ssi.hparams) == {"model.name", "lr"}
        assert job.mlflow()[1].data.params["model.dropout"] == "None"

    def test_wandb_code_is_the_diff_artifact_only(self, job: Job) -> None:
        """W&B gets the ``git-diffs`` artifact with ``uncommitted_changes_diff.txt`` as NeMo
        logs it, but no ``source-code`` artifact of every tracked file and no ``main_diff``."""
        arts = [
            r.artifact
            for r in iter_records(job.wandb_file())
            if r.WhichOneof("record_type") == "artifact" and r.artifact.type != "run_table"
        ]  # fmt: skip (tables are W&B's own)
        assert [(a.type, [e.path for e in a.manifest.contents]) for a in arts] == [
            ("git-diffs", ["uncommitted_changes_diff.txt"])
        ]
        assert json.loads(arts[0].metadata)["branch"] == "main"
