"""docs/architecture.md and docs/engines.md name code as `path.py:Name` or `path.py:Class.member`: each must exist.

The walk of one RunTask ("One RunTask, stop by stop") names a module and function per stop; a rename
that leaves the walk pointing at nothing fails here instead of going stale. Paths are relative to
``services/switchyard/`` and may be shortened to their tail (``engine_loop.py``); a shortened path that
matches several files passes when one of them defines the name.

The services' package docstrings are the maps of their modules: each names every one it holds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "services" / "switchyard"
DOCS = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "engines.md"]
REFERENCE = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.py):([A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)?)")


def _references() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for path, name in REFERENCE.findall(doc.read_text(encoding="utf-8")):
            found.append((doc.name, path, name))
    return sorted(set(found))


def _defines(tree: ast.Module, name: str) -> bool:
    """Whether ``tree`` defines ``name`` at top level, or ``Class.member`` as a method or class attribute."""
    head, _, member = name.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
            if not member:
                return True
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == member:
                        return True
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == member:
                        return True
        if not member and isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == head for t in targets):
                return True
    return False


def test_the_docs_name_code_at_all() -> None:
    assert len(_references()) >= 20  # the walk alone names more; a pattern that matches nothing tests nothing


@pytest.mark.parametrize(("doc", "path", "name"), _references())
def test_named_code_exists(doc: str, path: str, name: str) -> None:
    files = [f for f in PACKAGE.rglob("*.py") if f.as_posix().endswith("/" + path)]
    assert files, f"{doc}: `{path}:{name}`: no file services/switchyard/.../{path}"
    trees = [ast.parse(f.read_text(encoding="utf-8")) for f in files]
    assert any(_defines(tree, name) for tree in trees), (
        f"{doc}: `{path}:{name}`: {', '.join(str(f.relative_to(ROOT)) for f in files)} defines no {name}")


def test_a_wrong_name_is_caught() -> None:
    tree = ast.parse((PACKAGE / "dispatcher" / "scheduler" / "core.py").read_text(encoding="utf-8"))
    assert _defines(tree, "SchedulerCore.add_request")
    assert not _defines(tree, "SchedulerCore.add")
    assert not _defines(tree, "Scheduler.park")


@pytest.mark.parametrize("name", ["dispatcher", "dispatcher/scheduler", "dispatcher/engines", "gateway", "orchestrator"])
def test_a_package_docstring_names_every_module_it_holds(name: str) -> None:
    """A service's package docstring is the newcomer's map: every module and subpackage of the package is named
    there (``:mod:`.name```), and every module says in its own docstring what it owns."""
    package = PACKAGE / name
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    named = set(re.findall(r":mod:`\.([a-z_]+)`", doc))
    held = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    held |= {p.parent.name for p in package.glob("*/__init__.py")}
    assert held - named == set(), f"{name}/__init__.py names no {sorted(held - named)}"
    assert named - held == set(), f"{name}/__init__.py names {sorted(named - held)}, which it does not hold"
    undocumented = [p.relative_to(ROOT).as_posix() for p in package.rglob("*.py")
                    if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert undocumented == []
