"""RunTask and SubmitTask requests checked at the edge, before ``accepted``.

Every bound comes from ``limits`` in switchyard.json (see docs/architecture.md,
"Where each limit lives"); a bad field is ``INVALID_ARGUMENT`` naming it and
the bound it broke.

The agent and its priority class may also come as headers, as agent harnesses
tag their model calls: ``X-Agent-Id`` and ``X-Priority`` over HTTP, the gRPC
metadata keys ``x-agent-id`` and ``x-priority`` (:func:`apply_edge_headers`).
The request's own field wins where both are given; a header fills a field the
request left empty (``agent_id``) or unset (``priority``).

The task's tenant comes from the caller's bearer token when its line names one,
else from ``X-Tenant-Id`` (metadata ``x-tenant-id``), else ``default``
(:func:`edge_tenant`, common/tenant.py).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import TYPE_CHECKING

import grpc
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.common.config.limits import ContextWindow
from switchyard.common.errors import InvalidArgument, SwitchyardError
from switchyard.common.tenant import DEFAULT_TENANT, TENANT_HEADER, check_tenant
from switchyard.common.untrusted import check_id, check_utf8
from switchyard.common.metrics import TASK_TYPES
from switchyard.common.priority import LABELS_EXPECTED, PriorityClass, check_priority
from switchyard.gateway.models import not_served

if TYPE_CHECKING:
    from switchyard.common.auth import BearerTokens

AGENT_ID_HEADER = "x-agent-id"
PRIORITY_HEADER = "x-priority"
_PRIORITY_NAMES = {c.label: c.proto for c in PriorityClass}


def parse_priority(value: str, field: str) -> int:
    """``core``, ``normal`` or ``batch`` (any case) -> the ``agent.Priority`` value.

    Raises:
        InvalidArgument: naming ``field`` when ``value`` is none of the three.
    """
    try:
        return _PRIORITY_NAMES[value.strip().lower()]
    except KeyError:
        raise InvalidArgument(field, LABELS_EXPECTED, value) from None


def edge_header(metadata: Iterable[tuple[str, str]] | None, name: str,
                same: Callable[[str], str] = lambda value: value) -> str | None:
    """The one value of the edge header ``name`` (lower-case; gRPC metadata or HTTP headers), None when absent
    or only empty. An empty value names nothing and is ignored (``same`` of it is ""), so an empty header beside
    one with a value is that value, not two values. ``same``: what two values must agree on (x-priority's
    class, whatever its case and spaces).

    Raises:
        InvalidArgument: naming the header, sent more than once with different non-empty values (which one
            counts is not the caller's to leave to a proxy's order), or holding bytes that are not UTF-8.
    """
    values = {check_utf8(str(value), f"{name} header") for key, value in metadata or () if key == name}
    values = {value for value in values if same(value)}  # an empty header names nothing
    if len({same(value) for value in values}) > 1:
        raise InvalidArgument(f"{name} header", "one value (it was sent more than once, with different values)",
                              tuple(sorted(values)))  # every value, as sent
    return values.pop() if values else None


def _without_ows(value: str) -> str:
    """A header's value without the spaces and tabs around it, as an HTTP parser reads it (RFC 9110 section 5.5:
    they are not part of the value), so a header says the same over gRPC, whose metadata kept them, as over HTTP
    (one harness setting, ``X-Agent-Id:  agent-7 ``, named two agents); one of spaces alone stays as sent, refused."""
    return value.strip(" \t") or value


def _edge_header_without_ows(metadata: Iterable[tuple[str, str]] | None, name: str) -> str | None:
    """:func:`edge_header` ``name``'s one value :func:`_without_ows`, two values that differ only by it agreeing."""
    value = edge_header(metadata, name, _without_ows)
    return None if value is None else _without_ows(value)


def apply_edge_headers(request: agent_pb2.RunTaskRequest, metadata: Iterable[tuple[str, str]] | None,
                       max_id_chars: int) -> None:
    """Fill ``agent_id`` and ``priority`` from the ``x-agent-id`` and ``x-priority`` headers (gRPC metadata, or
    HTTP headers, keys lower-case) where the request leaves them empty or unset; the request's own fields win.
    ``max_id_chars``: the longest agent id, characters (``limits.max_id_chars``).

    Raises:
        InvalidArgument: naming the header: ``x-priority`` is not core, normal or batch, or ``x-agent-id`` is
            longer than ``max_id_chars``, only whitespace or holds a control character, each checked whether
            or not the request's own field wins (a header that says something wrong is refused, not ignored;
            an empty one names nothing and is ignored); either sent twice with different values
            (:func:`edge_header`).
    """
    agent = _edge_header_without_ows(metadata, AGENT_ID_HEADER)
    if agent is not None:
        check_id(agent, f"{AGENT_ID_HEADER} header", max_id_chars)
        if not request.agent_id:
            request.agent_id = agent
    priority_header = edge_header(metadata, PRIORITY_HEADER, lambda value: value.strip().lower())
    if priority_header is not None:  # an empty one names nothing, as an empty x-agent-id
        priority = parse_priority(priority_header, f"{PRIORITY_HEADER} header")
        if request.priority == agent_pb2.PRIORITY_UNSPECIFIED:
            request.priority = priority


def token_tenant(metadata: Iterable[tuple[str, str]] | None, tokens: "BearerTokens | None") -> str:
    """The tenant the caller's bearer token (the ``authorization`` header) names; "" with auth off (``tokens``
    None) or a token that names none. The one reading of it: the task's tenant (:func:`edge_tenant`) and which
    tasks a caller may read (``OrchestratorService._visible_to_caller``)."""
    if tokens is None:
        return ""
    return tokens.tenant_of(next((str(value) for key, value in metadata or () if key == "authorization"), None))


def edge_tenant(metadata: Iterable[tuple[str, str]] | None, tokens: "BearerTokens | None") -> str:
    """The task's tenant: its bearer token's (``tokens``: None with auth off), else the ``x-tenant-id`` header,
    else ``default``.

    Raises:
        InvalidArgument: naming ``x-tenant-id``, not 1 to 64 characters of A-Z a-z 0-9 . _ -, or sent twice with
            different values (checked first, with or without a token).
        SwitchyardError: PERMISSION_DENIED naming ``x-tenant-id``, a well-formed header naming another tenant
            than the bearer token's.
    """
    header = _edge_header_without_ows(metadata, TENANT_HEADER) or ""
    if header:
        check_tenant(header, f"{TENANT_HEADER} header")
    own = token_tenant(metadata, tokens)
    if own:
        if header and header != own:
            raise SwitchyardError(f"{TENANT_HEADER}: the bearer token belongs to another tenant than {header!r}; "
                                  "leave the header out or send the token's own", grpc.StatusCode.PERMISSION_DENIED)
        return own
    return header or DEFAULT_TENANT


@dataclass
class TaskSpec:
    """A validated RunTaskRequest, defaults filled in.

    ``model`` is the caller's (empty: the dispatcher's own model); ``max_tokens`` is never 0.
    """

    task_id: str
    payload: str
    workflow: str
    priority: int
    max_tokens: int
    model: str
    agent_id: str
    tenant_id: str = DEFAULT_TENANT
    """Who the task is served for (:func:`edge_tenant`)."""
    max_tokens_asked: int = 0
    """``max_tokens`` as the request sent it: 0 when ``max_tokens`` is the default (a refusal says so)."""


def task_spec_of(recorded: str) -> TaskSpec:
    """The :class:`TaskSpec` a task record keeps (``TaskRecord.spec``: its fields, JSON), what an orchestrator
    that adopts the task starts it from; a field the record lacks (written by an earlier build) takes its default,
    one this build does not know (a later build's) is left out.

    Raises:
        ValueError: ``recorded`` is no JSON object of a TaskSpec's fields.
        TypeError: a field without a default is missing.
    """
    values = json.loads(recorded)
    if not isinstance(values, dict):
        raise ValueError(f"expected a JSON object of TaskSpec fields, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(TaskSpec)}
    return TaskSpec(**{k: v for k, v in values.items() if k in known})


def validate(request: agent_pb2.RunTaskRequest, config: SwitchyardConfig, default_model: str,
             tenant_id: str = DEFAULT_TENANT, served: Sequence[str] = (), reported_window: int = 0) -> TaskSpec:
    """Check a request against ``limits`` and fill defaults; ``default_model`` is the dispatcher's,
    for a request naming none; ``tenant_id`` the tenant :func:`edge_tenant` found; ``served`` every model name
    the dispatcher serves (``ModelInfo.models``: a step engine's one model, or the ids its upstream lists and
    their ``model_map`` aliases), empty when not known (any name is then accepted and the upstream decides);
    ``reported_window`` the context window the upstream reports for the request's model (0: none).

    ``max_tokens`` is taken as sent (0: the default for the model's window); its range depends on the prompt's
    tokens, so it is checked where they are counted (workflows.py, ``check_question_fits``, with
    :func:`max_tokens_refusal`'s words).

    Raises:
        InvalidArgument: naming the field and what was expected (payload, task_id, agent_id, model,
            task_type, priority, metadata).
        SwitchyardError: NOT_FOUND, ``model`` names a model not in ``served`` (the message names it, the names
            served and the nearest of them).
    """
    orch, limits = config.orchestrator, config.limits
    if not request.payload.strip():
        raise InvalidArgument("payload", "a non-empty string (the question or instruction)")
    if len(request.payload) > limits.max_payload_chars:
        raise InvalidArgument("payload", f"at most {limits.max_payload_chars} characters (limits.max_payload_chars)",
                              f"{len(request.payload)} chars")
    check_id(request.task_id, "task_id", limits.max_task_id_chars, "max_task_id_chars")
    check_id(request.agent_id, "agent_id", limits.max_id_chars)
    check_id(request.model, "model", limits.max_id_chars)
    workflow = request.task_type or orch.default_task_type
    if workflow not in TASK_TYPES:
        raise InvalidArgument("task_type", f"one of {', '.join(TASK_TYPES)} (empty = {orch.default_task_type})", workflow)
    check_priority(request.priority)
    if served and request.model and request.model not in served:  # refused now, not after accepted
        raise not_served(request.model, served, default_model)
    model = request.model or default_model
    window = limits.context_window(model, reported_window)
    default = limits.default_for(window.tokens)
    check_metadata(request.metadata, limits)
    return TaskSpec(
        task_id=request.task_id or f"task-{uuid.uuid4().hex[:16]}",
        payload=request.payload,
        workflow=workflow,
        priority=request.priority or agent_pb2.NORMAL,
        max_tokens=request.max_tokens or default,
        model=request.model,
        agent_id=request.agent_id,
        tenant_id=tenant_id,
        max_tokens_asked=request.max_tokens,
    )


def max_tokens_bound(limits: Any, window: ContextWindow, prompt_tokens: int) -> int:
    """The largest ``max_tokens`` a task may ask for beside a prompt of ``prompt_tokens`` tokens: the lesser of
    ``limits.max_tokens`` and the model's context window (``window.tokens``) less the prompt as the model
    server counts it (:meth:`ContextWindow.left`), tokens (0 at least)."""
    return max(0, min(limits.max_tokens, window.left(prompt_tokens)))


def max_tokens_refusal(value: int, limits: Any, model: str, window: ContextWindow,
                       prompt_tokens: int) -> InvalidArgument:
    """The one refusal of a ``max_tokens`` of ``value`` out of range beside a prompt of ``prompt_tokens`` tokens
    in ``model``'s ``window``: it states :func:`max_tokens_bound` and both terms of it, whichever edge finds it."""
    return InvalidArgument(
        "max_tokens",
        f"0 (the default, {limits.default_for(window.tokens)}) to {max_tokens_bound(limits, window, prompt_tokens)}: "
        f"the lesser of limits.max_tokens ({limits.max_tokens}) and the context window of {model}, "
        f"{window.described()}, less the prompt's {window.counted(prompt_tokens)}",
        value,
    )


def check_metadata(metadata: Any, limits: Any) -> None:
    """Bound the ``metadata`` map: entries and bytes (UTF-8 keys plus values).

    Raises:
        InvalidArgument: naming ``metadata`` and the bound it broke.
    """
    if not metadata:
        return
    if len(metadata) > limits.max_metadata_entries:
        raise InvalidArgument("metadata", f"at most {limits.max_metadata_entries} entries (limits.max_metadata_entries)",
                              f"{len(metadata)} entries")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if size > limits.max_metadata_bytes:
        raise InvalidArgument("metadata", f"at most {limits.max_metadata_bytes} bytes of keys and values "
                              "(limits.max_metadata_bytes)", f"{size} bytes")
