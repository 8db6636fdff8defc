"""Which model server is behind ``model_gateway.base_url``, and how it takes a priority.

``model_gateway.server`` names the flavour (``vllm``, ``sglang``, ``tgi``, ``llama_cpp``,
``transformers``, ``ollama``, ``openai``) or ``auto``: :func:`detect` reads it from
``GET /v1/models`` (each model's ``owned_by``, and fields only one server adds) and the
response headers. A flavour says whether the server can order requests by a priority of
its own and, if so, in which body field and with which polarity:

========== ============ ================== ==================================================
server     field        order              source
========== ============ ================== ==================================================
vllm       ``priority`` lower value first  vLLM ``SamplingParams``/OpenAI server docs: "lower
                                           values are scheduled earlier", default 0; honoured
                                           with ``--scheduling-policy priority``
sglang     ``priority`` higher value first SGLang ``server_args.py``, ``--enable-priority-
                                           scheduling``: "requests with higher priority
                                           integer values will be scheduled first by
                                           default"; ``--schedule-low-priority-values-first``
                                           flips it (``priority_polarity: lower_first``)
others     none                            TGI, llama.cpp server, ``transformers serve``,
                                           Ollama and the OpenAI API have no request priority;
                                           ``transformers serve`` answers 422 "Unexpected
                                           fields in the request: {'priority'}"
========== ============ ================== ==================================================

An undetected server (``unknown``) gets vLLM's field and polarity, the most common
OpenAI-compatible server with a priority; a server that refuses the field answers 400/422
naming it, and the client then drops the field for that endpoint
(:func:`refused_field`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from switchyard.common import untrusted

@dataclass(frozen=True)
class ServerFlavour:
    """What a model server does with a request priority.

    ``priority_field``: the body field it reads a priority from, None when it has none.
    ``lower_first``: True when a lower value is served earlier (vLLM), False when a higher one is (SGLang).
    """

    name: str
    priority_field: str | None
    lower_first: bool = True


FLAVOURS: dict[str, ServerFlavour] = {
    "vllm": ServerFlavour("vllm", "priority", lower_first=True),
    "sglang": ServerFlavour("sglang", "priority", lower_first=False),
    "tgi": ServerFlavour("tgi", None),
    "llama_cpp": ServerFlavour("llama_cpp", None),
    "transformers": ServerFlavour("transformers", None),
    "ollama": ServerFlavour("ollama", None),
    "openai": ServerFlavour("openai", None),
    "unknown": ServerFlavour("unknown", "priority", lower_first=True),
}
"""Each server ``model_gateway.server`` may name (but ``auto``, which :func:`detect` resolves), and ``unknown``."""

# owned_by values each server writes into GET /v1/models (lower-cased).
_OWNERS = {
    "vllm": "vllm",  # vLLM ModelCard default owned_by
    "sglang": "sglang",  # SGLang /v1/models
    "llamacpp": "llama_cpp",  # llama.cpp server /v1/models
    "library": "ollama",  # Ollama's /v1/models: library models
    "ollama": "ollama",
    "openai": "openai",  # the OpenAI API: openai, system, openai-internal
    "system": "openai",
    "openai-internal": "openai",
    "text-generation-inference": "tgi",
    "tgi": "tgi",
}


def listed_ids(models_body: Any) -> list[str]:
    """The model ids a ``GET /v1/models`` answer (``models_body``, parsed JSON) lists: each ``data[].id`` (OpenAI's
    ``{"object": "list", "data": [{"id": ...}]}``). ``data: null`` lists none: Ollama answers so while no model
    is pulled (its ``ListCompletion`` marshals an empty Go slice as ``null``), where read as no model list at all
    the set-up was told to point the URL at an OpenAI-compatible root, which it was, not to pull a model. The one
    reader of the list, for the gateway's calls and ``switchyard doctor``.

    Raises:
        ValueError: ``models_body`` is no model list (not an object with ``data`` a list or null, or an item
            without an ``id``).
    """
    if not isinstance(models_body, dict) or "data" not in models_body:
        raise ValueError("no 'data' list")
    data = models_body["data"]
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(item, dict) and item.get("id") is not None for item in data):
        raise ValueError("'data' is not a list of objects with an 'id'")
    return [str(item["id"]) for item in data]


def detect(models_body: Any, headers: Mapping[str, str] | None = None) -> str:
    """The flavour name of the server that answered ``GET /v1/models`` with ``models_body`` (parsed JSON).

    Reads, in order: a model object's ``owned_by`` (table above); llama.cpp's ``meta`` and
    ``transformers serve``'s ``status`` fields on a model object; the ``server`` header.
    Returns ``unknown`` when nothing matches.
    """
    data = models_body.get("data") if isinstance(models_body, dict) else None
    items = [item for item in data or [] if isinstance(item, dict)]
    for item in items:
        owner = str(item.get("owned_by") or "").lower()
        if owner in _OWNERS:
            return _OWNERS[owner]
    for item in items:
        if "meta" in item and "n_ctx_train" in (item.get("meta") or {}):
            return "llama_cpp"
        status = item.get("status")
        if isinstance(status, dict) and "value" in status:
            return "transformers"  # transformers serve: {"status": {"value": "loaded"}}
    server = (headers or {}).get("server", "").lower()
    if "text-generation-inference" in server:
        return "tgi"
    if "llama.cpp" in server:
        return "llama_cpp"
    if "ollama" in server:
        return "ollama"
    return "unknown"


MAX_REPORTED_WINDOW = 100_000_000
"""The largest context window taken from a server's report, tokens (``ModelInfo.context_window_tokens`` is an
int32; no model has a window near this): a larger one is a server's bug, read as none."""


def reported_context_window(models_body: Any, model: str) -> int:
    """The context window, tokens, that ``GET /v1/models`` (``models_body``, parsed JSON) reports for ``model``:
    its ``max_model_len`` (vLLM's ``ModelCard``, SGLang's likewise); 0 when the server reports none (TGI,
    llama.cpp's ``meta.n_ctx_train`` is the training window, not the server's ``n_ctx``; ``transformers serve``,
    Ollama and the OpenAI API report none)."""
    data = models_body.get("data") if isinstance(models_body, dict) else None
    for item in data or []:
        if isinstance(item, dict) and item.get("id") == model:
            value = untrusted.json_integer(item.get("max_model_len"))  # 4096.0 is 4096: JSON has one number type
            return value if value is not None and 16 <= value <= MAX_REPORTED_WINDOW else 0
    return 0


def priority_value(flavour: ServerFlavour, values: Mapping[str, int], priority_class: str,
                   polarity: str = "server_default") -> int | None:
    """The value to send in ``flavour.priority_field`` for ``priority_class``, None when nothing is sent.

    ``values`` (``model_gateway.priority_values``) are on vLLM's scale, lower earlier. For a
    server that serves higher values first, each is mirrored (``max - value``), so CORE still
    goes first: ``{"core": 0, "normal": 1, "batch": 2}`` is sent as 2, 1, 0.
    ``polarity``: ``server_default`` (the flavour's), ``lower_first`` or ``higher_first``.
    """
    if flavour.priority_field is None or priority_class not in values:
        return None
    lower_first = flavour.lower_first if polarity == "server_default" else polarity == "lower_first"
    value = values[priority_class]
    return value if lower_first else max(values.values()) - value


_REFUSAL = re.compile(
    r"(?i)unexpected|unrecognized|unknown|extra|not permitted|not allowed|unsupported|invalid|not enabled")


def refused_field(status: int, message: str, sent: tuple[str, ...]) -> str | None:
    """The optional body field a 400/422 answer refuses, out of the ``sent`` ones, or None.

    Matches messages such as ``transformers serve``'s "Unexpected fields in the request:
    {'priority'}", OpenAI's "Unrecognized request argument supplied: priority", serde's
    "unknown field `priority`" (TGI), pydantic's ``extra_forbidden`` "Extra inputs are not
    permitted" with ``loc: ["body", "priority"]``, and vLLM's "Got priority 1 but Priority
    scheduling is not enabled." (started without ``--scheduling-policy priority``: it takes
    priority 0 only, and refuses any other inside its stream).
    """
    if status not in (400, 422) or not _REFUSAL.search(message):
        return None
    for name in sent:
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message):
            return name
    return None
