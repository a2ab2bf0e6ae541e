"""The ``ranklog`` command: what each subcommand prints, writes, and how it fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ranklog
from ranklog.cli import main
from ranklog.spool import read_segment
from ranklog.testing import crash

from .conftest import python_env
from .spoolgen import write_segment


def _job(spool: Path) -> None:
    for rank in range(2):
        with ranklog.init(spool, rank=rank, world_size=3, handle_signals=False) as run:
            for step in range(5):
                run.log_metrics({"loss": 1.0}, step=step)
                run.step_end(step)
            run.step_end(2)  # a late step_end, reported as late
    # rank 2 never closes: killed mid-run
    run = ranklog.init(spool, rank=2, world_size=3, handle_signals=False)
    run.log_metrics({"loss": 1.0}, step=0)
    run.step_end(0)
    crash(run)  # as if SIGKILLed


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``ranklog ARGS`` in its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ranklog.cli", *args],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _small_spool(spool: Path, steps: int = 4) -> None:
    with ranklog.init(spool, rank=0, world_size=1, handle_signals=False) as run:
        run.log_hyperparams({"lr": 0.5})
        for step in range(steps):
            run.log_metrics({"loss": float(step)}, step=step)
            run.log_text("val/sample_0", f"answer {step}", step=step)
            run.step_end(step)


class TestInspect:
    def test_json(self, spool: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """--json lists every incarnation with steps, end status and damage."""
        with pytest.warns(ranklog.RanklogWarning):
            _job(spool)
        assert main(["inspect", str(spool), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        incs = {i["rank"]: i for i in out["incarnations"]}
        assert out["world_size"] == 3 and sorted(incs) == [0, 1, 2]
        assert incs[0]["first_step"] == 0 and incs[0]["last_step"] == 4
        assert incs[0]["end_status"] == "ok" and incs[0]["state"] == "ended (ok)"
        assert incs[0]["late_events"] == 1 and incs[1]["late_events"] == 1
        assert incs[2]["end_status"] is None and incs[2]["state"] == "open"
        assert incs[2]["last_step"] == 0 and incs[2]["closed_step"] == 0
        assert out["bad"] == []

    def test_table_reports_damage_with_path_and_offset(
        self, spool: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The table names each damaged file and offset."""
        write_segment(spool, 5)
        seg = next((spool / "ranks" / "00000").iterdir())
        frame = next(f for f in read_segment(seg).frames if f.offset <= 200 < f.end)
        data = bytearray(seg.read_bytes())
        data[200] ^= 0xFF
        seg.write_bytes(bytes(data))
        assert main(["inspect", str(spool)]) == 0
        out = capsys.readouterr().out
        assert "damage  1 bad ranges" in out
        assert f"{seg}: {frame.end - frame.offset} bytes skipped at offset {frame.offset}" in out


class TestShip:
    def test_ship_once_then_inspect_shows_the_cursor(
        self, spool: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`ranklog ship --once` drains what is ready; inspect shows last step and exact lag."""
        a = ranklog.init(spool, rank=0, world_size=2, handle_signals=False)
        b = ranklog.init(spool, rank=1, world_size=2, handle_signals=False)
        for step in range(6):
            a.log_metrics({"loss": 1.0}, step=step)
            a.step_end(step)
        for step in range(3):
            b.log_metrics({"loss": 3.0}, step=step)
            b.step_end(step)
        out = tmp_path / "o.jsonl"
        assert main(["ship", str(spool), "--to", f"jsonl:{out}", "--once", "--quiet"]) == 0
        got = [x for x in map(json.loads, out.read_text().splitlines()) if "ranklog" not in x]
        assert got == [
            {"step": s, "metrics": {"loss": 2.0}, "ranks": 2, "world_size": 2, "complete": True}
            for s in range(3)
        ]
        capsys.readouterr()
        assert main(["inspect", str(spool), "--json"]) == 0
        (sh,) = json.loads(capsys.readouterr().out)["shippers"]
        # what is left to ship: rank 0's frames from its step 3 on
        (seg,) = (spool / "ranks" / "00000").iterdir()
        frames = read_segment(seg, writer_gone=False).frames
        first_unshipped = next(
            f.offset for f in frames if any(getattr(e, "step", -1) == 3 for e in f.events)
        )
        assert sh["target"] == f"jsonl:{out}" and sh["last_step"] == 2
        assert sh["lag_steps"] == 3
        assert sh["lag_bytes"] == seg.stat().st_size - first_unshipped
        a.close(), b.close()

    def test_several_targets_one_process_each(self, spool: Path, tmp_path: Path) -> None:
        """Two --to targets ship independently, each with its own cursor."""
        _small_spool(spool)
        a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        argv = ["ship", str(spool), "--to", f"jsonl:{a}", "--to", f"jsonl:{b}", "--once"]
        assert main([*argv, "--quiet"]) == 0
        assert a.read_text() == b.read_text()
        lines = [json.loads(x) for x in a.read_text().splitlines()]
        assert lines[0]["ranklog"]["name"] == spool.parent.name  # whose lines follow
        assert lines[1] == {"params": {"lr": 0.5}}
        assert [x["step"] for x in lines[2:]] == [0, 1, 2, 3]
        assert sorted(p.name for p in (spool / "cursors").glob("*.json")) == sorted(
            f"jsonl-{h}.json" for h in _hashes(a, b)
        )

    def test_target_options_reach_each_process(self, spool: Path, tmp_path: Path) -> None:
        """A target option given once (--samples) is passed on to the target's own process."""
        _small_spool(spool)
        proc = cli("ship", str(spool), "--to", f"jsonl:{tmp_path / 'a.jsonl'}", "--to",
                   "console", "--samples", "0", "--once", "--quiet")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "answer" not in proc.stdout  # no sample box: --samples 0 reached the console
        assert proc.stdout.count("step ") == 4 and "4 more samples" not in proc.stdout
        proc = cli("ship", str(spool), "--to", "console", "--samples", "1", "--once", "--quiet",
                   "--name", "again")  # fmt: skip
        assert proc.stdout.count("│ answer") == 4

    def test_help_lists_every_target_and_option(self) -> None:
        """--help names each target kind with its argument, and the options it declares."""
        proc = cli("ship", "--help")
        assert proc.returncode == 0
        text = " ".join(proc.stdout.split())
        for usage in ("jsonl:PATH", "console[:N]", "tensorboard:DIR", "mlflow[:URI]",
                      "wandb:PROJECT", "trackio:PROJECT", "swanlab:PROJECT"):  # fmt: skip
            assert usage in text
        assert "--experiment EXPERIMENT MLflow experiment (default: the run name) [mlflow]" in text
        assert (
            "--run-name RUN_NAME" in text
            and "[mlflow, swanlab, tensorboard, trackio, wandb]" in text
        )


def _hashes(*paths: Path) -> list[str]:
    from ranklog.shippers import default_name

    return [default_name(f"jsonl:{p}").partition("-")[2] for p in paths]


class TestProcess:
    def test_compact_and_replay_never_import_pandas(self, spool: Path, tmp_path: Path) -> None:
        """Compaction and replay skip pyarrow's pandas import; pandas still works after."""
        _small_spool(spool)
        code = (
            "import sys\n"
            "from ranklog.cli import main\n"
            f"main(['compact', {str(spool)!r}, '--out', {str(tmp_path / 'pq')!r}])\n"
            f"main(['replay', {str(tmp_path / 'pq')!r}, '--to',"
            f" 'jsonl:{tmp_path / 'out.jsonl'}'])\n"
            "print('pandas imported:', 'pandas' in sys.modules)\n"
            "import pyarrow as pa\n"
            "print('to_pandas:', pa.table({'a': [1, 2]}).to_pandas().shape)\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=python_env(), timeout=120, check=False)  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert "pandas imported: False" in p.stdout
        assert "to_pandas: (2, 1)" in p.stdout
        steps = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert "ranklog" in steps[0]  # the run line, then params, then the steps
        assert [x.get("step") for x in steps[1:]] == [None, 0, 1, 2, 3]

    def test_compact_loads_no_backend(self, spool: Path, tmp_path: Path) -> None:
        """``ranklog compact`` runs the engine into the steps table, and loads no backend's
        library (TensorBoard, MLflow, W&B, SwanLab, trackio); ``ship`` and ``replay`` still
        parse every target option."""
        _small_spool(spool)
        backends = ("tensorboard", "mlflow", "wandb", "swanlab", "trackio", "torch")
        code = (
            "import sys\n"
            "from ranklog.cli import main\n"
            f"main(['compact', {str(spool)!r}, '--out', {str(tmp_path / 'pq')!r}])\n"
            f"print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] in {backends!r}))\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=python_env(), timeout=120, check=False)  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert "compacted" in p.stdout and "loaded: []" in p.stdout, p.stdout
        assert "steps table: 4 steps as shipped, up to step 3" in p.stdout
        from ranklog.cli import build_parser

        for argv in (["ship", "S", "--to", "jsonl:x"], ["replay", "D", "--to", "jsonl:x"]):
            args = build_parser(argv[0]).parse_args([*argv, "--run-name", "r"])
            assert args.to == ["jsonl:x"]
        assert build_parser("ship").parse_args(["ship", "S", "--to", "x"]).lease_ttl == 30


class TestErrors:
    """Each subcommand, given a bad path or option: one line on stderr, the tree's exit code."""

    @pytest.mark.parametrize(
        "argv",
        [
            ["ship", "{missing}", "--to", "jsonl:x.jsonl", "--once"],
            ["compact", "{missing}", "--out", "{tmp}/pq"],
            ["replay", "{missing}", "--to", "jsonl:x.jsonl"],
            ["inspect", "{missing}"],
            ["report", "{missing}", "--out", "{tmp}/r.html"],
        ],
        ids=lambda a: a[0],
    )
    def test_missing_path(self, argv: list[str], tmp_path: Path) -> None:
        """A path that does not exist: exit 2 (bad input), naming the path, no traceback."""
        missing = tmp_path / "nope"
        proc = cli(*(a.format(missing=missing, tmp=tmp_path) for a in argv))
        assert proc.returncode == 2
        assert proc.stderr == f"ranklog {argv[0]}: {missing}: no such " + (
            "spool directory\n" if argv[0] in ("ship", "compact", "inspect") else
            "dataset directory\n"
        )  # fmt: skip

    @pytest.mark.parametrize("command", [["replay", "--to", "jsonl:x"], ["report"]])
    def test_a_spool_where_a_dataset_goes_names_the_command(
        self, command: list[str], spool: Path, tmp_path: Path
    ) -> None:
        """replay or report given a spool: exit 4, one line with the ``ranklog compact``
        command that makes the dataset, which runs as printed."""
        _small_spool(spool)
        proc = cli(command[0], str(spool), *command[1:])
        assert proc.returncode == 4 and proc.stderr.count("\n") == 1, proc.stderr
        made = proc.stderr.split("`")[1]
        assert made == f"ranklog compact {spool.resolve()} --out {spool.resolve()}-parquet"
        assert cli(*made.split()[1:]).returncode == 0

    @pytest.mark.parametrize(
        ("argv", "code", "says"),
        [
            (["ship", "{empty}", "--to", "jsonl:x", "--once"], 3, "is not a spool (no run.json)"),
            (["compact", "{empty}", "--out", "{tmp}/pq"], 3, "is not a spool (no run.json)"),
            (["replay", "{empty}", "--to", "jsonl:x"], 4, "is not a compacted ranklog dataset"),
            (["report", "{empty}"], 4, "is not a compacted ranklog dataset"),
            (["inspect", "{empty}"], 3, "is not a spool (no run.json)"),
        ],
        ids=lambda a: a[0] if isinstance(a, list) else None,
    )
    def test_wrong_kind_of_directory(
        self, argv: list[str], code: int, says: str, tmp_path: Path
    ) -> None:
        """A directory that is not a spool (exit 3) or not a dataset (exit 4): one line."""
        empty = tmp_path / "empty"
        empty.mkdir()
        proc = cli(*(a.format(empty=empty, tmp=tmp_path) for a in argv))
        assert proc.returncode == code, proc.stderr
        assert proc.stderr.startswith(f"ranklog {argv[0]}: {empty}") and says in proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr

    @pytest.mark.parametrize(
        ("extra", "says"),
        [
            (["--to", "carrier-pigeon:x"], "unknown target 'carrier-pigeon:x': expected one of"),
            (["--to", "jsonl:"], "jsonl target needs PATH: jsonl:PATH"),
            (["--to", "console:often"], "console:often: expected console or console:N"),
            (["--to", "wandb:"], "wandb target needs PROJECT: wandb:PROJECT"),
        ],
    )
    def test_bad_target(self, spool: Path, extra: list[str], says: str) -> None:
        """A bad --to spec: exit 2 and what is wrong with it (ship and replay alike)."""
        _small_spool(spool)
        proc = cli("ship", str(spool), *extra, "--once", "--quiet")
        assert proc.returncode == 2 and proc.stderr.startswith("ranklog ship: "), proc.stderr
        assert says in proc.stderr and "Traceback" not in proc.stderr

    @pytest.mark.parametrize(
        "argv",
        [
            ["ship", "{spool}", "--to", "wandb:p", "--mode", "shared"],
            ["ship", "{spool}", "--to", "console", "--samples", "many"],
            ["replay", "{spool}", "--to", "jsonl:x", "--steps", "ten"],
            ["compact", "{spool}"],
            ["inspect"],
        ],
        ids=["mode", "samples", "steps", "no-out", "no-spool"],
    )
    def test_bad_option(self, argv: list[str], spool: Path) -> None:
        """A bad or missing option: argparse's usage error (exit 2), the option named."""
        _small_spool(spool)
        proc = cli(*(a.format(spool=spool) for a in argv))
        if argv[0] == "compact":  # (--out is optional with --steps: said in one line)
            assert proc.returncode == 2 and "compact needs --out DIR" in proc.stderr
        else:
            assert proc.returncode == 2 and "usage: ranklog" in proc.stderr
        assert "Traceback" not in proc.stderr
        named = {"mode": "--mode", "samples": "--samples", "steps": "--steps"}
        for word in named.values():
            if word in argv:
                assert word in proc.stderr.splitlines()[-1]


class TestDemo:
    def test_small_demo(self, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
        """The demo runs its ranks to completion, ships, compacts, replays, reports."""
        assert main(["demo", "--out", str(tmp_path), "--ranks", "2", "--steps", "50"]) == 0
        out = capfd.readouterr().out
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert lines.pop(0)["ranklog"]["name"] == "ranklog-demo"  # one name, every backend
        assert "params" in lines[0] and lines[0]["params"]["wandb.api_key"] == "<redacted>"
        steps = [x for x in lines[1:] if "step" in x]
        assert [s["step"] for s in steps] == list(range(50))
        # every kind ranklog ships: a distribution, an image, a table, a text sample
        assert "train/grad_values" in steps[9]["histograms"]
        assert steps[49]["images"][0]["name"] == "val/loss_so_far"
        assert steps[49]["tables"][0]["name"] == "val/results" and steps[49]["texts"]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("ranklog-demo").experiment_id])
        assert run.info.run_name == "ranklog-demo"
        assert "<title>ranklog-demo - ranklog</title>" in (tmp_path / "report.html").read_text()
        assert all(s["complete"] and s["ranks"] == 2 for s in steps)
        assert {"train/loss", "train/tokens/sum", "timing/step_time"} <= set(steps[-1]["metrics"])
        assert steps[-1]["metrics"]["train/tokens/sum"] == 2 * 4096.0
        html = (tmp_path / "report.html").read_text()
        assert "<h2>Metrics" in html and "<h2>Step time" in html
        assert html.count("data:image/png;base64,") >= 2  # metric bands, step-time heatmap
        assert (tmp_path / "parquet" / "_manifest.json").is_file()
        assert any((tmp_path / "replayed-tensorboard").glob("events.out.tfevents.*"))
        for opener in ("tensorboard --logdir", "mlflow ui --backend-store-uri", "wandb sync"):
            assert opener in out
        # each printed command runs as printed, from any shell: the venv's own executables
        bin_dir = str(Path(sys.executable).parent)
        for tool in ("tensorboard", "mlflow", "ranklog"):
            assert f"{bin_dir}/{tool} " in out, tool
        inspect = next(x for x in out.splitlines() if "inspect" in x).split("(")[1].rstrip(")")
        assert subprocess.run(inspect.split(), capture_output=True, timeout=120).returncode == 0

    def test_the_run_exists_before_the_shipper_starts(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The shipper is launched into a spool that already has its run.json (it refuses a
        directory that is not a spool: on a slow machine the ranks could lose the race)."""
        import ranklog._demo as demo

        seen: list[bool] = []
        real = subprocess.Popen

        def launch(cmd: list[str], *args: object, **kw: object) -> object:
            if "ship" in cmd:
                seen.append((tmp_path / "spool" / "run.json").is_file())
            return real(cmd, *args, **kw)  # type: ignore[call-overload]

        monkeypatch.setattr(demo.subprocess, "Popen", launch)
        assert demo.run_demo(tmp_path / "spool", ranks=1, steps=3) == 0
        assert seen == [True]


class TestReplayWritesWhereTold:
    """Replay never writes into the dataset unless told to: a target's default place (an
    MLflow store, W&B files) is the current directory, said in one line; the hint of a
    target with no argument names it as typed (``mlflow``, not ``mlflow:``)."""

    def test_mlflow_default_store_is_the_current_directory(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """``replay DS --to mlflow`` from elsewhere: DS unchanged, ./mlflow.db written."""
        _small_spool(spool)
        ds, here = tmp_path / "ds", tmp_path / "here"
        here.mkdir()
        assert main(["compact", str(spool), "--out", str(ds)]) == 0
        before = sorted(p.relative_to(ds) for p in ds.rglob("*"))
        proc = subprocess.run(
            [sys.executable, "-m", "ranklog.cli", "replay", str(ds), "--to", "mlflow"],
            cwd=here, env=python_env(), capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.relative_to(ds) for p in ds.rglob("*")) == before
        assert (here / "mlflow.db").is_file()
        assert f"into mlflow:sqlite:///{here / 'mlflow.db'}" in proc.stdout
        assert "mlflow::" not in proc.stderr + proc.stdout


class TestOptionsThatApply:
    """An option no given target takes is refused in one line (exit 2), never ignored;
    every option's help gives its default."""

    def test_an_option_of_another_target_is_refused(self, spool: Path, tmp_path: Path) -> None:
        """``--histogram-stats`` (MLflow's) with a JSONL target: exit 2 naming both."""
        _small_spool(spool)
        proc = cli("ship", str(spool), "--once", "--to", f"jsonl:{tmp_path / 'o.jsonl'}",
                   "--histogram-stats", "mean")  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "--histogram-stats is an option of mlflow" in proc.stderr and "jsonl" in proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "o.jsonl").exists()
        ok = cli("ship", str(spool), "--once", "--quiet", "--to", f"jsonl:{tmp_path / 'o.jsonl'}",
                 "--leave-out", "texts")  # fmt: skip
        assert ok.returncode == 0, ok.stderr

    @pytest.mark.parametrize("command", ["ship", "replay", "compact", "report", "demo"])
    def test_every_option_says_its_default(self, command: str) -> None:
        """Each option that takes a value names its default (or that it is required)."""
        import argparse

        from ranklog.cli import build_parser

        parser = build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        lacking = [
            a.option_strings[0]
            for a in sub.choices[command]._actions
            if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._StoreTrueAction | argparse._HelpAction)
            and "default" not in (a.help or "") and "required" not in (a.help or "")
        ]  # fmt: skip
        assert lacking == []
