"""``--set KEY=VALUE``: config overrides for the stacks a benchmark starts, by the keys docs/configuration.md names.

``switchyard bench compare`` and ``switchyard bench upstream`` take them. A key is written as the
configuration reference (docs/configuration.md, ``switchyard config reference``) names it:

- a key of ``queue.json`` or ``switchyard.json`` with its table: ``model_gateway.concurrency.initial_limit``,
  ``flush.max_batch_size``, ``queues.inference.capacity``, ``orchestrator.program.rag_early_prefill``;
- a key of ``memory_policy.toml`` under its table, as TOML dots it: ``hbm.capacity_ratio``, ``dram.kv_swap``;
- a key of ``scheduler_config.json`` (the whole file is the section) alone: ``time_slice_ms``, ``policy``.

The ``SwitchyardConfig`` attribute paths (``upstream.concurrency.initial_limit``, ``batching.max_batch_size``,
``memory.hbm.capacity_ratio``, ``scheduler.policy``) are taken too, as before. Each key resolves to the
attribute path :meth:`SwitchyardConfig.with_overrides` takes (:func:`resolve_key`); its value parses as JSON,
else it is the text as written. The sections and where they live come from the loader's own table
(``switchyard.common.config.sections.SECTIONS``), so the keys are the reference's.
"""

from __future__ import annotations

import json
from typing import Any, get_origin

from pydantic import BaseModel

from switchyard.common.config.base import did_you_mean
from switchyard.common.config.sections import SECTIONS


def _prefixes() -> dict[str, str]:
    """Every spelling of a section's prefix -> its attribute path: the reference's (``model_gateway``,
    ``flush``, ``hbm``) and the attribute's own (``upstream``, ``batching``, ``memory.hbm``)."""
    out: dict[str, str] = {}
    for name, section in SECTIONS.items():
        out[name] = name
        if section.keys:
            out[".".join(section.keys)] = name
    return out


def _whole_file_sections() -> list[str]:
    """Sections that are a whole file (scheduler_config.json): their keys stand alone in the reference."""
    return [name for name, section in SECTIONS.items() if not section.keys]


def _model_at(model: type[BaseModel], head: str, parts: list[str]) -> str | None:
    """Why ``parts`` is not a key path of ``model`` (the section written ``head``; "" for a whole file),
    naming the first part that is not, or None. A path into a field that is not itself a table (a dict such
    as ``model_map``) is not checked past it."""
    for index, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(filter(None, (head, *parts[:index]))) or "scheduler_config.json"
            return f"{where} has no key {part!r}{did_you_mean(part, fields)}"
        annotation = fields[part].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        if index + 1 < len(parts) and get_origin(annotation) is not dict and annotation is not dict:
            where = ".".join(filter(None, (head, *parts[:index + 1])))
            return f"{where} is a value, not a table: nothing under it to set"
        return None
    return None


def resolve_key(key: str) -> str:
    """A config key as docs/configuration.md names it (or as the attribute path) -> the attribute path.

    ``"model_gateway.concurrency.initial_limit"`` -> ``"upstream.concurrency.initial_limit"``;
    ``"flush.max_batch_size"`` -> ``"batching.max_batch_size"``; ``"hbm.capacity_ratio"`` ->
    ``"memory.hbm.capacity_ratio"``; ``"time_slice_ms"`` -> ``"scheduler.time_slice_ms"``.

    Raises:
        ValueError: no section holds ``key``, or its section has no such key (the message says which, with the
            nearest key and examples of the documented spelling).
    """
    prefixes = _prefixes()
    for prefix in sorted(prefixes, key=len, reverse=True):
        if key.startswith(prefix + "."):
            section, head = prefixes[prefix], prefix
            rest = key[len(prefix) + 1:]
            break
    else:
        whole = [name for name in _whole_file_sections() if key.split(".")[0] in SECTIONS[name].model.model_fields]
        if not whole:
            known = sorted({p.split(".")[0] for p in prefixes} | {
                f for name in _whole_file_sections() for f in SECTIONS[name].model.model_fields})
            raise ValueError(
                f"--set {key}: no config key of that name; expected a key as docs/configuration.md names it, such as "
                "model_gateway.concurrency.initial_limit, flush.max_batch_size, queues.inference.capacity, "
                f"hbm.capacity_ratio or time_slice_ms{did_you_mean(key.split('.')[0], known)}")
        section, head, rest = whole[0], "", key
    problem = _model_at(SECTIONS[section].model, head, rest.split("."))
    if problem is not None:
        raise ValueError(f"--set {key}: {problem}")
    return f"{section}.{rest}"


def documented_names(text: str) -> str:
    """``text`` (a config error naming attribute paths) with each quoted key spelt as docs/configuration.md
    names it: ``'upstream.concurrency.initial_limit'`` -> ``'model_gateway.concurrency.initial_limit'``."""
    renames = sorted(((name, ".".join(section.keys)) for name, section in SECTIONS.items()
                      if section.keys and ".".join(section.keys) != name), key=lambda pair: -len(pair[0]))
    for attribute, reference in renames:
        text = text.replace(f"'{attribute}.", f"'{reference}.")
    return text


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """``["model_gateway.concurrency.initial_limit=2", "policy=fifo"]`` -> overrides for
    :meth:`SwitchyardConfig.with_overrides` (attribute paths, see :func:`resolve_key`); values parse as JSON,
    else they are the text as written.

    Raises:
        ValueError: an item without ``=``, or a key no section holds (the message names the item).
    """
    overrides: dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set: expected KEY=VALUE such as model_gateway.concurrency.initial_limit=2, "
                             f"got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        overrides[resolve_key(key.strip())] = value
    return overrides


__all__ = ["documented_names", "parse_settings", "resolve_key"]
