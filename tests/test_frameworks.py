"""The framework adapters under the real frameworks, 2 CPU processes (gloo) x 20 steps each.

Lightning's "ddp" launcher, and torchrun for the Hugging Face Trainer and Accelerate, run
the jobs of ``examples/`` (lightning_train.py, hf_train.py, accelerate_train.py);
``ranklog ship --once`` sends the spool to TensorBoard and JSONL, and TensorBoard's own
reader must show, at exactly the expected steps, the cross-rank reduction of what each
rank wrote into the spool. A SIGKILLed rank loses no
step it closed; a Lightning job restarted from its checkpoint continues the same run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ranklog.schemas import Event, Metrics, Params, RankEnd, RankStart, StepEnd, Text, Timer
from ranklog.spool import read_run
from ranklog.testing import events_by_incarnation

from .conftest import ROOT, python_env, run_python
from .test_tensorboard import f32, tb_back
from .test_torchrun import free_port, jsonl_steps, run_cmd, ship

pytestmark = pytest.mark.slow

JOBS = ROOT / "examples"
WORLD = 2
STEPS = 20
EXTRA = "installed by ./tools/test (extra ranklog[{}])"


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip unless ``module`` (and torch, tensorboard) can be imported."""
    found = all(importlib.util.find_spec(m) for m in (module, "torch", "tensorboard"))
    return pytest.mark.skipif(not found, reason=EXTRA.format(extra))


# -- running the jobs ---------------------------------------------------------------------------


def job_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A hermetic environment: no launcher, backend or SLURM variables, a private HOME and
    Hugging Face cache, offline, one thread per process, and no code provenance (whether the
    checkout under test is a git repository must not change what the jobs log)."""
    env = python_env(
        HOME=str(tmp / "home"), HF_HOME=str(tmp / "home" / "hf"), HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1", **extra,
    )  # fmt: skip
    gone = ("MLFLOW_", "SLURM_", "MASTER_", "RANKLOG_", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC")
    env = {k: v for k, v in env.items() if not k.startswith(gone) or k in extra}
    env.setdefault("RANKLOG_CODE", "0")
    return env


def torchrun(tmp: Path, script: str, *args: str, **env: str) -> tuple[int, str]:
    """``torchrun --nproc_per_node 2 examples/SCRIPT ARGS`` on a free loopback port."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(JOBS / script), *args,
    ]  # fmt: skip
    res = run_cmd(cmd, job_env(tmp, **env))
    return res.returncode, res.stdout


def lightning(tmp: Path, *args: str) -> tuple[int, str]:
    """``python examples/lightning_train.py ARGS``: Lightning starts rank 1 itself."""
    res = run_cmd([sys.executable, str(JOBS / "lightning_train.py"), *args], job_env(tmp))
    return res.returncode, res.stdout


def shipped(spool: Path, out: Path) -> dict[str, Any]:
    """``ranklog ship --once`` to JSONL and TensorBoard (with rank sub-runs), read back, and
    the oracle of the spool as it was shipped."""
    jsonl, tb = ship(spool, out)
    return {"spool": spool, "tb": tb, "jsonl": jsonl_steps(jsonl), "rows": tb_back(tb),
            "want": oracle(spool), "closed": steps_closed(spool)}  # fmt: skip


# -- what the ranks wrote, and what must have shipped ---------------------------------------------


def watermarks(by_inc: dict[tuple[int, int], list[Event]]) -> dict[tuple[int, int], int]:
    """The last step each incarnation closed: ``step_end``, or an event of a later step."""
    out = {}
    for key, events in by_inc.items():
        ends = [e.step for e in events if isinstance(e, StepEnd)]
        later = [e.step - 1 for e in events if isinstance(e, Metrics | Timer | Text)]
        out[key] = max(ends + later, default=-1)
    return out


def contributions(events: list[Event]) -> Iterator[tuple[int, str, float, str]]:
    """(step, shipped name, value, reduce op) of every metric and timer value."""
    for e in events:
        if isinstance(e, Metrics):
            for name, value in e.values.items():
                op = e.reduce if isinstance(e.reduce, str) else e.reduce.get(name, "mean")
                yield e.step, name, value, op
        elif isinstance(e, Timer):
            yield e.step, f"timing/{e.name}", e.seconds, e.reduce


def oracle(spool: Path) -> dict[int, dict[str, float]]:
    """Per step every rank closed, each name's reduction over what the ranks logged; per rank
    and step the values of the first incarnation that closed it count."""
    by_inc = events_by_incarnation(spool)
    marks = watermarks(by_inc)
    logged: dict[tuple[int, int], dict[int, list[tuple[str, float, str]]]] = defaultdict(dict)
    for (rank, inc), events in sorted(by_inc.items()):
        for step, name, value, op in contributions(events):
            logged[rank, step].setdefault(inc, []).append((name, value, op))
    ranks = sorted({r for r, _ in by_inc})
    closed = {r: max(m for (rr, _), m in marks.items() if rr == r) for r in ranks}
    values: dict[int, dict[str, list[tuple[int, float, str]]]] = defaultdict(dict)
    for (rank, step), incs in sorted(logged.items()):
        if step > min(closed.values()):
            continue
        closers = [i for i in incs if marks[rank, i] >= step]
        for name, value, op in incs[min(closers) if closers else max(incs)]:
            values[step].setdefault(name, []).append((rank, value, op))
    out: dict[int, dict[str, float]] = {}
    for step, names in sorted(values.items()):
        row = out[step] = {}
        for name, items in names.items():
            vs = [v for _, v, _ in items]
            op = items[0][2]
            row[name] = {"mean": math.fsum(vs) / len(vs), "sum": math.fsum(vs), "max": max(vs),
                         "min": min(vs)}[op]  # fmt: skip
            if name.startswith("timing/"):
                row[f"{name}/slowest_rank"] = float(max(items, key=lambda t: t[1])[0])
    return out


def assert_reduced(job: dict[str, Any], steps: list[int]) -> None:
    """TensorBoard shows ``steps`` exactly (each once), every value the oracle's reduction."""
    want = job["want"]
    assert sorted(want) == steps
    rows = job["rows"]
    assert [s for s, _ in rows] == steps
    for step, values in rows:
        assert values == {name: f32(v) for name, v in want[step].items()}, step
    assert [s["step"] for s in job["jsonl"]] == steps
    assert all(s["complete"] and s["ranks"] == WORLD for s in job["jsonl"])


def steps_closed(spool: Path) -> dict[tuple[int, int], list[int]]:
    """The steps each (rank, incarnation) closed with ``step_end``."""
    return {
        key: [e.step for e in events if isinstance(e, StepEnd)]
        for key, events in events_by_incarnation(spool).items()
    }


def ended(events: list[Event]) -> bool:
    return any(isinstance(e, RankEnd) for e in events)


# -- Lightning ----------------------------------------------------------------------------------

LIGHTNING_CRASH = 12  # rank 1 dies as step 12 begins; the last checkpoint is step 10's


@pytest.fixture(scope="module")
def lit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One Lightning DDP job, 2 ranks x 20 steps, shipped."""
    d = tmp_path_factory.mktemp("lightning")
    rc, out = lightning(d, "--spool", str(d / "spool"), "--root", str(d / "root"))
    assert rc == 0, out
    return shipped(d / "spool", d)


@pytest.fixture(scope="module")
def lit_crash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Lightning job whose rank 1 is SIGKILLed at step 12, shipped; then the same command
    resumed from the last checkpoint, shipped again."""
    d = tmp_path_factory.mktemp("lightning-crash")
    args = ["--spool", str(d / "spool"), "--root", str(d / "root"), "--checkpoint-every", "5"]
    rc, out = lightning(d, *args, "--crash-at", str(LIGHTNING_CRASH), "--crash-rank", "1")
    assert rc != 0 and f"rank 1: crashing at step {LIGHTNING_CRASH}" in out, out
    first = shipped(d / "spool", d)
    rc, out = lightning(d, *args, "--resume")
    assert rc == 0, out
    return {"crashed": first, "resumed": shipped(d / "spool", d), "root": d / "root"}


@needs("lightning", "lightning")
class TestRanklogLogger:
    def test_every_rank_logs_its_own_values(self, lit: dict[str, Any]) -> None:
        """Both ranks wrote their own train/loss and train/rank at steps 0..19 (no sync_dist),
        val/loss at each epoch's last step, Lightning's epoch, and the hyperparameters."""
        by_inc = events_by_incarnation(lit["spool"])
        assert sorted(by_inc) == [(0, 1), (1, 1)]
        for (rank, _), events in by_inc.items():
            start = next(e for e in events if isinstance(e, RankStart))
            assert (start.rank, start.world_size, start.local_rank) == (rank, WORLD, rank)
            params = [e.values for e in events if isinstance(e, Params)]
            assert params == [{"lr": 0.05, "crash_at": -1, "crash_rank": -1}]
            metrics = [e for e in events if isinstance(e, Metrics)]
            assert [m.step for m in metrics if "train/loss" in m.values] == list(range(STEPS))
            assert {m.values["train/rank"] for m in metrics if "train/rank" in m.values} == {rank}
            assert [m.step for m in metrics if "val/loss" in m.values] == [9, 19]
            assert all(m.values["epoch"] == m.step // 10 for m in metrics)
            assert [e.step for e in events if isinstance(e, StepEnd)] == list(range(STEPS))
            assert ended(events)
            # fit ended well: the rank ends ok at exit, as a script's close() does
            assert [e.status for e in events if isinstance(e, RankEnd)] == ["ok"]
        assert read_run(lit["spool"]).name == "lit"

    def test_tensorboard_shows_the_cross_rank_reduction(self, lit: dict[str, Any]) -> None:
        """TensorBoard holds steps 0..19 once each, every value the mean over both ranks."""
        assert_reduced(lit, list(range(STEPS)))
        assert all(row["train/rank"] == 0.5 for _, row in lit["rows"])
        for rank in range(WORLD):
            sub = tb_back(lit["tb"] / f"rank{rank:05d}")
            assert [row["train/rank"] for _, row in sub] == [float(rank)] * STEPS

    def test_sigkill_loses_no_closed_step(self, lit_crash: dict[str, Any]) -> None:
        """Rank 1 SIGKILLed at step 12 had closed 0..10: exactly those steps are in TensorBoard,
        complete; nothing after them is."""
        crashed = lit_crash["crashed"]
        assert crashed["closed"][1, 1] == list(range(LIGHTNING_CRASH - 1))
        assert crashed["closed"][0, 1][: LIGHTNING_CRASH - 1] == list(range(LIGHTNING_CRASH - 1))
        assert_reduced(crashed, list(range(LIGHTNING_CRASH - 1)))

    def test_restart_from_the_checkpoint_continues_the_run(self, lit_crash: dict[str, Any]) -> None:
        """fit(ckpt_path="last") finds the checkpoint under save_dir/name/run_id, each rank
        writes a second incarnation of the same run from step 10, and every step ships once."""
        resumed = lit_crash["resumed"]
        run = read_run(resumed["spool"])
        assert (lit_crash["root"] / "lit" / run.run_id / "checkpoints" / "last.ckpt").is_file()
        by_inc = events_by_incarnation(resumed["spool"])
        assert sorted(by_inc) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        for rank in range(WORLD):
            start = next(e for e in by_inc[rank, 2] if isinstance(e, RankStart))
            assert (start.run_id, start.incarnation) == (run.run_id, 2)
            assert [e.step for e in by_inc[rank, 2] if isinstance(e, StepEnd)] == list(
                range(10, STEPS)
            )
        assert_reduced(resumed, list(range(STEPS)))
        before = lit_crash["crashed"]["want"]
        assert [row for s, row in resumed["rows"] if s in before] == [
            {n: f32(v) for n, v in before[s].items()} for s in sorted(before)
        ]

    def test_identity_and_steps_that_go_back(self, tmp_path: Path) -> None:
        """name/version are the spool's run name and id; a lower step is logged at the current
        one; finalize closes the step, a later log opens the next; the logger pickles."""
        code = (
            "import json, sys\n"
            "from ranklog.lightning import RanklogLogger\n"
            "lg = RanklogLogger(sys.argv[1], name='unit', save_dir='/ck', handle_signals=False)\n"
            "lg.log_metrics({'a': 1.0}, step=0)\n"
            "lg.log_metrics({'b': 2.0}, step=0)\n"
            "lg.log_metrics({'a': 3.0}, step=3)\n"
            "lg.log_metrics({'v': 4.0}, step=1)\n"
            "lg.log_hyperparams({'lr': 0.1, 'api_key': 'k'})\n"
            "lg.finalize('success')\n"
            "lg.log_metrics({'test': 5.0}, step=3)\n"
            "lg.finalize('success')\n"
            "import pickle; again = pickle.loads(pickle.dumps(lg))  # ddp_spawn\n"
            "assert (again.version, again.log_dir) == (lg.version, lg.log_dir)\n"
            "print(json.dumps([lg.name, lg.version, lg.save_dir, lg.root_dir, lg.log_dir,\n"
            "                  type(lg.experiment).__name__]))\n"
        )
        spool = tmp_path / "spool"
        proc = run_python(code, str(spool), timeout=120)
        assert proc.returncode == 0, proc.stderr
        run = read_run(spool)
        got = json.loads(proc.stdout.splitlines()[-1])
        assert got == ["unit", run.run_id, "/ck", "/ck/unit", str(spool), "Run"]
        events = events_by_incarnation(spool)[0, 1]
        assert [(e.step, e.values) for e in events if isinstance(e, Metrics)] == [
            (0, {"a": 1.0}), (0, {"b": 2.0}), (3, {"a": 3.0}), (3, {"v": 4.0}), (4, {"test": 5.0}),
        ]  # fmt: skip
        assert [e.step for e in events if isinstance(e, StepEnd)] == [0, 3, 4]
        assert [e.values for e in events if isinstance(e, Params)] == [
            {"lr": 0.1, "api_key": "<redacted>"}
        ]


# -- Hugging Face Trainer -----------------------------------------------------------------------

HF_CRASH = 12  # process 1 dies as optimizer step 13 begins: it had closed steps 1..11


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One Trainer job under torchrun, 2 processes x 20 steps, the callback from
    ``report_to=["ranklog"]`` (spool from $RANKLOG_SPOOL), shipped."""
    d = tmp_path_factory.mktemp("hf")
    spool = d / "spool"
    rc, out = torchrun(d, "hf_train.py", "--spool", str(spool), "--out", str(d / "out"),
                       "--report-to", RANKLOG_SPOOL=str(spool))  # fmt: skip
    assert rc == 0, out
    return shipped(spool, d)


@pytest.fixture(scope="module")
def hf_crash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Trainer job (``callbacks=[RanklogCallback(spool)]``) whose process 1 is SIGKILLed."""
    d = tmp_path_factory.mktemp("hf-crash")
    rc, out = torchrun(d, "hf_train.py", "--spool", str(d / "spool"), "--out", str(d / "out"),
                       "--crash-at", str(HF_CRASH), "--crash-rank", "1")  # fmt: skip
    assert rc != 0 and f"rank 1: crashing after step {HF_CRASH}" in out, out
    return shipped(d / "spool", d)


@needs("transformers", "hf")
class TestRanklogCallback:
    def test_every_process_logs_at_the_global_step(self, hf: dict[str, Any]) -> None:
        """Through report_to=["ranklog"], both processes wrote the Trainer's logs at
        global_step 1..20 as train/*, eval/* at each epoch's end, and their own step times."""
        by_inc = events_by_incarnation(hf["spool"])
        assert sorted(by_inc) == [(0, 1), (1, 1)]
        for (rank, _), events in by_inc.items():
            start = next(e for e in events if isinstance(e, RankStart))
            assert (start.rank, start.world_size, start.local_rank) == (rank, WORLD, rank)
            metrics = [e for e in events if isinstance(e, Metrics)]
            steps = list(range(1, STEPS + 1))
            assert [m.step for m in metrics if "train/loss" in m.values] == steps
            names = {n for m in metrics for n in m.values}
            assert {"train/grad_norm", "train/learning_rate", "train/epoch"} <= names
            assert [m.step for m in metrics if "eval/loss" in m.values] == [10, 20]
            assert [m.step for m in metrics if "train/train_runtime" in m.values] == [20]
            assert [e.step for e in events if isinstance(e, Timer)] == steps
            assert [e.step for e in events if isinstance(e, StepEnd)] == steps
            # training ended well: the process's rank ends ok at exit
            assert [e.status for e in events if isinstance(e, RankEnd)] == ["ok"]
        assert read_run(hf["spool"]).name == "hf"

    def test_tensorboard_shows_the_cross_rank_reduction(self, hf: dict[str, Any]) -> None:
        """TensorBoard holds global steps 1..20 once each: means, runtimes and step times
        the slowest process's, with which process that was."""
        assert_reduced(hf, list(range(1, STEPS + 1)))
        names = set().union(*(row for _, row in hf["rows"]))
        assert {"train/loss", "eval/loss", "timing/step_time/slowest_rank"} <= names

    def test_training_arguments_are_hyperparameters_without_secrets(
        self, hf: dict[str, Any]
    ) -> None:
        """args.to_sanitized_dict() is shipped as params; the hub token never reaches the spool."""
        params = [e.values for e in events_by_incarnation(hf["spool"])[0, 1]
                  if isinstance(e, Params)]  # fmt: skip
        assert len(params) == 1
        p = params[0]
        assert (p["learning_rate"], p["per_device_train_batch_size"], p["run_name"]) == (
            0.05, 4, "hf"
        )  # fmt: skip
        assert p["hub_token"] == "<redacted>"
        blob = b"".join(f.read_bytes() for f in hf["spool"].rglob("*") if f.is_file())
        assert b"hf_SECRET_TOKEN" not in blob

    def test_sigkill_loses_no_closed_step(self, hf_crash: dict[str, Any]) -> None:
        """Process 1 SIGKILLed after step 12 had closed 1..11: exactly those are in TensorBoard."""
        assert hf_crash["closed"][1, 1] == list(range(1, HF_CRASH))
        assert hf_crash["closed"][0, 1][: HF_CRASH - 1] == list(range(1, HF_CRASH))
        assert_reduced(hf_crash, list(range(1, HF_CRASH)))

    def test_names_and_evaluate_after_training(self, tmp_path: Path) -> None:
        """Keys are named as the stock callbacks name them; an evaluate() after training is
        logged at the next step and closed by on_evaluate."""
        code = (
            "import sys\n"
            "from transformers import TrainerControl, TrainerState, TrainingArguments\n"
            "from ranklog.hf import RanklogCallback, metric_name\n"
            "assert [metric_name(k) for k in ('loss', 'eval_loss', 'test_acc')] == \\\n"
            "    ['train/loss', 'eval/loss', 'test/acc']\n"
            "args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to='none')\n"
            "cb = RanklogCallback(handle_signals=False)\n"
            "st, ctl = TrainerState(), TrainerControl()\n"
            "cb.on_train_begin(args, st, ctl)\n"
            "st.global_step = 5\n"
            "cb.on_log(args, st, ctl, logs={'loss': 1.0, 'note': 'hi', 'bad': [1]})\n"
            "cb.on_train_end(args, st, ctl)\n"
            "cb.on_log(args, st, ctl, logs={'eval_loss': 2.0})\n"
            "cb.on_evaluate(args, st, ctl, metrics={'eval_loss': 2.0})\n"
        )
        proc = run_python(code, str(tmp_path / "out"), timeout=120)
        assert proc.returncode == 0, proc.stderr
        events = events_by_incarnation(tmp_path / "out" / "ranklog")[0, 1]
        assert [(e.step, e.values) for e in events if isinstance(e, Metrics)] == [
            (5, {"train/loss": 1.0}), (6, {"eval/loss": 2.0}),
        ]  # fmt: skip
        assert [(e.step, e.name, e.text) for e in events if isinstance(e, Text)] == [
            (5, "train/note", "hi")
        ]
        assert [e.step for e in events if isinstance(e, StepEnd)] == [5, 6]


# -- Accelerate ---------------------------------------------------------------------------------

ACC_CRASH = 12  # process 1 dies as step 12 begins: it had closed steps 0..10


@pytest.fixture(scope="module")
def acc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One Accelerate job under torchrun, 2 processes x 20 steps, shipped."""
    d = tmp_path_factory.mktemp("accelerate")
    rc, out = torchrun(d, "accelerate_train.py", "--spool", str(d / "spool"))
    assert rc == 0, out
    return shipped(d / "spool", d)


@pytest.fixture(scope="module")
def acc_crash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An Accelerate job whose process 1 is SIGKILLed at step 12, shipped."""
    d = tmp_path_factory.mktemp("accelerate-crash")
    rc, out = torchrun(d, "accelerate_train.py", "--spool", str(d / "spool"),
                       "--crash-at", str(ACC_CRASH), "--crash-rank", "1")  # fmt: skip
    assert rc != 0 and f"rank 1: crashing at step {ACC_CRASH}" in out, out
    return shipped(d / "spool", d)


@needs("accelerate", "accelerate")
class TestRanklogTracker:
    def test_every_process_logs(self, acc: dict[str, Any]) -> None:
        """Through ranklog.accelerate.log both processes wrote their own values at steps 0..19;
        init_trackers' config (main process) became params, the token redacted."""
        by_inc = events_by_incarnation(acc["spool"])
        assert sorted(by_inc) == [(0, 1), (1, 1)]
        for (rank, _), events in by_inc.items():
            start = next(e for e in events if isinstance(e, RankStart))
            assert (start.rank, start.world_size, start.local_rank) == (rank, WORLD, rank)
            metrics = [e for e in events if isinstance(e, Metrics)]
            assert [m.step for m in metrics if "train/loss" in m.values] == list(range(STEPS))
            assert {m.values["train/rank"] for m in metrics if "train/rank" in m.values} == {rank}
            assert [e.step for e in events if isinstance(e, StepEnd)] == list(range(STEPS))
            params = [e.values for e in events if isinstance(e, Params)]
            assert params == ([{"lr": 0.05, "batch": 4, "hub_token": "<redacted>"}]
                              if rank == 0 else [])  # fmt: skip
        assert read_run(acc["spool"]).name == "acc"

    def test_tensorboard_shows_the_cross_rank_reduction(self, acc: dict[str, Any]) -> None:
        """TensorBoard holds steps 0..19 once each: loss the mean, samples the sum (reduce=)."""
        assert_reduced(acc, list(range(STEPS)))
        assert all(row["train/samples"] == 8.0 and row["train/rank"] == 0.5
                   for _, row in acc["rows"])  # fmt: skip

    def test_sigkill_loses_no_closed_step(self, acc_crash: dict[str, Any]) -> None:
        """Process 1 SIGKILLed at step 12 had closed 0..10: exactly those are in TensorBoard."""
        assert acc_crash["closed"][1, 1] == list(range(ACC_CRASH - 1))
        assert acc_crash["closed"][0, 1][: ACC_CRASH - 1] == list(range(ACC_CRASH - 1))
        assert_reduced(acc_crash, list(range(ACC_CRASH - 1)))

    def test_values_steps_and_finish(self, tmp_path: Path) -> None:
        """Numbers are metrics (nested dicts as a/b), strings text, others skipped; step=None
        is the next step; a lower step is logged at the current one; finish closes the run."""
        code = (
            "import sys\n"
            "from ranklog.accelerate import RanklogTracker\n"
            "t = RanklogTracker(sys.argv[1], rank=0, world_size=1, handle_signals=False)\n"
            "t.start()\n"
            "t.log({'loss': 1.0, 'grp': {'a': 2.0}, 'note': 'hi', 'bad': [1]}, step=3)\n"
            "t.log({'x': 1.0})\n"
            "t.log({'y': 2.0}, step=1, prefix='train', reduce='sum')\n"
            "t.finish()\n"
            "assert t.run.closed\n"
        )
        proc = run_python(code, str(tmp_path / "spool"), timeout=60)
        assert proc.returncode == 0, proc.stderr
        events = events_by_incarnation(tmp_path / "spool")[0, 1]
        assert [(e.step, e.values, e.reduce) for e in events if isinstance(e, Metrics)] == [
            (3, {"loss": 1.0, "grp/a": 2.0}, "mean"), (4, {"x": 1.0}, "mean"),
            (4, {"train/y": 2.0}, "sum"),
        ]  # fmt: skip
        assert [(e.step, e.name) for e in events if isinstance(e, Text)] == [(3, "note")]
        assert [e.step for e in events if isinstance(e, StepEnd)] == [3, 4]
        assert isinstance(events[-1], RankEnd) and events[-1].status == "ok"


# -- importing ------------------------------------------------------------------------------------


class TestImports:
    def test_import_ranklog_imports_no_framework(self) -> None:
        """``import ranklog`` imports none of lightning, transformers, accelerate."""
        names = ("lightning", "pytorch_lightning", "transformers", "accelerate")
        code = "import sys, json, ranklog\n" + (
            f"print(json.dumps([m for m in {names!r} if m in sys.modules]))"
        )
        proc = run_python(code)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == []

    @pytest.mark.parametrize(
        ("module", "framework", "extra"),
        [("lightning", "lightning", "lightning"), ("hf", "transformers", "hf"),
         ("accelerate", "accelerate", "accelerate")],
    )  # fmt: skip
    def test_a_missing_framework_names_the_extra(
        self, module: str, framework: str, extra: str
    ) -> None:
        """Without its framework, importing an adapter raises ExtraMissingError naming its extra."""
        code = (
            f"import sys; sys.modules[{framework!r}] = None\n"
            "from ranklog.errors import ExtraMissingError\n"
            f"try:\n    import ranklog.{module}\nexcept ExtraMissingError as e:\n    print(e)\n"
        )
        proc = run_python(code)
        assert proc.returncode == 0, proc.stderr
        assert f"pip install 'ranklog[{extra}]'" in proc.stdout
