"""Model names: the client-facing map, and the nearest known id for a NOT_FOUND message."""

from __future__ import annotations

import difflib
import re
from typing import Any, Iterable, Mapping, Sequence

import grpc

from switchyard.common.errors import SwitchyardError

_PUNCT = re.compile(r"[._:/\s]+")


def resolve(name: str, model_map: Mapping[str, str], default: str) -> str:
    """The upstream id for client-facing ``name`` (empty -> ``default``), through ``model_map``."""
    name = name or default
    return model_map.get(name, name)


def _normal(model_id: str) -> str:
    return _PUNCT.sub("-", model_id.lower())


def nearest(model: str, known: Iterable[str]) -> str | None:
    """The known id closest to ``model`` (difflib ratio >= 0.6 after folding case and . _ : / to -).

    ``nearest("claude-sonnet-4.5", ["claude-sonnet-4-5", "gpt-4o-mini"]) == "claude-sonnet-4-5"``; an id of
    the same last path part comes first (``nearest("tiny", ["/models/tiny"]) == "/models/tiny"``).
    """
    ids = [k for k in known if k and k != model]
    if not ids:
        return None
    folded = {_normal(k): k for k in ids}
    if (exact := folded.get(_normal(model))) is not None:
        return exact
    # the same name under another path or organisation: "Llama-3.1-8B-Instruct" for
    # "meta-llama/Llama-3.1-8B-Instruct", "tiny" for a local "/models/tiny"
    base = _normal(model.rstrip("/").rsplit("/", 1)[-1])
    same = [k for k in ids if _normal(k.rstrip("/").rsplit("/", 1)[-1]) == base]
    if len(same) == 1:
        return same[0]
    match = difflib.get_close_matches(_normal(model), list(folded), n=1, cutoff=0.6)
    return folded[match[0]] if match else None


def listed(model: str, ids: Iterable[str]) -> bool:
    """Whether a server listing ``ids`` (its ``GET /v1/models``) serves ``model``: listed as it is, or, named
    without a tag, under the tag ``latest``. Ollama names its models ``name:tag``, lists ``llama3:latest`` and
    serves ``llama3`` as that one: read as unlisted, such a name failed ``switchyard doctor``, was warned about
    at start ("requests fail NOT_FOUND") and turned any 400 naming it (a model that takes no tools) into
    NOT_FOUND, though the server served it."""
    if not model:
        return False
    ids = ids if isinstance(ids, (set, frozenset)) else set(ids)
    return model in ids or (":" not in model.rsplit("/", 1)[-1] and f"{model}:latest" in ids)


def served_names(ids: Iterable[str], model_map: Mapping[str, str]) -> list[str]:
    """Every client-facing name a request may give for a server listing ``ids``, sorted: each name whose upstream id
    (:func:`resolve` through ``model_map``) the server serves (:func:`listed`): the ids themselves (an id that
    ``model_map`` sends elsewhere only if that target is served), an Ollama ``name:latest`` also as ``name``, and
    each ``model_map`` alias of a served id. ``served_names(["m"], {"alias": "m", "gone": "x"}) == ["alias", "m"]``."""
    ids = frozenset(ids)
    names = set(ids) | {i.removesuffix(":latest") for i in ids} | set(model_map)
    return sorted(n for n in names if n and listed(resolve(n, model_map, ""), ids))


def not_served(model: str, served: Sequence[str], default_model: str) -> SwitchyardError:
    """NOT_FOUND for a request naming ``model``, which is not one of ``served`` (the dispatcher's ``ModelInfo.models``:
    a step engine's one model, or :func:`served_names` of its upstream), in the words every edge refuses it with
    (the orchestrator's submit, the dispatcher's Generate): the model, the names served (the first 10), the nearest
    of them, and that an empty model is ``default_model``."""
    from switchyard.common.untrusted import shown

    names = ", ".join(map(repr, served[:10])) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
    near = nearest(model, served)
    hint = f"; did you mean {near!r}?" if near else ""
    return SwitchyardError(f"model: {shown(model)} is not served here: the dispatcher serves {names}{hint} (leave "
                           f"model empty for {default_model!r})", grpc.StatusCode.NOT_FOUND)


def configured_models(config: Any) -> set[str]:
    """The upstream model ids ``model_gateway`` names: default and fallback through ``model_map`` (as a request's
    model goes), and every ``model_map`` target. A ``model_map`` name is never one: it is sent as its target."""
    named = (config.default_model, config.fallback_model)
    return {resolve(m, config.model_map, "") for m in named if m} | set(config.model_map.values())


def model_label(model: str, config: Any) -> str:
    """``model``, an upstream id, as a metric label: one of :func:`configured_models`, else ``other``.

    A client may name any model; metrics keep a bounded set of series.
    """
    from switchyard.common.metrics import bounded

    return bounded(model, configured_models(config))
