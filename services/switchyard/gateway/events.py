"""Requests to and events from an OpenAI-compatible upstream, independent of the dispatcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.request import word_pieces


@dataclass(frozen=True)
class ChatRequest:
    """One ``/v1/chat/completions`` call.

    ``messages`` and ``tools`` are in OpenAI's JSON shape (``{"role", "content"}``;
    ``{"type": "function", "function": {"name", "description", "parameters"}}``).
    ``model`` is the client-facing name (mapped through ``model_gateway.model_map``);
    empty means ``model_gateway.default_model``. ``priority`` (a :class:`PriorityClass`; None:
    none given, sent as normal and never in the server's own field) and ``agent_id`` go upstream as the ``X-Priority`` and ``X-Agent-Id`` headers of
    every request (``X-Agent-Id`` falls back to ``request_id`` when the request names no
    agent), and the priority also in the server's own field when
    ``model_gateway.forward_priority`` is on (:mod:`switchyard.gateway.servers`). ``tenant_id`` goes as
    ``X-Tenant-Id`` (empty: not sent): an agent is its tenant's and its id's, so two tenants' agents of one id
    are two agents upstream too.
    """

    messages: list[dict[str, Any]]
    model: str = ""
    max_tokens: int | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    priority: PriorityClass | None = None
    agent_id: str = ""
    tenant_id: str = ""
    """The task's tenant (``default`` when it names none; empty: no X-Tenant-Id header)."""
    temperature: float | None = None
    request_id: str = ""
    timeout_s: float | None = None
    """Seconds the caller has left (its gRPC deadline, passed on by the dispatcher): the completion,
    retries and fallback included, must end within this and ``model_gateway.total_timeout_s``."""
    deadline_source: str = ""
    """What set the caller's deadline (``timeout_s``), as its caller named it (the task's
    ``orchestrator.task_time_limit_s.<type> = 600`` or its caller's gRPC deadline); "" when not known. Named by
    the errors that cite the call's deadline."""
    affinity_key: str = ""
    """Whose warm state the call continues (the agent id): with a pool of endpoints, its calls go to one endpoint
    while its load allows; empty: a hash of the prompt's opening text is the key."""
    on_sent: Callable[[str, str], None] | None = field(default=None, compare=False, repr=False)
    """Called as each HTTP request of the call goes out (a retry, another endpoint, the fallback model: each
    again) with the endpoint's base URL (as configured: it may hold credentials) and the upstream model id sent:
    what the caller waits on from then (the dispatcher names it when the call's deadline or cancel ends it)."""


@dataclass(frozen=True)
class Usage:
    """Token counts reported by the upstream (0 when it reported none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class Token:
    """A piece of completion text, as streamed by the upstream."""

    text: str


@dataclass(frozen=True)
class Reasoning:
    """A piece of a reasoning model's thinking, streamed before its answer (``delta.reasoning_content``, as vLLM
    with a reasoning parser, SGLang, llama.cpp and DeepSeek's API send it, or ``delta.reasoning``, as newer vLLM,
    Ollama and OpenRouter do): generated tokens, but not the answer's text."""

    text: str


@dataclass(frozen=True)
class ToolCallOut:
    """A complete tool call, assembled from its deltas; ``arguments_json`` as sent upstream."""

    call_id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class Finished:
    """Last event of a stream: why it stopped, usage (if reported) and the upstream model id.

    ``ending``: how the body ended, ``done_marker`` (``data: [DONE]``) or ``finish_reason`` (a clean
    end after a choice's finish_reason, no marker); not part of equality.
    """

    finish_reason: str | None
    usage: Usage | None
    model: str
    ending: str | None = field(default=None, compare=False)


StreamEvent = Union[Token, Reasoning, ToolCallOut, Finished]


def estimated_tokens(event: StreamEvent) -> int:
    """The completion tokens ``event`` counts as where the server reports no usage (or a count of 0): the word
    pieces of a piece of text or thinking (about one a chunk as servers stream; a whole answer read in one piece
    counts its words) or of a tool call's name and arguments, at least 1 each; 0 for :class:`Finished`. Word
    pieces: :func:`switchyard.dispatcher.request.word_pieces`, the dispatcher's own count of a prompt (about
    0.75 a BPE token for English). The one estimate of both the dispatcher's usage and an endpoint's limit."""
    if isinstance(event, (Token, Reasoning)):
        return max(1, len(word_pieces(event.text)))
    if isinstance(event, ToolCallOut):
        return max(1, len(word_pieces(f"{event.name} {event.arguments_json}")))
    return 0
