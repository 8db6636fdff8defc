"""One dispatcher request in and out: validation and submission, then its chunks and its tracing.

After vLLM v1's ``Processor`` (a request in, validated, handed to the engine core) and its
``OutputProcessor`` (the engine's outputs out): :class:`RequestProcessor` is what every
:class:`~switchyard.dispatcher.generate_stream.GenerateSession` of the dispatcher uses for each of its
requests. :meth:`RequestProcessor.open_request` validates a ``GenerateRequest`` (:func:`to_request`),
sets its deadline and submits it to the engine loop; :meth:`RequestProcessor.chunk` encodes an item of
its output stream, :func:`done_chunk` its closing chunk; :meth:`RequestProcessor.record_done` closes its
tracing. The servicer (:mod:`switchyard.dispatcher.service`) builds one and hands it to its sessions, so
that a request's path goes servicer -> session -> processor -> engine loop and back, and never calls
back into the servicer.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from typing import Any, Iterable, Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common import telemetry, untrusted
from switchyard.common.config import SwitchyardConfig
from switchyard.common.config.limits import ContextWindow, RequestLimitsConfig
from switchyard.common.errors import DispatcherNotServing, InvalidArgument, SwitchyardError
from switchyard.common.priority import PriorityClass, check_priority
from switchyard.common.tenant import DEFAULT_TENANT, check_tenant
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engine_loop import LoopBase
from switchyard.dispatcher.engines import StepEngine, StreamEngine
from switchyard.dispatcher.output import OutputItem, StreamDone, StreamToken, StreamToolCall
from switchyard.dispatcher.request import Message, Request, RequestOutput, RequestStatus, Tool, ToolCall, word_pieces
from switchyard.dispatcher.scheduler.base import QUEUE_NAME
from switchyard.gateway.models import not_served

tracer = telemetry.get_tracer("switchyard.dispatcher.service")  # the request spans' scope, as before this module

_ROLES = ("system", "user", "assistant", "tool")


MAX_CHARS_PER_TOKEN = 128
"""No tokenizer packs more characters into one token than this: a caller's ``prompt_tokens`` below
``characters / MAX_CHARS_PER_TOKEN`` is refused rather than trusted (KV accounting relies on it)."""

COUNT_IN_THREAD_BYTES = 256 * 1024
"""Requests larger than this are validated and counted off the event loop."""

NOT_STARTED = "it has not started yet, or has stopped"
"""Why a dispatcher with no engine loop refuses requests (:class:`~switchyard.common.errors.DispatcherNotServing`)."""

MODELS_READ_WAIT_S = 1.0
"""Longest a request and a DescribeModel wait for the upstream's model list, seconds, in all
(:meth:`StreamEngine.await_model_list`: the first read, or DescribeModel's read of an unread list, and then a
read again for a model the list does not name): their callers' deadlines are a few seconds (the orchestrator
asks DescribeModel again with 1 s, ``MODEL_INFO_REFRESH_TIMEOUT_S``). Each of the two waits had this bound of
its own, so a call could wait twice as long."""

DEADLINE_SOURCE_EXTRA_CHARS = 64
"""Characters a ``GenerateRequest.deadline_source`` may have beyond ``limits.max_id_chars`` (the orchestrator's
``orchestrator.task_time_limit_s.<type> = 600`` names a task type, an id of at most that)."""


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_NAME_EXPECTED = "1 to 64 characters of A-Z a-z 0-9 _ - (the OpenAI function name's rule)"
"""What a tool's name may be: OpenAI's function-calling rule, which OpenAI-compatible servers hold it to."""


SCHEMA_CACHE_MAX_CHARS = 16_384
"""Longest ``parameters_json`` whose check :func:`schema_problem` keeps, characters: a tool's schema is a few hundred
characters; keeping every one checked, up to ``limits.max_tool_schema_chars`` each, held up to 256 of them."""


def schema_problem(parameters_json: str) -> str | None:
    """What is wrong with a tool's ``parameters_json``, said as what was expected, or None when it is a JSON
    Schema (checked against the Draft 2020-12 metaschema, ``jsonschema``) of an object: what OpenAI-compatible
    servers take as a function's parameters (OpenAI refuses a schema whose type is not ``object``). ``""`` is
    ``{}``, any object. Cached up to :data:`SCHEMA_CACHE_MAX_CHARS` characters: a react_loop agent offers the same
    few tools on every step, and a check costs about half a millisecond."""
    if len(parameters_json) <= SCHEMA_CACHE_MAX_CHARS:
        return _cached_schema_problem(parameters_json)
    return _schema_problem(parameters_json)


@functools.lru_cache(maxsize=256)
def _cached_schema_problem(parameters_json: str) -> str | None:
    return _schema_problem(parameters_json)


def _schema_problem(parameters_json: str) -> str | None:
    from jsonschema import Draft202012Validator, SchemaError  # the dispatcher's; the orchestrator never checks

    expected = "a JSON Schema object (the tool's parameters, type object)"
    try:
        schema = untrusted.loads(parameters_json) if parameters_json else {}
    except ValueError as exc:
        return f"{expected}: not JSON ({exc})"
    if not isinstance(schema, dict):
        return expected
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"{expected}: at {exc.json_path}, {exc.message[:200]}"
    except RecursionError:
        return f"{expected}: nested too deeply to check"
    if "type" in schema and schema["type"] != "object":
        return f"{expected}: at $.type, {schema['type']!r} is not 'object'"
    return None


def check_tool_schema_sizes(tools: Iterable[agent_pb2.ToolSpec], limits: RequestLimitsConfig) -> None:
    """Bound the tools' parameter schemas before any is checked (:func:`schema_problem`'s CPU time grows with a
    schema's size, about 3 ms a KiB): each at most ``limits.max_tool_schema_chars`` characters, all of them
    together at most ``limits.max_tool_schemas_chars``.

    Raises:
        InvalidArgument: naming ``tools[i].parameters_json`` (one schema too long) or ``tools`` (all of them),
            the size and the limit.
    """
    total = 0
    for i, t in enumerate(tools):
        size = len(t.parameters_json)
        if size > limits.max_tool_schema_chars:
            raise InvalidArgument(f"tools[{i}].parameters_json", f"a schema of at most {limits.max_tool_schema_chars} "
                                  "characters (limits.max_tool_schema_chars)", f"{size} chars")
        total += size
    if total > limits.max_tool_schemas_chars:
        raise InvalidArgument("tools", f"parameter schemas of at most {limits.max_tool_schemas_chars} characters in "
                              "all (limits.max_tool_schemas_chars)", f"{total} chars")


def to_request(
    request: agent_pb2.GenerateRequest, config: SwitchyardConfig, engine_model: str, *, only_model: bool = False,
    reported_window: int = 0, served: Sequence[str] = (), prompt_token_ratio: float = 1.0,
) -> Request:
    """Validate a GenerateRequest and build its :class:`Request`.

    ``max_tokens`` 0 means ``limits.default_for(window)`` (``default_max_tokens``, at most half the window);
    ``prompt_tokens`` 0 means counted here (word pieces of the prompt or messages, their tool calls and the tools offered).
    ``engine_model``: the engine's model
    (``engine.model``), the one a request naming none gets; ``only_model``: the
    engine serves it alone (a step engine: a request naming another is
    NOT_FOUND), else an upstream engine's gateway resolves the name; ``served``: every model name a request may
    give (a stream engine's :meth:`~StreamEngine.served_names`; empty: not known, any is sent), another is
    NOT_FOUND in the orchestrator's words (:func:`~switchyard.gateway.models.not_served`). ``reported_window``: the context
    window the upstream reports for the request's model (0: none; a window
    ``limits.context_window_tokens`` lists wins). ``prompt_token_ratio``: the model server's prompt tokens per
    counted one for that model, as an upstream engine measured it (1: none measured); the prompt's count is
    scaled by it before the window check (:meth:`ContextWindow.model_tokens`). Limits come from ``limits`` (the
    orchestrator checks the same ones before a task is accepted; this check
    serves callers that reach the dispatcher directly).

    Raises:
        InvalidArgument: naming ``prompt``, ``max_tokens`` (also when prompt +
            max_tokens exceed the model's context window), ``prompt_tokens``,
            ``priority``, ``request_id``, ``agent_id``, ``task_id``, ``model``, ``task_type``,
            ``messages``, ``tools``, ``messages[i].role``, ``tools[i].name`` (not :data:`TOOL_NAME`'s, or another
            tool's), ``tools[i].parameters_json`` (:func:`schema_problem`; its size, and all of them together:
            :func:`check_tool_schema_sizes`), ``tenant_id``,
            ``task_time_left_s``, ``expected_remaining_work_s``, ``early_refusal_margin_s``, ``deadline_source``
            (longer than ``limits.max_id_chars`` + :data:`DEADLINE_SOURCE_EXTRA_CHARS`, or not printable) or ``resume`` (set without an
            ``agent_id``).
        SwitchyardError: NOT_FOUND, a model this engine does not serve.
    """
    limits = config.limits
    tenant = check_tenant(request.tenant_id, "tenant_id") if request.tenant_id else DEFAULT_TENANT
    _check_fields(request, limits, engine_model, [engine_model] if only_model else served)
    chars, message_texts, tool_texts = _prompt_chars(request, limits)
    messages = _messages(request)
    tools = _tools(request)
    prompt_tokens = request.prompt_tokens
    if prompt_tokens == 0:  # counted here, never below the floor a caller's own count is held to
        text = "\n".join([request.prompt] if not messages else message_texts)
        pieces = len(word_pieces(text)) + sum(len(word_pieces(t)) for t in tool_texts)
        prompt_tokens = max(1, pieces, -(-chars // MAX_CHARS_PER_TOKEN))
    elif prompt_tokens < chars // MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(
            "prompt_tokens", f"at least {chars // MAX_CHARS_PER_TOKEN} for a prompt of {chars} characters "
            f"(no tokenizer packs more than {MAX_CHARS_PER_TOKEN} characters a token), or 0 to count here",
            prompt_tokens,
        )
    model = engine_model if only_model else request.model or engine_model
    window = limits.context_window(model, reported_window, prompt_token_ratio)
    max_tokens = _max_tokens_in_window(request, limits, model, prompt_tokens, window)
    return Request(
        request_id=request.request_id,  # never empty here: a session's start refuses one, Generate gives one
        prompt=request.prompt,
        messages=messages,
        tools=tools,
        prompt_tokens=prompt_tokens,
        prompt_tokens_sent=request.prompt_tokens > 0,
        max_tokens=max_tokens,
        model=model,  # the model it is served, resolved once here
        names_model=bool(request.model),
        agent_id=request.agent_id,
        task_id=request.task_id,
        task_type=request.task_type,
        priority=PriorityClass.from_proto(request.priority),
        resume=request.resume,
        tenant_id=tenant,
        task_time_left_s=request.task_time_left_s or None,
        expected_remaining_work_s=request.expected_remaining_work_s,
        prefill_only=request.prefill_only,
        no_early_refusal=request.no_early_refusal,
        early_refusal_margin_s=request.early_refusal_margin_s,
        deadline_source=request.deadline_source,
    )


def _check_fields(request: agent_pb2.GenerateRequest, limits: RequestLimitsConfig, engine_model: str,
                  served: Sequence[str]) -> None:
    """:func:`to_request`'s checks of the request's own fields, each against its limit (raises as it says)."""
    for name, seconds, zero in (("task_time_left_s", request.task_time_left_s, "not given"),
                                ("expected_remaining_work_s", request.expected_remaining_work_s, "not given"),
                                ("early_refusal_margin_s", request.early_refusal_margin_s, "no shortfall tolerated")):
        untrusted.check_seconds(seconds, name, zero)
    if len(request.deadline_source) > (most := limits.max_id_chars + DEADLINE_SOURCE_EXTRA_CHARS):
        raise InvalidArgument("deadline_source", f"at most {most} characters (limits.max_id_chars + "
                              f"{DEADLINE_SOURCE_EXTRA_CHARS})", f"{len(request.deadline_source)} chars")
    untrusted.check_id_chars(request.deadline_source, "deadline_source")
    if not request.prompt.strip() and not request.messages:
        raise InvalidArgument("prompt", "a non-empty prompt, or at least one message", request.prompt)
    if request.max_tokens < 0 or request.max_tokens > limits.max_tokens:
        raise InvalidArgument(
            "max_tokens", f"0 (the default: limits.default_max_tokens, {limits.default_max_tokens}, at most half the "
            f"model's context window) to {limits.max_tokens} (limits.max_tokens)",
            request.max_tokens,
        )
    if request.prompt_tokens < 0:
        raise InvalidArgument("prompt_tokens", "0 (count here) or a positive count", request.prompt_tokens)
    check_priority(request.priority)
    for name, value in (("request_id", request.request_id), ("agent_id", request.agent_id),
                        ("task_id", request.task_id), ("model", request.model), ("task_type", request.task_type)):
        untrusted.check_id(value, name, limits.max_id_chars)
    if request.resume and not request.agent_id:  # else a queue jump: resumed steps go ahead of their class
        raise InvalidArgument("resume", "an agent_id beside it (resume marks an agent's next step, back from its "
                              "tool call)", True)
    if served and request.model and request.model not in served:  # refused before it is queued
        raise not_served(request.model, served, engine_model)
    if len(request.messages) > limits.max_messages:
        raise InvalidArgument("messages", f"at most {limits.max_messages} messages (limits.max_messages)",
                              f"{len(request.messages)} messages")
    if len(request.tools) > limits.max_tools:
        raise InvalidArgument("tools", f"at most {limits.max_tools} tools (limits.max_tools)", f"{len(request.tools)} tools")
    check_tool_schema_sizes(request.tools, limits)


def _prompt_chars(request: agent_pb2.GenerateRequest,
                  limits: RequestLimitsConfig) -> tuple[int, list[str], list[str]]:
    """What the model reads: the prompt, the messages with their tool calls, and the tools offered (a server
    renders their names, descriptions and schemas into the prompt, and they take KV as any prompt token does).
    Returns (characters in all, the messages' texts, the tools' texts).

    Raises:
        InvalidArgument: past ``limits.max_prompt_chars``, naming ``tools`` where they pass it, else ``prompt``
            or ``messages``.
    """
    tool_texts = [text for t in request.tools for text in (t.name, t.description, t.parameters_json) if text]
    message_texts = [text for m in request.messages
                     for text in (m.content, *(part for c in m.tool_calls for part in (c.name, c.arguments_json)))
                     if text]
    tool_chars = sum(map(len, tool_texts))
    chars = len(request.prompt) + sum(map(len, message_texts)) + tool_chars
    if chars > limits.max_prompt_chars:
        field = "tools" if chars - tool_chars <= limits.max_prompt_chars else "prompt" if request.prompt else "messages"
        raise InvalidArgument(field, f"at most {limits.max_prompt_chars} characters of prompt, tools included "
                              "(limits.max_prompt_chars)", f"{chars} chars")
    return chars, message_texts, tool_texts


def _messages(request: agent_pb2.GenerateRequest) -> list[Message]:
    """The request's messages; raises InvalidArgument naming ``messages[i].role`` for a role not known."""
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"one of {', '.join(_ROLES)}", m.role)
        calls = tuple(ToolCall(c.call_id, c.name, c.arguments_json) for c in m.tool_calls)
        messages.append(Message(m.role, m.content, m.tool_call_id, m.name, calls))
    return messages


def _tools(request: agent_pb2.GenerateRequest) -> list[Tool]:
    """The tools offered; raises InvalidArgument naming ``tools[i].name`` (not :data:`TOOL_NAME`'s, or another
    tool's) or ``tools[i].parameters_json`` (:func:`schema_problem`)."""
    tools = []
    named: dict[str, int] = {}
    for i, t in enumerate(request.tools):
        if not TOOL_NAME.fullmatch(t.name):
            raise InvalidArgument(f"tools[{i}].name", f"a tool name of {TOOL_NAME_EXPECTED}", t.name[:80])
        if t.name in named:  # which of two same-named tools a model's call means is not the caller's to guess
            raise InvalidArgument(f"tools[{i}].name", f"a name no other tool has (tools[{named[t.name]}] is "
                                  f"also {t.name!r})", t.name)
        named[t.name] = i
        problem = schema_problem(t.parameters_json)
        if problem is not None:
            raise InvalidArgument(f"tools[{i}].parameters_json", problem, t.parameters_json[:80])
        tools.append(Tool(t.name, t.description, t.parameters_json or "{}"))
    return tools


def _max_tokens_in_window(request: agent_pb2.GenerateRequest, limits: RequestLimitsConfig, model: str,
                          prompt_tokens: int, window: ContextWindow) -> int:
    """The completion tokens the request may produce in ``model``'s context ``window``: its own ``max_tokens``,
    or ``limits.default_for(window)`` for 0. The prompt is taken as the model server counts it: ``prompt_tokens``
    scaled by the window's measured ratio (:meth:`ContextWindow.model_tokens`), so a prompt the server would
    find too long is refused here, in these words, rather than failed (or cut) by the server.

    Raises:
        InvalidArgument: ``prompt_tokens`` fill the window, or ``max_tokens`` does not fit beside them.
    """
    served = window.model_tokens(prompt_tokens)
    if served >= window.tokens:
        raise InvalidArgument(
            "prompt_tokens", f"fewer than the context window of {model}, {window.described()}"
            + ("" if served == prompt_tokens else f"; its server counts this prompt about {served} tokens"),
            prompt_tokens,
        )
    max_tokens = request.max_tokens or limits.default_for(window.tokens)
    if served + max_tokens > window.tokens:
        raise InvalidArgument(
            "max_tokens",
            f"prompt_tokens + max_tokens within the context window of {model}, {window.described()}; the prompt "
            f"is {window.counted(prompt_tokens)}, so at most {window.left(prompt_tokens)}"
            + ("" if request.max_tokens else f" (0 asks for the default, {max_tokens}: limits.default_max_tokens, "
                                             "at most half the window)"),
            max_tokens,
        )
    return max_tokens


def consumed(req: Request) -> agent_pb2.GenerateDone:
    """What ``req`` consumed until now, as its done chunk says it: the ``consumed`` of its error
    (``StreamedError.consumed``; Generate's ``switchyard-consumed-bin`` trailer), and the answer to its cancel."""
    return done_chunk(req).done


def done_chunk(req: Request) -> agent_pb2.GenerateChunk:
    """The closing chunk of ``req``'s stream (usage, timings in seconds, accounting; what it waited on when it ended
    unfinished, ``Request.waited_on``), its ``model`` the one that answered (an upstream's fallback model,
    ``req.answered_by``), else the one it was served (``req.model``). One cut short before the engine took it
    (cancelled or failed while buffered or waiting) used nothing: its usage, compute score and KV peak are 0."""
    cut_before_engine = not req.reached_engine and req.status in (RequestStatus.FINISHED_ABORTED,
                                                                  RequestStatus.FINISHED_ERROR)
    prompt = 0 if cut_before_engine else req.usage_prompt()
    completion = 0 if req.prefill_only else req.completion_tokens()
    ttft = (req.first_token_at - req.arrival) if req.first_token_at is not None else 0.0
    return agent_pb2.GenerateChunk(
        done=agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
            ),
            queue_wait_s=req.queue_wait_s,
            ttft_s=ttft,
            compute_score_used=req.compute_score_used,
            memory_peak_bytes=req.memory_peak_bytes,
            batch_size=req.batch_size,
            flush_reason=req.flush_reason,
            model=req.answered_by or req.model,
            preemptions=req.preemptions,
            finish_reason=req.finish_reason or "",
            prompt_token_ratio=req.prompt_token_ratio,
            waited_on=req.waited_on,
        )
    )



def request_span(parent: otel_context.Context | None, kind: trace.SpanKind) -> trace.Span:
    """A request's ``dispatcher.generate`` span, started (not made current) under ``parent`` (None: the
    current context)."""
    # Started, not made current: a span attached across a handler's yields would be detached by
    # whichever task closes a cancelled stream (see common/grpc_tracing.py).
    return tracer.start_span("dispatcher.generate", parent, kind=kind)


class RequestProcessor:
    """Each request of the dispatcher's sessions, in (validated, submitted) and out (chunks, tracing).

    Args:
        config: the whole config (``limits``, ``dispatcher``).
        engine: the engine (its model; whether it shares prefixes).

    ``loop`` is the engine loop while the dispatcher runs (None before its start and after its stop), written
    by the servicer.
    """

    def __init__(self, config: SwitchyardConfig, engine: StepEngine | StreamEngine) -> None:
        self.config = config
        self.engine = engine
        self.stepping = isinstance(engine, StepEngine)
        self.loop: LoopBase | None = None

    @property
    def draining(self) -> bool:
        """The dispatcher drains: its scheduler's intake is closed (the one flag; :meth:`DispatcherService.begin_drain`
        closes it), and new requests are refused ``DispatcherNotServing`` (:meth:`serving_loop`)."""
        return self.loop is not None and self.loop.scheduler.intake.closed

    def serving_loop(self) -> LoopBase:
        """The engine loop, when it takes requests.

        Raises:
            DispatcherNotServing: UNAVAILABLE, naming why: :data:`NOT_STARTED` (no loop), else why its scheduler's
                intake is closed (:meth:`~switchyard.dispatcher.scheduler.core.SchedulerCore.check_open`: shutting
                down, or the loop failed).
        """
        loop = self.loop
        if loop is None:
            raise DispatcherNotServing(NOT_STARTED)
        loop.scheduler.check_open()
        return loop

    @property
    def shares_prefixes(self) -> bool:
        """Whether the engine reuses a prompt prefix computed for an earlier request: what makes a
        ``prefill_only`` request worth running."""
        return self.engine.kv.shares_prefixes

    async def open_request(
        self, request: agent_pb2.GenerateRequest, timeout_s: float | None, span: trace.Span,
        arrived: float | None = None,
    ) -> Request:
        """Validate ``request`` (:func:`to_request`) and hand it to the engine loop.

        Args:
            timeout_s: the caller's time left when the request ``arrived``, seconds (None: no deadline); the
                scheduler and an upstream engine bound the request by it (``req.deadline``).
            span: the request's ``dispatcher.generate`` span; the engine's spans link to it.
            arrived: when its start arrived, ``time.monotonic()`` seconds (None: now): ``req.arrival``, what its
                deadline, queue wait and TTFT count from, so that the wait for the upstream's model list and a long
                prompt's count are counted in them (they were not: its deadline came that much after its caller's,
                and its TTFT, queue wait and the fair policy's time left left that time out).

        Raises:
            SwitchyardError: the request is invalid (INVALID_ARGUMENT, NOT_FOUND), the
                dispatcher serves no request now (UNAVAILABLE, :meth:`serving_loop`), the queue is full
                (RESOURCE_EXHAUSTED), or, under the ``fair`` policy, its task cannot meet its deadline
                (DEADLINE_EXCEEDED, :class:`~switchyard.dispatcher.scheduler.slack.CannotMeetDeadline`).
        """
        arrived = time.monotonic() if arrived is None else arrived
        reported, ratio = 0, 1.0
        served: Sequence[str] = ()
        if not self.stepping:
            await self.engine.await_model_list(request.model, MODELS_READ_WAIT_S)
            reported = self.engine.reported_context_window(request.model)
            served = self.engine.served_names() if request.model else ()  # a request naming none is never refused
            ratio = self.engine.prompt_token_ratio(request.model or self.engine.model)
        build = functools.partial(to_request, request, self.config, self.engine.model, only_model=self.stepping,
                                  reported_window=reported, served=served, prompt_token_ratio=ratio)
        if request.ByteSize() > COUNT_IN_THREAD_BYTES:  # counting a long prompt must not stall the streams
            req = await asyncio.to_thread(build)
        else:
            req = build()
        span.set_attribute("gen_ai.request.model", req.model)
        span.set_attribute("gen_ai.usage.input_tokens", req.prompt_tokens)
        span.set_attribute("switchyard.priority", req.priority.label)
        req.span = span
        req.arrival = arrived
        if timeout_s is not None:
            req.deadline = arrived + timeout_s
        loop = self.serving_loop()  # refused before its prefill_only shortcut, which would not reach the scheduler
        if req.prefill_only:
            if not self.shares_prefixes:  # nothing later could reuse its prefix: done, no tokens
                req.status = RequestStatus.FINISHED_STOPPED
                RequestOutput(req, finished=True).publish()
                return req
            req.max_tokens = 1  # the prompt's prefill is what it is for; its one token is dropped by the caller
        loop.submit(req)
        return req

    def chunk(self, req: Request, item: OutputItem) -> agent_pb2.GenerateChunk | None:
        """The chunk that carries one item of ``req``'s output stream; None for the one token a
        ``prefill_only`` request's step makes (its caller is promised none: agent.proto).

        Raises:
            SwitchyardError: the item is the request's error (an engine's own error becomes INTERNAL).
        """
        if isinstance(item, StreamToken):
            if req.prefill_only:
                return None
            return agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text=item.text, index=item.index, count=item.count))
        if isinstance(item, StreamToolCall):
            call = item.call
            return agent_pb2.GenerateChunk(
                tool_call=agent_pb2.ToolCall(call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)
            )
        if isinstance(item, StreamDone):
            return done_chunk(req)
        error = item.error
        if isinstance(error, SwitchyardError):
            raise error
        raise SwitchyardError(f"engine failed: {type(error).__name__}: {error}", grpc.StatusCode.INTERNAL)

    def record_done(self, req: Request, span: trace.Span) -> None:
        """Close ``req``'s tracing after its done chunk: its queue wait and engine phases as spans
        under ``span``, its output tokens and finish reason on it."""
        if span.is_recording():
            parent = trace.set_span_in_context(span)
            wall_arrival_ns = time.time_ns() - int((time.monotonic() - req.arrival) * 1e9)
            self._record_queue_wait(req, wall_arrival_ns, parent)
            self._record_engine_phases(req, wall_arrival_ns, parent)
            span.set_attribute("gen_ai.usage.output_tokens", req.completion_tokens())
            span.set_attribute("gen_ai.response.finish_reasons", [req.finish_reason or ""])

    def record_unfinished(self, req: Request, span: trace.Span) -> None:
        """Close ``req``'s tracing as it ends without its done chunk (cancelled, failed, its stream closed): the
        spans of what it reached, as :meth:`record_done` writes them: its queue wait (until now where it never
        left the queue) and the prefill and decode it got through. Only a finished request's were written, so
        the trace of a cancelled or failed task, the one an operator opens, showed its ``dispatcher.generate``
        with nothing under it."""
        if span.is_recording():
            parent = trace.set_span_in_context(span)
            now = time.monotonic()
            wall_arrival_ns = time.time_ns() - int((now - req.arrival) * 1e9)
            waited = req.queue_wait_s if req.reached_engine else max(req.queue_wait_s, now - req.arrival)
            self._record_queue_wait(req, wall_arrival_ns, parent, waited)
            self._record_engine_phases(req, wall_arrival_ns, parent)
            span.set_attribute("gen_ai.usage.output_tokens", req.completion_tokens())

    def _record_engine_phases(self, req: Request, wall_arrival_ns: int, parent: otel_context.Context) -> None:
        """``inference.prefill`` and ``inference.decode`` spans of this request, under its own span.

        The engine's step spans (``engine.prefill``/``engine.decode``) serve a whole batch and live
        in traces of their own; these two show in the task's trace where its engine time went.
        """
        if req.first_token_at is None:
            return

        def wall(t: float) -> int:
            return wall_arrival_ns + int((t - req.arrival) * 1e9)

        admitted = req.arrival + req.queue_wait_s
        common = {"switchyard.batch_size": req.batch_size, "switchyard.preemptions": req.preemptions}
        tracer.start_span(
            "inference.prefill", parent, start_time=wall(admitted),
            attributes={**common, "gen_ai.usage.input_tokens": req.prompt_tokens},
        ).end(end_time=wall(req.first_token_at))
        tracer.start_span(
            "inference.decode", parent, start_time=wall(req.first_token_at),
            attributes={
                **common,
                "gen_ai.usage.output_tokens": req.completion_tokens(),
                "switchyard.recomputed_tokens": req.recomputed_tokens,
            },
        ).end(end_time=wall(req.last_token_at or req.first_token_at))

    def _record_queue_wait(self, req: Request, wall_arrival_ns: int, parent: otel_context.Context,
                           waited_s: float | None = None) -> None:
        """A ``dispatcher.queue_wait`` span covering the wait before the engine took the request (``waited_s``,
        seconds; default its ``queue_wait_s``)."""
        end_ns = wall_arrival_ns + int((req.queue_wait_s if waited_s is None else waited_s) * 1e9)
        attributes: dict[str, Any] = {"switchyard.batch_size": req.batch_size}
        if req.flush_reason != agent_pb2.FLUSH_REASON_UNSPECIFIED:  # the batch span's word, not the enum's number
            attributes["switchyard.flush_reason"] = FlushReason(req.flush_reason).label
        telemetry.start_queue_wait_span(
            tracer, "dispatcher.queue_wait", QUEUE_NAME, wall_arrival_ns, parent, attributes
        ).end(end_time=end_ns)
