"""Tracing set-up: OTLP export, W3C propagation over gRPC aio, span status, tracing off."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from switchyard.common import envs, telemetry
from switchyard.common.channels import open_channel
from switchyard.common.errors import SERVER_FAULT_CODES, InvalidArgument, ServiceUnavailable, SwitchyardError
from switchyard.common.queues import QueueFullError, QueueTimeoutError
from otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.no_gpu

OTEL_VARS = tuple(name for name in envs.STANDARD_VARIABLES if name.startswith("OTEL_"))


@pytest.fixture
def clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


# --------------------------------------------------------------------------- set-up and export

_CHILD = """
from opentelemetry import trace
from switchyard.common.telemetry import current_trace_id, setup_tracing, tracing_enabled
shutdown = setup_tracing("retrieval")
assert tracing_enabled()
with trace.get_tracer("t").start_as_current_span("retrieval.search") as span:
    span.set_attribute("retrieval.top_k", 4)
    print(current_trace_id())
shutdown()
shutdown()  # a second call is harmless
"""


def _child_env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.upper() not in OTEL_VARS}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, **extra)
    return env


@pytest.mark.parametrize(
    ("extra", "service"), [({}, "retrieval"), ({"OTEL_SERVICE_NAME": "retrieval-eu1"}, "retrieval-eu1")]
)
def test_setup_tracing_exports_over_otlp_grpc_and_flushes_on_shutdown(extra, service):
    with OtlpReceiver() as receiver:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=_child_env(receiver, **extra), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        trace_id = out.stdout.strip()
        assert len(trace_id) == 32 and int(trace_id, 16)
        # shutdown() flushed before the process exited: the span is already here.
        [span] = receiver.spans
    assert span.name == "retrieval.search"
    assert span.service == service
    assert span.resource["service.namespace"] == "switchyard"
    assert span.trace_id == trace_id
    assert span.attributes["retrieval.top_k"] == 4


def test_sampler_comes_from_the_environment():
    with OtlpReceiver() as receiver:
        env = _child_env(receiver, OTEL_TRACES_SAMPLER="always_off")
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert receiver.spans == []


def test_the_start_line_names_the_sampler_as_the_sdk_describes_it():
    """It read 'sampler <opentelemetry.sdk.trace.sampling.ParentBased object at 0x7f635cb39690>'."""
    child = "import logging\nlogging.basicConfig(level=logging.INFO)\n" + _CHILD
    with OtlpReceiver() as receiver:
        env = _child_env(receiver, OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.1")
        out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sampler ParentBased{root:TraceIdRatioBased{0.1}" in out.stderr, out.stderr
    assert " object at 0x" not in out.stderr


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": " None , none"},
    ],
)
def test_tracing_off_installs_nothing(clean_otel_env, env):
    for name, value in env.items():
        clean_otel_env.setenv(name, value)
    assert not telemetry.tracing_configured()
    shutdown = telemetry.setup_tracing("orchestrator")
    shutdown()
    assert not telemetry.tracing_enabled()
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    assert telemetry.server_interceptors() == []
    assert telemetry.client_interceptors() == []
    with trace.get_tracer(__name__).start_as_current_span("plan") as span:
        assert not span.is_recording()
        assert telemetry.current_trace_id() == ""


def test_endpoint_turns_tracing_on(clean_otel_env):
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    assert telemetry.tracing_configured()


BAD_OTEL_VALUES = [
    # (variable, value, the expectation the refusal states); the SDK's own answer in the comment
    ("OTEL_TRACES_SAMPLER", "bogus", "expected one of always_on,"),  # a warning, then every trace sampled
    ("OTEL_TRACES_SAMPLER_ARG", "5", "a number from 0 to 1"),  # a warning, then a ratio of 1.0
    ("OTEL_TRACES_SAMPLER_ARG", "abc", "a number from 0 to 1"),  # the same
    ("OTEL_TRACES_EXPORTER", "zipkin", "expected 'otlp' or 'none'"),  # OTLP exported anyway
    ("OTEL_TRACES_EXPORTER", "otlp,console", "expected 'otlp' or 'none'"),
    ("OTEL_TRACES_EXPORTER", "otlp,none", "expected 'otlp' or 'none'"),  # was taken, and exported: off or on?
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", "expected 'grpc'"),  # gRPC to an HTTP port, nothing arrives
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "expected 'grpc'"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", "in seconds, above 0 and at most 600"),  # a traceback from the exporter
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-1", "in seconds, above 0 and at most 600"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "10000", "not the specification's milliseconds"),  # 2.8 h for each export
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "expected 'gzip', 'deflate' or 'none'"),  # a traceback too
    ("OTEL_EXPORTER_OTLP_INSECURE", "yes", "expected 'true' or 'false'"),  # read as false: TLS to a plain port
    ("OTEL_SDK_DISABLED", "yes", "expected 'true' or 'false'"),  # read as false: tracing stays on
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "not-a-url", "expected http://host:port"),  # a DNS name 'not-a-url'
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://", "a URL with no host"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD_OTEL_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_OTEL_VALUES])
def test_a_bad_otel_value_is_refused_naming_the_variable(clean_otel_env, name, value, expected):
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    clean_otel_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    clean_otel_env.setenv(name, value)
    with pytest.raises(ValueError) as refused:
        telemetry.check_tracing_environment()
    assert f"environment variable {name}={value!r}: " in str(refused.value)
    assert expected in str(refused.value)
    with pytest.raises(ValueError):
        telemetry.setup_tracing("orchestrator")
    assert not telemetry.tracing_enabled()


@pytest.mark.parametrize("env", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example:4317", "OTEL_EXPORTER_OTLP_INSECURE": "FALSE"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://[::1]:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
    {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "ignored by this sampler"},
    {"OTEL_TRACES_EXPORTER": "OTLP", "OTEL_SDK_DISABLED": "False", "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5",
     "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"},
], ids=str)
def test_the_values_the_sdk_takes_pass_the_check(clean_otel_env, env):
    for name, value in env.items():
        clean_otel_env.setenv(name, value)
    telemetry.check_tracing_environment()


@pytest.mark.parametrize("command", [("up", "--free-ports"), ("serve", "retrieval", "--port", "0")], ids=" ".join)
def test_a_bad_otel_value_stops_the_services_before_anything_starts(command):
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
    run = subprocess.run([sys.executable, "-m", "switchyard.cli", *command], capture_output=True, text=True,
                         timeout=60, env={**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert "bad configuration:\nenvironment variable OTEL_EXPORTER_OTLP_PROTOCOL='http/protobuf': expected 'grpc'" \
        in run.stderr
    assert "Traceback" not in run.stderr and "ready on" not in run.stderr


# --------------------------------------------------------------------------- propagation and status over real gRPC

SERVICE = "test.Echo"


def _handler(provider: TracerProvider) -> grpc.GenericRpcHandler:
    """Unary and server-streaming echo: b"OK" answers the current trace id; a status
    code's name aborts with that code; b"raise" raises (sent as UNKNOWN)."""
    tracer = provider.get_tracer(__name__)

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        text = request.decode()
        with tracer.start_as_current_span("inner.stage"):
            pass
        if text == "raise":
            raise RuntimeError("bug in the servicer")
        if text != "OK":
            await context.abort(grpc.StatusCode[text], f"aborted with {text}")
        return telemetry.current_trace_id().encode()

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await answer(request, context)

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        yield await answer(request, context)

    async def abort_in_stage(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        with tracer.start_as_current_span("abort.stage"):  # as a servicer does: abort inside its span
            await context.abort(grpc.StatusCode[request.decode()], "aborted inside a stage")
        return b""

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Abort": grpc.unary_unary_rpc_method_handler(abort_in_stage),
        },
    )


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = telemetry.make_tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.fixture
async def echo_server(spans):
    provider, _ = spans
    server = grpc.aio.server(interceptors=telemetry.server_interceptors(provider))
    server.add_generic_rpc_handlers((_handler(provider),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _named(exporter: InMemorySpanExporter, name: str, kind: SpanKind):
    return [s for s in exporter.get_finished_spans() if s.name == name and s.kind == kind]


async def _settled(exporter: InMemorySpanExporter) -> None:
    """Until no span is still open: a client span ends from its call's done callback, a tick after the call."""
    for _ in range(100):
        before = len(exporter.get_finished_spans())
        await asyncio.sleep(0.01)
        if len(exporter.get_finished_spans()) == before:
            return


async def test_traceparent_sent_by_client_becomes_the_parent(echo_server, spans):
    _, exporter = spans
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with open_channel(echo_server) as channel:  # a plain client, no OpenTelemetry
        call = channel.unary_unary(f"/{SERVICE}/Unary")
        reply = await call(b"OK", metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),))
    assert reply.decode() == trace_id  # the servicer sees the caller's trace as current
    await _settled(exporter)
    [server_span] = _named(exporter, f"{SERVICE}/Unary", SpanKind.SERVER)
    assert trace.format_trace_id(server_span.context.trace_id) == trace_id
    assert trace.format_span_id(server_span.parent.span_id) == parent_id
    [inner] = _named(exporter, "inner.stage", SpanKind.INTERNAL)
    assert inner.parent.span_id == server_span.context.span_id


async def test_client_interceptors_propagate_the_current_context(echo_server, spans):
    provider, exporter = spans
    async with open_channel(echo_server, tracer_provider=provider) as channel:
        with provider.get_tracer(__name__).start_as_current_span("task") as root:
            unary = await channel.unary_unary(f"/{SERVICE}/Unary")(b"OK")
            streamed = [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"OK")]
    root_trace = trace.format_trace_id(root.get_span_context().trace_id)
    assert unary.decode() == root_trace and streamed[-1].decode() == root_trace
    for method in ("Unary", "Stream"):
        await _settled(exporter)
        [client] = _named(exporter, f"{SERVICE}/{method}", SpanKind.CLIENT)
        [server] = _named(exporter, f"{SERVICE}/{method}", SpanKind.SERVER)
        assert client.parent.span_id == root.get_span_context().span_id
        assert server.parent.span_id == client.context.span_id
        assert server.context.trace_id == root.get_span_context().trace_id


async def test_concurrent_calls_never_share_a_span(echo_server, spans):
    provider, exporter = spans
    async with open_channel(echo_server, tracer_provider=provider) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Unary")
        tracer = provider.get_tracer(__name__)

        async def one(i: int) -> None:
            with tracer.start_as_current_span(f"task-{i}"):
                await call(b"OK")

        await asyncio.gather(*(one(i) for i in range(8)))
    await _settled(exporter)
    servers = _named(exporter, f"{SERVICE}/Unary", SpanKind.SERVER)
    clients = {s.context.span_id: s for s in _named(exporter, f"{SERVICE}/Unary", SpanKind.CLIENT)}
    assert len(servers) == 8 and len({s.context.span_id for s in servers}) == 8
    roots = {s.context.span_id: s.name for s in exporter.get_finished_spans() if s.name.startswith("task-")}
    parents_of_clients = {clients[s.parent.span_id].parent.span_id for s in servers}
    assert parents_of_clients == set(roots)  # each task's call hangs under that task


CODES = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_span_status_follows_the_rpc_semantic_conventions(echo_server, spans, method):
    """Server spans: ERROR only for a server-fault code; client spans: ERROR for every non-OK code."""
    provider, exporter = spans
    async with open_channel(echo_server, tracer_provider=provider) as channel:
        for code in CODES:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if method == "Unary":
                    await channel.unary_unary(f"/{SERVICE}/Unary")(code.name.encode())
                else:
                    [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(code.name.encode())]
            assert err.value.code() == code
    for kind in (SpanKind.SERVER, SpanKind.CLIENT):
        await _settled(exporter)
        finished = _named(exporter, f"{SERVICE}/{method}", kind)
        assert len(finished) == len(CODES)
        for code, span in zip(CODES, finished):
            assert span.attributes["rpc.grpc.status_code"] == code.value[0], (kind, code)
            error = code in SERVER_FAULT_CODES or kind == SpanKind.CLIENT
            assert span.status.status_code == (StatusCode.ERROR if error else StatusCode.UNSET), (kind, code)
            assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.method"] == method


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_uncaught_exception_is_an_unknown_error_on_both_sides(echo_server, spans, method):
    provider, exporter = spans
    async with open_channel(echo_server, tracer_provider=provider) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method == "Unary":
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"raise")
            else:
                [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"raise")]
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    for kind in (SpanKind.SERVER, SpanKind.CLIENT):
        await _settled(exporter)
        [span] = _named(exporter, f"{SERVICE}/{method}", kind)
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]


async def test_health_checks_are_not_traced(spans):
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    provider, exporter = spans
    server = grpc.aio.server(interceptors=telemetry.server_interceptors(provider))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}", tracer_provider=provider) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("exc", "code", "error"),
    [
        (InvalidArgument("payload", "a non-empty question", ""), "INVALID_ARGUMENT", False),
        (QueueFullError("inference", 512), "RESOURCE_EXHAUSTED", False),
        (SwitchyardError("model gpt-5 not found", grpc.StatusCode.NOT_FOUND), "NOT_FOUND", False),
        (QueueTimeoutError("retrieval", 2.0, 2000), "DEADLINE_EXCEEDED", True),
        (ServiceUnavailable("retrieval", "127.0.0.1:50052"), "UNAVAILABLE", True),
        (RuntimeError("bug"), "INTERNAL", True),
    ],
)
def test_stage_spans_follow_the_server_fault_rule(spans, exc, code, error):
    provider, exporter = spans
    with pytest.raises(type(exc)):
        with provider.get_tracer(__name__).start_as_current_span("infer"):
            raise exc
    [span] = exporter.get_finished_spans()
    assert span.attributes["switchyard.status_code"] == code
    assert span.status.status_code == (StatusCode.ERROR if error else StatusCode.UNSET)
    assert [e.name for e in span.events] == ["exception"]  # recorded either way


async def test_stage_span_as_decorator_of_a_coroutine(spans):
    provider, exporter = spans

    @provider.get_tracer(__name__).start_as_current_span("plan")
    async def plan() -> str:
        await asyncio.sleep(0)
        return telemetry.current_trace_id()

    trace_id = await plan()
    [span] = exporter.get_finished_spans()
    assert span.name == "plan" and trace.format_trace_id(span.context.trace_id) == trace_id


async def test_abort_inside_a_stage_span_leaves_the_status_to_the_rpc_span(echo_server, spans):
    provider, exporter = spans
    async with open_channel(echo_server, tracer_provider=provider) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await channel.unary_unary(f"/{SERVICE}/Abort")(b"RESOURCE_EXHAUSTED")
        with pytest.raises(grpc.aio.AioRpcError):
            await channel.unary_unary(f"/{SERVICE}/Abort")(b"INTERNAL")
    await _settled(exporter)
    stages = _named(exporter, "abort.stage", SpanKind.INTERNAL)
    assert [s.status.status_code for s in stages] == [StatusCode.UNSET, StatusCode.UNSET]
    servers = _named(exporter, f"{SERVICE}/Abort", SpanKind.SERVER)
    assert [s.status.status_code for s in servers] == [StatusCode.UNSET, StatusCode.ERROR]


def test_setting_no_status_on_exception_is_kept(spans):
    provider, exporter = spans
    with pytest.raises(RuntimeError):
        with provider.get_tracer(__name__).start_as_current_span("plan", set_status_on_exception=False):
            raise RuntimeError("bug")
    [span] = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.UNSET


# --------------------------------------------------------------------------- children of unsampled spans


def _provider(monkeypatch, sampler: str, arg: str | None = None):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    exporter = InMemorySpanExporter()
    provider = telemetry.make_tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_under_a_parentbased_sampler_no_child_of_an_unsampled_span_is_built(monkeypatch):
    provider, exporter = _provider(monkeypatch, "parentbased_traceidratio", "0")
    tracer = provider.get_tracer(__name__)
    with tracer.start_as_current_span("task") as root:  # ratio 0: the root is not sampled
        assert not root.is_recording()
        with tracer.start_as_current_span("infer") as stage:
            assert stage is root  # no span object: the one its sampler would have dropped
            assert trace.get_current_span() is root
        child = tracer.start_span("dispatcher.queue_wait")
        assert not child.is_recording() and child.get_span_context() == root.get_span_context()
        child.end()
        # an explicit parent is the caller's choice: the sampler decides it, as before
        explicit = tracer.start_span("batch", context=trace.set_span_in_context(root))
        assert not explicit.is_recording() and explicit.get_span_context().span_id != root.get_span_context().span_id
    assert exporter.get_finished_spans() == ()


def test_under_a_parentbased_sampler_children_of_a_sampled_span_are_recorded(monkeypatch):
    provider, exporter = _provider(monkeypatch, "parentbased_traceidratio", "1")
    tracer = provider.get_tracer(__name__)
    with tracer.start_as_current_span("task"):
        with tracer.start_as_current_span("infer") as stage:
            assert stage.is_recording()
        tracer.start_span("dispatcher.queue_wait").end()
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["dispatcher.queue_wait", "infer", "task"]


def test_a_sampler_that_is_not_parentbased_still_decides_every_child(monkeypatch):
    """always_on samples a child of an unsampled parent: such children are built and recorded."""
    provider, exporter = _provider(monkeypatch, "always_on")
    tracer = provider.get_tracer(__name__)
    unsampled = trace.NonRecordingSpan(trace.SpanContext(0x1234, 0x5678, is_remote=True))
    with trace.use_span(unsampled):
        with tracer.start_as_current_span("infer") as stage:
            assert stage.is_recording()
    [span] = exporter.get_finished_spans()
    assert span.name == "infer" and span.parent.span_id == 0x5678


def test_only_sampled_requests_are_linked():
    from switchyard.dispatcher.request import Request, request_links

    def req(sampled: bool | None) -> Request:
        r = Request(request_id="r", prompt="p", prompt_tokens=1, max_tokens=1)
        if sampled is not None:
            flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT)
            r.span = trace.NonRecordingSpan(trace.SpanContext(0xABC, 0x10 + int(sampled), False, flags))
        return r

    links = request_links([req(True), req(False), req(None)])
    assert [link.context.span_id for link in links] == [0x11]


async def test_a_server_stream_runs_in_its_own_task_with_its_own_span_current(spans):
    """The stream interceptor attaches the RPC's span once and never detaches it: that holds only
    because grpc.aio runs each RPC in a task (and context) of its own. Checked here, RPC by RPC."""
    provider, exporter = spans
    tracer = provider.get_tracer(__name__)

    held: list[asyncio.Task] = []  # kept alive, so no two RPCs' tasks share an id

    async def where(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(3):
            with tracer.start_as_current_span("step"):
                pass
            held.append(asyncio.current_task())
            span = trace.get_current_span().get_span_context().span_id
            yield f"{id(held[-1])} {span:016x}".encode()
            await asyncio.sleep(0)

    server = grpc.aio.server(interceptors=telemetry.server_interceptors(provider))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Where": grpc.unary_stream_rpc_method_handler(where)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(f"/{SERVICE}/Where")

            async def one() -> set[tuple[str, str]]:
                return {tuple(m.decode().split()) async for m in call(b"")}

            answers = [await one(), await one(), *await asyncio.gather(one(), one(), one())]
    finally:
        await server.stop(None)
    assert all(len(a) == 1 for a in answers)  # one task and one current span through each RPC's steps
    tasks = {task for a in answers for task, _ in a}
    assert len(tasks) == 5
    servers = {f"{s.context.span_id:016x}": s for s in exporter.get_finished_spans() if s.name == f"{SERVICE}/Where"}
    assert {span for a in answers for _, span in a} == set(servers)
    steps = [s for s in exporter.get_finished_spans() if s.name == "step"]
    assert len(steps) == 15 and {f"{s.parent.span_id:016x}" for s in steps} == set(servers)
