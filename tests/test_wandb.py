"""The W&B target, offline: the ``.wandb`` reader, exactly-once, values, per-rank runs."""

from __future__ import annotations

import json
import math
import random
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")

from ranklog.errors import ConfigError
from ranklog.shippers import ShippedStep, Shipper, make_target
from ranklog.shippers.targets import wandb as wandb_target
from ranklog.shippers.targets._wandb_log import (
    BLOCK,
    HEADER,
    LogReader,
    history_row,
    history_rows,
    iter_records,
    read_payloads,
)
from ranklog.shippers.targets.wandb import GPU_STEP, WandbTarget, scan_offline, wandb_run_id
from ranklog.spool import read_run

from . import test_compliance as tc
from .compliance import (
    Backend,
    Killed,
    KillSwitch,
    check,
    check_late,
    make_late_spool,
    run_once,
)
from .conftest import run_python
from .shiphelp import lines, log_steps, rank, ship

PROJECT = "ranklog-test"
DROPPED = ("less than the current step", "will be ignored", "Steps must be monotonically")


def _offline_env(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    """W&B offline and quiet, every file in tmp, no credentials, no reachable server."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_ENTITY", "WANDB_RUN_ID"):
        mp.delenv(var, raising=False)
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):
        mp.setenv(f"WANDB_{var}", str(tmp / f"wandb-{var.lower()}"))
    mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    mp.setenv("NETRC", str(tmp / "no-netrc"))


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_env(monkeypatch, tmp_path)


def _target(work: Path, **kw: Any) -> WandbTarget:
    return WandbTarget(PROJECT, work, mode="offline", **kw)


def _logs(work: Path, *, ranks: bool = False) -> list[Path]:
    """The .wandb files under ``work`` (the main runs', or the per-rank runs'), oldest first."""

    def started(path: Path) -> tuple[int, int]:
        for rec in iter_records(path):
            if rec.WhichOneof("record_type") == "run":
                return rec.run.start_time.seconds, rec.run.start_time.nanos
        return (0, 0)

    paths = [
        p
        for p in (work / "wandb").glob("offline-run-*/run-*.wandb")
        if ("r" in p.name[4:-6]) == ranks  # main ids are hex; rank ids end in r<rank>
    ]
    return sorted(paths, key=started)


def _rows(paths: list[Path]) -> list[dict[str, Any]]:
    return [row for p in paths for row in history_rows(p)]


def _metrics(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items() if not k.startswith(("_", "samples"))}


def _back(work: Path) -> list[tuple[int, dict[str, float]]]:
    return [(row["_step"], _metrics(row)) for row in _rows(_logs(work))]


def _run_records(work: Path, *, ranks: bool) -> list[Any]:
    return [
        rec.run
        for p in _logs(work, ranks=ranks)
        for rec in iter_records(p)
        if rec.WhichOneof("record_type") == "run"
    ]


def _params(work: Path) -> dict[str, Any]:
    """The config of the run the main .wandb files belong to."""
    wid = _logs(work)[-1].stem.removeprefix("run-")
    return scan_offline(work, wid)[1]


WANDB = Backend("wandb-offline", lambda work: _target(work), _back, read_params=_params)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.fixture(scope="module")
def real_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .wandb file written by real wandb: 400 steps, a big config value, then finished."""
    import wandb

    root = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp, root)
        run = wandb.init(
            project=PROJECT, id="readertest", dir=str(root), mode="offline",
            config={"big": "x" * 100_000, "lr": 0.5},
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                    disable_git=True, reinit="create_new"),
        )  # fmt: skip
        for s in range(400):
            run.log({f"k{i}": s + i / 10 for i in range(20)} | {"nan": math.nan}, step=s * 2)
        run.finish()
    (path,) = root.glob("wandb/offline-run-*/run-readertest.wandb")
    return path


class TestReader:
    def test_header_and_checksum(self, real_log: Path) -> None:
        """The file starts with the W&B header; chunk checksums are CRC-32/IEEE of type+data."""
        data = real_log.read_bytes()
        assert data[:7] == HEADER == b":W&B\xe1\xbe\x00"
        crc, length, kind = struct.unpack_from("<IHB", data, 7)
        assert kind in (1, 2)
        assert crc == zlib.crc32(data[14 : 14 + length], zlib.crc32(bytes((kind,))))

    def test_history_rows(self, real_log: Path) -> None:
        """History rows come back with their steps and JSON values, NaN included."""
        rows = list(history_rows(real_log))
        assert [r["_step"] for r in rows] == [s * 2 for s in range(400)]
        for s, row in zip(range(400), rows, strict=True):
            assert all(row[f"k{i}"] == pytest.approx(s + i / 10) for i in range(20))
            assert math.isnan(row["nan"])
        assert real_log.stat().st_size > 4 * BLOCK

    def test_record_over_several_blocks(self, real_log: Path) -> None:
        """A record longer than a block (FIRST, MIDDLE..., LAST chunks) is reassembled."""
        held, config = scan_offline(real_log.parent.parent.parent, "readertest")
        assert held.last == 798
        assert config == {"big": "x" * 100_000, "lr": 0.5}

    def test_truncated_anywhere(self, real_log: Path) -> None:
        """Cut at any offset, the reader never raises and yields a prefix of the records."""
        data = real_log.read_bytes()
        full, end = read_payloads(data)
        assert end == len(data)
        rng = random.Random(7)
        last_block = len(data) - len(data) % BLOCK
        cuts = list(range(last_block, len(data), 7)) + list(range(64))
        cuts += [rng.randrange(len(data)) for _ in range(300)]
        for n in cuts:
            got, resume = read_payloads(data[:n]) if n >= 7 else ([], 7)
            assert got == full[: len(got)], n
            assert resume <= max(n, 7)
            rest, _ = read_payloads(data, resume)  # resuming where it stopped gives the rest
            assert got + rest == full, n

    def test_damage_is_skipped(self, real_log: Path) -> None:
        """A damaged block is skipped up to the next block; later records still come back."""
        data = bytearray(real_log.read_bytes())
        full, _ = read_payloads(bytes(data))
        data[BLOCK + 100] ^= 0xFF
        got, _ = read_payloads(bytes(data))
        assert len(full) - 40 < len(got) < len(full)
        assert all(p in full for p in got)
        assert got[-1] == full[-1]

    def test_follows_a_growing_file(self, real_log: Path, tmp_path: Path) -> None:
        """LogReader reads a file as it grows, resuming mid-block and mid-record."""
        data = real_log.read_bytes()
        grown = tmp_path / "grown.wandb"
        reader = LogReader(grown)
        got: list[Any] = []
        with open(grown, "wb") as f:
            pos = 0
            rng = random.Random(3)
            while pos < len(data):
                step = rng.randrange(1, 9000)
                f.write(data[pos : pos + step])
                f.flush()
                pos += step
                got += reader.read()
        assert [r.SerializeToString() for r in got] == [
            r.SerializeToString() for r in iter_records(real_log)
        ]

    def test_not_a_wandb_file(self, tmp_path: Path) -> None:
        """A file without the W&B header yields nothing."""
        p = tmp_path / "x.wandb"
        p.write_bytes(b"not a log at all" * 100)
        assert list(iter_records(p)) == []
        assert list(iter_records(tmp_path / "missing.wandb")) == []


class TestCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, run against W&B offline."""

    @pytest.fixture
    def backend(self) -> Backend:
        return WANDB

    def test_finish_fallback(self, made: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """If the log never shows the steps in time, flush finishes the run: still exactly once."""
        import ranklog.shippers._engine as engine

        monkeypatch.setattr(engine, "BATCH_STEPS", 25)
        monkeypatch.setattr(WandbTarget, "_visible", lambda self, held, deadline: False)
        run_once(made, WANDB.make(work))
        assert len(_logs(work)) == 3  # steps 0-24, 25-49, 50-59: one run directory each
        check(WANDB, work)

    def test_late_values_are_left_out_once_warned(
        self, spool: Path, work: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``--late ship``: W&B cannot take a step below its current one, so it gets none."""
        import dataclasses

        make_late_spool(spool)
        with caplog.at_level("WARNING", logger="ranklog.ship"):
            run_once(spool, WANDB.make(work), "ship")
        check_late(dataclasses.replace(WANDB, late=False), work)
        warned = [r for r in caplog.records if "W&B cannot log a step below" in r.message]
        assert len(warned) == 1


def _rich_spool(spool: Path) -> None:
    """Two ranks, several metrics and reduce ops, timers, NaN and infinities, text, params."""
    for r in range(2):
        run = rank(spool, r, 2)
        run.log_hyperparams({"lr": 0.001, "model": {"layers": 12, "name": "tiny"}, "flag": True})
        for s in range(12):
            run.log_metrics(
                {"loss": 1 / (s + 1) + r, "acc": 0.5 + r / 10, "gpu.0.util": 40.0 + r},
                step=s, prefix="train", reduce=("mean", "max"),
            )  # fmt: skip
            run.log_metrics({"odd": math.nan if s == 3 else (math.inf if s == 4 else -s)}, step=s)
            run.log_timing("step_time", 0.5 + r + s / 100, step=s)
            if s % 5 == 0:
                run.log_text("val/sample_0", f"rank {r} step {s}: prompt -> answer", step=s)
            run.step_end(s)
        run.close()


def _ship_wandb(spool: Path, target: Any, *, per_rank: bool = False) -> Shipper:
    shipper = Shipper(
        str(spool), target, name="w", dead_after=3600, start_grace=0, per_rank=per_rank
    )
    shipper.run_forever(once=True)
    return shipper


class TestValues:
    def test_same_values_as_jsonl(self, spool: Path, work: Path) -> None:
        """Every step carries exactly the values the JSONL target writes for the same spool."""
        _rich_spool(spool)
        ship(spool, work / "out.jsonl")
        _ship_wandb(spool, _target(work))
        expected = [(x["step"], x["metrics"]) for x in lines(work / "out.jsonl")]
        got = _back(work)
        assert [s for s, _ in got] == [s for s, _ in expected] == list(range(12))
        for (_, want), (_, have) in zip(expected, got, strict=True):
            assert want.keys() == have.keys()
            assert all(_same(want[k], have[k]) for k in want), (want, have)

    def test_config_and_text(self, spool: Path, work: Path) -> None:
        """Params are in the run's config; text is a table of rank, name and text per step."""
        _rich_spool(spool)
        _ship_wandb(spool, _target(work))
        run_id = wandb_run_id(read_run(spool).run_id)
        _, config = scan_offline(work, run_id)
        assert config == {"lr": 0.001, "model.layers": 12, "model.name": "tiny", "flag": True}
        tables = {r["_step"]: r for r in _rows(_logs(work)) if "samples._type" in r}
        assert sorted(tables) == [0, 5, 10]
        path = next(_logs(work)[0].parent.glob("files/" + tables[5]["samples.path"]))
        table = json.loads(path.read_text())
        assert table["columns"] == ["rank", "name", "text"]
        assert sorted(map(tuple, table["data"])) == [
            (0, "val/sample_0", "rank 0 step 5: prompt -> answer"),
            (1, "val/sample_0", "rank 1 step 5: prompt -> answer"),
        ]

    def test_run_identity(self, spool: Path, work: Path) -> None:
        """One run, its id derived from the ranklog run id, named and grouped by the run name."""
        _rich_spool(spool)
        info = read_run(spool)
        _ship_wandb(spool, _target(work, group="sweep-7"))
        (rec,) = _run_records(work, ranks=False)
        assert rec.run_id == wandb_run_id(info.run_id) == info.run_id[:16]
        assert rec.display_name == info.name
        assert rec.run_group == "sweep-7"
        assert rec.project == PROJECT

    def test_restart_adds_no_duplicate_or_warning(self, spool: Path, work: Path) -> None:
        """Killed, restarted, rerun without cursor: no duplicate, and W&B drops no step."""
        _rich_spool(spool)
        proc = run_python(_RESTARTS, str(spool), str(work), timeout=180, WANDB_SILENT="false")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [s for s, _ in _back(work)] == list(range(12))
        ours, control = proc.stderr.split("CONTROL\n")
        ours += "".join(p.read_text(errors="replace") for p in work.glob("wandb/**/*.log"))
        assert not any(d in ours for d in DROPPED), ours[-3000:]
        # the check sees a dropped step: W&B reports it on the (not silenced) stderr
        assert any(d in control for d in DROPPED), control[-3000:]


#: ship (killed at the 2nd flush), restart, rerun without cursor; then a step W&B drops
_RESTARTS = f"""
import sys
from pathlib import Path
import ranklog.shippers._engine as engine
from ranklog.shippers import Shipper
from ranklog.shippers.targets.wandb import WandbTarget
from tests.compliance import KillSwitch, Killed
spool, work = sys.argv[1], sys.argv[2]
def ship(target):
    Shipper(spool, target, name="w", dead_after=3600, start_grace=0).run_forever(once=True)
def target():
    return WandbTarget({PROJECT!r}, work, mode="offline")
engine.BATCH_STEPS = 3
try:
    ship(KillSwitch(target(), "flush", 2))
except Killed:
    pass
ship(target())
Path(spool, "cursors", "w.json").unlink()
ship(target())
print("CONTROL", file=sys.stderr, flush=True)
import wandb
run = wandb.init(project="p", id="control", dir=work + "/control", mode="offline",
                 settings=wandb.Settings(reinit="create_new"))
run.log({{"x": 1.0}}, step=5, commit=True)
run.log({{"x": 2.0}}, step=2, commit=True)
run.finish()
"""


class TestPerRank:
    def test_one_run_per_rank(self, made: Path, work: Path) -> None:
        """With per_rank, each rank has a run in the group, job_type rank, with its own values."""
        info = read_run(made)
        _ship_wandb(made, _target(work, per_rank=True), per_rank=True)
        check(WANDB, work)
        runs = {r.run_id: r for r in _run_records(work, ranks=True)}
        assert sorted(runs) == [wandb_run_id(info.run_id, r) for r in range(3)]
        for r in range(3):
            rec = runs[wandb_run_id(info.run_id, r)]
            assert (rec.run_group, rec.job_type, rec.display_name) == (
                info.name, "rank", f"rank{r:05d}",
            )  # fmt: skip
            (path,) = work.glob(f"wandb/offline-run-*/run-{rec.run_id}.wandb")
            rows = list(history_rows(path))
            assert [x["_step"] for x in rows] == list(range(60))
            assert all(x["loss"] == pytest.approx(r + x["_step"] / 1000) for x in rows)
        (main,) = _run_records(work, ranks=False)
        assert main.run_group == info.name

    def test_restart_keeps_each_rank_once(
        self, made: Path, work: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Killed after a write, then without cursor: every rank's run holds each step once."""
        import ranklog.shippers._engine as engine

        monkeypatch.setattr(engine, "BATCH_STEPS", 7)
        with pytest.raises(Killed):
            _ship_wandb(made, KillSwitch(_target(work, per_rank=True), "write", 3, after=True),
                        per_rank=True)  # fmt: skip
        (made / "cursors" / "w.json").unlink()
        _ship_wandb(made, _target(work, per_rank=True), per_rank=True)
        check(WANDB, work)
        by_run: dict[str, list[int]] = {}
        for p in _logs(work, ranks=True):
            by_run.setdefault(p.name, []).extend(r["_step"] for r in history_rows(p))
        assert len(by_run) == 3
        assert all(steps == list(range(60)) for steps in by_run.values())


class TestDurability:
    def test_flush_survives_sigkill(self, spool: Path, work: Path) -> None:
        """After flush() returns, a SIGKILL of the shipper loses none of the flushed steps."""
        ensure = rank(spool, 0, 1)
        ensure.close()
        code = f"""
import os, signal, sys
from ranklog.shippers import ShippedStep
from ranklog.shippers.targets.wandb import WandbTarget
from ranklog.spool import read_run
t = WandbTarget({PROJECT!r}, sys.argv[2], mode="offline")
t.open(read_run(sys.argv[1]))
t.write([ShippedStep(s, {{"loss": s / 10}}, 1, 1, True, 0.0) for s in range(25)])
t.flush()
t.write([ShippedStep(25, {{"loss": 2.5}}, 1, 1, True, 0.0)])  # never flushed
os.kill(os.getpid(), signal.SIGKILL)
"""
        proc = run_python(code, str(spool), str(work), WANDB_MODE="offline")
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        target = _target(work)
        last = target.open(read_run(spool)).last  # waits for the dead shipper's wandb-core to go
        target.close()
        steps = [s for s, _ in _back(work)]
        assert steps[:25] == list(range(25))
        assert last == steps[-1] in (24, 25)

    def test_open_finishes_a_dead_targets_run(self, spool: Path, work: Path) -> None:
        """A target left unflushed in this process is finished by the next open, then counted."""
        rank(spool, 0, 1).close()
        info = read_run(spool)
        dead = _target(work)
        dead.open(info)
        dead.write([ShippedStep(s, {"loss": 1.0}, 1, 1, True, 0.0) for s in range(5)])
        fresh = _target(work)
        assert fresh.open(info).last == 4
        fresh.write([ShippedStep(s, {"loss": 2.0}, 1, 1, True, 0.0) for s in range(5, 8)])
        fresh.close()
        assert [s for s, _ in _back(work)] == list(range(8))


class TestMake:
    def test_registry_and_options(self, spool: Path, tmp_path: Path) -> None:
        """``wandb:PROJECT`` builds the target with the CLI options; offline without a key."""
        opts = dict(run_name="n", group="g", entity="e")
        t = make_target("wandb:proj", spool, opts, per_rank=True)
        assert isinstance(t, WandbTarget)
        assert (t.spec, t.project, t.root, t.mode) == ("wandb:proj", "proj", spool, "offline")
        assert (t.run_name, t.group, t.entity, t.per_rank) == ("n", "g", "e", True)
        t = make_target("wandb:p", spool, dict(mode="online", dir=str(tmp_path)))
        assert isinstance(t, WandbTarget)
        assert (t.mode, t.root) == ("online", tmp_path)
        with pytest.raises(ConfigError):
            make_target("wandb:", spool)
        with pytest.raises(ConfigError):
            make_target("wandb:p", spool, dict(mode="shared"))

    def test_default_mode(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Online only when WANDB_MODE says so or an API key is in the environment or netrc."""
        monkeypatch.delenv("WANDB_MODE")
        assert wandb_target.default_mode() == "offline"
        netrc = tmp_path / "netrc"
        netrc.write_text("machine example.org login user password " + "k" * 40 + "\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        monkeypatch.setenv("WANDB_BASE_URL", "https://example.org")
        assert wandb_target.default_mode() == "online"
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert wandb_target.default_mode() == "offline"
        monkeypatch.delenv("WANDB_MODE")
        monkeypatch.setenv("NETRC", str(tmp_path / "none"))
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        assert wandb_target.default_mode() == "online"

    def test_import_is_lazy(self) -> None:
        """Importing ranklog, its shippers and the W&B reader does not import wandb."""
        proc = run_python(
            "import sys, ranklog, ranklog.shippers, ranklog.shippers.targets._wandb_log;"
            "print('wandb' in sys.modules)"
        )
        assert proc.stdout.strip() == "False", proc.stderr

    def test_run_ids(self) -> None:
        """W&B ids are short, stable, and distinct per rank."""
        rid = "0123456789abcdef0123456789abcdef"
        assert wandb_run_id(rid) == "0123456789abcdef"
        assert wandb_run_id(rid, 3) == "0123456789abcdefr00003"


class TestMedia:
    def test_tables_are_wandb_tables(self, spool: Path, work: Path) -> None:
        """Each rank's table is a wandb.Table of its own, its cells as logged."""
        from .test_tables import COLUMNS, table_spool

        table_spool(spool)
        _ship_wandb(spool, _target(work))
        rows = {r["_step"]: r for r in _rows(_logs(work))}
        assert rows[1]["val/results/rank00000._type"] == "table-file"
        path = next(_logs(work)[0].parent.glob("files/" + rows[1]["val/results/rank00001.path"]))
        table = json.loads(path.read_text())
        assert table["columns"] == COLUMNS
        assert table["data"] == [["rank 1 | q", 1.5, True], ["two\nlines", None, False]]
        assert rows[2]["val/only._type"] == "table-file"

    def test_histogram_and_images(self, spool: Path, work: Path) -> None:
        """A histogram is a wandb.Histogram; each rank's image is a wandb.Image of its own."""
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(2, 1))
        ax.plot([0, 1])
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        runs = [rank(spool, r, 2) for r in range(2)]
        for r, run in enumerate(runs):
            run.log_histogram("grad", [r + 0.5, r + 1.5], step=0)
            run.log_image("plot", buf.getvalue(), step=0)
            run.step_end(0)
            run.close()
        _ship_wandb(spool, _target(work))
        (row,) = [r for r in _rows(_logs(work)) if r.get("_step") == 0]
        assert row["grad._type"] == "histogram"
        assert row["plot/rank00000._type"] == row["plot/rank00001._type"] == "image-file"


#: (host, index) of the GPUs the GPU spool samples; no sample in step 0
GPUS = (("node7", 0), ("node7", 1), ("node8", 0))
GPU_STEPS = 10


def _gpu_spool(spool: Path, *, steps: int = GPU_STEPS) -> None:
    """Two ranks; rank 0 (the host's sampler) adds one sample per GPU from step 1 on."""
    import time

    from ranklog.schemas import Gpu

    runs = [rank(spool, r, 2) for r in range(2)]
    for s in range(steps):
        for r, run in enumerate(runs):
            run.log_metrics({"loss": s + r}, step=s)
            if r == 0 and s > 0:
                for host, i in GPUS:
                    mem = (s * 37 % 11 + i + 1) * 2**20  # peaks mid-run: max != last
                    run._sink.append(
                        Gpu(time.time(), host, i, 10.0 * s + i, mem, 2**34, 50.0 + s % 4, 200.0)
                    )
            run.step_end(s)
    for run in runs:
        run.close()


class _Seen:
    """Wraps a target and keeps every step written to it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.kind, self.spec = inner, inner.kind, inner.spec
        self.steps: list[ShippedStep] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, steps: list[ShippedStep]) -> None:
        self.inner.write(steps)
        self.steps.extend(steps)


def _kinds(path: Path) -> list[tuple[str, Any]]:
    """(record type, record) of a .wandb file, in file order."""
    return [(r.WhichOneof("record_type"), r) for r in iter_records(path)]


def _summary(path: Path) -> dict[str, Any]:
    """The run summary a .wandb file ends with: every summary update applied in order."""
    out: dict[str, Any] = {}
    for kind, rec in _kinds(path):
        if kind == "summary":
            for u in rec.summary.update:
                out[".".join(u.nested_key) if u.nested_key else u.key] = json.loads(u.value_json)
    return out


def _gpu_row(row: dict[str, Any]) -> bool:
    return any("/gpu." in k or k.startswith("gpu.all.") for k in row)


def _check_definitions(path: Path) -> None:
    """Each definition once, all of them before the file's first GPU row."""
    records = _kinds(path)
    metrics = [r.metric for k, r in records if k == "metric"]
    first_gpu = next(
        i for i, (k, r) in enumerate(records) if k == "history" and _gpu_row(history_row(r))
    )
    assert all(k != "metric" for k, _ in records[first_gpu:])
    by = {m.name or m.glob_name: m for m in metrics}
    assert len(by) == len(metrics), [m.name or m.glob_name for m in metrics]
    step = by.pop(GPU_STEP)
    assert step.options.hidden and not step.step_metric
    globs = {n for n, m in by.items() if m.glob_name}
    assert globs == {"node7/gpu.*", "node8/gpu.*", "gpu.all.*"}
    assert all(m.step_metric == GPU_STEP for m in by.values())
    summaries = {n: [f.name for f, on in m.summary.ListFields() if on] for n, m in by.items()}
    for host, i in GPUS:
        pre = rf"{host}/gpu\.{i}\."
        assert summaries[pre + "gpu"] == ["mean"]
        assert summaries[pre + "memoryAllocatedBytes"] == ["max"]
        assert summaries[pre + "temp"] == ["max"]
        assert summaries[pre + "powerWatts"] == ["mean"]
    assert summaries[r"gpu\.all\.gpu"] == ["mean"]
    assert summaries[r"gpu\.all\.memoryAllocatedBytesMax"] == ["max"]
    assert all(summaries[g] == [] for g in globs)


class TestGpu:
    def test_gpu_rows_have_their_own_step_metric(self, spool: Path, work: Path) -> None:
        """GPU rows carry gpu/runtime; the file defines it, the globs and each key's summary."""
        _gpu_spool(spool)
        info = read_run(spool)
        seen = _Seen(_target(work))
        _ship_wandb(spool, seen)
        (path,) = _logs(work)
        _check_definitions(path)
        rows = list(history_rows(path))
        assert [r["_step"] for r in rows] == list(range(GPU_STEPS))
        assert GPU_STEP not in rows[0] and not _gpu_row(rows[0])  # no GPU sample in step 0
        by_step = {s.step: s for s in seen.steps}
        for row in rows[1:]:
            s = by_step[row["_step"]]
            assert row[GPU_STEP] == pytest.approx(s.ts - info.created, abs=1e-3)
            assert 0 <= row[GPU_STEP] < 600
            assert row["node7/gpu.1.gpu"] == 10.0 * row["_step"] + 1
        assert [r[GPU_STEP] for r in rows[1:]] == sorted(r[GPU_STEP] for r in rows[1:])
        # the summaries W&B computed from the definitions: peak memory, mean utilisation
        summary = _summary(path)
        mems = [r["node7/gpu.1.memoryAllocatedBytes"] for r in rows[1:]]
        assert mems[-1] != max(mems)
        assert summary["node7/gpu.1.memoryAllocatedBytes"] == {"max": max(mems)}
        utils = [r["node8/gpu.0.gpu"] for r in rows[1:]]
        assert summary["node8/gpu.0.gpu"] == {"mean": pytest.approx(sum(utils) / len(utils))}
        assert summary["gpu.all.memoryAllocatedBytesMax"] == {
            "max": max(r["gpu.all.memoryAllocatedBytesMax"] for r in rows[1:])
        }
        assert summary["loss"] == rows[-1]["loss"]  # other metrics keep W&B's default

    def test_definitions_again_after_restart(
        self, spool: Path, work: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A restarted shipper's new run file gets the definitions again: same, each once."""
        import ranklog.shippers._engine as engine

        _gpu_spool(spool)
        monkeypatch.setattr(engine, "BATCH_STEPS", 4)
        with pytest.raises(Killed):
            _ship_wandb(spool, KillSwitch(_target(work), "flush", 2, after=True))
        _ship_wandb(spool, _target(work))
        paths = _logs(work)
        assert len(paths) == 2
        assert [r["_step"] for r in _rows(paths)] == list(range(GPU_STEPS))  # each step once
        for p in paths:
            _check_definitions(p)
        first, second = ([r.metric for k, r in _kinds(p) if k == "metric"] for p in paths)
        assert sorted(m.SerializeToString() for m in first) == sorted(
            m.SerializeToString() for m in second
        )
        rows = list(history_rows(paths[1]))
        assert all(GPU_STEP in r for r in rows)
        mems = [r["node7/gpu.0.memoryAllocatedBytes"] for r in rows]
        assert _summary(paths[1])["node7/gpu.0.memoryAllocatedBytes"] == {"max": max(mems)}

    def test_per_rank_runs_get_no_gpu(self, spool: Path, work: Path) -> None:
        """With per-rank runs, GPU series and their definitions stay in the main run."""
        _gpu_spool(spool, steps=4)
        _ship_wandb(spool, _target(work, per_rank=True), per_rank=True)
        (main,) = _logs(work)
        _check_definitions(main)
        ranks = _logs(work, ranks=True)
        assert len(ranks) == 2
        for p in ranks:
            assert all(k != "metric" for k, _ in _kinds(p))
            rows = list(history_rows(p))
            assert [r["_step"] for r in rows] == list(range(4))
            assert not any(_gpu_row(r) or GPU_STEP in r for r in rows)

    def test_definitions(self) -> None:
        """Names: escaped dots for summaries, one glob per host, none with an inner '*'."""
        from ranklog.shippers._target import GpuStat
        from ranklog.shippers.targets._media import gpu_metrics
        from ranklog.shippers.targets.wandb import MetricDef, gpu_definitions

        stats = [GpuStat("n.1", 0, "", 1, 50.0, 10, 20, None, None), GpuStat("a*", 2, "", 1,
                 1.0, None, None, None, None)]  # fmt: skip
        step = ShippedStep(3, {}, 1, 1, True, 5.0, gpu=stats)
        defs = gpu_definitions(step, gpu_metrics(step, "wandb"))
        assert defs == [
            MetricDef(GPU_STEP, hidden=True),
            MetricDef("gpu.all.*", GPU_STEP),
            MetricDef("n.1/gpu.*", GPU_STEP),
            MetricDef(r"gpu\.all\.gpu", GPU_STEP, "mean"),
            MetricDef(r"gpu\.all\.memoryAllocatedBytesMax", GPU_STEP, "max"),
            MetricDef(r"n\.1/gpu\.0\.gpu", GPU_STEP, "mean"),
            MetricDef(r"n\.1/gpu\.0\.memoryAllocatedBytes", GPU_STEP, "max"),
        ]
        assert defs[0].options() == {"hidden": True}
        assert defs[-1].options() == {"step_metric": GPU_STEP, "summary": "max"}


class TestWhereItIs:
    def test_offline_says_where_and_how_to_upload(
        self, spool: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An offline run says once where its files are and the ``wandb sync`` command; a
        resumed one says its folders are one run."""
        from ranklog.cli import main

        run = rank(spool, 0, 1)
        log_steps(run, range(3))
        args = ["ship", str(spool), "--to", f"wandb:{PROJECT}", "--mode", "offline", "--dir",
                str(tmp_path), "--once", "--quiet"]  # fmt: skip
        wandb_target._SAID.clear()
        assert main(args) == 0
        err = capsys.readouterr().err
        assert f"wandb sync {tmp_path / 'wandb'}/offline-run-*-" in err
        log_steps(run, range(3, 5))
        run.close()
        wandb_target._SAID.clear()  # (a new shipper process says it again)
        assert main(args) == 0
        assert "in 2 folders (W&B starts one per session; they are one run)" in (
            capsys.readouterr().err
        )

    def test_a_folder_not_made_yet_is_counted(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The session's own folder counts even before wandb-core has created it (a fast
        restart said "in 1 folder" for a run split across two)."""
        (tmp_path / "wandb" / "offline-run-20261206_090000-abc").mkdir(parents=True)
        target = _target(tmp_path)
        wandb_target._SAID.discard("abc")
        with caplog.at_level("INFO", logger="ranklog.ship"):
            target._say_where(tmp_path / "wandb" / "offline-run-20261206_090001-abc", "abc")
        (line,) = [r.getMessage() for r in caplog.records if "offline" in r.getMessage()]
        assert "in 2 folders" in line
