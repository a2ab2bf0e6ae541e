"""The README and docs/: short, self-contained, and every link goes somewhere real."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=False).stdout.split()  # fmt: skip
    return [ROOT / p for p in out] or [p for p in ROOT.rglob("*") if ".venv" not in p.parts]


class TestDocs:
    def test_readme_is_short_and_starts_with_the_two_commands(self) -> None:
        """At most ~200 lines, opening with ./tools/demo and ./tools/test."""
        text = (ROOT / "README.md").read_text()
        assert len(text.splitlines()) <= 200
        head = text.split("```")[1]
        assert "./tools/demo" in head and "./tools/test" in head

    @pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
    def test_relative_links_resolve(self, page: Path) -> None:
        """Every relative link of a page names a file or folder of the repository."""
        for target, _ in _LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (page.parent / target).resolve().exists(), f"{page.name}: {target}"

    def test_nothing_points_outside_the_repository(self) -> None:
        """No tracked file refers to a path above the repository (a user never has one)."""
        shared = "shared"  # spelled apart, so that this file does not match itself
        outside = re.compile(rf"\.\./{shared}|{shared}/DESIGN|{shared}/seeds")
        bad = [
            str(p.relative_to(ROOT))
            for p in _tracked()
            if p.is_file() and p.suffix in {".md", ".py", ".toml", ".sh", ".sbatch", ""}
            and outside.search(p.read_text(errors="ignore"))
        ]  # fmt: skip
        assert not bad
