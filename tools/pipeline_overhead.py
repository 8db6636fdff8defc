"""Pipeline overhead: RunTask through the stack against a bare grpc.aio server streaming the same messages.

Usage: python tools/pipeline_overhead.py [--seconds 10] [--concurrency 64] [--tracing off|on]

Both servers run in a child process of their own and are driven, one after the
other, by the same client (``switchyard.bench.loadgen``, in another process):

- **bare floor**: an ``agent.AgentService.RunTask`` servicer on grpc.aio and
  uvloop that streams the events a chat task with ``max_tokens`` 8 streams
  (accepted, stages, 8 tokens, final: 15 messages) and does nothing else;
- **stack**: the orchestrator and the dispatcher (a zero-cost sim engine:
  every latency parameter 0) in one process, the way ``switchyard bench
  compare`` runs them, serving ``task_type: chat``, ``max_tokens`` 8.

It prints both rates in calls per second and their ratio (stack / floor): the
share of the floor the pipeline keeps. ``--tracing on`` installs an SDK tracer
provider with 10 % ratio sampling and an exporter that drops spans.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from typing import Any

CHAT = {"task_id": "overhead-{{.RequestNumber}}", "payload": "summarize this doc", "task_type": "chat",
        "max_tokens": 8}
ZERO_COST = {
    "sim.prefill_overhead_ms": 0.0, "sim.prefill_per_token_ms": 0.0,
    "sim.decode_base_ms": 0.0, "sim.decode_per_seq_ms": 0.0,
    "orchestrator.cpu_executor": "loop",
}


def _install_tracing(sampled: bool) -> None:
    if not sampled:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.1)))
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)


def _serve_bare(ports: Any) -> None:
    import asyncio

    import grpc
    import uvloop

    from switchyard.api import agent_pb2, agent_pb2_grpc

    events = [agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))]
    events += [agent_pb2.TaskEvent(stage=agent_pb2.StageEvent(name=n)) for n in ("plan", "render_prompt", "count_tokens",
                                                                                  "infer", "finalize")]
    events += [agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=f" w{i}", index=i)) for i in range(8)]
    events.append(agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(output="done")))

    class Bare(agent_pb2_grpc.AgentServiceServicer):
        async def RunTask(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            for event in events:
                yield event

    async def main() -> None:
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_stack(ports: Any, tracing: bool) -> None:
    import asyncio

    import uvloop

    from switchyard.common import telemetry
    from switchyard.common.config import load_config
    from switchyard.common.server import start_server
    from switchyard.serve import make_service

    _install_tracing(tracing)

    async def main() -> None:
        config = load_config(None).with_overrides(**ZERO_COST)
        interceptors = telemetry.server_interceptors() if tracing else ()
        d = await start_server([make_service("dispatcher", config)], "127.0.0.1", 0, config.server,
                               interceptors=interceptors)
        wired = config.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{d.port}",
                                         "orchestrator.retrieval_addr": "127.0.0.1:1"})
        o = await start_server([make_service("orchestrator", wired)], "127.0.0.1", 0, config.server,
                               interceptors=interceptors)
        ports.put(o.port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _rate(target: Any, args: tuple, seconds: float, concurrency: int) -> float:
    from switchyard.bench.calldata import parse_calldata
    from switchyard.bench.loadgen import LoadPlan, run_load

    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=target, args=(ports, *args), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        items = parse_calldata(CHAT)
        warm = LoadPlan(host=f"127.0.0.1:{port}", calldata=items, total=200, concurrency=concurrency)
        run_load(warm, in_process=False)
        plan = LoadPlan(host=f"127.0.0.1:{port}", calldata=items, duration_s=seconds, concurrency=concurrency)
        load = run_load(plan, in_process=False)
        errors = sum(1 for r in load.results if r.error)
        if errors:
            print(f"  {errors} calls failed, e.g. {next(r.error for r in load.results if r.error)}", file=sys.stderr)
        return sum(1 for r in load.results if not r.error) / load.wall_s
    finally:
        server.kill()
        server.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per server (default 10)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent calls (default 64)")
    parser.add_argument("--tracing", choices=["off", "on"], default="off",
                        help="on: SDK provider, 10 %% ratio sampling, spans dropped (default off)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OTEL_SDK_DISABLED", "false")
    floor = _rate(_serve_bare, (), args.seconds, args.concurrency)
    print(f"bare grpc.aio floor: {floor:8.1f} calls/s (15 messages per call)")
    stack = _rate(_serve_stack, (args.tracing == "on",), args.seconds, args.concurrency)
    print(f"stack (tracing {args.tracing}): {stack:8.1f} calls/s (chat, max_tokens 8, zero-cost sim engine)")
    print(f"pipeline / floor:    {stack / floor:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
