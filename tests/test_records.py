"""Run records (metric definitions, summary values, the code's git state) and Plotly charts:
logged once, shipped to each backend as its users expect, the same live and in replay."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import ranklog
from ranklog.errors import InvalidValueError
from ranklog.producer import _records
from ranklog.schemas import Params
from ranklog.shippers.targets._wandb_log import history_rows, iter_records
from ranklog.shippers.targets.jsonl import read_jsonl
from ranklog.testing import read_events

from .test_everyday import ranklog_cmd

DATA = Path(__file__).parent / "data"


def git(repo: Path, *args: str) -> str:
    """``git ARGS`` in ``repo``, as a user with a name and an e-mail."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x", "HOME": str(repo), "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository on branch ``train`` with one commit, a tracked file changed since
    (dirty), an untracked file, and an origin whose URL carries a token."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "train")
    (r / "train.py").write_text("lr = 0.1\n")
    git(r, "add", "train.py")
    git(r, "commit", "-qm", "first")
    git(r, "remote", "add", "origin", "https://user:ghp_secret123@github.com/acme/model.git")
    (r / "train.py").write_text("lr = 0.2\n")
    (r / "notes.txt").write_text("untracked, not part of the run's code\n")
    return r


def records(spool: Path) -> dict[str, Any]:
    """Every run record the spool's params events carry, the latest value of each key."""
    out: dict[str, Any] = {}
    for ev in read_events(spool):
        if isinstance(ev, Params):
            out.update(ev.meta)
    return out


def logged_run(spool: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> None:
    """A rank 0 started in ``cwd`` that logs two steps and every kind of run record."""
    monkeypatch.chdir(cwd)
    run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False, **kw)
    run.log_hyperparams({"optim": {"lr": 0.1}})
    run.define_metric("eval/*", step_metric="eval/epoch")
    run.define_metric("train/loss", summary="min")
    run.log_summary({"best_acc": 0.5})
    run.log_metrics({"train/loss": 2.0, "eval/acc": 0.5, "eval/epoch": 1.0}, step=0)
    run.step_end(0)
    run.log_summary({"best_acc": 0.75, "verdict": "good"})
    run.log_metrics({"train/loss": 1.0}, step=1)
    run.step_end(1)
    run.close()


class TestProducer:
    def test_code_records_commit_branch_dirty_and_diff(
        self, repo: Path, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """init(code=True) in a repository records its commit, branch, dirty flag, origin
        (without the token) and the diff of tracked files, untracked ones left out."""
        logged_run(spool, repo, monkeypatch, code=True)
        got = records(spool)
        assert got["code/commit"] == git(repo, "rev-parse", "HEAD")
        assert got["code/branch"] == "train"
        assert got["code/dirty"] is True
        assert got["code/remote"] == "https://github.com/acme/model.git"
        assert got["code/root"] == str(repo.resolve())
        assert "-lr = 0.1\n+lr = 0.2" in got["code/diff"]
        assert "untracked" not in got["code/diff"]
        assert got["code/diff_truncated"] is False
        assert got["code/diff_bytes"] == len(got["code/diff"].encode())

    def test_code_is_recorded_by_default_and_turned_off(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Code provenance is on unless RANKLOG_CODE=0 or init(code=False); rank 1, and a
        process outside any repository, record none."""
        monkeypatch.delenv("RANKLOG_CODE")
        logged_run(tmp_path / "on", repo, monkeypatch)
        assert "code/commit" in records(tmp_path / "on")
        logged_run(tmp_path / "off", repo, monkeypatch, code=False)
        monkeypatch.setenv("RANKLOG_CODE", "0")
        logged_run(tmp_path / "env", repo, monkeypatch)
        outside = tmp_path / "plain"
        outside.mkdir()
        logged_run(tmp_path / "outside", outside, monkeypatch, code=True)
        for name in ("off", "env", "outside"):
            assert not any(k.startswith("code/") for k in records(tmp_path / name)), name
        monkeypatch.chdir(repo)
        r1 = ranklog.init(tmp_path / "r1", rank=1, world_size=2, handle_signals=False, code=True)
        r1.close()
        assert records(tmp_path / "r1") == {}

    def test_a_large_diff_is_cut_at_a_line_end(
        self, repo: Path, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A diff past the bound is cut at a line end; its whole size and the cut are recorded."""
        monkeypatch.setattr(_records, "MAX_DIFF_BYTES", 300)
        (repo / "train.py").write_text("".join(f"line {i}\n" for i in range(200)))
        logged_run(spool, repo, monkeypatch, code=True)
        got = records(spool)
        assert got["code/diff_truncated"] is True
        assert len(got["code/diff"].encode()) <= 300 and got["code/diff"].endswith("\n")
        assert got["code/diff_bytes"] > 1000

    def test_records_of_definitions_and_summaries(self, spool: Path) -> None:
        """define_metric and log_summary are recorded with their options and values."""
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run.define_metric("eval/*", step_metric="eval/epoch", summary="max", goal="maximize")
        run.define_metric("hidden_one", hidden=True)
        run.log_summary({"best": 0.5, "n": 3, "ok": True, "what": "x", "none": None})
        run.close()
        got = records(spool)
        assert json.loads(got["define/eval/*"]) == {
            "step_metric": "eval/epoch", "summary": "max", "goal": "maximize"
        }  # fmt: skip
        assert json.loads(got["define/hidden_one"]) == {"hidden": True}
        assert {k: v for k, v in got.items() if k.startswith("summary/")} == {
            "summary/best": 0.5, "summary/n": 3, "summary/ok": True, "summary/what": "x",
            "summary/none": None,
        }  # fmt: skip

    @pytest.mark.parametrize(
        ("call", "says"),
        [
            (lambda r: r.define_metric("a*b"), "'a*b'"),
            (lambda r: r.define_metric("a", summary="avg"), "'a': summary 'avg'"),
            (lambda r: r.define_metric("a", goal="up"), "'a': goal 'up'"),
            (lambda r: r.log_summary({"best": [1, 2]}), "summary 'best'"),
            (lambda r: r.log_summary({"big": 10**400}), "summary 'big'"),
            (lambda r: r.log_summary(["best"]), "summary must be a dict"),
            (lambda r: r.log_hyperparams({"@code/commit": "x"}), "'@code/commit'"),
        ],
    )
    def test_bad_records_are_refused_naming_the_key(
        self, spool: Path, call: Any, says: str
    ) -> None:
        """A bad definition, summary value or an ``@`` hyperparameter raises, naming the key;
        nothing of it is written."""
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        with pytest.raises(InvalidValueError, match=says.replace("*", r"\*")):
            call(run)
        run.close()
        assert records(spool) == {}


class TestReviewed:
    """What a review of run records found, each fixed."""

    def test_a_repository_path_with_spaces(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A repository whose path holds spaces is recorded (git's output split by line)."""
        r = tmp_path / "My Projects" / "repo"
        r.mkdir(parents=True)
        git(r, "init", "-q", "-b", "main")
        (r / "a.py").write_text("x = 1\n")
        git(r, "add", "a.py")
        git(r, "commit", "-qm", "c")
        logged_run(tmp_path / "spool", r, monkeypatch, code=True)
        assert records(tmp_path / "spool")["code/root"] == str(r.resolve())

    def test_a_token_in_the_diff_is_redacted(
        self, repo: Path, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A credential-shaped token in a tracked file's diff never leaves the machine."""
        token = "hf_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3"
        (repo / "train.py").write_text(f"lr = 0.2\nHF = '{token}'\n")
        logged_run(spool, repo, monkeypatch, code=True)
        got = records(spool)
        assert token not in got["code/diff"] and "HF = '<redacted>'" in got["code/diff"]
        assert got["code/diff_redacted"] == 1

    def test_an_old_hyperparameter_named_with_at_stays_one(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """A hyperparameter named ``@x`` in a spool of an older release (legal then) ships
        as the hyperparameter ``@x``, not as a run record."""
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run._sink.append(Params(1.0, {"@x": 1, "lr": 0.1}, {"@l": [1, 2]}))
        run.log_metrics({"a": 1.0}, step=0)
        run.close()
        out = tmp_path / "o.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        lines = read_jsonl(out)
        assert [x["params"] for x in lines if "params" in x] == [{"@x": 1, "lr": 0.1, "@l": [1, 2]}]
        assert not [x for x in lines if "meta" in x]

    def test_the_cursor_keeps_a_digest_of_a_long_diff(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A long diff is kept in the cursor by its digest (the cursor, rewritten at every
        commit, stays small), and a restarted shipper still sends it once."""
        spool, out = tmp_path / "spool", tmp_path / "o.jsonl"
        (repo / "train.py").write_text("".join(f"line {i}\n" for i in range(20000)))
        logged_run(spool, repo, monkeypatch, code=True)
        assert len(records(spool)["code/diff"]) > 100_000
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        (cursor,) = (spool / "cursors").glob("*.json")
        assert cursor.stat().st_size < 20_000
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        assert sum("code/diff" in x.get("meta", {}) for x in read_jsonl(out)) == 1

    def test_several_ranks_replay_on_columns(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Rank 0's run records beside every rank's same config keep the replay on columns
        (not event by event), and it writes what live shipping wrote."""
        monkeypatch.chdir(repo)
        spool = tmp_path / "spool"
        for r in (0, 1):
            run = ranklog.init(spool, rank=r, world_size=2, handle_signals=False, code=r == 0)
            run.log_hyperparams({"lr": 0.1})
            if r == 0:
                run.log_summary({"best": 1.0})
            for step in range(3):
                run.log_metrics({"loss": step + r}, step=step)
                run.step_end(step)
            run.close()
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{live}", "--once").returncode == 0
        assert ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds")).returncode == 0
        done = ranklog_cmd("replay", str(tmp_path / "ds"), "--to", f"jsonl:{again}")
        assert done.returncode == 0 and "event by event" not in done.stderr, done.stderr
        assert again.read_bytes() == live.read_bytes()

    def test_tensorboard_code_text_is_no_step_and_written_once(self, tmp_path: Path) -> None:
        """The code's text record holds no step: a reopened target holds none, and does not
        write the same text again (a crash before the cursor was committed)."""
        pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")
        from ranklog.shippers.targets.tensorboard import TensorBoardTarget
        from ranklog.spool import RunInfo

        run = RunInfo("r" * 32, 0.0, "t")
        meta = {"code/commit": "abc", "code/dirty": False, "code/root": "/r", "code/diff": ""}
        for _ in range(2):
            target = TensorBoardTarget(tmp_path / "tb")
            assert not target.open(run)
            target.write_meta(dict(meta))
            target.flush()
            target.close()
        data = b"".join(p.read_bytes() for p in (tmp_path / "tb").glob("events.out.*"))
        assert data.count(b"code/git") == 1

    def test_wandb_sends_the_image_when_plotly_cannot_read_the_chart(self, tmp_path: Path) -> None:
        """A chart the shipper's plotly refuses (another version wrote it) goes as its image,
        said once; the shipper does not stop."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        pytest.importorskip("plotly", reason="extra plots; ./tools/test installs it")
        from ranklog.schemas import Image

        spool = tmp_path / "spool"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        import io

        from PIL import Image as PILImage

        buf = io.BytesIO()
        PILImage.new("RGB", (4, 4)).save(buf, format="png")
        bad = json.dumps({"data": [{"type": "scatter", "no_such_property": 1}]})
        run._sink.append(Image(1.0, 0, "plots/loss", buf.getvalue(), "png", bad), step=0)
        run.log_metrics({"x": 1.0}, step=0)
        run.close()
        done = ranklog_cmd("ship", str(spool), "--to", "wandb:p", "--dir", str(tmp_path / "w"),
                           "--mode", "offline", "--once")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "a Plotly chart this plotly cannot read is sent as its image" in done.stderr
        assert media_types(tmp_path / "w") == ["image-file"]

    def test_wandb_summary_replaced_by_a_logged_value_is_not_given_again(
        self, tmp_path: Path
    ) -> None:
        """A summary key later logged as a metric takes W&B's own summary (its last value);
        a later session is not given the older summary value."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        spool, root = tmp_path / "spool", tmp_path / "w"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run.log_summary({"loss": 9.0, "best": 1.0})
        run.log_metrics({"loss": 0.5}, step=0)
        run.step_end(0)
        run.flush()
        args = ("ship", str(spool), "--to", "wandb:p", "--dir", str(root), "--mode", "offline",
                "--once")  # fmt: skip
        assert ranklog_cmd(*args).returncode == 0
        run.log_metrics({"loss": 0.25}, step=1)
        run.step_end(1)
        run.close()
        assert ranklog_cmd(*args).returncode == 0
        second = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))[1]
        updates = [r.summary.update for r in iter_records(second)
                   if r.WhichOneof("record_type") == "summary"]  # fmt: skip
        given = {u.key: json.loads(u.value_json) for ups in updates for u in ups if u.key}
        assert given.get("best") == 1.0 and given.get("loss") != 9.0


class TestConsole:
    def test_the_console_prints_the_code_and_summary(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The console prints the commit, branch and dirty flag, and the summary values, a
        line each, and says nothing is left out."""
        spool = tmp_path / "spool"
        logged_run(spool, repo, monkeypatch, code=True)
        done = ranklog_cmd("ship", str(spool), "--to", "console", "--once")
        assert done.returncode == 0, done.stderr
        commit = git(repo, "rev-parse", "HEAD")
        assert f"code    {commit[:12]} on train (uncommitted changes)" in done.stdout
        assert "summary best_acc=0.5" in done.stdout
        assert "left out" not in done.stderr


class TestJsonlAndReplay:
    def test_meta_lines_live_and_replayed_alike(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """JSONL holds each record once, in ``meta`` lines before the step they precede;
        compaction keeps them (params rows named ``@...``) and replay writes the same file."""
        spool = tmp_path / "spool"
        logged_run(spool, repo, monkeypatch, code=True)
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{live}", "--once").returncode == 0
        metas = [x["meta"] for x in read_jsonl(live) if "meta" in x]
        assert metas[0]["summary/best_acc"] == 0.5 and "define/eval/*" in metas[0]
        assert metas[0]["code/commit"] == git(repo, "rev-parse", "HEAD")
        assert metas[1] == {"summary/best_acc": 0.75, "summary/verdict": "good"}
        kinds = [next(iter(x)) for x in read_jsonl(live)]
        assert kinds == ["ranklog", "params", "meta", "step", "meta", "step"]
        assert ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds")).returncode == 0
        import pyarrow.parquet as pq

        names = pq.read_table(tmp_path / "ds" / "params").column("name").to_pylist()
        assert "@summary/best_acc" in names and "optim.lr" in names
        assert ranklog_cmd("replay", str(tmp_path / "ds"), "--to", f"jsonl:{again}").returncode == 0
        assert again.read_bytes() == live.read_bytes()

    def test_a_restarted_shipper_sends_no_record_twice(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Records written before a crash (cursor not committed) are not written again."""
        spool = tmp_path / "spool"
        logged_run(spool, repo, monkeypatch, code=True)
        out = tmp_path / "o.jsonl"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        for cursor in (spool / "cursors").glob("*.json"):
            cursor.unlink()  # as if the shipper died before committing
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{out}", "--once").returncode == 0
        assert len([x for x in read_jsonl(out) if "meta" in x]) == 2


class TestSchema5Fixture:
    """tests/data/schema5: a spool and its dataset written before run records existed
    (tests/data/schema5/make.py, run by the release before schema 6)."""

    def test_old_spool_ships_and_old_dataset_replays_as_then(self, tmp_path: Path) -> None:
        """Today's shipper and replay write what that release wrote from them, byte for byte."""
        shutil.copytree(DATA / "schema5", tmp_path / "f")
        want = (DATA / "schema5" / "expected.jsonl").read_bytes()
        live, again = tmp_path / "live.jsonl", tmp_path / "replay.jsonl"
        spool = tmp_path / "f" / "spool"
        assert ranklog_cmd("ship", str(spool), "--to", f"jsonl:{live}", "--once").returncode == 0
        ds = str(tmp_path / "f" / "dataset")
        assert ranklog_cmd("replay", ds, "--to", f"jsonl:{again}").returncode == 0
        assert live.read_bytes() == want
        assert again.read_bytes() == want


def wandb_records(root: Path) -> list[tuple[str, Any]]:
    """(kind, record) of every record of every offline session under ``root``, in order."""
    out = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in iter_records(path):
            kind = rec.WhichOneof("record_type")
            out.append((kind, getattr(rec, kind)))
    return out


class TestWandb:
    def test_definitions_summary_and_git_diffs_artifact(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """W&B gets each define_metric, the summary values and, as NeMo RL logs it, a
        ``git-diffs`` artifact with ``uncommitted_changes_diff.txt`` and the commit."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        spool, root = tmp_path / "spool", tmp_path / "w"
        logged_run(spool, repo, monkeypatch, code=True)
        done = ranklog_cmd("ship", str(spool), "--to", "wandb:proj", "--dir", str(root),
                           "--mode", "offline", "--once")  # fmt: skip
        assert done.returncode == 0, done.stderr
        recs = wandb_records(root)
        metrics = {m.glob_name or m.name: m for k, m in recs if k == "metric"}
        assert metrics["eval/*"].step_metric == "eval/epoch"
        assert metrics["train/loss"].summary.min
        summary: dict[str, Any] = {}
        for k, s in recs:
            if k == "summary":
                summary.update((u.key, json.loads(u.value_json)) for u in s.update if u.key)
        assert summary["best_acc"] == 0.75 and summary["verdict"] == "good"
        (art,) = [a for k, a in recs if k == "artifact"]
        assert (art.type, art.name) == ("git-diffs", f"git-diffs-proj-{art.run_id}")
        assert json.loads(art.metadata)["commit"] == git(repo, "rev-parse", "HEAD")
        assert [e.path for e in art.manifest.contents] == ["uncommitted_changes_diff.txt"]
        (diff,) = root.glob("wandb/offline-run-*/files/uncommitted_changes_diff.txt")
        assert "+lr = 0.2" in diff.read_text()

    def test_a_later_session_is_given_the_records_again(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A restarted shipper starts a new offline session: it gets the definitions and
        the summary again (kept in the hidden config), so a sync of every folder keeps them."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        spool, root = tmp_path / "spool", tmp_path / "w"
        run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
        run.define_metric("eval/*", step_metric="eval/epoch")
        run.log_summary({"best": 1.0})
        run.log_metrics({"eval/acc": 0.5, "eval/epoch": 1.0}, step=0)
        run.step_end(0)
        run.flush()
        args = ("ship", str(spool), "--to", "wandb:proj", "--dir", str(root), "--mode", "offline",
                "--once")  # fmt: skip
        assert ranklog_cmd(*args).returncode == 0
        run.log_metrics({"eval/acc": 0.7, "eval/epoch": 2.0}, step=1)
        run.step_end(1)
        run.close()
        assert ranklog_cmd(*args).returncode == 0
        sessions = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(sessions) == 2
        second = [(r.WhichOneof("record_type"), r) for r in iter_records(sessions[1])]
        assert any(k == "metric" and r.metric.glob_name == "eval/*" for k, r in second)
        assert any(k == "summary" and any(u.key == "best" for u in r.summary.update)
                   for k, r in second)  # fmt: skip
        assert [row["eval/acc"] for row in history_rows(sessions[1])] == [0.7]


class TestMlflowAndTensorBoard:
    def test_mlflow_git_tags_and_code_artifacts(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """MLflow gets its own ``mlflow.source.git.*`` tags and ``code/`` artifacts; each
        summary key it cannot hold is said once on stderr."""
        pytest.importorskip("mlflow", reason="extra mlflow; ./tools/test installs it")
        from mlflow.tracking import MlflowClient

        spool = tmp_path / "spool"
        logged_run(spool, repo, monkeypatch, code=True)
        uri = f"sqlite:///{tmp_path / 'm.db'}"
        done = ranklog_cmd("ship", str(spool), "--to", f"mlflow:{uri}", "--once")
        assert done.returncode == 0, done.stderr
        said = [ln for ln in done.stderr.splitlines() if "summary values left out" in ln]
        assert [ln.split("(")[1].split(")")[0] for ln in said] == ["best_acc", "verdict"]
        client = MlflowClient(uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        tags = run.data.tags
        assert tags["mlflow.source.git.commit"] == git(repo, "rev-parse", "HEAD")
        assert tags["mlflow.source.git.branch"] == "train"
        assert tags["mlflow.source.git.repoURL"] == "https://github.com/acme/model.git"
        where = Path(client.download_artifacts(run.info.run_id, "code", str(tmp_path / "dl")))
        info = json.loads((where / "git.json").read_text())
        assert info["dirty"] is True and "diff" not in info
        assert "+lr = 0.2" in (where / "uncommitted_changes_diff.txt").read_text()

    def test_tensorboard_code_text(
        self, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """TensorBoard shows the code as a text entry ``code/git`` at step 0."""
        pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        spool, tb = tmp_path / "spool", tmp_path / "tb"
        logged_run(spool, repo, monkeypatch, code=True)
        assert (
            ranklog_cmd("ship", str(spool), "--to", f"tensorboard:{tb}", "--once").returncode == 0
        )
        acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
        acc.Reload()
        (entry,) = acc.Tensors("code/git")
        text = entry.tensor_proto.string_val[0].decode()
        assert entry.step == 0
        assert git(repo, "rev-parse", "HEAD") in text and "**branch** `train`" in text
        assert "```diff\n" in text and "+lr = 0.2" in text


def figure() -> Any:
    """A small line plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [2.0, 0.5, 1.0], label="loss")
    ax.set_title("loss")
    return fig


def plots_spool(spool: Path) -> None:
    run = ranklog.init(spool, rank=0, world_size=1, handle_signals=False)
    run.log_image("plots/loss", figure(), step=0)
    run.log_metrics({"x": 1.0}, step=0)
    run.step_end(0)
    run.close()


def media_types(root: Path) -> list[str]:
    rows = [
        r for p in sorted(root.glob("wandb/offline-run-*/run-*.wandb")) for r in history_rows(p)
    ]
    return [r["plots/loss._type"] for r in rows if "plots/loss._type" in r]


class TestPlotly:
    def test_a_figure_reaches_wandb_as_a_plotly_chart(self, tmp_path: Path) -> None:
        """With plotly installed, W&B shows a logged figure as an interactive chart (as
        ``wandb.log({name: figure})`` does); the replay of the dataset gives the same."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        pytest.importorskip("plotly", reason="extra plots; ./tools/test installs it")
        spool = tmp_path / "spool"
        plots_spool(spool)
        args = ("--mode", "offline")
        assert ranklog_cmd("ship", str(spool), "--to", "wandb:p", "--dir", str(tmp_path / "live"),
                           *args, "--once").returncode == 0  # fmt: skip
        assert media_types(tmp_path / "live") == ["plotly-file"]
        (chart,) = (tmp_path / "live").glob("wandb/offline-run-*/files/media/plotly/plots/*.json")
        assert json.loads(chart.read_text())["data"][0]["y"] == [2.0, 0.5, 1.0]
        assert ranklog_cmd("compact", str(spool), "--out", str(tmp_path / "ds")).returncode == 0
        assert ranklog_cmd("replay", str(tmp_path / "ds"), "--to", "wandb:p", "--dir",
                           str(tmp_path / "again"), *args).returncode == 0  # fmt: skip
        assert media_types(tmp_path / "again") == ["plotly-file"]

    def test_a_shipper_without_plotly_ships_the_image(self, tmp_path: Path) -> None:
        """The chart is kept beside the PNG: a shipper that cannot import plotly sends the image."""
        pytest.importorskip("wandb", reason="extra wandb; ./tools/test installs it")
        pytest.importorskip("plotly", reason="extra plots; ./tools/test installs it")
        from .conftest import python_env

        spool = tmp_path / "spool"
        plots_spool(spool)
        blocker = tmp_path / "blocker" / "plotly"
        blocker.mkdir(parents=True)
        (blocker / "__init__.py").write_text("raise ImportError('plotly is not here')\n")
        env = python_env()
        env["PYTHONPATH"] = f"{blocker.parent}:{env['PYTHONPATH']}"
        import sys

        done = subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", "wandb:p", "--dir",
             str(tmp_path / "w"), "--mode", "offline", "--once"], env=env, capture_output=True,
            text=True, timeout=180, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert media_types(tmp_path / "w") == ["image-file"]

    def test_without_plotly_the_producer_keeps_the_image_only(
        self, spool: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A producer without plotly logs the PNG alone (no chart, no error)."""
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "plotly" else real(n, *a)
        )
        plots_spool(spool)
        from ranklog.schemas import Image

        images = [ev for ev in read_events(spool) if isinstance(ev, Image)]
        assert len(images) == 1 and images[0].plotly == "" and images[0].data[:4] == b"\x89PNG"
