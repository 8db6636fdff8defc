"""Every config field is read by some code: a key that nothing reads is a promise the product breaks.

A field counts as read when ``.name`` appears in the services, deploy or tools code
outside the ``common/config/`` package, or inside a public method of one of its modules
(as an attribute or a quoted name; the reference generator, which reads every field's
description, does not count). Validators (private methods) do not count: checking
a value is not using it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

from pydantic import BaseModel

import switchyard.common.config as config_package

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "services" / "switchyard" / "common" / "config"


def _package_modules() -> list:
    return [config_package] + [
        importlib.import_module(f"{config_package.__name__}.{info.name}")
        for info in pkgutil.iter_modules(config_package.__path__)
    ]


def _config_models() -> list[type[BaseModel]]:
    found = {}
    for module in _package_modules():
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseModel) and value.__module__ == module.__name__:
                found[value.__qualname__] = value
    return list(found.values())


def _models_reachable_from(model: type[BaseModel]) -> set[type[BaseModel]]:
    """``model`` and every model its fields hold, recursively (the sections and their tables)."""
    seen = {model}
    for field in model.model_fields.values():
        annotation = field.annotation
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel) and annotation not in seen:
            seen |= _models_reachable_from(annotation)
    return seen


def _code_outside_config() -> str:
    files = [
        p for folder in ("services", "deploy", "tools") for p in (ROOT / folder).rglob("*.py")
        if CONFIG_DIR not in p.parents
    ]
    return "\n".join(p.read_text() for p in files)


def _names_public_config_methods_use() -> set[str]:
    used: set[str] = set()
    for path in CONFIG_DIR.glob("*.py"):
        if path.name == "reference.py":  # reads the models' descriptions, not the values of their fields
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Attribute):
                        used.add(inner.attr)
                    elif isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                        used.add(inner.value)
    return used


def test_the_check_covers_every_model_of_the_package() -> None:
    models = set(_config_models())
    reachable = _models_reachable_from(config_package.SwitchyardConfig)
    assert reachable <= models, f"models outside the package's modules: {reachable - models}"
    assert len({m.__module__ for m in models}) > 5  # the section modules, not only the package's __init__


def test_every_config_field_is_read_by_some_code() -> None:
    code = _code_outside_config()
    in_config = _names_public_config_methods_use()
    unread = [
        f"{model.__name__}.{name}"
        for model in _config_models()
        for name in model.model_fields
        if name not in in_config and not re.search(r"\." + re.escape(name) + r"\b", code)
    ]
    assert not unread, f"config fields no code reads (delete them, or use them): {unread}"


def test_the_check_finds_an_unread_field() -> None:
    class Probe(BaseModel):
        read_me: int = 1
        nobody_reads_this_key_xyz: int = 2

    code = _code_outside_config() + "\nprobe.read_me\n"
    unread = [n for n in Probe.model_fields if not re.search(r"\." + re.escape(n) + r"\b", code)]
    assert unread == ["nobody_reads_this_key_xyz"]
