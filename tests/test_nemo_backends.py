"""A GRPO-shaped NeMo RL run through ``python -m ranklog.nemo``, every backend for real.

``tests/nemo_rl_stub`` is a stand-in NeMo RL package whose own logger and timer refuse
to import: the run works only if ``install()`` answers ``nemo_rl.utils.logger`` with
ranklog's. What lands in TensorBoard (EventAccumulator), MLflow (MlflowClient) and W&B
(the offline ``.wandb`` file) is read back and compared with NeMo RL's behaviour.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ranklog.testing import read_events

from .conftest import ROOT

pytest.importorskip("torch", reason="the stub GRPO loop passes torch tensors, as NeMo does")
pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")
pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
pytest.importorskip("swanlab", reason="extra swanlab; ./tools/test installs it")

STUB = Path(__file__).parent / "nemo_rl_stub"
STEPS = range(1, 21)
VAL_STEPS = [0, 5, 10, 15, 20]


def loss(step: int) -> float:
    import math

    return 2.0 * math.exp(-step / 8)


class Run:
    """The finished run: its experiment dir, tracking URI and console output."""

    def __init__(self, exp: Path, uri: str, out: str) -> None:
        self.exp, self.uri, self.out = exp, uri, out


@pytest.fixture(scope="module")
def grpo(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``python -m ranklog.nemo run_grpo.py``: 20 steps, W&B offline, MLflow on sqlite."""
    root = tmp_path_factory.mktemp("nemo-grpo")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUB), str(ROOT)]),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # fmt: skip
    cmd = [sys.executable, "-m", "ranklog.nemo", str(STUB / "run_grpo.py"), str(root / "logs"), uri]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Run(root / "logs" / "exp_001", uri, proc.stdout)


def tb(exp: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(exp / "tensorboard"), size_guidance={"scalars": 0, "images": 0,
                                                                    "histograms": 0,
                                                                    "tensors": 0})  # fmt: skip
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def mlrun(grpo: Run) -> tuple[Any, Any]:
    """(client, run) of the MLflow run the shipper wrote."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=grpo.uri)
    exp = client.get_experiment_by_name("grpo-dev")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


@pytest.fixture(scope="module")
def wandb_file(grpo: Run) -> Path:
    """The offline W&B run file, named by the configured id."""
    (path,) = sorted((grpo.exp / "wandb").rglob("run-grpodev0001.wandb"))
    return path


class TestTensorBoard:
    def test_under_log_dir_tensorboard(self, grpo: Run) -> None:
        """Events are in <log_dir>/tensorboard, whatever tensorboard.log_dir says (NeMo's rule)."""
        assert list((grpo.exp / "tensorboard").rglob("events.out.tfevents.*"))
        assert not (grpo.exp / "tb_logs").exists()

    def test_every_step_once_with_its_value(self, grpo: Run) -> None:
        """train/loss at steps 1..20; validation at 0, 5, .., 20; setup timing at 0."""
        acc = tb(grpo.exp)
        got = {e.step: e.value for e in acc.Scalars("train/loss")}
        assert got == pytest.approx({s: loss(s) for s in STEPS})
        assert [e.step for e in acc.Scalars("train/loss")] == list(STEPS)
        assert [e.step for e in acc.Scalars("validation/accuracy")] == VAL_STEPS
        assert [e.step for e in acc.Scalars("timing/setup/total_setup_time_s")] == [0]
        assert [e.step for e in acc.Scalars("timing/train/total_step_time")] == list(STEPS)
        assert [e.step for e in acc.Scalars("timing/validation/total_validation_time")] == VAL_STEPS
        grad = {e.step: e.value for e in acc.Scalars("train/grad_norm")}
        assert grad == pytest.approx({s: 0.25 for s in STEPS})

    def test_full_result_tables_are_text_tables(self, grpo: Run) -> None:
        """NeMo skips wandb.Tables in TensorBoard; ranklog shows them as Markdown tables."""
        events = tb(grpo.exp).Tensors("train/full_result_table")
        assert [e.step for e in events] == list(STEPS)

    def test_a_value_after_step_finished_lands(self, grpo: Run) -> None:
        """A value logged at step 20 after step_finished is at step 20, once, as with NeMo."""
        got = [(e.step, e.value) for e in tb(grpo.exp).Scalars("validation/final_accuracy")]
        assert got == [(20, pytest.approx(0.7))]

    def test_plots_and_histograms(self, grpo: Run) -> None:
        """Token-mult-prob-error plots at steps 7 and 14; timelines at 10, 20; histograms."""
        acc = tb(grpo.exp)
        tags = acc.Tags()
        plot = "train/token_mult_prob_error_plot_sample"
        assert [e.step for e in acc.Images(plot)] == [7, 14]
        assert [e.step for e in acc.Images("generation_metrics/per_worker_kv_cache")] == [10, 20]
        assert [e.step for e in acc.Images("generation_metrics/average_kv_cache")] == [10, 20]
        assert "train/advantages/histogram" in tags["histograms"]
        assert [e.step for e in acc.Histograms("train/advantages/histogram")] == list(STEPS)


class TestMLflow:
    def test_run_name_and_metrics(self, mlrun: tuple[Any, Any]) -> None:
        """One run, NeMo's run name; train/loss once per step with its value."""
        client, run = mlrun
        assert run.info.run_name == "grpo-dev-logger"
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(STEPS)
        assert {m.step: m.value for m in history} == pytest.approx({s: loss(s) for s in STEPS})

    def test_the_run_ends_finished(self, mlrun: tuple[Any, Any]) -> None:
        """After the program ends, the MLflow run is FINISHED with an end time, as NeMo's
        logger leaves it (never RUNNING for ever)."""
        _, run = mlrun
        assert run.info.status == "FINISHED"
        assert run.info.end_time and run.info.end_time >= run.info.start_time

    def test_a_value_after_step_finished_lands(self, mlrun: tuple[Any, Any]) -> None:
        """The value logged after step 20 was finished is at step 20, once."""
        client, run = mlrun
        history = client.get_metric_history(run.info.run_id, "validation/final_accuracy")
        assert [(m.step, m.value) for m in history] == [(20, pytest.approx(0.7))]

    def test_lists_summarised_as_nemo(self, mlrun: tuple[Any, Any]) -> None:
        """Per-worker lists merged, then /mean, /p50, /p90, /max (NeMo's MLflow summary), and
        no other statistic (``--histogram-stats``, NeMo's set under ranklog.nemo)."""
        client, run = mlrun
        base = "train/generation_logger_metrics/kv_cache"
        keys = {k for k in run.data.metrics if k.startswith(base + "/")}
        assert keys == {f"{base}/{s}" for s in ("mean", "p50", "p90", "max")}
        got = {s: client.get_metric_history(run.info.run_id, f"{base}/{s}")[0].value
               for s in ("mean", "p50", "p90", "max")}  # fmt: skip
        assert got == pytest.approx({"mean": 0.25, "p50": 0.25, "p90": 0.37, "max": 0.4})

    def test_params_flattened_lists_by_index(self, mlrun: tuple[Any, Any]) -> None:
        """The config as NeMo flattens it: dots, lists by index, nothing stringified whole."""
        _, run = mlrun
        p = run.data.params
        assert p["grpo.max_num_steps"] == "20"
        assert p["policy.layers.0"] == "4" and p["policy.layers.1"] == "8"
        assert p["policy.generation.backend"] == "vllm"

    def test_full_result_tables_are_table_artifacts(self, mlrun: tuple[Any, Any]) -> None:
        """The wandb.Table NeMo-Gym logs is a log_table JSON artifact per step in MLflow."""
        client, run = mlrun
        top = {f.path for f in client.list_artifacts(run.info.run_id, "tables")}
        assert len(top) == len(STEPS)
        files = client.list_artifacts(run.info.run_id, "tables/step_00000003/train")
        assert [f.path for f in files] == ["tables/step_00000003/train/full_result_table.json"]

    def test_plots_where_nemo_puts_them(self, mlrun: tuple[Any, Any]) -> None:
        """Figures at plots/<name>.png (the latest one, as NeMo overwrites it)."""
        client, run = mlrun
        files = {f.path for f in client.list_artifacts(run.info.run_id, "plots/train")}
        assert "plots/train/token_mult_prob_error_plot_sample.png" in files
        gen = {f.path for f in client.list_artifacts(run.info.run_id, "plots/generation_metrics")}
        assert "plots/generation_metrics/average_kv_cache.png" in gen


class TestWandb:
    def test_identity_as_configured(self, wandb_file: Path) -> None:
        """The run has the configured id, project, name, group, tags and notes."""
        from ranklog.shippers.targets._wandb_log import iter_records

        runs = [r.run for r in iter_records(wandb_file) if r.WhichOneof("record_type") == "run"]
        rec = runs[0]
        assert rec.run_id == "grpodev0001" and rec.project == "grpo-dev"
        assert rec.display_name == "grpo-dev-logger" and rec.run_group == "g1"
        assert list(rec.tags) == ["grpo", "ranklog"] and rec.notes == "drop-in check"

    def test_config_nested_as_nemo_shows_it(self, wandb_file: Path) -> None:
        """The config is nested, lists as lists (NeMo hands W&B the dict as is)."""
        from ranklog.shippers.targets._wandb_log import iter_records

        config: dict[str, Any] = {}
        for r in iter_records(wandb_file):
            kind = r.WhichOneof("record_type")
            if kind in ("config", "run"):
                cfg = r.config if kind == "config" else r.run.config
                config.update({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                               for i in cfg.update})  # fmt: skip
        assert config["policy"]["layers"] == [4, 8]
        assert config["policy"]["generation"] == {"backend": "vllm", "temperature": 1.0}
        assert config["grpo"] == {"max_num_steps": 20, "num_prompts_per_step": 8}

    def test_history_has_every_step(self, wandb_file: Path) -> None:
        """train/loss once per step with its value; validation at its steps."""
        from ranklog.shippers.targets._wandb_log import history_rows

        rows = list(history_rows(wandb_file))
        losses = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
        assert losses == pytest.approx({s: loss(s) for s in STEPS})
        assert sorted(r["_step"] for r in rows if "validation/accuracy" in r) == VAL_STEPS

    def test_full_result_tables_are_tables(self, wandb_file: Path) -> None:
        """NeMo-Gym's wandb.Table of results reaches W&B as a table at every step."""
        from ranklog.shippers.targets._wandb_log import history_rows

        rows = [r for r in history_rows(wandb_file) if "train/full_result_table._type" in r]
        assert sorted(r["_step"] for r in rows) == list(STEPS)
        assert {r["train/full_result_table._type"] for r in rows} == {"table-file"}
        path = next(wandb_file.parent.glob("files/" + rows[2]["train/full_result_table.path"]))
        table = json.loads(path.read_text())
        assert table["columns"] == ["Full result"]
        assert [json.loads(c) for (c,) in table["data"]] == [
            {"reward": rows[2]["_step"] / 20, "turns": i} for i in range(2)
        ]

    def test_plots_are_plotly_charts(self, wandb_file: Path) -> None:
        """With plotly installed, NeMo's plots are interactive charts in W&B, as its W&B
        logger's ``run.log({name: figure})`` makes them."""
        pytest.importorskip("plotly", reason="extra plots; ./tools/test installs it")
        from ranklog.shippers.targets._wandb_log import history_rows

        key = "train/token_mult_prob_error_plot_sample._type"
        types = [r[key] for r in history_rows(wandb_file) if key in r]
        assert types == ["plotly-file", "plotly-file"]

    def test_a_value_after_step_finished_is_dropped(self, wandb_file: Path) -> None:
        """As wandb.log after commit=True: a step below the run's current one is not kept."""
        from ranklog.shippers.targets._wandb_log import history_rows

        assert not [r for r in history_rows(wandb_file) if "validation/final_accuracy" in r]


class TestSwanlab:
    """NeMo's SwanlabLogger: ``swanlab.init(project, name, logdir=<log_dir>/swanlab)``."""

    @staticmethod
    def sessions(grpo: Run) -> list[Path]:
        return sorted((grpo.exp / "swanlab").glob("run-*-*/run-*.swanlab"))

    def test_project_and_name_under_log_dir_swanlab(self, grpo: Run) -> None:
        """Finished offline sessions under ``<log_dir>/swanlab``, the configured project and
        name (SwanLab's own reader)."""
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader

        from ranklog.shippers.targets.swanlab import read_session

        files = self.sessions(grpo)
        assert files and all(read_session(f)[1] for f in files)
        reader = DataStoreReader()
        reader.open(str(files[0]))
        for raw in reader:
            rec = Record()
            rec.ParseFromString(raw)
            if rec.HasField("start"):
                assert (rec.start.project, rec.start.name) == ("grpo-dev", "grpo-dev-swanlab")
                break
        else:
            pytest.fail("no start record")

    def test_every_step_once_with_its_value(self, grpo: Run) -> None:
        """train/loss at steps 1..20, validation at its steps, each once across sessions."""
        from ranklog.shippers.targets.swanlab import read_session

        seen: dict[str, list[int]] = {}
        losses = {}
        for f in self.sessions(grpo):
            for step, values in read_session(f)[0].items():
                for key, value in values.items():
                    seen.setdefault(key, []).append(step)
                    if key == "train/loss":
                        losses[step] = value
        assert losses == pytest.approx({s: loss(s) for s in STEPS})
        assert sorted(seen["train/loss"]) == list(STEPS)
        assert sorted(seen["validation/accuracy"]) == VAL_STEPS
        plot = "train/token_mult_prob_error_plot_sample"
        assert sorted(seen[plot]) == [7, 14]  # plots are swanlab.Image, as NeMo logs them

    def test_a_value_after_step_finished_is_left_out(self, grpo: Run) -> None:
        """A value logged at step 20 after its step was shipped does not reach SwanLab (a
        synced session cannot take a step back); NeMo's SwanLab logger writes it."""
        from ranklog.shippers.targets.swanlab import read_session

        keys = {k for f in self.sessions(grpo) for v in read_session(f)[0].values() for k in v}
        assert "validation/accuracy" in keys
        assert "validation/final_accuracy" not in keys

    def test_config_nested_as_nemo_gives_it(self, grpo: Run) -> None:
        """The hyperparameters are the run's config, nested as NeMo's dict."""
        import yaml

        last = self.sessions(grpo)[-1].parent / "files" / "config.yaml"
        config = {k: v["value"] for k, v in yaml.safe_load(last.read_text()).items()}
        assert config["policy"]["layers"] == [4, 8]
        assert config["grpo"] == {"max_num_steps": 20, "num_prompts_per_step": 8}


class TestFilesAndConsole:
    def test_jsonl_as_nemo_writes_it(self, grpo: Run) -> None:
        """train_data_stepN / val_data_stepN rows of one-element slices plus idx."""
        rows = [
            json.loads(x) for x in (grpo.exp / "train_data_step3.jsonl").read_text().splitlines()
        ]
        assert rows[1] == {"content": ["sample 3.1"], "rewards": [0.0], "token_ids": [[3, 4]],
                           "idx": 1}  # fmt: skip
        val = (grpo.exp / "val_data_step5.jsonl").read_text().splitlines()
        assert len(val) == 4 and json.loads(val[0])["idx"] == 0
        assert (grpo.exp / "trajectory_collection.jsonl").read_text() == '{"trajectory": 1}\n'

    def test_samples_printed(self, grpo: Run) -> None:
        """Validation samples are printed as NeMo prints them."""
        assert "TRAINING STEP 5" in grpo.out and "Sample 1 | Reward: 1.0000" in grpo.out

    def test_the_spool_holds_every_closed_step(self, grpo: Run) -> None:
        """The spool closed steps 0..20, each once, and nothing was late."""
        from ranklog.schemas import StepEnd

        ends = [e.step for e in read_events(grpo.exp / "spool") if isinstance(e, StepEnd)]
        assert sorted(set(ends)) == [0, *STEPS]


class TestStandaloneBackend:
    def test_tensorboard_logger_on_its_own(self, tmp_path: Path) -> None:
        """TensorboardLogger(cfg, log_dir) alone writes TensorBoard events into log_dir."""
        from ranklog.nemo import TensorboardLogger

        tb_dir = tmp_path / "tb"
        logger = TensorboardLogger({}, log_dir=str(tb_dir))
        for step in range(3):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step, prefix="train")
        logger.finish()
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tb_dir))
        acc.Reload()
        assert [(e.step, round(e.value, 3)) for e in acc.Scalars("train/loss")] == [
            (0, 1.0), (1, 0.5), (2, 0.333)]  # fmt: skip
