"""The ``tensorboard:`` target, read back only with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import math
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("tensorboard", reason="extra tensorboard; ./tools/test installs it")

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    crc32c as tb_crc32c,
)
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    masked_crc32c,
)
from tensorboard.plugins.hparams import metadata as hp_meta
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from ranklog.errors import ConfigError, TargetError
from ranklog.shippers import ShippedStep, Shipper, TextItem
from ranklog.shippers._held import StepSet
from ranklog.shippers.targets import _tfrecord as tfr
from ranklog.shippers.targets import tensorboard as tbt
from ranklog.shippers.targets.tensorboard import HPARAMS_FILE, TensorBoardTarget, crc32c
from ranklog.spool import RunInfo, read_run

from . import test_compliance as tc
from .compliance import (
    RANKS,
    STEPS,
    Backend,
    Killed,
    KillSwitch,
    expected,
    run_once,
)
from .conftest import python_env, run_python
from .shiphelp import build_target, lines, rank, ship


def make(arg: str, spool: Path, opts: dict[str, Any] | None = None) -> Any:
    """The tensorboard target of ``tensorboard:arg`` (with option values)."""
    return build_target("tensorboard", arg, spool, opts)


SIZE = {ea.SCALARS: 0, ea.TENSORS: 0, ea.HISTOGRAMS: 0, ea.IMAGES: 0, ea.AUDIO: 0}
RUN = RunInfo(run_id="ab" * 16, created=1_700_000_000.0, name="exp")


# -- reading back with TensorBoard --------------------------------------------------------


def accumulator(path: Path, *, purge: bool = True) -> ea.EventAccumulator:
    """TensorBoard's reader over one run directory (``purge``: its purge on SessionLog.START)."""
    acc = ea.EventAccumulator(str(path), size_guidance=SIZE, purge_orphaned_data=purge)
    acc.Reload()
    return acc


def series(path: Path, *, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) list, as the reader loaded them; the slowest rank's
    series (``X/slowest_rank/rank00003``, one per rank) as one series ``X/slowest_rank``."""
    acc = accumulator(path, purge=purge)
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags()["scalars"]:
        pts = [(e.step, e.value) for e in acc.Scalars(tag)]
        head, _, last = tag.rpartition("/")
        if head.rsplit("/", 1)[-1].startswith("slowest_rank") and last.startswith("rank"):
            assert all(v == int(last[4:]) for _, v in pts), tag
            out[head] = sorted(out.get(head, []) + pts)
        else:
            out[tag] = pts
    return out


def tb_back(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {tag: value}) as TensorBoard shows them; a step shown twice in a tag comes twice.

    The raw files (no purge) must already hold each step at most once per tag, in
    increasing order, and the purge on START must drop nothing.
    """
    shown, raw = series(path), series(path, purge=False)
    for tag, pts in raw.items():
        steps = [s for s, _ in pts]
        assert steps == sorted(set(steps)), f"raw files hold {tag} out of order or twice"
    assert {t: [s for s, _ in p] for t, p in raw.items()} == {
        t: [s for s, _ in p] for t, p in shown.items()
    }, "the reader's purge on SessionLog.START dropped steps"
    rows: dict[int, dict[str, float]] = {}
    times: Counter[int] = Counter()
    for tag, pts in shown.items():
        for s, n in Counter(s for s, _ in pts).items():
            times[s] = max(times[s], n)
        for s, v in pts:
            rows.setdefault(s, {})[tag] = v
    return [(s, rows[s]) for s in sorted(rows) for _ in range(times[s])]


def f32(v: float) -> float:
    """What a float32 ``simple_value`` holds for ``v``."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _make(work: Path) -> Any:
    return make(str(work / "tb"), work, dict())


def _tb_params(work: Path) -> dict[str, Any]:
    ssi, _ = _hparams(work / "tb")
    return {k: v.number_value for k, v in ssi.hparams.items()}


TB = Backend(
    "tensorboard", make=_make, read_back=lambda work: tb_back(work / "tb"), rel=1e-7,
    read_params=_tb_params,
)  # fmt: skip


@pytest.fixture
def backend() -> Backend:
    return TB


def _step(i: int, metrics: dict[str, float] | None = None, **kw: Any) -> ShippedStep:
    values = {"loss": i / 10} if metrics is None else metrics
    return ShippedStep(i, values, ranks=1, world_size=1, complete=True, ts=RUN.created + i, **kw)


def _session(path: Path, steps: list[ShippedStep], params: dict[str, Any] | None = None) -> Any:
    """One shipper session through the target API: open, params, steps, flush, close."""
    t = TensorBoardTarget(path)
    last = t.open(RUN).last  # the highest step held
    if params:
        t.write_params(params)
    if steps:
        t.write(steps)
    t.close()
    return last


def _shipped(spool: Path, out: Path) -> ea.EventAccumulator:
    """``spool`` shipped once to ``tensorboard:out``, read back by TensorBoard."""
    target = make(str(out), spool, dict())
    Shipper(str(spool), target, name="t", dead_after=3600, start_grace=0).run_forever(once=True)
    return accumulator(out)


def _session_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("events.out.tfevents.*") if p.name != HPARAMS_FILE)


# -- the shared compliance suite ----------------------------------------------------------


class TestTensorBoardCompliance(tc.TestCompliance):
    """tests/test_compliance.py's exactly-once tests, for ``tensorboard:DIR``."""


class TestTensorBoardLateCompliance(tc.TestLateCompliance):
    """tests/test_compliance.py's late-value tests, for ``tensorboard:DIR``."""


# -- values, text, hyperparameters ----------------------------------------------------------


def _rich_spool(spool: Path) -> None:
    """3 ranks, 25 steps: several ops, a timer, NaN, inf, values beyond float32, text."""
    for r in range(3):
        run = rank(spool, r, 3)
        run.log_hyperparams({"lr": 3e-4, "opt": {"name": "adam", "nesterov": False}, "seed": 7})
        for s in range(25):
            run.log_metrics({"loss": r + s / 1000, "acc": 0.5 + r / 10}, step=s, prefix="train")
            run.log_metrics({"grad": r * s * 1.5}, step=s, reduce=("mean", "max", "min", "std"))
            run.log_timing("step_time", 0.01 * (r + 1) + s / 1e6, step=s)
            odd = {3: math.nan, 4: math.inf, 5: 1e39 * (r + 1), 6: -1e300, 7: 1e-46}
            if s in odd:
                run.log_metrics({"odd": odd[s]}, step=s)
            if s % 10 == 0:
                run.log_text("val/sample_0", f"rank {r} says *{s}*", step=s)
            run.step_end(s)
        run.close()


class TestValues:
    def test_every_value_as_in_jsonl(self, spool: Path, tmp_path: Path) -> None:
        """The same spool shipped to jsonl: and tensorboard: gives every value, float32-rounded."""
        _rich_spool(spool)
        ship(spool, tmp_path / "out.jsonl", name="j")
        want = lines(tmp_path / "out.jsonl")
        target = make(str(tmp_path / "tb"), spool, dict())
        Shipper(str(spool), target, name="t", dead_after=3600, start_grace=0).run_forever(once=True)
        got = tb_back(tmp_path / "tb")
        assert [s for s, _ in got] == [x["step"] for x in want] == list(range(25))
        for (step, values), line in zip(got, want, strict=True):
            assert set(values) == set(line["metrics"]), step
            for name, v in line["metrics"].items():
                assert same(values[name], f32(v)), (step, name, values[name], v)
        assert math.isnan(got[3][1]["odd"]) and got[4][1]["odd"] == math.inf
        assert got[5][1]["odd"] == math.inf and got[6][1]["odd"] == -math.inf
        assert got[7][1]["odd"] == 0.0

    def test_wall_time_is_the_step_time(self, tmp_path: Path) -> None:
        """Each step's wall_time is the step's own timestamp (now when it has none)."""
        _session(tmp_path, [_step(0), ShippedStep(1, {"loss": 1.0}, 1, 1, True, math.nan)])
        events = accumulator(tmp_path).Scalars("loss")
        assert events[0].wall_time == RUN.created
        assert abs(events[1].wall_time - time.time()) < 60

    def test_slowest_rank_is_a_series_per_rank_and_no_other_name_is_read_as_one(
        self, tmp_path: Path
    ) -> None:
        """Each step's slowest rank R is ``.../slowest_rank/rankRRRRR`` = R; a name that only
        looks like one (a fraction, NaN, another prefix) stays the scalar it was logged as."""
        odd = {"timing/t/slowest_rank.derived": 2.0, "mine/slowest_rank": 3.0,
               "timing/u/slowest_rank": 2.5, "timing/v/slowest_rank": math.nan}  # fmt: skip
        steps = [_step(s, {"timing/t": 1.0, "timing/t/slowest_rank": s % 2, **odd})
                 for s in range(4)]  # fmt: skip
        _session(tmp_path, steps)
        acc = accumulator(tmp_path)
        pts = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
        assert pts["timing/t/slowest_rank/rank00000"] == [(0, 0.0), (2, 0.0)]
        assert pts["timing/t/slowest_rank/rank00001"] == [(1, 1.0), (3, 1.0)]
        assert pts["timing/t/slowest_rank.derived/rank00002"] == [(s, 2.0) for s in range(4)]
        assert pts["mine/slowest_rank"] == [(s, 3.0) for s in range(4)]
        assert pts["timing/u/slowest_rank"] == [(s, 2.5) for s in range(4)]
        assert all(math.isnan(v) for _, v in pts["timing/v/slowest_rank"])
        assert "timing/t/slowest_rank" not in pts and not acc.Tags()["tensors"]

    def test_long_and_unicode_names_big_steps(self, tmp_path: Path) -> None:
        """Tags over 127 bytes, non-ASCII tags, 500 scalars a step, steps past 2**32 read back."""
        names = ["x" * 300, "ü/λoss", *(f"m/{i:03d}" for i in range(500))]
        steps = [_step(s, {n: i + s for i, n in enumerate(names)}) for s in (0, 2**33, 2**40)]
        _session(tmp_path, steps)
        got = tb_back(tmp_path)
        assert [s for s, _ in got] == [0, 2**33, 2**40]
        for (s, values), sent in zip(got, steps, strict=True):
            assert values == {n: f32(v) for n, v in sent.metrics.items()}, s


class TestText:
    def test_text_of_several_ranks_shows_each_rank(self, spool: Path, tmp_path: Path) -> None:
        """Three ranks' sample of one name is one text tag with a markdown block per rank."""
        _rich_spool(spool)
        acc = _shipped(spool, tmp_path / "tb")
        assert set(acc.PluginTagToContent("text")) == {"val/sample_0"}
        events = acc.Tensors("val/sample_0")
        assert [ev.step for ev in events] == [0, 10, 20]
        for ev in events:
            text = tensor_util.make_ndarray(ev.tensor_proto).item().decode()
            blocks = [f"**rank {r}**\n\nrank {r} says *{ev.step}*" for r in range(3)]
            assert text == "\n\n---\n\n".join(blocks)

    def test_single_text_is_plain(self, tmp_path: Path) -> None:
        """A name only one rank logged in a step is its text as is, tagged by the name."""
        texts = [TextItem(2, "val/a", "# hi\n*md*"), TextItem(0, "notes", "x")]
        _session(tmp_path, [_step(0, texts=texts), _step(1, {})])
        acc = accumulator(tmp_path)
        assert set(acc.PluginTagToContent("text")) == {"val/a", "notes"}
        (ev,) = acc.Tensors("val/a")
        assert tensor_util.make_ndarray(ev.tensor_proto).item() == b"# hi\n*md*"
        assert [s for s, _ in tb_back(tmp_path)] == [0]  # a step of no scalar shows none


class TestTornLate:
    def test_every_tear_leaves_whole_groups(self, tmp_path: Path) -> None:
        """Torn at any byte, open() cuts late records whose carrier's record is missing."""
        batch = [_step(10), _step(12), _step(5, {"v": 3.0}, carrier=12),
                 _step(7, {"v": 4.0}, carrier=12), _step(8, {"v": 5.0}, carrier=13)]  # fmt: skip
        _session(tmp_path / "tb", batch)
        (path,) = _session_files(tmp_path / "tb")
        full = path.read_bytes()
        spans = tfr.spans(full, len(full))
        records = [event_pb2.Event.FromString(full[a:b]) for a, b in spans]
        late = [r.source_metadata.writer == "ranklog late" for r in records]
        assert [(r.step, x) for r, x in zip(records, late, strict=True)][2:] == [
            (10, False),
            (5, True),
            (7, True),
            (12, False),
            (8, True),
            (13, False),
        ]
        ends = [b + 4 for _, b in spans]
        whole = {ends[2]: 10, ends[5]: 12, ends[7]: 13}  # where step 10 and each group end
        for cut in range(ends[1], len(full) + 1):
            work = tmp_path / f"cut{cut}"
            work.mkdir()
            (work / path.name).write_bytes(full[:cut])
            held = TensorBoardTarget(work).open(RUN)
            kept = max((e for e in whole if e <= cut), default=ends[1])
            assert (held.last, (work / path.name).stat().st_size) == (whole.get(kept), kept), cut


class TestTables:
    def test_tables_are_markdown_text(self, spool: Path, tmp_path: Path) -> None:
        """Each rank's table is a text-plugin Markdown table, ``name/rankNNNNN`` when shared."""
        from .test_tables import table_spool

        table_spool(spool)
        acc = _shipped(spool, tmp_path / "tb")
        tags = {"val/results/rank00000", "val/results/rank00001", "val/only"}
        assert set(acc.PluginTagToContent("text")) == tags
        (ev,) = acc.Tensors("val/results/rank00001")
        assert ev.step == 1
        assert tensor_util.make_ndarray(ev.tensor_proto).item().decode().splitlines() == [
            "| prompt | score | ok |", "|---|---|---|",
            "| rank 1 \\| q | 1.5 | True |", "| two<br>lines |  | False |",
        ]  # fmt: skip
        (only,) = acc.Tensors("val/only")
        assert only.step == 2
        assert [s for s, _ in tb_back(tmp_path / "tb")] == [0, 1, 2]


def _hparams(path: Path) -> tuple[Any, Any]:
    content = accumulator(path).PluginTagToContent("hparams")
    ssi = hp_meta.parse_session_start_info_plugin_data(content["_hparams_/session_start_info"])
    exp = hp_meta.parse_experiment_plugin_data(content["_hparams_/experiment"])
    return ssi, exp


class TestHparams:
    def test_session_and_experiment_visible(self, made: Path, work: Path) -> None:
        """The hparams plugin data holds the params and lists the reduced metrics."""
        run_once(made, _make(work))
        ssi, exp = _hparams(work / "tb")
        assert {k: v.number_value for k, v in ssi.hparams.items()} == {"lr": 0.1, "nested.depth": 3}
        assert ssi.group_name == read_run(made).name
        assert ssi.start_time_secs == read_run(made).created
        assert sorted(h.name for h in exp.hparam_infos) == ["lr", "nested.depth"]
        assert [(m.name.tag, m.name.group) for m in exp.metric_infos] == [
            (name, "") for name in sorted(expected(0)) if not name.endswith("/slowest_rank")
        ]  # (the slowest rank is a series per rank: no hparams metric)

    def test_types_and_domains(self, tmp_path: Path) -> None:
        """Strings, bools and numbers become typed hparams with their one value; None is left
        out, as TensorBoard's own writer (torch's ``SummaryWriter.add_hparams``) leaves it."""
        params = {"name": "adam", "flag": True, "lr": 0.5, "n": 3, "none": None, "big": math.inf}
        _session(tmp_path, [_step(0)], params)
        ssi, exp = _hparams(tmp_path)
        got = {k: getattr(v, v.WhichOneof("kind")) for k, v in ssi.hparams.items()}
        assert got == {"name": "adam", "flag": True, "lr": 0.5, "n": 3.0, "big": math.inf}
        torch_summary = pytest.importorskip(
            "torch.utils.tensorboard.summary",
            reason="torch, pinned by ./tools/test: TensorBoard's own writer",
        )
        _, theirs, _ = torch_summary.hparams(params, {})
        from tensorboard.plugins.hparams import plugin_data_pb2

        data = plugin_data_pb2.HParamsPluginData.FromString(
            theirs.value[0].metadata.plugin_data.content
        )
        assert set(data.session_start_info.hparams) == set(got)
        infos = {h.name: h for h in exp.hparam_infos}
        assert infos["lr"].domain_interval.min_value == infos["lr"].domain_interval.max_value == 0.5
        assert infos["flag"].domain_discrete.values[0].bool_value is True
        assert infos["name"].domain_discrete.values[0].string_value == "adam"

    def test_later_metrics_and_params_after_restart(self, tmp_path: Path) -> None:
        """Metric names and params that come later, even after a restart, reach the experiment."""
        _session(tmp_path, [_step(0, {"a": 1.0})], {"lr": 0.1})
        _session(tmp_path, [_step(1, {"a": 1.0, "eval/b": 2.0})])
        _session(tmp_path, [_step(2, {"c": 3.0})], {"wd": 0.01, "lr": 0.2})
        ssi, exp = _hparams(tmp_path)
        assert sorted(m.name.tag for m in exp.metric_infos) == ["a", "c", "eval/b"]
        assert sorted(h.name for h in exp.hparam_infos) == ["lr", "wd"]
        assert {k: v.number_value for k, v in ssi.hparams.items()} == {"lr": 0.2, "wd": 0.01}

    def test_hparams_plugin_reads_them(self, tmp_path: Path) -> None:
        """TensorBoard's hparams plugin shows the params, every metric and the session's values."""
        from tensorboard import context
        from tensorboard.backend.event_processing import data_provider
        from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
        from tensorboard.plugins import base_plugin
        from tensorboard.plugins.hparams import (
            api_pb2,
            backend_context,
            get_experiment,
            list_session_groups,
        )

        _session(tmp_path / "exp", [_step(0, {"a": 1.0})], {"lr": 0.1, "opt": "adam"})
        _session(tmp_path / "exp", [_step(1, {"a": 2.0, "eval/b": 3.0})])
        mux = pem.EventMultiplexer()
        mux.AddRunsFromDirectory(str(tmp_path))
        mux.Reload()
        provider = data_provider.MultiplexerDataProvider(mux, str(tmp_path))
        tb = base_plugin.TBContext(logdir=str(tmp_path), multiplexer=mux, data_provider=provider)
        ctx, hp = context.RequestContext(), backend_context.Context(tb)
        get = api_pb2.GetExperimentRequest(include_metrics=True)
        exp = get_experiment.Handler(ctx, hp, "", get).run()
        assert [h.name for h in exp.hparam_infos] == ["lr", "opt"]
        assert [m.name.tag for m in exp.metric_infos] == ["a", "eval/b"]
        req = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=10)
        req.allowed_statuses.extend([api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS])
        for info in exp.hparam_infos:
            req.col_params.add(hparam=info.name)
        for m in exp.metric_infos:
            req.col_params.add(metric=m.name)
        (group,) = list_session_groups.Handler(ctx, hp, "", req).run().session_groups
        assert group.name == "exp" and group.hparams["opt"].string_value == "adam"
        assert {m.name.tag: (m.value, m.training_step) for m in group.metric_values} == {
            "a": (2.0, 1),
            "eval/b": (3.0, 1),
        }

    def test_no_params_no_hparams_file(self, tmp_path: Path) -> None:
        """Without params there is no hparams file (an experiment without hparams is noise)."""
        _session(tmp_path, [_step(0)])
        assert not (tmp_path / HPARAMS_FILE).exists()
        with pytest.raises(KeyError):
            accumulator(tmp_path).PluginTagToContent("hparams")


# -- resume -----------------------------------------------------------------------------------


class TestResume:
    def test_torn_last_record_is_cut_and_ignored(self, tmp_path: Path) -> None:
        """A record written in part (crash mid-write) is not counted, and is cut off on open."""
        _session(tmp_path, [_step(i) for i in range(10)])
        (f,) = _session_files(tmp_path)
        size = f.stat().st_size
        with open(f, "ab") as out:
            out.write(b"\x40\x00\x00\x00\x00\x00\x00\x00\x01\x02")  # half a header
        assert _session(tmp_path, [_step(i) for i in range(10, 15)]) == 9
        assert f.stat().st_size == size
        assert [s for s, _ in tb_back(tmp_path)] == list(range(15))

    def test_zero_filled_tail_is_cut(self, tmp_path: Path) -> None:
        """A record whose data never reached the disk (zeros, a power loss) does not count."""
        _session(tmp_path, [_step(i) for i in range(5)])
        (f,) = _session_files(tmp_path)
        data = f.read_bytes()
        head = struct.pack("<Q", 40)
        with open(f, "ab") as out:  # a valid length, then data and crc that never got written
            out.write(head + struct.pack("<I", masked_crc32c(head)) + b"\x00" * 44)
        assert TensorBoardTarget(tmp_path).open(RUN).last == 4
        assert f.read_bytes() == data

    def test_last_step_found_behind_a_stepless_session(self, tmp_path: Path) -> None:
        """A later session that wrote only params does not hide the last step of an earlier one."""
        _session(tmp_path, [_step(i) for i in range(5)])
        assert _session(tmp_path, [], {"lr": 1.0}) == 4
        assert _session(tmp_path, []) == 4
        assert len(_session_files(tmp_path)) == 2  # a session that writes nothing makes no file

    def test_each_session_file_sorts_after_the_previous(self, tmp_path: Path) -> None:
        """A session of this second by a host that sorts later is still read before the next one."""
        _session(tmp_path, [_step(i) for i in range(3)])
        (first,) = _session_files(tmp_path)
        first.rename(tmp_path / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999.0")
        for k in range(1, 6):  # quick restarts, within the same second or so
            assert _session(tmp_path, [_step(i) for i in range(3 * k, 3 * k + 3)]) == 3 * k - 1
        assert _session_files(tmp_path)[0].name.split(".")[4] == "zzzz"
        assert [s for s, _ in tb_back(tmp_path)] == list(range(18))

    def test_late_values_stay_with_their_carrier_past_a_gap(self, tmp_path: Path) -> None:
        """Filling a gap below held steps, a carrier past the gap takes its late values into
        its own file: reopened, the late value is still there, each step once, in order."""
        _session(tmp_path, [_step(i) for i in range(100, 200)])
        late = _step(50, {"val": 5.0}, carrier=200)
        _session(tmp_path, [_step(98), _step(99), _step(200), late])
        assert TensorBoardTarget(tmp_path).open(RUN) == StepSet([98, 99, *range(100, 201)])
        got = series(tmp_path, purge=False)
        assert got["val"] == [(50, 5.0)]
        assert [s for s, _ in tb_back(tmp_path)] == [50, 98, 99, *range(100, 201)]

    def test_params_first_then_a_gap(self, tmp_path: Path) -> None:
        """Sessions 200..299, then (params first) 0..99, then 100..199: read in step order,
        nothing purged, every step once."""
        _session(tmp_path, [_step(i) for i in range(200, 300)], {"lr": 1.0})
        _session(tmp_path, [_step(i) for i in range(100)], {"lr": 2.0})
        _session(tmp_path, [_step(i) for i in range(100, 200)])
        assert [s for s, _ in tb_back(tmp_path)] == list(range(300))

    def test_another_run_is_refused(self, tmp_path: Path) -> None:
        """A directory holding another ranklog run's event files is refused, not mixed."""
        _session(tmp_path, [_step(0)])
        other = RunInfo(run_id="cd" * 16, created=RUN.created, name="other")
        with pytest.raises(TargetError, match="another directory"):
            TensorBoardTarget(tmp_path).open(other)

    def test_other_writers_files_are_left_alone(self, tmp_path: Path) -> None:
        """Event files of another writer neither count as held steps nor get cut."""
        w = EventFileWriter(str(tmp_path))
        value = summary_pb2.Summary.Value(tag="theirs", simple_value=1.0)
        w.add_event(event_pb2.Event(step=500, summary=summary_pb2.Summary(value=[value])))
        w.close()
        (theirs,) = _session_files(tmp_path)
        with open(theirs, "ab") as out:
            out.write(b"\x01\x02\x03")
        before = theirs.read_bytes()
        assert _session(tmp_path, [_step(0)]) is None
        assert theirs.read_bytes() == before

    def test_open_again_without_close(self, tmp_path: Path) -> None:
        """Opening a target again (as the engine does after a failure) continues correctly."""
        t = TensorBoardTarget(tmp_path)
        assert t.open(RUN).last is None
        t.write([_step(0), _step(1)])
        assert t.open(RUN).last == 1
        t.write([_step(2)])
        t.close()
        assert [s for s, _ in tb_back(tmp_path)] == [0, 1, 2]


# -- per-rank sub-runs ----------------------------------------------------------------------


def _per_rank_target(path: Path) -> Any:
    return make(str(path), path, dict(per_rank=True))


def _per_rank_shipper(spool: Path, target: Any) -> Shipper:
    return Shipper(str(spool), target, name="pr", dead_after=3600, start_grace=0, per_rank=True)


def _check_ranks(path: Path, steps: int, ranks: int) -> None:
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == [
        f"rank{r:05d}" for r in range(ranks)
    ]
    for r in range(ranks):
        got = tb_back(path / f"rank{r:05d}")
        assert [s for s, _ in got] == list(range(steps)), r
        for s, values in got:
            assert values["loss"] == f32(r + s / 1000), (r, s)


class TestPerRank:
    def test_each_rank_in_its_sub_run(self, made: Path, tmp_path: Path) -> None:
        """--per-rank writes each rank's own values to DIR/rankNNNNN/, the reduced ones to DIR."""
        _per_rank_shipper(made, _per_rank_target(tmp_path / "tb")).run_forever(once=True)
        _check_ranks(tmp_path / "tb", STEPS, RANKS)
        assert [s for s, _ in tb_back(tmp_path / "tb")] == list(range(STEPS))

    @pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
    def test_killed_then_restarted(
        self, made: Path, tmp_path: Path, after: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A shipper killed mid-run and restarted leaves each rank's steps once."""
        import ranklog.shippers._engine as engine

        monkeypatch.setattr(engine, "BATCH_STEPS", 7)
        with pytest.raises(Killed):
            target = KillSwitch(_per_rank_target(tmp_path / "tb"), "write", 3, after=after)
            _per_rank_shipper(made, target).run_forever(once=True)  # type: ignore[arg-type]
        _per_rank_shipper(made, _per_rank_target(tmp_path / "tb")).run_forever(once=True)
        _check_ranks(tmp_path / "tb", STEPS, RANKS)

    def test_rank_runs_written_main_not(self, tmp_path: Path) -> None:
        """Killed after the rank sub-runs, before the main run: a resend rewrites no rank step."""
        steps = [_step(s, {"loss": s / 1000}, per_rank={0: {"loss": s / 1000}}) for s in range(6)]
        t = TensorBoardTarget(tmp_path, per_rank=True)
        t.open(RUN)
        t.write(steps[:3])

        def dead(*args: object) -> None:
            raise Killed("write")

        t._main.append = dead  # type: ignore[method-assign, union-attr]
        with pytest.raises(Killed):
            t.write(steps[3:5])
        t2 = TensorBoardTarget(tmp_path, per_rank=True)
        assert t2.open(RUN).last == 2
        t2.write(steps[3:])
        t2.close()
        _check_ranks(tmp_path, 6, 1)
        assert [s for s, _ in tb_back(tmp_path)] == list(range(6))


# -- the CLI shipper SIGKILLed while ranks write ------------------------------------------

PRODUCER = """
import sys, time, ranklog
run = ranklog.init(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
run.log_hyperparams({"lr": 0.1})
for step in range(int(sys.argv[4])):
    run.log_metrics({"loss": run.rank + step / 1000}, step=step, prefix="train")
    run.log_timing("step_time", 0.01 * (run.rank + 1), step=step)
    run.step_end(step)
    if step and step % 10 == 0:  # validation after the step closed: late, shipped with step+1
        run.log_metrics({"acc": run.rank + step / 1000}, step=step, prefix="val")
    time.sleep(0.02)
run.close()
"""


def _cli_shipper(spool: Path, out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ranklog.cli", "ship", str(spool), "--to", f"tensorboard:{out}"]
    cmd += [
        "--quiet",
        "--per-rank",
        "--dead-after",
        "120",
        "--start-grace",
        "120",
        "--poll",
        "0.05",
        "--late",
        "ship",
    ]
    return subprocess.Popen(cmd, env=python_env(), stderr=subprocess.DEVNULL)


class TestChaos:
    @pytest.mark.slow
    def test_cli_shipper_sigkilled_while_ranks_write(self, spool: Path, tmp_path: Path) -> None:
        """`ranklog ship --to tensorboard:DIR` SIGKILLed again and again: each step once, right.

        Late validation values ride along (``--late ship``): each at its step, once.
        """
        ranks, steps, rng, out = 4, 150, random.Random(11), tmp_path / "tb"
        producers = [
            subprocess.Popen(
                [sys.executable, "-c", PRODUCER, str(spool), str(r), str(ranks), str(steps)],
                env=python_env(),
            )
            for r in range(ranks)
        ]
        kills = 0
        try:
            # until the producers end and two killed shippers got far enough to leave a file
            # each (with one, the last shipper may find every step shipped and add none)
            while (kills < 6 or any(p.poll() is None for p in producers)
                   or len(_session_files(out)) < 2):  # fmt: skip
                # a killed shipper leaves its lease, which the next one takes over after a
                # 1 s pause (a concurrent taker's rename must land): killed within that pause
                # every time, none would ever ship (a slow start made this loop for ever)
                takeover = 1.0 if list((spool / "cursors").glob("*.lease")) else 0.0
                proc = _cli_shipper(spool, out)
                time.sleep(takeover + rng.uniform(0.5, 1.2))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
        finally:
            for p in producers:
                assert p.wait(timeout=120) == 0
        assert _cli_shipper(spool, out).wait(timeout=120) == 0
        got = tb_back(out)
        assert [s for s, _ in got] == list(range(steps)), f"after {kills} kills"
        for s, values in got:
            assert values["train/loss"] == f32((ranks - 1) / 2 + s / 1000)
            assert values["timing/step_time"] == f32(0.01 * ranks)
            assert values["timing/step_time/slowest_rank"] == ranks - 1
        acc = [(s, v["val/acc"]) for s, v in got if "val/acc" in v]
        assert acc == [(s, f32((ranks - 1) / 2 + s / 1000)) for s in range(10, steps, 10)]
        for r in range(ranks):
            sub = tb_back(out / f"rank{r:05d}")
            assert [s for s, _ in sub] == list(range(steps)), r
            assert all(v["train/loss"] == f32(r + s / 1000) for s, v in sub)
        ssi, _ = _hparams(out)
        assert ssi.hparams["lr"].number_value == 0.1
        assert len(_session_files(out)) >= 2  # killed sessions' files: readers still see once


# -- wiring ---------------------------------------------------------------------------------


class TestWiring:
    def test_import_ranklog_does_not_import_tensorboard(self) -> None:
        """Importing ranklog, its shippers and this module loads no tensorboard."""
        code = (
            "import sys, ranklog, ranklog.shippers, ranklog.shippers.targets.tensorboard\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard'))"
        )
        res = run_python(code)
        assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr

    def test_missing_tensorboard_names_the_extra(self, tmp_path: Path) -> None:
        """Without tensorboard, the target raises ExtraMissingError naming ranklog[tensorboard]."""
        code = (
            "import sys; sys.modules['tensorboard'] = None\n"
            "from ranklog.errors import ExtraMissingError\n"
            "from ranklog.shippers import make_target\n"
            "try:\n    make_target(sys.argv[1], sys.argv[2])\n"
            "except ExtraMissingError as e:\n    print(e)\n"
        )
        res = run_python(code, f"tensorboard:{tmp_path / 'tb'}", str(tmp_path))
        assert "pip install 'ranklog[tensorboard]'" in res.stdout, res.stderr

    def test_directory_required(self, tmp_path: Path) -> None:
        """``tensorboard:`` without a directory is a configuration error."""
        with pytest.raises(ConfigError, match="tensorboard:DIR"):
            make("", tmp_path, dict())

    def test_crc32c_matches_tensorboard(self) -> None:
        """The table-driven CRC-32C equals TensorBoard's reference implementation."""
        rng = random.Random(3)
        for n in [*range(40), 255, 256, 1000, 4099]:
            data = rng.randbytes(n)
            assert crc32c(data) == tb_crc32c(data), n
        assert crc32c(b"123456789") == 0xE3069283

    @pytest.mark.parametrize("rows", [None, 64], ids=["table", "pieces"])
    @pytest.mark.parametrize("per_pass", [None, 1, 5000], ids=["pass", "pass1", "pass5k"])
    def test_batched_crc32c_matches(
        self, rows: int | None, per_pass: int | None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The CRCs of a batch, with numpy (parts over the table's rows in pieces), are exact."""
        if rows is not None:
            monkeypatch.setattr(tfr, "_ROWS_MAX", rows)
            monkeypatch.setattr(tfr, "_rows", [])
        if per_pass is not None:
            monkeypatch.setattr(tfr, "_NP_PASS", per_pass)
        rng = random.Random(7)
        sizes = [0, 1, 3, 4, 5, 8, 63, 64, 65, 127, 128, 129, 391, 4095, 4096, 4097, 9000]
        datas = [rng.randbytes(rng.choice(sizes)) for _ in range(120)]
        datas += [rng.randbytes(tfr._NP_MAX + 1), b"\xff" * 70_000, bytes(5000)]
        want = [crc32c(d) for d in datas]
        assert want[:60] == [tb_crc32c(d) for d in datas[:60]]
        assert tfr._crcs(datas) == want
        assert tfr._crcs(datas[::-1]) == want[::-1]
        assert [tfr._crcs([d])[0] for d in datas[:30]] == want[:30]
        assert tfr._crcs([]) == []

    def test_records_check_with_tensorboard_and_match_python(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each record's CRCs are TensorBoard's; the bytes are those written without numpy."""
        monkeypatch.setattr(tbt, "time", SimpleNamespace(time=lambda: RUN.created))
        names = [f"train/m{k:02d}" for k in range(20)]
        big = [f"m/{i:03d}" for i in range(400)]  # a record over the numpy table's 4096 rows
        steps = [_step(s, {n: s + k / 7 for k, n in enumerate(names)}) for s in range(300)]
        steps += [_step(300, {n: 1.5 for n in big}), _step(301, texts=[TextItem(0, "t", "x")])]
        files = []
        for numpy in (True, False):
            if not numpy:
                monkeypatch.setattr(tfr, "_numpy", lambda: None)
            _session(tmp_path / str(numpy), steps, {"lr": 0.1})
            (session,) = _session_files(tmp_path / str(numpy))
            files.append(
                (session.read_bytes(), (tmp_path / str(numpy) / HPARAMS_FILE).read_bytes())
            )
        assert files[0] == files[1]
        data = files[0][0]
        pos, count = 0, 0
        while pos < len(data):
            (size,) = struct.unpack_from("<Q", data, pos)
            assert struct.unpack_from("<I", data, pos + 8)[0] == masked_crc32c(data[pos : pos + 8])
            body = data[pos + 12 : pos + 12 + size]
            assert struct.unpack_from("<I", data, pos + 12 + size)[0] == masked_crc32c(body)
            pos, count = pos + 16 + size, count + 1
        assert pos == len(data) and count == 2 + 1 + len(steps)  # version, START, params
        assert [s for s, _ in tb_back(tmp_path / "True")] == list(range(302))

    def test_write_before_open_fails(self, tmp_path: Path) -> None:
        """Writing to a target that is not open is an error, not a silent drop."""
        with pytest.raises(TargetError, match="not open"):
            TensorBoardTarget(tmp_path).write([_step(0)])
        assert os.listdir(tmp_path) == []


def test_a_refusal_names_the_run_and_every_step_it_holds(tmp_path: Path) -> None:
    """Run "live" shipped into a directory in two sessions (two files: before and after a
    stop), then another run into it: the refusal names "live" and steps 0-299, not one
    file's unnamed part."""
    import ranklog
    from ranklog.errors import TargetHeldError

    tb = tmp_path / "tb"
    live = tmp_path / "live"
    run = ranklog.init(live, rank=0, world_size=1, name="live", handle_signals=False)
    for s in range(300):
        run.log_metrics({"loss": s / 300}, step=s)
        run.step_end(s)
        if s in (92, 299):
            run.flush()
            Shipper(str(live), TensorBoardTarget(tb), name="t", start_grace=0,
                    dead_after=3600).run_forever(once=True)  # fmt: skip
    run.close()
    assert len(list(tb.glob("events.out.tfevents.*"))) >= 2
    other = tmp_path / "other"
    with ranklog.init(other, rank=0, world_size=1, name="other", handle_signals=False) as o:
        o.log_metrics({"loss": 1.0}, step=0)
        o.step_end(0)
    with pytest.raises(TargetHeldError, match=r"holds run [0-9a-f]{32} \(live, steps 0-299\)"):
        Shipper(str(other), TensorBoardTarget(tb), name="t", start_grace=0).run_forever(once=True)
