"""What a user sees in the backends' own servers: a real ``tensorboard`` and a real
``mlflow server`` on 127.0.0.1, queried over the HTTP APIs their UIs use after ``ranklog
ship``: runs, tags, steps, values, hyperparameters, text samples and GPU system metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard", reason="installed by ./tools/test (extra ranklog[tensorboard])")
pytest.importorskip("mlflow", reason="installed by ./tools/test (extra ranklog[mlflow])")

import ranklog
from ranklog.schemas import Gpu
from ranklog.spool import read_run

from .conftest import headless_dom, python_env
from .mlflow_server import MlflowServer, free_port, running_server

pytestmark = pytest.mark.slow

STEPS = 5
HOST = "gpu-node"
NAME = "ui-run"
EXPERIMENT = "ui-exp"
SAMPLE = "hello **world**"
MEM = 40_000_000_000  # bytes in use on the fake GPU
PARAMS = {"lr": 0.001, "model": {"layers": 4, "name": "tiny"}, "api_key": "sk-secret"}


def loss(rank: int, step: int) -> float:
    """What rank ``rank`` logs as train/loss at ``step`` (exact in float32)."""
    return (rank + 1) * (step + 1) / 8


def step_time(rank: int, step: int) -> float:
    """Rank 1 is the slow one."""
    return 0.25 * (rank + 1) + step / 16


class FakeGpu:
    """A GPU source that always reads 50 % utilisation and 40 GB in use on ``gpu-node``."""

    name = "fake"

    def sample(self) -> list[Gpu]:
        return [Gpu(time.time(), HOST, 0, util=50.0, mem_used=MEM, mem_total=2 * MEM)]

    def close(self) -> None:
        pass


def make_spool(spool: Path) -> None:
    """Two ranks x 5 steps: train/loss (mean), train/tokens (sum), a step timer, params from
    rank 0, a validation sample at step 2, and GPU samples from rank 0's sampler."""
    kw: dict[str, Any] = {"world_size": 2, "name": NAME, "handle_signals": False}
    runs = [
        ranklog.init(spool, rank=0, local_rank=0, gpu=FakeGpu(), gpu_interval=0.01, **kw),
        ranklog.init(spool, rank=1, local_rank=1, **kw),
    ]
    runs[0].log_hyperparams(PARAMS)
    for step in range(STEPS):
        time.sleep(0.05)  # rank 0's sampler takes a few samples in each step
        for r, run in enumerate(runs):
            run.log_metrics({"loss": loss(r, step)}, step=step, prefix="train")
            run.log_metrics({"tokens": 100 * (r + 1)}, step=step, prefix="train", reduce="sum")
            run.log_timing("step_time", step_time(r, step), step=step)
            if step == 2 and r == 0:
                run.log_text("val/sample", SAMPLE, step=step)
            run.step_end(step)
    for run in runs:
        run.close()


def ship(spool: Path, *targets: str, timeout: float = 120) -> None:
    """``ranklog ship SPOOL --to ... --per-rank --once``: every step, plus one run per rank."""
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--per-rank", "--once",
           "--quiet"]  # fmt: skip
    if any(t.startswith("mlflow") for t in targets):  # (an option no target takes: refused)
        cmd += ["--experiment", EXPERIMENT]
    for target in targets:
        cmd += ["--to", target]
    env = {k: v for k, v in python_env().items() if not k.startswith("MLFLOW_")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


# -- HTTP ------------------------------------------------------------------------------------------


def get(url: str, **query: str) -> Any:
    """GET ``url?query`` and parse its JSON."""
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=20) as resp:
        return json.loads(resp.read())


def post(url: str, body: Any) -> Any:
    """POST a JSON body (Content-Type: application/json, as the UIs send it); parse the JSON."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=20) as resp:
        return json.loads(resp.read())


def wait_until(ready: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll ``ready()`` until it returns something truthy (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            if got := ready():
                return got
        assert time.monotonic() < deadline, f"{what} not ready after {timeout}s"
        time.sleep(0.25)


@contextlib.contextmanager
def tensorboard(logdir: Path, log: Path) -> Iterator[str]:
    """``tensorboard --logdir DIR --host 127.0.0.1 --port P``, in its own process group."""
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
           "127.0.0.1", "--port", str(port), "--reload_interval", "1",
           "--samples_per_plugin", "scalars=100000,text=1000"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=python_env(HOME=str(log.parent)), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- the servers, with a shipped spool ----------------------------------------------------------


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The spool shipped to TensorBoard (served by tensorboard) and to an mlflow server."""
    d = tmp_path_factory.mktemp("ui")
    spool = d / "spool"
    make_spool(spool)
    ship(spool, f"tensorboard:{d / 'tb'}")
    with tensorboard(d / "tb", d / "tensorboard.log") as tb, running_server(d / "mlflow") as srv:
        ship(spool, f"mlflow:{srv.uri}")
        wait_until(lambda: tensorboard_loaded(tb), "tensorboard")
        yield {"tb": tb, "mlflow": srv, "run_id": read_run(spool).run_id}


def tensorboard_loaded(tb: str) -> bool:
    """Whether tensorboard has read every run's scalars, the text and the hparams session."""
    tags = get(f"{tb}/data/plugin/scalars/tags")
    last = get(f"{tb}/data/plugin/scalars/scalars", run=".", tag="train/loss") if tags else []
    return (
        len(tags) == 3 and all(tags.values()) and len(last) == STEPS
        and bool(get(f"{tb}/data/plugin/text/tags"))
        and bool(post(f"{tb}/data/plugin/hparams/experiment", {"experimentName": ""})
                 .get("hparamInfos"))
    )  # fmt: skip


def tb_points(ui: dict[str, Any], run: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar series, from the route the Scalars dashboard reads."""
    rows = get(f"{ui['tb']}/data/plugin/scalars/scalars", run=run, tag=tag)
    return [(int(step), value) for _wall, step, value in rows]


class TestTensorBoardUI:
    def test_runs_and_scalar_tags(self, ui: dict[str, Any]) -> None:
        """One run for the reduced job and one per rank (its own values and timer); tags follow
        train/loss-style names, timers under timing/, GPUs under gpu/<host>/<index>/."""
        assert sorted(get(f"{ui['tb']}/data/runs")) == [".", "rank00000", "rank00001"]
        tags = {run: set(t) for run, t in get(f"{ui['tb']}/data/plugin/scalars/tags").items()}
        assert tags["."] == {
            "train/loss", "train/tokens", "timing/step_time",
            "timing/step_time/slowest_rank/rank00001",
            f"gpu/{HOST}/0/utilization", f"gpu/{HOST}/0/memory_used_bytes",
            "gpu/all/utilization", "gpu/all/memory_used_bytes_max",
        }  # fmt: skip
        own = {"train/loss", "train/tokens", "timing/step_time"}
        assert tags["rank00000"] == tags["rank00001"] == own

    def test_scalar_steps_and_values(self, ui: dict[str, Any]) -> None:
        """Each step once, with the cross-rank reduction; each rank's run holds its own values."""
        steps = list(range(STEPS))
        assert tb_points(ui, ".", "train/loss") == [(s, (loss(0, s) + loss(1, s)) / 2)
                                                    for s in steps]  # fmt: skip
        assert tb_points(ui, ".", "train/tokens") == [(s, 300.0) for s in steps]
        for r in range(2):
            run = f"rank{r:05d}"
            assert tb_points(ui, run, "train/loss") == [(s, loss(r, s)) for s in steps]
            assert tb_points(ui, run, "timing/step_time") == [(s, step_time(r, s)) for s in steps]
        gpu = tb_points(ui, ".", f"gpu/{HOST}/0/utilization")
        assert gpu and {v for _, v in gpu} == {50.0} and {s for s, _ in gpu} <= set(steps)
        assert {v for _, v in tb_points(ui, ".", f"gpu/{HOST}/0/memory_used_bytes")} == {MEM}

    def test_text_sample(self, ui: dict[str, Any]) -> None:
        """The Text dashboard shows the sample at its step, rendered from markdown."""
        tags = get(f"{ui['tb']}/data/plugin/text/tags")
        assert {k: sorted(v) for k, v in tags.items()} == {".": ["val/sample"]}
        rows = get(f"{ui['tb']}/data/plugin/text/text", run=".", tag="val/sample")
        html = "<p>hello <strong>world</strong></p>"
        assert [(r["step"], r["text"]) for r in rows] == [(2, html)]

    def test_slowest_rank_is_a_series_smoothing_cannot_bend(self, ui: dict[str, Any]) -> None:
        """Which rank was slowest is a series per rank, its value the rank (a constant, which
        smoothing leaves as is), with a point at each step that rank was slowest."""
        tag = "timing/step_time/slowest_rank/rank00001"
        assert tb_points(ui, ".", tag) == [(s, 1.0) for s in range(STEPS)]

    def test_hparams(self, ui: dict[str, Any]) -> None:
        """The HParams dashboard lists the flattened params (the key redacted) and the metrics;
        the run's session group holds the values and each metric's last value."""
        hp = f"{ui['tb']}/data/plugin/hparams"
        exp = post(f"{hp}/experiment", {"experimentName": ""})
        assert {h["name"] for h in exp["hparamInfos"]} == {"lr", "model.layers", "model.name",
                                                           "api_key"}  # fmt: skip
        assert {"train/loss", "train/tokens"} <= {m["name"]["tag"] for m in exp["metricInfos"]}
        statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
        body = {"experimentName": "", "allowedStatuses": statuses, "startIndex": 0,
                "sliceSize": 10, "includeMetrics": True}  # fmt: skip
        (group,) = post(f"{hp}/session_groups", body)["sessionGroups"]
        assert group["name"] == NAME
        assert group["hparams"] == {"lr": 0.001, "model.layers": 4.0, "model.name": "tiny",
                                    "api_key": "<redacted>"}  # fmt: skip
        last = {m["name"]["tag"]: (m["trainingStep"], m["value"]) for m in group["metricValues"]}
        assert last["train/loss"] == (STEPS - 1, (loss(0, STEPS - 1) + loss(1, STEPS - 1)) / 2)


def slowest_of(step: int) -> int:
    """Which of three ranks is slowest at ``step``: rank 2 on every fifth step, else 0 or 1."""
    return 2 if step % 5 == 0 else (step // 7) % 2


def test_tensorboard_shows_every_steps_slowest_rank(tmp_path: Path) -> None:
    """In TensorBoard as it starts by default (its sampling kept), each of 300 steps' slowest
    rank is read back from the Scalars dashboard's route: no step left out, none twice."""
    spool, steps = tmp_path / "spool", 300
    kw: dict[str, Any] = {"world_size": 3, "name": NAME, "handle_signals": False}
    runs = [ranklog.init(spool, rank=r, **kw) for r in range(3)]
    for step in range(steps):
        for r, run in enumerate(runs):
            run.log_timing("step_time", 1.0 + (r == slowest_of(step)) + step / 1024, step=step)
            run.step_end(step)
    for run in runs:
        run.close()
    ship(spool, f"tensorboard:{tmp_path / 'tb'}")
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "tb"),
           "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"]  # fmt: skip
    with open(tmp_path / "tb.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=python_env(HOME=str(tmp_path)), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        tb = f"http://127.0.0.1:{port}"
        ui = {"tb": tb}
        want = {f"timing/step_time/slowest_rank/rank{r:05d}" for r in range(3)}

        def loaded() -> bool:
            tags = get(f"{tb}/data/plugin/scalars/tags").get(".", {})
            return want <= set(tags) and tb_points(ui, ".", "timing/step_time")[-1:] == [
                (steps - 1, pytest.approx(2 + (steps - 1) / 1024))
            ]

        wait_until(loaded, "tensorboard")
        shown = sorted((s, int(v)) for tag in want for s, v in tb_points(ui, ".", tag))
        assert shown == [(s, slowest_of(s)) for s in range(steps)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def mlflow_api(server: MlflowServer, route: str, body: Any = None, **query: str) -> Any:
    """A call of MLflow's REST API (``/api/2.0/mlflow/<route>``), as the MLflow UI makes it."""
    url = f"{server.uri}/api/2.0/mlflow/{route}"
    return get(url, **query) if body is None else post(url, body)


def mlflow_runs(ui: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The experiment's runs by name."""
    server = ui["mlflow"]
    exp = mlflow_api(server, "experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
    found = mlflow_api(server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    return {r["info"]["run_name"]: r for r in found}


def history(ui: dict[str, Any], run: dict[str, Any], key: str) -> list[tuple[int, float]]:
    """(step, value) of a metric, as the UI's charts get it."""
    got = mlflow_api(ui["mlflow"], "metrics/get-history", run_id=run["info"]["run_id"],
                     metric_key=key)["metrics"]  # fmt: skip
    return sorted((int(m["step"]), m["value"]) for m in got)


def tags(run: dict[str, Any]) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


class TestMlflowUI:
    def test_one_run_and_a_child_run_per_rank(self, ui: dict[str, Any]) -> None:
        """The experiment holds the run (named as the ranklog run, tagged with its id) and,
        with --per-rank, one child run per rank under it."""
        runs = mlflow_runs(ui)
        assert sorted(runs) == [NAME, f"{NAME}-rank0", f"{NAME}-rank1"]
        main = tags(runs[NAME])
        assert (main["ranklog.run_id"], main["ranklog.role"], main["ranklog.world_size"]) == (
            ui["run_id"], "main", "2"
        )  # fmt: skip
        for r in range(2):
            child = tags(runs[f"{NAME}-rank{r}"])
            assert child["mlflow.parentRunId"] == runs[NAME]["info"]["run_id"]
            assert (child["ranklog.role"], child["ranklog.rank"]) == ("rank", str(r))

    def test_params_metrics_and_system_metrics(self, ui: dict[str, Any]) -> None:
        """Params as strings (the key redacted); each metric once per step with the reduction;
        the GPU under MLflow's system/ names; each child run its rank's own values."""
        runs = mlflow_runs(ui)
        run = mlflow_api(ui["mlflow"], "runs/get", run_id=runs[NAME]["info"]["run_id"])["run"]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params == {"lr": "0.001", "model.layers": "4", "model.name": "tiny",
                          "api_key": "<redacted>"}  # fmt: skip
        steps = list(range(STEPS))
        main = runs[NAME]
        assert history(ui, main, "train/loss") == [(s, (loss(0, s) + loss(1, s)) / 2)
                                                  for s in steps]  # fmt: skip
        assert history(ui, main, "train/tokens") == [(s, 300.0) for s in steps]
        assert history(ui, main, "timing/step_time") == [(s, step_time(1, s)) for s in steps]
        util = history(ui, main, f"system/{HOST}/gpu_0_utilization_percentage")
        assert util and {v for _, v in util} == {50.0} and {s for s, _ in util} <= set(steps)
        mem = history(ui, main, f"system/{HOST}/gpu_0_memory_usage_megabytes")
        assert {v for _, v in mem} == {MEM / 1e6}
        assert {v for _, v in history(ui, main, "system/gpu_utilization_percentage")} == {50.0}
        for r in range(2):
            child = runs[f"{NAME}-rank{r}"]
            assert history(ui, child, "train/loss") == [(s, loss(r, s)) for s in steps]

    def test_text_sample_is_an_artifact(self, ui: dict[str, Any]) -> None:
        """The validation sample is the artifact text/val/sample/step_00000002.md, as logged."""
        server, run_id = ui["mlflow"], mlflow_runs(ui)[NAME]["info"]["run_id"]
        listed = mlflow_api(server, "artifacts/list", run_id=run_id, path="text/val/sample")
        assert [f["path"] for f in listed["files"]] == ["text/val/sample/step_00000002.md"]
        query = urllib.parse.urlencode({"run_id": run_id, "path": listed["files"][0]["path"]})
        with urllib.request.urlopen(f"{server.uri}/get-artifact?{query}", timeout=20) as resp:
            assert resp.read().decode() == SAMPLE


class TestMlflowInABrowser:
    """MLflow's own web UI, rendered by headless Chromium: what a user sees of the run."""

    def page(self, ui: dict[str, Any], route: str, profile: Path) -> str:
        exp = mlflow_api(ui["mlflow"], "experiments/get-by-name", experiment_name=EXPERIMENT)
        url = f"{ui['mlflow'].uri}/#/experiments/{exp['experiment']['experiment_id']}{route}"
        return headless_dom(url + "?workflowType=machine_learning", profile)

    def test_the_run_is_in_the_training_view(self, ui: dict[str, Any], tmp_path: Path) -> None:
        """The experiment is tagged as model training; its runs table lists the run."""
        exp = mlflow_api(ui["mlflow"], "experiments/get-by-name", experiment_name=EXPERIMENT)
        kinds = {t["key"]: t["value"] for t in exp["experiment"]["tags"]}
        assert kinds["mlflow.experimentKind"] == "custom_model_development"
        dom = self.page(ui, "/runs", tmp_path / "profile")
        assert "Model training" in dom and NAME in dom, dom[-3000:]

    def test_the_charts_are_the_runs_values(self, ui: dict[str, Any], tmp_path: Path) -> None:
        """The run's chart page has a section per group of its metrics (``train``, ``timing``)
        and nothing of ranklog's bookkeeping (an earlier release drew ``ranklog/step``)."""
        run_id = mlflow_runs(ui)[NAME]["info"]["run_id"]
        dom = self.page(ui, f"/runs/{run_id}/model-metrics", tmp_path / "profile")
        texts = [t.strip() for t in re.findall(r">([^<>]+)<", dom)]
        sections = {t for t in texts if t in ("timing", "timing/step_time", "train", "ranklog")}
        assert sections == {"timing", "timing/step_time", "train"}, texts[:80]
        assert not [t for t in texts if "ranklog" in t]

    def test_a_sample_reads_as_markdown(self, ui: dict[str, Any], tmp_path: Path) -> None:
        """A validation sample opens in the artifact view, rendered as the Markdown it is."""
        run_id = mlflow_runs(ui)[NAME]["info"]["run_id"]
        route = f"/runs/{run_id}/artifacts/text/val/sample/step_00000002.md"
        dom = self.page(ui, route, tmp_path / "profile")
        assert "<strong>world</strong>" in dom, dom[-3000:]
