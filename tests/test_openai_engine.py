"""The ``openai`` StreamEngine: Request in, token texts / ToolCalls / Usage out, against sim-openai."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, sim_openai, start_sim  # noqa: F401

from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2
from switchyard.common.config import load_config
from switchyard.common.errors import SwitchyardError
from switchyard.dispatcher.engines import StreamEngine, Usage, make_engine
from switchyard.dispatcher.engines.openai import OpenAIEngine, chat_messages
from switchyard.dispatcher.request import Message, Request, Tool, ToolCall
from switchyard.orchestrator.addresses import HIDDEN
from switchyard_harness.faults import Fault
from switchyard.common.channels import open_channel
from token_events import token_count

PROMPT = "<context>[1] Lists\nPython lists are mutable sequences.</context><question>Are lists mutable?</question>"


def engine_for(base_url: str, **gateway: object) -> OpenAIEngine:
    overrides = {"dispatcher.engine": "openai", "upstream.base_url": base_url,
                 "upstream.api_key_required": False,
                 "upstream.retry_backoff_initial_s": 0.01, "upstream.retry_backoff_max_s": 0.02}
    overrides.update({f"upstream.{k}": v for k, v in gateway.items()})
    engine = make_engine(load_config("config").with_overrides(**overrides))
    assert isinstance(engine, OpenAIEngine)
    return engine


async def run(engine: OpenAIEngine, req: Request) -> list:
    try:
        return [item async for item in engine.generate(req)]
    finally:
        await engine.aclose()


async def test_factory_builds_a_stream_engine(sim_openai):
    engine = engine_for(sim_openai.base_url)
    assert isinstance(engine, StreamEngine) and engine.model == "claude-sonnet-4-5"
    await engine.aclose()


async def test_generate_streams_token_texts_then_usage(sim_openai):
    items = await run(engine_for(sim_openai.base_url), Request("r1", prompt=PROMPT, prompt_tokens=11))
    texts, usage = items[:-1], items[-1]
    assert "".join(texts) == "Python lists are mutable sequences. [1]"
    assert isinstance(usage, Usage) and usage.finish_reason == "stop" and usage.model == "claude-sonnet-4-5"
    assert usage.completion_tokens == len(texts) and usage.prompt_tokens > 0
    assert sim_openai.state.requests[-1]["messages"] == [{"role": "user", "content": PROMPT}]


async def test_tools_in_and_tool_calls_out(sim_openai):
    tool = Tool("search_docs", "search", json.dumps({"type": "object", "properties": {"query": {"type": "string"}}}))
    req = Request("r2", messages=[Message("user", "what is a list")], tools=[tool], max_tokens=64)
    items = await run(engine_for(sim_openai.base_url), req)
    assert isinstance(items[0], ToolCall) and items[0].name == "search_docs"
    assert json.loads(items[0].arguments_json) == {"query": "what is a list"}
    assert items[-1].finish_reason == "tool_calls"
    body = sim_openai.state.requests[-1]
    assert body["tools"][0]["function"]["parameters"]["properties"] == {"query": {"type": "string"}}
    assert body["max_tokens"] == 64


def test_tool_results_restate_the_assistant_tool_calls():
    messages = chat_messages("", [
        Message("user", "q"), Message("assistant", ""),
        Message("tool", "result", tool_call_id="call_1", name="search_docs"),
    ])
    assert messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "search_docs", "arguments": "{}"}}]
    assert messages[2] == {"role": "tool", "content": "result", "tool_call_id": "call_1", "name": "search_docs"}


def test_assistant_tool_calls_go_upstream_with_their_arguments():
    call = ToolCall("call_7", "calculator", '{"expression": "2+2"}')
    messages = chat_messages("", [
        Message("user", "q"), Message("assistant", "", tool_calls=(call,)),
        Message("tool", "2+2 = 4", tool_call_id="call_7", name="calculator"),
    ])
    assert messages[1]["tool_calls"] == [{"id": "call_7", "type": "function",
                                          "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]
    assert messages[2]["tool_call_id"] == "call_7"


async def test_priority_class_forwarded_when_enabled(sim_openai):
    req = Request("r3", prompt="hi", priority=PriorityClass.CORE)
    await run(engine_for(sim_openai.base_url, forward_priority=True), req)
    assert sim_openai.state.requests[-1]["priority"] == 0


async def test_upstream_failure_raises_switchyard_error_with_status(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=503)}) as server:
        with pytest.raises(SwitchyardError) as caught:
            await run(engine_for(server.base_url, max_retries=0), Request("r5", prompt="hi"))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


async def test_fallback_model_reported_in_usage(clean_proxy_env):
    with start_sim(faults={"claude-sonnet-4-5": Fault(cut_after=0)}) as server:
        items = await run(engine_for(server.base_url, max_retries=0), Request("r6", prompt="hi"))
    assert items[-1].model == "gpt-4o-mini"


async def test_a_batch_fans_out_concurrently(sim_openai):
    engine = engine_for(sim_openai.base_url)
    reqs = [Request(f"b{i}", prompt=PROMPT) for i in range(8)]

    async def one(req: Request) -> list:
        return [item async for item in engine.generate(req)]

    try:
        results = await asyncio.gather(*(one(s) for s in reqs))
    finally:
        await engine.aclose()
    assert all("".join(r[:-1]) == "Python lists are mutable sequences. [1]" for r in results)


# --------------------------------------------------------------------------- through the dispatcher


async def generate_over_grpc(base_url: str, request: agent_pb2.GenerateRequest, **gateway: object) -> list:
    from switchyard.api import agent_pb2_grpc
    from switchyard.common.server import running
    from switchyard.dispatcher.service import DispatcherService

    engine = engine_for(base_url, **gateway)
    cfg = load_config("config")
    async with running([DispatcherService(cfg, engine=engine)], cfg.server) as server:
        async with open_channel(f"127.0.0.1:{server.port}") as channel:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            return [chunk async for chunk in stub.Generate(request)]


async def test_dispatcher_generate_streams_from_the_upstream(sim_openai):
    chunks = await generate_over_grpc(sim_openai.base_url, agent_pb2.GenerateRequest(
        request_id="g1", prompt=PROMPT, max_tokens=32, priority=agent_pb2.BATCH))
    tokens = [c.token for c in chunks if c.WhichOneof("chunk") == "token"]
    done = chunks[-1].done
    assert "".join(t.text for t in tokens) == "Python lists are mutable sequences. [1]"
    assert done.usage.completion_tokens == token_count(tokens) and done.finish_reason == "stop"
    assert sim_openai.state.requests[-1]["max_tokens"] == 32


async def test_each_upstream_call_is_a_child_of_its_request_span(sim_openai, monkeypatch):
    """The gateway's ``gateway.chat_completions`` span (the model server's URL, its status, what it streamed) is
    the child of the request's ``dispatcher.generate``, in the task's trace: the call ran in a task the stream loop
    started, in the loop's context, so each upstream call was a trace of its own that no task's trace showed. Its
    HTTP request carries that span as ``traceparent``: it carried no trace context, so a model server that traces
    (vLLM, TGI, SGLang) started traces of its own."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from switchyard.api import agent_pb2_grpc
    from switchyard.common.server import running
    from switchyard.dispatcher import processor
    from switchyard.dispatcher.service import DispatcherService

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(processor, "tracer", provider.get_tracer(processor.__name__))
    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": sim_openai.base_url, "upstream.api_key_required": False})
    engine = OpenAIEngine(cfg, tracer=provider.get_tracer("switchyard.gateway.client"))
    try:
        async with running([DispatcherService(cfg, engine=engine)], cfg.server) as server:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)


                async def one(i: int) -> None:
                    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
                        request_id=f"t{i}", prompt=PROMPT, max_tokens=8))]
                    assert chunks[-1].WhichOneof("chunk") == "done"

                await asyncio.gather(*(one(i) for i in range(3)))
        spans = exporter.get_finished_spans()
    finally:
        provider.shutdown()
    requests = {s.context.span_id: s for s in spans if s.name == "dispatcher.generate"}
    calls = [s for s in spans if s.name == "gateway.chat_completions"]
    assert len(requests) == 3 and len(calls) == 3
    assert sorted(c.attributes["switchyard.request_id"] for c in calls) == ["t0", "t1", "t2"]
    for call in calls:
        assert call.parent is not None, "an upstream call with no parent: a trace of its own"
        assert call.context.trace_id == requests[call.parent.span_id].context.trace_id
    assert len({call.parent.span_id for call in calls}) == 3  # each request's own call
    # the model server is handed each call's span as its parent (W3C traceparent), to join the trace if it traces
    sent = sorted(h["traceparent"] for h in sim_openai.state.headers[-3:])
    assert sent == sorted(f"00-{c.context.trace_id:032x}-{c.context.span_id:016x}-{c.context.trace_flags:02x}"
                          for c in calls)


async def test_dispatcher_generate_carries_the_upstream_status(clean_proxy_env):
    with start_sim(faults={"*": Fault(expired=True)}) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate_over_grpc(server.base_url, agent_pb2.GenerateRequest(request_id="g2", prompt="hi"))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "re-authenticate" in caught.value.details()


# --------------------------------------------------------------------------- RunTask end to end


async def run_task(base_url: str, request: agent_pb2.RunTaskRequest, index_dir=None, into: list | None = None,
                   metadata: tuple = (), orchestrator: dict | None = None, **gateway: object) -> list:
    """The task's events; ``into``, where given, holds those that came before an error the call raised;
    ``metadata``: the RunTask call's (x-tenant-id, say); ``orchestrator``: overrides of its config."""
    from switchyard.api import agent_pb2_grpc
    from switchyard.common.server import running
    from switchyard.dispatcher.service import DispatcherService
    from switchyard.orchestrator.service import OrchestratorService

    cfg = load_config("config")
    server = cfg.server
    async with contextlib.AsyncExitStack() as stack:
        disp = await stack.enter_async_context(running([DispatcherService(cfg, engine=engine_for(base_url, **gateway))],
                                                       server))
        # CPU work on the event loop: a spawn pool costs seconds per stack, and no test here is of the executor
        overrides = {"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}", "orchestrator.cpu_executor": "loop",
                     **(orchestrator or {})}
        if index_dir is not None:
            from switchyard.retrieval.service import RetrievalService

            cfg = cfg.with_overrides(**{"retrieval.index_dir": str(index_dir)})
            retrieval = await stack.enter_async_context(running([RetrievalService(cfg)], server))
            overrides["orchestrator.retrieval_addr"] = f"127.0.0.1:{retrieval.port}"
        orch = await stack.enter_async_context(running([OrchestratorService(cfg.with_overrides(**overrides))], server))
        events = [] if into is None else into
        async with open_channel(f"127.0.0.1:{orch.port}") as channel:
            async for event in agent_pb2_grpc.AgentServiceStub(channel).RunTask(request, metadata=metadata):
                events.append(event)
            return events


async def test_run_task_chat_on_the_openai_engine(sim_openai):
    events = await run_task(sim_openai.base_url, agent_pb2.RunTaskRequest(
        task_id="e2e-1", payload="summarize this doc", task_type="chat", priority=agent_pb2.CORE),
        forward_priority=True)
    tokens = [e.token for e in events if e.HasField("token")]
    final = events[-1].final
    assert tokens and final.output == "".join(t.text for t in tokens)
    assert final.usage.completion_tokens == token_count(tokens)
    body = sim_openai.state.requests[-1]
    assert body["model"] == "claude-sonnet-4-5" and body["priority"] == 0 and body["stream"] is True


async def test_the_final_event_says_why_the_model_stopped_and_a_cut_answer_is_named_cut(sim_openai):
    """The dispatcher's done chunk carried the upstream's finish_reason, and the task's final event dropped
    it: an answer the model finished and one cut at max_tokens (finish_reason length) read the same, to
    gRPC, HTTP and switchyard run alike."""
    from switchyard.client import HumanPrinter

    finished = await run_task(sim_openai.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"))
    cut = await run_task(sim_openai.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat", max_tokens=2))
    assert finished[-1].final.finish_reason == "stop" and cut[-1].final.finish_reason == "length"
    assert cut[-1].final.usage.completion_tokens == 2
    printed = {}
    for name, events in (("finished", finished), ("cut", cut)):
        out = io.StringIO()
        HumanPrinter(out)(events[-1])
        printed[name] = out.getvalue()
    assert "finish stop" in printed["finished"] and "cut short" not in printed["finished"]
    assert "finish length" in printed["cut"] and "output cut short" in printed["cut"]


async def test_an_answer_the_servers_content_filter_stopped_ends_content_filter_not_stop(clean_proxy_env):
    """Azure OpenAI ends an answer its output filter stopped with finish_reason content_filter (one of OpenAI's
    five): the dispatcher read every reason but stop, length and tool_calls as stop, so a withheld answer
    read as one the model finished, to gRPC, HTTP and switchyard run alike."""
    from switchyard.client import HumanPrinter
    from test_upstream_streams import FIXTURES, load, replay_server

    async with replay_server(load(FIXTURES / "azure_openai_content_filter.sse")) as (base, _):
        chunks = await generate_over_grpc(base, agent_pb2.GenerateRequest(request_id="cf:0", prompt=PROMPT),
                                          fallback_model="", max_retries=0)
        events = await run_task(base, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                                fallback_model="", max_retries=0)
    assert chunks[-1].done.finish_reason == "content_filter"
    final = events[-1].final
    assert (final.output, final.finish_reason) == ("Here is how", "content_filter")
    out = io.StringIO()
    HumanPrinter(out)(events[-1])
    assert "finish content_filter" in out.getvalue() and "content filter withheld the rest" in out.getvalue()


async def test_run_task_upstream_failure_reaches_the_caller_as_its_status(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=404)}) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_task(server.base_url, agent_pb2.RunTaskRequest(
                payload="hi", task_type="chat", model="claude-sonnet-4.5"), fallback_model="")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "claude-sonnet-4-5" in caught.value.details()


async def test_a_task_whose_model_asks_for_a_wait_past_its_time_limit_fails_naming_that_limit(clean_proxy_env):
    """A model server answering 429 Retry-After 10 to a task with 3 s of time limit: the task failed with
    "... longer than the 2.9 s left before the call's deadline", which did not say that the task type's time limit
    set that deadline (the task's own out-of-time errors name it). The refusal names it now."""
    limits = {"chat": 3, "rag_answer": 3, "react_loop": 3}
    with start_sim(faults={"*": Fault(status=429, retry_after=10)}) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_task(server.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                           orchestrator={"orchestrator.task_time_limit_s": limits}, fallback_model="",
                           retry_after_max_s=30)
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "asked to wait 10.0 s" in details, details
    assert "before the call's deadline (set by its caller, from orchestrator.task_time_limit_s.chat = 3)" in details


@pytest.mark.slow
async def test_run_task_react_loop_tool_calls_through_the_openai_engine(sim_openai, pydoc_index_dir):
    question = "What does the with statement do, and what is 12*(3+4)?"
    events = await run_task(sim_openai.base_url, agent_pb2.RunTaskRequest(payload=question, task_type="react_loop"),
                            index_dir=pydoc_index_dir)
    calls = [e.tool_call.name for e in events if e.HasField("tool_call")]
    results = {e.tool_result.name: e.tool_result for e in events if e.HasField("tool_result")}
    assert set(calls) >= {"search_docs", "calculator"} and "= 84" in results["calculator"].content
    assert "84" in events[-1].final.output
    tool_turns = [m for body in sim_openai.state.requests for m in body["messages"] if m["role"] == "tool"]
    assert tool_turns and all(m["tool_call_id"] for m in tool_turns)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [3, 1])
async def test_a_react_step_cut_inside_its_tool_call_fails_naming_max_tokens_and_the_call_is_not_run(
        sim_openai, pydoc_index_dir, max_tokens):
    """A server cut at max_tokens sends the tool call it had generated so far, its arguments incomplete, with
    finish_reason length. The call is not run (half an argument is another action: a query cut to its first word),
    and the task fails INVALID_ARGUMENT naming max_tokens rather than ending "finished" with an empty answer.
    At 1 token the call has its name and no argument yet."""
    events: list = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_task(sim_openai.base_url, agent_pb2.RunTaskRequest(
            payload="What is 12*(3+4)?", task_type="react_loop", max_tokens=max_tokens), index_dir=pydoc_index_dir,
            into=events)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert details.startswith("max_tokens: expected room for a react_loop step's whole tool call or answer"), details
    assert "call of search_docs was cut, its arguments incomplete, and not run" in details and \
        f"(got {max_tokens})" in details, details
    assert not [e for e in events if e.HasField("tool_call") or e.HasField("tool_result") or e.HasField("final")]
    assert len(sim_openai.state.requests) == 1  # no second step


def test_unusable_key_stops_the_engine_at_start_naming_the_variable(monkeypatch):
    from switchyard.gateway.errors import GatewayError

    monkeypatch.setenv("SWITCHYARD_TEST_START_KEY", "sk-test-0123456789\n")
    with pytest.raises(GatewayError) as caught:
        engine_for("http://127.0.0.1:9/v1", api_key_env="SWITCHYARD_TEST_START_KEY", api_key_required=True)
    message = str(caught.value)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "SWITCHYARD_TEST_START_KEY" in message and "whitespace" in message
    assert "sk-test-0123456789" not in message
    monkeypatch.delenv("SWITCHYARD_TEST_START_KEY")
    with pytest.raises(GatewayError, match="SWITCHYARD_TEST_START_KEY"):
        engine_for("http://127.0.0.1:9/v1", api_key_env="SWITCHYARD_TEST_START_KEY", api_key_required=True)


def address_of(base_url: str) -> str:
    """``host:port`` of a base URL."""
    return base_url.split("://", 1)[1].split("/", 1)[0]


@pytest.mark.parametrize(("fault", "says"), [
    (Fault(no_finish=True), "before any finish_reason and without 'data: [DONE]'"),
    (Fault(cut_after=2), "closed mid-response"),
])
async def test_an_upstream_failure_names_the_upstream_not_the_dispatcher(clean_proxy_env, fault, says):
    """UNAVAILABLE relayed by a healthy dispatcher names the upstream model as the hop that failed,
    never "dispatcher service unavailable ... is it running"."""
    with start_sim(faults={"*": fault}) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_task(server.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                           max_retries=0, fallback_model="")
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # the tenant reads both hops named, their addresses hidden (orchestrator.show_addresses_to_callers)
    assert details.startswith(f"upstream model (via dispatcher at {HIDDEN}):") and says in details, details
    assert address_of(server.base_url) not in details, details
    assert "is it running" not in details
    origin = dict(caught.value.trailing_metadata())["switchyard-error-origin"]
    assert origin == "upstream model"


async def test_a_stream_ending_after_its_finish_reason_without_done_is_served(clean_proxy_env):
    """transformers serve's ending (sim-openai ``no_done``): the task finishes with every token."""
    with start_sim(faults={"*": Fault(no_done=True)}) as server:
        events = await run_task(server.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                                max_retries=0, fallback_model="")
    tokens = [e.token for e in events if e.HasField("token")]
    assert tokens and events[-1].final.output == "".join(t.text for t in tokens)


async def test_a_dead_proxy_is_named_as_the_proxy(clean_proxy_env, monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with start_sim() as server:
        monkeypatch.setenv("HTTP_PROXY", dead)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_task(server.base_url, agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                           max_retries=0, fallback_model="")
    details = caught.value.details()
    assert details.startswith(f"proxy (via dispatcher at {HIDDEN}): local proxy failed: HTTP_PROXY=the proxy "
                              "did not answer"), details  # the tenant reads the proxy named, not where it is
    assert dead not in details and address_of(server.base_url) not in details, details


async def test_a_generate_naming_no_model_is_served_by_the_fallback_when_the_default_is_not_served(clean_proxy_env):
    """Once the dispatcher resolved the model a Generate naming none is served, the gateway saw a named model and
    refused to fall back: the default missing upstream failed NOT_FOUND where the fallback serves. A model the
    caller names is still never replaced by another."""
    with start_sim(models=["gpt-4o-mini"]) as server:  # the default, claude-sonnet-4-5, is not served
        chunks = await generate_over_grpc(server.base_url, agent_pb2.GenerateRequest(
            request_id="unnamed", prompt=PROMPT, max_tokens=4))
        assert chunks[-1].done.model == "gpt-4o-mini"
        with pytest.raises(grpc.aio.AioRpcError) as named:
            await generate_over_grpc(server.base_url, agent_pb2.GenerateRequest(
                request_id="named", prompt=PROMPT, max_tokens=4, model="claude-sonnet-4-5"))
    assert named.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_engine_busy_ratio_and_seconds_are_exported_in_front_of_a_model_server(clean_proxy_env):
    """In front of a model server the busy ratio is the share of the upstream's concurrency limit the streams
    held (docs/engines.md); the compute score read it, but the stream loop never wrote
    ``switchyard_engine_busy_ratio`` nor ``switchyard_engine_busy_seconds_total``: both stayed 0 under load
    (the locust watch file, the Grafana dashboard and the roofline efficiency read them)."""
    from prometheus_client import REGISTRY

    from switchyard.dispatcher import metrics

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    metrics.ENGINE_BUSY_RATIO.set(0)
    before = sample("switchyard_engine_busy_seconds_total")
    with start_sim(faults={"*": Fault(slow_ms=250)}) as server:  # a stream of ~10 items: ~2.5 s, > a window (1 s)
        chunks = await generate_over_grpc(server.base_url, agent_pb2.GenerateRequest(
            request_id="busy1", prompt=PROMPT, max_tokens=32))
    assert chunks[-1].WhichOneof("chunk") == "done"
    # one stream under a limit of 4 (initial_limit) for about a second: a quarter of it busy
    assert sample("switchyard_engine_busy_seconds_total") - before > 0.1
    assert 0 < sample("switchyard_engine_busy_ratio") <= 1


async def test_a_turn_answered_with_a_tool_call_counts_its_time_to_first_token(sim_openai):
    """``switchyard_ttft_seconds`` is the time to the first token or tool call (the step loop's measure); the
    stream loop observed it on a token text only, so a react_loop turn that answers with a tool call (no text)
    was never counted: every tool-call turn was missing from the TTFT quantiles and the SLO alerts."""
    from prometheus_client import REGISTRY

    def ttft_count(cls: str) -> float:
        return REGISTRY.get_sample_value("switchyard_ttft_seconds_count", {"priority_class": cls}) or 0.0

    tool = agent_pb2.ToolSpec(name="search_docs", description="search",
                              parameters_json=json.dumps({"type": "object",
                                                          "properties": {"query": {"type": "string"}}}))
    before = ttft_count("core")
    chunks = await generate_over_grpc(sim_openai.base_url, agent_pb2.GenerateRequest(
        request_id="tool-ttft:0", messages=[agent_pb2.ChatMessage(role="user", content="what is a list")],
        tools=[tool], max_tokens=64, priority=agent_pb2.CORE))
    kinds = [c.WhichOneof("chunk") for c in chunks]
    assert "tool_call" in kinds and "token" not in kinds, kinds
    assert ttft_count("core") - before == 1


async def test_generated_tokens_follow_the_servers_usage_where_a_chunk_carries_several():
    """A server may send several tokens in one chunk (speculative decoding, vLLM's stream interval):
    ``switchyard_generated_tokens`` counted one per chunk; the stream's usage says how many there were."""
    from prometheus_client import REGISTRY

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        body = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else []}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    stream = (chunk({"role": "assistant", "content": "two words"}) + chunk({"content": " and two"})
              + chunk({"content": " more"}, finish="stop")
              + chunk({}, usage={"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}) + b"data: [DONE]\n\n")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + stream)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    before = REGISTRY.get_sample_value("switchyard_generated_tokens_total") or 0.0
    try:
        chunks = await generate_over_grpc(
            f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1",
            agent_pb2.GenerateRequest(request_id="packed:0", prompt=PROMPT, max_tokens=16, model="m"),
            fallback_model="", default_model="m")
    finally:
        server.close()
    assert chunks[-1].done.usage.completion_tokens == 6
    assert REGISTRY.get_sample_value("switchyard_generated_tokens_total") - before == 6


def recorded_stream(*data: dict) -> "object":
    """A replayable 200 stream of ``data`` payloads then ``data: [DONE]`` (test_upstream_streams' server)."""
    from test_upstream_streams import Recorded

    body = b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in data) + b"data: [DONE]\n\n"
    return Recorded("inline", {"status": "HTTP/1.1 200 OK", "content-type": "text/event-stream",
                               "framing": "chunked"}, body)


async def test_an_empty_answer_sent_as_the_usage_chunk_alone_finishes_stop_with_no_output(clean_proxy_env):
    """A server that generated nothing may send no choice at all, only the usage chunk (completion_tokens 0):
    an empty answer, as legal as a finish chunk with no content. It failed INTERNAL "reading choices"."""
    from test_upstream_streams import replay_server

    usage_only = recorded_stream({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                                  "usage": {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}})
    async with replay_server(usage_only) as (base, _):
        chunks = await generate_over_grpc(base, agent_pb2.GenerateRequest(request_id="empty:0", prompt="hi", model="m"),
                                          fallback_model="", default_model="m", max_retries=0)
    assert [c.WhichOneof("chunk") for c in chunks] == ["done"]
    done = chunks[-1].done
    assert (done.finish_reason, done.usage.prompt_tokens, done.usage.completion_tokens) == ("stop", 7, 0)


@pytest.mark.parametrize("fixture, output, finish", [
    ("vllm_reasoning", "2 + 2 = 4.", "stop"),  # reasoning_content, then the answer
    ("ollama_reasoning", "Hello!", "stop"),  # Ollama's 'reasoning'
    ("vllm_reasoning_length", "", "length"),  # max_tokens spent thinking: no answer, and it says so
])
async def test_a_reasoning_models_answer_is_its_content_and_its_thinking_counts_as_output(clean_proxy_env, fixture,
                                                                                          output, finish):
    """vLLM with a reasoning parser streams the thinking as delta.reasoning_content (Ollama as delta.reasoning):
    the gateway dropped it, so a model that spent its budget thinking answered an empty output, 'stop'-like, with
    no token counted. The answer is the content; the thinking is output tokens (TTFT, the server's usage), not
    streamed as answer text."""
    from test_upstream_streams import FIXTURES, load, replay_server

    recorded = load(FIXTURES / f"{fixture}.sse")
    async with replay_server(recorded) as (base, _):
        events = await run_task(base, agent_pb2.RunTaskRequest(payload="what is 2+2?", task_type="chat"),
                                fallback_model="", max_retries=0)
    final = events[-1].final
    tokens = [e.token for e in events if e.HasField("token")]
    assert (final.output, "".join(t.text for t in tokens), final.finish_reason) == (output, output, finish)
    assert final.usage.completion_tokens == int(recorded.meta["expect-usage"].split()[1])


@pytest.mark.parametrize("fixture", ["vllm_tool_calls", "ollama_tool_calls", "reasoning_without_usage"])
async def test_without_the_servers_usage_the_completion_tokens_are_estimated_from_what_streamed(clean_proxy_env,
                                                                                              fixture):
    """A server that sends no usage (vLLM without include_usage, Ollama's tool calls): the completion tokens read 0
    for an answer of tool calls only (and for one of reasoning, which was dropped). They are estimated: the word
    pieces of each streamed piece of text, answer or reasoning (" plus two." in one chunk counts 2), and of each
    tool call."""
    from switchyard.dispatcher.request import word_pieces
    from test_upstream_streams import FIXTURES, load, replay_server

    if fixture == "reasoning_without_usage":
        def piece(delta: dict, finish: str | None = None) -> dict:
            return {"id": "c", "object": "chat.completion.chunk", "model": "m",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        recorded = recorded_stream(piece({"role": "assistant", "content": ""}), piece({"reasoning_content": "Two"}),
                                   piece({"reasoning_content": " plus two."}), piece({"content": "4"}),
                                   piece({}, "stop"))
    else:
        recorded = load(FIXTURES / f"{fixture}.sse")
    async with replay_server(recorded) as (base, _):
        chunks = await generate_over_grpc(base, agent_pb2.GenerateRequest(request_id="est:0", prompt=PROMPT, model="m"),
                                          fallback_model="", default_model="m", max_retries=0)
    calls = [c.tool_call for c in chunks if c.WhichOneof("chunk") == "tool_call"]
    expected = 4 if not calls else sum(len(word_pieces(f"{c.name} {c.arguments_json}")) for c in calls)
    assert chunks[-1].done.usage.completion_tokens == expected > 0


@pytest.mark.parametrize("content_type", ["application/json", "text/event-stream"])
async def test_a_whole_answer_without_usage_counts_the_word_pieces_of_its_text(clean_proxy_env, content_type):
    """An answer that came whole (a chat completion answering the stream request) is one piece of text: counted
    one per piece, a 9-word answer without the server's usage read as 1 completion token. Labelled
    ``text/event-stream`` with no ``data:`` line (the label the stream request asked for), it failed UNAVAILABLE
    as a stream cut after 0 chunks, and was sent again; the body decides, not its label."""
    from switchyard.dispatcher.request import word_pieces
    from test_upstream_streams import Recorded, replay_server

    text = "The with statement wraps a block in a context manager."
    body = {"id": "c", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    whole = Recorded("inline", {"status": "HTTP/1.1 200 OK", "content-type": content_type, "framing": "close"},
                     json.dumps(body).encode())
    async with replay_server(whole) as (base, _):
        chunks = await generate_over_grpc(base, agent_pb2.GenerateRequest(request_id="whole:0", prompt=PROMPT, model="m"),
                                          fallback_model="", default_model="m", max_retries=0)
    assert "".join(c.token.text for c in chunks if c.WhichOneof("chunk") == "token") == text
    assert chunks[-1].done.usage.completion_tokens == len(word_pieces(text)) > 1


async def test_sim_openai_stands_in_for_a_reasoning_server_and_its_finish_reasons(clean_proxy_env):
    """``--fault reasoning=N`` and ``--fault finish=WORD`` let the fake upstream send what vLLM does with a reasoning
    parser, and its abort: the thinking never reaches the answer but counts; an abort is an error naming it."""
    request = agent_pb2.GenerateRequest(request_id="sim:0", prompt=PROMPT, max_tokens=64)
    with start_sim() as server:
        plain = await generate_over_grpc(server.base_url, request)
    with start_sim(faults={"*": Fault(reasoning=3, finish="eos_token")}) as server:
        thought = await generate_over_grpc(server.base_url, request)
    texts = [[c.token.text for c in chunks if c.WhichOneof("chunk") == "token"] for chunks in (plain, thought)]
    assert texts[0] == texts[1] and "thinking" not in "".join(texts[1])
    assert thought[-1].done.usage.completion_tokens == plain[-1].done.usage.completion_tokens + 3
    assert thought[-1].done.finish_reason == "stop"
    with start_sim(faults={"*": Fault(finish="abort")}) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate_over_grpc(server.base_url, request, max_retries=0, fallback_model="")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "finish_reason 'abort'" in caught.value.details()


async def test_a_request_cancelled_mid_stream_is_answered_with_the_compute_score_charged(clean_proxy_env, monkeypatch):
    """The upstream's usage never comes for a stream cut short: the answer to the cancel carries the compute score
    the dispatcher charged and the tokens that streamed, finish_reason cancelled (a cancelled task counts it)."""
    from switchyard.common.server import running
    from switchyard.dispatcher.service import DispatcherService
    from switchyard.orchestrator import generate_stream
    from switchyard.orchestrator.generate_stream import GenerateStreamClient

    monkeypatch.setattr(generate_stream, "CANCEL_ANSWER_WAIT_S", 60.0)  # behaviour, not speed
    with start_sim(faults={"*": Fault(slow_ms=50)}) as server:
        engine = engine_for(server.base_url)
        cfg = load_config("config")
        async with running([DispatcherService(cfg, engine=engine)], cfg.server) as disp:
            async with open_channel(f"127.0.0.1:{disp.port}") as channel:
                client = GenerateStreamClient(channel)
                answers: list[agent_pb2.GenerateDone] = []
                first = asyncio.Event()

                async def generate() -> None:
                    request = agent_pb2.GenerateRequest(request_id="cut:0", prompt=PROMPT, max_tokens=64)
                    async for chunk in client.generate(request, 30, on_consumed=answers.append):
                        if chunk.HasField("token"):
                            first.set()

                task = asyncio.create_task(generate())
                await asyncio.wait_for(first.wait(), 30)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await client.close()
    [done] = answers
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens >= 1
    assert done.compute_score_used > 0
