"""Hyperparameters reach every backend as logged: secrets redacted, nothing else; lists as lists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ranklog.errors import InvalidValueError
from ranklog.producer import flatten_params
from ranklog.producer._redact import Redactor
from ranklog.producer._values import REDACTED
from ranklog.shippers.targets.jsonl import read_jsonl
from ranklog.spool import read_segment

from .conftest import ROOT
from .shiphelp import log_steps, rank, ship

NEMO_KEYS = [
    line.strip()
    for line in (ROOT / "tests/data/nemo_rl_config_keys.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


class TestRedaction:
    def test_nemo_rl_configs_keep_every_setting(self) -> None:
        """Every key of NeMo RL's GRPO and SFT configs survives (max_new_tokens, tokenizer...)."""
        assert len(NEMO_KEYS) > 300
        cfg = {key: 1 for key in NEMO_KEYS}
        flat = flatten_params(cfg, redactor=Redactor(env=False))
        assert [k for k, v in flat.items() if v == REDACTED] == []
        for key in ("policy.generation.max_new_tokens", "policy.tokenizer.name",
                    "loss_fn.token_level_loss", "policy.generation.stop_token_ids",
                    "policy.megatron_cfg.moe_token_dispatcher_type"):  # fmt: skip
            assert key in NEMO_KEYS

    @pytest.mark.parametrize(
        "key",
        ["wandb.api_key", "apiKey", "hf_token", "hub_token", "access_token", "auth.token",
         "refresh_token", "db.password", "passwd", "aws_secret_access_key", "client_secret",
         "credentials.user", "github_token", "ssh.private_key", "secrets.anything",
         "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN", "CI_JOB_TOKEN", "HFToken",
         "slack.webhook_token"],
    )  # fmt: skip
    def test_secrets_by_name(self, key: str) -> None:
        """Whole components naming a secret are redacted."""
        assert flatten_params({key: "value"}, redactor=Redactor(env=False))[key] == REDACTED

    @pytest.mark.parametrize(
        "key",
        ["max_new_tokens", "num_tokens", "tokenizer", "token_level_loss", "stop_token_ids",
         "pad_token", "eos_token", "api_key_env_var", "password_file", "train_mb_tokens",
         "tokens_per_second", "keyword", "tokenizer.bos_token", "unkToken", "image_token",
         "max_token", "MLFLOW_TRACKING_TOKEN_FILE"],
    )  # fmt: skip
    def test_words_that_merely_contain_token(self, key: str) -> None:
        """Settings about tokens, and names of where a secret is kept, are not secrets."""
        assert flatten_params({key: "value"}, redactor=Redactor(env=False))[key] == "value"

    @pytest.mark.parametrize(
        "value",
        ["0123456789abcdef0123456789abcdef01234567", "hf_" + "a" * 34, "sk-proj-" + "A" * 40,
         "ghp_" + "x" * 36, "github_pat_" + "y" * 60],
    )  # fmt: skip
    def test_credential_shaped_values(self, value: str) -> None:
        """A value shaped like a credential is redacted whatever its key, in a list too."""
        red = Redactor(env=False)
        assert flatten_params({"note": value}, redactor=red)["note"] == REDACTED
        assert flatten_params({"keys": ["a", value]}, redactor=red)["keys"] == ["a", REDACTED]

    def test_a_git_sha_is_kept(self) -> None:
        """40 hex digits under a key naming a commit or a hash are a git object, kept."""
        sha = "0123456789abcdef0123456789abcdef01234567"
        assert flatten_params({"code": {"commit": sha}}, redactor=Redactor(env=False)) == {
            "code.commit": sha
        }

    def test_users_add_their_own(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """init(redact=[...]) and $RANKLOG_REDACT add globs over keys and components."""
        monkeypatch.setenv("RANKLOG_REDACT", "*.db_url, internal_*")
        red = Redactor(["cluster.head"])
        cfg = {"store": {"db_url": "pg://u:p@h"}, "internal_id": 3, "cluster": {"head": "n1"}}
        flat = flatten_params({**cfg, "lr": 0.1}, redactor=red)
        assert flat == {"store.db_url": REDACTED, "internal_id": REDACTED,
                        "cluster.head": REDACTED, "lr": 0.1}  # fmt: skip


class TestValues:
    def test_big_ints_are_kept_as_text(self) -> None:
        """A hyperparameter int past 64 bits is kept, as its exact text, nested too."""
        flat = flatten_params({"seed": 2**70, "opt": {"seed": 10**30}, "ok": 2**63 - 1})
        assert flat == {"seed": str(2**70), "opt.seed": str(10**30), "ok": 2**63 - 1}

    def test_a_metric_past_float_range_names_its_key(self, spool: Path) -> None:
        """log_metrics of 10**400 raises InvalidValueError naming the key; nothing logged."""
        run = rank(spool, 0, 1)
        with pytest.raises(InvalidValueError, match=r"'train/k'.*beyond the range"):
            run.log_metrics({"ok": 1.0, "k": 10**400}, step=0, prefix="train")
        run.close()

    def test_big_int_params_reach_the_spool(self, spool: Path) -> None:
        """log_hyperparams with 2**70 (and nested) never raises OverflowError into training."""
        run = rank(spool, 0, 1)
        run.log_hyperparams({"seed": 2**70, "opt": {"seed": 10**30}})
        run.close()
        (seg,) = sorted((spool / "ranks").glob("*/*.rlog"))
        (params,) = [e for e in read_segment(seg).events if type(e).__name__ == "Params"]
        assert params.all() == {"seed": str(2**70), "opt.seed": str(10**30)}

    def test_lists_of_scalars_stay_lists(self) -> None:
        """Lists and tuples of scalars stay lists; anything else in a list becomes JSON text."""
        flat = flatten_params({"betas": (0.9, 0.95), "ids": [1, 2], "mixed": [{"a": 1}, 2]})
        assert flat == {"betas": [0.9, 0.95], "ids": [1, 2], "mixed": '[{"a": 1}, 2]'}


class TestListsInBackends:
    """``optim.betas = [0.9, 0.95]`` as each backend's users expect it."""

    CFG: ClassVar[dict[str, Any]] = {"optim": {"betas": [0.9, 0.95], "lr": 0.1}, "tags": ["a", "b"]}

    def _spool(self, spool: Path) -> None:
        run = rank(spool, 0, 1)
        run.log_hyperparams(self.CFG)
        log_steps(run, range(2))
        run.close()

    def test_jsonl(self, spool: Path, tmp_path: Path) -> None:
        """JSONL: a JSON array in the params line."""
        self._spool(spool)
        ship(spool, tmp_path / "o.jsonl")
        (params,) = [x["params"] for x in read_jsonl(tmp_path / "o.jsonl") if "params" in x]
        assert params == {"optim.betas": [0.9, 0.95], "optim.lr": 0.1, "tags": ["a", "b"]}

    def test_parquet_and_replay(self, spool: Path, tmp_path: Path) -> None:
        """Parquet: the list's JSON text in ``value``; a replay ships the list as live did."""
        import pyarrow.parquet as pq

        from ranklog.archive import compact, replay
        from ranklog.shippers.targets.jsonl import JsonlTarget

        self._spool(spool)
        compact(spool, tmp_path / "pq")
        table = pq.read_table(tmp_path / "pq" / "params")
        got = dict(zip(table["name"].to_pylist(), table["value"].to_pylist(), strict=True))
        assert json.loads(got["optim.betas"]) == [0.9, 0.95]
        ship(spool, tmp_path / "live.jsonl")
        replay(tmp_path / "pq", JsonlTarget(tmp_path / "again.jsonl"))
        assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "live.jsonl").read_bytes()

    def test_mlflow(self, spool: Path, tmp_path: Path) -> None:
        """MLflow: the param is the list's JSON text."""
        pytest.importorskip("mlflow")
        from mlflow.tracking import MlflowClient

        from ranklog.shippers import Shipper, make_target

        self._spool(spool)
        uri = f"sqlite:///{tmp_path / 'm.db'}"
        Shipper(str(spool), make_target(f"mlflow:{uri}", spool), start_grace=0).run_forever(
            once=True
        )
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert json.loads(run.data.params["optim.betas"]) == [0.9, 0.95]
        assert run.data.params["tags"] == '["a", "b"]'

    def test_wandb(self, spool: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """W&B: the run's config holds the list as a list."""
        pytest.importorskip("wandb")
        from ranklog.shippers import Shipper
        from ranklog.shippers.targets._wandb_log import iter_records
        from ranklog.shippers.targets.wandb import WandbTarget

        from .test_wandb import _offline_env

        _offline_env(monkeypatch, tmp_path)
        self._spool(spool)
        target = WandbTarget("p", tmp_path, mode="offline")
        Shipper(str(spool), target, start_grace=0).run_forever(once=True)
        config: dict[str, Any] = {}
        for path in tmp_path.glob("wandb/offline-run-*/run-*.wandb"):
            for rec in iter_records(path):
                kind = rec.WhichOneof("record_type")
                if kind in ("config", "run"):
                    cfg = rec.config if kind == "config" else rec.run.config
                    for item in cfg.update:
                        config[item.key] = json.loads(item.value_json)
        assert config["optim"]["betas"] == [0.9, 0.95]
        assert config["tags"] == ["a", "b"]

    def test_tensorboard(self, spool: Path, tmp_path: Path) -> None:
        """TensorBoard: the hparam is the list's JSON text."""
        pytest.importorskip("tensorboard")
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.plugins.hparams import metadata

        from ranklog.shippers import Shipper, make_target

        self._spool(spool)
        Shipper(str(spool), make_target(f"tensorboard:{tmp_path / 'tb'}", spool),
                start_grace=0).run_forever(once=True)  # fmt: skip
        acc = ea.EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
        info = metadata.parse_session_start_info_plugin_data(content)
        assert info.hparams["optim.betas"].string_value == "[0.9, 0.95]"


class TestParamsAfterARestart:
    def test_a_new_incarnation_params_go_before_its_first_step(
        self, spool: Path, tmp_path: Path
    ) -> None:
        """A rank back from a restart logs params: written before its next step, live and replay."""
        from ranklog.archive import compact, replay
        from ranklog.shippers.targets.jsonl import JsonlTarget

        out = tmp_path / "live.jsonl"
        first = rank(spool, 0, 1)
        first.log_hyperparams({"lr": 0.1})
        log_steps(first, range(5))
        first.close()
        ship(spool, out)  # steps 0-4 shipped by a shipper that then stops
        again = rank(spool, 0, 1)  # the job resumed from its checkpoint after step 4
        again.log_hyperparams({"lr": 0.5})
        log_steps(again, range(5, 8))
        again.close()
        ship(spool, out)
        order = [("params", x["params"]) if "params" in x else ("step", x["step"])
                 for x in read_jsonl(out) if "ranklog" not in x]  # fmt: skip
        assert order == [("params", {"lr": 0.1}), *[("step", s) for s in range(5)],
                         ("params", {"lr": 0.5}), *[("step", s) for s in range(5, 8)]]  # fmt: skip
        compact(spool, tmp_path / "pq")
        replay(tmp_path / "pq", JsonlTarget(tmp_path / "again.jsonl"))
        assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()
