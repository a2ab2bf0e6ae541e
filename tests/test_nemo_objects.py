"""The backend objects NeMo RL code reaches (``wandb_logger.run``, ``TensorboardLogger.writer``,
``MLflowLogger.run``): what they give, where their writes land (read back from each
backend), and the clear error for what they do not offer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ranklog.nemo as nemo
from ranklog.errors import RanklogError, UnsupportedError
from ranklog.nemo._objects import WandbRun
from ranklog.shippers.targets._wandb_log import history_rows, iter_records

from .test_nemo import no_backends

pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")
pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")


class Done:
    """What the module's run saw in-process, and where its backends wrote."""

    def __init__(self, logs: Path, uri: str) -> None:
        self.logs, self.uri = logs, uri
        self.seen: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}


def _loggers(logger: Any, cls: type) -> Any:
    (found,) = [lg for lg in logger.loggers if isinstance(lg, cls)]
    return found


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """A Logger with W&B (offline), TensorBoard and MLflow, driven through the objects."""
    root = tmp_path_factory.mktemp("nemo-objects")
    out = Done(root / "logs", f"sqlite:///{root / 'mlflow.db'}")
    cfg = no_backends(
        out.logs, wandb_enabled=True, tensorboard_enabled=True, mlflow_enabled=True,
        wandb={"project": "objs", "name": "objects", "mode": "offline"},
        mlflow={"experiment_name": "objs", "tracking_uri": out.uri},
    )  # fmt: skip
    logger = nemo.Logger(cfg)  # type: ignore[arg-type]
    try:
        run = logger.wandb_logger.run  # type: ignore[union-attr]
        writer = _loggers(logger, nemo.TensorboardLogger).writer
        mlflow_logger = _loggers(logger, nemo.MLflowLogger)
        out.seen.update(id=run.id, name=run.name, project=run.project, dir=run.dir,
                        url=run.url, offline=run.offline)  # fmt: skip
        logger.log_hyperparams({"optim": {"lr": 0.1}})
        run.config.update({"extra": {"k": 1}}, allow_val_change=True)
        run.config["seed"] = 5
        out.seen["config"] = (run.config["optim"], run.config.seed, dict(run.config))
        run.define_metric("eval/*", step_metric="eval/epoch")
        logger.log_metrics({"loss": 1.0}, step=0)
        run.log({"eval/acc": 0.5, "eval/epoch": 1})  # no step: the logger's, 0
        run.summary["best_acc"] = 0.5
        run.summary.update({"verdict": "ok"})
        out.seen["summary"] = dict(run.summary)
        writer.add_scalar("custom/x", 3.0, 0)
        writer.add_scalars("pair", {"a": 1.0, "b": 2.0}, 0)
        writer.add_text("custom/note", "hello", 0)
        writer.add_histogram("custom/h", [1.0, 2.0, 3.0], 0)
        monitor = nemo.RayGpuMonitorLogger(1, 10, "ray", "ray/ray_step", parent_logger=logger)
        monitor.metrics_buffer = [{"step": 7, "metrics": {"node.0.gpu.0.util": 50.0}}]
        monitor.flush()  # NeMo's monitor: its step metric keeps its name (ray/ray_step)
        logger.log_metrics({"loss": 0.5}, step=1, step_finished=True)
        run.log({"loss": 0.25}, step=2, commit=True)
        out.seen["mlflow_run_id"] = mlflow_logger.run_id
        out.seen["mlflow_run"] = mlflow_logger.run.info.run_id
        for what, call in {
            "run.watch": lambda: run.watch,
            "writer.add_image": lambda: writer.add_image("x", None, 0),
            "config del": lambda: run.config.__delitem__("seed"),
        }.items():
            try:
                call()
            except BaseException as exc:
                out.errors[what] = exc
    finally:
        logger.finish()
    return out


def wandb_file(done: Done) -> Path:
    (path,) = sorted((done.logs / "wandb").rglob("run-*.wandb"))
    return path


class TestWandbRun:
    def test_identity_is_the_shippers_run(self, done: Done) -> None:
        """``run.id`` is the id of the W&B run the shipper wrote; name, project, dir as
        configured; offline, so no URL."""
        assert wandb_file(done).name == f"run-{done.seen['id']}.wandb"
        assert (done.seen["name"], done.seen["project"]) == ("objects", "objs")
        assert done.seen["dir"] == str(done.logs / "wandb")
        assert done.seen["offline"] is True and done.seen["url"] is None

    def test_config_writes_reach_the_config(self, done: Done) -> None:
        """``run.config.update`` and ``run.config[k] = v`` are hyperparameters in W&B; reads
        give what was logged, by key or attribute."""
        optim, seed, whole = done.seen["config"]
        assert optim == {"lr": 0.1} and seed == 5
        assert whole == {"optim": {"lr": 0.1}, "extra": {"k": 1}, "seed": 5}
        config: dict[str, Any] = {}
        for rec in iter_records(wandb_file(done)):
            kind = rec.WhichOneof("record_type")
            items = rec.config.update if kind == "config" else rec.run.config.update
            if kind in ("config", "run"):
                config.update((i.key, json.loads(i.value_json)) for i in items)
        assert config["optim"] == {"lr": 0.1} and config["extra"] == {"k": 1}
        assert config["seed"] == 5

    def test_summary_define_metric_and_log(self, done: Done) -> None:
        """Summary writes, definitions and ``run.log`` reach the W&B run: ``log`` without a
        step goes to the logger's step; with ``commit=True`` it closes its step."""
        assert done.seen["summary"] == {"best_acc": 0.5, "verdict": "ok"}
        summary: dict[str, Any] = {}
        globs = {}
        for rec in iter_records(wandb_file(done)):
            kind = rec.WhichOneof("record_type")
            if kind == "summary":
                summary.update((u.key, json.loads(u.value_json)) for u in rec.summary.update)
            elif kind == "metric":
                globs[rec.metric.glob_name or rec.metric.name] = rec.metric.step_metric
        assert summary["best_acc"] == 0.5 and summary["verdict"] == "ok"
        assert globs["eval/*"] == "eval/epoch"
        rows = {r["_step"]: r for r in history_rows(wandb_file(done))}
        assert rows[0]["eval/acc"] == 0.5 and rows[0]["loss"] == 1.0
        assert rows[2]["loss"] == 0.25

    def test_the_step_metric_keeps_its_name(self, done: Done) -> None:
        """NeMo's GPU monitor logs ``ray/ray_step`` under prefix ``ray``: it stays
        ``ray/ray_step`` (NeMo's W&B rule), never ``ray/ray/ray_step``."""
        keys = {k for r in history_rows(wandb_file(done)) for k in r}
        assert {"ray/ray_step", "ray/node.0.gpu.0.util"} <= keys
        assert "ray/ray/ray_step" not in keys

    def test_what_it_does_not_offer_is_named(self, done: Done) -> None:
        """``run.watch`` raises UnsupportedError (an AttributeError) naming the attribute."""
        exc = done.errors["run.watch"]
        assert isinstance(exc, UnsupportedError) and isinstance(exc, AttributeError)
        assert isinstance(exc, RanklogError)
        assert "wandb_logger.run.watch is not available" in str(exc)
        assert "docs/nemo.md" in str(exc)
        assert isinstance(done.errors["config del"], UnsupportedError)


class TestSummaryWriter:
    def test_writes_reach_tensorboard(self, done: Done) -> None:
        """add_scalar, add_scalars, add_text and add_histogram land in the event files."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        sizes = {"scalars": 0, "tensors": 0, "histograms": 0}
        acc = EventAccumulator(str(done.logs / "tensorboard"), size_guidance=sizes)
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("custom/x")] == [(0, 3.0)]
        assert [e.value for e in acc.Scalars("pair/a")] == [1.0]
        assert [e.value for e in acc.Scalars("pair/b")] == [2.0]
        (note,) = acc.Tensors("custom/note")
        assert note.tensor_proto.string_val[0] == b"hello"
        (hist,) = acc.Histograms("custom/h")
        assert hist.histogram_value.num == 3

    def test_what_it_does_not_offer_is_named(self, done: Done) -> None:
        """``writer.add_image`` raises UnsupportedError naming it and what is offered."""
        exc = done.errors["writer.add_image"]
        assert isinstance(exc, UnsupportedError)
        assert "TensorboardLogger.writer.add_image" in str(exc) and "add_scalar" in str(exc)


class TestMlflowRun:
    def test_run_id_of_the_run_ranklog_created(self, done: Done) -> None:
        """``MLflowLogger.run_id`` and ``.run`` name the run the shipper created."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(done.uri)
        exp = client.get_experiment_by_name("objs")
        assert exp is not None
        (run,) = client.search_runs([exp.experiment_id])
        assert done.seen["mlflow_run_id"] == run.info.run_id == done.seen["mlflow_run"]


class TestInProcess:
    def test_url_online_with_an_entity(self, tmp_path: Path) -> None:
        """Online with an entity, ``url`` is the run's page; ``path`` is entity/project/id."""
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        try:
            cfg = {"project": "p", "entity": "team", "id": "abc123", "mode": "online"}
            run = WandbRun(logger._session, cfg, None)
            assert run.url == "https://wandb.ai/team/p/runs/abc123"
            assert run.path == "team/p/abc123"
            assert not hasattr(run, "alert")
        finally:
            logger.finish()
