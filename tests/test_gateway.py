"""GatewayClient against a real sim-openai server: streaming and JSON answers, tool calls, model map, priority."""

from __future__ import annotations

import json

import pytest

from gateway_fixtures import clean_proxy_env, gateway_config, sim_openai  # noqa: F401

from switchyard.common.priority import PriorityClass
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.events import ChatRequest, Finished, Token, ToolCallOut

QUESTION = (
    "<context>[1] Lists\nPython lists are mutable sequences. Tuples are immutable sequences.</context>"
    "<question>Are lists mutable?</question>"
)
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search_docs", "description": "search the docs",
                 "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
}


def ask(text: str = QUESTION, **fields) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], **fields)


async def collect(client: GatewayClient, request: ChatRequest) -> list:
    return [event async for event in client.stream_chat(request)]


async def test_streaming_answer_has_tokens_then_usage(sim_openai):
    async with GatewayClient(gateway_config(sim_openai.base_url)) as client:
        events = await collect(client, ask())
    tokens = [e.text for e in events if isinstance(e, Token)]
    assert "".join(tokens) == "Python lists are mutable sequences. [1]"
    assert len(tokens) > 1
    final = events[-1]
    assert isinstance(final, Finished) and final.finish_reason == "stop" and final.model == "claude-sonnet-4-5"
    assert final.usage is not None and final.usage.completion_tokens == len(tokens)
    body = sim_openai.state.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_streamed_tool_call_is_assembled_from_deltas(sim_openai):
    async with GatewayClient(gateway_config(sim_openai.base_url)) as client:
        events = await collect(client, ask("what is a list", tools=[SEARCH_TOOL]))
    calls = [e for e in events if isinstance(e, ToolCallOut)]
    assert len(calls) == 1 and calls[0].name == "search_docs"
    assert json.loads(calls[0].arguments_json) == {"query": "what is a list"}
    assert calls[0].call_id.startswith("call_")
    assert events[-1].finish_reason == "tool_calls"
    assert not any(isinstance(e, Token) for e in events)
    assert sim_openai.state.requests[-1]["tools"] == [SEARCH_TOOL]


async def test_model_map_and_priority_forwarding(sim_openai):
    cfg = gateway_config(sim_openai.base_url, model_map={"fast": "gpt-4o-mini"}, forward_priority=True,
                         priority_values={"core": 0, "normal": 1, "batch": 7})
    async with GatewayClient(cfg) as client:
        events = await collect(client, ask(model="fast", priority=PriorityClass.BATCH))
    assert events[-1].model == "gpt-4o-mini"
    body = sim_openai.state.requests[-1]
    assert body["model"] == "gpt-4o-mini" and body["priority"] == 7


async def test_priority_not_sent_unless_enabled_and_default_model_used(sim_openai):
    async with GatewayClient(gateway_config(sim_openai.base_url)) as client:
        await collect(client, ask(priority=PriorityClass.CORE))
    body = sim_openai.state.requests[-1]
    assert "priority" not in body and body["model"] == "claude-sonnet-4-5"


async def test_list_models(sim_openai):
    async with GatewayClient(gateway_config(sim_openai.base_url)) as client:
        assert await client.list_models() == ["claude-sonnet-4-5", "gpt-4o-mini", "sim-7b"]


async def test_concurrent_streams_share_the_pool(sim_openai):
    import asyncio

    async with GatewayClient(gateway_config(sim_openai.base_url, max_connections=2, max_keepalive_connections=2,
                                            concurrency={"max_limit": 2, "initial_limit": 2})) as client:
        results = await asyncio.gather(*(collect(client, ask()) for _ in range(6)))
    texts = {"".join(e.text for e in events if isinstance(e, Token)) for events in results}
    assert texts == {"Python lists are mutable sequences. [1]"}


async def test_sim_openai_answers_model_lookups_and_unknown_paths_in_openai_error_shape(sim_openai):
    import httpx

    async with httpx.AsyncClient(base_url=sim_openai.base_url, trust_env=False) as http:
        found = await http.get("/models/gpt-4o-mini")
        assert found.status_code == 200 and found.json()["id"] == "gpt-4o-mini"
        missing = await http.get("/models/claude-sonnet-4.5")
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
        assert missing.json() == {"error": {"message": "The model 'claude-sonnet-4.5' does not exist",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}
        unknown = await http.get("/embeddings")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "Invalid URL (GET /v1/embeddings)"
        wrong_method = await http.get("/chat/completions")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_a_stream_its_caller_stops_reading_is_counted_cancelled_and_a_finished_one_ok(clean_proxy_env):
    """A cancelled task's upstream call was counted outcome="ok"; a caller that closes the stream after its
    Finished event ended a complete call, which stays ok."""
    from gateway_fixtures import start_sim

    from switchyard_harness.faults import Fault
    from switchyard.gateway.metrics import GATEWAY_REQUESTS

    def count(outcome: str) -> float:
        return GATEWAY_REQUESTS.labels("sim-7b", outcome)._value.get()

    with start_sim(faults={"sim-7b": Fault(slow_ms=50)}) as server:
        config = gateway_config(server.base_url, default_model="sim-7b", fallback_model="")
        async with GatewayClient(config) as client:
            ok, cancelled = count("ok"), count("CANCELLED")
            request = ChatRequest(messages=[{"role": "user", "content": "tell me a long story"}], max_tokens=20)
            stream = client.stream_chat(request)
            assert isinstance(await anext(stream), Token)
            await stream.aclose()  # the caller went away after one token
            assert (count("ok"), count("CANCELLED")) == (ok, cancelled + 1)
            stream = client.stream_chat(request)
            async for event in stream:
                if isinstance(event, Finished):
                    break
            await stream.aclose()  # closed right after its Finished: a complete call
            assert (count("ok"), count("CANCELLED")) == (ok + 1, cancelled + 1)


async def test_a_cancelled_call_is_counted_cancelled_not_ok(clean_proxy_env):
    """A caller that cancels a call before any answer: outcome CANCELLED, never 'ok'."""
    import asyncio

    from prometheus_client import REGISTRY

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)  # reads the request, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    def count(outcome: str) -> float:
        return REGISTRY.get_sample_value("switchyard_gateway_requests_total",
                                         {"model": "claude-sonnet-4-5", "outcome": outcome}) or 0.0

    before = count("ok"), count("CANCELLED")
    try:
        async with GatewayClient(gateway_config(base, fallback_model="")) as client:
            call = asyncio.ensure_future(collect(client, ask()))
            await asyncio.sleep(0.3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
    finally:
        server.close()
    assert (count("ok"), count("CANCELLED")) == (before[0], before[1] + 1)


async def test_the_call_span_names_the_server_it_called_as_opentelemetry_conventions_say(sim_openai):
    """server.address held the whole base URL ('http://127.0.0.1:PORT/v1'), where OpenTelemetry's HTTP client
    conventions put the host, with server.port and url.full beside it (as the gRPC client spans do)."""
    from urllib.parse import urlsplit

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with GatewayClient(gateway_config(sim_openai.base_url), tracer=provider.get_tracer("test")) as client:
        await collect(client, ask())
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "gateway.chat_completions"]
    url = urlsplit(sim_openai.base_url)
    assert (span.attributes["server.address"], span.attributes["server.port"]) == (url.hostname, url.port)
    assert span.attributes["url.full"] == f"{sim_openai.base_url}/chat/completions"
