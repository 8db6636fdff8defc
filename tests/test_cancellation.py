"""Work ends when its caller is gone: 300 RunTasks cancelled mid-stream with tracing on.

The stack (dispatcher on the sim engine, orchestrator) runs in a child process
with a global tracer provider, as `switchyard serve` would with tracing on, so
every interceptor and stage span is live. The child counts "Failed to detach
context" errors, spans started and never ended, and what the dispatcher still
holds after the cancels, and prints them as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_CHILD = r'''
import asyncio, json, logging, sys, time
import uvloop
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import telemetry
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import start_server
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.metrics import AGENTS_CONCURRENT
from switchyard.orchestrator.service import OrchestratorService

TASKS, CONCURRENCY = int(sys.argv[1]), 25


class OpenSpans(SpanProcessor):
    def __init__(self):
        self.open = {}
    def on_start(self, span, parent_context=None):
        self.open[span.context.span_id] = span.name
    def on_end(self, span):
        self.open.pop(span.context.span_id, None)


class ContextErrors(logging.Handler):
    count = 0
    def emit(self, record):
        if "Failed to detach context" in record.getMessage():
            ContextErrors.count += 1


async def main():
    exporter, tracker = InMemorySpanExporter(), OpenSpans()
    provider = telemetry.make_tracer_provider()
    provider.add_span_processor(tracker)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install_provider(provider)
    logging.getLogger().addHandler(ContextErrors())

    cfg = load_config("config").with_overrides(**{"dispatcher.engine": "sim"})
    dispatcher = DispatcherService(cfg)
    disp = await start_server([dispatcher], "127.0.0.1", 0, cfg.server, telemetry.server_interceptors())
    cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}",
                                "orchestrator.cpu_executor": "loop"})
    orch = await start_server([OrchestratorService(cfg)], "127.0.0.1", 0, cfg.server,
                              telemetry.server_interceptors())
    cancelled_at = {}
    tracer = provider.get_tracer("test")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i, stub):
        async with gate:
            request = agent_pb2.RunTaskRequest(task_id=f"c{i}", payload="Explain the with statement.",
                                               task_type="chat", max_tokens=400,
                                               metadata={"user": f"u{i}", "secret": "not recorded"})
            with tracer.start_as_current_span(f"client-{i}") as root:
                call = stub.RunTask(request, timeout=60)
                async for event in call:
                    if event.HasField("token"):
                        break
                call.cancel()
                cancelled_at[root.get_span_context().trace_id] = time.time_ns()

    async with open_channel(f"127.0.0.1:{orch.port}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        await asyncio.gather(*(one(i, stub) for i in range(TASKS)))
    for _ in range(200):  # until the dispatcher has let go of every request
        await asyncio.sleep(0.02)
        held = dispatcher.scheduler.num_running + dispatcher.scheduler.num_waiting + dispatcher.scheduler.num_queued
        if not held and AGENTS_CONCURRENT._value.get() == 0:
            break
    await orch.stop(1.0)
    await disp.stop(1.0)
    await asyncio.sleep(0.1)

    spans = exporter.get_finished_spans()
    # Requests reach the dispatcher over GenerateStream: one dispatcher.generate span each, in the task's trace.
    generate = [s for s in spans if s.name == "dispatcher.generate" and s.kind.name == "SERVER"]
    infer = {s.context.span_id for s in spans if s.name == "infer"}
    lag_ms = sorted((s.end_time - cancelled_at[s.context.trace_id]) / 1e6
                    for s in generate if s.context.trace_id in cancelled_at)
    print(json.dumps({
        "context_errors": ContextErrors.count,
        "open_spans": sorted(set(tracker.open.values())),
        "held_requests": held,
        "agents_concurrent": AGENTS_CONCURRENT._value.get(),
        "run_task_codes": sorted({s.attributes.get("rpc.grpc.status_code") for s in spans
                                  if s.name == "agent.AgentService/RunTask" and s.kind.name == "SERVER"}),
        "metadata_attributes": sorted({k for s in spans if s.name == "agent.AgentService/RunTask"
                                       and s.kind.name == "SERVER" for k in s.attributes if "metadata" in k}),
        "generate_server_spans": len(generate),
        "generate_codes": sorted({s.attributes.get("rpc.grpc.status_code") for s in generate}),
        "generate_under_infer": sum(s.parent is not None and s.parent.span_id in infer for s in generate),
        "cancel_to_dispatcher_ms_p50": lag_ms[len(lag_ms) // 2] if lag_ms else None,
    }))

uvloop.run(main())
'''


def test_300_cancelled_tasks_leave_no_context_error_no_open_span_and_nothing_held():
    out = subprocess.run([sys.executable, "-c", _CHILD, "300"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["context_errors"] == 0, report
    assert report["open_spans"] == [], report
    assert report["held_requests"] == 0 and report["agents_concurrent"] == 0, report
    assert report["run_task_codes"] == [1], report  # CANCELLED, for all 300
    assert report["generate_server_spans"] == 300 and report["generate_under_infer"] == 300, report
    assert report["generate_codes"] == [1], report
    assert report["metadata_attributes"] == ["switchyard.metadata.user"], report  # the allow-list only
