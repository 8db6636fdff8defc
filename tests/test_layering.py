"""The serving path apart from the measuring path.

``services/switchyard`` (the services) never imports ``harness/switchyard_harness`` (benchmarks,
the fake upstream, top and profile, test tooling) except where the ``switchyard`` command routes
to a harness command, lazily; a product test (``tests/``, outside ``tests/harness/``) imports no
benchmark code, directly or through the helpers and packages it imports; the wheel carries both
packages, and a tree with ``services/`` alone (what the service images copy) builds without the
harness, whose commands then say what to install.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from switchyard import cli, serve

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
HARNESS_TESTS = TESTS / "harness"
PACKAGES = {"switchyard": ROOT / "services", "switchyard_harness": ROOT / "harness"}
BENCH = ROOT / "harness" / "switchyard_harness" / "bench"
LAZY_ENTRY_POINTS = {ROOT / "services" / "switchyard" / "cli.py", ROOT / "services" / "switchyard" / "serve.py"}
"""The only product modules that may name the harness: the command's router, inside functions or as strings."""

_MODULE_PATH = re.compile(r"switchyard_harness(\.[A-Za-z_]\w*)*")


@functools.cache
def _module_file(name: str) -> Path | None:
    """The file of module ``name`` in this repository: a package's module, or a test helper
    (a top-level name: ``tests/<name>.py`` or ``tests/harness/<name>.py``); None for anything else.
    Cached: each walk asks for the same few hundred names again, and the tree does not change in a run."""
    top, *rest = name.split(".")
    if top in PACKAGES:
        base = PACKAGES[top].joinpath(top, *rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None
    if rest:
        return None
    for folder in (TESTS, HARNESS_TESTS):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    return None


def _package_of(path: Path) -> str | None:
    for top, root in PACKAGES.items():
        if path.is_relative_to(root / top):
            return ".".join(path.relative_to(root).parts[:-1])  # a/b/c.py and a/b/__init__.py: a.b
    return None


@functools.cache
def imports(path: Path) -> tuple[str, ...]:
    """Every module ``path`` imports (module level or inside functions), as absolute dotted names:
    ``import a.b`` gives ``a`` and ``a.b``; ``from a.b import c`` gives ``a``, ``a.b`` and ``a.b.c``
    (``c`` may be a submodule); relative imports are resolved against the file's package."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = (_package_of(path) or "").split(".")
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in found:
            parts = name.split(".")
            names += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return tuple(names)


def reaches(start: Path, forbidden) -> list[Path] | None:
    """The import chain from ``start`` to the first file for which ``forbidden(file)`` holds, or None."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        path = todo.pop()
        for name in imports(path):
            target = _module_file(name)
            if target is None or target in chains:
                continue
            chains[target] = [*chains[path], target]
            if forbidden(target):
                return chains[target]
            todo.append(target)
    return None


def _is_benchmark_code(path: Path) -> bool:
    return path.is_relative_to(BENCH) or path.is_relative_to(HARNESS_TESTS)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


PRODUCT_TESTS = sorted(p for p in TESTS.rglob("*.py") if not p.is_relative_to(HARNESS_TESTS))


def test_the_walk_finds_benchmark_code_where_it_is_imported():
    """The checker itself: a harness test reaches bench code; a chain through a helper is followed."""
    assert reaches(HARNESS_TESTS / "test_bench.py", _is_benchmark_code) is not None
    fixtures = TESTS / "stack_fixtures.py"
    assert reaches(fixtures, lambda p: p == PACKAGES["switchyard"] / "switchyard" / "launcher.py") is not None
    assert "switchyard.dispatcher.request" in imports(ROOT / "services" / "switchyard" / "dispatcher" / "processor.py")


@pytest.mark.parametrize("path", PRODUCT_TESTS, ids=_rel)
def test_a_product_test_imports_no_benchmark_code(path):
    chain = reaches(path, _is_benchmark_code)
    assert chain is None, (
        f"{_rel(path)} reaches benchmark code: {' -> '.join(map(_rel, chain))}; a test of benchmark code "
        "goes in tests/harness/, a test double in switchyard_harness.testing")


SERVICE_FILES = sorted((ROOT / "services" / "switchyard").rglob("*.py"))


def harness_references(source: str, lazy_allowed: bool) -> list[str]:
    """``"line N: module"`` for each import of ``switchyard_harness`` in ``source`` (an ``import`` or
    ``from`` statement, or a string that is a module path, as handed to importlib). With
    ``lazy_allowed``, statements inside a function and such strings are fine; module-level imports never."""
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f)}
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            named = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_PATH.fullmatch(node.value):
            named = [node.value]
        else:
            continue
        for name in named:
            if name.split(".")[0] == "switchyard_harness" and not (
                    lazy_allowed and (isinstance(node, ast.Constant) or id(node) in inside)):
                wrong.append(f"line {node.lineno}: {name}")
    return wrong


def test_the_check_catches_each_way_of_naming_the_harness():
    eager = "import switchyard_harness.top\nfrom switchyard_harness.bench import cli\n"
    lazy = "def main():\n    from switchyard_harness import sim_openai\n\nMODULE = 'switchyard_harness.top'\n"
    assert harness_references(eager, lazy_allowed=True) == ["line 1: switchyard_harness.top",
                                                           "line 2: switchyard_harness.bench"]
    assert harness_references(lazy, lazy_allowed=True) == []
    assert len(harness_references(lazy, lazy_allowed=False)) == 2
    assert harness_references('"""See :mod:`switchyard_harness.top`."""', lazy_allowed=False) == []


@pytest.mark.parametrize("path", SERVICE_FILES, ids=_rel)
def test_the_services_import_the_harness_only_lazily_in_the_command_router(path):
    wrong = harness_references(path.read_text(encoding="utf-8"), lazy_allowed=path in LAZY_ENTRY_POINTS)
    assert not wrong, f"{_rel(path)} imports the harness: {wrong}; only the command router may, lazily"


def test_every_harness_command_is_routed_through_the_harness_check():
    harness_commands = {name for name, (module, _) in cli.COMMANDS.items() if module.startswith(cli.HARNESS + ".")}
    assert harness_commands == {"bench", "top", "profile"}
    for module, _ in cli.COMMANDS.values():
        assert _module_file(module) is not None, module


@pytest.mark.parametrize("argv", [["bench", "run"], ["top", "--once"], ["profile", "orchestrator"],
                                  ["serve", "sim-openai", "--port", "0"]], ids=" ".join)
def test_a_harness_command_without_the_harness_says_what_to_install(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "switchyard_harness", None)  # as in a service image: not installed
    code = serve.main(argv[1:]) if argv[0] == "serve" else cli.main(argv)
    err = capsys.readouterr().err
    command = "switchyard " + " ".join(argv[:2] if argv[0] == "serve" else argv[:1])
    assert code == 1
    assert err.startswith(f"{command}: this command is part of the benchmark harness (package switchyard_harness")
    assert "pip install ." in err


def test_the_other_commands_work_without_the_harness(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "switchyard_harness", None)
    assert cli.main(["--help"]) == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--help"])
    assert exc.value.code == 0 and "doctor" in capsys.readouterr().out


def _wheel_packages(source: Path, out: Path) -> set[str]:
    """Top-level packages of the wheel ``pip wheel`` builds from ``source`` (setuptools from this venv)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(source)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}


def _copy(tmp: Path, *folders: str) -> Path:
    src = tmp / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in folders:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


@pytest.mark.slow
def test_the_wheel_carries_both_packages_and_a_services_only_tree_builds_without_the_harness(tmp_path):
    assert _wheel_packages(_copy(tmp_path / "full", "services", "harness"), tmp_path / "w1") == {
        "switchyard", "switchyard_harness"}
    # deploy/docker/*.Dockerfile copy pyproject.toml, README.md and services/ only.
    assert _wheel_packages(_copy(tmp_path / "image", "services"), tmp_path / "w2") == {"switchyard"}
