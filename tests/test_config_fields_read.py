"""Every config field is read by some code: a key that nothing reads is a promise the product breaks.

A field counts as read when ``.name`` appears in the services, deploy or tools code
outside ``common/config.py``, or inside a public method of ``common/config.py`` (as an
attribute or as a quoted name handed to ``getattr``). Validators (private methods) do not
count: checking a value is not using it.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from pydantic import BaseModel

import switchyard.common.config as config_module

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PY = ROOT / "services" / "switchyard" / "common" / "config.py"


def _config_models() -> list[type[BaseModel]]:
    return [v for v in vars(config_module).values()
            if inspect.isclass(v) and issubclass(v, BaseModel) and v.__module__ == config_module.__name__]


def _code_outside_config() -> str:
    files = [p for folder in ("services", "deploy", "tools") for p in (ROOT / folder).rglob("*.py") if p != CONFIG_PY]
    return "\n".join(p.read_text() for p in files)


def _names_public_config_methods_use() -> set[str]:
    used: set[str] = set()
    for node in ast.walk(ast.parse(CONFIG_PY.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Attribute):
                    used.add(inner.attr)
                elif isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    used.add(inner.value)
    return used


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
