"""What every section shares: the error type, the strict base model, and how a validation error is told."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(Exception):
    """A config file is missing, unparsable or holds a value out of range."""


class _Strict(BaseModel):
    # strict: "8" is not silently taken for 8; a value must have the type the key expects.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

def _describe(path: str, exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        key = ".".join([*([prefix] if prefix else []), *(str(part) for part in err["loc"])]) or "(top level)"
        value = err.get("input")
        expected = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            expected = "no such key (a typo?)"
        elif err["type"] == "missing":
            value = "(missing)"
        lines.append(f"{path}: key '{key}' has value {value!r}; expected: {expected}")
    return "\n".join(lines)
