"""ranklog.nemo against NeMo RL's ``nemo_rl.utils.logger``: names, signatures and helpers.

What NeMo RL's module and Timer do was read from its source at commit 7ea279ab
(docs/nemo.md); the expectations below restate that behaviour. The backends, for real,
are in ``test_nemo_backends.py``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ranklog.nemo as nemo
from ranklog.errors import InvalidValueError
from ranklog.nemo import timer as nemo_timer
from ranklog.schemas import Histogram, Image, Metrics, Params, StepEnd, Text
from ranklog.testing import read_events

from .conftest import run_python
from .test_gpu import metrics_server  # noqa: F401 (a fixture: the recorded Ray export)

#: NeMo RL's public callables and their parameters (name, or name=default), at 7ea279ab
NEMO_SIGNATURES: dict[str, str] = {
    "flatten_dict": "d, sep='.', expand_lists=True",
    "should_log_nemo_gym_full_result_tables": "*, wandb_enabled, wandb_config",
    "configure_rich_logging": "level='INFO', show_time=True, show_path=True",
    "print_message_log_samples": "message_logs, rewards, num_samples=5, step=0",
    "get_next_experiment_dir": "base_log_dir",
    "log_container_init_timing": "",
    "_merge_generation_logger_workers": "metrics",
    "_summarize_list": "values",
    "Logger": "cfg",
    "TensorboardLogger": "cfg, log_dir=None",
    "WandbLogger": "cfg, log_dir=None",
    "SwanlabLogger": "cfg, log_dir=None",
    "MLflowLogger": "cfg, log_dir=None",
    "RayGpuMonitorLogger": (
        "collection_interval, flush_interval, metric_prefix, step_metric, parent_logger=None"
    ),
}
#: every method NeMo's Logger has, with its parameters
LOGGER_METHODS: dict[str, str] = {
    "log_metrics": "self, metrics, step, prefix='', step_metric=None, step_finished=False",
    "log_hyperparams": "self, params",
    "finish": "self",
    "log_batched_dict_as_jsonl": "self, to_log, filename",
    "log_string_list_as_jsonl": "self, to_log, filename",
    "log_plot_per_worker_timeline_metrics": (
        "self, metrics, step, prefix, name, timeline_interval"
    ),
    "log_histogram": "self, histogram, step, name",
    "log_plot": "self, figure, step, name",
    "log_plot_token_mult_prob_error": "self, data, step, name",
}
TIMER_METHODS: dict[str, str] = {
    "__init__": "self, context=None",
    "start": "self, label, should_log=True",
    "stop": "self, label, should_log=True",
    "record": "self, label, elapsed",
    "mark": "self, label, metadata=None",
    "get_markers": "self, label=None",
    "time": "self, label, should_log=True",
    "get_elapsed": "self, label",
    "get_latest_elapsed": "self, label",
    "reduce": "self, label, operation='mean'",
    "get_timing_metrics": "self, reduction_op='mean'",
    "reset": "self, label=None",
}
CONFIG_KEYS = {
    "WandbConfig": {"project", "name", "entity", "log_nemo_gym_full_result_tables"},
    "SwanlabConfig": {"project", "name"},
    "TensorboardConfig": {"log_dir"},
    "MLflowConfig": {"experiment_name", "run_id", "run_name", "tracking_uri", "artifact_location"},
    "GPUMonitoringConfig": {"collection_interval", "flush_interval"},
    "LoggerConfig": {"log_dir", "wandb_enabled", "swanlab_enabled", "tensorboard_enabled",
                     "mlflow_enabled", "wandb", "tensorboard", "swanlab", "mlflow",
                     "monitor_gpus", "gpu_monitoring", "num_val_samples_to_print"},
    "GpuMetricSnapshot": {"step", "metrics"},
}  # fmt: skip


def params(fn: Any) -> str:
    """``fn``'s parameters as NeMo's table writes them (annotations left out)."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def no_backends(log_dir: Path, **extra: Any) -> dict[str, Any]:
    """A NeMo logger config with every backend off (the spool only)."""
    return {"log_dir": str(log_dir), "wandb_enabled": False, "swanlab_enabled": False,
            "tensorboard_enabled": False, "mlflow_enabled": False, "monitor_gpus": False,
            "wandb": {}, "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
            **extra}  # fmt: skip


class TestModuleFidelity:
    def test_every_public_name_is_exported(self) -> None:
        """Every public name of NeMo's module is in ranklog.nemo (and its __all__)."""
        names = {*NEMO_SIGNATURES, *CONFIG_KEYS, "LoggerInterface"}
        assert names <= set(nemo.__all__)
        assert all(hasattr(nemo, n) for n in nemo.__all__)

    @pytest.mark.parametrize("name", sorted(NEMO_SIGNATURES))
    def test_signature(self, name: str) -> None:
        """Each function and class takes NeMo's parameters, with NeMo's defaults."""
        assert params(getattr(nemo, name)) == NEMO_SIGNATURES[name]

    @pytest.mark.parametrize("method", sorted(LOGGER_METHODS))
    def test_logger_method(self, method: str) -> None:
        """Logger has each of NeMo's methods with NeMo's parameters."""
        assert params(getattr(nemo.Logger, method)) == LOGGER_METHODS[method]

    @pytest.mark.parametrize("name", sorted(CONFIG_KEYS))
    def test_config_typeddicts(self, name: str) -> None:
        """The config TypedDicts declare NeMo's keys."""
        assert set(getattr(nemo, name).__annotations__) == CONFIG_KEYS[name]

    def test_interface_has_four_abstract_methods(self) -> None:
        """LoggerInterface declares log_metrics, log_hyperparams, log_histogram, log_plot."""
        assert nemo.LoggerInterface.__abstractmethods__ == {
            "log_metrics", "log_hyperparams", "log_histogram", "log_plot"
        }  # fmt: skip
        for cls in (nemo.Logger, nemo.TensorboardLogger, nemo.WandbLogger, nemo.MLflowLogger):
            assert issubclass(cls, nemo.LoggerInterface)
            for m in ("log_metrics", "log_histogram", "log_plot"):
                assert params(getattr(cls, m)) == params(getattr(nemo.LoggerInterface, m))

    def test_ray_monitor_methods(self) -> None:
        """RayGpuMonitorLogger keeps NeMo's method names, private ones included."""
        for m in ("start", "stop", "flush", "_collection_loop", "_parse_metric",
                  "_parse_gpu_sku", "_collect_gpu_sku", "_collect_metrics", "_collect",
                  "_fetch_and_parse_metrics"):  # fmt: skip
            assert callable(getattr(nemo.RayGpuMonitorLogger, m)), m

    def test_import_is_light(self) -> None:
        """Importing ranklog.nemo imports no backend, numpy, matplotlib or torch."""
        heavy = "('numpy', 'matplotlib', 'torch', 'wandb', 'mlflow', 'tensorboard', 'ray')"
        code = f"import sys, ranklog.nemo; print([m for m in {heavy} if m in sys.modules])"
        import subprocess

        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stdout.strip() == "[]", out.stderr


class TestHelpers:
    def test_flatten_dict_nested_and_lists(self) -> None:
        """Nested dicts join with the separator; lists expand by index unless told not to."""
        f = nemo.flatten_dict
        assert f({}) == {}
        assert f({"a": 1, "b": {"c": 2, "d": 3}, "e": {"f": {"g": 4}}}) == {
            "a": 1, "b.c": 2, "b.d": 3, "e.f.g": 4}  # fmt: skip
        assert f({"a": {"b": 1}}, sep="_") == {"a_b": 1}
        assert f({"a": [1, 2], "b": {"c": [3, 4]}}) == {"a.0": 1, "a.1": 2, "b.c.0": 3, "b.c.1": 4}
        assert f({"a": [{"b": 1}, {"c": 2}]}) == {"a.0.b": 1, "a.1.c": 2}
        assert f({"m": {0: [1, 2], 1: [3]}}) == {"m.0.0": 1, "m.0.1": 2, "m.1.0": 3}
        assert f({"m": {0: [1, 2, 3]}}, expand_lists=False) == {"m.0": [1, 2, 3]}
        assert f({"t": (1, 2), "e": [], "d": {}}) == {"t": (1, 2)}

    def test_summarize_list(self) -> None:
        """mean/p50/p90/max of the numbers (bools and strings left out), as numpy computes."""
        import numpy as np

        s = nemo._summarize_list
        assert s([1, 2, 3, 4]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "max": 4.0})
        assert s([5.0]) == {"mean": 5.0, "p50": 5.0, "p90": 5.0, "max": 5.0}
        assert s([]) == {} and s(["x", True]) == {}
        values = [np.int64(1), np.float32(5), 3]
        assert s(values)["mean"] == 3.0
        assert s(values)["p90"] == pytest.approx(float(np.percentile([1, 5, 3], 90)))

    def test_merge_generation_logger_workers(self) -> None:
        """Per-worker lists become one list per metric; the input is not changed."""
        metrics = {"generation_logger_metrics": {"kv": {0: [1, 2], 1: [3]}, "n": 7}, "loss": 1}
        merged = nemo._merge_generation_logger_workers(metrics)
        assert merged == {"generation_logger_metrics": {"kv": [1, 2, 3], "n": 7}, "loss": 1}
        assert metrics["generation_logger_metrics"]["kv"] == {0: [1, 2], 1: [3]}
        plain = {"loss": 1}
        assert nemo._merge_generation_logger_workers(plain) is plain

    @pytest.mark.parametrize(
        ("enabled", "cfg", "expected"),
        [(True, {"log_nemo_gym_full_result_tables": True}, True),
         (True, {"log_nemo_gym_full_result_tables": False}, False),
         (True, {}, False),
         (False, {"log_nemo_gym_full_result_tables": True}, False),
         (False, {}, False)],
    )  # fmt: skip
    def test_should_log_full_result_tables(
        self, enabled: bool, cfg: dict[str, Any], expected: bool
    ) -> None:
        """True only when W&B is on and the flag is set (a real bool)."""
        got = nemo.should_log_nemo_gym_full_result_tables(wandb_enabled=enabled, wandb_config=cfg)  # type: ignore[arg-type]
        assert got is expected

    def test_get_next_experiment_dir(self, tmp_path: Path) -> None:
        """exp_001 first, then one past the highest number, created on disk."""
        first = nemo.get_next_experiment_dir(str(tmp_path))
        assert first == str(tmp_path / "exp_001") and Path(first).is_dir()
        (tmp_path / "exp_007").mkdir()
        assert nemo.get_next_experiment_dir(str(tmp_path)) == str(tmp_path / "exp_008")

    def test_print_message_log_samples(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The samples' messages and rewards are printed, best first."""
        logs = [
            [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "2+2 = 4"}],
            [{"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "7"}],
        ]  # fmt: skip
        nemo.print_message_log_samples(logs, [1.0, 0.0], num_samples=1, step=3)
        out = capsys.readouterr().out
        assert "TRAINING STEP 3" in out
        assert "What is 2+2?" in out and "2+2 = 4" in out
        assert "Sample 1 | Reward: 1.0000" in out and "What is 3+3?" not in out
        nemo.print_message_log_samples([], [], step=1)
        assert "No message logs or rewards to display" in capsys.readouterr().out

    def test_container_init_timing(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture,
    ) -> None:  # fmt: skip
        """Without NRL_JOB_START_EPOCH a warning; with every variable, the full breakdown."""
        for var in ("NRL_JOB_START_EPOCH", "SLURM_JOB_START_TIME", "NRL_RAY_READY_EPOCH"):
            monkeypatch.delenv(var, raising=False)
        with caplog.at_level(logging.WARNING):
            nemo.log_container_init_timing()
        assert "NRL_JOB_START_EPOCH not set" in caplog.text
        assert "CONTAINER INIT TIMING" not in capsys.readouterr().out
        now = time.time()
        monkeypatch.setenv("SLURM_JOB_START_TIME", str(int(now) - 3))
        monkeypatch.setenv("NRL_JOB_START_EPOCH", str(int(now) - 2))
        monkeypatch.setenv("NRL_RAY_READY_EPOCH", str(int(now) - 1))
        nemo.log_container_init_timing()
        out = capsys.readouterr().out
        assert "CONTAINER INIT TIMING" in out and "slurm_prologue: 1.0s" in out
        assert "cluster_startup (orchestrator+container+ray): 1.0s" in out
        assert "driver_startup (launch+python+imports):" in out and "total:" in out


class TestTimer:
    @pytest.mark.parametrize("level", ["DEBUG", "INFO", None])
    def test_debug_records_as_nemos(self, level: str | None) -> None:
        """``NRL_LOG_LEVEL=DEBUG`` shows the Timer's records as NeMo's do: logger
        ``nemo_rl.utils.timer``, DEBUG, ``[context] label event ts=...``; INFO (NeMo's
        default) and no variable show none."""
        code = ("import logging\n"
                "logging.basicConfig(format='%(name)s %(levelname)s %(message)s')\n"
                "from ranklog.nemo.timer import Timer\n"
                "t = Timer({'rank': 3})\n"
                "t.start('gen'); t.stop('gen'); t.record('load', 0.5)\n"
                "t.mark('crash', {'w': 1})\n")  # fmt: skip
        env = {"NRL_LOG_LEVEL": level} if level else {}
        out = run_python(code, **env)
        assert out.returncode == 0, out.stderr
        lines = out.stderr.splitlines()
        if level != "DEBUG":
            assert lines == []
            return
        host = socket.gethostname()
        want = ["gen start", "gen end elapsed=", "load record elapsed=0.5000s",
                "crash mark meta={'w': 1}"]  # fmt: skip
        assert len(lines) == 4, lines
        for line, event in zip(lines, want, strict=True):
            assert line.startswith(f"nemo_rl.utils.timer DEBUG [rank=3 hostname={host}] {event}")
            assert re.search(r" ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", line), line

    def test_start_stop_and_reductions(self) -> None:
        """Durations per label; reduce and get_timing_metrics as NeMo's (sum per label)."""
        t = nemo_timer.Timer(context={"worker": "driver"})
        with t.time("generation"):
            time.sleep(0.01)
        t.record("generation", 1.0)
        t.record("prepare_for_generation/total", 0.5)
        gen = t.get_elapsed("generation")
        assert len(gen) == 2 and gen[0] >= 0.01
        assert t.reduce("generation", "sum") == pytest.approx(sum(gen))
        assert t.reduce("generation", "count") == 2
        assert t.reduce("generation", "max") == 1.0
        assert t.get_latest_elapsed("generation") == 1.0
        assert t.get_timing_metrics(reduction_op="sum") == pytest.approx(
            {"generation": sum(gen), "prepare_for_generation/total": 0.5})  # fmt: skip
        mixed = t.get_timing_metrics({"generation": "max", "other": "mean"})
        assert mixed["generation"] == 1.0 and mixed["prepare_for_generation/total"] == [0.5]
        assert t._context["worker"] == "driver" and "hostname" in t._context
        t.reset("generation")
        assert "generation" not in t._timers
        t.reset()
        assert t._timers == {}

    def test_std_and_median_match_numpy(self) -> None:
        """std is numpy's (population) deviation; median numpy's."""
        import numpy as np

        t = nemo_timer.Timer()
        for v in (1.0, 2.0, 4.0, 8.0):
            t.record("x", v)
        assert t.reduce("x", "std") == pytest.approx(float(np.std([1, 2, 4, 8])))
        assert t.reduce("x", "median") == pytest.approx(float(np.median([1, 2, 4, 8])))

    def test_errors_are_nemos(self) -> None:
        """Starting twice, stopping a stopped timer, an unknown op or label raise NeMo's errors."""
        t = nemo_timer.Timer()
        t.start("a")
        with pytest.raises(ValueError, match="Timer 'a' is already running"):
            t.start("a")
        t.stop("a")
        with pytest.raises(ValueError, match="Timer 'a' is not running"):
            t.stop("a")
        with pytest.raises(ValueError, match=r"Invalid operation 'p99'\. Valid options are: mean"):
            t.reduce("a", "p99")
        with pytest.raises(KeyError, match="No timings recorded for 'b'"):
            t.get_elapsed("b")

    def test_block_that_raises_is_timed(self) -> None:
        """A failing ``time()`` block is still recorded."""
        t = nemo_timer.Timer()
        with pytest.raises(RuntimeError), t.time("boom"):
            raise RuntimeError
        assert len(t.get_elapsed("boom")) == 1

    def test_markers(self) -> None:
        """mark() returns epoch seconds; get_markers copies, empty for an unknown label."""
        t = nemo_timer.Timer()
        ts = t.mark("refit", {"v": 1})
        assert abs(ts - time.time()) < 5
        assert t.get_markers("refit") == {"refit": [(ts, {"v": 1})]}
        assert t.get_markers("none") == {"none": []}

    @pytest.mark.parametrize("method", sorted(TIMER_METHODS))
    def test_signatures(self, method: str) -> None:
        """Timer and ThreadSafeTimer take NeMo's parameters."""
        for cls in (nemo_timer.Timer, nemo_timer.ThreadSafeTimer):
            assert params(getattr(cls, method)) == TIMER_METHODS[method]

    def test_thread_safe_timer_under_threads(self) -> None:
        """Eight threads recording at once lose no duration."""
        t = nemo_timer.ThreadSafeTimer()
        threads = [threading.Thread(target=lambda: [t.record("x", 1.0) for _ in range(500)])
                   for _ in range(8)]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert t.reduce("x", "count") == 4000

    def test_timeout_checker(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Fires once: when the limit is reached, or when one more mean step would pass it."""
        assert nemo_timer.convert_to_seconds("01:02:03:04") == 86400 + 7200 + 180 + 4
        c = nemo_timer.TimeoutChecker(timeout="00:00:00:10", fit_last_save_time=True)
        c.start_iterations()
        c.iteration_times = [4.0]
        monkeypatch.setattr(nemo_timer._time, "time", lambda: c.start_time + 7.0)
        assert c.check_save() is True
        assert c.check_save() is False
        never = nemo_timer.TimeoutChecker(timeout=None)
        assert never.check_save() is False


class TestPlots:
    @pytest.fixture(autouse=True)
    def _agg(self) -> None:
        import matplotlib

        matplotlib.use("Agg")

    def test_token_mult_prob_error_figure(self) -> None:
        """One figure, five lines, NeMo's labels, handed to log_plot under the given name."""
        import numpy as np

        got: list[tuple[Any, int, str]] = []
        gen = np.log(np.linspace(0.3, 0.9, 10))[None, :]
        prev = gen.copy()
        prev[0, 5] -= 0.7
        data = {"token_mask": np.ones((1, 10)), "sample_mask": np.ones(1),
                "generation_logprobs": gen, "prev_logprobs": prev,
                "prompt_lengths": np.array([2]), "full_lengths": np.array([8])}  # fmt: skip

        def keep(fig: Any, step: int, name: str) -> None:
            lines = fig.axes[0].get_lines()
            texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
            got.append((len(lines), step, name))
            assert texts[0] == "logprob (inference engine)"
            assert texts[1] == "logprob (reference policy)"
            assert texts[2].startswith("abs diff (token_mult_prob_error=")
            assert texts[3] == "Max abs error: 0.7000"
            assert texts[4].startswith("Max rel error (prob): ")
            assert fig.axes[0].get_xlabel() == "Token Position (starting from prompt end)"
            assert fig.axes[0].get_ylabel() == "Log Probability/Difference"
            assert list(lines[0].get_xdata()) == list(range(1, 7))

        from ranklog.nemo._plots import plot_token_mult_prob_error

        plot_token_mult_prob_error(data, 3, "train/token_mult_prob_error_plot_sample", keep)
        assert got == [(5, 3, "train/token_mult_prob_error_plot_sample")]

    def test_per_worker_timeline_figures(self) -> None:
        """A line per worker (sorted), then their average; ValueError for interval 0."""
        from ranklog.nemo._plots import plot_per_worker_timeline

        figs: list[tuple[str, list[tuple[list[float], list[float], str]]]] = []

        def keep(fig: Any, step: int, name: str) -> None:
            lines = [(list(x.get_xdata()), list(x.get_ydata()), x.get_label())
                     for x in fig.axes[0].get_lines()]  # fmt: skip
            figs.append((name, lines))

        plot_per_worker_timeline({1: [2, 3, 4], 0: [1, 2, 3]}, 1, "vllm", "kv_cache", 0.5, keep)
        assert figs == [
            ("vllm/per_worker_kv_cache", [([0.0, 0.5, 1.0], [1.0, 2.0, 3.0], "worker_0"),
                                          ([0.0, 0.5, 1.0], [2.0, 3.0, 4.0], "worker_1")]),
            ("vllm/average_kv_cache", [([0.0, 0.5, 1.0], [1.5, 2.5, 3.5], "average")]),
        ]  # fmt: skip
        with pytest.raises(ValueError, match=r"timeline_interval must be positive; received 0\.0"):
            plot_per_worker_timeline({0: [1]}, 1, "vllm", "kv", 0.0, keep)
        plot_per_worker_timeline({}, 1, "vllm", "kv", 1.0, keep)
        plot_per_worker_timeline({0: []}, 1, "vllm", "kv", 1.0, keep)
        assert len(figs) == 2


class TestJsonl:
    def test_batched_dict_rows_as_nemo_writes_them(self, tmp_path: Path) -> None:
        """One line per row, each value a one-element slice, then idx; the file is rewritten."""
        logger = nemo.Logger(no_backends(tmp_path / "logs"))  # type: ignore[arg-type]
        try:
            logger.log_batched_dict_as_jsonl({"content": ["a", "b"], "rewards": [1.0, 0.0]},
                                             "val_data_step1.jsonl")  # fmt: skip
            logger.log_batched_dict_as_jsonl({"content": ["c"], "rewards": [2.0]},
                                             "val_data_step1.jsonl")  # fmt: skip
            import numpy as np

            batch = {"ids": np.array([[1, 2], [3, 4]]), "o": [object(), 1]}
            logger.log_batched_dict_as_jsonl(batch, "sub/train.jsonl")
        finally:
            logger.finish()
        lines = (tmp_path / "logs" / "val_data_step1.jsonl").read_text().splitlines()
        assert [json.loads(x) for x in lines] == [{"content": ["c"], "rewards": [2.0], "idx": 0}]
        rows = [json.loads(x) for x in (tmp_path / "logs/sub/train.jsonl").read_text().splitlines()]
        assert rows[0]["ids"] == [[1, 2]] and rows[1]["ids"] == [[3, 4]]
        assert rows[0]["o"][0].startswith("<object object") and rows[1]["idx"] == 1

    def test_string_list_is_appended(self, tmp_path: Path) -> None:
        """Strings are appended as lines, unencoded."""
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        try:
            logger.log_string_list_as_jsonl(['{"a": 1}'], "trajectory_collection.jsonl")
            logger.log_string_list_as_jsonl(['{"a": 2}', '{"a": 3}'], "trajectory_collection.jsonl")
        finally:
            logger.finish()
        text = (tmp_path / "trajectory_collection.jsonl").read_text()
        assert text == '{"a": 1}\n{"a": 2}\n{"a": 3}\n'


class TestLoggerSpool:
    """What the Logger writes to its spool (the backends read it in test_nemo_backends)."""

    def test_values_by_kind(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """Numbers, strings, nested dicts, lists and figures each take their path."""
        import numpy as np

        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, "ranklog.nemo"):
            logger.log_metrics({"loss": np.float32(0.5), "ok": True, "n": np.array([3]),
                                "sample": "q -> a", "lens": [1, 2, 3], "adv": np.ones((2, 2)),
                                "generation_logger_metrics": {"kv": {0: [1.0], 1: [3.0]}},
                                "table": object(), "none": None}, 1, prefix="train")  # fmt: skip
            logger.log_metrics({"table": object()}, 2, prefix="train")
        logger.finish()
        events = read_events(tmp_path / "spool")
        metrics = {k: v for e in events if isinstance(e, Metrics) for k, v in e.values.items()}
        assert metrics == {"train/loss": 0.5, "train/ok": 1.0, "train/n": 3.0}
        assert [(e.name, e.text) for e in events if isinstance(e, Text)] == [
            ("train/sample", "q -> a")
        ]
        hists = {e.name: list(e.values) for e in events if isinstance(e, Histogram)}
        assert hists == {"train/lens": [1, 2, 3], "train/adv": [1, 1, 1, 1],
                         "train/generation_logger_metrics/kv": [1.0, 3.0]}  # fmt: skip
        skipped = [r.getMessage() for r in caplog.records]
        assert len([m for m in skipped if "'train/table'" in m]) == 1  # once per key
        assert any("'train/none'" in m for m in skipped)

    def test_bad_name_logs_nothing_of_the_call(self, tmp_path: Path) -> None:
        """A bad key raises naming it, and nothing of that call reaches the spool."""
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError, match="bad\\\\x00"):
            logger.log_metrics({"fine": 1.0, "text": "t", "bad\x00": 2.0}, 1)
        logger.finish()
        events = read_events(tmp_path / "spool")
        assert not [e for e in events if isinstance(e, Metrics | Text)]

    def test_steps_close_as_nemo_loops_log(self, tmp_path: Path) -> None:
        """step_finished closes (GRPO), timing/train too (SFT), and so does a later step."""
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        ends: list[int] = []
        logger.log_metrics({"a": 1}, 0, prefix="validation")
        logger.log_metrics({"a": 1}, 1, prefix="train")  # closes 0
        logger.log_metrics({"t": 1}, 1, prefix="timing/train", step_finished=True)  # closes 1
        logger.log_metrics({"a": 1}, 2, prefix="train")
        logger.log_metrics({"t": 1}, 2, prefix="timing/train")  # SFT: no step_finished
        logger.log_metrics({"a": 1}, 3, prefix="train")
        logger.log_metrics({"gpu": 1, "ray/ray_step": 40}, 40, prefix="ray",
                           step_metric="ray/ray_step")  # fmt: skip
        logger.finish()  # closes 3
        events = read_events(tmp_path / "spool")
        ends = [e.step for e in events if isinstance(e, StepEnd)]
        assert ends == [0, 1, 2, 3]
        ray_at = {e.step for e in events if isinstance(e, Metrics) and "ray/gpu" in e.values}
        assert ray_at == {3}  # a custom x-axis never moves the training step

    def test_hyperparams_flattened_as_nemo(self, tmp_path: Path) -> None:
        """Nested config flattened with ".", lists by index (W&B nests it back)."""
        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        logger.log_hyperparams({"policy": {"lr": 1e-5, "layers": [4, 8]}, "seed": 1})
        logger.finish()
        (p,) = [e for e in read_events(tmp_path / "spool") if isinstance(e, Params)]
        assert p.values == {
            "policy.lr": 1e-5,
            "policy.layers.0": 4,
            "policy.layers.1": 8,
            "seed": 1,
        }

    def test_plots_and_histograms(self, tmp_path: Path) -> None:
        """log_plot is an image; log_histogram a histogram (an empty one logs 0)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        logger = nemo.Logger(no_backends(tmp_path))  # type: ignore[arg-type]
        fig, _ = plt.subplots()
        logger.log_plot(fig, 2, "train/curve")
        plt.close(fig)
        logger.log_histogram([0.1, 0.2], 2, "train/advantages/histogram")
        logger.log_histogram([], 2, "train/empty")
        logger.finish()
        events = read_events(tmp_path / "spool")
        assert [(e.name, e.step) for e in events if isinstance(e, Image)] == [("train/curve", 2)]
        assert [e.name for e in events if isinstance(e, Histogram)] == [
            "train/advantages/histogram"
        ]
        assert any(isinstance(e, Metrics) and e.values == {"train/empty": 0.0} for e in events)

    def test_swanlab_ships_to_log_dir_swanlab(self, tmp_path: Path) -> None:
        """swanlab_enabled: a shipper to ``swanlab:<project>`` writing under
        ``<log_dir>/swanlab``, named as the config says; ``logger.swanlab_logger`` is set."""
        cfg = no_backends(tmp_path, swanlab_enabled=True,
                          swanlab={"project": "p1", "name": "exp-9"})  # fmt: skip
        (cmd,) = [c for c in nemo.Logger.shipper_commands(cfg) if "swanlab:p1" in c]
        assert cmd[cmd.index("--dir") + 1] == str(tmp_path / "swanlab")
        assert cmd[cmd.index("--run-name") + 1] == "exp-9"

    def test_del_of_a_bare_logger_is_quiet(self) -> None:
        """A Logger made with __new__ (as NeMo's tests do) is collected without error."""
        bare = nemo.Logger.__new__(nemo.Logger)
        bare.loggers = []
        bare.__del__()

    def test_only_the_owner_starts_shippers(self, tmp_path: Path) -> None:
        """A rank that is not the owner writes its spool and starts no shipper."""
        cfg = no_backends(tmp_path, tensorboard_enabled=True,
                          ranklog={"rank": 1, "world_size": 2})  # fmt: skip
        logger = nemo.Logger(cfg)  # type: ignore[arg-type]
        try:
            assert logger._session._shippers == []
            assert [c[c.index("--to") + 1] for c in logger._session.commands] == [
                f"tensorboard:{tmp_path / 'tensorboard'}"]  # fmt: skip
        finally:
            logger.finish()


class TestInstall:
    def test_nemo_modules_resolve_to_ranklog(self, tmp_path: Path) -> None:
        """After install(), nemo_rl.utils.logger/timer are ranklog's, NeMo's files unread."""
        pkg = tmp_path / "nemo_rl" / "utils"
        pkg.mkdir(parents=True)
        (tmp_path / "nemo_rl" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "logger.py").write_text("raise ImportError('NeMo RL logger imported')\n")
        (pkg / "timer.py").write_text("raise ImportError('NeMo RL timer imported')\n")
        code = ("import ranklog.nemo as r; r.install()\n"
                "from nemo_rl.utils.logger import Logger, flatten_dict\n"
                "from nemo_rl.utils.timer import Timer\n"
                "import nemo_rl.utils.logger as m\n"
                "assert Logger is r.Logger and m is r and m.__spec__.name == 'ranklog.nemo'\n"
                "assert Timer.__module__ == 'ranklog.nemo.timer'\n"
                "print('ok')\n")  # fmt: skip
        import subprocess

        env = {**_env(), "PYTHONPATH": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert out.stdout.strip() == "ok", out.stderr[-2000:]

    def test_install_after_nemo_import_is_an_error(self, tmp_path: Path) -> None:
        """NeMo's module already imported: install() says to call it first."""
        pkg = tmp_path / "nemo_rl" / "utils"
        pkg.mkdir(parents=True)
        for p in (tmp_path / "nemo_rl", pkg):
            (p / "__init__.py").write_text("")
        (pkg / "logger.py").write_text("X = 1\n")
        code = ("import nemo_rl.utils.logger\nimport ranklog.nemo as r\ntry:\n    r.install()\n"
                "except Exception as e:\n    print(type(e).__name__, e)\n")  # fmt: skip
        import subprocess

        env = {**_env(), "PYTHONPATH": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert out.stdout.startswith("ConfigError nemo_rl.utils.logger was imported before")


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


class _Parent:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int, str, str]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "",
                    step_metric: str | None = None) -> None:  # fmt: skip
        self.calls.append((dict(metrics), step, prefix, step_metric or ""))


class TestRayGpuMonitorLogger:
    def test_parse_metric_names(self) -> None:
        """Ray's samples become node.I.gpu.J.util|mem_gb and node.I.mem_gb|mem_total_gb."""
        from ranklog.nemo._backends import Sample

        m = nemo.RayGpuMonitorLogger(1, 10, "ray", "ray/ray_step")
        assert m._parse_metric(Sample("ray_node_gpus_utilization", {"GpuIndex": "0"}, 75.5), 1) == {
            "node.1.gpu.0.util": 75.5}  # fmt: skip
        assert m._parse_metric(Sample("ray_node_gram_used", {"GpuIndex": "0"}, 80 * 1024), 1) == {
            "node.1.gpu.0.mem_gb": 80.0}  # fmt: skip
        assert m._parse_metric(Sample("ray_node_mem_used", {}, 100 * 1024**3), 1) == {
            "node.1.mem_gb": 100.0}  # fmt: skip
        assert m._parse_metric(Sample("ray_node_mem_total", {}, 200 * 1024**3), 1) == {
            "node.1.mem_total_gb": 200.0}  # fmt: skip
        assert m._parse_metric(Sample("ray_node_cpu_count", {}, 8), 1) == {}

    def test_fetch_and_flush_to_parent(self, metrics_server: tuple[int, list[str]]) -> None:  # noqa: F811
        """The agent's export is parsed per node; flush hands each snapshot to the parent."""
        metrics_agent = f"127.0.0.1:{metrics_server[0]}"
        parent = _Parent()
        m = nemo.RayGpuMonitorLogger(1, 10, "ray", "ray/ray_step", parent_logger=parent)
        got = m._fetch_and_parse_metrics(0, metrics_agent, m._parse_metric)
        assert got["node.0.gpu.0.util"] >= 0 and "node.0.mem_total_gb" in got
        assert all(math.isfinite(v) for v in got.values())
        skus = m._fetch_and_parse_metrics(0, metrics_agent, m._parse_gpu_sku)
        assert skus and all(k.endswith(".type") for k in skus)
        m.metrics_buffer = [{"step": 3, "metrics": dict(got)}, {"step": 13, "metrics": {"a": 1}}]
        m.flush()
        calls = [(c[1], c[2], c[3]) for c in parent.calls]
        assert calls == [(3, "ray", "ray/ray_step"), (13, "ray", "ray/ray_step")]
        assert parent.calls[1][0] == {"a": 1, "ray/ray_step": 13} and m.metrics_buffer == []

    def test_start_needs_ray(self) -> None:
        """start() without ray.init() raises NeMo's ValueError."""
        pytest.importorskip("ray")
        import ray

        if ray.is_initialized():
            pytest.skip("a Ray driver is connected in this process")
        m = nemo.RayGpuMonitorLogger(1, 10, "ray", "ray/ray_step")
        with pytest.raises(ValueError, match="Ray must be initialized"):
            m.start()


_JOB = """
import json, os, signal, sys, time
from ranklog.nemo import Logger
cfg, first, last = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kill, wait = sys.argv[4], float(sys.argv[5])
logger = Logger(cfg)
for step in range(first, last):
    logger.log_metrics({"loss": step / 10}, step, prefix="train", step_finished=True)
if kill == "kill":
    logger.run.flush()
    time.sleep(wait)  # 0: nothing shipped yet; 1.5: some or all of it
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole job: ranks and shippers
logger.finish()
"""


class TestWholeJobKill:
    @pytest.mark.parametrize("wait", [0.0, 1.5])
    def test_the_next_logger_ships_what_the_killed_job_left(
        self, tmp_path: Path, wait: float
    ) -> None:
        """Ranks and shippers SIGKILLed together; the next ``Logger(cfg)`` on the same log_dir
        (a requeue) ships the killed job's closed steps and its own, each once."""
        import subprocess

        pytest.importorskip("tensorboard")
        from .test_tensorboard import tb_back

        cfg = no_backends(tmp_path, tensorboard_enabled=True)
        for first, last, kill in ((0, 10, "kill"), (10, 15, "")):
            proc = subprocess.run(
                [sys.executable, "-c", _JOB, json.dumps(cfg), str(first), str(last), kill,
                 str(wait)],
                env=_env(), capture_output=True, text=True, timeout=300,
                start_new_session=True, check=False,
            )  # fmt: skip
            assert proc.returncode == (-9 if kill else 0), proc.stderr[-3000:]
        assert [s for s, _ in tb_back(tmp_path / "tensorboard")] == list(range(15))
