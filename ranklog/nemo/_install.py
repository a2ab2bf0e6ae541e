"""``install()``: NeMo RL's own modules import ranklog's logger and timer, unedited.

NeMo RL builds its ``Logger`` inside ``nemo_rl/algorithms/*`` (``from
nemo_rl.utils.logger import Logger``). After :func:`install`, the import system answers
``nemo_rl.utils.logger`` with :mod:`ranklog.nemo` and ``nemo_rl.utils.timer`` with
:mod:`ranklog.nemo.timer`, so every NeMo module that imports them afterwards gets
ranklog's. Call it before anything of NeMo RL is imported (``python -m ranklog.nemo
examples/run_grpo.py ...`` does).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

from ranklog.errors import ConfigError

__all__ = ["ALIASES", "install", "uninstall"]

#: NeMo RL's module -> the ranklog module that stands in for it
ALIASES = {
    "nemo_rl.utils.logger": "ranklog.nemo",
    "nemo_rl.utils.timer": "ranklog.nemo.timer",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds NeMo's module names and loads ranklog's modules under them."""

    def __init__(self, aliases: dict[str, str]) -> None:
        self.aliases = aliases

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.aliases:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.aliases[spec.name])
        self._own_spec = module.__spec__  # the import system sets the alias's; put it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec


def _finder() -> _AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)


def install(*, timer: bool = True) -> None:
    """Make ``nemo_rl.utils.logger`` (and ``nemo_rl.utils.timer``) resolve to ranklog's.

    Raises :class:`~ranklog.errors.ConfigError` when NeMo's own module was imported
    already: the modules that imported it would keep it.
    """
    aliases = {k: v for k, v in ALIASES.items() if timer or not k.endswith(".timer")}
    for name, ours in aliases.items():
        loaded = sys.modules.get(name)
        if loaded is not None and loaded is not sys.modules.get(ours):
            raise ConfigError(
                f"{name} was imported before ranklog.nemo.install(): call install() first "
                "(before importing anything of nemo_rl), or run `python -m ranklog.nemo SCRIPT`"
            )
    if _finder() is None:
        sys.meta_path.insert(0, _AliasFinder(aliases))


def uninstall() -> None:
    """Undo :func:`install` (NeMo's modules load normally again on their next import)."""
    finder = _finder()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    for name in finder.aliases:
        sys.modules.pop(name, None)
