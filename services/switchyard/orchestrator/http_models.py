"""The HTTP face's JSON shapes (pydantic), and the OpenAPI document generated from them.

Bodies and answers of ``orchestrator/http_face.py``. The request body takes an
agent harness's fields as it sends them (``agent_id``, ``priority`` in lower
case, ``task_type``, ``max_tokens``) plus RunTaskRequest's own; it is converted
to a RunTaskRequest and checked by the servicer's own validation, so the
bounds (``limits`` in switchyard.json) and their messages are the gRPC edge's.
Here only the JSON types are checked.

Task states use the names agent harnesses read: ``queued``, ``running``,
``finished`` (SUCCEEDED) and ``failed``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Mapping, get_args

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from switchyard.common.tenant import DEFAULT_TENANT, TENANT_PATTERN
from switchyard.common.untrusted import ID_PATTERN
from switchyard.api import agent_pb2
from switchyard.common.errors import InvalidArgument
from switchyard.common.metrics import TASK_TYPES
from switchyard.common.priority import LABELS, LABELS_EXPECTED, ClassLabel

EVENT_STREAM = "text/event-stream"
"""The media type of RunTask's answer over HTTP (Server-Sent Events); every other answer is JSON."""

PROBE_PATHS = ("/healthz", "/readyz")
"""The probes' paths: their status is the answer (200 or 503), read by health checkers (Kubernetes, load balancers,
uptime monitors) that send whatever Accept they are configured with, so it is not negotiated: a checker sending
``Accept: text/html`` read 406 from a healthy face and took it out of service (RFC 9110 section 12.5.1 lets a
server disregard Accept)."""

MIB = 1 << 20

StateName = Literal["unspecified", "queued", "running", "finished", "failed"]
"""A task state's name in HTTP answers, as a type for the answers' models (:data:`STATE_NAMES` is its one source)."""

STATE_NAMES: dict[int, StateName] = {
    agent_pb2.TASK_STATE_UNSPECIFIED: "unspecified",
    agent_pb2.QUEUED: "queued",
    agent_pb2.RUNNING: "running",
    agent_pb2.SUCCEEDED: "finished",
    agent_pb2.FAILED: "failed",
}
"""TaskState -> the lower-case name in HTTP answers."""
assert get_args(StateName) == tuple(STATE_NAMES.values()), "StateName lists STATE_NAMES' names, in its order"


def state_name(state: int) -> StateName:
    """A TaskState's name in HTTP answers (:data:`STATE_NAMES`); a number the proto does not name: unspecified."""
    return STATE_NAMES.get(state, "unspecified")

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""RunTaskRequest.max_tokens's wire type, int32."""


def _lower(value: Any) -> Any:
    """A priority's name in any case (as the X-Priority header takes it) lower-cased; anything else as it is, for
    the strict check to refuse quoting what was sent."""
    if isinstance(value, str) and value.lower() in LABELS:
        return value.lower()
    return value


class TaskRequest(BaseModel):
    """Body of ``POST /api/v1/agent/submit`` and ``POST /api/v1/agent/run`` (a RunTaskRequest).

    ``task_type`` is required, as the field's harnesses send it; ``agent_id`` too, from the body or the
    ``X-Agent-Id`` header (the face checks it: a JSON schema cannot say "this or a header"). Types are strict (JSON's own: ``"128"`` is not an
    integer). ``task_type`` is one of the workflows (no empty default here, unlike the gRPC edge); the
    bounds of every field are checked by the servicer (orchestrator/validation.py), so their messages are
    the gRPC edge's.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    agent_id: str = Field("", description="The agent the task belongs to; required here or as the X-Agent-Id header "
                                          "(the body wins).")
    priority: Annotated[ClassLabel | None, BeforeValidator(_lower)] = Field(
        None, description="Priority class, any case (as X-Priority); absent: the X-Priority header, else normal."
    )
    task_type: Literal[TASK_TYPES] = Field(description="Workflow.")  # type: ignore[valid-type]
    # Only the JSON type is checked here; the range, limits.max_tokens and the model's context window less the
    # prompt, is the servicer's (one value past RunTaskRequest's int32 is carried cut to it, the face quoting
    # what was sent), so every value out of range gets the gRPC edge's message, with one bound. The document
    # states the range a caller may send: from 0 to limits.max_tokens (:func:`openapi` fills the maximum in).
    max_tokens: int = Field(0, json_schema_extra={"minimum": 0},
                            description="Completion tokens at most of each model call (react_loop makes up to "
                                        "orchestrator.react.max_steps + 1); 0: the default, limits.default_max_tokens "
                                        "(at most half the model's context window). At most the lesser "
                                        "of limits.max_tokens and the model's context window less the prompt's tokens.")
    payload: str | None = Field(
        None, description="The question or instruction; absent: orchestrator.http.default_payload."
    )
    task_id: str = Field("", description="The caller's id of the task (idempotent submit); empty: one is generated.")
    model: str = Field("", description="Model id; empty: the dispatcher's model.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Free-form key/values (limits.max_metadata_*).")


EXPECTED: dict[str, str] = {
    "agent_id": "a non-empty string, the agent's id (or the X-Agent-Id header)",
    "priority": LABELS_EXPECTED,  # parse_priority's words: the gRPC edge's message for x-priority
    "task_type": f"one of {', '.join(TASK_TYPES)}",
    "max_tokens": "an integer from 0 (the default) to the lesser of limits.max_tokens and the model's context window "
                  "less the prompt's tokens",
    "payload": "a string (the question or instruction)",
    "task_id": "a string",
    "model": "a string",
    "metadata": "an object of string values",
}
"""What each body field takes, as :class:`InvalidArgument` words it (``field: expected ...``)."""


class AcceptedResponse(BaseModel):
    """Answer of a submit: the task is recorded in the task store and queued."""

    status: Literal["accepted"] = "accepted"
    queue_position: int = Field(description="Submitted tasks ahead of this one in the orchestrator's backlog "
                                            "(priority class, then arrival), tasks; 0: it started at once or is next.")
    task_id: str
    trace_id: str = Field("", description="W3C trace id (32 hex characters); empty with tracing off.")
    state: StateName = Field(
        "queued", description="The task's state: queued for a task recorded now; for the identical body "
                              "resubmitted under its task_id, the recorded task's, which may be finished or failed "
                              "(cancelled): a finished task is not run again.")


class TimingsModel(BaseModel):
    """Wall-clock timings of a task, seconds."""

    queue_wait_s: dict[str, float] = Field(default_factory=dict, description="Wait per queue, seconds.")
    ttft_s: float = Field(0.0, description="Accepted -> first token, seconds (a submitted task: from its first start, "
                                           "over every run).")
    total_s: float = Field(0.0, description="Accepted -> final event, seconds (a submitted task: from its first start, "
                                            "over every run).")
    stage_s: dict[str, float] = Field(default_factory=dict, description="Seconds per workflow stage.")


class TaskStatusResponse(BaseModel):
    """Answer of a status read: TaskStatus with the state's lower-case name and the peak memory in MiB as well."""

    task_id: str
    state: StateName
    compute_score_used: float = Field(description="Compute score x seconds the task consumed on the dispatcher: so far while "
                                                   "running (from the orchestrator that runs it; another replica "
                                                   "reads 0 until it ends), in all once finished or failed (a "
                                                   "cancelled task's until the cancel, the step it cut "
                                                   "included; 0 when cancelled while queued).")
    memory_peak_mb: float = Field(description="Peak KV/prefix-state memory held for the task, MiB (2^20 bytes).")
    memory_peak_bytes: int = Field(description="The same peak, bytes.")
    queue_position: int = Field(0, description="While queued: submitted tasks ahead of it in the orchestrator's "
                                               "backlog, tasks (0: next to start); 0 in every other state.")
    error: str = Field("", description="gRPC status name and message once failed (CANCELLED: ... when cancelled).")
    tenant_id: str = Field(DEFAULT_TENANT, description="The task's tenant: its bearer token's, else X-Tenant-Id, else default.")
    timings: TimingsModel
    result: dict[str, Any] | None = Field(None, description="The final event (FinalEvent as JSON) once finished; none once failed.")


class ErrorBody(BaseModel):
    code: str = Field(description="The gRPC status name, e.g. RESOURCE_EXHAUSTED.")
    message: str = Field(description="What failed, naming the field, queue or service, and the fix.")
    origin: str = Field(description="The hop that answered the error: orchestrator, retrieval, dispatcher, upstream model, proxy.")


class ErrorResponse(BaseModel):
    """Every error answer; also the data of the ``error`` event that ends a stream that failed after it began."""

    error: ErrorBody


def message_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready data: field names as in agent.proto, every field present, and 64-bit
    integers as JSON numbers (protobuf's JSON mapping writes them as strings, for JavaScript's 2^53; these
    are byte and token counts, far below it), so a figure has one type wherever the face answers it."""
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _int64_as_numbers(message.DESCRIPTOR, data)
    return data


_INT64_TYPES = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})


def _int64_as_numbers(descriptor: Any, data: dict[str, Any]) -> None:
    """Turn the 64-bit integer fields of ``data`` (``MessageToDict`` of a ``descriptor`` message) into ints,
    in nested messages too (maps of scalars and repeated fields included)."""
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if value_field.type in _INT64_TYPES:
                    data[field.name] = {k: int(v) for k, v in value.items()}
                elif value_field.message_type is not None:
                    for item in value.values():
                        _int64_as_numbers(value_field.message_type, item)
            else:
                for item in value if isinstance(value, list) else [value]:
                    _int64_as_numbers(field.message_type, item)
        elif field.type in _INT64_TYPES:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def status_json(status: agent_pb2.TaskStatus) -> dict[str, Any]:
    """TaskStatus -> :class:`TaskStatusResponse` data."""
    return {
        "task_id": status.task_id,
        "state": state_name(status.state),
        "compute_score_used": status.compute_score_used,
        "memory_peak_mb": status.memory_peak_bytes / MIB,
        "memory_peak_bytes": status.memory_peak_bytes,
        "queue_position": status.queue_position,
        "error": status.error,
        "tenant_id": status.tenant_id or DEFAULT_TENANT,
        "timings": message_dict(status.timings),
        "result": message_dict(status.result) if status.HasField("result") else None,
    }


class _AsJson:
    """A parsed body value shown as JSON spells it (``true``, ``null``, ``100.0``) in an error's ``(got ...)``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return json.dumps(self.value)


def _got(value: Any) -> Any:
    """The value a caller sent, as the message quotes it: a string as it is, anything else (null included) as
    JSON."""
    return value if isinstance(value, str) else _AsJson(value)


def describe_error(exc: ValidationError, expected: Mapping[str, str] = EXPECTED) -> str:
    """Pydantic's errors of a :class:`TaskRequest` body as the gRPC edge words a bad field:
    ``field: expected ... (got value)`` (:class:`InvalidArgument`), one per error, joined by ``; ``, each
    field's words from ``expected`` (the HTTP face passes its limits in). A body that is not JSON, or not an
    object, is ``body: expected a JSON object ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        kind = err["type"]
        if kind == "json_invalid":
            reason = err["ctx"].get("error", "invalid JSON") if err.get("ctx") else "invalid JSON"
            if "hex escape" in reason:  # jiter's words for a \uD800-\uDFFF escape without its pair
                reason += ("; a \\uXXXX escape must name a character: a UTF-16 surrogate (\\uD800-\\uDFFF) "
                           "only as half of a pair")
            problem = InvalidArgument("body", f"a JSON object ({reason})")
        elif not loc or kind == "model_type":
            problem = InvalidArgument("body", "a JSON object", _json_type(err.get("input")))
        elif kind == "extra_forbidden":
            problem = InvalidArgument(loc[0], f"one of the body's fields ({', '.join(TaskRequest.model_fields)}); "
                                      "there is no such field", _got(err.get("input")))
        elif kind == "missing":
            problem = InvalidArgument(loc[0], f"{expected[loc[0]]} (required)")
        else:
            problem = InvalidArgument(".".join(loc), "a string" if len(loc) > 1 else expected[loc[0]],
                                      _got(err.get("input")))
        parts.append(str(problem))
    if len(parts) > MAX_ERRORS_LISTED:  # a body of 200,000 unknown keys got an answer 11.7 times its size
        parts[MAX_ERRORS_LISTED:] = [f"and {len(parts) - MAX_ERRORS_LISTED} more errors"]
    return "; ".join(parts)


MAX_ERRORS_LISTED = 10
"""The most field errors one answer lists (the rest are counted)."""


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (array, string, number, ...)."""
    names = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
    return f"a JSON {names.get(type(value), type(value).__name__)}"


SSE_EVENT: dict[str, Any] = {
    "type": "object", "required": ["event", "data", "id"],
    "description": "One event of the stream, as an SSE parser reads it (the schema of each event, as OpenAPI 3.2's "
                   "itemSchema says it and schema-driven tools read a text/event-stream schema): its kind, its id "
                   "and its data, one JSON object (the TaskEvent's member of that kind, field names as in "
                   "agent.proto; an error event's is ErrorResponse). Comment lines (':', while the task waits) "
                   "are no event.",
    "properties": {
        "event": {"type": "string",
                  "enum": ["accepted", "stage", "token", "tool_call", "tool_result", "final", "error"]},
        "id": {"type": "string", "pattern": r"^.+:[0-9]+(:end)?$",
               "description": "<task_id>:<n>, n from 0; ':end' added on the stream's last event (final or error)"},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
}
"""The schema of each event of ``POST /api/v1/agent/run``'s stream (http_face.py writes them). A ``{"type":
"string"}`` for the stream read to schemathesis as the schema of each event, and every event violated it."""


def id_schema(most: int, setting: str, required: bool = False) -> dict[str, Any]:
    """The JSON schema of an id of at most ``most`` characters (``limits.<setting>``): the id rule
    (untrusted.check_id_chars) as far as :data:`ID_PATTERN` says it. Without it, a schema-driven client
    (schemathesis) sent ids the document called valid, with a tab or U+008D, and was refused 400."""
    return {"type": "string", **({"minLength": 1} if required else {}), "maxLength": most, "pattern": ID_PATTERN,
            "description": f"An id: at most {most} characters (limits.{setting}), printable (no control, "
                           "invisible format or bidirectional characters, no space other than U+0020), in NFC, "
                           "no space at its start or end (refused, not stripped: a header's surrounding whitespace "
                           "is HTTP's and not the id's)."}


def openapi(version: str, max_tokens: int, max_id_chars: int, max_task_id_chars: int,
            cors: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the HTTP face, its schemas generated from the models above; ``max_tokens``:
    the face's ``limits.max_tokens``, the most a body's max_tokens may be (the model's context window less the
    prompt may allow less, which no schema can say); ``max_id_chars`` and ``max_task_id_chars``: the longest
    agent_id or model, and task_id (:func:`id_schema`); ``cors``: the face answers CORS preflights
    (``orchestrator.http.cors_allowed_origins`` lists origins), an ``options`` operation on every path. Every
    route the face serves is an operation here, HEAD beside each GET."""
    models = [TaskRequest, AcceptedResponse, TaskStatusResponse, ErrorResponse]
    _, defs = models_json_schema([(m, "serialization" if m is not TaskRequest else "validation") for m in models],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs.get("$defs", {})
    fields = schemas["TaskRequest"]["properties"]
    fields["max_tokens"]["maximum"] = max_tokens
    for name, most, setting in (("agent_id", max_id_chars, "max_id_chars"), ("model", max_id_chars, "max_id_chars"),
                                ("task_id", max_task_id_chars, "max_task_id_chars")):
        rule = id_schema(most, setting)
        fields[name] = {**fields[name], **rule, "description": f"{fields[name]['description']} {rule['description']}"}
    agent_path = {"name": "agent_id", "in": "path", "required": True,
                  "schema": id_schema(max_id_chars, "max_id_chars", required=True)}
    task_path = {"name": "task_id", "in": "path", "required": True,
                 "schema": id_schema(max_task_id_chars, "max_task_id_chars", required=True)}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def json_body(model: type[BaseModel], description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": ref(model)}}}

    errors = {str(code): json_body(ErrorResponse, meaning) for code, meaning in (
        (400, "INVALID_ARGUMENT: a field is missing, of the wrong type or out of range, or the body is not JSON "
              "(the message names the field and what was expected)"),
        (401, "UNAUTHENTICATED: no or an unknown bearer token"),
        (403, "PERMISSION_DENIED: the token may not call this"),
        (429, "RESOURCE_EXHAUSTED: a queue is full (refused at once, nothing queued)"),
        (503, "UNAVAILABLE: a downstream service or the task store did not answer"),
        (504, "DEADLINE_EXCEEDED: a queue's timeout or the task's time limit passed"),
    )}
    # Every route: an Expect header the face does not meet, and a request head past the parser's bounds.
    face_errors = {
        "417": json_body(ErrorResponse, "FAILED_PRECONDITION: an Expect header other than 100-continue"),
        "431": json_body(ErrorResponse, "INVALID_ARGUMENT: a header line (or the request line) past 8190 bytes, or "
                                        "too many header fields (the connection is closed)"),
    }
    tenant_header = {
        "name": "X-Tenant-Id", "in": "header", "required": False,
        "schema": {"type": "string", "pattern": f"^$|^{TENANT_PATTERN.pattern}$"},  # empty: default, as absent
        "description": "The task's tenant where the bearer token names none (a token's tenant wins; a header "
                       "naming another is 403); absent or empty: default. Sent twice with different values: 400."}
    headers = [
        {"name": "X-Agent-Id", "in": "header", "required": False,
         "schema": {"type": "string", "maxLength": max_id_chars, "pattern": f"^$|{ID_PATTERN}"},
         "description": "The agent, where the body's agent_id is empty (the body wins); one of the two is required. "
                        "Checked even where the body wins (limits.max_id_chars, printable); empty: ignored; sent "
                        "twice with different values: 400."},
        {"name": "X-Priority", "in": "header", "required": False,
         "schema": {"type": "string", "enum": list(LABELS)},
         "description": "The priority class, any case, where the body has none (the body wins); checked even "
                        "where the body wins; empty: ignored; sent twice with different values: 400."},
        tenant_header,
    ]
    body_errors = {
        "404": json_body(ErrorResponse, "NOT_FOUND: the body's model is not served here (the message names the "
                                        "models that are)"),
        "413": json_body(ErrorResponse, "INVALID_ARGUMENT: the body is larger than the face reads (the message "
                                        "gives the limit, from limits.max_payload_chars)"),
        "408": json_body(ErrorResponse, "DEADLINE_EXCEEDED: the body did not arrive whole within "
                         "orchestrator.http.body_read_timeout_s (the connection is closed)"),
        "415": json_body(ErrorResponse, "INVALID_ARGUMENT: the body is not Content-Type application/json"),
    }
    probe_ok = {"description": "Serving", "content": {"application/json": {"schema": {
        "type": "object", "required": ["status"], "properties": {"status": {"const": "serving"}}}}}}
    status_answers = {"200": json_body(TaskStatusResponse, "The task's status"),
                      "404": json_body(ErrorResponse, "NOT_FOUND: no such task (or past retention)"),
                      **{k: v for k, v in errors.items() if k in ("400", "401", "403", "503")}, **face_errors}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard AgentService over HTTP", "version": version,
                 "description": "Every path also answers 405 (UNIMPLEMENTED, with Allow) to a method it does not "
                                "serve, 406 (INVALID_ARGUMENT) to an Accept header that takes none of the media "
                                "type its operation answers (text/event-stream for RunTask, application/json "
                                "elsewhere; no Accept header takes anything), and the face 501 (UNIMPLEMENTED) to a method no route knows and 505 "
                                "(INVALID_ARGUMENT) to a version other than HTTP/1.0 and HTTP/1.1 (the connection "
                                "is closed); all in the ErrorResponse shape. Bearer tokens (Authorization) are "
                                "the bearer security scheme's."},
        "paths": {
            "/api/v1/agent/submit": {"post": {
                "summary": "SubmitTask: record the task, place it in the backlog of submitted tasks, answer once "
                           "it is durable",
                "parameters": headers,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(TaskRequest)}}},
                "responses": {"200": json_body(AcceptedResponse, "Accepted and recorded"),
                              "409": json_body(ErrorResponse, "ALREADY_EXISTS: task_id taken by another request"),
                              **errors, **body_errors, **face_errors},
            }},
            "/api/v1/agent/run": {"post": {
                "summary": "RunTask as Server-Sent Events: one event per TaskEvent (accepted, stage, token, "
                           "tool_call, tool_result), then final, or an error event; a comment line (':') whenever the stream "
                           "has been quiet for orchestrator.http.sse_keepalive_s while its task waits",
                "parameters": [*headers, {
                    "name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"},
                    "description": "Sent by an EventSource-style client reconnecting: the id of the last event it "
                                   "read. A stream is not resumed and the task is not run again: 204 where the id "
                                   "ended the stream (its final or error event), else 409."}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(TaskRequest)}}},
                "responses": {"200": {"description": "The event stream; each event's id is <task_id>:<n>, with "
                                                     ":end added on the last (final or error)",
                                      "content": {EVENT_STREAM: {"schema": SSE_EVENT}}},
                              "204": {"description": "Last-Event-ID named the last event of a stream: it was read "
                                                     "whole, and an EventSource-style client stops reconnecting"},
                              "409": json_body(ErrorResponse, "ABORTED: Last-Event-ID named an event within a "
                                               "stream: its task was cancelled when its connection closed, and "
                                               "a stream is not resumed (POST without it to run the task again)"),
                              **errors, **body_errors, **face_errors},
            }},
            "/api/v1/agent/{agent_id}/status": {"get": {
                "summary": "GetTaskStatus of the task the agent submitted last (the agent of the caller's tenant)",
                "parameters": [agent_path, tenant_header],
                "responses": status_answers,
            }},
            "/api/v1/tasks/{task_id}": {"get": {
                "summary": "GetTaskStatus of one task",
                "parameters": [task_path, tenant_header],
                "responses": status_answers,
            }},
            "/api/v1/tasks/{task_id}/cancel": {"post": {
                "summary": "CancelTask: a queued task never starts, a running one is stopped; either ends failed "
                           "with error CANCELLED. Answers the status after it (a finished task's unchanged). Any "
                           "replica answers: a task another orchestrator holds is cancelled by that one",
                "parameters": [task_path, tenant_header],
                "responses": status_answers,
            }},
            "/healthz": {"get": {
                "summary": "Liveness, for an HTTP probe or load balancer: 200 while the process serves (gRPC "
                           "health's overall status)",
                "security": [],
                "responses": {"200": probe_ok, **face_errors},
            }},
            "/readyz": {"get": {
                "summary": "Readiness, for an HTTP probe or load balancer: 200 while the orchestrator takes tasks of "
                           "its default type, as gRPC health's agent.AgentService answers SERVING",
                "security": [],
                "responses": {"200": probe_ok,
                              "503": json_body(ErrorResponse, "UNAVAILABLE: not ready, naming why (a downstream "
                                                              "service that did not answer its health check, a "
                                                              "drain, the start); Retry-After"),
                              **face_errors},
            }},
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "Required where orchestrator.auth is on (a token file's tokens, each with the methods "
                           "it may call); not asked for where it is off"}}},
        # a bearer token, or none (OpenAPI 3.1 section 4.8.30: an empty requirement makes it optional): the
        # document is the same whether auth is on or off, so a generated client can send the token
        "security": [{"bearer": []}, {}],
    }
    document["paths"]["/openapi.json"] = {"get": {
        "summary": "This document (OpenAPI 3.1)",
        "security": [],
        "responses": {"200": {"description": "The OpenAPI document", "content": {"application/json": {
            "schema": {"type": "object", "required": ["openapi", "paths"]}}}}, **face_errors},
    }}
    for path, operations in document["paths"].items():
        # each answers one media type: an Accept that takes none of it is 406, but at a probe (PROBE_PATHS)
        for operation in ([] if path in PROBE_PATHS else operations.values()):
            answers = [media for status, answer in operation["responses"].items() if status.startswith("2")
                       for media in answer.get("content", {})]
            media = answers[0] if answers else "application/json"
            operation["responses"]["406"] = json_body(ErrorResponse, (
                f"INVALID_ARGUMENT: the Accept header takes no {media}, which this route answers (a media range "
                f"that takes it: {media}, {media.split('/')[0]}/* or */*, with a q above 0; or no Accept header); "
                "the message names it. Errors are application/json on every route"))
        if "get" in operations:  # RFC 9110 section 9.3.2: HEAD wherever GET, its status and headers, no body
            get = operations["get"]
            operations["head"] = {
                "summary": f"As GET, with no body: {get['summary']}",
                **{key: get[key] for key in ("parameters", "security") if key in get},
                "responses": {status: {"description": answer["description"]}
                              for status, answer in get["responses"].items()},
            }
        if cors:
            in_path = {p["name"]: p for operation in operations.values() for p in operation.get("parameters", ())
                       if p["in"] == "path"}
            operations["options"] = _preflight(sorted(method.upper() for method in operations), list(in_path.values()),
                                               face_errors)
    return document


CORS_REQUEST_HEADERS = ("Authorization", "Content-Type", "Content-Encoding", "X-Agent-Id", "X-Priority", "X-Tenant-Id",
                        "Last-Event-ID", "traceparent", "tracestate")
"""The request headers a browser page of an allowed origin may send (a preflight naming another is 403): the
bearer token, the body's type and coding (a compressed body, which the face reads), the edge headers, an
EventSource-style client's ``Last-Event-ID``, and the W3C trace context a page's OpenTelemetry sends."""


def _preflight(methods: list[str], in_path: list[dict[str, Any]], face_errors: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` operation of a path where the face answers CORS preflights (a browser's, before a page of
    another origin calls ``methods``); ``in_path``: the path's parameters."""
    error = {"description": "PERMISSION_DENIED: the Origin is not in orchestrator.http.cors_allowed_origins, or the "
                            "method or a header asked for is not taken here (the message says which); no CORS "
                            "headers, so the browser refuses the call",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return {
        "summary": f"CORS preflight of a browser page before it calls {', '.join(methods)} here; runs nothing",
        "security": [],  # a browser sends a preflight with no credentials
        "parameters": [
            *in_path,
            {"name": "Origin", "in": "header", "required": True, "schema": {"type": "string"},
             "description": "The page's origin: one of orchestrator.http.cors_allowed_origins (or any, where it "
                            "lists '*')."},
            {"name": "Access-Control-Request-Method", "in": "header", "required": True,
             "schema": {"type": "string", "enum": methods}},
            {"name": "Access-Control-Request-Headers", "in": "header", "required": False,
             "schema": {"type": "string"},
             "description": f"Comma-separated, among {', '.join(CORS_REQUEST_HEADERS)}."},
        ],
        "responses": {
            "200": {"description": "Allowed: the call may follow", "headers": {
                name: {"schema": {"type": "string"}} for name in (
                    "Access-Control-Allow-Origin", "Access-Control-Allow-Methods", "Access-Control-Allow-Headers",
                    "Access-Control-Max-Age", "Vary")}},
            "403": error,
            **face_errors,
        },
    }
