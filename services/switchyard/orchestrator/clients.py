"""gRPC clients of the orchestrator's two downstream services.

Channels come from :func:`switchyard.common.channels.open_channel`: no HTTP
proxy, keepalive, and each call bounded by the task's deadline.

A downstream failure is re-raised with the service's name and address, so a
caller of RunTask learns which service is down, not just "UNAVAILABLE".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import sys
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import grpc
from opentelemetry import trace

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.errors import ORIGIN_KEY, ServiceUnavailable, SwitchyardError
from switchyard.common.channels import MAX_RECONNECT_BACKOFF_MS, beyond_deadline, open_channel
from switchyard.common.config import AffinityConfig, ProgramConfig, ServerConfig, TlsConfig
from switchyard.common.request_ids import LiveRequestIds
from switchyard.common.tasks import settle
from switchyard.common.tenant import agent_key
from switchyard.common.tls_check import explain, looks_like_tls_failure
from switchyard.orchestrator.generate_stream import GenerateStreamClient, RequestFailed
from switchyard.orchestrator.metrics import DISPATCHER_RETRIES, TOOL_WAIT_HINT_OUTCOMES, TOOL_WAIT_HINTS
from switchyard.common.grpc_target import static_addresses
from switchyard.orchestrator.replicas import ReplicaSet

if TYPE_CHECKING:
    from switchyard.orchestrator.program import Budget
    from switchyard.orchestrator.tools import Tool
    from switchyard.orchestrator.validation import TaskSpec

log = logging.getLogger(__name__)

MODEL_INFO_MAX_AGE_S = 30.0
"""Seconds a DescribeModel answer is kept before the next task asks again (a dispatcher replaced behind one
address, a rolling update, by a build serving another model or window is known within this long); the
answer before stands when the ask fails."""

MODEL_INFO_REFRESH_TIMEOUT_S = 1.0
"""Deadline of a DescribeModel asked again while an answer is kept (it delays the task that asks)."""

MODEL_INFO_RETRY_S = 5.0
"""Seconds between asks of DescribeModel while an ``openai`` engine's upstream has reported no context window
(one small RPC: a server that was down when the stack started has its window known at the edge within seconds
of coming up; at 30 s tasks past its window were accepted and failed after acceptance meanwhile)."""


def reported_window(info: agent_pb2.ModelInfo, model: str) -> int:
    """The context window the dispatcher's upstream reports for ``model`` (a name the request gave, or the
    default ``info.model``), tokens; 0: none reported. Taken through ``limits.context_window(model, reported)``."""
    return info.context_windows.get(model) or (info.context_window_tokens if model == info.model else 0)


def _downstream_error(service: str, address: str, err: grpc.aio.AioRpcError, waited: str = "") -> SwitchyardError:
    """The error to raise for a failed call to ``service``, naming the hop that failed.

    An answer from the service carries its origin (:data:`ORIGIN_KEY`): the service itself, or the
    upstream model or proxy it relays. Without one, nothing answered: the service is unreachable, or (a
    DEADLINE_EXCEEDED) it did not answer within the call's own timeout, which ``waited`` names with its
    setting (``"7000 ms (orchestrator.retrieval_timeout_ms)"``) where gRPC's words were a bare
    "Deadline Exceeded".
    """
    origin = dict(err.trailing_metadata() or ()).get(ORIGIN_KEY, "")
    details = err.details() or err.code().name
    if waited and not origin and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"no answer within {waited}"
    return _hop_error(service, address, err.code(), details, origin)


def _hop_error(service: str, address: str, code: grpc.StatusCode, details: str, origin: str) -> SwitchyardError:
    """:func:`_downstream_error` from a status's parts (``origin`` "": nothing answered)."""
    if not origin:
        if code == grpc.StatusCode.UNAVAILABLE:
            return ServiceUnavailable(service, address, details)
        error = SwitchyardError(f"{service} ({address}): {details}", code)
    elif origin == service:
        error = SwitchyardError(f"{service} ({address}): {details}", code)
    else:
        error = SwitchyardError(f"{origin} (via {service} at {address}): {details}", code)
    error.origin = origin or service
    return error


async def _tls_named(error: SwitchyardError, address: str, tls: TlsConfig) -> SwitchyardError:
    """``error`` with what its TLS failure was (the dialled name, the certificate's names and issuer, and
    why they do not fit) when TLS is on and nothing answered the way a failed handshake reads."""
    if tls.enabled and isinstance(error, ServiceUnavailable) and looks_like_tls_failure(str(error)):
        error.args = (f"{error.args[0]}; {await explain(address, tls)}",)
    return error


class RetrievalClient:
    """RetrievalService.Retrieve over one channel.

    Args:
        max_query_chars: ``limits.max_query_chars``: a query is cut to it before it is sent (the retrieval
            service refuses a longer one; every caller, rag_answer's stage and the search tool, gets the cut).
    """

    def __init__(self, address: str, config: ServerConfig, timeout_s: float, max_query_chars: int) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_query_chars = max_query_chars
        self._tls = config.tls
        self._channel = open_channel(address, config, peer="retrieval")
        self._stub = agent_pb2_grpc.RetrievalServiceStub(self._channel)

    async def retrieve(self, query: str, top_k: int = 0) -> agent_pb2.RetrieveResponse:
        """Passages for ``query``, cut to :attr:`max_query_chars` (the query need not hold all of a long
        payload: the embedding model reads its first 256 tokens).

        Raises:
            ServiceUnavailable: retrieval is down.
            SwitchyardError: retrieval answered with an error (its code kept), or DEADLINE_EXCEEDED: no answer
                within :attr:`timeout_s` (named with ``orchestrator.retrieval_timeout_ms``).
        """
        try:
            return await self._stub.Retrieve(
                agent_pb2.RetrieveRequest(query=query[:self.max_query_chars], top_k=top_k), timeout=self.timeout_s,
                wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            waited = f"{self.timeout_s * 1000:g} ms (orchestrator.retrieval_timeout_ms)"
            raise await _tls_named(_downstream_error("retrieval", self.address, err, waited), self.address,
                                   self._tls) from None

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel calls take (readiness checks health over it too)."""
        return self._channel

    async def close(self) -> None:
        await self._channel.close()


RECONNECT_WAIT_S = 1.25 * MAX_RECONNECT_BACKOFF_MS / 1000
"""Longest wait for a channel to connect again before a call is retried on it: grpc core's reconnect backoff at
its cap (``grpc.max_reconnect_backoff_ms``) with its jitter (+-20 %), so that one reconnection attempt falls in it."""


def _left(seconds: float | None, since: float) -> float | None:
    """What is left of ``seconds`` counted from ``since`` (monotonic), never below 0; None stays None."""
    return None if seconds is None else max(0.0, seconds - (time.monotonic() - since))


async def _reconnected(channel: grpc.aio.Channel, timeout_s: float | None) -> None:
    """Wait until ``channel`` is connected (READY), at most :data:`RECONNECT_WAIT_S` and ``timeout_s`` (the call's
    time left); the call then fails, or succeeds, on its own."""
    wait_s = RECONNECT_WAIT_S if timeout_s is None else min(RECONNECT_WAIT_S, max(0.0, timeout_s))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            await channel.channel_ready()


class InferenceClient:
    """Generation on the dispatcher over one channel, or, for a target of several replicas, over each
    replica's own channel: an agent's replica for a call with an affinity key, the next in turn otherwise.

    Requests travel over one ``GenerateStream`` per channel
    (:class:`~switchyard.orchestrator.generate_stream.GenerateStreamClient`), not a Generate call each.

    Args:
        address: the dispatcher target (``host:port``, ``ipv4:a,b``, ``dns:///name:port``).
        config: ``server`` (channel options).
        affinity: ``orchestrator.affinity``; disabled: every call takes the next replica in turn.
        program: ``orchestrator.program``: the ToolWait announcements' deadline (``tool_wait_hint_timeout_ms``)
            and whether rag_answer's calls share a replica (``rag_early_prefill``); None: its defaults.
        token_hold_s: how long a task of a priority (an ``agent.Priority``) has its tokens held on its own stream,
            seconds (:meth:`~switchyard.common.config.OrchestratorConfig.token_hold_s`): each call of the task
            carries it, and the dispatcher holds the call's tokens no longer. None: no call carries a hold.
    """

    MAX_ATTEMPTS = 3
    """Tries of one call that fails UNAVAILABLE before its first chunk, each on another replica."""

    def __init__(self, address: str, config: ServerConfig, affinity: AffinityConfig | None = None,
                 program: ProgramConfig | None = None, token_hold_s: Callable[[int], float] | None = None) -> None:
        self.address = address
        self._token_hold_s = token_hold_s
        self._tls = config.tls
        self._channel = open_channel(address, config, peer="dispatcher")
        self._max_message_bytes = config.max_message_bytes
        self._stub = agent_pb2_grpc.InferenceServiceStub(self._channel)
        self._streams: dict[grpc.aio.Channel, GenerateStreamClient] = {}
        self._closing: set[asyncio.Future[None]] = set()
        self._model_info: agent_pb2.ModelInfo | None = None
        self._model_info_at = -math.inf
        self._model_info_stale = False
        self._model_info_refresh: asyncio.Task[None] | None = None
        """The DescribeModel asked again now (:meth:`model_info`), while it is under way: a task that needs what it
        answers waits for it rather than read the answer kept before it."""
        self._prompt_token_ratios: dict[str, float] = {}
        """Per model, the dispatcher's measured ratio of the model server's prompt tokens to the count sent
        (``ModelInfo.prompt_token_ratios``, then each ``GenerateDone.prompt_token_ratio``): the models the
        dispatcher measured, a bounded set."""
        self._request_ids = LiveRequestIds()
        """Request ids of this orchestrator's dispatcher calls in flight: no two share one."""
        program = program or ProgramConfig()
        self.task_affinity: frozenset[str] = frozenset(  # rag_answer's warm-up and answer must reach one replica
            {"react_loop", "rag_answer"} if program.rag_early_prefill else {"react_loop"})
        """Workflows whose calls without an agent are routed by their task id (:meth:`affinity_key`)."""
        self._hints: set[asyncio.Task[None]] = set()
        self._hint_logged: set[str] = set()
        self.no_early_refusal = not program.refuse_early
        """``orchestrator.program.refuse_early`` off: every Generate says so (``no_early_refusal``), and the
        dispatcher's fair policy serves it whatever its slack, as this orchestrator does."""
        self.early_refusal_margin_s = program.refuse_early_margin_s
        """``orchestrator.program.refuse_early_margin_s``, on every Generate (``early_refusal_margin_s``): the
        dispatcher's fair policy tolerates the shortfall this orchestrator tolerates."""
        self.hint_timeout_s = program.tool_wait_hint_timeout_ms / 1000
        """Deadline of one ToolWait announcement (``orchestrator.program.tool_wait_hint_timeout_ms``), seconds."""
        addresses = static_addresses(address)
        self.replicas: ReplicaSet | None = None
        affinity = affinity or AffinityConfig()
        self._affinity = affinity.enabled
        if addresses is None or len(addresses) > 1:
            self.replicas = ReplicaSet(address, config, affinity.idle_s, affinity.resolve_interval_s, affinity.balance)

    def affinity_key(self, spec: TaskSpec) -> str | None:
        """The key an agent's calls are routed by (generations and tool-wait announcements alike): the agent's
        key, its tenant's and its id's (:func:`switchyard.common.tenant.agent_key`: two tenants' agents of one
        id are two agents, placed apart); without an agent, the task itself (task ids are one namespace across
        tenants) for a workflow whose calls share a prefix (react_loop's turns; rag_answer's early prefill and
        its answer); else None (the next replica in turn)."""
        if spec.agent_id:
            return agent_key(spec.tenant_id, spec.agent_id)
        return spec.task_id if spec.workflow in self.task_affinity else None

    async def _route(self, affinity_key: str | None, tried: frozenset[str]) -> tuple[str, grpc.aio.Channel]:
        if self.replicas is not None:
            await self.replicas.refresh()
            try:
                if affinity_key and self._affinity:
                    return self.replicas.pick(affinity_key, tried)
                return self.replicas.rotate(tried)
            except LookupError:  # none known yet, or every replica tried: the channel's round_robin decides
                pass
        return self.address, self._channel

    def _streams_for(self, channel: grpc.aio.Channel) -> GenerateStreamClient:
        streams = self._streams.get(channel)
        if streams is None:
            if self.replicas is not None:  # forget the streams of channels the replica set has let go
                live = {self._channel, *self.replicas.channels.values()}
                for gone in [c for c in self._streams if c not in live]:
                    self._closing.add(settle(asyncio.ensure_future(self._streams.pop(gone).close()),
                                             expected=lambda e: False))
                    self._closing = {t for t in self._closing if not t.done()}
            streams = self._streams[channel] = GenerateStreamClient(channel, self._max_message_bytes)
        return streams

    async def generate(
        self,
        spec: TaskSpec,
        turn: int,
        *,
        prompt: str = "",
        messages: Sequence[agent_pb2.ChatMessage] = (),
        prompt_tokens: int = 0,
        tools: Sequence[Tool] = (),
        resume: bool = False,
        timeout_s: float | None = None,
        budget: Budget | None = None,
        prefill_only: bool = False,
        max_tokens: int | None = None,
        on_consumed: Callable[[agent_pb2.GenerateDone], None] | None = None,
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """Stream the chunks of one generation: turn ``turn`` (0, 1, ...) of the task ``spec``.

        The request carries the task's id (``request_id`` ``{task_id}:{turn}``; ``~<n>`` after it while another
        call of this orchestrator holds that id, :class:`~switchyard.common.request_ids.LiveRequestIds`), priority,
        type, ``max_tokens`` (the task's, or this call's ``max_tokens``) and model; the prompt as ``prompt`` text or
        as ``messages``, its
        ``prompt_tokens`` as counted here; the ``tools`` offered to the model; ``resume`` for a turn
        that follows a tool call. ``timeout_s`` bounds the call (the task's time left). The request
        carries the task's tenant, and ``budget``'s time left and expected work after this step
        (orchestrator/program.py); its start carries the task's token hold (``token_hold_s``: a BATCH task's
        tokens are merged on its own stream anyway). ``prefill_only``: a warm-up of the prompt's prefix state
        (``request_id`` ``{task_id}:prefill``), no tokens expected. ``on_consumed``: called once with what the
        request consumed when it did not finish: the caller was cancelled or its time ran out while it ran (the
        dispatcher's answer to the cancel, a done chunk with ``finish_reason`` ``cancelled``), or the dispatcher
        failed it after it ran (its error's ``consumed``); :meth:`GenerateStreamClient.generate`. It is called
        before the cancellation or the error goes on, once per attempt that ran.

        The call goes to the replica holding the agent's warm state (see
        :mod:`switchyard.orchestrator.replicas`): the agent is its tenant's and ``spec.agent_id``'s
        (:meth:`affinity_key`), or for a ``react_loop`` without one the task itself (its turns share the KV of
        one conversation).
        A call that fails UNAVAILABLE from the replica itself (unreachable, or draining) before its
        first chunk did nothing the caller saw: it is tried again on another replica, up to
        :data:`MAX_ATTEMPTS` times; with none other, again on the same one once its channel has connected
        again (:func:`_reconnected`, waited for once per call: a dispatcher restarted while the task waited
        on a tool is back, but the channel waits out its reconnect backoff, in which every call fails at once). One that fails after chunks were streamed is not (they were
        sent on): its error names the replica and how many chunks it had streamed.

        Raises:
            ServiceUnavailable: the dispatcher (or the replica) is down, naming its address.
            SwitchyardError: the dispatcher answered with an error (its code kept).
        """
        request = agent_pb2.GenerateRequest(
            request_id=f"{spec.task_id}:{'prefill' if prefill_only else turn}",
            prompt=prompt,
            messages=messages,
            prompt_tokens=prompt_tokens,
            max_tokens=spec.max_tokens if max_tokens is None else max_tokens,
            model=spec.model,
            priority=spec.priority,
            task_type=spec.workflow,
            agent_id=spec.agent_id or spec.task_id,
            task_id=spec.task_id,
            tools=[agent_pb2.ToolSpec(name=t.name, description=t.description, parameters_json=t.parameters_json)
                   for t in tools],
            resume=resume,
            tenant_id=spec.tenant_id,
            # 0 on the wire is "not given": a task already at its deadline sends the least time left there is
            task_time_left_s=max(budget.time_left_s, sys.float_info.min) if budget is not None else 0.0,
            expected_remaining_work_s=budget.remaining_after_s if budget is not None else 0.0,
            deadline_source=budget.deadline_source if budget is not None else "",
            prefill_only=prefill_only,
            no_early_refusal=self.no_early_refusal,
            early_refusal_margin_s=self.early_refusal_margin_s,
        )
        # Two tasks under one task_id on two dispatcher replicas would reach the model server behind them under
        # one X-Request-Id (one replica's calls are kept apart by its gateway's own LiveRequestIds too).
        request.request_id = self._request_ids.claim(request.request_id)
        try:
            async with contextlib.aclosing(self._send(request, spec, timeout_s, on_consumed)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._request_ids.release(request.request_id)

    async def _send(self, request: agent_pb2.GenerateRequest, spec: TaskSpec, timeout_s: float | None,
                    on_consumed: Callable[[agent_pb2.GenerateDone], None] | None
                    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """:meth:`generate`'s call of ``request``, its id its own: to the replica its affinity picks, tried again
        on another as :meth:`generate` says. Each attempt carries the time left when it is sent, as its gRPC
        deadline and as ``task_time_left_s``: one attempt's time (a wait for a replica to reconnect, a replica
        that refused) is gone for the next, whose dispatcher would otherwise order it by slack it no longer has
        and let it run past the task's deadline."""
        affinity_key = self.affinity_key(spec)
        tried: set[str] = set()
        waited = False
        sent_at, time_left_s = time.monotonic(), request.task_time_left_s
        token_hold_s = self._token_hold_s(spec.priority) if self._token_hold_s is not None else 0.0
        for attempt in range(self.MAX_ATTEMPTS):
            address, channel = await self._route(affinity_key, frozenset(tried))
            if address in tried and not waited:  # no other replica: this one may be restarting (port closed a moment)
                waited = True
                await _reconnected(channel, _left(timeout_s, sent_at))
            if attempt and time_left_s:  # 0 on the wire is "not given": at its deadline, the least time left there is
                request.task_time_left_s = max(_left(time_left_s, sent_at), sys.float_info.min)
            received = 0
            chunks = self._streams_for(channel).generate(request, _left(timeout_s, sent_at), token_hold_s,
                                                         on_consumed)
            replicas = self.replicas if self.replicas is not None and address in self.replicas.channels else None
            if replicas is not None:
                replicas.started(address)  # counts against the replica's bound until the call ends
            try:
                async for chunk in chunks:
                    received += 1
                    if chunk.HasField("done") and chunk.done.prompt_token_ratio > 0:  # the dispatcher's newest
                        self._prompt_token_ratios[spec.model or self.known_default_model] = \
                            chunk.done.prompt_token_ratio
                    yield chunk
                return
            except RequestFailed as err:
                if err.code == grpc.StatusCode.NOT_FOUND:
                    # the model was not served there after all (a server restarted with another model): the
                    # dispatcher read its upstream's list again for it, and the answer kept here is the list before
                    self._model_info_stale = True
                # No origin: nothing answered (the replica is gone); origin dispatcher: it refused (draining).
                # An error relayed from the upstream model is not the replica's: another would meet it too.
                replica_fault = err.origin in ("", "dispatcher")
                unavailable = err.code == grpc.StatusCode.UNAVAILABLE and replica_fault
                if unavailable and received == 0 and attempt + 1 < self.MAX_ATTEMPTS:
                    tried.add(address)
                    DISPATCHER_RETRIES.inc()
                    continue
                if unavailable and received and not err.origin:  # nothing answered: the stream was cut
                    raise ServiceUnavailable("dispatcher", address, f"stream cut after {received} chunk(s): "
                                             f"{err.details}") from None
                if unavailable and received:  # the dispatcher ended it (its drain ran out): its words
                    raise _hop_error("dispatcher", address, err.code, f"{err.details} (after {received} streamed "
                                     "chunk(s): not tried again, no chunk is repeated)", err.origin) from None
                error = _hop_error("dispatcher", address, err.code, err.details, err.origin)
                raise await _tls_named(error, address, self._tls) from None
            finally:
                if replicas is not None:
                    replicas.finished(address)
                await chunks.aclose()  # a request given up on is cancelled on the stream now

    def dispatcher_back(self) -> None:
        """The dispatcher came back after readiness found it gone (a restart, perhaps with another engine or
        model): the next :meth:`model_info` asks DescribeModel again."""
        self._model_info_stale = True

    async def model_info(self, timeout_s: float = 5.0, model: str = "") -> agent_pb2.ModelInfo:
        """What the dispatcher serves (asked once, then kept): the model a request naming none is served,
        the engine, whether it shares prefixes, the context window its upstream reports, the model names a
        request may give (``models``; empty: not known). Asked again by the
        next task once the dispatcher came back (:meth:`dispatcher_back`) or the answer is
        :data:`MODEL_INFO_MAX_AGE_S` old, or a call ended NOT_FOUND (the upstream no longer serves a model it
        listed: a server restarted with another one, whose new list the dispatcher read for that answer; the list
        kept here refused the new model's name for up to :data:`MODEL_INFO_RETRY_S` more, naming the models of
        before as served), and while an ``openai`` engine's upstream reported no window or
        model list yet (it was down, or reports none), or a task names ``model``, one the answer kept does not
        list (the dispatcher then reads its upstream's list again: a model just loaded there is served), at
        most every :data:`MODEL_INFO_RETRY_S`; the answer kept before stands when that fails. One ask runs at a
        time: a task naming a model the kept answer does not list that comes while it runs waits for its answer
        (the answer kept had refused a model just loaded upstream to every task that came during the ask, and
        accepted the one that asked).

        Raises:
            ServiceUnavailable: the dispatcher is down, naming its address.
            SwitchyardError: the dispatcher answered with an error (its code kept).
        """
        info = self._model_info
        age = time.monotonic() - self._model_info_at
        unknown_model = bool(model) and info is not None and bool(info.models) and model not in info.models
        unread = info is not None and info.engine == "openai" and not (info.context_window_tokens and info.models)
        refresh = self._model_info_refresh
        if refresh is None and info is not None and (self._model_info_stale or age >= MODEL_INFO_MAX_AGE_S or (
                (unread or unknown_model) and age >= MODEL_INFO_RETRY_S)):
            self._model_info_at, self._model_info_stale = time.monotonic(), False
            refresh = self._model_info_refresh = asyncio.ensure_future(self._ask_model_info_again(model, timeout_s))
            await asyncio.shield(refresh)  # a caller that leaves does not cancel the ask others wait for
        elif refresh is not None and unknown_model:
            # asked again now, by another task (for this model, or for the same list): its answer is this one's too;
            # the answer kept refused a model just loaded upstream to every task that came while it was asked. A
            # task the kept answer serves does not wait (a window still unread is as unknown to the ask, mostly:
            # transformers serve and TGI report none)
            await asyncio.shield(refresh)
        if self._model_info is None:
            address, channel = await self._route(None, frozenset())
            try:
                self._model_info = await self._stub_for(channel).DescribeModel(
                    agent_pb2.DescribeModelRequest(model=model), timeout=timeout_s)
                self._prompt_token_ratios.update(self._model_info.prompt_token_ratios)
                self._model_info_at = time.monotonic()
            except grpc.aio.AioRpcError as err:
                waited = f"{timeout_s:g} s (its DescribeModel, asked before the first task naming no model)"
                raise await _tls_named(_downstream_error("dispatcher", address, err, waited), address,
                                       self._tls) from None
        return self._model_info

    async def _ask_model_info_again(self, model: str, timeout_s: float) -> None:
        """:meth:`model_info`'s DescribeModel asked again while an answer is kept (at most
        :data:`MODEL_INFO_REFRESH_TIMEOUT_S`): the answer replaces it; the one kept stands when the ask fails."""
        try:
            with contextlib.suppress(SwitchyardError, grpc.aio.AioRpcError):
                address, channel = await self._route(None, frozenset())
                self._model_info = await self._stub_for(channel).DescribeModel(
                    agent_pb2.DescribeModelRequest(model=model), timeout=min(timeout_s, MODEL_INFO_REFRESH_TIMEOUT_S))
                self._prompt_token_ratios.update(self._model_info.prompt_token_ratios)
        finally:
            self._model_info_refresh = None

    @property
    def known_default_model(self) -> str:
        """The model the dispatcher serves to a request that names none, as the kept :meth:`model_info` says it
        (``ModelInfo.model``); "" before it was first asked."""
        return self._model_info.model if self._model_info is not None else ""

    def reported_context_window(self, model: str) -> int:
        """The context window the dispatcher's upstream reports for ``model`` (``ModelInfo.context_window_tokens``,
        for the dispatcher's default model), once :meth:`model_info` has been asked; else 0. Taken through
        ``limits.context_window(model, reported)``."""
        return reported_window(self._model_info, model) if self._model_info is not None else 0

    def prompt_token_ratio(self, model: str) -> float:
        """The model server's prompt tokens per token of this orchestrator's count for ``model``, as the
        dispatcher measured it (its DescribeModel, then each generation's ``GenerateDone``); 1.0 where none was
        measured. Taken through ``limits.context_window(model, reported, ratio)``: the dispatcher owns the
        measure (it alone sees the server's usage beside the count sent), the orchestrator the check that
        refuses or cuts a prompt (it alone can leave memory out, trim passages, cut tool results)."""
        return self._prompt_token_ratios.get(model, 1.0)

    def _stub_for(self, channel: grpc.aio.Channel) -> agent_pb2_grpc.InferenceServiceStub:
        return self._stub if channel is self._channel else agent_pb2_grpc.InferenceServiceStub(channel)

    def announce_tool_wait(self, spec: TaskSpec, tool: str, expected_wait_s: float) -> asyncio.Task[None]:
        """Tell the agent's dispatcher (the replica its generations go to) that it now waits on ``tool`` for
        about ``expected_wait_s`` seconds: ``ToolWait``, fire-and-forget, never delaying the tool.

        The call runs in the background under :attr:`hint_timeout_s`; its outcome is counted in
        ``switchyard_tool_wait_hints_total{outcome}`` (ok, deadline_exceeded, unavailable, unimplemented,
        error) and the first failure of each kind is logged. The dispatcher's answer is recorded on the
        span current at the call (the tool's), while it is still open: ``switchyard.tool_wait.decision``
        (KEEP, SWAP, DROP) and, for a swap, ``switchyard.tool_wait.restore_at_s`` (when the KV is planned
        back in HBM, seconds after the tool started); it is not acted on here, the dispatcher acts on it.
        Never raises.

        Returns:
            the announcement's background task (:meth:`end_tool_wait` sends its end after it).
        """
        request = agent_pb2.ToolWaitRequest(agent_id=spec.agent_id or spec.task_id, tool=tool,
                                            task_id=spec.task_id,
                                            expected_wait_s=expected_wait_s, tenant_id=spec.tenant_id,
                                            priority=spec.priority)
        return self._hint(spec, request)

    def end_tool_wait(self, spec: TaskSpec, tool: str, expected_wait_s: float,
                      after: asyncio.Task[None] | None) -> None:
        """The agent's task ended while it waited on ``tool`` (cancelled, past its deadline, refused before its
        next step): ``ToolWait`` with ``task_ended``, after the announcement ``after`` where there was one (so
        that the end never overtakes it), fire-and-forget under :attr:`hint_timeout_s` and counted as :meth:`announce_tool_wait`'s.
        The dispatcher releases the agent's parked state, its DRAM copy and its tool-wait plan at once: no
        restore runs for a turn that will not come. It runs beyond the task's deadline (a task past it ends
        so). Never raises."""
        request = agent_pb2.ToolWaitRequest(agent_id=spec.agent_id or spec.task_id, tool=tool,
                                            task_id=spec.task_id,
                                            expected_wait_s=expected_wait_s, tenant_id=spec.tenant_id,
                                            priority=spec.priority, task_ended=True)
        self._hint(spec, request, after, context=beyond_deadline())

    def _hint(self, spec: TaskSpec, request: agent_pb2.ToolWaitRequest, after: asyncio.Task[None] | None = None,
              context: contextvars.Context | None = None) -> asyncio.Task[None]:
        hint = asyncio.create_task(self._tool_wait(self.affinity_key(spec), request, after),
                                   name=f"tool-wait-{spec.task_id}", context=context)
        self._hints.add(hint)
        hint.add_done_callback(self._hints.discard)
        return hint

    async def _tool_wait(self, affinity_key: str | None, request: agent_pb2.ToolWaitRequest,
                         after: asyncio.Task[None] | None = None) -> None:
        if after is not None:
            await asyncio.wait([after])  # the announcement first (it never raises)
        address = self.address
        try:
            async with asyncio.timeout(self.hint_timeout_s):
                address, channel = await self._route(affinity_key, frozenset())
                reply = await self._stub_for(channel).ToolWait(request, timeout=self.hint_timeout_s)
            outcome, detail = "ok", agent_pb2.ToolWaitDecision.Name(reply.decision)
            span = trace.get_current_span()  # the tool's span: this task runs in the context it started in
            if span.is_recording() and not request.task_ended:  # a tool that already ended has closed its span
                span.set_attribute("switchyard.tool_wait.decision", detail)
                if reply.decision == agent_pb2.SWAP:
                    span.set_attribute("switchyard.tool_wait.restore_at_s", reply.restore_at_s)
            log.debug("ToolWait for agent %s on %s: %s (restore at %.3f s)", request.agent_id, request.tool, detail,
                      reply.restore_at_s)
        except TimeoutError:
            outcome, detail = "deadline_exceeded", f"no answer within {self.hint_timeout_s * 1000:g} ms"
        except grpc.aio.AioRpcError as err:
            code = err.code()
            outcome = code.name.lower() if code.name.lower() in TOOL_WAIT_HINT_OUTCOMES else "error"
            detail = f"{code.name}: {err.details()}"
        except Exception as exc:  # noqa: BLE001 - a hint never fails its task
            outcome, detail = "error", repr(exc)
        TOOL_WAIT_HINTS.labels(outcome).inc()
        if outcome != "ok" and outcome not in self._hint_logged:
            self._hint_logged.add(outcome)
            log.warning("ToolWait to the dispatcher at %s failed (%s): %s; tools run on, the dispatcher keeps its "
                        "parking TTL (logged once per outcome; switchyard_tool_wait_hints_total counts them)",
                        address, outcome, detail)

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel calls take (readiness checks health over it too)."""
        return self._channel

    async def close(self) -> None:
        """Close the channels, after the ToolWait calls in flight: a stop ends the tasks it cancels with a
        ``task_ended`` each (:meth:`end_tool_wait`), which the dispatcher needs to release their agents' parked
        state and plans. Each is bounded by :attr:`hint_timeout_s` after its announcement (itself bounded so):
        what is still in flight after twice that is cancelled."""
        if self._hints:
            await asyncio.wait(set(self._hints), timeout=2 * self.hint_timeout_s)
        for hint in self._hints:
            hint.cancel()
        await asyncio.gather(*self._hints, return_exceptions=True)
        await asyncio.gather(*(streams.close() for streams in self._streams.values()), *self._closing)
        self._streams.clear()
        if self.replicas is not None:
            await self.replicas.close()
        await self._channel.close()
