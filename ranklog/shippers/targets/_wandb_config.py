"""A W&B run's config: ranklog's dotted params as the nested config W&B shows, and back.

:func:`nest` turns ``{"optim.lr": 1e-3}`` into ``{"optim": {"lr": 1e-3}}`` for
``wandb.init(config=...)``; :func:`scan_offline` reads an offline run's ``.wandb`` files
back into the steps it holds and the params it holds, flattened again, and the run's
``_ranklog`` config (which ranklog run it holds; W&B's UI hides keys that start with
``_``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from ranklog.shippers._held import StepSet
from ranklog.shippers.targets._wandb_log import LogReader

__all__ = ["META_KEY", "RUN_KEY", "config_set", "flat_params", "nest", "scan_offline"]


#: the config key under which a W&B run records the ranklog run it holds (W&B's UI hides
#: config keys that start with "_")
RUN_KEY: Final = "_ranklog"
#: the config key under which a W&B run keeps ranklog's run records (definitions, summary
#: values, the code's commit), as JSON text: a later session gives them to W&B again
META_KEY: Final = "_ranklog_meta"


def scan_offline(
    root: Path, wid: str, mark: dict[str, Any] | None = None
) -> tuple[StepSet, dict[str, Any]]:
    """(steps held, config) over every offline directory of W&B run ``wid`` under ``root``.

    ``mark``: filled with the run's ``_ranklog`` config (which ranklog run it holds).
    """
    steps = StepSet()
    config: dict[str, Any] = {}
    for path in sorted(root.glob(f"wandb/offline-run-*/run-{wid}.wandb")):
        for rec in LogReader(path).read():
            if rec.WhichOneof("record_type") == "history":
                steps.add(rec.history.step.num)
            for k, v in config_set(rec):
                if k.startswith(RUN_KEY + "."):
                    if mark is not None:
                        mark[k[len(RUN_KEY) + 1 :]] = v
                elif k != "_wandb":
                    config[k] = v
    return steps, config


def config_set(rec: Any) -> list[tuple[str, Any]]:
    """The config items a record sets: a config record's, or those the run record starts with."""
    kind = rec.WhichOneof("record_type")
    if kind not in ("config", "run"):
        return []
    cfg = rec.config if kind == "config" else rec.run.config
    out: list[tuple[str, Any]] = []
    for item in cfg.update:
        key = item.key or ".".join(item.nested_key)
        value = json.loads(item.value_json)
        out += _flat(key, value) if key != "_wandb" else [(key, value)]
    return out


def _flat(key: str, value: Any) -> list[tuple[str, Any]]:
    """A nested config item as the dotted params it was made of (see :func:`nest`)."""
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _flat(f"{key}.{k}", v)]
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in _flat(f"{key}.{i}", v)]
    return [(key, value)]


def nest(params: dict[str, Any]) -> dict[str, Any]:
    """Dotted params as the nested config they came from: ``a.b`` -> ``{"a": {"b": ...}}``.

    Keys ``0..n-1`` under one parent become a list (a config's list, flattened by index).
    A key that is both a value and a parent (``a`` and ``a.b``) stays dotted.
    """
    tree: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for key, value in params.items():
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                flat[key] = value
                break
            node = child
        else:
            if isinstance(node.get(parts[-1]), dict):
                flat[key] = value
            else:
                node[parts[-1]] = value
    return {**_lists(tree), **flat}


def _lists(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        if isinstance(v, dict):
            v = _lists(v)
            if v and set(v) == {str(i) for i in range(len(v))}:
                v = [v[str(i)] for i in range(len(v))]
        out[k] = v
    return out


def flat_params(params: dict[str, Any]) -> dict[str, Any]:
    """Params as :func:`scan_offline` reads them back from the config (a list by index)."""
    return dict(p for key, value in params.items() for p in _flat(key, value))
