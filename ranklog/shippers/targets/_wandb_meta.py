"""The W&B target's run records: metric definitions, summary values, the code's diff.

A part of :class:`~ranklog.shippers.targets.wandb.WandbTarget`. Definitions and summary
values go to the live run and to every later session of it; the diff is a ``git-diffs``
artifact, as NeMo RL's W&B logger logs it. All but the diff are kept in the run's hidden
config ``_ranklog_meta`` (:data:`META_KEY`), which ``flush`` waits for: durable as the
config is, and read back by a restarted shipper.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ranklog.schemas import ParamScalar
from ranklog.shippers._meta import records
from ranklog.shippers.targets._wandb_config import META_KEY, RUN_KEY, nest
from ranklog.shippers.targets._wandb_media import wandb_module

__all__ = ["SUMMARY", "WandbRecords", "meta_of"]

#: the key prefix of a summary record
SUMMARY: Final = "summary/"


def meta_of(raw: Any) -> dict[str, ParamScalar]:
    """The run records a W&B config's ``_ranklog_meta`` holds ({} when none or unreadable)."""
    if not isinstance(raw, str):
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        return {}
    return dict(meta) if isinstance(meta, dict) else {}


class WandbRecords:
    """Run records for :class:`~ranklog.shippers.targets.wandb.WandbTarget` (a mixin)."""

    project: str
    _meta: dict[str, ParamScalar]
    _config: dict[str, Any]

    if TYPE_CHECKING:  # the target's own

        def _require(self, rank: int | None) -> Any: ...
        def _start(self, held: Any) -> None: ...
        def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...
        def _mark(self) -> dict[str, str]: ...

    def write_meta(self, meta: dict[str, ParamScalar]) -> None:
        """Run records: ``define_metric`` calls, summary values, the code's git state.

        Definitions and summary values go to the live run, and to every later session of
        it; the code's diff is a ``git-diffs`` artifact (as NeMo RL's W&B logger logs it).
        All but the diff are kept in the run's hidden config ``_ranklog_meta``, which
        :meth:`flush` waits for: durable as the config is.
        """
        main = self._require(None)
        kept = {k: v for k, v in meta.items() if k != "code/diff"}
        self._meta.update(kept)
        if main.run is None:
            self._start(main)  # gives every record known to the new run
        else:
            self._apply_meta(main, kept)
            if kept:
                self._call(main.run.config.update, {META_KEY: self._meta_json()},
                           allow_val_change=True)  # fmt: skip
                main.config_wait[META_KEY] = self._meta_json()
        if meta.get("code/diff"):
            self._log_diff(main, meta)

    def _init_config(self) -> dict[str, Any]:
        config = {**nest(self._config), RUN_KEY: self._mark()}
        if self._meta:
            config[META_KEY] = self._meta_json()
        return config

    def _meta_json(self) -> str:
        return json.dumps(self._meta, sort_keys=True)

    def _apply_meta(self, held: Any, meta: Mapping[str, ParamScalar]) -> None:
        """Give ``meta``'s definitions and summary values to the live run of ``held``."""
        summary: dict[str, Any] = {}
        for key, value in meta.items():
            kind, _, name = key.partition("/")
            if kind == "define" and isinstance(value, str):
                self._call(held.run.define_metric, name, **json.loads(value))
                held.defined.add(name)
            elif kind == "summary":
                summary[name] = value
        if summary:
            self._call(held.run.summary.update, summary)

    def _summary_logged(self, held: Any, row: Mapping[str, Any]) -> None:
        """Keys with a summary value that a later step logged: W&B's own summary (the last
        value logged) holds from now on; a later session is not given the older value."""
        for k in row:
            self._meta.pop(SUMMARY + k, None)
        if held.run is not None:
            self._call(held.run.config.update, {META_KEY: self._meta_json()},
                       allow_val_change=True)  # fmt: skip
            held.config_wait[META_KEY] = self._meta_json()

    def _log_diff(self, held: Any, meta: Mapping[str, ParamScalar]) -> None:
        """The diff against HEAD as NeMo RL logs it: artifact ``git-diffs-<project>-<id>``
        of type ``git-diffs`` holding ``uncommitted_changes_diff.txt``, with the commit,
        branch and dirty flag as its metadata."""
        wandb, run = wandb_module(), held.run
        files = Path(run.dir)
        files.mkdir(parents=True, exist_ok=True)
        path = files / "uncommitted_changes_diff.txt"
        path.write_text(str(meta["code/diff"]))
        info = records(self._meta, "code")
        artifact = wandb.Artifact(
            name=f"git-diffs-{self.project}-{held.wid}", type="git-diffs", metadata=info
        )
        artifact.add_file(str(path), name="uncommitted_changes_diff.txt", policy="immutable")
        self._call(run.log_artifact, artifact)
