"""The architecture as a test: kvshare's import graph has no cycle and points down the layers.

The layers are read from docs/architecture.md (the fenced ``layers`` block), so the
document and the test cannot drift apart. The graph is built with ``ast`` from the source
files: nothing is imported, so optional dependencies (vLLM, redis, CUDA) do not matter.

    layer k may import layers 0..k (its own included); never k+1 and above
    no module may reach itself through imports (a cycle), in any layer

Imports under ``if TYPE_CHECKING:`` count too: a type-only import against the layers is
still a dependency a reader has to hold in mind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A module holds one concept and its size follows from that: split by concept, never squeeze. This
# ceiling is far above what one concept needs, so a module near it is a sign of two concepts, not a budget.
MAX_LINES = 600
# A function a reader can hold at once: split by step above this (from its ``def`` to its last line)
MAX_FUNCTION_LINES = 60
FUNCTIONS_CHECKED = ("kvshare",)  # the whole package


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package_dir`` (a package's __init__ is its name)."""
    top = package_dir.name
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (top, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of a file, tried again where CPython 3.11's AST constructor miscounts its recursion depth
    while other threads of the test process parse (python/cpython#106905: a spurious SystemError)."""
    for attempt in range(3):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    modules = module_names(package_dir)
    top = package_dir.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(parse(path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = [f"{source}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules] or [source]
            for target in targets:
                if target != top and not target.startswith(top + "."):
                    continue
                while target not in modules and "." in target:  # `import a.b.c` of an attribute
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def long_functions(package_dir: Path, limit: int) -> dict[str, int]:
    """``file:function`` -> lines, for every function (methods and nested ones too) longer than ``limit``."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > limit:
                    found[f"{path.relative_to(package_dir.parent).as_posix()}:{node.name}"] = num_lines
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def read_layers(markdown: str) -> list[tuple[str, list[str]]]:
    """The fenced ``layers`` block of docs/architecture.md: ``name: prefix prefix ...``, lowest first."""
    match = re.search(r"```layers\n(.*?)```", markdown, re.S)
    if not match:
        raise AssertionError("docs/architecture.md has no ```layers block")
    layers = []
    for line in match.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, prefixes = line.split(":", 1)
            layers.append((name.strip(), prefixes.split()))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The layer whose prefix names ``module`` most closely (``a.b`` covers ``a.b`` and ``a.b.*``)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Imports that point up the layers, and modules no layer names."""
    problems = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            problems.append(f"{module} is in no layer of docs/architecture.md")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > mine:
                problems.append(f"{module} ({layers[mine][0]}) imports {target} ({layers[theirs][0]}), a higher layer")
    return problems


# -- kvshare itself --------------------------------------------------------------------------------------


def _kvshare() -> tuple[dict[str, set[str]], list[tuple[str, list[str]]]]:
    return import_graph(ROOT / "kvshare"), read_layers((ROOT / "docs" / "architecture.md").read_text())


def test_kvshare_has_no_import_cycle():
    graph, _ = _kvshare()
    assert find_cycles(graph) == []


def test_kvshare_imports_point_down_the_layers():
    graph, layers = _kvshare()
    assert layer_violations(graph, layers) == []


def test_every_package_is_named_in_docs_architecture():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(
        p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "kvshare").rglob("__init__.py")
    )
    missing = [p for p in packages if f"`{p}`" not in text]
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_no_kvshare_file_is_over_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "kvshare").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_function_in_the_checked_packages_is_over_the_function_limit():
    long = {}
    for package in FUNCTIONS_CHECKED:
        long.update(long_functions(ROOT / package, MAX_FUNCTION_LINES))
    assert long == {}


# -- negative controls: the checks fail on a tree that breaks them ------------------------------------------


def _fixture(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


FIXTURE_LAYERS = [("low", ["pkg.low", "pkg"]), ("high", ["pkg.high"])]


def test_a_cycle_in_a_fixture_tree_is_found(tmp_path):
    pkg = _fixture(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from pkg.low import b\n",
            "low/b.py": "from . import c\n",
            "low/c.py": "import pkg.low.a\n",
            "low/d.py": "from pkg.low.a import something\n",
        },
    )
    assert find_cycles(import_graph(pkg)) == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]


def test_a_type_checking_import_closes_a_cycle_too(tmp_path):
    pkg = _fixture(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import pkg.b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        },
    )
    assert find_cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_an_upward_import_in_a_fixture_tree_is_found(tmp_path):
    pkg = _fixture(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/x.py": "def f():\n    from pkg.high.y import g\n",  # a lazy import counts as well
            "high/__init__.py": "",
            "high/y.py": "from pkg.low.x import f\n",
        },
    )
    problems = layer_violations(import_graph(pkg), FIXTURE_LAYERS)
    assert problems == ["pkg.low.x (low) imports pkg.high.y (high), a higher layer"]
    assert find_cycles(import_graph(pkg)) == [["pkg.high.y", "pkg.low.x"]]


def test_a_module_in_no_layer_is_reported(tmp_path):
    pkg = _fixture(tmp_path, {"__init__.py": "", "stray.py": ""})
    problems = layer_violations(import_graph(pkg), [("low", ["pkg.low"])])
    assert "pkg.stray is in no layer of docs/architecture.md" in problems


def test_the_layers_block_is_required():
    with pytest.raises(AssertionError, match="no ```layers block"):
        read_layers("# Architecture\n")


def test_a_long_function_in_a_fixture_tree_is_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    pkg = _fixture(tmp_path, {"__init__.py": "", "a.py": f"def short():\n    pass\n\n\ndef long():\n{body}"})
    assert long_functions(pkg, MAX_FUNCTION_LINES) == {"pkg/a.py:long": 61}


# -- the module map of docs/architecture.md --------------------------------------------------------------


def read_module_map(markdown: str) -> dict[str, set[str]]:
    """Package -> the modules its ``### `package` `` headings list (``- `module`: ...`` lines), over every heading
    of that package in the "Module map" section."""
    if "\n## Module map\n" not in markdown:
        raise AssertionError("docs/architecture.md has no '## Module map' section")
    section = markdown.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    package = None
    for line in section.splitlines():
        if heading := re.match(r"### `([\w.]+)`", line):
            package = heading.group(1)
            listed.setdefault(package, set())
        elif package and (item := re.match(r"- `(\w+)`:", line)):
            listed[package].add(item.group(1))
    return listed


def module_map_problems(package_dir: Path, listed: dict[str, set[str]]) -> list[str]:
    """Modules the map leaves out, and names it lists that are no module of their package."""
    actual: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        package = path.parent.relative_to(package_dir.parent).as_posix().replace("/", ".")
        actual.setdefault(package, set())
        if path.stem != "__init__":
            actual[package].add(path.stem)
    problems = []
    for package in sorted(set(actual) | set(listed)):
        have, named = actual.get(package, set()), listed.get(package, set())
        problems += [f"{package}.{m} is not in the module map" for m in sorted(have - named)]
        problems += [f"{package}.{m} is in the module map but not in the tree" for m in sorted(named - have)]
        if package not in listed:
            problems.append(f"{package} has no heading in the module map")
    return problems


def test_the_module_map_lists_every_module_and_only_those():
    listed = read_module_map((ROOT / "docs" / "architecture.md").read_text())
    assert module_map_problems(ROOT / "kvshare", listed) == []


def test_a_module_missing_from_the_map_and_a_stale_name_are_reported(tmp_path):
    pkg = _fixture(tmp_path, {"__init__.py": "", "a.py": "", "sub/__init__.py": "", "sub/b.py": ""})
    text = (
        "# x\n\n## Module map\n\n### `pkg`: low\n\n- `a`: one\n- `gone`: two\n\n"
        "### `pkg.sub`: low\n\n## Next\n- `b`: no\n"  # the next section's items are not the map's
    )
    assert module_map_problems(pkg, read_module_map(text)) == [
        "pkg.gone is in the module map but not in the tree",
        "pkg.sub.b is not in the module map",
    ]
