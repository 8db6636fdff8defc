"""The dispatcher service: ``agent.InferenceService`` (GenerateStream, Generate) over the scheduler.

Path of one request (a GenerateStream start, or a Generate call: a stream of one,
served by the same session, :mod:`switchyard.dispatcher.generate_stream`)::

    session -> processor (validate, submit) -> scheduler.add_request (double buffer; refused at once
             when full) -> waiting set -> running set (admitted by compute score and KV memory,
                or the upstream's adaptive limit) -> engine steps
             -> the request's output stream -> its session -> processor (encode) -> GenerateChunk stream

The servicer here builds the engine, the scheduler, the loop and the
:class:`~switchyard.dispatcher.processor.RequestProcessor`, and hands each
call to a session; what is done for each request (validation, submission,
chunks, tracing) is the processor's, so a request's path never calls back
into this module.

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
in HBM, SWAP it to DRAM, DROP it; TOOL_WAIT_DECISION_UNSPECIFIED when nothing is parked here). A ``prefill_only`` request (a warm-up of a prompt prefix)
finishes at once, no tokens, on an engine that shares no prefixes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import untrusted
from switchyard.common.config import SwitchyardConfig
from switchyard.common.dram import DramClient
from switchyard.common.errors import InvalidArgument, SwitchyardError, abort
from switchyard.common.priority import check_priority
from switchyard.common.server import (GRPC_SERVICES, STREAM_END_MARGIN_S, Drains, EndsStreams, HealthOwner,
                                     set_health)
from switchyard.common.tenant import check_tenant, program_key
from switchyard.common.generate_protocol import CONSUMED_KEY, decode_error, entry_bytes, new_request_id, pack
from switchyard.dispatcher.adaptive_flush import AdaptiveFlush
from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit
from switchyard.dispatcher.engine_loop import LoopBase, StepLoop
from switchyard.dispatcher.engines import StepEngine, StreamEngine, make_engine
from switchyard.dispatcher.metrics import STREAM_MESSAGE_CHUNKS
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.capacity import ConcurrencyCapacity, StreamSlots
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.request_queue import RequestQueue
from switchyard.dispatcher.scheduler.tool_wait import Decision
from switchyard.dispatcher.stream_loop import StreamLoop
from switchyard.dispatcher.tiers import ColdStore, KvStore, MemoryTiers
from switchyard.dispatcher.generate_stream import GenerateSession
from switchyard.dispatcher.processor import MODELS_READ_WAIT_S, TOOL_NAME, TOOL_NAME_EXPECTED, RequestProcessor

log = logging.getLogger(__name__)


MAX_EXPECTED_WAIT_S = 86_400.0
"""Longest tool wait a ToolWait may announce, seconds (a day): longer than any tool call the orchestrator's settings
allow (``orchestrator.react``: 20 attempts of at most 600 s, with backoffs of at most 600 s between them); a larger
number is a caller's mistake, and would plan a restore years ahead and make the expected-wait histogram's sum
infinite."""


class DispatcherService(agent_pb2_grpc.InferenceServiceServicer, Drains, EndsStreams, HealthOwner):
    """Serves ``agent.InferenceService``; implements :class:`switchyard.common.server.Service`.

    Args:
        config: the whole config.
        engine: an engine to use instead of :func:`make_engine` (tests, benchmarks).
        policy: a scheduling policy name (``priority``, ``fifo``, ``fair``) instead of
            ``scheduler_config.json`` ``policy``.
        queue: the waiting order instead of the policy's own (benchmarks: another
            scheduler's order on this dispatcher).

    Raises:
        EngineUnavailable: the configured engine is not installed.
        ValueError: ``memory_policy.toml [oss] path`` names a store fsspec cannot open.
    """

    name = "dispatcher"
    grpc_service_names = (GRPC_SERVICES["dispatcher"],)

    def __init__(
        self,
        config: SwitchyardConfig,
        engine: StepEngine | StreamEngine | None = None,
        policy: str | None = None,
        queue: RequestQueue | None = None,
    ) -> None:
        self.config = config
        self.engine = engine if engine is not None else make_engine(config)
        self.stepping = isinstance(self.engine, StepEngine)
        flush = config.batching
        adaptive_flush = (AdaptiveFlush(flush, engine_step_s=config.scheduler.time_slice_ms / 1000)
                          if flush.adaptive else None)
        self.stream_slots: StreamSlots | None = None
        """The streams in flight to a stream engine's upstream and the one limit they are admitted under: the
        engine's own (the openai engine's gateway keeps one limit per endpoint and admits up to their sum), else
        one that nothing measures (see ``StreamEngine.stream_slots``); None for a step engine."""
        capacity = None
        if not self.stepping:
            own = self.engine.stream_slots  # type: ignore[union-attr]
            self.stream_slots = (own if own is not None
                                 else StreamSlots(AdaptiveConcurrencyLimit(config.upstream.concurrency)))
            capacity = ConcurrencyCapacity(self.stream_slots)
        # KV state swapped out of HBM waits in Redis ([dram]); an engine with nothing to swap needs none.
        dram = config.memory.dram
        store = (KvStore(DramClient(dram), dram.kv_ttl_s)
                 if self.stepping and dram.kv_swap and self.engine.kv.can_export() else None)
        oss = config.memory.oss
        cold = ColdStore(oss.path, dram.key_prefix, oss.storage_options) if store is not None else None  # [oss]
        self.tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, self.engine.kv, store, cold)
        self.scheduler: SchedulerCore = make_scheduler(
            config, self.engine, policy=policy, capacity=capacity, adaptive_flush=adaptive_flush, tiers=self.tiers,
            queue=queue,
        )
        self.processor = RequestProcessor(config, self.engine)
        """Each request of the sessions, in and out (:mod:`switchyard.dispatcher.processor`); it holds the
        engine loop and the draining flag the sessions read."""
        self._sessions: set[GenerateSession] = set()
        """The GenerateStream and Generate calls in flight, each a session of its requests."""
        self._no_sessions = asyncio.Event()
        """Set while no session is open (:meth:`end_streams` waits on it)."""
        self._no_sessions.set()
        self._health: health.aio.HealthServicer | None = None
        self._health_update: asyncio.Task[None] | None = None

    @property
    def loop(self) -> LoopBase | None:
        """The engine loop while the dispatcher runs; None before :meth:`start` and after :meth:`stop`."""
        return self.processor.loop

    @property
    def draining(self) -> bool:
        """Set by :meth:`begin_drain` (the scheduler's intake closed): new requests are refused UNAVAILABLE."""
        return self.processor.draining

    # ------------------------------------------------------------------ Service protocol

    def register(self, server: grpc.aio.Server) -> None:
        agent_pb2_grpc.add_InferenceServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Start the engine loop."""
        loop: LoopBase
        if self.stepping:
            loop = StepLoop(self.config, self.engine, self.scheduler)  # type: ignore[arg-type]
        else:
            loop = StreamLoop(self.config, self.engine, self.scheduler)  # type: ignore[arg-type]
        self.processor.loop = loop
        loop.on_failure = self._loop_failed
        loop.start()
        if self.tiers.store is not None:  # an outage at start is logged now, and switchyard_dram_up is true from the start
            await self.tiers.store.dram.start()
        if not self.stepping:  # the upstream's flavour and context windows, read in the background
            self.engine.start_describing()  # type: ignore[union-attr]
        log.info(
            "dispatcher: engine %s (%s), policy %s", type(self.engine).__name__, self.engine.model, self.scheduler.name
        )

    async def watch_health(self, health: health.aio.HealthServicer) -> None:
        """SERVING once the server serves; NOT_SERVING once the engine loop has failed (:attr:`LoopBase.failure`),
        the server's overall status ("", what the liveness probe asks) included: a dispatcher that can answer no
        request is restarted, not left refusing them."""
        self._health = health
        failed = self.loop is not None and self.loop.failure is not None
        await set_health(health, self, serving=not failed, overall=failed)

    def _loop_failed(self, exc: BaseException) -> None:
        if self._health is not None:
            self._health_update = asyncio.get_running_loop().create_task(
                set_health(self._health, self, serving=False, overall=True))

    async def begin_drain(self) -> None:
        """SIGTERM: new requests are refused UNAVAILABLE from now on; each GenerateStream ends once
        the requests it carries are done (the server then stops without waiting out its grace)."""
        self.scheduler.close()  # the one drain flag: the scheduler refuses from now on, and the processor reads it
        for session in self._sessions:
            session.drain()

    async def end_streams(self, after_s: float) -> None:
        """The drain's end: requests still running ``after_s`` seconds (``server.shutdown_grace_s``) after SIGTERM
        are ended UNAVAILABLE naming the stop, each with what it consumed (:meth:`GenerateSession.end_all`), on
        GenerateStream and Generate alike; their streams then end. The server's own cancel, which came next, read
        only 'Cancelling all calls' (relayed by the orchestrator as 'dispatcher service unavailable ... is it
        running?'), and what each request had used was lost."""
        try:
            await asyncio.wait_for(self._no_sessions.wait(), after_s)
            return
        except TimeoutError:
            pass
        error = SwitchyardError(
            f"dispatcher is stopping: the request was still running after server.shutdown_grace_s = {after_s:g} s "
            "of draining and was ended; run it again (on another replica, or once this one is back)",
            grpc.StatusCode.UNAVAILABLE)
        for session in list(self._sessions):
            session.end_all(error)
        with contextlib.suppress(TimeoutError):  # each session writes its errors and ends (the server's cancel
            await asyncio.wait_for(self._no_sessions.wait(), STREAM_END_MARGIN_S / 2)  # of what is left follows)

    def _open(self, session: GenerateSession) -> None:
        self._sessions.add(session)
        self._no_sessions.clear()

    def _closed(self, session: GenerateSession) -> None:
        self._sessions.discard(session)
        if not self._sessions:
            self._no_sessions.set()

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
        self.processor.loop = None

    # ------------------------------------------------------------------ RPC

    async def DescribeModel(
        self, request: agent_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.ModelInfo:
        """The model served to a request that names none, the engine, whether that model is the only one
        (a step engine's), and the context window the upstream reports for it (an ``openai`` engine in front
        of vLLM or SGLang: ``max_model_len``; 0 otherwise): callers check a request's model, and its prompt +
        max_tokens against that model's context window (``limits.context_window(model, reported)``), before
        accepting it, the prompt's count scaled by the server's prompt tokens per counted one that the engine
        measured for the model (``prompt_token_ratios``; none measured: absent); and every model name a request
        may give (``models``: the step engine's one model, or the ids the upstream lists and their ``model_map``
        aliases; empty while no list was read). The upstream's models are waited for at most
        :data:`MODELS_READ_WAIT_S` in all (:meth:`StreamEngine.await_model_list`, ``read_unread``: a list not read
        yet is read now, so a down upstream reports nothing and the next call asks again; a list that does not
        name ``request.model`` is read again first)."""
        served = self.engine.model  # what a request naming none is served (the processor's own rule)
        reported, windows, names, ratios = 0, {}, [served], {}
        if not self.stepping:
            engine: StreamEngine = self.engine  # type: ignore[assignment]
            await engine.await_model_list(request.model, MODELS_READ_WAIT_S, read_unread=True)
            reported, windows = engine.reported_context_window(""), engine.reported_context_windows()
            names = engine.served_names()
            ratios = engine.prompt_token_ratios()
        return agent_pb2.ModelInfo(model=served, engine=self.config.dispatcher.engine,
                                   shares_prefixes=self.shares_prefixes, serves_only_model=self.stepping,
                                   context_window_tokens=reported, context_windows=windows, models=names,
                                   prompt_token_ratios=ratios)

    @property
    def shares_prefixes(self) -> bool:
        """Whether the engine reuses a prompt prefix computed for an earlier request (automatic prefix caching):
        what makes a ``prefill_only`` request worth running."""
        return self.processor.shares_prefixes

    async def ToolWait(self, request: agent_pb2.ToolWaitRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.ToolWaitReply:
        """An agent's tool call started: validate the announcement and answer :meth:`tool_wait`'s decision.

        Ends INVALID_ARGUMENT naming the field: ``agent_id`` empty, past ``limits.max_id_chars`` or holding a
        control character (every edge's rule for an id, :func:`switchyard.common.untrusted.check_id`), ``task_id`` past the same limit or
        holding one, ``tool`` not a name a tool offered to
        Generate may have (:data:`.processor.TOOL_NAME`),
        ``expected_wait_s`` not a finite number of seconds from 0 to :data:`MAX_EXPECTED_WAIT_S`, ``tenant_id``
        malformed, ``priority`` not a Priority.
        """
        limits = self.config.limits
        try:
            untrusted.check_id(request.agent_id, "agent_id", limits.max_id_chars, required=True)
            untrusted.check_id(request.task_id, "task_id", limits.max_id_chars)
            if not TOOL_NAME.fullmatch(request.tool):  # one the model was offered: Generate's rule for tools[i].name
                raise InvalidArgument("tool", f"a tool name of {TOOL_NAME_EXPECTED}", request.tool[:80])
            untrusted.check_seconds(request.expected_wait_s, "expected_wait_s", at_most=MAX_EXPECTED_WAIT_S)
            if request.tenant_id:  # checked as Generate's; with the agent id it names the parked agent
                check_tenant(request.tenant_id, "tenant_id")
            check_priority(request.priority)
        except SwitchyardError as exc:
            await abort(context, exc, "dispatcher")
        waiting = program_key(request.tenant_id, request.agent_id, request.task_id)  # the task that waits
        if request.task_ended:
            self.end_tool_wait(waiting)
            return agent_pb2.ToolWaitReply(decision=agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED)
        decision, restore_at_s = self.tool_wait(waiting, request.tool, request.expected_wait_s)
        return agent_pb2.ToolWaitReply(decision=decision, restore_at_s=restore_at_s)

    def end_tool_wait(self, program_key: str) -> None:
        """The task ``program_key`` names (:func:`switchyard.common.tenant.program_key`) ended during its tool wait (``ToolWaitRequest.task_ended``:
        cancelled, past its deadline, or refused before its next step): its parked state leaves HBM, its DRAM
        copy is dropped and its tool-wait plan ends, now (:meth:`~switchyard.dispatcher.scheduler.core.SchedulerCore.forget_agent`);
        nothing is restored for a turn that will not come. Nothing to do on a stream engine."""
        loop = self.loop
        if isinstance(loop, StepLoop):
            loop.forget_agent(program_key)

    def tool_wait(self, program_key: str, tool: str, expected_wait_s: float) -> tuple[int, float]:
        """What to do with the prefix state of the task ``program_key`` names (its key: its tenant's, its
        agent's and its own id, :func:`switchyard.common.tenant.program_key`) while it waits ``expected_wait_s`` seconds on ``tool``.

        A step engine's scheduler decides at once
        (:meth:`~switchyard.dispatcher.scheduler.core.SchedulerCore.tool_wait`, counted in
        ``switchyard_tool_wait_decisions_total{decision}`` and, per tool,
        ``switchyard_tool_wait_decisions_by_tool_total{tool,decision}``): KEEP holds the parked KV in HBM
        for the expected wait and as long again (with the tool's returns measured, until their P95); SWAP copies it to the DRAM tier now and restores it
        ahead of the tool's return; DROP releases it. The decision is the agent's parked step's: the
        announcement's priority (the orchestrator's view) is checked, not read, the parked request carries
        its own; ``tool`` labels the per-tool figures (decisions, warm and cold resumes, prefetch timings).

        Answered ``TOOL_WAIT_DECISION_UNSPECIFIED`` with restore 0 when nothing is decided here: no parked step of that agent on this
        replica (its step has not ended yet, it ended without a tool call, its TTL ran out, or it ran
        elsewhere), or a stream engine (an upstream server keeps its own prefix cache; no KV is held here).

        A SWAP's DRAM copy is restored ahead of the tool's expected return: ``restore_at_s`` is when it is
        planned back in HBM (:attr:`~switchyard.dispatcher.scheduler.tool_wait.ToolWaitDecision.warm_at_s`:
        the restore starts ``expected_wait_s - transfer - margin`` after now, at least one transfer after
        now, and takes one transfer: ``margin`` ahead of the tool's expected return when the round trip
        fits in the wait; with the tool's returns measured, where the cost model lands it, and 0 when it plans
        none ahead: the turn restores it at admission); an agent back earlier has it restored at its next
        step's admission. ``tool``'s returns are measured under its own name (each tool's restores timed
        by its own returns); it is counted under its name when it is one of the orchestrator's registered
        tools (:data:`switchyard.common.metrics.TOOL_NAMES`), else as ``other``.

        Returns:
            (``agent_pb2.ToolWaitDecision`` value, restore_at_s: seconds from now, SWAP only, else 0).
        """
        loop = self.loop
        if not isinstance(loop, StepLoop):  # a stream engine (or not started): no KV held here
            return agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED, 0.0
        decided = loop.tool_wait(program_key, expected_wait_s, tool)
        if decided is None:
            return agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED, 0.0
        if decided.decision is Decision.SWAP:
            return agent_pb2.SWAP, float(decided.warm_at_s or 0.0)
        return (agent_pb2.DROP if decided.decision is Decision.DROP else agent_pb2.KEEP), 0.0

    async def Generate(
        self, request: agent_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """Stream one completion: a session of one request (the path of a GenerateStream start), its chunks
        as they are, its error as the call's status with the origin trailer and, once its request ran, what it
        consumed (:data:`~switchyard.common.generate_protocol.CONSUMED_KEY`: a serialized ``GenerateDone``). See
        the module docstring."""
        if not request.request_id:
            request.request_id = new_request_id()  # Generate's id is optional; a session's is not
        arrived = time.monotonic()  # before its time left is read: its deadline is never after its caller's
        session = GenerateSession(self.processor)
        self._open(session)
        try:
            await session.start(request, context.time_remaining(), None, arrived=arrived)
            session.close_intake()
            while (replies := await session.replies()) is not None:
                for streamed in replies:
                    if streamed.HasField("error"):
                        error = streamed.error  # what its request consumed, if it ran, in a trailer beside its origin
                        used = (((CONSUMED_KEY, error.consumed.SerializeToString()),)
                                if error.HasField("consumed") else ())
                        await abort(context, decode_error(error), self.name, used)
                    yield streamed.chunk
        finally:
            session.close()  # the caller went away: free its place and KV
            self._closed(session)

    async def GenerateStream(
        self, request_iterator: AsyncIterator[agent_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Many requests over one stream (the orchestrator's hop); see :mod:`switchyard.dispatcher.generate_stream`.

        Each reply leaves in as few messages as fit ``server.max_message_bytes``
        (:func:`switchyard.common.generate_protocol.pack`), and while the stream carries more than one
        request, at most one reply per ``dispatcher.stream_flush_interval_ms``: what becomes ready within
        it leaves together, except a request's first output (its TTFT is never held), a CORE request's
        output and refusals (:meth:`GenerateSession.hold`). A request whose start carries ``token_hold_s``
        (a BATCH task's call) sends its tokens after the first at most once per that hold.
        """
        session = GenerateSession(self.processor)
        self._open(session)
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
            self._closed(session)
