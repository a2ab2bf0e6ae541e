"""The ``mlflow:`` target: compliance on sqlite, a real ``mlflow server``, names, params, ranks."""

from __future__ import annotations

import http.server
import json
import logging
import math
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ranklog.errors import ExtraMissingError, RanklogError, TransientTargetError
from ranklog.shippers import Shipper, make_target
from ranklog.shippers._held import StepSet
from ranklog.shippers._target import ShippedStep, TextItem
from ranklog.shippers.targets.jsonl import JsonlTarget
from ranklog.spool import RunInfo, read_run

from . import test_compliance as tc
from .compliance import (
    Backend,
    Killed,
    expected,
    make_spool,
    run_once,
)
from .conftest import python_env, run_python
from .mlflow_server import MlflowServer, free_port, running_server
from .shiphelp import build_target, lines, log_steps, rank

pytest.importorskip("mlflow", reason="installed by ./tools/test (extra ranklog[mlflow])")

from mlflow.tracking import MlflowClient

from ranklog.shippers.targets.mlflow import (
    KEY_MAP,
    MARKER,
    STEPS_TAG,
    MlflowTarget,
    _text_files,
    held_steps,
    sanitize_key,
)

_TEMPLATE: dict[str, Path] = {}


def make(arg: str, spool: Path, opts: dict[str, Any] | None = None) -> Any:
    """The mlflow target of ``mlflow:arg`` (with option values)."""
    return build_target("mlflow", arg, spool, opts)


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test runs in an empty directory, and MLflow must leave nothing there (no ./mlruns)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert not list(cwd.iterdir())


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite store with its tables made (migrations take seconds)."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    _TEMPLATE["db"] = path
    return path


def sqlite_uri(work: Path) -> str:
    """A sqlite store in ``work``, copied from the template the first time."""
    db = work / "mlflow.db"
    if not db.exists():
        shutil.copyfile(_TEMPLATE["db"], db)
    return f"sqlite:///{db}"


def main_run(client: Any) -> Any:
    """The one main run ranklog made in this store."""
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, "tags.\"ranklog.role\" = 'main'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def history(client: Any, run_id: str, keys: list[str]) -> dict[str, dict[int, float]]:
    """key -> step -> value; fails if any (key, step) holds more than one point."""
    out: dict[str, dict[int, float]] = {}
    for key in keys:
        points = client.get_metric_history(run_id, key)
        steps = [p.step for p in points]
        dups = sorted({s for s in steps if steps.count(s) > 1})
        assert not dups, f"{key}: more than one point at steps {dups}"
        out[key] = {p.step: p.value for p in points}
    return out


def held(client: Any, run: Any) -> set[int]:
    """The steps a run says it holds: its ``ranklog.steps`` tags (and an older release's
    ``ranklog/step`` marker metric, if it has one)."""
    found = client.get_run(run.info.run_id)
    old = {p.step for p in client.get_metric_history(run.info.run_id, MARKER)}
    return {s for lo, hi in held_steps(found.data.tags).ranges() for s in range(lo, hi + 1)} | old


def read_back(uri: str) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of every step the run holds, each step's metrics once; every step
    with values is one the run says it holds; no bookkeeping metric among them."""
    client = MlflowClient(tracking_uri=uri)
    run = main_run(client)
    assert MARKER not in run.data.metrics
    hist = history(client, run.info.run_id, sorted(run.data.metrics))
    steps = sorted({s for h in hist.values() for s in h})
    # a step held without values: one that only carried late values (``--late ship``)
    assert set(steps) <= held(client, run), "a step with values the run does not say it holds"
    return [(s, {k: h[s] for k, h in hist.items() if s in h}) for s in steps]


def _sqlite_backend() -> Backend:
    def target(work: Path) -> MlflowTarget:
        return make(sqlite_uri(work), work, dict())

    def params(work: Path) -> dict[str, str]:
        return dict(main_run(MlflowClient(tracking_uri=sqlite_uri(work))).data.params)

    return Backend(
        "mlflow-sqlite", target, lambda work: read_back(sqlite_uri(work)), read_params=params,
        param=str,
    )  # fmt: skip


@pytest.fixture
def backend(template_db: Path) -> Backend:
    return _sqlite_backend()


class TestLateCompliance(tc.TestLateCompliance):
    """tests/test_compliance.py's late-value tests, run against MLflow on sqlite."""


class TestCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, run against MLflow on sqlite."""

    def test_texts_are_artifacts(self, backend: Backend, made: Path, work: Path) -> None:
        """A text name's ranks of a step are one artifact, ``text/<name>/step_N.md``."""
        run_once(made, backend.make(work))
        (text,) = (work / "mlflow-artifacts").rglob("*.md")
        assert text.relative_to(text.parents[3]).as_posix() == "text/val/sample_0/step_00000059.md"
        assert text.read_text().count("### rank ") == 3


class _DyingClient:
    """An MlflowClient whose n-th ``log_batch`` dies before it is sent."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self.inner, self.calls = inner, calls

    def log_batch(self, *args: Any, **kw: Any) -> Any:
        self.calls[0] -= 1
        if self.calls[0] == 0:
            raise Killed("log_batch")
        return self.inner.log_batch(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DiesMidWrite(MlflowTarget):
    """Dies between the requests of one write (some of a step's metrics stored, not its marker)."""

    def __init__(self, uri: str, calls: list[int], *, per_rank: bool) -> None:
        super().__init__(uri, per_rank=per_rank)
        self.calls = calls

    def open(self, run: RunInfo) -> int | None:
        last = super().open(run)
        self._client = _DyingClient(self._client, self.calls)
        return last


class TestTornWrites:
    """A write is several requests; dying between any two loses nothing and doubles nothing."""

    #: (per_rank, n) where the n-th request falls inside the main run's metrics of a write,
    #: before the tag that names its steps, with requests of 4 metrics (main: 9 metric
    #: requests and the tag a write; per rank: 18 child requests first)
    TORN = frozenset({(False, 3), (False, 4), (False, 6), (False, 9), (False, 21), (False, 24),
                      (True, 21), (True, 24)})  # fmt: skip

    @pytest.mark.parametrize("per_rank", [False, True], ids=["main", "per-rank"])
    @pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 9, 21, 24])
    def test_killed_between_requests(
        self,
        template_db: Path,
        made: Path,
        work: Path,
        n: int,
        per_rank: bool,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Killed before the n-th request of a write, then restarted: each step exactly once.

        Requests hold 4 metrics here (1,000 in use), so that one write is many requests and
        a step's metrics are split across them, as a large write's are.
        """
        import ranklog.shippers._engine as engine
        import ranklog.shippers.targets.mlflow as target_module

        monkeypatch.setattr(engine, "BATCH_STEPS", 7)
        monkeypatch.setattr(target_module, "_MAX_METRICS", 4)
        uri = sqlite_uri(work)

        def ship(target: MlflowTarget) -> None:
            Shipper(
                str(made), target, name="torn", dead_after=3600, start_grace=0, per_rank=per_rank
            ).run_forever(once=True)

        with pytest.raises(Killed):
            ship(DiesMidWrite(uri, [n], per_rank=per_rank))
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        marked = held(client, main)
        stored = history(client, main.info.run_id, list(expected(0)))
        for key, points in stored.items():  # a marked step has every metric stored
            assert marked <= set(points), key
        torn = {s for points in stored.values() for s in points} - marked
        assert bool(torn) == ((per_rank, n) in self.TORN), f"stored, not marked: {torn}"
        reopened = make(uri, made, dict()).open(read_run(made))
        assert reopened == StepSet(marked)  # exactly the steps its tags name
        ship(make(uri, made, dict(per_rank=per_rank)))
        back = read_back(uri)
        assert [s for s, _ in back] == list(range(60))
        for s, metrics in back:
            assert metrics["loss"] == pytest.approx((0 + 1 + 2) / 3 + s / 1000)
        if per_rank:
            client = MlflowClient(tracking_uri=uri)
            main = main_run(client)
            query = "tags.\"ranklog.role\" = 'rank'"
            children = client.search_runs([main.info.experiment_id], query)
            assert len(children) == 3
            for child in children:
                r = int(child.data.tags["ranklog.rank"])
                hist = history(client, child.info.run_id, ["loss"])["loss"]
                assert hist == {s: pytest.approx(r + s / 1000) for s in range(60)}


class Amnesiac(MlflowTarget):
    """Forgets what the run holds: every step is sent again."""

    def open(self, run: RunInfo) -> int | None:
        super().open(run)
        return None


def resend_everything(spool: Path, uri: str) -> None:
    """Ship, then ship it all again as exact repeats (no cursor, no marker read)."""
    run_once(spool, make(uri, spool, dict()))
    (spool / "cursors" / "compliance.json").unlink()
    run_once(spool, Amnesiac(uri))


def rich_spool(spool: Path, *, steps: int = 12, world: int = 3) -> None:
    """Metrics with several reduce ops, timers, NaN, texts from one and from several ranks."""
    runs = [rank(spool, r, world) for r in range(world)]
    for run in runs:
        run.log_hyperparams({"lr": 0.001, "model": {"layers": 4, "name": "tiny"}, "flag": True})
    for s in range(steps):
        for run in runs:
            r = run.rank
            run.log_metrics({"loss": r + s / 1000, "acc": 0.5 + r / 10}, step=s, prefix="train")
            run.log_metrics({"gnorm": (r + 1) * (s + 1)}, step=s, reduce=("mean", "max", "min"))
            run.log_metrics({"odd": math.nan if s == 3 else float(s)}, step=s, reduce="last")
            run.log_timing("step_time", 0.01 * (r + 1), step=s)
            if s == 5 and r < 2:
                run.log_text("val/sample_0", f"rank {r} says {s}", step=s)
            if s == 7 and r == 2:
                run.log_text("val/sample_1", "only rank 2", step=s)
            run.step_end(s)
    for run in runs:
        run.close()


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def compare_with_jsonl(client: Any, spool: Path, out: Path) -> Any:
    """Each (key, step) of the JSONL output is in MLflow once, with the same value; no more."""
    shipper = Shipper(str(spool), JsonlTarget(out), name="jsonl", dead_after=3600, start_grace=0)
    shipper.run_forever(once=True)
    got = lines(out)
    run = main_run(client)
    keys = sorted({k for x in got for k in x["metrics"]})
    assert sorted(run.data.metrics) == keys  # the run's own values, nothing else
    hist = history(client, run.info.run_id, keys)
    assert sorted(held(client, run)) == [x["step"] for x in got]
    for x in got:
        for k, v in x["metrics"].items():
            assert same(hist[k][x["step"]], v), (k, x["step"], hist[k][x["step"]], v)
    points = sum(len(h) for h in hist.values())
    assert points == sum(len(x["metrics"]) for x in got)
    return run


def artifact_text(client: Any, run_id: str, path: str, tmp: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(tmp))).read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One ``mlflow server`` on 127.0.0.1 for this module, stopped by pid at the end."""
    with running_server(tmp_path_factory.mktemp("mlflow-server")) as srv:
        yield srv


@pytest.mark.slow
class TestServer:
    """Against a real ``mlflow server --host 127.0.0.1`` with a sqlite store."""

    def test_values_params_tags_texts(
        self, server: MlflowServer, spool: Path, tmp_path: Path
    ) -> None:
        """Each value equals the JSONL target's, once per (key, step); params, tags, texts there."""
        rich_spool(spool)
        opts = dict(experiment="server-test", run_name="rich")
        target = make_target(f"mlflow:{server.uri}", spool, opts)
        Shipper(str(spool), target, name="m", dead_after=3600, start_grace=0).run_forever(once=True)
        client = MlflowClient(tracking_uri=server.uri)
        run = compare_with_jsonl(client, spool, tmp_path / "out.jsonl")
        assert client.get_experiment(run.info.experiment_id).name == "server-test"
        assert run.info.run_name == "rich"
        params = run.data.params
        assert params == {"lr": "0.001", "model.layers": "4", "model.name": "tiny", "flag": "True"}
        tags = run.data.tags
        assert tags["ranklog.run_id"] == read_run(spool).run_id
        assert tags["ranklog.world_size"] == "3"
        assert tags["ranklog.version"]
        texts = [f.path for f in client.list_artifacts(run.info.run_id, "text/val/sample_0")]
        assert "text/val/sample_0/step_00000005.md" in texts
        got = artifact_text(client, run.info.run_id, "text/val/sample_0/step_00000005.md",
                            tmp_path)  # fmt: skip
        assert got == "### rank 0\n\nrank 0 says 5\n\n### rank 1\n\nrank 1 says 5"
        path = "text/val/sample_1/step_00000007.md"
        assert artifact_text(client, run.info.run_id, path, tmp_path) == "only rank 2"

    def test_exact_repeats_are_ignored(self, server: MlflowServer, spool: Path) -> None:
        """The server stores a re-sent step (same key, step, timestamp, value) once, not twice."""
        make_spool(spool)
        resend_everything(spool, server.uri)
        client = MlflowClient(tracking_uri=server.uri)
        exps = [e.experiment_id for e in client.search_experiments()]
        query = f"tags.\"ranklog.run_id\" = '{read_run(spool).run_id}'"
        (run,) = client.search_runs(exps, query)
        hist = history(client, run.info.run_id, ["loss"])
        assert sorted(hist["loss"]) == sorted(held(client, run)) == list(range(60))

    def test_run_finishes_and_runs_again(self, server: MlflowServer, spool: Path) -> None:
        """The run ends FINISHED with its ranks, RUNNING once a requeued rank logs again."""
        client = MlflowClient(tracking_uri=server.uri)
        first = rank(spool, 0, 1)
        log_steps(first, range(5))
        first.close()
        run_once(spool, make(server.uri, spool))
        query = f"tags.\"ranklog.run_id\" = '{read_run(spool).run_id}'"
        (got,) = client.search_runs([e.experiment_id for e in client.search_experiments()], query)
        assert got.info.status == "FINISHED" and got.info.end_time is not None
        again = rank(spool, 0, 1)  # a requeue: the next incarnation
        log_steps(again, range(5, 7))
        run_once(spool, make(server.uri, spool))
        assert client.get_run(got.info.run_id).info.status == "RUNNING"
        again.close()
        run_once(spool, make(server.uri, spool))
        assert client.get_run(got.info.run_id).info.status == "FINISHED"
        assert sorted(history(client, got.info.run_id, ["loss"])["loss"]) == list(range(7))


@pytest.mark.slow
class TestServerKilled:
    """The server dies for ~20 s while producers write and a shipper follows the job."""

    PRODUCER = """
import sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
run.log_hyperparams({"lr": 0.1})
for step in range(int(sys.argv[4])):
    run.log_metrics({"loss": run.rank + step / 1000}, step=step, prefix="train")
    run.log_timing("step_time", 0.01 * (run.rank + 1), step=step)
    run.step_end(step)
    time.sleep(0.05)
run.close()
"""

    def test_nothing_lost_or_doubled(self, spool: Path, tmp_path: Path) -> None:
        """Killed mid-run and restarted on the same port and store: each step once, right value."""
        ranks, steps = 3, 600
        server = MlflowServer(tmp_path / "server")
        procs: list[subprocess.Popen[bytes]] = []
        log = tmp_path / "shipper.log"
        try:
            server.start()
            for r in range(ranks):
                args = [str(spool), str(r), str(ranks), str(steps)]
                procs.append(
                    subprocess.Popen([sys.executable, "-c", self.PRODUCER, *args], env=python_env())
                )
            time.sleep(1.0)
            cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--quiet"]
            cmd += ["--to", f"mlflow:{server.uri}", "--poll", "0.1", "--start-grace", "120"]
            with open(log, "wb") as err:
                shipper = subprocess.Popen(cmd, env=python_env(), stderr=err)
            procs.append(shipper)
            client = MlflowClient(tracking_uri=server.uri)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # shipping has begun
                runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
                if runs and (held_steps(runs[0].data.tags).last or -1) >= 5:
                    break
                time.sleep(0.5)
            else:
                pytest.fail("nothing shipped in 60 s: " + log.read_text())
            server.kill(signal.SIGKILL)
            assert any(p.poll() is None for p in procs[:ranks]), "producers finished too early"
            time.sleep(20)
            assert shipper.poll() is None, log.read_text()
            server.start()
            for p in procs[:ranks]:
                assert p.wait(timeout=180) == 0
            assert shipper.wait(timeout=240) == 0, log.read_text()  # exits once all ranks ended
            text = log.read_text()
            assert "connection refused" in text and "retrying" in text  # it noticed the outage
            compare_with_jsonl(client, spool, tmp_path / "out.jsonl")
            held = read_back(server.uri)
            assert [s for s, _ in held] == list(range(steps))
            for s, metrics in held:
                assert metrics["train/loss"] == pytest.approx((ranks - 1) / 2 + s / 1000)
            assert main_run(client).data.params == {"lr": "0.1"}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            server.stop()


class TestNames:
    """Keys MLflow would refuse are renamed deterministically, and the renaming is recorded."""

    VALID = re.compile(r"^[/\w.\- :]*$")

    def valid(self, key: str) -> bool:
        norm = posixpath.normpath(key)
        return (
            bool(self.VALID.match(key))
            and "\n" not in key
            and len(key) <= 250
            and ".." not in key
            and norm == key
            and not norm.startswith(("/", "."))
        )

    @pytest.mark.parametrize(
        "name",
        ["bad key!/with..dots", "", ".", "..", "/lead", "trail/", "a//b", "./x", "é€", "x\n",
         "a" * 300, "ranklog/ranks_reporting", "ok/name-1 :x.y"],
    )  # fmt: skip
    def test_sanitized_keys_are_valid(self, name: str) -> None:
        """Every name maps to a key MLflow accepts; a valid name stays as it is."""
        key = sanitize_key(name)
        assert self.valid(key), key
        assert sanitize_key(name) == key
        if self.valid(name):
            assert key == name

    def test_distinct_names_stay_distinct(self) -> None:
        """Names that clean up alike (or share a long prefix) still get different keys."""
        names = ["a b!", "a b?", "a b_", "a/b..c", "a/b._c", "x" * 300, "x" * 299 + "y"]
        assert len({sanitize_key(n) for n in names}) == len(names)

    def test_text_paths(self) -> None:
        """One text artifact per name and step, the ranks in it; no file name is too long."""
        texts = [TextItem(0, "val/a", "x"), TextItem(1, "val/a", "y"), TextItem(1, "val/a", "z")]
        texts += [TextItem(2, "b b!", "w"), TextItem(0, "é" * 300, "v")]
        step = ShippedStep(3, {}, 3, 3, True, 1.0, texts=texts)
        paths = [p for p, _ in _text_files(step)]
        assert paths[:2] == [
            "text/val/a/step_00000003.md",
            f"text/{sanitize_key('b b!')}/step_00000003.md",
        ]
        assert _text_files(step)[0][1] == "### rank 0\n\nx\n\n### rank 1\n\ny\n\n### rank 1\n\nz"
        assert all(len(part.encode()) < 255 for p in paths for part in p.split("/"))
        assert len(set(paths)) == len(paths)

    def test_late_artifacts_keep_the_first_ones(self) -> None:
        """A late step's text and table files end in .late<carrier>: the first stay as they are."""
        from ranklog.shippers import TableItem
        from ranklog.shippers.targets.mlflow import _table_files

        texts, tables = [TextItem(0, "val/a", "x")], [TableItem(0, "t", ["c"], [[1]])]
        first = ShippedStep(3, {}, 1, 1, True, 1.0, texts=texts, tables=tables)
        late = ShippedStep(3, {}, 1, 1, True, 1.0, texts=texts, tables=tables, carrier=12)
        assert [p for p, _ in _text_files(first) + _table_files(first)] == [
            "text/val/a/step_00000003.md", "tables/step_00000003/t.json"
        ]  # fmt: skip
        assert [p for p, _ in _text_files(late) + _table_files(late)] == [
            "text/val/a/step_00000003.late00000012.md", "tables/step_00000003/t.late00000012.json"
        ]  # fmt: skip

    def test_bad_key_ships_under_a_valid_key(
        self, template_db: Path, spool: Path, work: Path
    ) -> None:
        """``bad key!/with..dots`` ships under a valid key; the key map records it, and new ones."""
        uri = sqlite_uri(work)
        run = rank(spool, 0, 1)
        run.log_hyperparams({"bad param!": 1})
        for s in range(3):
            run.log_metrics({"bad key!/with..dots": s + 0.5, "fine": 1.0}, step=s)
            run.step_end(s)
        run.flush()
        run_once(spool, make(uri, work, dict()))
        for s in range(3, 5):
            run.log_metrics({"bad key!/with..dots": s + 0.5, "new one?": 2.0}, step=s)
            run.step_end(s)
        run.close()
        run_once(spool, make(uri, work, dict()))
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        key, new = sanitize_key("bad key!/with..dots"), sanitize_key("new one?")
        assert self.valid(key) and key.startswith("bad key_/with_.dots_")
        assert sorted(main.data.metrics) == sorted([key, new, "fine"])
        hist = history(client, main.info.run_id, [key])
        assert hist[key] == {s: s + 0.5 for s in range(5)}
        assert main.data.params == {sanitize_key("bad param!"): "1"}
        mapping = json.loads(artifact_text(client, main.info.run_id, KEY_MAP, work))
        assert mapping == {
            "bad key!/with..dots": key,
            "new one?": new,
            "bad param!": sanitize_key("bad param!"),
        }

    def test_marker_name_is_reserved(
        self, template_db: Path, spool: Path, work: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A metric called ``ranklog/step`` (an older ranklog let it be logged; this one
        refuses ``ranklog/`` names) is renamed: an older release's marker had that name,
        and its history is still read as steps held."""
        import ranklog.producer._names as names

        monkeypatch.setattr(names, "RESERVED", "\0")  # as an older producer wrote it
        run = rank(spool, 0, 1)
        for s in range(3):
            run.log_metrics({MARKER: 100.0 + s}, step=s)
            run.step_end(s)
        run.close()
        uri = sqlite_uri(work)
        run_once(spool, make(uri, work, dict()))
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        assert MARKER not in main.data.metrics
        (other,) = main.data.metrics
        assert history(client, main.info.run_id, [other])[other] == {0: 100.0, 1: 101.0, 2: 102.0}


class TestParams:
    """MLflow params are immutable: a changed value is reported, never fatal."""

    def test_changed_param_does_not_crash(
        self, template_db: Path, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """lr changes mid-run: the shipper warns, tags the new value and ships every step."""
        uri = sqlite_uri(work)
        run = rank(spool, 0, 1)
        run.log_hyperparams({"lr": 0.1, "bs": 32})
        for s in range(3):
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)
        run.flush()
        run_once(spool, make(uri, work, dict()))
        run.log_hyperparams({"lr": 0.2, "wd": 0.01})
        for s in range(3, 6):
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)
        run.close()
        with caplog.at_level(logging.WARNING, logger="ranklog.ship"):
            run_once(spool, make(uri, work, dict()))
        assert "'lr' changed from '0.1' to '0.2'" in caplog.text
        main = main_run(MlflowClient(tracking_uri=uri))
        assert main.data.params == {"lr": "0.1", "bs": "32", "wd": "0.01"}
        assert main.data.tags["ranklog.param_changed.lr"] == "0.2"
        assert [s for s, _ in read_back(uri)] == list(range(6))

    def test_params_unknown_to_the_target(self, template_db: Path, spool: Path, work: Path) -> None:
        """A param set in the run behind the target's back, with another value, is no error."""
        uri = sqlite_uri(work)
        run = rank(spool, 0, 1)
        run.log_metrics({"loss": 1.0}, step=0)
        run.step_end(0)
        run.flush()
        run_once(spool, make(uri, work, dict()))
        target = make(uri, work, dict())
        target.open(read_run(spool))
        MlflowClient(tracking_uri=uri).log_param(target.run_id, "lr", "9")
        target.write_params({"lr": 0.5, "bs": 8})
        main = main_run(MlflowClient(tracking_uri=uri))
        assert main.data.params == {"lr": "9", "bs": "8"}
        assert main.data.tags["ranklog.param_changed.lr"] == "0.5"


class TestPerRank:
    """``--per-rank``: a child run per rank with the rank's own values."""

    def test_child_runs_hold_each_ranks_values(
        self, template_db: Path, made: Path, work: Path
    ) -> None:
        """Each child run holds its rank's loss once per step; a restart reuses the children."""
        uri = sqlite_uri(work)
        opts = dict(per_rank=True, run_name="pr")

        def ship_once() -> None:
            target = make(uri, made, opts)
            Shipper(
                str(made), target, name="pr", dead_after=3600, start_grace=0, per_rank=True
            ).run_forever(once=True)

        ship_once()
        (made / "cursors" / "pr.json").unlink()
        ship_once()
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        exp = main.info.experiment_id
        query = f"tags.\"ranklog.run_id\" = '{main.data.tags['ranklog.run_id']}'"
        runs = client.search_runs([exp], query)
        children = [r for r in runs if r.info.run_id != main.info.run_id]
        assert sorted(int(c.data.tags["ranklog.rank"]) for c in children) == [0, 1, 2]
        for child in children:
            r = int(child.data.tags["ranklog.rank"])
            assert child.data.tags["mlflow.parentRunId"] == main.info.run_id
            assert child.info.run_name == f"pr-rank{r}"
            hist = history(client, child.info.run_id, ["loss"])["loss"]
            assert hist == {s: pytest.approx(r + s / 1000) for s in range(60)}
        assert [s for s, _ in read_back(uri)] == list(range(60))


class TestWiring:
    """How the target is built, where it stores, and how it fails."""

    def test_default_store_is_in_the_spool(self, template_db: Path, spool: Path) -> None:
        """``mlflow:`` alone ships to sqlite in the spool, texts beside it; names from options."""
        rich_spool(spool)
        shutil.copyfile(template_db, spool / "mlflow.db")
        opts = dict(experiment="exp-x", run_name="run-y")
        target = make_target("mlflow:", spool, opts)
        assert target.spec == "mlflow:"
        run_once(spool, target)
        uri = f"sqlite:///{(spool / 'mlflow.db').resolve()}"
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        assert client.get_experiment(main.info.experiment_id).name == "exp-x"
        assert main.info.run_name == "run-y"
        assert [s for s, _ in read_back(uri)] == list(range(12))
        texts = sorted(p.relative_to(p.parents[3]).as_posix()
                       for p in (spool / "mlflow-artifacts").rglob("*.md"))  # fmt: skip
        assert texts == ["text/val/sample_0/step_00000005.md", "text/val/sample_1/step_00000007.md"]

    def test_down_server_is_transient_and_quick(self, spool: Path) -> None:
        """Nothing listening: open() raises TransientTargetError within seconds."""
        make_spool(spool)
        target = make(f"http://127.0.0.1:{free_port()}", spool, dict())
        t0 = time.monotonic()
        with pytest.raises(TransientTargetError):
            target.open(read_run(spool))
        assert time.monotonic() - t0 < 15

    @pytest.mark.parametrize(
        ("status", "code", "transient"),
        [(503, "TEMPORARILY_UNAVAILABLE", True), (500, "INTERNAL_ERROR", True),
         (429, "REQUEST_LIMIT_EXCEEDED", True), (403, "PERMISSION_DENIED", False)],
    )  # fmt: skip
    def test_error_answers(self, spool: Path, status: int, code: str, transient: bool) -> None:
        """5xx and 429 raise TransientTargetError (the engine retries); 403 stops with a message."""
        make_spool(spool)
        body = json.dumps({"error_code": code, "message": "no"}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            target = make(f"http://127.0.0.1:{httpd.server_port}", spool, dict())
            t0 = time.monotonic()
            with pytest.raises(TransientTargetError if transient else RanklogError):
                target.open(read_run(spool))
            assert time.monotonic() - t0 < 15
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join()

    def test_missing_extra(self, monkeypatch: pytest.MonkeyPatch, spool: Path) -> None:
        """Without mlflow installed the error names ``pip install 'ranklog[mlflow]'``."""
        monkeypatch.setitem(sys.modules, "mlflow", None)
        with pytest.raises(ExtraMissingError, match=r"ranklog\[mlflow\]"):
            make("", spool, dict())

    def test_import_ranklog_does_not_import_mlflow(self) -> None:
        """``import ranklog`` and the shippers package leave mlflow unimported."""
        code = "import sys, ranklog, ranklog.shippers; print('mlflow' in sys.modules)"
        assert run_python(code).stdout.strip() == "False"

    def test_exact_repeats_on_sqlite(self, template_db: Path, made: Path, work: Path) -> None:
        """The sqlite store keeps one point when a step is re-sent with the same timestamp."""
        uri = sqlite_uri(work)
        resend_everything(made, uri)
        held = read_back(uri)
        assert [s for s, _ in held] == list(range(60))


class TestMedia:
    def test_tables_are_log_table_artifacts(self, tmp_path: Path) -> None:
        """Each table is ``tables/step_N/<name>.json`` in log_table's JSON (NaN as null)."""
        from mlflow.tracking import MlflowClient

        from ranklog.shippers import Shipper

        from .test_tables import COLUMNS, table_spool

        spool = tmp_path / "spool"
        table_spool(spool)
        uri = f"sqlite:///{tmp_path / 'm.db'}"
        target = build_target("mlflow", uri, spool, dict())
        for _ in range(2):  # shipped again from scratch: the same files, no appended rows
            Shipper(str(spool), target, name="m").run_forever(once=True)
            (spool / "cursors" / "m.json").unlink()
            target = Amnesiac(uri)
        client = MlflowClient(tracking_uri=uri)
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        run_id = found.info.run_id
        paths = [a.path for a in client.list_artifacts(run_id, "tables/step_00000001/val/results")]
        assert paths == [f"tables/step_00000001/val/results/rank0000{r}.json" for r in range(2)]
        got = json.loads(artifact_text(client, run_id, paths[1], tmp_path))
        rows = [["rank 1 | q", 1.5, True], ["two\nlines", None, False]]
        assert got == {"columns": COLUMNS, "data": rows}
        only = artifact_text(client, run_id, "tables/step_00000002/val/only.json", tmp_path)
        assert json.loads(only) == {"columns": ["n"], "data": [[7], [None]]}

    def test_histogram_summary_and_image_artifacts(self, tmp_path: Path) -> None:
        """A histogram becomes name/count, /min, /max, /mean, /std; each image an artifact."""
        from mlflow.tracking import MlflowClient

        from ranklog.shippers import Shipper

        from .shiphelp import rank

        spool = tmp_path / "spool"
        runs = [rank(spool, r, 2) for r in range(2)]
        for r, run in enumerate(runs):
            run.log_histogram("grad", [float(r), r + 2.0], step=0)
            run.log_image("plot", b"\\x89PNG-rank%d" % r, step=0)
            run.step_end(0)
            run.close()
        uri = f"sqlite:///{tmp_path / 'm.db'}"
        target = build_target("mlflow", uri, spool, dict())
        Shipper(str(spool), target, name="m").run_forever(once=True)
        client = MlflowClient(tracking_uri=uri)
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        data = found.data.metrics
        assert data["grad/count"] == 4 and data["grad/max"] == 3.0 and data["grad/mean"] == 1.5
        arts = [
            a.path for a in client.list_artifacts(found.info.run_id, "images/step_00000000/plot")
        ]
        assert sorted(arts) == [
            "images/step_00000000/plot/rank00000.png",
            "images/step_00000000/plot/rank00001.png",
        ]


class TestWhatTheUIShows:
    """MLflow's UI shows the run's own values, among training runs, and readable samples."""

    def test_no_bookkeeping_metric(self, template_db: Path, made: Path, work: Path) -> None:
        """The run's metrics are the run's values only; the steps it holds are a tag."""
        run_once(made, make(sqlite_uri(work), work, dict()))
        run = main_run(MlflowClient(tracking_uri=sqlite_uri(work)))
        assert sorted(run.data.metrics) == sorted(expected(0))
        assert run.data.tags[STEPS_TAG] == "0-59"

    def test_the_run_lasts_from_its_start_to_its_last_step(
        self, template_db: Path, made: Path, work: Path
    ) -> None:
        """The run starts when the ranklog run was created and ends at its last step: the UI's
        duration is the job's (not negative: the shipper made the run after the steps)."""
        run_once(made, make(sqlite_uri(work), work, dict()))
        run = main_run(MlflowClient(tracking_uri=sqlite_uri(work)))
        assert run.info.status == "FINISHED"
        assert run.info.start_time == int(read_run(made).created * 1000)
        assert run.info.end_time >= run.info.start_time

    def test_experiment_shows_as_model_training(
        self, template_db: Path, made: Path, work: Path
    ) -> None:
        """A new experiment is tagged as MLflow 3's UI tells training from GenAI; a kind the
        user set is kept."""
        uri = sqlite_uri(work)
        client = MlflowClient(tracking_uri=uri)
        client.create_experiment("theirs", artifact_location=(work / "theirs").as_uri(),
                                 tags={"mlflow.experimentKind": "genai_development"})  # fmt: skip
        run_once(made, make(uri, work, dict()))
        theirs = make(uri, work, dict(experiment="theirs"))
        Shipper(str(made), theirs, name="theirs").run_forever(once=True)
        kinds = {e.name: e.tags.get("mlflow.experimentKind") for e in client.search_experiments()}
        assert kinds[read_run(made).name] == "custom_model_development"
        assert kinds["theirs"] == "genai_development"

    @pytest.mark.parametrize(
        "steps",
        [[], [0], list(range(100)), [*range(10, 510, 10)], [0, 1, 5, 9, 10, 11, 30, 33, 36, 39],
         [3, 7], [2**63 - 1], [*range(5), *range(100, 2000, 7), 5000]],
        ids=["none", "one", "range", "every-10th", "mixed", "two", "largest", "long"],
    )  # fmt: skip
    def test_steps_text_round_trip(self, steps: list[int]) -> None:
        """Held steps as tag text come back the same, however they are spread."""
        from ranklog.shippers.targets._mlflow_rows import chunk_text, decode_steps, encode_steps

        text = encode_steps(StepSet(steps).ranges())
        assert StepSet.of_ranges(decode_steps(text)) == StepSet(steps)
        if steps == [*range(10, 510, 10)]:
            assert text == "10-500/10"
        for size in (12, 40, 7900):
            chunks = chunk_text(text, size)
            assert ",".join(chunks) == text
            assert all(len(c) <= size for c in chunks if "," in c)

    @pytest.mark.filterwarnings("ignore:ranklog. rank 0 logged")  # steps 0, 1, 4, 9, ...
    def test_a_long_list_of_steps_spans_tags(
        self, template_db: Path, spool: Path, work: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Steps too many for one tag go on in ``ranklog.steps.1``...; a restart reads them all
        and sends nothing twice."""
        import ranklog.shippers.targets.mlflow as target_module

        monkeypatch.setattr(target_module, "_STEPS_CHUNK", 24)
        steps = [s * s for s in range(40)]  # no stride: one text part per step
        run = rank(spool, 0, 1)
        for s in steps:
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)
        run.flush()
        uri = sqlite_uri(work)
        run_once(spool, make(uri, work, dict()))
        for s in range(1601, 1610):
            run.log_metrics({"loss": float(s)}, step=s)
            run.step_end(s)
        run.close()
        assert make(uri, work, dict()).open(read_run(spool)) == StepSet(steps)
        run_once(spool, make(uri, work, dict()))
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        assert len([k for k in main.data.tags if k.startswith(STEPS_TAG)]) > 3
        assert held(client, main) == {*steps, *range(1601, 1610)}
        assert sorted(history(client, main.info.run_id, ["loss"])["loss"]) == sorted(
            held(client, main)
        )

    def test_a_run_an_earlier_release_wrote(
        self, template_db: Path, spool: Path, work: Path
    ) -> None:
        """A run holding its steps as the ``ranklog/step`` marker history (an earlier release):
        those steps are held, the next ones are written once."""
        from mlflow.entities import Metric

        run = rank(spool, 0, 1)
        log_steps(run, range(10), close=False)
        run.flush()
        uri = sqlite_uri(work)
        run_once(spool, make(uri, work, dict()))
        client = MlflowClient(tracking_uri=uri)
        main = main_run(client)
        shipped = held(client, main)
        assert len(shipped) >= 9
        client.delete_tag(main.info.run_id, STEPS_TAG)  # as the earlier release left it:
        marks = [Metric(MARKER, float(s), 0, s) for s in shipped]  # the marker, no tag
        client.log_batch(main.info.run_id, metrics=marks, synchronous=True)
        assert make(uri, work, dict()).open(read_run(spool)) == StepSet(shipped)
        log_steps(run, range(10, 20))
        run_once(spool, make(uri, work, dict()))
        hist = history(client, main.info.run_id, ["loss"])
        assert sorted(hist["loss"]) == list(range(20))
        assert client.get_run(main.info.run_id).data.tags[STEPS_TAG] == "0-19"

    def test_the_shipper_says_where_to_look(self, template_db: Path, made: Path) -> None:
        """``ranklog ship`` says once where the run is in MLflow's UI: the command that serves
        a sqlite store and the link to the run in the training view."""
        from .test_everyday import ranklog_cmd

        res = ranklog_cmd("ship", str(made), "--to", "mlflow:", "--once")
        assert res.returncode == 0, res.stderr
        (line,) = [x for x in res.stderr.splitlines() if "see it with" in x]
        run = main_run(MlflowClient(tracking_uri=f"sqlite:///{(made / 'mlflow.db').resolve()}"))
        assert f"`mlflow ui --backend-store-uri sqlite:///{(made / 'mlflow.db').resolve()}`" in line
        page = f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        assert f"http://127.0.0.1:5000/{page}?workflowType=machine_learning" in line
