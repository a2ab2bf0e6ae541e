"""The SwanLab target, offline: exactly once, read back with SwanLab's own record reader."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("swanlab")

from ranklog.errors import ConfigError, TargetHeldError
from ranklog.shippers import Shipper
from ranklog.shippers.targets.swanlab import SwanlabTarget, read_session
from ranklog.spool import read_run

from . import test_compliance as tc
from .compliance import Backend, check_late, make_late_spool, run_once
from .conftest import python_env
from .shiphelp import log_steps, rank

PROJECT = "ranklog-test"


def sessions(work: Path, finished_only: bool = True) -> list[Path]:
    """The record files of the run's sessions under ``work``, in order."""
    files = sorted(work.glob("run-*-*/run-*.swanlab"))
    return [f for f in files if not finished_only or read_session(f)[1]]


def _back(work: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, numbers) of every step of every finished session, in the order written."""
    out = []
    for f in sessions(work):
        for step, values in sorted(read_session(f)[0].items()):
            out.append((step, {k: v for k, v in values.items() if isinstance(v, float)}))
    return out


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config(work: Path) -> dict[str, Any]:
    """The latest finished session's config (``files/config.yaml``)."""
    import yaml

    raw = yaml.safe_load((sessions(work)[-1].parent / "files" / "config.yaml").read_text())
    return {k: v["value"] for k, v in raw.items()}


def _params(work: Path) -> dict[str, Any]:
    return _flat({k: v for k, v in config(work).items() if not k.startswith("_")})


def _target(work: Path, **kw: Any) -> SwanlabTarget:
    return SwanlabTarget(PROJECT, work, **kw)


SWANLAB = Backend("swanlab-offline", lambda work: _target(work), _back, read_params=_params,
                  late=False)  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No account, no network, every setting file of SwanLab's in tmp."""
    for var in [v for v in os.environ if v.startswith("SWANLAB_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-root"))


class TestCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, run against SwanLab offline."""

    @pytest.fixture
    def backend(self) -> Backend:
        return SWANLAB

    def test_late_values_are_left_out_once_warned(
        self, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``--late ship``: a synced SwanLab session cannot take a step back; none is written."""
        make_late_spool(spool)
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            run_once(spool, SWANLAB.make(work), "ship")
        check_late(SWANLAB, work)
        assert any("late" in r.message for r in caplog.records)


class TestSessions:
    def test_a_session_per_flush_each_finished(self, made: Path, work: Path) -> None:
        """Each flush is one finished session of the same run id; together, every step once."""
        import ranklog.shippers._engine as engine

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine, "BATCH_STEPS", 25)
            run_once(made, SWANLAB.make(work))
        files = sessions(work)
        assert len(files) >= 2
        run_id = read_run(made).run_id
        assert {f.name for f in files} == {f"run-{run_id}.swanlab"}
        assert sorted(s for s, _ in _back(work)) == list(range(60))

    def test_a_killed_session_is_set_aside(self, made: Path, work: Path) -> None:
        """A session whose process was SIGKILLed before ``finish()`` is moved out of
        ``swanlab sync``'s way; its steps are written again, once."""
        run_id = read_run(made).run_id
        code = (
            "import os, signal, swanlab\n"
            f"run = swanlab.init(project={PROJECT!r}, id={run_id!r}, mode='offline', "
            f"logdir={str(work)!r})\n"
            "for s in range(30):\n"
            "    run.log({'loss': 1.0}, step=s)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        env = python_env(SWANLAB_TERMINAL_PROXY_TYPE="none", SWANLAB_PROBE_MONITOR="false")
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
        assert res.returncode == -signal.SIGKILL, res.stderr
        assert len(list(work.glob(f"run-*-{run_id}"))) == 1
        run_once(made, SWANLAB.make(work))
        assert [p.parent.name for p in (work / ".torn").glob("run-*/*.swanlab")]
        assert [s for s, _ in _back(work)] == list(range(60))

    def test_text_nan_and_names(self, spool: Path, work: Path) -> None:
        """A text is a ``swanlab.Text`` under its name (a file in the session's media);
        NaN stays NaN; the run is named and grouped."""
        run = rank(spool, 0, 1, name="exp-3")
        run.log_text("val/sample", "hello", step=0)
        run.log_metrics({"nan": math.nan, "loss": 0.5}, step=0)
        run.step_end(0)
        run.close()
        run_once(spool, _target(work, group="sweep"))
        (f,) = sessions(work)
        values = read_session(f)[0][0]
        assert math.isnan(values["nan"]) and values["loss"] == 0.5
        (media,) = values["val/sample"]
        (text,) = f.parent.glob(f"media/**/{media}")
        assert text.read_text() == "hello"
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader

        reader = DataStoreReader()
        reader.open(str(f))
        start = next(r.start for r in map(_record(Record), reader) if r.HasField("start"))
        assert (start.name, start.group, start.project) == ("exp-3", "sweep", PROJECT)


def _record(cls: Any) -> Any:
    def parse(raw: bytes) -> Any:
        rec = cls()
        rec.ParseFromString(raw)
        return rec

    return parse


class TestRefusals:
    def test_another_run_in_the_run_id_is_refused(self, tmp_path: Path, work: Path) -> None:
        """``--run-id`` of a SwanLab run that holds another ranklog run: refused."""
        spools = []
        for name in ("a", "b"):
            spools.append(tmp_path / name)
            run = rank(spools[-1], 0, 1)
            log_steps(run, range(3))
            run.close()
        run_once(spools[0], _target(work, run_id="shared"))
        with pytest.raises(TargetHeldError, match="holds run"):
            run_once(spools[1], _target(work, run_id="shared"))

    def test_per_rank_and_bad_project_are_config_errors(self, spool: Path) -> None:
        """``--per-rank`` and a project SwanLab refuses: one line, before anything."""
        from ranklog.shippers import make_target

        with pytest.raises(ConfigError, match="per-rank"):
            make_target("swanlab:p", spool, per_rank=True)
        with pytest.raises(ConfigError, match="no spaces"):
            make_target("swanlab:my project", spool)

    def test_the_shipper_says_where_and_how_to_sync(self, made: Path) -> None:
        """``ranklog ship --to swanlab:P`` says where the sessions are and the sync command."""
        from .test_everyday import ranklog_cmd

        res = ranklog_cmd("ship", str(made), "--to", f"swanlab:{PROJECT}", "--once")
        assert res.returncode == 0, res.stderr
        run_id = read_run(made).run_id
        assert f"`swanlab sync {made / 'swanlog'}/run-*-{run_id}`" in res.stderr
        assert "`swanlab watch`" in res.stderr and "not offline runs" in res.stderr
        assert sorted(s for s, _ in _back(made / "swanlog")) == list(range(60))


def test_shipper_flushes_once_per_batch(made: Path, work: Path) -> None:
    """The engine's flush is the session: nothing is written before it."""
    target = _target(work)
    shipper = Shipper(str(made), target, name="x")
    target.open(read_run(made))
    assert not list(work.glob("run-*"))
    shipper.run_forever(once=True)
    assert sessions(work)


class TestEdges:
    """What a review found: ids SwanLab rewrites, steps it keeps nothing of, names that meet."""

    def test_a_run_id_swanlab_rewrites_in_its_file_name(self, made: Path, work: Path) -> None:
        """``--run-id exp-1.a``: SwanLab names the file ``run-exp_1_a.swanlab``; the sessions
        are still read, and a second shipper adds nothing."""
        run_once(made, _target(work, run_id="exp-1.a"))
        (made / "cursors" / "compliance.json").unlink()
        run_once(made, _target(work, run_id="exp-1.a"))
        assert not (work / ".torn").exists()
        assert [s for s, _ in _back(work)] == list(range(60))

    def test_a_step_swanlab_keeps_nothing_of_ends(
        self, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A step with only a distribution (SwanLab has no histogram): said once, not retried
        for ever; a name SwanLab strips (``loss.``) is kept under its stripped name."""
        run = rank(spool, 0, 1)
        run.log_histogram("grad", [1.0, 2.0], step=0)
        run.step_end(0)
        run.log_metrics({"loss.": 0.5}, step=1)
        run.step_end(1)
        run.close()
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            run_once(spool, _target(work))
        assert _back(work) == [(1, {"loss": 0.5})]
        said = [r.getMessage() for r in caplog.records if r.name == "ranklog.ship"]
        assert len(said) == 1 and "distributions (grad)" in said[0]

    def test_another_project_in_the_same_place_is_refused(self, made: Path, work: Path) -> None:
        """Same directory and run id, another project: refused, never counted as held."""
        run_once(made, _target(work))
        other = SwanlabTarget("other", work)
        assert other.identity(read_run(made)) != _target(work).identity(read_run(made))
        with pytest.raises(TargetHeldError, match="belongs to project 'ranklog-test'"):
            other.open(read_run(made))

    def test_names_that_meet_in_a_step(self, spool: Path, work: Path) -> None:
        """Two texts of one rank under one name are a list; a text named as a metric is
        written under ``<name>/media``: nothing is overwritten."""
        run = rank(spool, 0, 1)
        run.log_text("val/s", "one", step=0)
        run.log_text("val/s", "two", step=0)
        run.log_text("loss", "a note", step=0)
        run.log_metrics({"loss": 0.5}, step=0)
        run.step_end(0)
        run.close()
        run_once(spool, _target(work))
        (f,) = sessions(work)
        values = read_session(f).steps[0]
        assert values["loss"] == 0.5 and len(values["loss/media"]) == 1
        assert len(values["val/s/rank00000"]) == 2
