"""What every section shares: the error type, the strict base model, and how a validation error is told."""

from __future__ import annotations

import difflib
from typing import Iterable

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(Exception):
    """A config file is missing, unparsable or holds a value out of range."""


class _Strict(BaseModel):
    # strict: "8" is not silently taken for 8; a value must have the type the key expects.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)  # nan passed every bound

def _describe(path: str, exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """Each error of ``exc`` (validating ``model``, when given) as ``path: key 'K' has value V; expected: ...``;
    an unknown key names the nearest known one."""
    lines = []
    for err in exc.errors():
        key = ".".join([*([prefix] if prefix else []), *(str(part) for part in err["loc"])]) or "(top level)"
        value = err.get("input")
        expected = err["msg"].removeprefix("Value error, ").removeprefix("expected ")  # the line says "expected:"
        if err["type"] == "extra_forbidden":
            expected = "no such key (a typo?)" + _nearest_key(model, err["loc"])
        elif err["type"] == "missing":
            value = "(missing)"
        elif err["type"] == "value_error" and isinstance(value, dict) and _is_section(model, err["loc"]):
            # a rule across a section's keys
            lines.append(f"{path}: section '{key}': {err['msg'].removeprefix('Value error, ')}")  # names them
            continue
        lines.append(f"{path}: key '{key}' has value {value!r}; expected: {expected}")
    return "\n".join(lines)


def _is_section(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> bool:
    """Whether ``loc`` names a section (a nested model, or ``model`` itself) rather than a key whose value is a
    table (``scheduler.tenant_weights``: its rule is about its entries); True where ``model`` is not known."""
    for part in loc:
        if model is None:
            return True
        field = model.model_fields.get(str(part))
        nested = field.annotation if field is not None else None
        if not (isinstance(nested, type) and issubclass(nested, BaseModel)):
            return False
        model = nested
    return True


def _nearest_key(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """``; did you mean 'X'?`` for the known key of ``model`` nearest the unknown last part of ``loc``, or ""."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        nested = field.annotation if field is not None else None
        model = nested if isinstance(nested, type) and issubclass(nested, BaseModel) else None
    if model is None or not loc:
        return ""
    return did_you_mean(str(loc[-1]), model.model_fields)


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """``; did you mean 'X'?`` for the ``known`` key nearest ``key`` (difflib's ratio 0.6 or more), or ""."""
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean '{near[0]}'?" if near else ""
