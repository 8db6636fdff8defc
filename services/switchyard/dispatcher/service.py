"""The dispatcher service: ``agent.InferenceService`` (GenerateStream, Generate) over the scheduler.

Path of one request (a GenerateStream start, or a Generate call: a stream of one,
served by the same session, :mod:`switchyard.dispatcher.generate_stream`)::

    validate -> scheduler.add_request (double buffer; refused at once when full)
             -> waiting set -> running set (admitted by compute score and KV memory,
                or the upstream's adaptive limit) -> engine steps
             -> the request's output stream -> its session -> GenerateChunk stream

The stream carries token chunks (text, index), tool-call chunks, then one
``done`` chunk with usage, queue wait, TTFT, compute score, memory peak, the
flush that carried the request, the model, preemptions and finish_reason.
Errors end the request with a gRPC status and its origin
(:mod:`switchyard.common.generate_protocol`): a Generate call's status, or a
stream's ``StreamedError``. The scheduler alone expires waiting requests and
releases KV; when the caller goes away, the session aborts its request there.
``ToolWait`` hears from the orchestrator that an agent's tool call started
(who, which tool, the expected wait, tenant, priority): :meth:`DispatcherService.tool_wait`
asks the scheduler what the agent's parked prefix state does meanwhile (KEEP it
in HBM, SWAP it to DRAM, DROP it; KEEP when nothing is parked here). A ``prefill_only`` request (a warm-up of a prompt prefix)
finishes at once, no tokens, on an engine that shares no prefixes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import telemetry, untrusted
from switchyard.common.metrics import TOOL_NAMES, bounded
from switchyard.common.config import SwitchyardConfig, default_model
from switchyard.common.dram import DramClient
from switchyard.common.errors import InvalidArgument, SwitchyardError, abort
from switchyard.common.server import Drains
from switchyard.common.tenant import DEFAULT_TENANT, check_tenant
from switchyard.common.generate_protocol import decode_error, deadline_after, entry_bytes, new_request_id, pack
from switchyard.dispatcher.adaptive_flush import AdaptiveFlush
from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit
from switchyard.dispatcher.engine_loop import LoopBase, StepLoop
from switchyard.dispatcher.engines import StepEngine, StreamEngine, make_engine
from switchyard.dispatcher.metrics import STREAM_MESSAGE_CHUNKS
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.capacity import ConcurrencyCapacity
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.tool_wait import Decision
from switchyard.dispatcher.stream_loop import StreamLoop
from switchyard.dispatcher.tiers import ColdStore, KvStore, MemoryTiers
from switchyard.dispatcher.generate_stream import GenerateSession
from switchyard.dispatcher.output import OutputItem, StreamDone, StreamToken, StreamToolCall
from switchyard.dispatcher.request import Message, Request, RequestOutput, RequestStatus, Tool, ToolCall, word_pieces

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)

_ROLES = ("system", "user", "assistant", "tool")


MAX_CHARS_PER_TOKEN = 128
"""No tokenizer packs more characters into one token than this: a caller's ``prompt_tokens`` below
``characters / MAX_CHARS_PER_TOKEN`` is refused rather than trusted (KV accounting relies on it)."""

COUNT_IN_THREAD_BYTES = 256 * 1024
"""Requests larger than this are validated and counted off the event loop."""


def to_request(
    request: agent_pb2.GenerateRequest, config: SwitchyardConfig, served_model: str | None = None
) -> Request:
    """Validate a GenerateRequest and build its :class:`Request`.

    ``max_tokens`` 0 means ``dispatcher.default_max_tokens``; ``prompt_tokens``
    0 means counted here (word pieces of the prompt or messages); an empty
    ``request_id`` gets a random one. ``served_model``: the one model a step
    engine serves (a request naming another is NOT_FOUND); None for an upstream
    engine, whose gateway resolves the name. Limits come from ``limits`` (the
    orchestrator checks the same ones before a task is accepted; this check
    serves callers that reach the dispatcher directly).

    Raises:
        InvalidArgument: naming ``prompt``, ``max_tokens`` (also when prompt +
            max_tokens exceed the model's context window), ``prompt_tokens``,
            ``priority``, ``request_id``, ``agent_id``, ``model``, ``task_type``,
            ``messages``, ``tools``, ``messages[i].role``, ``tools[i].parameters_json``, ``tenant_id``,
            ``task_time_left_s`` or ``expected_remaining_work_s``.
        SwitchyardError: NOT_FOUND, a model this engine does not serve.
    """
    defaults, limits = config.dispatcher, config.limits
    tenant = check_tenant(request.tenant_id, "tenant_id") if request.tenant_id else DEFAULT_TENANT
    for name, seconds in (("task_time_left_s", request.task_time_left_s),
                          ("expected_remaining_work_s", request.expected_remaining_work_s)):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise InvalidArgument(name, "a finite number of seconds, 0 or more (0: not given)", seconds)
    if not request.prompt.strip() and not request.messages:
        raise InvalidArgument("prompt", "a non-empty prompt, or at least one message", request.prompt)
    if request.max_tokens < 0 or request.max_tokens > limits.max_tokens:
        raise InvalidArgument(
            "max_tokens", f"0 (default {defaults.default_max_tokens}) to {limits.max_tokens} (limits.max_tokens)",
            request.max_tokens,
        )
    if request.prompt_tokens < 0:
        raise InvalidArgument("prompt_tokens", "0 (count here) or a positive count", request.prompt_tokens)
    if request.priority not in agent_pb2.Priority.values():
        raise InvalidArgument("priority", "CORE, NORMAL, BATCH or unset", request.priority)
    for name, value in (("request_id", request.request_id), ("agent_id", request.agent_id),
                        ("model", request.model), ("task_type", request.task_type)):
        if len(value) > limits.max_id_chars:
            raise InvalidArgument(name, f"at most {limits.max_id_chars} characters (limits.max_id_chars)",
                                  f"{len(value)} chars")
    if served_model is not None and request.model and request.model != served_model:
        raise SwitchyardError(
            f"model {request.model!r} is not served here: this dispatcher's engine serves {served_model!r} "
            "(leave model empty for it)", grpc.StatusCode.NOT_FOUND,
        )
    if len(request.messages) > limits.max_messages:
        raise InvalidArgument("messages", f"at most {limits.max_messages} messages (limits.max_messages)",
                              f"{len(request.messages)} messages")
    if len(request.tools) > limits.max_tools:
        raise InvalidArgument("tools", f"at most {limits.max_tools} tools (limits.max_tools)", f"{len(request.tools)} tools")
    chars = len(request.prompt) + sum(len(m.content) for m in request.messages)
    if chars > limits.max_prompt_chars:
        field = "prompt" if request.prompt else "messages"
        raise InvalidArgument(field, f"at most {limits.max_prompt_chars} characters of prompt (limits.max_prompt_chars)",
                              f"{chars} chars")
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"one of {', '.join(_ROLES)}", m.role)
        calls = tuple(ToolCall(c.call_id, c.name, c.arguments_json) for c in m.tool_calls)
        messages.append(Message(m.role, m.content, m.tool_call_id, m.name, calls))
    tools = []
    for i, t in enumerate(request.tools):
        if not t.name:
            raise InvalidArgument(f"tools[{i}].name", "a non-empty tool name", t.name)
        try:
            schema = untrusted.loads(t.parameters_json) if t.parameters_json else {}
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"tools[{i}].parameters_json", "a JSON Schema object", t.parameters_json[:80])
        tools.append(Tool(t.name, t.description, t.parameters_json or "{}"))
    prompt_tokens = request.prompt_tokens
    if prompt_tokens == 0:
        text = request.prompt if not messages else "\n".join(m.content for m in messages)
        prompt_tokens = max(1, len(word_pieces(text)))
    elif prompt_tokens < chars // MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(
            "prompt_tokens", f"at least {chars // MAX_CHARS_PER_TOKEN} for a prompt of {chars} characters "
            f"(no tokenizer packs more than {MAX_CHARS_PER_TOKEN} characters a token), or 0 to count here",
            prompt_tokens,
        )
    max_tokens = request.max_tokens or defaults.default_max_tokens
    model = served_model or request.model or default_model(config)
    window = limits.context_window(model)
    if prompt_tokens >= window:
        raise InvalidArgument(
            "prompt_tokens", f"fewer than the context window of {model}, {window} tokens (limits.context_window_tokens)",
            prompt_tokens,
        )
    if prompt_tokens + max_tokens > window:
        default = " (0 asks for dispatcher.default_max_tokens)" if not request.max_tokens else ""
        raise InvalidArgument(
            "max_tokens",
            f"prompt_tokens + max_tokens within the context window of {model}, {window} tokens "
            f"(limits.context_window_tokens); the prompt is {prompt_tokens} tokens, so at most "
            f"{window - prompt_tokens}{default}",
            max_tokens,
        )
    return Request(
        request_id=request.request_id or new_request_id(),
        prompt=request.prompt,
        messages=messages,
        tools=tools,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        model=request.model,
        agent_id=request.agent_id,
        task_type=request.task_type,
        priority=request.priority,
        resume=request.resume,
        tenant_id=tenant,
        task_time_left_s=request.task_time_left_s or None,
        expected_remaining_work_s=request.expected_remaining_work_s,
        prefill_only=request.prefill_only,
    )


def done_chunk(req: Request, model: str) -> agent_pb2.GenerateChunk:
    """The closing chunk of ``req``'s stream (usage, timings in seconds, accounting)."""
    prompt, completion = req.usage_prompt(), req.completion_tokens()
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
            model=model,
            preemptions=req.preemptions,
            finish_reason=req.finish_reason or "",
        )
    )


class DispatcherService(agent_pb2_grpc.InferenceServiceServicer, Drains):
    """Serves ``agent.InferenceService``; implements :class:`switchyard.common.server.Service`.

    Args:
        config: the whole config.
        engine: an engine to use instead of :func:`make_engine` (tests, benchmarks).
        policy: a scheduling policy name (``priority``, ``fifo``) instead of
            ``scheduler_config.json`` ``policy``.

    Raises:
        EngineUnavailable: the configured engine is not installed.
        ValueError: ``memory_policy.toml [oss] path`` names a store fsspec cannot open.
    """

    name = "dispatcher"
    grpc_service_names = ("agent.InferenceService",)

    def __init__(
        self,
        config: SwitchyardConfig,
        engine: StepEngine | StreamEngine | None = None,
        policy: str | None = None,
    ) -> None:
        self.config = config
        self.engine = engine if engine is not None else make_engine(config)
        self.stepping = isinstance(self.engine, StepEngine)
        flush = config.batching
        self.adaptive: AdaptiveFlush | None = (
            AdaptiveFlush(flush, engine_step_s=config.scheduler.time_slice_ms / 1000) if flush.adaptive else None
        )
        self.limit: AdaptiveConcurrencyLimit | None = None
        capacity = None
        if not self.stepping:
            # a pool of upstream endpoints brings its own limit (the sum of one per endpoint)
            pooled = self.engine.concurrency_limit  # type: ignore[union-attr]
            self.limit = pooled if pooled is not None else AdaptiveConcurrencyLimit(config.upstream.concurrency)
            capacity = ConcurrencyCapacity(self.limit)
        # KV state swapped out of HBM waits in Redis ([dram]); an engine with nothing to swap needs none.
        dram = config.memory.dram
        store = (KvStore(DramClient(dram), dram.kv_ttl_s)
                 if self.stepping and dram.kv_swap and self.engine.kv.can_export() else None)
        oss = config.memory.oss
        cold = ColdStore(oss.path, dram.key_prefix, oss.storage_options) if store is not None else None  # [oss]
        self.tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, self.engine.kv, store, cold)
        self.scheduler: SchedulerCore = make_scheduler(
            config, self.engine, policy=policy, capacity=capacity, flush_interval_s=self.adaptive, tiers=self.tiers
        )
        if self.adaptive is not None:
            self.scheduler.on_batch_done = self.adaptive.on_batch_done
        self.loop: LoopBase | None = None
        self.draining = False
        self._sessions: set[GenerateSession] = set()

    # ------------------------------------------------------------------ Service protocol

    def register(self, server: grpc.aio.Server) -> None:
        agent_pb2_grpc.add_InferenceServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Start the engine loop."""
        if self.stepping:
            self.loop = StepLoop(self.config, self.engine, self.scheduler)  # type: ignore[arg-type]
        else:
            assert self.limit is not None
            self.loop = StreamLoop(self.config, self.engine, self.scheduler, self.limit)  # type: ignore[arg-type]
        self.loop.start()
        log.info(
            "dispatcher: engine %s (%s), policy %s", type(self.engine).__name__, self.engine.model, self.scheduler.name
        )

    async def begin_drain(self) -> None:
        """SIGTERM: new requests are refused UNAVAILABLE from now on; each GenerateStream ends once
        the requests it carries are done (the server then stops without waiting out its grace)."""
        self.draining = True
        for session in self._sessions:
            session.drain()

    async def stop(self) -> None:
        """Drain: refuse new requests, run accepted ones to their end, close the engine.

        Waits up to ``server.shutdown_grace_s``; whatever is still running after
        that is cancelled.
        """
        if self.loop is None:
            return
        try:
            await asyncio.wait_for(self.loop.drain(), self.config.server.shutdown_grace_s)
        except TimeoutError:
            log.warning("dispatcher: drain exceeded the grace period; cancelling what still runs")
            await self.loop.stop()
        if not self.stepping:
            await self.engine.aclose()  # type: ignore[union-attr]
        self.loop = None

    # ------------------------------------------------------------------ RPC

    async def DescribeModel(
        self, request: agent_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.ModelInfo:
        """The model served to a request that names none, and the engine: callers check a request's
        prompt + max_tokens against that model's context window before sending it."""
        served = self.engine.model if self.stepping else default_model(self.config)
        return agent_pb2.ModelInfo(model=served, engine=self.config.dispatcher.engine,
                                   shares_prefixes=self.shares_prefixes)

    @property
    def shares_prefixes(self) -> bool:
        """Whether the engine reuses a prompt prefix computed for an earlier request (automatic prefix caching):
        what makes a ``prefill_only`` request worth running."""
        return self.engine.kv.shares_prefixes

    async def ToolWait(self, request: agent_pb2.ToolWaitRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.ToolWaitReply:
        """An agent's tool call started: validate the announcement and answer :meth:`tool_wait`'s decision.

        Ends INVALID_ARGUMENT naming the field: ``agent_id`` or ``tool`` empty or past
        ``limits.max_id_chars``, ``expected_wait_s`` not a finite number of seconds >= 0, ``tenant_id``
        malformed, ``priority`` not a Priority.
        """
        limits = self.config.limits
        try:
            for name, value in (("agent_id", request.agent_id), ("tool", request.tool)):
                if not value or len(value) > limits.max_id_chars:
                    raise InvalidArgument(name, f"1 to {limits.max_id_chars} characters (limits.max_id_chars)",
                                          f"{len(value)} chars")
            if not (math.isfinite(request.expected_wait_s) and request.expected_wait_s >= 0):
                raise InvalidArgument("expected_wait_s", "a finite number of seconds, 0 or more", request.expected_wait_s)
            tenant = check_tenant(request.tenant_id, "tenant_id") if request.tenant_id else DEFAULT_TENANT
            if request.priority not in agent_pb2.Priority.values():
                raise InvalidArgument("priority", "CORE, NORMAL, BATCH or unset", request.priority)
        except SwitchyardError as exc:
            await abort(context, exc, "dispatcher")
        decision, restore_at_s = self.tool_wait(request.agent_id, request.tool, request.expected_wait_s, tenant,
                                                request.priority or agent_pb2.NORMAL)
        return agent_pb2.ToolWaitReply(decision=decision, restore_at_s=restore_at_s)

    def tool_wait(self, agent_id: str, tool: str, expected_wait_s: float, tenant: str,
                  priority: int) -> tuple[int, float]:
        """What to do with ``agent_id``'s prefix state while it waits ``expected_wait_s`` seconds on ``tool``.

        A step engine's scheduler decides at once
        (:meth:`~switchyard.dispatcher.scheduler.core.SchedulerCore.tool_wait`, counted in
        ``switchyard_tool_wait_decisions_total{decision}`` and, per tool,
        ``switchyard_tool_wait_decisions_by_tool_total{tool,decision}``): KEEP holds the parked KV in HBM
        for the expected wait and as long again; SWAP copies it to the DRAM tier now and restores it
        ahead of the tool's return; DROP releases it. The decision is the agent's parked step's:
        ``tenant`` and ``priority`` (the orchestrator's view) are not read, the parked request carries
        its own; ``tool`` labels the per-tool figures (decisions, warm and cold resumes, prefetch timings).

        Answered KEEP with restore 0 when nothing is decided here: no parked step of ``agent_id`` on this
        replica (its step has not ended yet, it ended without a tool call, its TTL ran out, or it ran
        elsewhere), or a stream engine (an upstream server keeps its own prefix cache; no KV is held here).

        A SWAP's DRAM copy is restored ahead of the tool's expected return: ``restore_at_s`` is when it is
        planned back in HBM (:attr:`~switchyard.dispatcher.scheduler.tool_wait.ToolWaitDecision.warm_at_s`:
        the restore starts ``expected_wait_s - transfer - margin`` after now, at least one transfer after
        now, and takes one transfer: ``margin`` ahead of the tool's expected return when the round trip
        fits in the wait; with the tool's returns measured, where the cost model lands it, and 0 when it plans
        none ahead: the turn restores it at admission); an agent back earlier has it restored at its next
        step's admission. ``tool`` is
        counted under its name when it is one of the orchestrator's registered tools
        (:data:`switchyard.common.metrics.TOOL_NAMES`), else as ``other``.

        Returns:
            (``agent_pb2.ToolWaitDecision`` value, restore_at_s: seconds from now, SWAP only, else 0).
        """
        loop = self.loop
        if not isinstance(loop, StepLoop):  # a stream engine (or not started): no KV held here
            return agent_pb2.KEEP, 0.0
        decided = loop.tool_wait(agent_id, expected_wait_s, bounded(tool, TOOL_NAMES))
        if decided is None:
            return agent_pb2.KEEP, 0.0
        if decided.decision is Decision.SWAP:
            return agent_pb2.SWAP, float(decided.warm_at_s or 0.0)
        return (agent_pb2.DROP if decided.decision is Decision.DROP else agent_pb2.KEEP), 0.0

    async def Generate(
        self, request: agent_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """Stream one completion: a session of one request (the path of a GenerateStream start), its chunks
        as they are, its error as the call's status with the origin trailer. See the module docstring."""
        if not request.request_id:
            request.request_id = new_request_id()  # Generate's id is optional; a session's is not
        session = GenerateSession(self)
        try:
            await session.start(request, context.time_remaining(), None)
            session.close_intake()
            while (replies := await session.replies()) is not None:
                for streamed in replies:
                    if streamed.HasField("error"):
                        await abort(context, decode_error(streamed.error), self.name)
                    yield streamed.chunk
        finally:
            session.close()  # the caller went away: free its place and KV

    async def GenerateStream(
        self, request_iterator: AsyncIterator[agent_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Many requests over one stream (the orchestrator's hop); see :mod:`switchyard.dispatcher.generate_stream`.

        Each reply leaves in as few messages as fit ``server.max_message_bytes``
        (:func:`switchyard.common.generate_protocol.pack`), and while the stream carries more than one
        request, at most one reply per ``dispatcher.stream_flush_interval_ms``: what becomes ready within
        it leaves together, except a request's first output (its TTFT is never held) and refusals
        (:meth:`GenerateSession.hold`).
        """
        session = GenerateSession(self)
        self._sessions.add(session)
        reader = asyncio.create_task(session.read(request_iterator), name="generate-stream-reader")
        max_bytes = self.config.server.max_message_bytes
        flush_interval_s = self.config.dispatcher.stream_flush_interval_ms / 1000
        clock = asyncio.get_running_loop().time
        try:
            while (replies := await session.replies()) is not None:
                written_at = clock()
                for group in pack([(c, entry_bytes(c)) for c in replies], max_bytes):
                    STREAM_MESSAGE_CHUNKS.observe(len(group))
                    await context.write(agent_pb2.GenerateStreamResponse(chunks=group))
                if flush_interval_s:
                    # the next message waits out the interval: what becomes ready meanwhile (other
                    # requests' tokens) leaves with it, one write for many
                    wait = written_at + flush_interval_s - clock()
                    if wait > 0:
                        await session.hold(wait)
        finally:
            reader.cancel()
            session.close()  # what the stream still carries is aborted
            self._sessions.discard(session)

    # ------------------------------------------------------------------ one request, for its session

    def request_span(self, parent: otel_context.Context | None, kind: trace.SpanKind) -> trace.Span:
        """A request's ``dispatcher.generate`` span, started (not made current) under ``parent`` (None:
        the current context)."""
        # Started, not made current: a span attached across a handler's yields would be detached by
        # whichever task closes a cancelled stream (see common/grpc_tracing.py).
        return tracer.start_span("dispatcher.generate", parent, kind=kind)

    async def open_request(
        self, request: agent_pb2.GenerateRequest, timeout_s: float | None, span: trace.Span
    ) -> Request:
        """Validate ``request`` (:func:`to_request`) and hand it to the engine loop.

        Args:
            timeout_s: the caller's time left, seconds (None: no deadline); the
                scheduler and an upstream engine bound the request by it.
            span: the request's ``dispatcher.generate`` span; the engine's spans link to it.

        Raises:
            SwitchyardError: the request is invalid (INVALID_ARGUMENT, NOT_FOUND), the
                dispatcher is not started or draining (UNAVAILABLE), or the queue is full
                (RESOURCE_EXHAUSTED).
        """
        served = self.engine.model if self.stepping else None
        if request.ByteSize() > COUNT_IN_THREAD_BYTES:  # counting a long prompt must not stall the streams
            req = await asyncio.to_thread(to_request, request, self.config, served)
        else:
            req = to_request(request, self.config, served)
        span.set_attribute("gen_ai.request.model", request.model or self.engine.model)
        span.set_attribute("gen_ai.usage.input_tokens", req.prompt_tokens)
        span.set_attribute("switchyard.priority", req.priority_name)
        req.span_context = span.get_span_context()
        req.span = span
        if timeout_s is not None:
            req.deadline = deadline_after(timeout_s)
        loop = self.loop
        if loop is None or self.draining:
            raise SwitchyardError("dispatcher is not started or is draining", grpc.StatusCode.UNAVAILABLE)
        if req.prefill_only:
            if not self.shares_prefixes:  # nothing later could reuse its prefix: done, no tokens
                req.status = RequestStatus.FINISHED_STOPPED
                RequestOutput(req, finished=True).publish()
                return req
            req.max_tokens = 1  # the prompt's prefill is what it is for; its one token is dropped by the caller
        if self.adaptive is not None:
            self.adaptive.on_arrival(time.monotonic(), self.scheduler.intake.active_size + 1)
        loop.submit(req)
        return req

    def chunk(self, req: Request, item: OutputItem) -> agent_pb2.GenerateChunk:
        """The chunk that carries one item of ``req``'s output stream.

        Raises:
            SwitchyardError: the item is the request's error (an engine's own error becomes INTERNAL).
        """
        if isinstance(item, StreamToken):
            return agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text=item.text, index=item.index, count=item.count))
        if isinstance(item, StreamToolCall):
            call = item.call
            return agent_pb2.GenerateChunk(
                tool_call=agent_pb2.ToolCall(call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)
            )
        if isinstance(item, StreamDone):
            model = self.engine.model if self.stepping else (req.model or self.engine.model)
            return done_chunk(req, model)
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

    def _record_queue_wait(self, req: Request, wall_arrival_ns: int, parent: otel_context.Context) -> None:
        """A ``dispatcher.queue_wait`` span covering the wait before the engine took the request."""
        end_ns = wall_arrival_ns + int(req.queue_wait_s * 1e9)
        qspan = tracer.start_span(
            "dispatcher.queue_wait",
            parent,
            start_time=wall_arrival_ns,
            attributes={
                "switchyard.queue": "inference",
                "switchyard.batch_size": req.batch_size,
                "switchyard.flush_reason": req.flush_reason,
            },
        )
        qspan.end(end_time=end_ns)
