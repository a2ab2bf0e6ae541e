"""The NeMo RL drop-in: NeMo's config and calls, shipped to all three backends for real."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ranklog.nemo import Logger
from ranklog.testing import read_events

STEPS = 12


def _cfg(log_dir: Path) -> dict[str, Any]:
    return {
        "log_dir": str(log_dir),
        "wandb_enabled": True,
        "tensorboard_enabled": True,
        "mlflow_enabled": True,
        "wandb": {"project": "grpo-dev", "name": "grpo-dev-logging"},
        "tensorboard": {"log_dir": "tb_logs"},
        "mlflow": {
            "experiment_name": "nemo-rl-experiment",
            "run_name": "grpo-dev-run",
            "tracking_uri": None,
        },
        "monitor_gpus": False,
        "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
        "num_val_samples_to_print": 1,
    }


def _loss(step: int) -> float:
    return 2.0 * math.exp(-step / 5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A NeMo-style training loop run against the drop-in, with every backend enabled."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
        yield _train(tmp_path_factory.mktemp("nemo") / "logs")


def _train(log_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logger = Logger(_cfg(log_dir), rank=0, world_size=1)
    logger.log_hyperparams({"policy": {"model_name": "tiny"}, "grpo": {"lr": 1e-5}})
    for step in range(STEPS):
        logger.log_metrics({"loss": _loss(step), "reward": step / 10}, step, prefix="train")
        if step % 4 == 3:
            logger.log_metrics({"accuracy": 0.5, "sample": f"prompt {step} -> answer"}, step,
                               prefix="validation")  # fmt: skip
            logger.log_histogram([0.1, 0.2, 0.2, 0.9], step, "validation/rewards")
        logger.log_metrics({"step_time": 0.5}, step, prefix="timing", step_finished=True)
    fig, ax = plt.subplots()
    ax.plot(range(STEPS), [_loss(s) for s in range(STEPS)])
    logger.log_plot(fig, STEPS - 1, "train/loss_curve")
    plt.close(fig)
    logger.finish()
    return log_dir


def test_spool_holds_everything(trained: Path) -> None:
    """Every call landed in the spool: metrics, text, histogram, image, params."""
    kinds = {type(e).__name__ for e in read_events(trained / "spool")}
    assert {"Metrics", "Text", "Histogram", "Image", "Params", "StepEnd"} <= kinds


def test_tensorboard_has_every_step(trained: Path) -> None:
    """TensorBoard's reader sees each step of train/loss once, under log_dir/tensorboard.

    NeMo RL writes there whatever ``tensorboard.log_dir`` says; so does the drop-in.
    """
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        TENSORS,
        EventAccumulator,
    )

    assert not (trained / "tb_logs").exists()
    acc = EventAccumulator(str(trained / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(STEPS))
    assert [e.value for e in events] == pytest.approx([_loss(s) for s in range(STEPS)], rel=1e-6)


def test_mlflow_has_every_step(trained: Path) -> None:
    """MLflow holds one point per step, in the configured experiment and run name."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(trained / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("nemo-rl-experiment")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "grpo-dev-run"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(STEPS))
    assert {m.step: m.value for m in history} == pytest.approx({s: _loss(s) for s in range(STEPS)})
    assert run.data.params.get("grpo.lr") == "1e-05"


def test_wandb_has_every_step(trained: Path) -> None:
    """The offline W&B run holds each step once with its value, and the config."""
    from ranklog.shippers.targets._wandb_log import history_rows

    files = sorted((trained / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files
    rows = [r for f in files for r in history_rows(f) if "train/loss" in r]
    assert sorted(r["_step"] for r in rows) == list(range(STEPS))
    assert {r["_step"]: r["train/loss"] for r in rows} == pytest.approx(
        {s: _loss(s) for s in range(STEPS)}
    )


def test_only_the_owner_starts_shippers(tmp_path: Path) -> None:
    """Ranks other than the owner write to the spool and start no shipper."""
    logger = Logger(_cfg(tmp_path / "logs"), rank=1, world_size=2)
    try:
        assert logger._shippers == []
        assert len(logger.shipper_commands()) == 4  # what the owner would start
    finally:
        logger.finish()
