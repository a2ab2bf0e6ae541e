"""The public surface: what ``import ranklog`` exposes and what it costs."""

from __future__ import annotations

import json

import ranklog
import ranklog.errors
import ranklog.producer
import ranklog.ray
import ranklog.schemas
import ranklog.spool

from .conftest import run_python

HEAVY = (
    "pyarrow", "wandb", "mlflow", "tensorboard", "ray", "torch", "numpy", "pandas", "watchdog",
    "ranklog.shippers",
)  # fmt: skip
PUBLIC = (ranklog, ranklog.errors, ranklog.producer, ranklog.ray, ranklog.schemas, ranklog.spool)


class TestPublicAPI:
    def test_all_names_exist(self) -> None:
        """Every name in each public module's ``__all__`` is importable from it."""
        for module in PUBLIC:
            for name in module.__all__:
                assert hasattr(module, name), f"{module.__name__}.{name}"

    def test_all_is_unique(self) -> None:
        """``__all__`` lists have no duplicates (ruff's RUF022 keeps them sorted)."""
        for module in PUBLIC:
            assert len(set(module.__all__)) == len(module.__all__)

    def test_top_level_reexports(self) -> None:
        """The top-level package re-exports init, Run and every error."""
        assert ranklog.init is ranklog.producer.init
        assert ranklog.Run is ranklog.producer.Run
        for name in ranklog.errors.__all__:
            assert getattr(ranklog, name) is getattr(ranklog.errors, name)

    def test_pinned_producer_names(self) -> None:
        """The producer API names pinned by the design exist on Run."""
        for name in (
            "log_metrics",
            "log_timing",
            "timer",
            "log_text",
            "log_hyperparams",
            "step_end",
            "close",
            "flush",
        ):
            assert callable(getattr(ranklog.Run, name))


class TestErrors:
    def test_tree(self) -> None:
        """Every error derives from RanklogError, and input errors from the builtin they mean."""
        e = ranklog.errors
        for name in e.__all__:
            cls = getattr(e, name)
            if name != "RanklogWarning":
                assert issubclass(cls, e.RanklogError), name
        assert issubclass(e.InvalidValueError, TypeError)
        assert issubclass(e.InvalidStepError, ValueError)
        assert issubclass(e.ConfigError, ValueError)
        assert issubclass(e.ExtraMissingError, ImportError)

    def test_extra_missing_names_the_install_command(self) -> None:
        """ExtraMissingError says which pip install fixes it."""
        err = ranklog.ExtraMissingError("wandb", "wandb")
        assert "pip install 'ranklog[wandb]'" in str(err)


class TestImportCost:
    def test_import_is_light(self) -> None:
        """``import ranklog`` pulls in no backend, no pyarrow, no numpy."""
        code = (
            "import sys, json, ranklog; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
        )
        proc = run_python(code)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == []

    def test_ray_helpers_import_lazily(self) -> None:
        """``import ranklog.ray`` imports ray only once its ``init()`` is called."""
        code = "import sys, json, ranklog.ray; print(json.dumps('ray' in sys.modules))"
        proc = run_python(code)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) is False
