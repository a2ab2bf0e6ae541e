"""The trackio target: exactly once, read back with trackio's own reader and dashboard server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trackio")

from ranklog.errors import TargetHeldError
from ranklog.shippers.targets.trackio import TrackioTarget, log_id, trackio_key

from . import test_compliance as tc
from .compliance import (
    RANKS,
    Backend,
    check_late,
    make_late_spool,
    run_once,
)
from .conftest import headless_dom
from .shiphelp import log_steps, rank
from .test_everyday import ranklog_cmd

PROJECT = "ranklog-test"


@contextlib.contextmanager
def storage(work: Path) -> Iterator[Any]:
    """trackio's ``SQLiteStorage`` reading the project files in ``work``."""
    import trackio.sqlite_storage as ss

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ss, "TRACKIO_DIR", work)
        yield ss.SQLiteStorage


def runs(work: Path, project: str = PROJECT) -> list[dict[str, Any]]:
    """The project's runs as trackio lists them (id, name, ...)."""
    with storage(work) as s:
        return list(s.get_run_records(project))


def logs(work: Path, run_id: str | None = None, project: str = PROJECT) -> list[dict[str, Any]]:
    """Every row of a run (the main run by default), as trackio's reader returns them."""
    if run_id is None:
        (main,) = [r for r in runs(work, project) if "-rank" not in str(r["name"])]
        run_id = str(main["id"])
    with storage(work) as s:
        return list(s.get_logs(project, run_id=run_id))


def config(work: Path, run_id: str, project: str = PROJECT) -> dict[str, Any]:
    with storage(work) as s:
        return dict(s.get_run_config(project, run_id=run_id) or {})


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's values as numbers; the slowest rank read back from its text (``rank 3 (...)``)."""
    skip = {"step", "timestamp"}
    out = {k: float(v) for k, v in row.items() if k not in skip and isinstance(v, int | float)}
    for k, v in row.items():
        if k.endswith("/slowest_rank"):
            assert v["_type"] == "trackio.markdown", v
            out[k] = float(v["_value"].split()[1])
    return out


def _back(work: Path) -> list[tuple[int, dict[str, float]]]:
    return [(int(row["step"]), _scalars(row)) for row in logs(work)]


def _params(work: Path) -> dict[str, Any]:
    (main,) = [r for r in runs(work) if "-rank" not in str(r["name"])]
    return {k: v for k, v in config(work, str(main["id"])).items() if not k.startswith("_")}


def _target(work: Path, **kw: Any) -> TrackioTarget:
    return TrackioTarget(PROJECT, work, **kw)


TRACKIO = Backend("trackio", lambda work: _target(work), _back, read_params=_params)


class TestCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, run against a trackio project."""

    @pytest.fixture
    def backend(self) -> Backend:
        return TRACKIO

    def test_late_values_at_their_own_step(self, spool: Path, work: Path) -> None:
        """``--late ship``: late values are rows at their own step, each once."""
        make_late_spool(spool)
        run_once(spool, TRACKIO.make(work), "ship")
        check_late(TRACKIO, work)


class TestRows:
    def test_rows_carry_their_log_ids(self, made: Path, work: Path) -> None:
        """Each row's log id names its run and step: written twice, trackio keeps one."""
        run_once(made, TRACKIO.make(work))
        (main,) = runs(work)
        with contextlib.closing(sqlite3.connect(work / f"{PROJECT}.db")) as conn:
            rows = conn.execute("SELECT step, log_id FROM metrics ORDER BY id").fetchall()
        assert rows == [(s, log_id(str(main["id"]), s)) for s in range(60)]

    def test_a_windowed_replay_then_the_rest(self, made: Path, work: Path, tmp_path: Path) -> None:
        """``ranklog replay --steps`` then a full one: the missing steps once, none twice."""
        ds, to = tmp_path / "ds", f"trackio:{PROJECT}"
        assert ranklog_cmd("compact", str(made), "--out", str(ds)).returncode == 0
        res = ranklog_cmd("replay", str(ds), "--to", to, "--dir", str(work), "--steps", "20:40")
        assert res.returncode == 0, res.stderr
        assert [s for s, _ in _back(work)] == list(range(20, 40))
        res = ranklog_cmd("replay", str(ds), "--to", to, "--dir", str(work))
        assert res.returncode == 0, res.stderr
        assert sorted(s for s, _ in _back(work)) == list(range(60))
        assert len(_back(work)) == 60

    def test_run_name_group_and_config(self, made: Path, work: Path) -> None:
        """The run is named and grouped as asked; the config records the ranklog run."""
        run_once(made, _target(work, run_name="exp-7", group="sweep"))
        (main,) = runs(work)
        assert main["name"] == "exp-7"
        cfg = config(work, str(main["id"]))
        assert cfg["_Group"] == "sweep"
        assert cfg["_ranklog"]["run_id"] == main["id"]
        assert cfg["lr"] == 0.1 and cfg["nested.depth"] == 3

    def test_texts_histograms_and_nan(self, spool: Path, work: Path) -> None:
        """A text is a row of the step's ``samples`` table; a distribution a trackio histogram;
        NaN comes back NaN."""
        run = rank(spool, 0, 1)
        run.log_text("val/sample", "hello", step=0)
        run.log_histogram("grad", [1.0, 2.0, 2.5, math.inf], step=0)
        run.log_metrics({"nan": math.nan}, step=0)
        run.step_end(0)
        run.close()
        run_once(spool, TRACKIO.make(work))
        (row,) = logs(work)
        assert math.isnan(row["nan"])
        assert row["samples"]["_type"] == "trackio.table"
        assert row["samples"]["_value"] == [{"rank": 0, "name": "val/sample", "text": "hello"}]
        assert row["grad"]["_type"] == "trackio.histogram"
        assert sum(row["grad"]["values"]) == 3  # the infinite value is left out of the bins

    def test_tables_and_images(self, spool: Path, work: Path) -> None:
        """A table is a ``trackio.Table`` under its name (``name/rankNNNNN`` where ranks share
        it); an image a ``trackio.Image`` file under trackio's media folder."""
        runs_ = [rank(spool, r, 2) for r in range(2)]
        for r, run in enumerate(runs_):
            run.log_table("scores", ["a", "b"], [[r, "x"]], step=0)
            if r == 0:
                run.log_image("plot", b"\x89PNG-rank0", step=0)
            run.log_metrics({"loss": 1.0}, step=0)
            run.step_end(0)
            run.close()
        run_once(spool, TRACKIO.make(work))
        (row,) = logs(work)
        assert {k for k in row if k.startswith("scores")} == {"scores/rank00000",
                                                               "scores/rank00001"}  # fmt: skip
        assert row["scores/rank00001"]["_value"] == [{"a": 1, "b": "x"}]
        assert row["plot"]["_type"] == "trackio.image"
        assert (work / "media" / row["plot"]["file_path"]).read_bytes() == b"\x89PNG-rank0"

    def test_reserved_names_renamed_as_trackio_does(
        self, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``step`` and ``time`` are trackio's own fields: written as ``__step``, ``__time``."""
        run = rank(spool, 0, 1)
        run.log_metrics({"time": 1.5, "step": 7.0, "ok": 1.0}, step=0)
        run.step_end(0)
        run.close()
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            run_once(spool, TRACKIO.make(work))
        (row,) = logs(work)
        assert row["__time"] == 1.5 and row["__step"] == 7.0 and row["step"] == 0
        assert trackio_key("time") == "__time" and trackio_key("loss") == "loss"
        assert sum("reserves" in r.message for r in caplog.records) == 2

    def test_per_rank_runs(self, made: Path, work: Path) -> None:
        """``--per-rank``: one run per rank, same group, each with its own values."""
        from ranklog.shippers import Shipper

        Shipper(str(made), _target(work, per_rank=True), per_rank=True).run_forever(once=True)
        names = sorted(str(r["name"]) for r in runs(work))
        main = [n for n in names if "-rank" not in n]
        assert len(names) == 1 + RANKS and len(main) == 1
        (one,) = [r for r in runs(work) if str(r["name"]).endswith("-rank00001")]
        assert config(work, str(one["id"]))["_Group"] == main[0]
        rows = logs(work, str(one["id"]))
        assert [r["step"] for r in rows] == list(range(60))
        assert rows[5]["loss"] == pytest.approx(1 + 5 / 1000)


class TestAnotherRun:
    def test_two_runs_into_one_project_are_two_runs(self, tmp_path: Path, work: Path) -> None:
        """A new ranklog run into the same project is its own trackio run: nothing skipped."""
        for name in ("a", "b"):
            spool = tmp_path / name
            run = rank(spool, 0, 1)
            log_steps(run, range(5 if name == "a" else 8))
            run.close()
            run_once(spool, TRACKIO.make(work))
        counts = sorted(len(logs(work, str(r["id"]))) for r in runs(work))
        assert counts == [5, 8]

    def test_a_run_id_holding_another_run_is_refused(self, tmp_path: Path, work: Path) -> None:
        """``--run-id`` of a trackio run that holds another ranklog run: refused, one line."""
        spools = []
        for name in ("a", "b"):
            spools.append(tmp_path / name)
            run = rank(spools[-1], 0, 1)
            log_steps(run, range(3))
            run.close()
        run_once(spools[0], _target(work, run_id="shared"))
        with pytest.raises(TargetHeldError, match="holds run"):
            run_once(spools[1], _target(work, run_id="shared"))
        assert len(logs(work, "shared")) == 3

    def test_another_names_selection_is_refused(self, made: Path, work: Path) -> None:
        """A replay with ``--names`` into a run holding every name: refused."""
        from ranklog.shippers import Shipper

        run_once(made, TRACKIO.make(work))
        target = TrackioTarget(PROJECT, work, names="loss")
        with pytest.raises(TargetHeldError, match="--names"):
            Shipper(str(made), target).run_forever(once=True)


def test_late_backend_is_the_default() -> None:
    """The trackio backend of the compliance suite takes late values (it stores them)."""
    assert dataclasses.replace(TRACKIO).late and TrackioTarget.takes_late
    assert json.dumps(log_id("r", 3, 9)) == '"ranklog:r:3:late9"'


@contextlib.contextmanager
def dashboard(work: Path, tmp_path: Path) -> Iterator[str]:
    """``trackio show`` on 127.0.0.1 over the project files in ``work``: its URL."""
    import re
    import subprocess
    import sys
    import time

    from .conftest import python_env
    from .mlflow_server import free_port

    env = python_env() | {
        "TRACKIO_DIR": str(work), "GRADIO_SERVER_PORT": str(free_port()),
        "HF_HOME": str(tmp_path / "hf"), "BROWSER": "true", "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    out = tmp_path / "dashboard.log"
    with out.open("w") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("trackio")), "show", "--project", PROJECT],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (m := re.search(r"(http://127\.0\.0\.1:\d+)/", out.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        yield m.group(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


def api(base: str, name: str, **kwargs: Any) -> Any:
    """One call of the dashboard's HTTP API (what its web page asks for)."""
    import urllib.request

    req = urllib.request.Request(
        f"{base}/api/{name}", data=json.dumps(kwargs).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["data"]


@pytest.mark.slow
class TestDashboard:
    def test_what_trackio_show_shows(self, spool: Path, work: Path, tmp_path: Path) -> None:
        """``ranklog ship --to trackio:P``, then ``trackio show``: the run, its values, its
        config and samples through the dashboard's API, and in a headless browser's page."""
        run = rank(spool, 0, 1, name="ui-run")
        run.log_hyperparams({"lr": 0.001, "model": {"layers": 4}})
        for s in range(5):
            run.log_metrics({"loss": 1 / (s + 1)}, step=s, prefix="train")
            run.log_text("val/sample", f"answer {s}", step=s)
            run.step_end(s)
        run.close()
        res = ranklog_cmd("ship", str(spool), "--to", f"trackio:{PROJECT}", "--dir", str(work),
                          "--once")  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert f"TRACKIO_DIR={work} trackio show --project {PROJECT}" in res.stderr
        with dashboard(work, tmp_path) as base:
            (main,) = api(base, "get_runs_for_project", project=PROJECT)
            assert main["name"] == "ui-run"
            rows = api(base, "get_logs", project=PROJECT, run_id=main["id"])
            assert [r["step"] for r in rows] == list(range(5))
            assert [r["train/loss"] for r in rows] == [1 / (s + 1) for s in range(5)]
            assert rows[4]["samples"]["_value"][0]["text"] == "answer 4"
            configs = api(base, "get_run_configs", project=PROJECT)
            (cfg,) = configs.values()
            assert cfg["lr"] == 0.001 and cfg["model.layers"] == 4
            dom = headless_dom(f"{base}/?project={PROJECT}", tmp_path / "profile", height=1000)
            assert "ui-run" in dom, dom[-3000:]
            assert "train/loss" in dom or ">loss<" in dom


class TestEdges:
    """What a review found: trackio's own config keys, a full disk, a very wide histogram."""

    def test_a_param_named_as_trackios_own_key(self, spool: Path, work: Path) -> None:
        """A param ``_Group`` is written as ``param_Group``: the run's group and ranklog's mark
        stay, and a restart finds the run its own."""
        run = rank(spool, 0, 1)
        run.log_hyperparams({"_Group": "mine", "lr": 0.1})
        log_steps(run, range(3))
        run.close()
        run_once(spool, _target(work, group="g"))
        (main,) = runs(work)
        cfg = config(work, str(main["id"]))
        assert cfg["_Group"] == "g" and cfg["param_Group"] == "mine" and cfg["lr"] == 0.1
        (spool / "cursors" / "compliance.json").unlink()
        run_once(spool, _target(work, group="g"))
        assert len(logs(work)) == 3

    def test_a_full_disk_is_retried(self, work: Path) -> None:
        """SQLite's "database or disk is full" is transient, as a full disk is everywhere."""
        import sqlite3

        from ranklog.errors import TransientTargetError
        from ranklog.shippers.targets.trackio import _storage

        with pytest.raises(TransientTargetError), _storage(work, "write"):
            raise sqlite3.OperationalError("database or disk is full")

    def test_a_histogram_numpy_cannot_bin(
        self, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Values near the float limits: the distribution is left out, said; the step ships."""
        run = rank(spool, 0, 1)
        run.log_histogram("wide", [-1e308, 1e308], step=0)
        run.log_metrics({"loss": 0.5}, step=0)
        run.step_end(0)
        run.close()
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            run_once(spool, TRACKIO.make(work))
        (row,) = logs(work)
        assert row["loss"] == 0.5 and "wide" not in row
        assert any("'wide' not written" in r.getMessage() for r in caplog.records)
