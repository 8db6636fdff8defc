"""The dispatcher over a real gRPC server on 127.0.0.1:0 with the sim engine."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from typing import AsyncIterator

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import SwitchyardConfig
from switchyard.common.server import RunningServer, start_server
from switchyard.dispatcher.engines.base import StreamEngine
from switchyard.dispatcher.engines.sim import SimEngine, SimKV
from switchyard.dispatcher.request import RequestStatus
from switchyard.dispatcher.service import DispatcherService
from switchyard.common.channels import open_channel
from fast_sim import FAST
from token_events import positions_follow_on, token_count

pytestmark = pytest.mark.no_gpu

PROMPT = """<context>
[1] The with statement
The with statement is used to wrap the execution of a block with methods defined by a context manager.
</context>
<question>How does the with statement work?</question>"""

SLOW_DECODE = {**FAST, "sim.decode_base_ms": 20.0}


def make_config(**overrides: object) -> SwitchyardConfig:
    return SwitchyardConfig().with_overrides(**{**FAST, **overrides})


def kv_room_for(tokens: int, config: SwitchyardConfig | None = None) -> dict[str, object]:
    """Overrides that size the sim GPU so that its HBM budget holds the KV of ``tokens`` tokens."""
    sim = (config or SwitchyardConfig()).sim
    ratio = SwitchyardConfig().memory.hbm.capacity_ratio
    weights = sim.params_billion * 1e9 * sim.bytes_per_param
    return {"sim.hbm_gb": (weights + tokens * sim.kv_bytes_per_token + 1) / ratio / 1e9}


def one_at_a_time(config: SwitchyardConfig) -> DispatcherService:
    """A FIFO dispatcher whose GPU holds one request of up to 600 tokens (prompt + max_tokens)."""
    config = config.with_overrides(**kv_room_for(600, config))
    return DispatcherService(config, policy="fifo")


class Harness:
    def __init__(self, service: DispatcherService, srv: RunningServer, channel: grpc.aio.Channel) -> None:
        self.service, self.srv, self.channel = service, srv, channel
        self.stub = agent_pb2_grpc.InferenceServiceStub(channel)

    async def generate(self, **fields: object) -> list[agent_pb2.GenerateChunk]:
        fields.setdefault("prompt", PROMPT)
        timeout = fields.pop("timeout", 30.0)
        return [c async for c in self.stub.Generate(agent_pb2.GenerateRequest(**fields), timeout=timeout)]


async def serve(service: DispatcherService) -> AsyncIterator[Harness]:
    srv = await start_server([service], "127.0.0.1", 0, service.config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}")
    try:
        yield Harness(service, srv, channel)
    finally:
        await channel.close()
        await srv.stop(1.0)


@pytest.fixture
async def dispatcher() -> AsyncIterator[Harness]:
    async for harness in serve(DispatcherService(make_config())):
        yield harness


async def wait_until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


# --------------------------------------------------------------------------- streaming


async def test_generate_streams_tokens_then_done_with_usage(dispatcher: Harness) -> None:
    chunks = await dispatcher.generate(request_id="r1", max_tokens=64, task_type="rag_answer")
    tokens = [c.token for c in chunks if c.HasField("token")]
    assert tokens and positions_follow_on(tokens)
    text = "".join(t.text for t in tokens)
    assert text.startswith("The with statement is used to wrap the execution of a block") and "[1]" in text
    assert chunks[-1].HasField("done") and sum(c.HasField("done") for c in chunks) == 1
    done = chunks[-1].done
    assert done.usage.completion_tokens == token_count(tokens)
    assert done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.finish_reason == "stop"
    assert done.model == "sim-7b"
    assert done.batch_size >= 1
    assert done.flush_reason == agent_pb2.IDLE  # an idle engine takes a request at once
    assert done.ttft_s > 0 and done.queue_wait_s >= 0
    assert done.memory_peak_bytes > 0


async def test_concurrent_requests_share_batches_and_each_gets_its_own_stream(dispatcher: Harness) -> None:
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("switchyard_batch_size_sum") or 0.0
    results = await asyncio.gather(*(dispatcher.generate(request_id=f"c{i}", max_tokens=5 + i) for i in range(12)))
    for i, chunks in enumerate(results):
        done = chunks[-1].done
        assert done.usage.completion_tokens == 5 + i
        assert done.finish_reason == "length"
    assert (REGISTRY.get_sample_value("switchyard_batch_size_sum") or 0.0) - before == 12  # each flushed once


async def test_tools_offered_give_a_tool_call_chunk(dispatcher: Harness) -> None:
    chunks = await dispatcher.generate(
        prompt="", messages=[agent_pb2.ChatMessage(role="user", content="<question>what is with?</question>")],
        tools=[agent_pb2.ToolSpec(name="search_docs", parameters_json='{"type": "object"}')],
    )
    calls = [c.tool_call for c in chunks if c.HasField("tool_call")]
    assert [c.name for c in calls] == ["search_docs"]
    assert calls[0].arguments_json == '{"query": "what is with?"}'
    assert chunks[-1].done.finish_reason == "tool_calls"
    assert not [c for c in chunks if c.HasField("token")]


def test_checking_large_tool_schemas_keeps_none_of_them() -> None:
    """A tool's schema check is cached (the same few tools come with every step of an agent), and the cache kept
    each schema it checked, whatever its size: 256 of them, up to limits.max_prompt_chars (1,000,000) each, so
    callers offering tools with large distinct schemas held up to 256 MB of the dispatcher's memory for good."""
    import json
    import tracemalloc

    from switchyard.dispatcher.processor import schema_problem

    tracemalloc.start(8)  # deep enough to see this test's frame under the schema's allocation
    try:
        for i in range(10):  # 10 distinct schemas of 400 KB each: 4 MB if kept
            assert schema_problem(json.dumps({"type": "object", "description": f"{i} " + "x" * 400_000})) is None
        # what is still allocated from here (other threads' allocations, a sim server's, are not this test's)
        here = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, __file__, all_frames=True)])
    finally:
        tracemalloc.stop()
    retained = sum(stat.size for stat in here.statistics("filename"))
    assert retained < 1_000_000, retained
    assert schema_problem('{"type": "object", "properties": {"q": {"type": "string"}}}') is None  # a small one: kept


# --------------------------------------------------------------------------- bad requests


async def test_a_model_the_engine_does_not_serve_is_not_found(dispatcher: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dispatcher.generate(model="gpt-4o-mini", prompt_tokens=100000, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "serves 'sim-7b'" in (err.value.details() or "")
    chunks = await dispatcher.generate(model="sim-7b", max_tokens=3)  # its own name is fine
    assert chunks[-1].done.model == "sim-7b"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_tokens": 4090}, "max_tokens"),  # prompt + max_tokens past sim-7b's 4096-token context window
        ({"agent_id": "a" * 300}, "agent_id"),
        ({"task_id": "t" * 300}, "task_id"),
        ({"task_id": "task\x00one"}, "task_id"),
        ({"prompt_tokens": 2**31 - 1, "max_tokens": 8}, "prompt_tokens"),  # the bad field is named, not max_tokens
        # nested past the JSON parser's recursion limit: INVALID_ARGUMENT, not UNKNOWN from a RecursionError
        ({"tools": [agent_pb2.ToolSpec(name="t", parameters_json='{"a":' * 1100 + "1" + "}" * 1100)]},
         "tools[0].parameters_json"),
        ({"prompt": "x " * 1000, "prompt_tokens": 1}, "prompt_tokens"),  # a count the text cannot have
        ({"prompt": "x" * 1_000_001}, "prompt"),
        ({"task_type": "t" * 300}, "task_type"),
        ({"tools": [agent_pb2.ToolSpec(name=f"t{i}") for i in range(200)]}, "tools"),
        ({"prompt": "   "}, "prompt"),
        ({"messages": [agent_pb2.ChatMessage(role="robot", content="hi")]}, "messages[0].role"),
        ({"tools": [agent_pb2.ToolSpec(name="x", parameters_json="[1")]}, "tools[0].parameters_json"),
        # an agent's next step names its agent: without one, resume only put the request ahead of every new
        # request of its class (the priority policy's order), a queue jump for any caller
        ({"resume": True}, "resume"),
        # ids that read as other ids: the orchestrator's rule, for callers that reach the dispatcher directly
        ({"request_id": "r\u200b1"}, "request_id"), ({"agent_id": "cafe\u0301"}, "agent_id"),
        ({"model": "sim-7b\ufeff"}, "model"), ({"task_type": "chat\u2028x"}, "task_type"),
        # tools an OpenAI-compatible server refuses, or a model's call could not name alone: they were served
        ({"tools": [agent_pb2.ToolSpec(name="search"), agent_pb2.ToolSpec(name="search")]}, "tools[1].name"),
        ({"tools": [agent_pb2.ToolSpec(name="my tool")]}, "tools[0].name"),
        ({"tools": [agent_pb2.ToolSpec(name="a\x00b")]}, "tools[0].name"),
        ({"tools": [agent_pb2.ToolSpec(name="t" * 65)]}, "tools[0].name"),
        ({"tools": [agent_pb2.ToolSpec(name="")]}, "tools[0].name"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"type": 5}')]}, "tools[0].parameters_json"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"type": "objectt"}')]}, "tools[0].parameters_json"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"type": "string"}')]}, "tools[0].parameters_json"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"properties": [1]}')]}, "tools[0].parameters_json"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"properties": {"q": {"pattern": "("}}}')]},
         "tools[0].parameters_json"),
        ({"tools": [agent_pb2.ToolSpec(name="s", parameters_json='{"properties": {"a": ' * 400 + "{}" + "}}" * 400)]},
         "tools[0].parameters_json"),  # JSON that parses, a schema too deep for the check: named, not UNKNOWN
    ],
)
async def test_bad_requests_are_invalid_argument_naming_the_field(
    dispatcher: Harness, fields: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dispatcher.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field)


async def test_tools_a_model_server_takes_are_served(dispatcher: Harness) -> None:
    """The tool checks refuse what OpenAI-compatible servers refuse, and nothing they take."""
    tools = [agent_pb2.ToolSpec(name="search_docs", parameters_json=json.dumps({
                 "type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                 "required": ["query"]})),
             agent_pb2.ToolSpec(name="Calc-2", parameters_json=""),  # empty: any object ({})
             agent_pb2.ToolSpec(name="t" * 64, parameters_json='{"properties": {"n": {"type": ["integer", "null"]}}}')]
    chunks = await dispatcher.generate(tools=tools, max_tokens=3)
    assert chunks[-1].done.finish_reason in ("stop", "length", "tool_calls")
    message = await _refusal(dispatcher, tools=[agent_pb2.ToolSpec(name="a"), agent_pb2.ToolSpec(name="b"),
                                                agent_pb2.ToolSpec(name="a")])
    assert message.startswith("tools[2].name: expected a name no other tool has (tools[0] is also 'a')"), message
    message = await _refusal(dispatcher, tools=[agent_pb2.ToolSpec(name="s", parameters_json='{"type": 5}')])
    assert message.startswith("tools[0].parameters_json: expected a JSON Schema object (the tool's parameters, "
                              "type object): at $.type,"), message


async def test_the_tools_offered_and_the_messages_tool_calls_count_in_the_prompt() -> None:
    """A model server renders the tools offered (names, descriptions, schemas) and the messages' tool calls into
    the prompt, where they take KV as any prompt token does. They counted nowhere: a 2 MB tool description was
    served, and a step offering tools of 2,000 words reserved the KV of its 2-word prompt."""
    config = make_config(**{"limits.max_prompt_chars": 20_000})
    async for dispatcher in serve(DispatcherService(config)):
        described = [agent_pb2.ToolSpec(name="search", description="look it up " * 700)]  # 2,100 words
        done = (await dispatcher.generate(prompt="hi", tools=described, max_tokens=2))[-1].done
        assert done.usage.prompt_tokens >= 2100, done.usage
        call = agent_pb2.ToolCall(call_id="c1", name="search", arguments_json=json.dumps({"q": "word " * 900}))
        messages = [agent_pb2.ChatMessage(role="user", content="hi"),
                    agent_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                    agent_pb2.ChatMessage(role="tool", tool_call_id="c1", content="found")]
        done = (await dispatcher.generate(prompt="", messages=messages, max_tokens=2))[-1].done
        assert done.usage.prompt_tokens >= 900, done.usage
        message = await _refusal(dispatcher, prompt="hi", tools=[agent_pb2.ToolSpec(name="s", description="x" * 20_000)])
        assert message.startswith("tools: expected at most 20000 characters of prompt, tools included "
                                  "(limits.max_prompt_chars)"), message
        # the tools are named where the prompt alone fits; the prompt where it alone does not
        message = await _refusal(dispatcher, prompt="p" * 19_000, tools=[agent_pb2.ToolSpec(name="s",
                                                                                          description="x" * 2000)])
        assert message.startswith("tools: expected at most 20000 characters"), message
        message = await _refusal(dispatcher, prompt="p" * 21_000, tools=[agent_pb2.ToolSpec(name="s")])
        assert message.startswith("prompt: expected at most 20000 characters"), message


def _schema_of(chars: int) -> str:
    """A valid tool schema of ``chars`` characters: an object's, with a string property per 100 characters."""
    properties = {f"p{i}": {"type": "string", "description": "x" * 8} for i in range(chars // 100)}
    schema = json.dumps({"type": "object", "properties": properties, "description": ""})
    return schema[:-2] + "x" * (chars - len(schema)) + schema[-2:]


async def test_a_tool_schema_past_its_size_limit_is_refused_before_it_is_checked(
    dispatcher: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool's schema was checked against the JSON Schema metaschema whatever its size, at about 3 ms of the
    dispatcher's CPU a KiB: a valid schema of about 1 MB (under limits.max_prompt_chars) took seconds to check,
    and 128 tools sharing that megabyte cost the same. Each schema is bounded (limits.max_tool_schema_chars,
    64 KiB) and all of a request's together (limits.max_tool_schemas_chars, 256 KiB), refused unchecked."""
    from switchyard.dispatcher import processor

    checked: list[int] = []
    real = processor._schema_problem
    monkeypatch.setattr(processor, "_schema_problem", lambda text: checked.append(len(text)) or real(text))
    large = _schema_of(800_000)  # under limits.max_prompt_chars
    message = await _refusal(dispatcher, tools=[agent_pb2.ToolSpec(name="s", parameters_json="{}"),
                                                agent_pb2.ToolSpec(name="big", parameters_json=large)])
    assert message == (f"tools[1].parameters_json: expected a schema of at most 65536 characters "
                       f"(limits.max_tool_schema_chars) (got '{len(large)} chars')"), message
    just_over = _schema_of(65_537)
    message = await _refusal(dispatcher, tools=[agent_pb2.ToolSpec(name="s", parameters_json=just_over)])
    assert message.startswith("tools[0].parameters_json: expected a schema of at most 65536 characters"), message
    several = [agent_pb2.ToolSpec(name=f"t{i}", parameters_json=_schema_of(60_000)) for i in range(5)]
    total = sum(len(t.parameters_json) for t in several)
    message = await _refusal(dispatcher, tools=several)
    assert message == (f"tools: expected parameter schemas of at most 262144 characters in all "
                       f"(limits.max_tool_schemas_chars) (got '{total} chars')"), message
    assert checked == []  # none of them was checked
    # at the limits: checked (then refused for sim-7b's 4,096-token context window, which they overflow)
    at_limits = [_schema_of(65_536), _schema_of(65_536), _schema_of(65_536), _schema_of(65_534), "{}"]
    message = await _refusal(dispatcher, tools=[agent_pb2.ToolSpec(name=f"t{i}", parameters_json=schema)
                                                for i, schema in enumerate(at_limits)])
    assert message.startswith("prompt_tokens: expected fewer than the context window of sim-7b"), message
    assert checked == [65_536, 65_536, 65_536, 65_534, 2]
    real_size = [agent_pb2.ToolSpec(name="s", parameters_json=_schema_of(4096))]
    chunks = await dispatcher.generate(prompt="hi", tools=real_size, max_tokens=2)  # a real tool's size: served
    assert chunks[-1].done.finish_reason in ("stop", "length", "tool_calls")


async def _refusal(dispatcher: Harness, **fields: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dispatcher.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details() or ""


# --------------------------------------------------------------------------- the inference queue


async def test_full_inference_queue_refuses_at_once_naming_queue_and_capacity() -> None:
    config = make_config(**{**SLOW_DECODE, "queues.inference.capacity": 1})
    async for h in serve(one_at_a_time(config)):
        running = h.stub.Generate(agent_pb2.GenerateRequest(prompt=PROMPT, max_tokens=500))
        await running.read()  # first token: it was admitted and left the queue
        waiting = asyncio.create_task(h.generate(max_tokens=100))  # its KV does not fit beside it: waits
        await wait_until(lambda: h.service.scheduler.num_queued == 1, "the second request holds the only place")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generate(max_tokens=5, timeout=10)
        assert loop.time() - started < 5  # refused, not left to wait for the deadline
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "inference queue full: 1 items waiting (queues.inference.capacity)" in (err.value.details() or "")
        running.cancel()
        assert (await waiting)[-1].done.finish_reason == "stop"


async def test_request_that_waits_past_timeout_ms_is_deadline_exceeded_by_the_scheduler() -> None:
    config = make_config(**{**SLOW_DECODE, "queues.inference.timeout_ms": 100})
    async for h in serve(one_at_a_time(config)):
        running = h.stub.Generate(agent_pb2.GenerateRequest(prompt=PROMPT, max_tokens=500))
        await running.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generate(max_tokens=100)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "in the inference queue for admission to the engine" in (err.value.details() or "")
        assert "queues.inference.timeout_ms = 100" in (err.value.details() or "")
        running.cancel()
        await wait_until(lambda: h.service.scheduler.num_queued == 0 and h.service.scheduler.num_waiting == 0,
                         "queue empties")


async def test_request_larger_than_the_hbm_budget_is_invalid_argument() -> None:
    async for h in serve(one_at_a_time(make_config())):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generate(max_tokens=4000)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert details.startswith("max_tokens") and "HBM budget" in details


async def test_client_cancellation_frees_the_running_slot() -> None:
    config = make_config(**SLOW_DECODE)
    async for h in serve(one_at_a_time(config)):
        call = h.stub.Generate(agent_pb2.GenerateRequest(prompt=PROMPT, max_tokens=500))
        await call.read()
        assert h.service.scheduler.num_running == 1
        call.cancel()
        await wait_until(lambda: h.service.scheduler.num_running == 0, "the slot is freed")
        assert h.service.scheduler.capacity.reserved_bytes == 0  # type: ignore[attr-defined]
        from prometheus_client import REGISTRY

        # the gauges return to 0 when the work ends, however it ends (no later request needed)
        assert REGISTRY.get_sample_value("switchyard_running_sequences") == 0
        assert REGISTRY.get_sample_value("switchyard_running_agents", {"priority_class": "normal"}) == 0
        chunks = await h.generate(max_tokens=3)  # the freed KV serves the next request
        assert chunks[-1].done.usage.completion_tokens == 3


# --------------------------------------------------------------------------- graceful stop


async def test_graceful_stop_lets_an_in_flight_stream_complete() -> None:
    config = make_config(**{**FAST, "sim.decode_base_ms": 5.0})
    service = DispatcherService(config)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}")
    stopping: asyncio.Task[None] | None = None
    try:
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        call = stub.Generate(agent_pb2.GenerateRequest(prompt=PROMPT, max_tokens=30), timeout=30)
        chunks = [await call.read()]
        stopping = asyncio.create_task(srv.stop(10.0))
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert chunks[-1].done.finish_reason == "stop"
        tokens = [c for c in chunks if c.HasField("token")]
        assert chunks[-1].done.usage.completion_tokens == token_count(c.token for c in tokens) > 1
    finally:
        await channel.close()
        if stopping is None:
            await srv.stop(1.0)
        else:
            await stopping


# --------------------------------------------------------------------------- tracing


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch):
    """``traced(*modules)``: the spans those modules' ``tracer`` makes, in memory (an ``InMemorySpanExporter``, its
    provider shut down after the test)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def trace_modules(*modules: object) -> InMemorySpanExporter:
        for module in modules:
            monkeypatch.setattr(module, "tracer", provider.get_tracer(module.__name__))
        return exporter

    yield trace_modules
    provider.shutdown()


async def test_spans_link_each_batch_to_its_requests(traced) -> None:
    from switchyard.dispatcher import engine_loop, processor
    from switchyard.dispatcher.engines import sim

    exporter = traced(engine_loop, processor, sim)  # the loop makes the batch spans from the scheduler's report
    async for h in serve(DispatcherService(make_config(**{"batching.flush_interval_ms": 50}))):
        results = await asyncio.gather(*(h.generate(request_id=f"s{i}", max_tokens=4) for i in range(3)))
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "dispatcher.generate"]
    assert len(requests) == 3
    for span, chunks in zip(sorted(requests, key=lambda s: s.start_time), results):
        assert span.attributes["gen_ai.request.model"] == "sim-7b"
        assert span.attributes["gen_ai.usage.input_tokens"] == chunks[-1].done.usage.prompt_tokens
        assert span.attributes["gen_ai.usage.output_tokens"] == 4
    waits = [s for s in spans if s.name == "dispatcher.queue_wait"]
    assert {w.parent.span_id for w in waits} == {r.context.span_id for r in requests}
    batches = [s for s in spans if s.name == "dispatcher.batch"]
    linked = {link.context.span_id for b in batches for link in b.links}
    assert linked == {r.context.span_id for r in requests}
    assert sum(b.attributes["switchyard.batch_size"] for b in batches) == 3
    assert {b.attributes["switchyard.flush_reason"] for b in batches} <= {"idle", "step", "size", "interval"}
    assert any(s.name == "engine.prefill" for s in spans) and any(s.name == "engine.decode" for s in spans)


async def test_request_trace_shows_its_prefill_and_decode_phases(traced) -> None:
    from switchyard.dispatcher import processor

    exporter = traced(processor)
    async for h in serve(DispatcherService(make_config())):
        await h.generate(request_id="phases", max_tokens=5)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request, prefill, decode = spans["dispatcher.generate"], spans["inference.prefill"], spans["inference.decode"]
    assert prefill.parent.span_id == decode.parent.span_id == request.context.span_id
    assert request.start_time <= prefill.start_time <= prefill.end_time <= decode.start_time <= decode.end_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5


async def test_a_cancelled_requests_trace_shows_its_queue_wait_prefill_and_decode(traced) -> None:
    """The queue wait and engine phases of a request were written only with its done chunk: the trace of a task
    cancelled (or failed) mid-decode, the one an operator opens to see where its time went, had its
    ``dispatcher.generate`` with nothing under it. A request cancelled after its first tokens shows both phases
    up to its last token, and its wait."""
    from switchyard.dispatcher import processor

    exporter = traced(processor)
    async for h in serve(DispatcherService(make_config())):
        call = h.stub.Generate(agent_pb2.GenerateRequest(prompt=PROMPT, request_id="cut", max_tokens=4000),
                               timeout=30)
        tokens = 0
        async for chunk in call:
            tokens += chunk.HasField("token")
            if tokens == 3:
                call.cancel()
                break
        await wait_until(lambda: any(s.name == "dispatcher.generate" for s in exporter.get_finished_spans()),
                         "the cancelled request's span ended")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["dispatcher.generate"]
    assert request.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    for name in ("dispatcher.queue_wait", "inference.prefill", "inference.decode"):
        assert name in spans, f"{name} missing from the cancelled request's trace: {sorted(spans)}"
        assert spans[name].parent.span_id == request.context.span_id
    assert spans["inference.prefill"].end_time <= spans["inference.decode"].start_time
    assert 3 <= spans["inference.decode"].attributes["gen_ai.usage.output_tokens"] < 4000


def test_preemption_is_an_event_on_the_request_span() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from switchyard.dispatcher.request import Request

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("dispatcher.generate") as span:
        req = Request("p1", prompt="x", span=span)
        req.output_tokens.extend(["a", "b"])
        req.mark_preempted()
    (finished,) = exporter.get_finished_spans()
    (event,) = finished.events
    assert event.name == "preempted"
    assert event.attributes["switchyard.preemptions"] == 1 and event.attributes["switchyard.tokens_streamed"] == 2
    provider.shutdown()


async def test_batching_and_latency_metrics_are_recorded(dispatcher: Harness) -> None:
    from prometheus_client import REGISTRY

    from switchyard.dispatcher.double_buffer import FLUSH_REASON_LABELS as REASONS

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def per_class(name: str) -> dict[str, float]:
        return {c: sample(name, priority_class=c) for c in ("core", "normal", "batch")}

    before = {
        "batches": sample("switchyard_batch_size_count"),
        "flushes": sum(sample("switchyard_flushes_total", reason=r) for r in REASONS),
        "ttft": per_class("switchyard_ttft_seconds_count"),
        "itl": per_class("switchyard_inter_token_latency_seconds_count"),
        "tokens": sample("switchyard_generated_tokens_total"),
        "busy": sample("switchyard_engine_busy_seconds_total"),
    }
    await asyncio.gather(
        *(dispatcher.generate(request_id=f"m{i}", max_tokens=3, priority=agent_pb2.CORE) for i in range(2)),
        *(dispatcher.generate(request_id=f"b{i}", max_tokens=3, priority=agent_pb2.BATCH) for i in range(2)),
    )
    flushes = sum(sample("switchyard_flushes_total", reason=r) for r in REASONS)
    assert flushes - before["flushes"] == sample("switchyard_batch_size_count") - before["batches"] >= 1
    ttft, itl = per_class("switchyard_ttft_seconds_count"), per_class("switchyard_inter_token_latency_seconds_count")
    # Each latency lands in its own priority class: 2 core and 2 batch requests of 3 tokens.
    assert {c: ttft[c] - before["ttft"][c] for c in ttft} == {"core": 2, "normal": 0, "batch": 2}
    assert {c: itl[c] - before["itl"][c] for c in itl} == {"core": 4, "normal": 0, "batch": 4}
    assert sample("switchyard_generated_tokens_total") - before["tokens"] == 4 * 3
    assert sample("switchyard_engine_busy_seconds_total") > before["busy"]
    # The sim engine's roofline: batch / decode step time at flush.max_batch_size.
    assert sample("switchyard_engine_decode_bound_tokens_per_second") > 0
    assert sample("switchyard_running_sequences") == 0


# --------------------------------------------------------------------------- core work in a step in flight

LONG_STEP = {**FAST, "sim.decode_base_ms": 200.0}
"""A decode step of 200 ms (6.25 ms a layer): what happens during a step is unambiguous."""


class StepsOnly(SimEngine):
    """A step engine without the layer-boundary capability: the sim's steps and memory, nothing else."""

    supports_layer_preemption = False


async def core_during_a_step(
    service: DispatcherService, batch_tokens: int = 4, core_tokens: int = 2,
) -> tuple[list[tuple[str, int]], list[agent_pb2.GenerateChunk], list[agent_pb2.GenerateChunk]]:
    """A BATCH request decodes; right after its first token (its first decode step is then in flight) a CORE
    request arrives. Returns the token events as the client received them, ``(who, position)`` of each
    token, and the chunks of the core and of the batch request."""
    events: list[tuple[str, int]] = []

    async def stream(who: str, **fields: object) -> list[agent_pb2.GenerateChunk]:
        chunks = []
        request = agent_pb2.GenerateRequest(prompt=PROMPT, request_id=who, **fields)  # type: ignore[arg-type]
        async for chunk in h.stub.Generate(request, timeout=30):
            chunks.append(chunk)
            if chunk.HasField("token"):
                events.extend((who, chunk.token.index + i) for i in range(max(1, chunk.token.count)))
        return chunks

    async for h in serve(service):
        batch = asyncio.create_task(stream("batch", max_tokens=batch_tokens, priority=agent_pb2.BATCH))
        await wait_until(lambda: events, "the batch request's first token")
        core = await stream("core", max_tokens=core_tokens, priority=agent_pb2.CORE)
        batch_chunks = await batch
    return events, core, batch_chunks


def every_token(chunks: list[agent_pb2.GenerateChunk], expected: int) -> bool:
    tokens = [c.token for c in chunks if c.HasField("token")]
    return positions_follow_on(tokens) and token_count(tokens) == expected == chunks[-1].done.usage.completion_tokens


@pytest.mark.parametrize("mode", ["layer", "step"])
async def test_a_core_request_arriving_mid_step_gets_its_first_token_before_that_steps_tokens(mode: str) -> None:
    service = DispatcherService(make_config(**LONG_STEP, **{"scheduler.core_preemption": mode}))
    events, core, batch = await core_during_a_step(service)
    core_first, batch_second = events.index(("core", 0)), events.index(("batch", 1))
    if mode == "layer":
        # prefilled at the step's next layer boundary: out before the batch's token of that step
        assert core_first < batch_second
        assert core[-1].done.flush_reason == agent_pb2.PREEMPT
    else:
        assert core_first > batch_second  # at the step boundary, as iteration-level batching does
    assert every_token(batch, 4) and every_token(core, 2)
    assert batch[-1].done.preemptions == 0 and core[-1].done.finish_reason == "length"


async def test_a_core_request_that_does_not_fit_mid_step_waits_for_the_step_boundary() -> None:
    config = make_config(**LONG_STEP)
    async for h in serve(DispatcherService(config)):  # the prompt's length, as the dispatcher counts it
        counted = (await h.generate(max_tokens=1))[-1].done.usage.prompt_tokens
    # Room for the batch request (prompt + 3) or the core one (prompt + 2), not both.
    service = DispatcherService(make_config(**LONG_STEP, **kv_room_for(2 * counted + 4)))
    events, core, batch = await core_during_a_step(service, batch_tokens=3, core_tokens=2)
    # Not admitted mid-step (it does not fit, and nothing is preempted there); at the step boundary the
    # policy preempts the batch request for it (grace 50 ms), which then resumes.
    assert core[-1].done.flush_reason == agent_pb2.PREEMPT  # taken from the buffer mid-step, then refused
    assert events.index(("core", 0)) > events.index(("batch", 1))
    assert batch[-1].done.preemptions == 1
    assert every_token(batch, 3) and every_token(core, 2)


async def test_an_engine_without_the_capability_keeps_the_step_boundary() -> None:
    from switchyard.dispatcher.engines.base import StepEngine

    engine = StepsOnly(make_config(**LONG_STEP))
    assert isinstance(engine, StepEngine) and not engine.supports_layer_preemption
    service = DispatcherService(make_config(**LONG_STEP), engine=engine)
    assert service.scheduler.scheduler_config.core_preemption == "layer"
    events, core, batch = await core_during_a_step(service)
    assert events.index(("core", 0)) > events.index(("batch", 1))
    assert every_token(batch, 4) and every_token(core, 2)


class HeldChunkKV(SimKV):
    """The sim's KV, counting each request's frees (by request id)."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self.frees: collections.Counter[str] = collections.Counter()

    def free(self, req) -> None:  # type: ignore[no-untyped-def]
        self.frees[req.request_id] += 1
        super().free(req)


class HeldChunkSim(SimEngine):
    """The sim engine, its KV frees counted (:class:`HeldChunkKV`), whose decode-only steps wait for ``joined``
    (the running request decodes no further before request ``victim`` has arrived), and which holds the step that
    carries a later chunk of ``victim``'s prefill at its start (``held`` set) until ``release`` is set: core work
    arriving meanwhile finds that chunked prefill in flight, whatever the machine's speed. Then the step of its
    prefill from the start again (its resume) is held too (``resuming`` set) until ``resume`` is set."""

    def __init__(self, config: SwitchyardConfig, victim: str) -> None:
        super().__init__(config)
        self.kv = HeldChunkKV(self)
        self.victim = victim
        self.joined, self.held, self.release = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.resuming, self.resume = asyncio.Event(), asyncio.Event()

    async def execute_model(self, batch):  # type: ignore[no-untyped-def]
        computed = [req.num_computed_tokens for req, _ in batch.prefill if req.request_id == self.victim]
        if not batch.prefill:
            await self.joined.wait()
        elif computed and computed[0] > 0 and not self.held.is_set():
            self.held.set()
            await self.release.wait()
        elif computed and computed[0] == 0 and self.held.is_set() and not self.resuming.is_set():
            self.resuming.set()
            await self.resume.wait()
        return await super().execute_model(batch)


async def test_core_work_preempting_a_chunked_prefill_mid_step_frees_the_victims_kv_once_and_it_resumes() -> None:
    """A BATCH request's long prompt is prefilled in chunks beside a NORMAL request's decodes; a CORE request that
    does not fit arrives while one of its chunks runs. The step loop admits the core request at once and preempts
    the batch request mid-step (:meth:`SchedulerCore._preempt_mid_step`): out of the running set, its live KV (the
    chunk step's allocation, :meth:`SchedulerCore._kv_bytes`) held in the budget until that step ends; then freed
    once, and it waits again, resumes (recomputing its prefix), and finishes with all its tokens. At the end the
    budget holds nothing: no reservation, no leaving bytes."""
    long_prompt = PROMPT + " " + " ".join(["the context manager wraps the block"] * 40)
    settings = {**FAST, "sim.prefix_caching": False, "scheduler.max_step_prefill_tokens": 32,
                "scheduler.core_wait_before_preempt_ms": 0, "scheduler.core_preemption": "layer"}
    async for h in serve(DispatcherService(make_config(**settings))):  # the prompts' lengths, as counted here
        short = (await h.generate(max_tokens=1))[-1].done.usage.prompt_tokens
        long = (await h.generate(prompt=long_prompt, max_tokens=1))[-1].done.usage.prompt_tokens
    assert long > 4 * 32  # prefilled over several steps
    # Room for the normal request (short + 16) and the batch one (long + 6) with 8 tokens to spare: not for the
    # core request (short + 4) beside them, which fits once the batch request's unwritten blocks leave.
    config = make_config(**settings, **kv_room_for(short + 16 + long + 6 + 8))
    engine = HeldChunkSim(config, "victim")
    service = DispatcherService(config, engine=engine)
    budget = service.scheduler.kv_budget
    assert budget is not None
    per_token = budget.info.kv_bytes_per_token
    async for h in serve(service):
        normal_chunks: list[agent_pb2.GenerateChunk] = []

        async def normal() -> None:
            async for chunk in h.stub.Generate(agent_pb2.GenerateRequest(
                    prompt=PROMPT, request_id="normal", max_tokens=16, priority=agent_pb2.NORMAL), timeout=30):
                normal_chunks.append(chunk)

        normal_call = asyncio.create_task(normal())
        await wait_until(lambda: any(c.HasField("token") for c in normal_chunks), "the normal request's first token")
        victim_call = asyncio.create_task(h.generate(prompt=long_prompt, request_id="victim", max_tokens=6,
                                                     priority=agent_pb2.BATCH))
        await wait_until(lambda: service.scheduler.num_waiting == 1, "the batch request waiting")
        engine.joined.set()  # the normal request decodes on: the batch request is admitted beside it
        await wait_until(engine.held.is_set, "a later chunk of the batch request's prefill in flight")
        [victim] = [r for r in service.scheduler.running if r.request_id == "victim"]
        assert 0 < victim.num_computed_tokens < victim.prompt_tokens  # mid-prefill
        allocated = victim.step_kv_bytes
        assert allocated == (victim.num_computed_tokens + 32) * per_token  # this chunk's step allocation
        core_call = asyncio.create_task(h.generate(request_id="core", max_tokens=4, priority=agent_pb2.CORE))
        await wait_until(lambda: victim.status is RequestStatus.PREEMPTING, "the batch request preempted mid-step")
        assert service.scheduler.preempting == [victim] and [r.request_id for r in service.scheduler.running] == [
            "normal", "core"]
        assert victim.kv_leaving_bytes == allocated == budget.leaving_bytes  # held until the step ends
        assert engine.kv.frees["victim"] == 0  # not freed while the step in flight writes it
        engine.release.set()
        await wait_until(engine.resuming.is_set, "the batch request's prefill from the start again (its resume)")
        assert victim.status is RequestStatus.RUNNING and victim.preemptions == 1
        assert engine.kv.frees["victim"] == 1 and budget.leaving_bytes == 0 and victim.kv_leaving_bytes == 0
        engine.resume.set()
        core, batch = await core_call, await victim_call
        await normal_call
    assert every_token(core, 4) and every_token(batch, 6) and every_token(normal_chunks, 16)
    assert batch[-1].done.preemptions == 1 and core[-1].done.flush_reason == agent_pb2.PREEMPT
    assert engine.kv.frees == {"normal": 1, "core": 1, "victim": 2}  # the preemption's, then its end's
    assert (budget.reserved_bytes, budget.leaving_bytes, budget.restoring_bytes, budget.held_bytes) == (0, 0, 0, 0)
    assert victim.step_kv_bytes == 0 and victim.kv_reserved_bytes == 0


# --------------------------------------------------------------------------- stream engines


class EchoStreamEngine(StreamEngine):
    """A StreamEngine that streams the prompt's words back, counting concurrent streams."""

    model = "echo-1"
    stream_slots = None  # the dispatcher keeps the limit

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0
        self.closed = False

    async def generate(self, req):  # type: ignore[no-untyped-def]
        from switchyard.dispatcher.engines.base import Usage

        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            words = req.prompt.split()[: req.max_tokens]
            for word in words:
                await asyncio.sleep(0.002)
                yield word + " "
            yield Usage(prompt_tokens=len(req.prompt.split()), completion_tokens=len(words), model="echo-1-fallback")
        finally:
            self.active -= 1

    async def aclose(self) -> None:
        self.closed = True


class GatedEchoEngine(EchoStreamEngine):
    """:class:`EchoStreamEngine` whose streams of the requests ``gated`` picks wait for ``release`` before their
    first item."""

    def __init__(self, release: asyncio.Event, gated) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.release, self.gated = release, gated

    async def generate(self, req):  # type: ignore[no-untyped-def]
        if self.gated(req):
            await self.release.wait()
        async for item in super().generate(req):
            yield item


async def test_stream_engine_fans_out_past_batches_in_prefill_up_to_the_concurrency_limit() -> None:
    # workers counts batches in prefill, not streams: 2 workers still give the upstream 3 streams,
    # and the adaptive limit (held at 3 here) is what bounds the streams in flight.
    limit = {"min_limit": 3, "initial_limit": 3, "max_limit": 3}
    config = make_config(**{"queues.inference.max_batches_in_prefill": 2, "upstream.concurrency": limit})
    engine = EchoStreamEngine()
    service = DispatcherService(config, engine=engine)
    async for h in serve(service):
        results = await asyncio.gather(
            *(h.generate(request_id=f"e{i}", prompt="one two three four five", max_tokens=4) for i in range(8))
        )
    for chunks in results:
        assert "".join(c.token.text for c in chunks if c.HasField("token")) == "one two three four "
        done = chunks[-1].done
        assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 4
        assert done.finish_reason == "stop" and done.model == "echo-1-fallback"
    assert engine.peak == 3
    assert engine.closed


async def test_a_stream_aborted_in_the_turn_that_admitted_it_leaves_no_batch_in_prefill() -> None:
    """Each request here is aborted before its stream task's first step (the caller's cancel ready in the same
    turn of the event loop as the admission): a task cancelled before it starts never runs its body, and the
    batch it was counted in stayed "in prefill" for good. Two such leaks (``max_batches_in_prefill`` 2) and no
    arrival woke the loop again: every later request waited for a time slice or the idle tick."""
    from switchyard.dispatcher.request import Request, RequestStatus

    config = make_config(**{"queues.inference.max_batches_in_prefill": 2, "scheduler.time_slice_ms": 10_000})
    service = DispatcherService(config, engine=EchoStreamEngine())
    await service.start()
    try:
        loop = service.loop
        for i in range(3):
            req = Request(request_id=f"r{i}", prompt="one two three", prompt_tokens=3, max_tokens=3)
            loop.submit(req)
            while req.status is not RequestStatus.RUNNING:
                await asyncio.sleep(0)
            loop.abort(req)  # its stream task was created, and has not run a step
            await asyncio.sleep(0.01)
            assert req.status is RequestStatus.FINISHED_ABORTED and req.upstream_call is None
            assert loop._prefilling == {} and loop.slots.in_flight == 0
        late = Request(request_id="late", prompt="a b", prompt_tokens=2, max_tokens=2)
        loop.submit(late)

        async def finished() -> None:
            while not late.is_finished:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(finished(), 5.0)  # woken on arrival, not by a 10 s time slice or the idle tick
        assert late.status is RequestStatus.FINISHED_STOPPED
    finally:
        await service.stop()


async def test_a_normal_arrival_while_only_cores_reserved_slots_are_left_wakes_no_decision() -> None:
    """Six NORMAL streams fill what a limit of 8 lets the lower classes fill (2 held back for CORE): each NORMAL
    arrival after them woke the stream loop, whose decision refused it for CORE's reserve (a decision that
    admits nothing, one per arrival). A CORE arrival still starts at once in a reserved slot, with NORMAL work
    waiting ahead of it, and a NORMAL one starts when a stream ends."""
    from switchyard.common.priority import PriorityClass
    from switchyard.dispatcher.adaptive_limit import UPSTREAM_CORE_RESERVE
    from switchyard.dispatcher.request import Request, RequestStatus

    release = asyncio.Event()
    config = make_config(**{"scheduler.time_slice_ms": 10_000, "queues.inference.max_batches_in_prefill": 64,
                            "upstream.concurrency": {"min_limit": 8, "initial_limit": 8, "max_limit": 8,
                                                     "core_reserved_slots": 2}})
    held_ones = GatedEchoEngine(release, lambda req: req.request_id.startswith("held"))
    service = DispatcherService(config, engine=held_ones)
    await service.start()
    try:
        loop, refused = service.loop, service.scheduler.counters.admissions_refused

        def submit(rid: str, priority: PriorityClass = PriorityClass.NORMAL) -> Request:
            req = Request(request_id=rid, prompt="one two", prompt_tokens=2, max_tokens=2, priority=priority)
            loop.submit(req)
            return req

        async def running(req: Request) -> None:
            while req.status is not RequestStatus.RUNNING:
                await asyncio.sleep(0.002)

        held = [submit(f"held-{i}") for i in range(6)]
        await asyncio.wait_for(asyncio.gather(*(running(req) for req in held)), 5.0)
        before = refused.get(UPSTREAM_CORE_RESERVE, 0)
        waiting = []
        for i in range(5):  # one at a time: each arrival woke a decision that refused it
            waiting.append(submit(f"normal-{i}"))
            await asyncio.sleep(0.01)
        assert refused.get(UPSTREAM_CORE_RESERVE, 0) == before, "a decision was woken to refuse them"
        assert not any(req.reached_engine for req in waiting)
        core = submit("core", PriorityClass.CORE)
        await asyncio.wait_for(running(core), 5.0)  # a reserved slot, without a stream's end or the time slice
        release.set()  # the held streams end: the NORMAL ones start
        await asyncio.wait_for(asyncio.gather(*(running(req) for req in waiting)), 5.0)
    finally:
        await service.stop()


async def test_a_batch_in_prefill_counts_its_members_not_their_ids() -> None:
    """Two requests of one admission wave under the same caller's id (ids are the caller's: two Generate calls
    may share one): the first one's first token left the wave with no member "in prefill", its id taken for
    both, while the other had none yet. With ``max_batches_in_prefill`` 1 a third request was then sent
    ahead of that first token."""
    from switchyard.dispatcher.request import Request, RequestStatus

    release = asyncio.Event()
    config = make_config(**{"queues.inference.max_batches_in_prefill": 1, "scheduler.time_slice_ms": 10_000})
    stalls_one = GatedEchoEngine(release, lambda req: req.prompt.startswith("stall"))
    service = DispatcherService(config, engine=stalls_one)
    await service.start()
    try:
        loop = service.loop
        fast = Request(request_id="dup", prompt="one two", prompt_tokens=2, max_tokens=2)
        stalled = Request(request_id="dup", prompt="stall one", prompt_tokens=2, max_tokens=2)
        loop.submit(fast)
        loop.submit(stalled)  # the same wave: both admitted by the loop's next decision
        await wait_until(lambda: fast.is_finished, "the first request's stream")
        assert stalled.status is RequestStatus.RUNNING and not stalled.output_tokens
        late = Request(request_id="late", prompt="a b", prompt_tokens=2, max_tokens=2)
        loop.submit(late)
        await asyncio.sleep(0.05)
        assert not late.reached_engine  # the wave is still in prefill: its stalled member has no first token
        release.set()
        await wait_until(lambda: late.is_finished and stalled.is_finished, "the stalled and the late request")
        assert late.status is RequestStatus.FINISHED_STOPPED
    finally:
        await service.stop()


async def test_a_stream_whose_first_output_is_a_tool_call_records_its_ttft() -> None:
    """TTFT is the first token or tool call, on both loops: the stream loop timed only token texts, so a stream
    that answered with a tool call alone recorded no TTFT (a react_loop step's usual answer), and one with text
    after its tool call recorded that text's time as its TTFT."""
    from prometheus_client import REGISTRY

    from switchyard.dispatcher.engines.base import Usage
    from switchyard.dispatcher.request import ToolCall

    class CallsATool(EchoStreamEngine):
        async def generate(self, req):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.01)
            yield ToolCall("call-1", "search", "{}")
            await asyncio.sleep(0.2)
            if req.prompt.startswith("then"):
                yield "text "
            yield Usage(prompt_tokens=2, completion_tokens=3, finish_reason="tool_calls", model="echo-1")

    def ttfts() -> tuple[float, float]:
        labels = {"priority_class": "batch"}
        return (REGISTRY.get_sample_value("switchyard_ttft_seconds_count", labels) or 0.0,
                REGISTRY.get_sample_value("switchyard_ttft_seconds_sum", labels) or 0.0)

    service = DispatcherService(make_config(), engine=CallsATool())
    async for h in serve(service):
        for prompt in ("one two", "then two"):
            count, total = ttfts()
            chunks = await h.generate(request_id="t", prompt=prompt, priority=agent_pb2.BATCH)
            assert chunks[-1].done.finish_reason == "tool_calls"
            after, after_total = ttfts()
            assert after == count + 1
            assert after_total - total < 0.15  # the tool call's time, not the text's 0.2 s later


async def test_auto_flush_interval_learns_from_arrivals_and_batches() -> None:
    service = DispatcherService(make_config(**{"batching.flush_interval_ms": "auto"}))
    adaptive = service.scheduler.adaptive_flush
    assert adaptive is not None
    async for h in serve(service):
        results = await asyncio.gather(*(h.generate(request_id=f"a{i}", max_tokens=3) for i in range(5)))
    assert all(chunks[-1].done.usage.completion_tokens == 3 for chunks in results)
    assert adaptive.service_p95() > 0  # batch service times were reported


def test_a_stream_engines_admission_is_bounded_by_the_upstream_limit_alone(monkeypatch):
    """The openai engine's GPU is its model server's: a busy GPU on the dispatcher's host (NVML reads 100 %,
    vLLM beside it, say) must not hold admission below the adaptive limit, the one limit on the upstream."""
    from nvml_fixtures import FakeNvml

    from switchyard.common.config import SwitchyardConfig
    from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.scheduler import make_scheduler
    from switchyard.dispatcher.scheduler.capacity import ConcurrencyCapacity, StreamSlots

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpu=100, memory=100))

    class AlwaysBusy(EchoStreamEngine):
        """Its upstream's limit always taken (the openai engine's busy seconds): a compute score of about 100."""

        @property
        def busy_seconds(self) -> float:  # type: ignore[override]
            return time.monotonic()

    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1})
    limit = AdaptiveConcurrencyLimit(config.upstream.concurrency)
    sched = make_scheduler(config, AlwaysBusy(), capacity=ConcurrencyCapacity(StreamSlots(limit)))
    sched.schedule(time.monotonic())
    time.sleep(0.01)
    assert sched.monitor.read(time.monotonic()) > 50  # the engine's busy ratio: the score is high
    for i in range(4):
        sched.add_request(Request(request_id=f"r{i}", prompt="hi", prompt_tokens=1, max_tokens=8), 100.0)
    out = sched.schedule(time.monotonic())
    assert len(out.admitted) == min(4, limit.lower_class_ceiling) >= 2  # what the limit lets NORMAL fill
    assert not sched.counters.admissions_refused.get("compute_score")


async def test_a_sim_dispatchers_compute_score_comes_from_its_model_not_the_hosts_gpu(monkeypatch):
    """The sim engine models its own GPU; on a host with a real one, the sim dispatcher's compute score was NVML's
    reading of that GPU (88 when busy with other work), holding admission behind whatever the host ran. NVML
    reads a busy GPU here: the score stays the sim model's, and NVML is never read."""
    from nvml_fixtures import FakeNvml

    nvml = FakeNvml(gpu=100, memory=100)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    async for h in serve(DispatcherService(make_config(**{"scheduler.score_sample_interval_ms": 1}))):
        monitor = h.service.scheduler.monitor
        assert monitor.read(time.monotonic()) == 0  # idle: the busy host GPU is not the sim's
        chunks = await h.generate(max_tokens=4)
        assert chunks[-1].done.usage.completion_tokens == 4
        assert monitor.sample.source == "engine_model"  # what it read while it served: the sim's model
        assert monitor.gpu_available is False and nvml.reads == 0


def test_a_scheduler_for_a_stream_engine_never_preempts_a_stream():
    """An upstream's stream cannot be paused: a scheduler built for a stream engine preempts nothing, whoever drives
    it (the stream loop, a bench, a test). It was the stream loop that switched preemption off, after the scheduler
    was built: a scheduler driven without it sent a running stream back to the queue for CORE work (its stream went
    on, its tokens then went nowhere, and its next admission streamed it a second time)."""
    from switchyard.common.priority import PriorityClass
    from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit
    from switchyard.dispatcher.request import Request, RequestStatus
    from switchyard.dispatcher.scheduler import make_scheduler
    from switchyard.dispatcher.scheduler.capacity import ConcurrencyCapacity, StreamSlots

    config = SwitchyardConfig().with_overrides(**{
        "upstream.concurrency.initial_limit": 1, "upstream.concurrency.min_limit": 1,
        "upstream.concurrency.max_limit": 1, "upstream.concurrency.core_reserved_slots": 0})
    for policy in ("priority", "fair"):
        sched = make_scheduler(config, EchoStreamEngine(), policy=policy,
                               capacity=ConcurrencyCapacity(StreamSlots(AdaptiveConcurrencyLimit(config.upstream.concurrency))))
        assert not sched.preemption_enabled
        batch = Request(request_id="b", prompt="hi", prompt_tokens=1, max_tokens=8, priority=PriorityClass.BATCH,
                        arrival=0.0)
        sched.add_request(batch, 0.0)
        assert sched.schedule(0.0).admitted == [batch]
        core = Request(request_id="c", prompt="hi", prompt_tokens=1, max_tokens=8, priority=PriorityClass.CORE,
                       arrival=1.0)
        sched.add_request(core, 1.0)
        for out in (sched.schedule(1.0), sched.admit_core(1.0)):
            assert out.preempted == [] and out.admitted == []
        assert batch.status is RequestStatus.RUNNING and sched.preempting == [] and sched.waiting == [core]


def test_a_request_built_without_max_tokens_or_tenant_has_the_generate_defaults() -> None:
    """A Request built without max_tokens or tenant_id (a bench, a test) has what a Generate that sends neither
    is given (processor.to_request): the config's limits.default_max_tokens and the default tenant, read from
    their one source, not written again beside them."""
    from switchyard.dispatcher.processor import to_request
    from switchyard.dispatcher.request import Request

    served = to_request(agent_pb2.GenerateRequest(request_id="r", prompt="hello"), SwitchyardConfig(), "sim-7b")
    bare = Request("r", prompt="hello")
    assert (bare.max_tokens, bare.tenant_id) == (served.max_tokens, served.tenant_id)


def test_an_id_is_refused_by_one_rule_at_the_orchestrator_and_the_dispatcher() -> None:
    """Every edge that takes an id (RunTask's validation, the x-agent-id header, Generate, ToolWait, lookups)
    refuses it by one rule, common.untrusted.check_id: the same words for the same id."""
    from switchyard.common.errors import InvalidArgument
    from switchyard.dispatcher.processor import to_request
    from switchyard.orchestrator.validation import apply_edge_headers, validate

    config = SwitchyardConfig()
    long_id = "a" * (config.limits.max_id_chars + 1)
    refusals = []
    for refuse in (
        lambda: validate(agent_pb2.RunTaskRequest(payload="p", agent_id=long_id), config, "sim-7b"),
        lambda: apply_edge_headers(agent_pb2.RunTaskRequest(), [("x-agent-id", long_id)], config.limits.max_id_chars),
        lambda: to_request(agent_pb2.GenerateRequest(request_id="r", prompt="p", agent_id=long_id), config, "sim-7b"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            refuse()
        refusals.append(str(refused.value).removeprefix("x-agent-id header").removeprefix("agent_id"))
    assert refusals == [f": expected at most {config.limits.max_id_chars} characters (limits.max_id_chars) "
                        f"(got '{len(long_id)} chars')"] * 3
