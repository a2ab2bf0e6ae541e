"""Targets declare themselves; this module finds them and builds one from a ``--to`` spec.

A target module (``ranklog/shippers/targets/<kind>.py``, or any module a
``ranklog.targets`` entry point names) defines one :class:`TargetKind`, ``TARGET``:
its kind, what the argument after the colon means, the :class:`Option` s it takes
and the function that builds it. Everything else is derived from that one
declaration: the ``ranklog ship``/``replay`` flags and their help, the flags a
multi-target ``ranklog ship`` passes on to its per-target processes, and the keys
``ranklog.nemo`` reads from NeMo RL's logger config. A target's backend library
is imported only when the target is built (``ExtraMissingError`` names the extra
to install). ``docs/targets.md`` walks through writing one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Final

from ranklog.errors import ConfigError
from ranklog.shippers._leave_out import parse_leave_out
from ranklog.shippers._target import Target

__all__ = [
    "ENTRY_POINT_GROUP",
    "Option",
    "TargetContext",
    "TargetKind",
    "all_options",
    "default_name",
    "make_target",
    "target_kinds",
]

log = logging.getLogger("ranklog.ship")

#: the entry point group through which other packages add targets
ENTRY_POINT_GROUP = "ranklog.targets"
#: the built-in targets, found by listing (never imported by name: the engine below them)
_TARGETS_PACKAGE = "ranklog.shippers.targets"
_TARGETS_DIR = Path(__file__).parent / "targets"


@dataclass(frozen=True, slots=True)
class Option:
    """One option a target takes: its flag, its help, its type and its NeMo config key."""

    #: Python name, e.g. ``run_name``; the flag is ``--run-name``
    name: str
    help: str
    #: converts the flag's text (``str``, ``int``, ``float``); ``bool`` makes a switch
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    #: the key of this option in the target's section of NeMo RL's logger config
    nemo: str | None = None

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str) -> Any:
        """The value of ``text`` for this option; :class:`ConfigError` when it does not fit."""
        try:
            value = self.type(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.flag} {text!r}: {exc}") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{self.flag} {text!r}: expected one of {', '.join(self.choices)}")
        return value


#: the option every target takes: kinds of values it is not given (:mod:`._leave_out`)
LEAVE_OUT: Final = Option(
    "leave_out",
    "kinds of values this target is not given, comma-separated: histograms, texts, tables, "
    "images, derived (slowest_rank, ranks_reporting), code (default: none)",
    metavar="KINDS",
)


@dataclass(frozen=True, slots=True)
class TargetContext:
    """What every target may use besides its own options."""

    #: the spool (or dataset) being shipped: where defaults live (a sqlite store, W&B files)
    spool: Path
    #: the shipper also sends each rank's own values (``--per-rank``)
    per_rank: bool = False
    #: the names a replay writes (``--names GLOB``; ``*``: every name): recorded with
    #: the steps, so that a target never mixes two selections of one run
    names: str = "*"
    #: write this run after another one the target holds (``--append-run``; JSONL)
    append_run: bool = False


Build = Callable[[str, TargetContext, Mapping[str, Any]], Target]


@dataclass(frozen=True, slots=True)
class TargetKind:
    """A target's declaration (a module's ``TARGET``)."""

    #: the part of a spec before the colon
    kind: str
    #: how the argument after the colon reads in help (``DIR``, ``URI``); "" when none
    arg: str
    #: one line for ``--help``
    help: str
    #: ``build(arg, context, options)``: the options are this kind's, parsed, None when unset
    build: Build
    options: tuple[Option, ...] = ()
    #: the argument may be left out (``console``, ``mlflow:``)
    arg_optional: bool = False
    #: the pip extra its backend needs
    extra: str | None = None
    #: NeMo RL: the logger config's section for this backend (``wandb`` -> ``wandb_enabled``)
    nemo_section: str | None = None
    #: NeMo RL: the spec's argument from (section, the backend's dir ``log_dir/<section>``)
    nemo_arg: Callable[[Mapping[str, Any], Path], str] | None = field(default=None)
    #: NeMo RL: option values that follow from (section, backend dir) beyond the ``nemo`` keys
    nemo_options: Callable[[Mapping[str, Any], Path], dict[str, Any]] | None = field(default=None)

    def nemo_command(self, cfg: Mapping[str, Any], log_dir: Path) -> list[str] | None:
        """``--to`` and option flags for NeMo RL's logger config (None: not enabled there).

        The backend writes under ``log_dir/<section>``, as NeMo RL's Logger places it.
        """
        if self.nemo_section is None or not cfg.get(f"{self.nemo_section}_enabled"):
            return None
        return self.nemo_backend_command(
            cfg.get(self.nemo_section) or {}, log_dir / self.nemo_section
        )

    def nemo_backend_command(self, section: Mapping[str, Any], backend_dir: Path) -> list[str]:
        """``--to`` and option flags for one NeMo backend section writing under ``backend_dir``."""
        arg = self.nemo_arg(section, backend_dir) if self.nemo_arg is not None else ""
        values = {o.name: section.get(o.nemo) for o in self.options if o.nemo is not None}
        if self.nemo_options is not None:
            values.update(self.nemo_options(section, backend_dir))
        flags = ["--to", f"{self.kind}:{arg}" if arg else self.kind]
        for o in self.options:
            value = values.get(o.name)
            if isinstance(value, list | tuple):  # NeMo's lists (W&B tags): one flag, commas
                value = ",".join(map(str, value))
            if value is None or value == "" or value is False:
                continue
            flags += [o.flag] if value is True else [o.flag, str(value)]
        return flags

    @property
    def usage(self) -> str:
        """``kind:ARG``, ``kind[:ARG]`` or ``kind``."""
        if not self.arg:
            return self.kind
        return f"{self.kind}[:{self.arg}]" if self.arg_optional else f"{self.kind}:{self.arg}"

    def make(self, arg: str, context: TargetContext, values: Mapping[str, Any]) -> Target:
        """Build the target with the values of this kind's options (others are ignored)."""
        if not arg and self.arg and not self.arg_optional:
            raise ConfigError(f"{self.kind} target needs {self.arg}: {self.usage}")
        mine = {o.name: values.get(o.name) for o in self.options}
        for o in self.options:
            value = mine[o.name]
            if value is not None and o.choices is not None and value not in o.choices:
                raise ConfigError(f"{o.flag} {value!r}: expected one of {', '.join(o.choices)}")
        leave_out = values.get(LEAVE_OUT.name)
        kinds = parse_leave_out(leave_out) if isinstance(leave_out, str) else frozenset()
        target = self.build(arg, context, mine)
        if not kinds:
            return target
        from ranklog.shippers._leave_out import LeaveOut

        return LeaveOut(target, kinds)


@functools.cache
def target_kinds() -> dict[str, TargetKind]:
    """Every target: the modules of ``ranklog.shippers.targets``, then entry points."""
    found: dict[str, TargetKind] = {}
    for mod in pkgutil.iter_modules([str(_TARGETS_DIR)]):
        if mod.name.startswith("_"):
            continue
        _add(found, importlib.import_module(f"{_TARGETS_PACKAGE}.{mod.name}"), mod.name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken plug-in must not break the built-in targets
            log.warning("target entry point %s (%s) cannot be loaded: %s", ep.name, ep.value, exc)
            continue
        _add(found, loaded, ep.value)
    return found


def _add(found: dict[str, TargetKind], obj: Any, where: str) -> None:
    kind = getattr(obj, "TARGET", obj)
    if not isinstance(kind, TargetKind):
        log.warning("%s declares no ranklog TargetKind (TARGET); ignored", where)
        return
    if kind.kind in found:
        log.warning("target kind %r of %s is already taken; ignored", kind.kind, where)
        return
    found[kind.kind] = kind


def all_options() -> dict[str, tuple[Option, list[str]]]:
    """Every option name -> (its declaration, the kinds that take it), for the CLI.

    Kinds that share an option name must declare the same type and choices.
    """
    out: dict[str, tuple[Option, list[str]]] = {
        LEAVE_OUT.name: (LEAVE_OUT, [k.kind for k in target_kinds().values()])
    }
    for kind in target_kinds().values():
        for opt in kind.options:
            seen = out.get(opt.name)
            if seen is None:
                out[opt.name] = (opt, [kind.kind])
                continue
            if (seen[0].type, seen[0].choices) != (opt.type, opt.choices):
                raise ConfigError(
                    f"target {kind.kind!r} declares option {opt.name!r} unlike "
                    f"{', '.join(seen[1])}: same name, another type or choices"
                )
            seen[1].append(kind.kind)
    return out


def make_target(
    spec: str,
    spool: str | os.PathLike[str],
    options: Mapping[str, Any] | None = None,
    *,
    per_rank: bool = False,
    names: str | None = None,
    append_run: bool = False,
) -> Target:
    """Build the target a ``--to`` spec names, with the option values that apply to it.

    ``names``: a replay's ``--names`` glob; ``append_run``: ``--append-run``.
    """
    kind, _, arg = spec.partition(":")
    found = target_kinds().get(kind)
    if found is None:
        raise ConfigError(
            f"unknown target {spec!r}: expected one of "
            + ", ".join(k.usage for k in target_kinds().values())
        )
    context = TargetContext(Path(spool), per_rank, names or "*", append_run)
    return found.make(arg, context, options or {})


def default_name(spec: str) -> str:
    """A stable cursor and lease name for a target: its kind and a short hash of ``spec``.

    The shipper passes the target's identity (``jsonl:/real/path``), so that two
    spellings of one target share one cursor and one lease; older cursors were named
    after the spec as typed (found again by :meth:`Shipper` on the first restart).
    """
    kind = spec.partition(":")[0] or "target"
    if spec == kind:
        return kind
    digest = hashlib.sha1(spec.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{kind}-{digest}"
