"""``switchyard serve sim-openai``: an OpenAI-compatible server driven by the sim engine.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}`` and ``POST
/v1/chat/completions`` (streaming SSE and JSON, usage, tool calls in OpenAI's
function-calling shape), and ``GET /metrics``: Prometheus text with vLLM's
metric names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``), so a router can read its load as it reads a
vLLM server's. Errors, unknown paths and methods included, come in
OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``). Replies come
from the sim engine's deterministic planner
(:func:`switchyard.dispatcher.engines.sim.plan_reply`), or as the last message's plan line
states (:class:`~switchyard_harness.testing.step_plan.StepPlan`: a benchmark's workload), and, unless
``--no-latency``, take the sim latency model's time (prefill, then one decode
step per token sized by the streams in flight). With latency on, the server
models a continuous-batching engine's two limits: at most ``max_running``
streams run at once (the rest wait, counted in ``vllm:num_requests_waiting``),
and prompt blocks it has prefilled stay in an automatic prefix cache
(:class:`~switchyard.dispatcher.engines.prefix_cache.PrefixCache`, vLLM's
``enable_prefix_caching``) of ``kv_tokens``: a prompt opening with cached
blocks prefills only the rest. Failures are injected per
request (see :mod:`switchyard_harness.faults`), so gateways, this project's
included, can be tested against every upstream failure with no model.

Run: ``switchyard serve sim-openai [--port 8400] [--api-key-env VAR] [--fault SPEC]`` (``--port 0``: a free
port, printed in the first line)
or ``python -m switchyard_harness.sim_openai``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from switchyard.common import children, envs
from switchyard.common.config import SimEngineConfig
from switchyard.dispatcher.engines.prefix_cache import PrefixCache
from switchyard.dispatcher.engines.sim import decode_seconds, plan_reply, prefill_seconds
from switchyard.dispatcher.request import Message, Tool, word_pieces
from switchyard_harness.faults import FAULT_HEADER, MODEL_SUFFIX, Fault, parse_fault, parse_flag, split_model
from switchyard.gateway.sse import DONE, encode
from switchyard_harness.testing.step_plan import StepPlan

DEFAULT_PORT = 8400
DEFAULT_MODELS = ("claude-sonnet-4-5", "gpt-4o-mini", "sim-7b")


class _CutStream(Exception):
    """Raised inside a streaming body to drop the connection mid-response."""


@dataclass
class SimOpenAIOptions:
    """How the server behaves.

    ``api_key``: when set, requests must carry ``Authorization: Bearer <api_key>``.
    ``faults``: model id (or ``*``) -> fault applied to its requests.
    ``latency``: sleep per the sim latency model (``sim`` parameters).
    """

    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    api_key: str | None = None
    faults: dict[str, Fault] = field(default_factory=dict)
    latency: bool = True
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)
    owned_by: str = "switchyard-sim"
    """``owned_by`` of every model in ``GET /v1/models`` (``vllm``, ``sglang``... to stand in for a server flavour)."""
    max_model_len: int = 0
    """``max_model_len`` of every model in ``GET /v1/models`` (vLLM's and SGLang's context window); 0: not
    listed (as ``transformers serve``, TGI and the OpenAI API list none). A chat completion whose prompt (this
    server's count: word pieces) and ``max_tokens`` do not fit it is answered 400 in vLLM's words."""
    refuse_fields: frozenset[str] = frozenset()
    """Body fields answered with 422 "Unexpected fields in the request: {...}", as ``transformers serve``
    answers fields it does not take (``priority``)."""
    max_completion_tokens_only: bool = False
    """Answer a body with ``max_tokens`` 400 "Unsupported parameter: 'max_tokens' is not supported with this
    model. Use 'max_completion_tokens' instead.", as the OpenAI API answers for its reasoning models."""
    priority_scheduling: bool = True
    """False: answer a request whose ``priority`` is not 0 as vLLM started without ``--scheduling-policy
    priority`` does, with one in-stream error ("Got priority N but Priority scheduling is not enabled.", code
    400) and ``data: [DONE]`` (a request that is not streamed: that 400)."""
    max_streams: int | None = None
    """Answer 429 (``Retry-After: 0``) to a streaming request while this many streams are open, as a
    rate-limited hosted API does; None: no limit."""
    max_running: int | None = None
    """Streams decoding at once (vLLM's ``--max-num-seqs``); later ones wait for a slot (with latency on);
    None: no limit."""
    kv_tokens: int = 100_000
    """KV cache size, tokens: the prefix cache's capacity and the denominator of ``vllm:kv_cache_usage_perc``."""
    prefix_caching: bool = True
    """Keep prefilled prompt blocks (``sim.prefix_block_tokens`` each) and skip them in later prompts."""
    models_delay_s: float = 0.0
    """Seconds ``GET /v1/models`` takes to answer (a server still loading, or far away)."""


@dataclass
class SimOpenAIState:
    """What the server saw: request bodies (in arrival order) and per-model request counts."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    """Request headers of every ``POST /v1/chat/completions`` (lower-cased names), in arrival order."""
    counts: dict[str, int] = field(default_factory=dict)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    """Per model, the ``time.monotonic()`` of each chat completion's arrival (to check Retry-After is honoured)."""
    active_streams: int = 0
    open_streams: int = 0
    """Streaming requests accepted and not yet finished (counted from acceptance, before the body starts)."""
    peak_open_streams: int = 0
    streams_left_by_client: int = 0
    """Streams whose client closed the connection before their end (the server stopped generating them)."""
    rejected_overload: int = 0
    """Requests answered 429 because ``max_streams`` streams were open."""
    running: int = 0
    """Streams holding a running slot (prefilling or decoding)."""
    waiting: int = 0
    """Streams waiting for a running slot (``max_running``)."""
    kv_used_tokens: int = 0
    """Prompt and output tokens of the running streams."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_hit_tokens: int = 0
    """Prompt tokens found there (not prefilled again)."""


def _error(status: int, message: str, code: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code, **extra}},
        status_code=status,
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (404 unknown path, 405 wrong method) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"Invalid URL ({request.method} {request.url.path})" if status == 404 else (
        f"Method {request.method} not allowed on {request.url.path}" if status == 405 else str(exc))
    headers = getattr(exc, "headers", None)
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
        status_code=status, headers=headers,
    )


def _status_error(status: int, model: str, headers: dict[str, str] | None = None,
                  said: str | None = None) -> JSONResponse:
    kinds = {
        400: ("bad request (injected)", "invalid_request_error"),
        401: ("invalid API key (injected)", "invalid_api_key"),
        404: (f"The model `{model}` does not exist (injected)", "model_not_found"),
        429: ("Rate limit reached (injected)", "rate_limit_exceeded"),
    }
    message, code = kinds.get(status, (f"upstream failure {status} (injected)", "server_error"))
    message = said if said is not None else message
    return JSONResponse({"error": {"message": message, "type": "sim_fault", "code": code}}, status_code=status,
                        headers=headers)


def _kind(value: Any) -> str:
    """A JSON value's type in OpenAI's words ("expected an integer, but got a string instead")."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _body_problem(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first field of a chat completions body that an OpenAI-compatible server refuses 400, as (param,
    message in the OpenAI API's words), or None. A body of the wrong shape was a 500 (a traceback in the
    server's log, and mid-stream for ``stream_options``), and a max_tokens of -1 or "3" was served as no
    limit at all: a gateway under test that sent either passed here and failed at every real server."""
    def typed(param: str, value: Any, expected: str, ok: bool) -> tuple[str, str] | None:
        return None if ok else (param, f"Invalid type for '{param}': expected {expected}, but got {_kind(value)} "
                                       "instead.")

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages", "messages: expected a non-empty list"
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            return typed(where, message, "an object", False)
        if problem := typed(f"{where}.role", message.get("role"), "a string", isinstance(message.get("role"), str)):
            return problem
        content = message.get("content")
        if problem := typed(f"{where}.content", content, "a string or an array of content parts",
                            content is None or isinstance(content, (str, list))):
            return problem
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                return typed(f"{where}.content[{j}]", part, "a content part (an object whose text is a string)",
                             False)
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is None:
            continue
        if problem := typed(param, value, "an integer", type(value) is int):
            return problem
        if value < 1:
            return param, (f"Invalid '{param}': integer below minimum value. Expected a value >= 1, but got "
                           f"{value} instead.")
    checks = (("model", "a string", str), ("stream", "a boolean", bool), ("stream_options", "an object", dict),
              ("tools", "an array", list), ("priority", "an integer", int))
    for param, expected, kind in checks:
        value = body.get(param)
        right = type(value) is kind  # a boolean is no integer here, as in JSON
        if value is not None and (problem := typed(param, value, expected, right)):
            return problem
    for i, tool in enumerate(body.get("tools") or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return typed(f"tools[{i}]", tool, "a function tool ({\"type\": \"function\", \"function\": {\"name\": "
                         "...}})", False)
    return None


def _messages(raw: list[dict[str, Any]]) -> list[Message]:
    out = []
    for item in raw:
        content = item.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append(Message(str(item.get("role", "user")), str(content), str(item.get("tool_call_id") or ""),
                           str(item.get("name") or "")))
    return out


def _tools(raw: list[dict[str, Any]]) -> list[Tool]:
    tools = []
    for item in raw or []:
        fn = item.get("function") or {}
        tools.append(Tool(str(fn.get("name", "")), str(fn.get("description", "")),
                          json.dumps(fn.get("parameters") or {})))
    return tools


def _prompt_pieces(messages: list[Message]) -> list[str]:
    """The prompt as the sim's tokens, messages marked by role: what the prefix cache hashes."""
    pieces: list[str] = []
    for message in messages:
        pieces.append(f"<{message.role}>")
        pieces.extend(word_pieces(message.content))
    return pieces


class _ServerMetrics:
    """The server's ``/metrics``: vLLM's names, read from the state at scrape time (own registry per server)."""

    def __init__(self, sim: "SimOpenAI") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        model = sim.options.models[0] if sim.options.models else "sim"
        state = sim.state
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda: state.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: state.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             lambda: min(1.0, state.kv_used_tokens / max(1, sim.options.kv_tokens))),
        )
        for name, doc, read in gauges:
            Gauge(name, doc, ["model_name"], registry=self.registry).labels(model).set_function(read)
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", ["model_name"],
                               registry=self.registry).labels(model)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", ["model_name"],
                            registry=self.registry).labels(model)


class SimOpenAI:
    """The ASGI application and its state; build with :func:`make_app`."""

    def __init__(self, options: SimOpenAIOptions) -> None:
        self.options = options
        self.state = SimOpenAIState()
        sim = options.sim
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(sim.prefix_block_tokens, sim.prefix_block_tokens) if options.prefix_caching else None
        )
        """Cached prompt blocks; ``block_bytes`` counts tokens here, so ``nbytes`` is tokens cached."""
        self._slots: asyncio.Semaphore | None = None
        self._metrics = _ServerMetrics(self)
        self.app = _CutConnections(Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_error},
        ))

    # ------------------------------------------------------------------ helpers

    def _auth_error(self, request: Request, fault: Fault | None) -> Response | None:
        if fault is not None and fault.expired:
            return JSONResponse(
                {"error": {"message": "OAuth access token expired; sign in again", "type": "authentication_error",
                           "code": "token_expired"}},
                status_code=401,
                headers={"www-authenticate": 'Bearer error="invalid_token", error_description="token expired"'},
            )
        if self.options.api_key is None:
            return None
        presented = request.headers.get("authorization", "").removeprefix("Bearer ")
        if presented == self.options.api_key:
            return None
        shown = f": {presented}" if fault is not None and fault.echo_key else ""
        return JSONResponse(
            {"error": {"message": f"Incorrect API key provided{shown}", "type": "invalid_request_error",
                       "code": "invalid_api_key"}},
            status_code=401,
        )

    def _fault_for(self, request: Request, model: str, suffix: Fault | None) -> Fault | None:
        if header := request.headers.get(FAULT_HEADER):
            return parse_fault(header)
        if suffix is not None:
            return suffix
        return self.options.faults.get(model) or self.options.faults.get("*")

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def _uncached_tokens(self, messages: list[Message], prompt_tokens: int) -> tuple[int, list[int]]:
        """Prompt tokens to prefill after the prefix cache's hit, and the prompt's block keys (to insert)."""
        cache = self.prefix_cache
        if cache is None:
            return prompt_tokens, []
        pieces = _prompt_pieces(messages)
        keys = cache.keys(pieces)
        hit = cache.match(keys) * cache.block_tokens
        cached = min(prompt_tokens, prompt_tokens * hit // max(1, len(pieces)))
        self.state.prefix_query_tokens += prompt_tokens
        self.state.prefix_hit_tokens += cached
        self._metrics.queries.inc(prompt_tokens)
        self._metrics.hits.inc(cached)
        return prompt_tokens - cached, keys

    def _cache_prompt(self, keys: list[int]) -> None:
        cache = self.prefix_cache
        if cache is None or not keys:
            return
        cache.insert(keys)
        if cache.nbytes > self.options.kv_tokens:
            cache.evict(cache.nbytes - self.options.kv_tokens)

    @contextlib.asynccontextmanager
    async def _running_slot(self) -> AsyncIterator[None]:
        """Hold one of ``max_running`` slots (waiting, counted, when all are taken)."""
        limit = self.options.max_running
        if limit is None or not self.options.latency:
            self.state.running += 1
            try:
                yield
            finally:
                self.state.running -= 1
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(limit)
        self.state.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.state.waiting -= 1
        self.state.running += 1
        try:
            yield
        finally:
            self.state.running -= 1
            self._slots.release()

    # ------------------------------------------------------------------ endpoints

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: running and waiting requests, KV use and prefix-cache counters, as vLLM names them."""
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the configured model ids."""
        if (denied := self._auth_error(request, None)) is not None:
            return denied
        if self.options.models_delay_s:
            await asyncio.sleep(self.options.models_delay_s)
        data = [self._model_card(m) for m in self.options.models]
        return JSONResponse({"object": "list", "data": data})

    def _model_card(self, model: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": self.options.owned_by}
        if self.options.max_model_len:
            card["max_model_len"] = self.options.max_model_len
        return card

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: one model object, or OpenAI's 404 ``model_not_found``."""
        if (denied := self._auth_error(request, None)) is not None:
            return denied
        model = request.path_params["model"]
        if model not in self.options.models:
            return _error(404, f"The model '{model}' does not exist", "model_not_found", param="model")
        return JSONResponse(self._model_card(model))

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` with faults applied first."""
        self.state.headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON", "invalid_json")
        if isinstance(body, dict) and (unexpected := self.options.refuse_fields & set(body)):
            self.state.requests.append(body)
            return JSONResponse({"detail": f"Unexpected fields in the request: {unexpected}"}, status_code=422)
        if isinstance(body, dict) and self.options.max_completion_tokens_only and "max_tokens" in body:
            self.state.requests.append(body)
            return _error(400, "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                               "'max_completion_tokens' instead.", "unsupported_parameter", param="max_tokens")
        if not isinstance(body, dict):
            return _error(400, f"Invalid type for the request body: expected an object, but got {_kind(body)} "
                               "instead.", "invalid_type")
        if (problem := _body_problem(body)) is not None:
            param, message = problem
            return _error(400, message, "invalid_value" if message.startswith(("Invalid '", "messages:"))
                          else "invalid_type", param=param)
        try:
            model, suffix = split_model(str(body.get("model") or ""))
        except ValueError as exc:  # the MODEL#SPEC suffix: a 400 naming it, as a bad x-sim-fault header
            return _error(400, str(exc), "invalid_fault", param="model")
        try:
            fault = self._fault_for(request, model, suffix)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_fault", param=FAULT_HEADER)
        if (denied := self._auth_error(request, fault)) is not None:
            return denied
        self.state.requests.append(body)
        count = self.state.counts[model] = self.state.counts.get(model, 0) + 1
        self.state.arrivals.setdefault(model, []).append(time.monotonic())
        if model not in self.options.models:
            return _error(404, f"The model `{model}` does not exist or you do not have access to it.",
                          "model_not_found")
        if fault is not None and fault.status and (not fault.fail_first or count <= fault.fail_first):
            return _status_error(fault.status, model, fault.retry_headers(time.time()), fault.said)
        priority = body.get("priority", 0)
        if not self.options.priority_scheduling and priority != 0:
            error = {"error": {"message": f"Got priority {priority} but Priority scheduling is not enabled.",
                               "type": "BadRequestError", "param": None, "code": 400}}
            if not body.get("stream"):
                return JSONResponse(error, status_code=400)
            return StreamingResponse(iter([encode(error), encode(DONE)]), media_type="text/event-stream")
        fault = fault or Fault()
        messages = _messages(body["messages"])
        plan = StepPlan.parse(messages[-1].content)  # a benchmark's stated reply (bench agents --stack)
        reply = (plan.reply(f"call_{uuid.uuid4().hex[:24]}") if plan
                 else plan_reply("", messages, _tools(body.get("tools") or [])))
        prompt_tokens = sum(len(word_pieces(m.content)) for m in messages)
        if (past := self._past_window(body, prompt_tokens)) is not None:
            return past
        stream = bool(body.get("stream"))
        if stream != fault.mismatch:
            limit = self.options.max_streams
            if limit is not None and self.state.open_streams >= limit:
                self.state.rejected_overload += 1
                return JSONResponse(
                    {"error": {"message": f"Rate limit reached: {limit} concurrent streams", "type": "rate_limit_error",
                               "code": "rate_limit_exceeded"}},
                    status_code=429, headers={"retry-after": "0"},
                )
            self.state.open_streams += 1
            self.state.peak_open_streams = max(self.state.peak_open_streams, self.state.open_streams)
            return StreamingResponse(
                self._stream(body, model, reply, prompt_tokens, fault, messages),
                media_type=None if fault.stream_type == "none" else fault.stream_type,
            )
        return JSONResponse(await self._completion(body, model, reply, prompt_tokens, messages))

    def _past_window(self, body: dict[str, Any], prompt_tokens: int) -> JSONResponse | None:
        """vLLM's 400 for a request past ``max_model_len`` (its prompt, as this server counts it, and its
        ``max_tokens``), in its words and error shape (``serving_engine._validate_input``); None when it fits or no
        window is set."""
        window = self.options.max_model_len
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        max_tokens = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else 0
        if not window or prompt_tokens + max_tokens <= window:
            return None
        if prompt_tokens >= window:
            message = (f"This model's maximum context length is {window} tokens. However, you requested "
                       f"{prompt_tokens} tokens in the messages, Please reduce the length of the messages.")
        else:
            message = (f"This model's maximum context length is {window} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                       "completion). Please reduce the length of the messages or completion.")
        return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                             "code": 400}, status_code=400)

    # ------------------------------------------------------------------ bodies

    def _limit(self, body: dict[str, Any], tokens: list[str], finish: str) -> tuple[list[str], str]:
        """The reply cut to the body's ``max_tokens``, finish_reason ``length``: an answer or a tool call alike (a
        server sends the call it had generated so far, its arguments incomplete: :func:`_sent_calls`)."""
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(max_tokens, int) and max_tokens > 0 and len(tokens) > max_tokens and finish in (
                "stop", "tool_calls"):
            return tokens[:max_tokens], "length"
        return tokens, finish

    async def _completion(self, body: dict[str, Any], model: str, reply: Any, prompt_tokens: int,
                          messages: list[Message]) -> dict[str, Any]:
        tokens, finish = self._limit(body, reply.tokens, reply.finish_reason)
        async with self._running_slot():
            self.state.kv_used_tokens += prompt_tokens + len(tokens)
            try:
                uncached, keys = self._uncached_tokens(messages, prompt_tokens)
                if self.options.latency:
                    await self._sleep(prefill_seconds(self.options.sim, uncached))
                self._cache_prompt(keys)
                if self.options.latency:
                    await self._sleep(len(tokens) * decode_seconds(self.options.sim, 1))
            finally:
                self.state.kv_used_tokens -= prompt_tokens + len(tokens)
        message: dict[str, Any] = {"role": "assistant", "content": None if reply.tool_calls else "".join(tokens)}
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": "".join(pieces)}}
                for c, pieces in _sent_calls(reply, tokens, finish)
            ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)},
        }

    def _deltas(self, reply: Any, tokens: list[str], finish: str) -> Iterator[dict[str, Any]]:
        if not reply.tool_calls:
            for text in tokens:
                yield {"content": text}
            return
        for index, (call, pieces) in enumerate(_sent_calls(reply, tokens, finish)):
            yield {"tool_calls": [{"index": index, "id": call.call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}}]}
            for piece in pieces:
                yield {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}

    async def _stream(
        self, body: dict[str, Any], model: str, reply: Any, prompt_tokens: int, fault: Fault,
        messages: list[Message] | None = None,
    ) -> AsyncIterator[bytes]:
        chunk_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        tokens, finish = self._limit(body, reply.tokens, reply.finish_reason)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            payload: dict[str, Any] = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                                       "model": model}
            payload["choices"] = [] if fault.no_choices else [
                {"index": 0, "delta": delta, "finish_reason": finish_reason}]
            return encode(payload)

        self.state.active_streams += 1
        kv = 0
        try:
            async with self._running_slot():
                kv = prompt_tokens
                self.state.kv_used_tokens += kv
                try:
                    uncached, keys = self._uncached_tokens(messages or [], prompt_tokens)
                    if self.options.latency:
                        await self._sleep(prefill_seconds(self.options.sim, uncached))
                    self._cache_prompt(keys)
                    yield chunk({"role": "assistant", "content": ""})
                    if fault.stream_error is not None:
                        kind = "BadRequestError" if 400 <= fault.stream_error < 500 else "InternalServerError"
                        yield encode({"error": {"object": "error", "message": f"injected stream_error "
                                                f"{fault.stream_error}", "type": kind, "code": fault.stream_error}})
                        return
                    for piece in range(fault.reasoning):  # a reasoning parser's thinking, before the answer
                        yield chunk({"reasoning_content": f"{' ' if piece else ''}thinking-{piece + 1}"})
                    for sent, delta in enumerate(self._deltas(reply, tokens, finish)):
                        kv += 1
                        self.state.kv_used_tokens += 1
                        if fault.cut_after is not None and sent >= fault.cut_after:
                            raise _CutStream(f"cut after {sent} items (injected)")
                        if fault.malformed_after is not None and sent >= fault.malformed_after:
                            yield (b'data: {"id": "' + chunk_id.encode()
                                   + b'", "choices": [{"delta": {"content": "tru\n\n')
                            return
                        step = decode_seconds(self.options.sim, self.state.running) if self.options.latency else 0
                        await self._sleep(step + fault.slow_ms / 1000)
                        yield chunk(delta)
                finally:
                    self.state.kv_used_tokens -= kv
            if fault.cut_after is not None:
                raise _CutStream("cut before finish (injected)")
            if fault.no_finish:
                return
            yield chunk({}, fault.finish or finish)
            if body.get("stream_options", {}).get("include_usage"):
                generated = len(tokens) + fault.reasoning
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                         "total_tokens": prompt_tokens + generated}
                yield encode({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
                              "choices": [], "usage": usage})
            if not fault.no_done:
                yield encode(DONE)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: the server stops generating
            self.state.streams_left_by_client += 1
            raise
        finally:
            self.state.active_streams -= 1
            self.state.open_streams -= 1


def _sent_calls(reply: Any, tokens: list[str], finish: str) -> list[tuple[Any, list[str]]]:
    """A reply's tool calls as sent, each with its arguments' word pieces: whole, or, cut at ``max_tokens``
    (``finish`` ``length``), as far as ``len(tokens)`` pieces reach over the calls in order (a call not begun is
    not sent)."""
    left = len(tokens) if finish == "length" else None
    sent = []
    for call in reply.tool_calls:
        pieces = word_pieces(call.arguments_json)
        if left is not None:
            if left <= 0:
                break
            pieces, left = pieces[:left], left - len(pieces)
        sent.append((call, pieces))
    return sent


class _CutConnections:
    """ASGI wrapper: a streaming body that raises :class:`_CutStream` ends without its final chunk.

    The server then closes the connection mid-response (uvicorn logs one line,
    "ASGI callable returned without completing response"), which is what a
    client sees when an upstream or proxy dies mid-stream.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except _CutStream:
            return


def make_app(options: SimOpenAIOptions | None = None) -> SimOpenAI:
    """The sim-openai application (``.app`` is the ASGI app, ``.state`` what it saw)."""
    return SimOpenAI(options or SimOpenAIOptions())


# --------------------------------------------------------------------------- running it


@dataclass
class RunningSimOpenAI:
    """A sim-openai server running in a background thread."""

    sim: SimOpenAI
    port: int
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``: what ``model_gateway.base_url`` should hold."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def state(self) -> SimOpenAIState:
        return self.sim.state


class _ThreadServer(uvicorn.Server):
    """uvicorn's server for :func:`run_in_thread`, stopped as soon as asked.

    uvicorn looks at ``should_exit`` every 0.1 s and, stopping, sleeps 0.1 s before it polls its open
    connections every 0.1 s: some 0.15-0.25 s per server, paid by each of the hundreds of tests that start
    one. Here :meth:`stop` wakes the loop at once and the same graceful stop (no new connections, each
    open one asked to close once its response is done, then waited for, as are the tasks) polls every
    5 ms."""

    POLL_S = 0.005

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def stop(self) -> None:
        """Ask the server to stop (from any thread); it does at once, not at its next 0.1 s tick."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: it stopped
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):  # on_tick: the Date header each second, then should_exit
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # an idle keep-alive connection closes now, a busy one after its response
        while self.server_state.connections and not self.force_exit:
            await asyncio.sleep(self.POLL_S)
        while self.server_state.tasks and not self.force_exit:
            await asyncio.sleep(self.POLL_S)
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


@contextlib.contextmanager
def run_in_thread(
    options: SimOpenAIOptions | None = None, host: str = "127.0.0.1", port: int = 0
) -> Iterator[RunningSimOpenAI]:
    """Serve in a daemon thread with its own event loop (port 0 picks a free port); stop on exit.

    Works from sync and async tests alike. Raises RuntimeError when the
    server does not start within 10 s.
    """
    sim = make_app(options)
    server = _ThreadServer(uvicorn.Config(sim.app, host=host, port=port, log_level="warning", lifespan="off",
                                          access_log=False))
    thread = threading.Thread(target=server.run, name="sim-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"sim-openai did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningSimOpenAI(sim, bound, host)
    finally:
        server.stop()
        thread.join(timeout=10)


@dataclass
class SpawnedSimOpenAI:
    """A sim-openai server in its own process (so that it can be killed as a crashed replica is)."""

    process: subprocess.Popen[str]
    base_url: str

    def kill(self) -> None:
        """SIGKILL the server (its open streams are cut, its port refuses) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def spawn(args: list[str] = (), host: str = "127.0.0.1", timeout_s: float = 30.0) -> SpawnedSimOpenAI:  # type: ignore[assignment]
    """Start ``switchyard serve sim-openai --port 0 ARGS`` in a child process; returns once it listens.

    Raises:
        RuntimeError: it exited or printed no address within ``timeout_s`` (its output is in the message).
    """
    command = [sys.executable, "-m", "switchyard_harness.sim_openai", "--host", host, "--port", "0", *args]
    process = subprocess.Popen(children.dying_with_parent(command, signal.SIGTERM),  # it served on, orphaned
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].split()[0]
            # keep reading its output so that a full pipe never blocks it
            threading.Thread(target=process.stdout.read, name="sim-openai-output", daemon=True).start()
            return SpawnedSimOpenAI(process, url)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"sim-openai did not start ({' '.join(command)}): {line.strip() or 'no output'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchyard serve sim-openai",
        description="OpenAI-compatible server driven by the sim engine, with failure injection.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="default %(default)s (queue.json base_url); 0: a free port, printed")
    parser.add_argument("--model", action="append", dest="models", metavar="ID",
                        help=f"model id served (repeatable; default {', '.join(DEFAULT_MODELS)})")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="require 'Authorization: Bearer <value of VAR>' (default: no key check)")
    parser.add_argument("--fault", action="append", default=[], metavar="[MODEL=]SPEC",
                        help="inject a failure, e.g. status=503 | gpt-4o-mini=cut_after=3 | slow_ms=50 "
                             f"(keys: {' '.join(f.name for f in fields(Fault))}); per request: header {FAULT_HEADER} "
                             "or model suffix MODEL#SPEC")
    parser.add_argument("--no-latency", action="store_true", help="answer at once instead of at sim-engine speed")
    parser.add_argument("--owned-by", default="switchyard-sim", metavar="NAME",
                        help="owned_by of the listed models, e.g. vllm or sglang to stand in for that server")
    parser.add_argument("--max-model-len", type=int, default=0, metavar="TOKENS",
                        help="list each model's max_model_len (its context window), as vLLM does; default none")
    parser.add_argument("--refuse-field", action="append", default=[], metavar="FIELD",
                        help="answer 422 'Unexpected fields in the request' to a body with FIELD (repeatable), "
                             "as transformers serve answers 'priority'")
    parser.add_argument("--max-completion-tokens-only", action="store_true",
                        help="answer a body with max_tokens 400 'Unsupported parameter: 'max_tokens' ... Use "
                             "'max_completion_tokens' instead.', as the OpenAI API answers for o1, o3 and gpt-5")
    parser.add_argument("--no-priority-scheduling", action="store_true",
                        help="answer a request whose priority is not 0 with vLLM's in-stream error 'Got priority N "
                             "but Priority scheduling is not enabled.', as vLLM without --scheduling-policy priority")
    parser.add_argument("--max-running", type=int, metavar="N",
                        help="streams decoding at once; later ones wait (vllm:num_requests_waiting); default no limit")
    parser.add_argument("--kv-tokens", type=int, default=SimOpenAIOptions.kv_tokens, metavar="N",
                        help="KV cache size in tokens: prefix cache capacity and kv_cache_usage_perc (%(default)s)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="prefill every prompt whole")
    parser.add_argument("--prefill-per-token-ms", type=float, metavar="MS",
                        help="prefill cost per uncached prompt token (default: sim.prefill_per_token_ms, 0.025)")
    parser.add_argument("--config-dir", help="read the sim latency parameters from this config folder")
    return parser


def _fault_flags(parser: argparse.ArgumentParser, flags: list[str], models: list[str]) -> dict[str, Fault]:
    """The ``--fault [MODEL=]SPEC`` flags as model (``*``: every model) -> fault, each read by
    :func:`~switchyard_harness.faults.parse_flag` against the models served; exits 2 (``parser.error``) for a
    flag that could never act, which the server took and then never injected (parse_flag's refusals: a MODEL
    this server does not serve, a blank MODEL, no fault), or a second flag for the same model (the last one
    replaced the first)."""
    faults: dict[str, Fault] = {}
    for flag in flags:
        try:
            model, fault = parse_flag(flag, models)
        except ValueError as exc:
            parser.error(f"--fault {exc}")
        if model in faults:
            whom = "every model" if model == "*" else f"model {model!r}"
            parser.error(f"--fault {flag!r}: a second fault for {whom} (the first would be replaced); give one "
                         "--fault per model, its items comma-separated (status=503,fail_first=2)")
        faults[model] = fault
    return faults


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``switchyard serve sim-openai``; returns the exit code (2 on bad flags)."""
    parser = _parser()
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_env:
        api_key = envs.read_secret(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: the variable is not set or empty")
    sim = SimEngineConfig()
    if args.config_dir:
        from switchyard.common.config import ConfigError, load_config

        try:
            sim = load_config(args.config_dir).sim
        except (ConfigError, ValueError) as exc:
            print(f"switchyard serve sim-openai: bad configuration in --config-dir {args.config_dir}:\n{exc}",
                  file=sys.stderr)
            return 2
    if args.prefill_per_token_ms is not None:
        if not 0 <= args.prefill_per_token_ms <= 1000:
            parser.error(f"--prefill-per-token-ms: expected 0 to 1000, got {args.prefill_per_token_ms}")
        sim = sim.model_copy(update={"prefill_per_token_ms": args.prefill_per_token_ms})
    if args.max_running is not None and args.max_running < 1:
        parser.error(f"--max-running: expected at least 1, got {args.max_running}")
    if args.kv_tokens < 1:
        parser.error(f"--kv-tokens: expected at least 1, got {args.kv_tokens}")
    for model in args.models or ():  # '' was served as a model no request can name; 'a#b' read as a#<fault>
        if not model.strip() or MODEL_SUFFIX in model:
            parser.error(f"--model: expected a model id, not blank and without '{MODEL_SUFFIX}' (which starts a "
                         f"fault suffix, MODEL{MODEL_SUFFIX}SPEC), got {model!r}")
    faults = _fault_flags(parser, args.fault, args.models or list(DEFAULT_MODELS))
    if args.max_model_len and args.max_model_len < 16:
        parser.error(f"--max-model-len: expected 0 (none listed) or at least 16 tokens, got {args.max_model_len}")
    options = SimOpenAIOptions(
        models=args.models or list(DEFAULT_MODELS), api_key=api_key, faults=faults, latency=not args.no_latency, sim=sim,
        owned_by=args.owned_by, refuse_fields=frozenset(args.refuse_field), max_model_len=args.max_model_len,
        max_running=args.max_running, kv_tokens=args.kv_tokens, prefix_caching=not args.no_prefix_caching,
        priority_scheduling=not args.no_priority_scheduling, max_completion_tokens_only=args.max_completion_tokens_only,
    )
    if not 0 <= args.port <= 65535:  # bind() raised OverflowError, a traceback
        parser.error(f"--port: expected 0 (any free port) to 65535, got {args.port}")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # bound here, so that port 0's choice can be printed
    except OSError as exc:
        parser.error(f"--host/--port: cannot listen on {args.host}:{args.port}: {exc}")
    sock.listen(2048)  # connections made once the address is printed wait in the backlog until uvicorn serves
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"sim-openai listening on http://{host}:{port}/v1 (models: {', '.join(options.models)})", flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(options).app, log_level="warning", lifespan="off"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
