"""The house rules, checked on the source: layers, no import cycles, one error tree."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import ranklog.errors

from .conftest import ROOT

PACKAGE = ROOT / "ranklog"

#: imported by anything: they import nothing of ranklog's layers
BASE = {"ranklog.errors", "ranklog._version", "ranklog._fs", "ranklog._proc", "ranklog._kept"}
#: layer -> the layers its modules may import (BASE always allowed)
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "spool": {"schemas"},
    "producer": {"schemas", "spool"},
    "shippers": {"schemas", "spool"},
    "targets": {"schemas", "spool", "shippers"},
    "archive": {"schemas", "spool", "shippers"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    """The pipeline layer of a ranklog module (None: an application module on top)."""
    if module in BASE:
        return "base"
    if module.startswith("ranklog.shippers.targets"):
        return "targets"
    for name in ("schemas", "spool", "producer", "shippers", "archive"):
        if module == f"ranklog.{name}" or module.startswith(f"ranklog.{name}."):
            return name
    return None


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str], me: str | None = None) -> Iterator[tuple[str, int]]:
    """Every ranklog module ``path`` imports (anywhere in it, TYPE_CHECKING included)."""
    me = me or module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ranklog"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]).strip(".")
            if not base.startswith("ranklog"):
                continue
            yield base, node.lineno
            for alias in node.names:  # ``from ranklog.shippers import targets``: a module
                if f"{base}.{alias.name}" in known:
                    yield f"{base}.{alias.name}", node.lineno


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {i for i, _ in imports(p, known) if i != m} for m, p in mods.items()}


def layer_violations(mods: dict[str, Path]) -> list[str]:
    """Imports from a layer into one it may not use, as ``file:line: ...`` lines."""
    wrong = []
    for mod, path in mods.items():
        mine = layer(mod)
        if mine is None:
            continue
        allowed = {"base", mine} | ALLOWED.get(mine, set())
        for imported, line in imports(path, set(mods), mod):
            theirs = layer(imported)
            if theirs is None or theirs not in allowed:
                wrong.append(f"{path}:{line}: {mine} imports {imported}")
    return wrong


class TestLayers:
    def test_layers_import_only_below(self) -> None:
        """schemas import nothing of ranklog, spool only schemas, and so on up the pipeline."""
        wrong = layer_violations(modules())
        assert not wrong, "\n".join(wrong)

    def test_producer_never_imports_shippers_targets_or_archive(self) -> None:
        """The training side imports none of the shipping side (its hot path stays light)."""
        for mod, deps in graph().items():
            if layer(mod) == "producer":
                assert not {d for d in deps if layer(d) in ("shippers", "targets", "archive")}

    def test_a_violation_is_reported(self, tmp_path: Path) -> None:
        """A spool module importing the engine (as replay once did) is reported, with its line."""
        bad = tmp_path / "_bad.py"
        bad.write_text("import os\n\ndef f():\n    from ranklog.shippers import Shipper\n")
        wrong = layer_violations({"ranklog.spool._bad": bad})
        assert wrong == [f"{bad}:4: spool imports ranklog.shippers"]


#: the modules that decide what the engine decides (docs/architecture.md, one rule per module)
ENGINE_RULES = {
    "ranklog.shippers._waited", "ranklog.shippers._tail", "ranklog.shippers._lost",
    "ranklog.shippers._params", "ranklog.shippers._reduce", "ranklog.shippers._finish",
    "ranklog.shippers._steps", "ranklog.shippers._gather",
}  # fmt: skip


def rule_importers(mods: dict[str, Path]) -> list[str]:
    """Modules of archive/ that import a rule of the engine (they must run the engine)."""
    wrong = []
    for mod, path in mods.items():
        if layer(mod) == "archive":
            for imported, line in imports(path, set(mods), mod):
                if imported in ENGINE_RULES:
                    wrong.append(f"{path}:{line}: {mod} imports {imported}")
    return wrong


class TestOneEngine:
    def test_the_archive_runs_the_engine_and_decides_nothing(self) -> None:
        """archive/ imports none of the modules holding the engine's rules (completeness,
        incarnations, late values, lost frames, params' step, reduction): compaction and
        replay run the Shipper, and the steps table keeps what it decided."""
        assert set(ENGINE_RULES) <= set(modules())
        wrong = rule_importers(modules())
        assert not wrong, "\n".join(wrong)

    def test_a_rule_imported_by_the_archive_is_reported(self, tmp_path: Path) -> None:
        """A replay module reducing on its own (as the columnar replay once did) is named."""
        bad = tmp_path / "_bad.py"
        bad.write_text("from ranklog.shippers._reduce import fsums\n")
        mods = {**modules(), "ranklog.archive._bad": bad}
        assert rule_importers(mods) == [f"{bad}:1: ranklog.archive._bad imports "
                                        "ranklog.shippers._reduce"]  # fmt: skip


class TestNoCycles:
    def test_no_import_cycles(self) -> None:
        """No module reaches itself through imports, lazy and TYPE_CHECKING ones included."""
        g = graph()
        cycles = [c for c in _strongly_connected(g) if len(c) > 1]
        assert not cycles, cycles

    def test_detects_a_cycle(self) -> None:
        """The cycle finder itself finds a cycle when there is one."""
        assert [sorted(c) for c in _strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()})
                if len(c) > 1] == [["a", "b"]]  # fmt: skip


def _strongly_connected(g: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for start in g:
        if start in index:
            continue
        work = [(start, iter(sorted(g.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in g:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(g.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                out.append(comp)
    return out


# -- the error tree ---------------------------------------------------------------------------

#: raises outside the tree, each with why it is fine (anything else fails the test)
ALLOWED_RAISES: dict[tuple[str, str], str] = {
    ("ranklog/spool/_writer.py", "OSError"): "a short write, caught at once like any failed write",
    ("ranklog/cli.py", "ValueError"): "a bad --steps value, caught at once for argparse",
    ("ranklog/cli.py", "ArgumentTypeError"): "argparse's protocol: a usage error, exit 2",
    ("ranklog/_cli_run.py", "ImportError"): "an import hook's protocol: pandas shown absent to "
    "pyarrow's one optional check, in compact/replay processes",
    ("ranklog/archive/__init__.py", "AttributeError"): "a module __getattr__'s protocol "
    "(replay imported on first use)",
    ("ranklog/producer/_gpu.py", "ValueError"): "an unreadable Prometheus line, caught by the "
    "GPU sampler (which backs off and warns once)",
    ("ranklog/nemo/__main__.py", "SystemExit"): "`python -m ranklog.nemo` without a script",
    # ranklog.nemo keeps NeMo RL's exceptions: NeMo programs catch and test for them
    ("ranklog/nemo/_backends.py", "ValueError"): "NeMo's monitor: Ray not initialised",
    ("ranklog/nemo/_plots.py", "ValueError"): "NeMo's timeline: timeline_interval <= 0",
    ("ranklog/nemo/timer.py", "ValueError"): "NeMo's Timer: start twice, stop idle, bad op",
    ("ranklog/nemo/timer.py", "KeyError"): "NeMo's Timer: no timings for a label",
    ("ranklog/nemo/timer.py", "IndexError"): "NeMo's Timer: a label with no measurement",
    ("ranklog/nemo/timer.py", "RuntimeError"): "TimeoutChecker.mark_iteration before start "
    "(NeMo's fails there too)",
}


def _drawn_tree() -> dict[str, str | None]:
    """class -> parent, read from the drawing in ranklog.errors' docstring."""
    doc = ranklog.errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^(\s*)((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+(?:Error|Warning))\b", line)
        if m is None or not line.startswith("    "):
            continue
        depth = len(m.group(2)) // 4 + (1 if ("├" in line or "└" in line) else 0)
        name = m.group(3)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


def _raised() -> Iterator[tuple[str, int, str]]:
    """(file, line, class name) of every ``raise Class(...)`` in ranklog/."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", None)
            if name is not None and name[:1].isupper():
                yield str(path.relative_to(ROOT)), node.lineno, name


class TestErrorTree:
    def test_drawing_matches_the_classes(self) -> None:
        """Every error class is drawn under its real base class, and nothing else is drawn."""
        drawn = _drawn_tree()
        e = ranklog.errors
        assert set(drawn) == set(e.__all__)
        for name, parent in drawn.items():
            cls = getattr(e, name)
            if parent is None:
                assert name in ("RanklogError", "RanklogWarning"), name
            else:
                assert cls.__mro__[1] is getattr(e, parent), f"{name} drawn under {parent}"

    def test_each_branch_has_an_exit_code(self) -> None:
        """The CLI's exit codes: distinct per branch, 2 for bad input (as argparse)."""
        e = ranklog.errors
        codes = {
            cls: cls.exit_code
            for cls in (e.ConfigError, e.SpoolError, e.ArchiveError, e.TargetError,
                        e.ExtraMissingError)
        }  # fmt: skip
        assert len(set(codes.values())) == len(codes)
        assert e.ConfigError.exit_code == 2 and e.RanklogError.exit_code == 1

    def test_every_raise_is_in_the_tree(self) -> None:
        """A raise in ranklog/ uses a class of the tree, or one listed with its reason here."""
        e = ranklog.errors
        wrong = []
        for path, line, name in _raised():
            cls = getattr(e, name, None)
            if cls is not None and issubclass(cls, e.RanklogError):
                continue
            if (path, name) in ALLOWED_RAISES:
                continue
            wrong.append(f"{path}:{line}: raise {name}")
        assert not wrong, "\n".join(wrong)

    def test_the_raise_check_can_fail(self) -> None:
        """The scan sees raises of builtins (the allowed ones prove it)."""
        seen = {(p, n) for p, _, n in _raised()}
        assert set(ALLOWED_RAISES) <= seen
        assert all(n in dir(builtins) or n == "ArgumentTypeError" for _, n in ALLOWED_RAISES)


@pytest.mark.parametrize("name", ranklog.errors.__all__)
def test_documented_in_one_place(name: str) -> None:
    """Each error class has a docstring of its own."""
    assert getattr(ranklog.errors, name).__doc__
