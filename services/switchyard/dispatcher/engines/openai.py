"""The ``openai`` engine: any OpenAI-compatible upstream (vLLM, SGLang, TGI, Ollama, LiteLLM, hosted APIs).

A :class:`~switchyard.dispatcher.engines.base.StreamEngine`: each request is
one streamed ``/v1/chat/completions`` call made by
:class:`switchyard.gateway.client.GatewayClient`, which owns the HTTP pool,
retries, fallback and the error table. This module only translates a
:class:`~switchyard.dispatcher.request.Request` into an OpenAI request and
the gateway's events into the engine protocol's items. The stream loop
(:mod:`switchyard.dispatcher.stream_loop`) fans admitted requests out as concurrent calls, bounded by the
upstream's concurrency limit (:attr:`OpenAIEngine.stream_slots`);
``queues.inference.max_batches_in_prefill`` bounds only the admission waves sent that have no first token yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, AsyncIterator, Sequence

from opentelemetry.trace import Tracer

from switchyard.common import envs, untrusted
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.base import Reasoning, StreamEngine, StreamItem, Usage
from switchyard.dispatcher.engines.token_ratio import PromptTokenRatios
from switchyard.dispatcher.metrics import PROMPT_TOKEN_RATIO
from switchyard.dispatcher.request import Message, Request, Tool, ToolCall
from switchyard.dispatcher.scheduler.capacity import StreamSlots
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import ContextWindowExceeded, EndpointNotFound, GatewayError
from switchyard.gateway import events
from switchyard.gateway import models as model_names
from switchyard.gateway.keys import load_api_key, require_usable
from switchyard.gateway.pool import server_root
from switchyard.gateway.redact import install_log_redaction, safe_url

log = logging.getLogger(__name__)

DESCRIBE_RETRY_S = 10.0
"""Seconds between reads of an upstream's model list that has not answered yet (its context windows)."""

def _tool_spec(tool: Tool) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of ``tool``, whose ``parameters_json`` :func:`.processor.to_request` checked is a
    JSON object."""
    function: dict[str, Any] = {"name": tool.name, "parameters": untrusted.loads(tool.parameters_json or "{}")}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_messages(prompt: str, messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI chat messages for a request: ``messages`` if any, else one user turn holding ``prompt``.

    OpenAI-compatible servers require each ``tool`` message to answer a
    ``tool_calls`` entry of the assistant turn before it. Assistant messages
    carry their calls; a tool result whose call is missing (an older client)
    gets its call restated on that assistant turn (arguments ``{}``).
    """
    if not messages:
        return [{"role": "user", "content": prompt}]
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in message.tool_calls
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
            owner = _assistant_before(out)
            if owner is None:
                owner = {"role": "assistant", "content": ""}
                out.append(owner)
            calls = owner.setdefault("tool_calls", [])
            if all(call["id"] != message.tool_call_id for call in calls):
                calls.append({"id": message.tool_call_id, "type": "function",
                              "function": {"name": message.name, "arguments": "{}"}})
        elif message.name:
            item["name"] = message.name
        out.append(item)
    return out


def _assistant_before(out: list[dict[str, Any]]) -> dict[str, Any] | None:
    for item in reversed(out):
        if item["role"] == "assistant":
            return item
        if item["role"] != "tool":
            return None
    return None


def chat_request(req: Request) -> events.ChatRequest:
    """The gateway request for ``req``: messages, tools, max_tokens, model, priority class, agent and tenant; each HTTP
    request of it that goes out is noted on ``req`` (:meth:`Request.sent_upstream`: what it then waits on). Its
    tools' ``parameters_json`` were checked as JSON Schema objects when the request was built
    (:func:`~switchyard.dispatcher.processor.to_request`, INVALID_ARGUMENT there): nothing is refused here."""
    return events.ChatRequest(
        messages=chat_messages(req.prompt, req.messages),
        model=req.model if req.names_model else "",  # "": the default, which may fall back (the gateway's rule)
        max_tokens=req.max_tokens or None,
        tools=[_tool_spec(tool) for tool in req.tools],
        priority=req.priority,
        agent_id=req.agent_id,
        tenant_id=req.tenant_id,
        request_id=req.request_id,
        timeout_s=None if req.deadline is None else max(0.0, req.deadline - time.monotonic()),
        deadline_source=req.deadline_source,
        affinity_key=req.agent_key,
        on_sent=lambda url, model: req.sent_upstream(upstream_words(url, model)),
    )


def upstream_words(url: str, model: str) -> str:
    """How a message names the model server a call waits on: ``the model server at http://host:port (model m)``,
    from an endpoint's base URL (its ``/v1`` left out, and any credentials, query or fragment: :func:`safe_url`)
    and the upstream model id sent."""
    return f"the model server at {safe_url(server_root(url))} (model {model})"


class OpenAIEngine(StreamEngine):
    """StreamEngine over ``model_gateway`` (queue.json).

    Args:
        config: the whole config; reads ``upstream``.
        tracer: tracer for the gateway spans (default: global).
    """

    def __init__(self, config: SwitchyardConfig, *, tracer: Tracer | None = None) -> None:
        upstream = config.upstream  # the gateway client keeps it (client.config); the engine reads it here only
        self.model = upstream.default_model
        # Fail at start-up, not on the first task: a missing key, or one with
        # whitespace (a pasted trailing newline), is a set-up error.
        require_usable(load_api_key(upstream.api_key_env), required=upstream.api_key_required)
        self.client = GatewayClient(upstream, tracer=tracer)
        self.stream_slots = StreamSlots(self.client.concurrency_limit)
        """The streams the dispatcher admits to the upstream, under the sum of the endpoints' adaptive limits
        (:class:`switchyard.gateway.pool.PoolLimit`; ``base_url`` alone is a pool of one), each fed by the
        gateway with its endpoint's TTFTs, tokens, 429/503 answers and reported queue."""
        self.token_ratios = PromptTokenRatios()
        """Per model, the server's ``usage.prompt_tokens`` per token of the count the caller sent: learnt here,
        the one place that sees both, on every call whose usage the server reported."""
        PROMPT_TOKEN_RATIO.labels(self.model).set(1.0)  # none measured yet: the count taken as it is
        self._described = False
        self._describing: asyncio.Task[None] | None = None
        self._reads_ended = 0
        self._described_at = -math.inf
        # Defence in depth: messages are redacted where they are built; this
        # also scrubs the key from any log line that reaches a root handler.
        install_log_redaction(envs.read_secret(upstream.api_key_env))

    @property
    def busy_seconds(self) -> float:  # type: ignore[override]
        """Seconds of the upstream's concurrency limit in use (:attr:`StreamSlots.busy_seconds`): the busy ratio the
        compute score reads without NVML is the share of the server's knee the streams held."""
        return self.stream_slots.busy_seconds

    def reported_context_window(self, model: str) -> int:
        """The window the upstream's ``GET /v1/models`` reported for ``model`` (vLLM's ``max_model_len``), once
        :meth:`describe_upstream` or the gateway has listed the models; else 0. While the models are unread
        (the upstream was down when the dispatcher started), a read is started in the background, at most
        every :data:`DESCRIBE_RETRY_S`, so that the window is learnt once the server answers."""
        if not self._described and time.monotonic() - self._described_at >= DESCRIBE_RETRY_S:
            self.start_describing()
        return self.client.reported_context_window(model or self.model)

    def reported_context_windows(self) -> dict[str, int]:
        """The windows of every model the upstream's ``GET /v1/models`` reported one for, and their aliases."""
        return self.client.reported_context_windows()

    def served_names(self) -> Sequence[str]:
        """Every model name a request may give (:meth:`GatewayClient.served_names`, its one owner, built when a list
        is read with other ids: the listed ids and each ``model_map`` alias of one); empty until the list of every
        endpoint has been read."""
        return self.client.served_names()

    def _read_again_for(self, model: str) -> asyncio.Task[None] | None:
        """Read the upstream's model list again (:meth:`start_describing`) when it was read, does not name ``model``,
        and the last read is :data:`DESCRIBE_RETRY_S` old: a model loaded on the server since is then served,
        not refused by the list of before; a client naming unknown models costs the server one read per
        :data:`DESCRIBE_RETRY_S`. Returns the read under way, or None."""
        names = self.served_names()
        if not model or not names or model in names:
            return None
        if time.monotonic() - self._described_at >= DESCRIBE_RETRY_S:
            self._described = False
        return self.start_describing()

    def prompt_token_ratio(self, model: str) -> float:
        return self.token_ratios.ratio(model or self.model)

    def prompt_token_ratios(self) -> dict[str, float]:
        return self.token_ratios.ratios()

    def _learn_prompt_tokens(self, req: Request, served: int, answered: str) -> None:
        """Learn ``req.model``'s ratio from the server's ``served`` prompt tokens, where the caller counted the
        prompt (``req.prompt_tokens_sent``: the orchestrator's cl100k count; the processor's own word-piece
        count is another measure, not learnt from) and the model that ``answered`` (the upstream id the stream
        names) is not the fallback (``model_gateway.fallback_model``: another model, perhaps another
        tokenizer); the request carries the estimate back to its caller."""
        primary, *fallback = self.client.models_for(req.model)
        if req.prompt_tokens_sent and served > 0 and not (answered in fallback and answered != primary):
            learnt = self.token_ratios.observe(req.model, req.prompt_tokens, served)
            if learnt is not None:
                PROMPT_TOKEN_RATIO.labels(req.model).set(learnt)
        req.prompt_token_ratio = self.token_ratios.ratio(req.model, unmeasured=0.0)

    def start_describing(self) -> asyncio.Task[None] | None:
        """Start the read of the upstream's model list in the background unless it has been read or a read is
        under way; returns the read under way (None: read already, or no running loop). The engine's one owner
        of that read: the dispatcher's start, :meth:`reported_context_window` and :meth:`describe_upstream`
        all come here, so they never list the models twice at once; :meth:`aclose` stops it."""
        if self._described:
            return None
        if self._describing is None or self._describing.done():
            with contextlib.suppress(RuntimeError):  # no running loop: a synchronous caller, nothing started
                self._describing = asyncio.get_running_loop().create_task(self._list_models(),
                                                                          name="describe-upstream")
        return self._describing

    async def describe_upstream(self) -> None:
        """Wait for the read of the upstream's models (:meth:`start_describing`, started now when none is under
        way): its flavour and the context windows it reports. A failure is logged and leaves both unknown."""
        reading = self.start_describing()
        if reading is not None:
            await asyncio.shield(reading)  # a caller's timeout does not cancel the read others wait for

    async def await_model_list(self, model: str, wait_s: float, *, read_unread: bool = False) -> None:
        """:meth:`StreamEngine.await_model_list`: the first read under way (or, ``read_unread``, a read now while
        the list is unread: :meth:`describe_upstream`), then a read again while the list does not name ``model``
        (:meth:`_read_again_for`, at most every :data:`DESCRIBE_RETRY_S`); ``wait_s`` bounds both together. With
        nothing to wait for (the list read, and naming ``model``: every request once the first read ended) it
        returns at once, no timer armed (a request's check runs it: 0.2 us, not the 8 us of a timeout's set-up)."""
        if read_unread:
            first = self.start_describing()  # a read now while the list is unread (None: read already)
        else:
            first = self._describing if not self._reads_ended else None  # the first read, while under way
        again = None
        if first is None or first.done():
            first = None
            again = self._read_again_for(model)
            if again is None:
                return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                if first is not None:
                    await asyncio.shield(first)  # a caller's timeout does not cancel the read others wait for
                    again = self._read_again_for(model)
                if again is not None:
                    await asyncio.shield(again)

    async def _list_models(self) -> None:
        """Read the upstream's model list. What stands in the way of every request is a WARNING, once: the
        upstream not answering (the first read fails; later retries log at INFO), or not listing the model a
        request naming none is served (``switchyard up`` reports the stack healthy either way: the dispatcher
        is up, and a model server may come up after it); and so is one not listing ``fallback_model``, which
        every call whose model fails before its first token is sent to (it had been no warning: the fallback
        served none of them, each call's error adding that it was not found there)."""
        self._described_at = time.monotonic()
        try:
            ids = await self.client.list_models_everywhere()
            self._described = True
        except GatewayError as exc:
            level = logging.WARNING if not self._reads_ended else logging.INFO
            if isinstance(exc, EndpointNotFound):  # it answered: GET /models is no route there (404, 405, 3xx)
                log.log(level, "could not list the upstream's models: %s; requests are sent all the same (a server "
                        "with no model list, such as TGI before 2.3, serves them; a wrong URL fails them NOT_FOUND), "
                        "context windows unknown (limits.context_window_tokens); `switchyard doctor` probes which",
                        exc)
                return
            log.log(level, "could not list the upstream's models: %s; requests fail until it answers (context "
                    "windows unknown meanwhile; `switchyard doctor` checks the set-up)", exc)
        else:
            served = self.client.models_for(self.model)[0]
            if ids and not model_names.listed(served, ids):
                log.warning("the upstream does not list model %r, which a request naming no model is served (it "
                            "lists %s): such requests fail NOT_FOUND; set model_gateway.default_model "
                            "(SWITCHYARD_UPSTREAM_MODEL) to one it serves", served, ", ".join(map(repr, ids[:10])))
            fallback = self.client.models_for("")[1:]
            if ids and fallback and not model_names.listed(fallback[0], ids):
                log.warning("the upstream does not list model %r, model_gateway.fallback_model, which a call whose "
                            "model fails before its first token is sent to (it lists %s): it is not found there, so "
                            "it serves none of them; set model_gateway.fallback_model (SWITCHYARD_UPSTREAM_FALLBACK_MODEL) to one "
                            "it serves, or to none (SWITCHYARD_UPSTREAM_FALLBACK_MODEL=none) for no fallback",
                            fallback[0], ", ".join(map(repr, ids[:10])))
        finally:
            self._reads_ended += 1

    async def generate(self, req: Request) -> AsyncIterator[StreamItem]:
        """Stream ``req``'s completion: token texts, Reasoning (a reasoning model's thinking: output tokens, not
        the answer), ToolCalls, then one Usage.

        The Usage is the server's; where it reports none (no ``stream_options`` support, usage omitted) or a
        count of 0, the completion tokens are the gateway's estimate of what came
        (:func:`~switchyard.gateway.events.estimated_tokens`: word pieces of each piece of text, thinking and tool
        call; an answer that came whole, not streamed, counts its words), and the prompt tokens the dispatcher's
        own count. A usage the server reported teaches the model's prompt-token ratio (:attr:`token_ratios`).

        Raises:
            switchyard.gateway.errors.GatewayError: the error-table row of the
                upstream failure (gRPC status on ``.code``). Retries and the
                fallback model happen inside, before the first item only.
        """
        request = chat_request(req)
        estimated = 0  # the completion tokens, where the server counts none
        try:
            async for event in self.client.stream_chat(request):
                estimated += events.estimated_tokens(event)
                if isinstance(event, events.Token):
                    yield event.text
                elif isinstance(event, events.Reasoning):
                    yield Reasoning(event.text)
                elif isinstance(event, events.ToolCallOut):
                    yield ToolCall(event.call_id, event.name, event.arguments_json)
                elif isinstance(event, events.Finished):
                    usage = event.usage
                    self._learn_prompt_tokens(req, usage.prompt_tokens if usage else 0, event.model)
                    yield Usage(
                        prompt_tokens=usage.prompt_tokens if usage and usage.prompt_tokens else req.prompt_tokens,
                        completion_tokens=usage.completion_tokens if usage and usage.completion_tokens else estimated,
                        finish_reason=event.finish_reason or None,  # read as one of OpenAI's by the gateway
                        model=event.model,
                    )
        except ContextWindowExceeded as exc:
            self._refused_past_window(req, exc)
            raise

    def _refused_past_window(self, req: Request, exc: ContextWindowExceeded) -> None:
        """The server refused ``req`` as too long for its model's context window, a prompt the dispatcher's
        check let by at its count (a first call of the model, before any ratio of the server's tokens to the
        caller's count was measured; or a ratio measured below this prompt's): the count the server's words give
        (:attr:`ContextWindowExceeded.server_prompt_tokens`) teaches the model's ratio as a usage does
        (:meth:`_learn_prompt_tokens`), so that the next prompt past the window is refused before it is sent, in
        the dispatcher's words; and the error says both counts, and why the check let it by."""
        served = exc.server_prompt_tokens
        before = self.token_ratios.ratio(req.model, unmeasured=0.0)
        if served:
            self._learn_prompt_tokens(req, served, exc.model or self.client.models_for(req.model)[0])
        counted = (f"prompt_tokens {req.prompt_tokens} (the caller's count)" if req.prompt_tokens_sent
                   else f"prompt_tokens {req.prompt_tokens} (the dispatcher's own count: the caller sent none)")
        measured = (f"the server's tokens per counted one measured for {req.model!r} before: {before:.2f}" if before
                    else f"no ratio of the server's tokens to the count was measured for {req.model!r} yet")
        note = f"the dispatcher's window check let it by at {counted} beside max_tokens {req.max_tokens} ({measured})"
        if served:
            note += f"; the server counted the prompt {served} tokens"
            after = self.token_ratios.ratio(req.model, unmeasured=0.0)
            if after and after != before:
                note += (f", {after:.2f} per counted token, now measured for {req.model!r}: a prompt past the "
                         "window is refused before it is sent")
        else:
            note += ("; its server counts the prompt with its own tokenizer, and the ratio is learnt from the calls it "
                     "answers with usage")
        exc.with_note(note)

    def refused_for_load(self, exc: BaseException) -> bool:
        """The upstream refused the call for load (a 429 or 503: :attr:`GatewayError.refuses_load`, the rule
        the endpoint's limit backs off by) after the gateway's retries and its fallback, before any token."""
        return isinstance(exc, GatewayError) and exc.refuses_load and not exc.tokens_sent

    async def aclose(self) -> None:
        """Close the HTTP connection pool (and stop a read of the model list still under way)."""
        if self._describing is not None:
            self._describing.cancel()
        await self.client.aclose()
