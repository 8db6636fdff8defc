"""One task, three processes, one trace: spans exported over OTLP/gRPC to an in-process
receiver, linked parent to child across process boundaries; metrics scraped after it."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from otlp_receiver import OtlpReceiver, ReceivedSpan
from stack_fixtures import UpStack
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.process_metrics import find_cpu_stat
from switchyard.dispatcher.double_buffer import FLUSH_REASON_LABELS
from switchyard.common.channels import open_channel

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]

SERVICES = ("orchestrator", "retrieval", "dispatcher")
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT
@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(pydoc_index_dir, receiver):
    """`switchyard up` on the session's default index (a copy, not an index of its own to embed and export)."""
    s = UpStack(pydoc_index_dir, env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export every 100 ms instead of 5 s
    })
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


# --------------------------------------------------------------------------- helpers

TRACE_ID, CALLER_SPAN_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


async def run_task(stack: UpStack, request: agent_pb2.RunTaskRequest) -> list[agent_pb2.TaskEvent]:
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
    async with open_channel(stack.address("orchestrator")) as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).RunTask(
            request, timeout=120, metadata=(("traceparent", traceparent),)
        )
        return [event async for event in call]


def one(spans: list[ReceivedSpan], name: str, service: str, kind: int | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service and (kind is None or s.kind == kind)]
    assert len(found) == 1, f"expected one {service}:{name}, got {len(found)}: {sorted((s.service, s.name) for s in spans)}"
    return found[0]


def ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """``span``'s parent, grandparent, ... within ``spans`` (stops at a parent not received)."""
    by_id = {s.span_id: s for s in spans}
    chain, parent = [], by_id.get(span.parent_span_id)
    while parent is not None:
        chain.append(parent)
        parent = by_id.get(parent.parent_span_id)
    return chain


def assert_under(child: ReceivedSpan, parent: ReceivedSpan, spans: list[ReceivedSpan]) -> None:
    names = [f"{s.service}:{s.name}" for s in ancestors(child, spans)]
    assert parent in ancestors(child, spans), f"{child.service}:{child.name} is not under {parent.service}:{parent.name}; ancestors {names}"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# --------------------------------------------------------------------------- tests


def _task_complete(spans: list[ReceivedSpan]) -> bool:
    names = {(s.service, s.name) for s in spans if s.trace_id == TRACE_ID}
    return {
        ("orchestrator", "agent.AgentService/RunTask"),
        ("retrieval", "retrieval.search"),
        ("dispatcher", "dispatcher.generate"),
    } <= names and any(s.name == "dispatcher.batch" for s in spans) and any(s.name == "engine.decode" for s in spans) \
        and sum(s.name == "dispatcher.generate" and s.trace_id == TRACE_ID for s in spans) == 2  # prefill + answer


async def test_one_task_is_one_trace_across_three_processes(stack, receiver):
    events = await run_task(stack, agent_pb2.RunTaskRequest(task_id="trace-001", payload="How does the with statement work?"))
    final = events[-1].final
    assert events[-1].HasField("final") and final.task_id == "trace-001"
    assert final.trace_id == TRACE_ID  # the caller's traceparent is the task's trace
    assert events[0].accepted.trace_id == TRACE_ID

    spans = receiver.wait_for(_task_complete, timeout_s=60)
    task = [s for s in spans if s.trace_id == TRACE_ID]
    assert {s.service for s in task} == set(SERVICES)

    # The orchestrator's server span is the child of the caller's span.
    run = one(task, "agent.AgentService/RunTask", "orchestrator", SERVER)
    assert run.parent_span_id == CALLER_SPAN_ID

    # A span per orchestrator stage, all under the RunTask span.
    for stage in ("orchestration.queue_wait", "retrieve", "render_prompt", "infer"):
        spans_named = [s for s in task if s.name == stage and s.service == "orchestrator"]
        assert spans_named, f"no orchestrator span {stage}"
        for span in spans_named:
            assert_under(span, run, task)

    # orchestrator retrieve -> gRPC client span -> retrieval server span (another process) -> its stages
    retrieve = one(task, "retrieve", "orchestrator")
    retrieve_client = one(task, "agent.RetrievalService/Retrieve", "orchestrator", CLIENT)
    assert_under(retrieve_client, retrieve, task)
    retrieval_server = one(task, "agent.RetrievalService/Retrieve", "retrieval", SERVER)
    assert retrieval_server.parent_span_id == retrieve_client.span_id
    for stage in ("retrieval.queue_wait", "retrieval.embed", "retrieval.search"):
        assert_under(one(task, stage, "retrieval"), retrieval_server, task)

    # Each service's queue wait names its queue as the switchyard_queue_wait_seconds label does.
    waits = {(s.service, s.attributes.get("switchyard.queue")) for s in task if s.name.endswith("queue_wait")}
    assert waits == {("orchestrator", "orchestration"), ("retrieval", "retrieval"), ("dispatcher", "inference")}, waits

    # orchestrator infer -> the request's SERVER span in the dispatcher (another process; the request
    # travelled over GenerateStream with the infer span's traceparent) -> its stages
    # (rag_answer's early prefill, sent while retrieval ran, is a request of its own under a prefill span)
    infer = one(task, "infer", "orchestrator")
    requests = [s for s in task if s.name == "dispatcher.generate" and s.service == "dispatcher" and s.kind == SERVER]
    request_span = next(s for s in requests if s.parent_span_id == infer.span_id)
    prefill = one(task, "prefill", "orchestrator")
    assert_under(prefill, run, task)
    assert [s.parent_span_id for s in requests if s is not request_span] == [prefill.span_id]

    def under_request(name: str) -> ReceivedSpan:
        return one([s for s in task if request_span in ancestors(s, task)], name, "dispatcher")

    queue_wait = under_request("dispatcher.queue_wait")
    assert_under(queue_wait, request_span, task)
    for phase in ("inference.prefill", "inference.decode"):
        assert_under(under_request(phase), request_span, task)
    assert request_span.attributes["gen_ai.usage.input_tokens"] > 0
    assert request_span.attributes["gen_ai.usage.output_tokens"] == final.usage.completion_tokens

    # The batch that carried the request links to the request's span, and says why it flushed.
    batches = [s for s in spans if s.name == "dispatcher.batch" and (TRACE_ID, request_span.span_id) in s.links]
    assert len(batches) == 1, "exactly one batch carries the request"
    batch = batches[0]
    assert batch.service == "dispatcher"
    assert batch.attributes["switchyard.batch_size"] == len(batch.links) >= 1
    assert batch.attributes["switchyard.flush_reason"] in FLUSH_REASON_LABELS
    # the request's queue wait says the same, in the same words (not the proto enum's number)
    assert queue_wait.attributes["switchyard.flush_reason"] == batch.attributes["switchyard.flush_reason"]
    assert queue_wait.attributes["switchyard.batch_size"] == batch.attributes["switchyard.batch_size"]

    # Engine turns serve sequences of several tasks: each turn's span links to the requests it served,
    # and the engine's steps are its children, never traces of their own.
    turns = [s for s in spans if s.name == "dispatcher.step" and (TRACE_ID, request_span.span_id) in s.links]
    assert turns and all(not t.parent_span_id for t in turns)  # roots, tied to tasks by links
    turn_ids = {t.span_id for t in turns}
    engine = [s for s in spans if s.name.startswith("engine.") and s.parent_span_id in turn_ids]
    names = {s.name for s in engine}
    assert "engine.decode" in names and names & {"engine.prefill", "engine.step"}
    decode_steps = [s for s in engine if s.name == "engine.decode"]
    assert len(decode_steps) >= final.usage.completion_tokens - 1  # the first token comes from prefill
    assert not [s for s in spans if s.name.startswith("engine.") and not s.parent_span_id]

    # Nothing in a successful task is marked as an error.
    assert not [f"{s.service}:{s.name}" for s in task if s.is_error]


async def test_metrics_endpoints_show_queue_batch_and_ttft_after_a_task(stack):
    await run_task(stack, agent_pb2.RunTaskRequest(payload="What does the for statement do?"))
    orchestrator = scrape(stack.metrics_url("orchestrator"))
    retrieval = scrape(stack.metrics_url("retrieval"))
    dispatcher = scrape(stack.metrics_url("dispatcher"))

    for name, samples in (("orchestrator", orchestrator), ("retrieval", retrieval), ("dispatcher", dispatcher)):
        assert total(samples, "switchyard_service_info", service=name) == 1
        assert total(samples, "switchyard_event_loop_lag_seconds_count") > 0, name

    assert total(orchestrator, "switchyard_queue_wait_seconds_count", queue="orchestration") > 0
    assert total(orchestrator, "switchyard_task_ttft_seconds_count") > 0
    assert total(retrieval, "switchyard_queue_wait_seconds_count", queue="retrieval") > 0
    assert total(retrieval, "switchyard_embed_batch_size_count") > 0
    assert total(dispatcher, "switchyard_queue_wait_seconds_count", queue="inference") > 0
    assert total(dispatcher, "switchyard_batch_size_count") > 0 and total(dispatcher, "switchyard_batch_size_sum") > 0
    assert total(dispatcher, "switchyard_flushes_total") > 0
    assert total(dispatcher, "switchyard_ttft_seconds_count") > 0 and total(dispatcher, "switchyard_ttft_seconds_sum") > 0
    assert total(dispatcher, "switchyard_inter_token_latency_seconds_count") > 0


# docs/architecture.md: every service's endpoint carries the process metrics; each service the
# metrics of its own work. Metric family names, as prometheus_client's parser reports them
# (counters without "_total"); a labelled family with no series yet still counts as present.
DESIGN_METRICS = {
    "orchestrator": (
        "switchyard_queue_depth", "switchyard_queue_wait_seconds", "switchyard_task_ttft_seconds",
        "switchyard_agents_concurrent",
    ),
    "retrieval": ("switchyard_queue_depth", "switchyard_queue_wait_seconds"),
    "dispatcher": (
        "switchyard_queue_depth", "switchyard_queue_wait_seconds", "switchyard_batch_size", "switchyard_flushes",
        "switchyard_engine_busy_ratio", "switchyard_gpu_utilization_ratio", "switchyard_compute_score",
        "switchyard_running_agents", "switchyard_waiting_agents", "switchyard_preemptions", "switchyard_ttft_seconds",
        "switchyard_inter_token_latency_seconds", "switchyard_task_compute_score_used",
        "switchyard_task_memory_peak_bytes",
    ),
}
PROCESS_METRICS = ("switchyard_event_loop_lag_seconds", "switchyard_service_info")
CPU_THROTTLING = ("switchyard_cpu_periods", "switchyard_cpu_throttled_periods", "switchyard_cpu_throttled_seconds")


@pytest.mark.parametrize("service", SERVICES)
def test_metrics_endpoint_carries_the_design_metrics(stack, service):
    with urllib.request.urlopen(stack.metrics_url(service), timeout=10) as response:
        families = {f.name for f in text_string_to_metric_families(response.read().decode())}
    expected = (*PROCESS_METRICS, *DESIGN_METRICS[service])
    if find_cpu_stat() is not None:  # the container's CPU throttling, where the cgroup file exists
        expected += CPU_THROTTLING
    missing = [name for name in expected if name not in families]
    assert not missing, f"{service} metrics endpoint lacks {missing}"


async def test_tool_calls_get_spans_under_the_task(stack, receiver):
    trace_id = "1f2e3d4c5b6a79880a1b2c3d4e5f6071"
    request = agent_pb2.RunTaskRequest(payload="What does the with statement do, and what is 12*(3+4)?",
                                       task_type="react_loop")
    async with open_channel(stack.address("orchestrator")) as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).RunTask(
            request, timeout=120, metadata=(("traceparent", f"00-{trace_id}-{CALLER_SPAN_ID}-01"),)
        )
        events = [event async for event in call]
    called = {e.tool_call.name for e in events if e.HasField("tool_call")}
    assert called, "the react_loop task called no tool"
    expected = {f"tool {name}" for name in called}
    wanted = expected | {"agent.AgentService/RunTask"}  # the server span ends last
    spans = receiver.wait_for(lambda got: wanted <= {s.name for s in got if s.trace_id == trace_id}, timeout_s=60)
    task = [s for s in spans if s.trace_id == trace_id]
    run = one(task, "agent.AgentService/RunTask", "orchestrator", SERVER)
    for name in expected:
        for span in (s for s in task if s.name == name):
            assert_under(span, run, task)
            assert span.attributes["gen_ai.tool.name"] == name.removeprefix("tool ")


async def test_an_http_submit_is_a_server_span_the_task_runs_under_and_a_request_duration(stack, receiver):
    import re

    import httpx

    trace_id = "5c4b3a29181706f5e4d3c2b1a0998877"
    http = next(m.group(1) for line in stack.lines if (m := re.match(r"\s+http\s+(http://\S+:\d+)\s", line)))
    body = {"agent_id": "trace-agent", "priority": "core", "task_type": "rag_answer", "max_tokens": 16,
            "payload": "How does the with statement work?"}
    async with httpx.AsyncClient(base_url=http, timeout=60) as client:
        reply = await client.post("/api/v1/agent/submit", json=body,
                                  headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"})
        assert reply.status_code == 200 and reply.json()["trace_id"] == trace_id
    spans = receiver.wait_for(lambda got: {"POST /api/v1/agent/submit", "infer", "dispatcher.generate"} <= {
        s.name for s in got if s.trace_id == trace_id}, timeout_s=60)
    task = [s for s in spans if s.trace_id == trace_id]
    submit = one(task, "POST /api/v1/agent/submit", "orchestrator", SERVER)
    assert submit.parent_span_id == CALLER_SPAN_ID and submit.attributes["http.route"] == "/api/v1/agent/submit"
    for stage in ("orchestration.queue_wait", "retrieve", "infer"):
        assert_under(one(task, stage, "orchestrator"), submit, task)
    assert_under(one(task, "dispatcher.generate", "dispatcher", SERVER), submit, task)
    samples = scrape(stack.metrics_url("orchestrator"))
    assert total(samples, "http_server_request_duration_seconds_count", http_request_method="POST",
                 http_route="/api/v1/agent/submit", http_response_status_code="200") >= 1
