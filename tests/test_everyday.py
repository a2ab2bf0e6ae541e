"""Exactly once in everyday operations: what users do, each checked on the real backends.

Two spellings of one target, a new run into an old target, a windowed replay followed by
a wider one, ``compact --delete`` before a shipper, ``--once`` against a target that can
never work, how a job's end reaches the backends, what ``inspect`` says, and a whole job
killed at once. Each ends with every step once, or with one line and its exit code.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ranklog.cli import main
from ranklog.shippers.targets.jsonl import read_jsonl
from ranklog.spool import read_run

from .conftest import python_env
from .shiphelp import lines, log_steps, rank

pytest.importorskip("mlflow", reason="installed by ./tools/test (extra ranklog[mlflow])")
pytest.importorskip("wandb", reason="installed by ./tools/test (extra ranklog[wandb])")

from mlflow.tracking import MlflowClient

from ranklog.shippers.targets._wandb_log import history_rows, iter_records

from .mlflow_server import free_port
from .test_tensorboard import tb_back


def cli(*args: str, cwd: Path | None = None, timeout: float = 120, **env: str) -> Any:
    """``ranklog ARGS`` in its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", *args], cwd=cwd, env=python_env(**env),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def ranklog_cmd(*args: str, cwd: Path | None = None, **env: str) -> Any:
    """``ranklog ARGS`` in this process (what ``cli`` does, without a start of its own)."""
    out, err = io.StringIO(), io.StringIO()
    saved, here = {k: os.environ.get(k) for k in env}, os.getcwd()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def follow(*args: str, **env: str) -> subprocess.Popen[str]:
    """A live ``ranklog ship`` that follows the job."""
    return subprocess.Popen(
        [sys.executable, "-m", "ranklog.cli", "ship", *args, "--quiet", "--poll", "0.1"],
        env=python_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=60)


def steps_of(path: Path) -> list[int]:
    """The steps of a JSONL target's step lines, in file order."""
    return [x["step"] for x in lines(path) if "shipped_with" not in x]


def job(spool: Path, steps: range, *, world: int = 1, end: bool = True) -> None:
    """``world`` ranks log ``train/loss`` and ``timing/step`` for each step and close it."""
    runs = [rank(spool, r, world) for r in range(world)]
    for s in steps:
        for run in runs:
            run.log_metrics({"loss": run.rank + s / 1000}, step=s, prefix="train")
            run.log_timing("step", 0.5 + run.rank, step=s)
            run.step_end(s)
    for run in runs:
        run.flush()
        if end:
            run.close()


def one_line(err: str) -> str:
    """The only line of stderr."""
    got = err.strip().splitlines()
    assert len(got) == 1, err
    return got[0]


@pytest.fixture(scope="module")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store, its tables made once (migrations take seconds)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "m.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(store_template: Path, tmp_path: Path) -> str:
    """The URI of a fresh MLflow sqlite store, ``tmp_path/m.db``."""
    shutil.copyfile(store_template, tmp_path / "m.db")
    return f"sqlite:///{tmp_path / 'm.db'}"


def wandb_env(tmp: Path) -> dict[str, str]:
    """W&B offline, quiet, with no credentials and no reachable server."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "NETRC": str(tmp / "no-netrc"),
           "WANDB_BASE_URL": "http://127.0.0.1:9"}  # fmt: skip
    for var in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):
        env[f"WANDB_{var}"] = str(tmp / f"wandb-{var.lower()}")
    return env


def wandb_steps(root: Path) -> list[int]:
    """Every history step of every offline run under ``root``, in write order."""
    return [
        row["_step"]
        for p in sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
        for row in history_rows(p)
    ]


# -- 1. one target, two spellings ---------------------------------------------------------


class TestTwoSpellings:
    def test_a_link_to_the_file_is_the_same_target(self, spool: Path, tmp_path: Path) -> None:
        """A second shipper of the file through a linked directory is refused (exit 3)."""
        run = rank(spool, 0, 1)
        log_steps(run, range(5))
        (tmp_path / "link").symlink_to(tmp_path)
        first = follow(
            str(spool), "--to", f"jsonl:{tmp_path / 'out.jsonl'}", "--dead-after", "3600"
        )
        try:
            wait_for(lambda: len(lines(tmp_path / "out.jsonl")) == 5)
            second = cli("ship", str(spool), "--to", f"jsonl:{tmp_path / 'link/out.jsonl'}",
                         "--once", "--quiet")  # fmt: skip
            assert second.returncode == 3, second.stderr
            assert f"pid {first.pid}" in one_line(second.stderr)
            log_steps(run, range(5, 10))
            wait_for(lambda: len(lines(tmp_path / "out.jsonl")) == 10)
        finally:
            stop(first)
        assert steps_of(tmp_path / "out.jsonl") == list(range(10))

    def test_dotdot_and_plain_share_one_cursor(self, spool: Path, tmp_path: Path) -> None:
        """``DIR/sub/../a.jsonl`` then ``DIR/a.jsonl``: one cursor, each step once."""
        (tmp_path / "sub").mkdir()
        run = rank(spool, 0, 1)
        for n, spelling in enumerate(("sub/../a.jsonl", "a.jsonl", "./sub/../a.jsonl")):
            log_steps(run, range(50 * n, 50 * n + 50))
            res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{spelling}", "--once", "--quiet",
                      cwd=tmp_path)  # fmt: skip
            assert res.returncode == 0, res.stderr
        assert steps_of(tmp_path / "a.jsonl") == list(range(150))
        assert len(list((spool / "cursors").glob("*.json"))) == 1

    def test_tensorboard_through_a_link(self, spool: Path, tmp_path: Path) -> None:
        """A TensorBoard directory named through a link is the same run: each step once."""
        job(spool, range(20), end=False)
        (tmp_path / "tb").mkdir()
        (tmp_path / "alias").symlink_to(tmp_path / "tb")
        for where in ("tb", "alias"):
            res = ranklog_cmd(
                "ship", str(spool), "--to", f"tensorboard:{tmp_path / where}", "--once", "--quiet"
            )
            assert res.returncode == 0, res.stderr
        assert [s for s, _ in tb_back(tmp_path / "tb")] == list(range(20))
        assert len(list((spool / "cursors").glob("*.json"))) == 1

    def test_mlflow_store_spelled_two_ways(self, spool: Path, tmp_path: Path, store: str) -> None:
        """A sqlite store named relatively and absolutely is one target: one cursor, no repeat."""
        job(spool, range(10))
        for uri in ("sqlite:///m.db", f"sqlite:///{tmp_path / 'm.db'}"):
            res = ranklog_cmd("ship", str(spool), "--to", f"mlflow:{uri}", "--once", "--quiet",
                      cwd=tmp_path)  # fmt: skip
            assert res.returncode == 0, res.stderr
        assert len(list((spool / "cursors").glob("*.json"))) == 1
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(
            range(10)
        )


# -- 2. a new run into an old target ------------------------------------------------------


class TestAnotherRun:
    def test_new_run_into_an_old_jsonl_is_refused(self, tmp_path: Path) -> None:
        """Run B into run A's file: one line naming A, exit 5, the file untouched."""
        a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "m.jsonl"
        job(a, range(10))
        job(b, range(15))
        assert (
            ranklog_cmd("ship", str(a), "--to", f"jsonl:{out}", "--once", "--quiet").returncode == 0
        )
        before = out.read_bytes()
        res = ranklog_cmd("ship", str(b), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 5
        line = one_line(res.stderr)
        assert read_run(a).run_id in line and "--append-run" in line
        assert out.read_bytes() == before

    def test_a_run_that_opened_the_file_holds_it_before_its_first_step(
        self, tmp_path: Path
    ) -> None:
        """Run A's shipper opened the file (its run line) but wrote no step yet: B is refused."""
        from ranklog.errors import TargetHeldError
        from ranklog.shippers.targets.jsonl import JsonlTarget
        from ranklog.spool import RunInfo

        out = tmp_path / "m.jsonl"
        first = JsonlTarget(out)
        first.open(RunInfo(run_id="a" * 32, created=1.0, name="a"))
        first.close()
        with pytest.raises(TargetHeldError, match=r"holds run a{32} \(a, no step yet\)"):
            JsonlTarget(out).open(RunInfo(run_id="b" * 32, created=2.0, name="b"))
        assert [x["ranklog"]["run_id"] for x in read_jsonl(out)] == ["a" * 32]

    def test_append_run_writes_the_second_run_whole(self, tmp_path: Path) -> None:
        """With --append-run, B's 15 steps follow A's 10, each once, after a line naming B."""
        a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "m.jsonl"
        job(a, range(10))
        job(b, range(15))
        for spool in (a, b, b):  # B twice: the second time, nothing more
            res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet",
                      "--append-run")  # fmt: skip
            assert res.returncode == 0, res.stderr
        runs = [x["ranklog"]["run_id"] for x in read_jsonl(out) if "ranklog" in x]
        assert runs == [read_run(s).run_id for s in (a, b)]
        assert steps_of(out) == [*range(10), *range(15)]

    def test_mlflow_run_id_of_another_run_is_refused(self, tmp_path: Path, store: str) -> None:
        """Each ranklog run gets its own MLflow run; B into A's run id is refused (exit 5)."""
        a, b, uri = tmp_path / "a", tmp_path / "b", store
        job(a, range(5))
        job(b, range(7))
        for spool in (a, b):
            res = ranklog_cmd(
                "ship", str(spool), "--to", f"mlflow:{uri}", "--experiment", "e", "--once"
            )
            assert res.returncode == 0, res.stderr
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
        held = [len(client.get_metric_history(r.info.run_id, "train/loss")) for r in runs]
        assert sorted(held) == [5, 7]
        of_a = next(r for r in runs if r.data.tags["ranklog.run_id"] == read_run(a).run_id)
        c = tmp_path / "c"
        job(c, range(3))
        res = ranklog_cmd(
            "ship", str(c), "--to", f"mlflow:{uri}", "--run-id", of_a.info.run_id, "--once"
        )
        assert res.returncode == 5 and "holds run" in one_line(res.stderr), res.stderr

    def test_wandb_run_id_of_another_run_is_refused(self, tmp_path: Path) -> None:
        """W&B offline: B into the run id A wrote is refused, one line, exit 5."""
        a, b, env = tmp_path / "a", tmp_path / "b", wandb_env(tmp_path)
        job(a, range(5))
        job(b, range(5))
        to = ["--to", "wandb:p", "--mode", "offline", "--dir", str(tmp_path), "--run-id", "shared"]
        assert ranklog_cmd("ship", str(a), *to, "--once", "--quiet", **env).returncode == 0
        res = ranklog_cmd("ship", str(b), *to, "--once", "--quiet", **env)
        assert res.returncode == 5 and "holds run" in one_line(res.stderr), res.stderr
        assert wandb_steps(tmp_path) == list(range(5))


# -- 3. a windowed replay, then a wider one -----------------------------------------------


@pytest.fixture
def dataset(spool: Path, tmp_path: Path) -> Path:
    """A 300-step run of 2 ranks, compacted."""
    job(spool, range(300), world=2)
    res = ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds"))
    assert res.returncode == 0, res.stderr
    return tmp_path / "ds"


class TestWindowedReplay:
    def test_jsonl_window_then_all(self, dataset: Path, tmp_path: Path) -> None:
        """``--steps 100:200`` then a full replay: steps 0..299, each once, few stderr lines."""
        out = f"jsonl:{tmp_path / 'r.jsonl'}"
        first = ranklog_cmd("replay", str(dataset), "--to", out, "--steps", "100:200")
        assert first.returncode == 0 and len(first.stderr.splitlines()) <= 2, first.stderr
        assert steps_of(tmp_path / "r.jsonl") == list(range(100, 200))
        assert ranklog_cmd("replay", str(dataset), "--to", out).returncode == 0
        assert sorted(steps_of(tmp_path / "r.jsonl")) == list(range(300))
        again = ranklog_cmd("replay", str(dataset), "--to", out)  # nothing left to write
        assert again.returncode == 0 and sorted(steps_of(tmp_path / "r.jsonl")) == list(range(300))

    def test_tensorboard_window_then_all(self, dataset: Path, tmp_path: Path) -> None:
        """TensorBoard: the gap is filled in files read in step order; nothing purged or doubled."""
        tb = f"tensorboard:{tmp_path / 'tb'}"
        for window in (["--steps", "100:200"], ["--steps", "250:"], []):
            res = ranklog_cmd("replay", str(dataset), "--to", tb, *window)
            assert res.returncode == 0, res.stderr
        back = tb_back(tmp_path / "tb")  # raw files: each tag in step order, each step once
        assert [s for s, _ in back] == list(range(300))
        assert all(set(m) >= {"train/loss", "timing/step"} for _, m in back)

    def test_names_then_all_is_refused(self, dataset: Path, tmp_path: Path) -> None:
        """Steps held with ``--names 'train/*'``: a full replay is refused; the same names fill."""
        tb = f"tensorboard:{tmp_path / 'tb'}"
        res = ranklog_cmd(
            "replay", str(dataset), "--to", tb, "--names", "train/*", "--steps", "100:200"
        )
        assert res.returncode == 0, res.stderr
        res = ranklog_cmd("replay", str(dataset), "--to", tb)
        assert res.returncode == 5 and "--names 'train/*'" in one_line(res.stderr)
        res = ranklog_cmd("replay", str(dataset), "--to", tb, "--names", "train/*")
        assert res.returncode == 0, res.stderr
        back = tb_back(tmp_path / "tb")
        assert [s for s, _ in back] == list(range(300))
        assert all("timing/step" not in m for _, m in back)

    def test_mlflow_window_then_all(self, dataset: Path, store: str) -> None:
        """MLflow: a replay after a windowed one writes the missing steps, each once."""
        uri = store
        for window in (["--steps", "100:200"], []):
            res = ranklog_cmd("replay", str(dataset), "--to", f"mlflow:{uri}", *window)
            assert res.returncode == 0, res.stderr
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        for key in ("train/loss", "timing/step"):
            got = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert got == list(range(300)), key

    def test_wandb_cannot_write_below_and_says_so(self, dataset: Path, tmp_path: Path) -> None:
        """W&B holds 100..199: a full replay is refused before writing; --below-last skip
        writes the steps above and says what it left out."""
        env = wandb_env(tmp_path)
        to = ["--to", "wandb:p", "--mode", "offline", "--dir", str(tmp_path)]
        assert ranklog_cmd("replay", str(dataset), *to, "--steps", "100:200", **env).returncode == 0
        res = ranklog_cmd("replay", str(dataset), *to, **env)
        assert res.returncode == 5 and "--below-last skip" in one_line(res.stderr)
        assert wandb_steps(tmp_path) == list(range(100, 200))
        res = ranklog_cmd("replay", str(dataset), *to, "--below-last", "skip", **env)
        assert res.returncode == 0 and "left out" in res.stderr, res.stderr
        assert wandb_steps(tmp_path) == list(range(100, 300))


# -- 4. compact --delete before a shipper -------------------------------------------------


class TestCompactDelete:
    def test_deleted_before_shipping_says_replay(self, spool: Path, tmp_path: Path) -> None:
        """No shipper known: --delete deletes; a later ``ship --once`` names the replay (exit 3)."""
        job(spool, range(50))
        ds, out = tmp_path / "ds", tmp_path / "o.jsonl"
        res = ranklog_cmd("compact", str(spool), "--out", str(ds), "--delete")
        assert res.returncode == 0 and "deleted (verified)" in res.stdout, res.stdout
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 3
        assert f"ranklog replay {ds.resolve()}" in one_line(res.stderr)
        assert ranklog_cmd("replay", str(ds), "--to", f"jsonl:{out}").returncode == 0
        assert steps_of(out) == list(range(50))
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 0, res.stderr  # the target holds what was deleted: go on
        assert steps_of(out) == list(range(50))

    def test_the_shipper_goes_on_after_the_replay(self, spool: Path, tmp_path: Path) -> None:
        """Deleted, replayed, then the job goes on: the shipper ships the new steps once."""
        run = rank(spool, 0, 1, max_segment_bytes=4096)
        log_steps(run, range(60))
        ds, out = tmp_path / "ds", tmp_path / "o.jsonl"
        res = ranklog_cmd("compact", str(spool), "--out", str(ds), "--delete")
        assert res.returncode == 0 and "deleted (verified)" in res.stdout, res.stdout
        assert ranklog_cmd("replay", str(ds), "--to", f"jsonl:{out}").returncode == 0
        log_steps(run, range(60, 70))
        run.close()
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 0, res.stderr
        assert steps_of(out) == list(range(70))

    def test_an_older_deleted_json_still_says_replay(self, spool: Path, tmp_path: Path) -> None:
        """deleted.json of the first format (no steps): the target cannot be checked, refused."""
        job(spool, range(5))
        ds, out = tmp_path / "ds", tmp_path / "o.jsonl"
        assert ranklog_cmd("compact", str(spool), "--out", str(ds), "--delete").returncode == 0
        body = json.loads((spool / "deleted.json").read_text())
        old = {k: v["dataset"] for k, v in body["segments"].items()}
        (spool / "deleted.json").write_text(json.dumps({"version": 1, "segments": old}))
        assert ranklog_cmd("replay", str(ds), "--to", f"jsonl:{out}").returncode == 0
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 3 and "ranklog replay" in one_line(res.stderr)

    @pytest.mark.parametrize("entry", [7, ["ds"], {"dataset": "ds"}, {"steps": [[0, 1]]}])
    def test_a_damaged_deleted_json_is_named(self, tmp_path: Path, entry: object) -> None:
        """An entry of deleted.json that is no dataset is a SpoolFormatError naming the file."""
        from ranklog.errors import SpoolFormatError
        from ranklog.spool import deleted_segments

        body = {"version": 2, "segments": {"00000/0000-000000": entry}}
        (tmp_path / "deleted.json").write_text(json.dumps(body))
        with pytest.raises(SpoolFormatError, match=r"deleted\.json"):
            deleted_segments(tmp_path)

    def test_a_shipper_with_no_cursor_yet_keeps_them(self, spool: Path, tmp_path: Path) -> None:
        """A shipper holding its lease but with no cursor yet: every segment is kept."""
        from ranklog.shippers._lease import Lease

        job(spool, range(20))
        lease = Lease(spool, "jsonl-0000", target="jsonl:/elsewhere.jsonl")
        lease.acquire()
        try:
            res = ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds"), "--delete")
        finally:
            lease.release()
        assert res.returncode == 0
        assert "deleted" not in res.stdout and "no cursor yet" in res.stdout, res.stdout
        assert list((spool / "ranks").glob("*/*.rlog"))

    def test_a_shipper_behind_keeps_them_unless_forced(self, spool: Path, tmp_path: Path) -> None:
        """A cursor that has not finished a segment keeps it; --force deletes it all the same."""
        run = rank(spool, 0, 1)
        log_steps(run, range(10))
        out = tmp_path / "o.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        log_steps(run, range(10, 20))
        run.close()
        res = ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds"), "--delete")
        assert "has not shipped all of it yet" in res.stdout, res.stdout
        res = ranklog_cmd(
            "compact", str(spool), "--out", str(tmp_path / "ds"), "--delete", "--force"
        )
        assert "deleted (verified)" in res.stdout, res.stdout
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet")
        assert res.returncode == 3 and "ranklog replay" in one_line(res.stderr)


# -- 5. --once always ends ----------------------------------------------------------------


class TestOnceEnds:
    @pytest.mark.parametrize(
        "where",
        ["jsonl:{tmp}", "jsonl:{tmp}/file/x.jsonl", "tensorboard:{tmp}/file",
         "jsonl:/proc/nope/x.jsonl"],
        ids=["path-is-a-dir", "under-a-file", "tb-is-a-file", "proc"],
    )  # fmt: skip
    def test_permanent_target_errors_fail_at_once(
        self, where: str, spool: Path, tmp_path: Path
    ) -> None:
        """A target that can never be written: one line, exit 5, in seconds (once and live)."""
        job(spool, range(3))
        (tmp_path / "file").write_text("a file\n")
        spec = where.format(tmp=tmp_path)
        for once in (["--once"], []):
            t0 = time.monotonic()
            res = cli("ship", str(spool), "--to", spec, "--quiet", *once, timeout=60)
            assert res.returncode == 5, res.stderr
            said = one_line(res.stderr)
            assert "not retried" in said or "not a ranklog JSONL file" in said
            assert time.monotonic() - t0 < 30

    def test_a_project_name_wandb_refuses_fails_at_once(self, spool: Path, tmp_path: Path) -> None:
        """wandb's UsageError (a project name it refuses) is permanent: one line, exit 5."""
        job(spool, range(2))
        res = cli("ship", str(spool), "--to", "wandb:a?b", "--mode", "offline", "--dir",
                  str(tmp_path), "--once", "--quiet", timeout=100)  # fmt: skip
        assert res.returncode == 5, res.stderr
        line = res.stderr.strip().splitlines()[-1]  # (after a line on wandb's service)
        assert "not retried" in line and "Invalid project name 'a?b'" in line

    def test_stopped_mlflow_server_gives_up_after_retry_for(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """Nothing listens: retried for --retry-for seconds, one line a try, then exit 5."""
        job(spool, range(3))
        uri = f"http://127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        res = cli("ship", str(spool), "--to", f"mlflow:{uri}", "--once", "--quiet",
                  "--retry-for", "2", timeout=120, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")  # fmt: skip
        assert res.returncode == 5, res.stderr
        assert time.monotonic() - t0 < 90
        err = res.stderr.strip().splitlines()
        assert all(line.startswith("ranklog") for line in err), res.stderr
        assert "Retry(" not in res.stderr and "connection refused" in err[-1]
        assert "run the same command again to resume" in err[-1]


# -- 6. the job's end reaches the backends ------------------------------------------------


def _ended(spool: Path, how: str) -> None:
    """Two ranks: both end ok; or rank 1 fails; or rank 1 is stopped by a signal."""
    runs = [rank(spool, r, 2) for r in range(2)]
    for s in range(4):
        for run in runs:
            run.log_metrics({"loss": 1.0}, step=s)
            run.step_end(s)
    runs[0].close()
    if how == "ok":
        runs[1].close()
    elif how == "error":
        runs[1].close("error", 1)
    else:
        runs[1].close("signal", 143)


class TestJobEnd:
    @pytest.mark.parametrize(
        ("how", "status"), [("ok", "FINISHED"), ("error", "FAILED"), ("signal", "KILLED")]
    )
    def test_mlflow_run_ends_as_the_ranks_did(
        self, how: str, status: str, spool: Path, store: str
    ) -> None:
        """Every rank ok: FINISHED; a rank failed: FAILED; a rank stopped by a signal: KILLED."""
        _ended(spool, how)
        uri = store
        res = ranklog_cmd(
            "ship", str(spool), "--to", f"mlflow:{uri}", "--once", "--dead-after", "0"
        )
        assert res.returncode == 0, res.stderr
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == status
        assert run.info.end_time is not None

    def test_a_rank_never_heard_of_fails_the_run(self, spool: Path, store: str) -> None:
        """World size 2, rank 1 never wrote a byte: the job did not finish, the run FAILED."""
        run = rank(spool, 0, 2)
        log_steps(run, range(3))
        run.close()
        res = ranklog_cmd("ship", str(spool), "--to", f"mlflow:{store}", "--once",
                          "--dead-after", "0", "--start-grace", "0")  # fmt: skip
        assert res.returncode == 0, res.stderr
        client = MlflowClient(tracking_uri=store)
        (got,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert got.info.status == "FAILED"

    def test_an_uncaught_exception_fails_the_run(self, spool: Path, store: str) -> None:
        """A training script that dies of an exception (no close()): the MLflow run FAILED."""
        code = (
            "import os, ranklog; r = ranklog.init(os.environ['SPOOL'], rank=0, world_size=1);"
            "r.log_metrics({'x': 1.0}, step=0); r.step_end(0); raise RuntimeError('boom')"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=python_env(SPOOL=str(spool)),
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert proc.returncode == 1 and "boom" in proc.stderr
        uri = store
        assert ranklog_cmd("ship", str(spool), "--to", f"mlflow:{uri}", "--once").returncode == 0
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "FAILED"

    @pytest.mark.parametrize(("how", "code"), [("ok", 0), ("error", 1)])
    def test_wandb_run_finishes_with_the_exit_code(
        self, how: str, code: int, spool: Path, tmp_path: Path
    ) -> None:
        """The W&B run's exit record carries 0 when every rank ended ok, 1 when one failed."""
        _ended(spool, how)
        to = ["--to", "wandb:p", "--mode", "offline", "--dir", str(tmp_path)]
        res = ranklog_cmd("ship", str(spool), *to, "--once", "--quiet", **wandb_env(tmp_path))
        assert res.returncode == 0, res.stderr
        exits = [
            rec.exit.exit_code
            for p in tmp_path.glob("wandb/offline-run-*/run-*.wandb")
            for rec in iter_records(p)
            if rec.WhichOneof("record_type") == "exit"
        ]
        assert exits and exits[-1] == code


# -- 7. inspect says what it knows ---------------------------------------------------------


def _inspect(spool: Path) -> dict[str, Any]:
    res = ranklog_cmd("inspect", str(spool), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


class TestInspect:
    def test_shipped_count_is_what_the_target_holds_after_a_crash(
        self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Killed between the target's flush and the cursor's commit: the count still matches."""
        import ranklog.shippers._engine as engine

        from .compliance import Killed
        from .shiphelp import ship

        run = rank(spool, 0, 1)
        log_steps(run, range(40))
        monkeypatch.setattr(engine, "BATCH_STEPS", 7)
        real, calls = engine.save_cursor, {"n": 0}

        def dying(*args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise Killed("commit")
            real(*args)

        monkeypatch.setattr(engine, "save_cursor", dying)
        out = tmp_path / "o.jsonl"
        with pytest.raises(Killed):
            ship(spool, out, name="x")
        monkeypatch.setattr(engine, "save_cursor", real)
        ship(spool, out, name="x")
        (sh,) = _inspect(spool)["shippers"]
        assert sh["steps_shipped"] == len(steps_of(out)) == 40

    def test_a_crashed_incarnation_is_superseded(self, spool: Path) -> None:
        """An incarnation killed without rank_end and relaunched reads crashed, superseded."""
        code = (
            "import os, ranklog; r = ranklog.init(os.environ['SPOOL'], rank=0, world_size=1);"
            "r.log_metrics({'x': 1.0}, step=0); r.step_end(0); r.flush(); os._exit(9)"
        )
        subprocess.run([sys.executable, "-c", code], env=python_env(SPOOL=str(spool)), check=False)
        run = rank(spool, 0, 1)
        log_steps(run, range(1, 3))
        run.close()
        states = [i["state"] for i in _inspect(spool)["incarnations"]]
        assert states == ["crashed, superseded by 2", "ended (ok)"]

    def test_a_shipper_is_running_then_stopped(self, spool: Path, tmp_path: Path) -> None:
        """A live shipper shows as running with its pid; once it stopped, as stopped."""
        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        out = tmp_path / "o.jsonl"
        proc = follow(str(spool), "--to", f"jsonl:{out}", "--dead-after", "3600")
        try:
            wait_for(lambda: len(lines(out)) == 3)
            wait_for(lambda: (spool / "cursors").is_dir() and _inspect(spool)["shippers"])
            (sh,) = _inspect(spool)["shippers"]
            assert sh["state"] == f"running (pid {proc.pid})"
        finally:
            stop(proc)
        (sh,) = _inspect(spool)["shippers"]
        assert sh["state"] == "stopped"

    def test_inspect_into_a_closed_pipe_is_quiet(self, spool: Path) -> None:
        """``ranklog inspect --json | head -c 1``: no error line, the status of a closed pipe."""
        for r in range(160):  # more JSON than a pipe holds: the write meets the closed pipe
            run = rank(spool, r, 160)
            run.log_metrics({"x": 1.0}, step=0)
            run.close()
        res = subprocess.run(
            f"{sys.executable} -m ranklog.cli inspect --json {spool} | head -c 1; "
            "echo \" ${PIPESTATUS[0]}\"",
            shell=True, executable="/bin/bash", env=python_env(), capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert res.stderr == ""
        assert res.stdout.split() == ["{", "141"]


# -- 8. a whole job killed at once --------------------------------------------------------


class TestWholeJobKill:
    def test_the_epilogue_ships_to_every_recorded_target(self, spool: Path, tmp_path: Path) -> None:
        """Ranks and shippers die together: ``ranklog ship SPOOL --once`` finishes every target."""
        runs = [rank(spool, r, 2) for r in range(2)]
        for run in runs:
            log_steps(run, range(5))
        out, tb = tmp_path / "o.jsonl", tmp_path / "tb"
        shippers = [
            follow(str(spool), "--to", spec, "--dead-after", "3600")
            for spec in (f"jsonl:{out}", f"tensorboard:{tb}")
        ]
        wait_for(
            lambda: len(lines(out)) == 5 and len(list((spool / "cursors").glob("*.json"))) == 2
        )
        for p in shippers:
            p.kill()
            p.communicate()
        for run in runs:  # the last steps close; then SIGKILL takes the ranks (no rank_end)
            log_steps(run, range(5, 9))
        res = cli("ship", str(spool), "--once", "--quiet")
        assert res.returncode == 0, res.stderr
        assert steps_of(out) == list(range(9))
        assert [s for s, _ in tb_back(tb)] == list(range(9))

    def test_several_targets_record_one_name_each(self, spool: Path, tmp_path: Path) -> None:
        """``--name x`` with two targets: each cursor records its own name, in one process
        or one per target, so the epilogue starts each shipper as it was."""
        job(spool, range(3))
        out, tb = tmp_path / "o.jsonl", tmp_path / "tb"
        res = ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--to", f"tensorboard:{tb}",
                          "--name", "x", "--once", "--quiet", "--in-process")  # fmt: skip
        assert res.returncode == 0, res.stderr
        cursors = [json.loads(p.read_text()) for p in (spool / "cursors").glob("*.json")]
        names = sorted(c["argv"][c["argv"].index("--name") + 1] for c in cursors)
        assert names == ["x-jsonl", "x-tensorboard"]
        job(spool, range(3, 5))
        res = ranklog_cmd("ship", str(spool), "--once", "--quiet")
        assert res.returncode == 0, res.stderr
        assert len(list((spool / "cursors").glob("*.json"))) == 2
        assert steps_of(out) == list(range(5))

    def test_no_recorded_target_is_one_line(self, spool: Path) -> None:
        """``ranklog ship SPOOL --once`` with no shipper recorded: one line, exit 2."""
        job(spool, range(2))
        res = ranklog_cmd("ship", str(spool), "--once")
        assert res.returncode == 2 and "--to" in one_line(res.stderr)

    def test_a_shipper_follows_its_training_process(self, spool: Path, tmp_path: Path) -> None:
        """``--exit-with PID``: once PID dies, the shipper ships what is closed and exits."""
        run = rank(spool, 0, 1)
        log_steps(run, range(6))
        trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        out = tmp_path / "o.jsonl"
        proc = follow(str(spool), "--to", f"jsonl:{out}", "--dead-after", "3600",
                      "--exit-with", str(trainer.pid))  # fmt: skip
        try:
            wait_for(lambda: len(lines(out)) == 6)
            log_steps(run, range(6, 8))
            trainer.kill()
            trainer.wait()
            t0 = time.monotonic()
            proc.wait(timeout=30)
            assert time.monotonic() - t0 < 10
        finally:
            trainer.kill()
            _, err = stop(proc)
        assert proc.returncode == 0, err
        assert steps_of(out) == list(range(8))
        assert not os.path.exists(spool / "cursors" / "x.lease")
