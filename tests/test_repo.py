"""Checks on the repository itself, run by `make test`: types (mypy over runtime/ and
components/), file size, which modules may import the optional heavy libraries, and that no file
cites a document the repository does not contain."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = (ROOT / "runtime", ROOT / "components")
MAX_LINES = 400


def repo_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def source_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in root.rglob("*.py"))


@pytest.mark.timeout(600)
def test_mypy_is_clean_over_runtime_and_components() -> None:
    assert importlib.util.find_spec("mypy"), "mypy comes with the test extra: pip install -e '.[test]'"
    run = subprocess.run([sys.executable, "-m", "mypy", "runtime/tandem", "components/tandem"],
                         cwd=ROOT, capture_output=True, text=True)
    report = (run.stdout + run.stderr).strip()
    assert run.returncode == 0, f"mypy found problems:\n{report}"


def test_no_source_file_is_over_400_lines() -> None:
    sizes = {p.relative_to(ROOT): len(p.read_text(encoding="utf-8").splitlines())
             for p in source_files()}
    assert sizes, "no source files found"
    over = {str(p): n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"


# Spelled in pieces so that this file does not match its own patterns.
_OUTSIDE_DOCS = re.compile("|".join([
    r"\b" + "DES" + r"IGN\b",  # the design notes live outside the repository
    "REV" + r"IEW\.md", "STY" + r"LE\.md", "SGL" + r"ANG\.md",
    r"\.\./" + "shared" + "/", "/work/" + "shared",
]))
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".json",
                  ".csv", ""}


def test_no_file_cites_a_document_outside_the_repository() -> None:
    hits = []
    for path in repo_files():
        if path.suffix not in _TEXT_SUFFIXES or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE_DOCS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "cites a document the repository does not contain (point to ARCHITECTURE.md " \
                     "or README.md instead):\n" + "\n".join(hits)


def _importers(module: str) -> list[str]:
    pattern = re.compile(rf"^\s*(import|from)\s+{module}\b", re.M)
    return sorted(str(p.relative_to(ROOT)) for p in source_files()
                  if pattern.search(p.read_text(encoding="utf-8")))


@pytest.mark.parametrize("module", ["sglang", "nixl"])
def test_one_module_imports_each_optional_library(module: str) -> None:
    assert len(_importers(module)) <= 1, f"{module} is imported by {_importers(module)}"


def test_the_architecture_page_and_readme_exist_and_are_linked() -> None:
    arch = ROOT / "ARCHITECTURE.md"
    assert arch.is_file()
    assert "ARCHITECTURE.md" in (ROOT / "README.md").read_text(encoding="utf-8")
