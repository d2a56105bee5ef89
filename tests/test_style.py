"""One formatter and linter, ruff, configured in pyproject.toml: kvshare/, tests/ and benchmarks/ are as
``ruff format`` writes them, and ``ruff check`` finds nothing there. A failure names the files; fix them with

    ruff format kvshare tests benchmarks && ruff check --fix kvshare tests benchmarks

ruff is a dev dependency (``pip install -e .[dev]``); without it these tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("kvshare", "tests", "benchmarks")


_UNFORMATTED = re.compile(r"^(?:Would reformat: (?P<old>\S+)|(?P<path>\S+?):\d+:\d+: unformatted\b)")


def _ruff() -> str:
    """The ruff binary of this interpreter's environment (pip's ruff package), else the one on PATH."""
    try:
        from ruff.__main__ import find_ruff_bin

        return str(find_ruff_bin())
    except (ImportError, FileNotFoundError):
        path = shutil.which("ruff")
    if path is None:
        pytest.skip("ruff is not installed (it is a dev dependency: pip install -e .[dev])")
    return path


def _run(root: Path, args: list[str], paths: tuple[str, ...], excluded: tuple[str, ...]) -> str:
    """ruff ``args`` over ``paths`` of ``root`` (whose pyproject.toml configures it), ``excluded`` left out."""
    exclude = ["--force-exclude", "--extend-exclude", ",".join(excluded)] if excluded else []
    done = subprocess.run(
        [_ruff(), *args, "--no-cache", *exclude, *paths], cwd=root, capture_output=True, text=True, timeout=120
    )
    if done.returncode not in (0, 1):  # 2: ruff itself failed (a bad setting, a path that does not exist)
        raise AssertionError(f"ruff {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def unformatted_files(root: Path, paths: tuple[str, ...], excluded: tuple[str, ...] = ()) -> list[str]:
    """The files under ``paths`` that ``ruff format`` would change, sorted."""
    out = _run(root, ["format", "--check", "--output-format", "concise"], paths, excluded)
    return sorted({m["old"] or m["path"] for line in out.splitlines() if (m := _UNFORMATTED.match(line))})


def lint_findings(root: Path, paths: tuple[str, ...], excluded: tuple[str, ...] = ()) -> list[str]:
    """``ruff check``'s findings under ``paths``, one ``file:line:col: CODE message`` each."""
    out = _run(root, ["check", "--output-format", "concise"], paths, excluded)
    return [line for line in out.splitlines() if re.match(r"^\S+:\d+:\d+: ", line)]


def test_the_tree_is_formatted():
    """Fails naming every file that ``ruff format`` would change (test_an_unformatted_file_is_named below)."""
    assert unformatted_files(ROOT, CHECKED) == []


def test_ruff_check_finds_nothing():
    """Fails naming every finding, ``file:line:col: CODE message`` (test_a_lint_finding_is_named below)."""
    assert lint_findings(ROOT, CHECKED) == []


# -- negative controls: the checks fail on a tree that breaks them ------------------------------------------


def _fixture(tmp_path: Path, files: dict[str, str]) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")  # the project's own ruff settings
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_an_unformatted_file_is_named(tmp_path):
    root = _fixture(tmp_path, {"pkg/good.py": 'X = {"a": 1}\n', "pkg/bad.py": "X = { 'a' : 1 }\n"})
    assert unformatted_files(root, ("pkg",)) == ["pkg/bad.py"]


def test_a_line_over_120_characters_is_found(tmp_path):
    long_line = "# " + "x" * 130 + "\n"  # a comment: the formatter leaves it, the linter names it
    root = _fixture(tmp_path, {"pkg/long.py": long_line})
    assert unformatted_files(root, ("pkg",)) == []
    assert [f.split(": ", 1)[1].split()[0] for f in lint_findings(root, ("pkg",))] == ["E501"]


def test_a_lint_finding_is_named(tmp_path):
    root = _fixture(tmp_path, {"pkg/unused.py": "import os\n"})
    findings = lint_findings(root, ("pkg",))
    assert len(findings) == 1 and findings[0].startswith("pkg/unused.py:1:8: F401")


def test_a_path_left_out_is_not_checked(tmp_path):
    root = _fixture(tmp_path, {"pkg/new/bad.py": "import os\nX = { 'a' : 1 }\n", "pkg/ok.py": "X = 1\n"})
    assert unformatted_files(root, ("pkg",), ("pkg/new",)) == []
    assert lint_findings(root, ("pkg",), ("pkg/new",)) == []
    assert unformatted_files(root, ("pkg",)) == ["pkg/new/bad.py"]
