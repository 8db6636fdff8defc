"""Per-call cost of tracing on RunTask-like work: no instrumentation vs tracing off vs on.

Usage: python tools/tracing_overhead.py [--calls N] [--rounds R]

Two measurements, each printing per-call time and the ratio to "none":

1. ``grpc``: a RunTask-like server-streaming call over real gRPC aio on
   127.0.0.1. The front server decodes the JSON request, plans, calls a
   second server (retrieval-like: embed, search) over a unary RPC, renders a
   Jinja prompt, counts tokens and streams 16 token messages and a final one.
2. ``cpu``: the same CPU stages alone, with nothing else in the call: the
   worst case for span overhead, as the stage work is tens of microseconds.

Variants: "none" has no tracing calls at all; "off" wraps every stage in a
span through the OpenTelemetry API with no SDK installed, which is what
``setup_tracing`` leaves when no OTLP endpoint is set (no interceptors
either); "on" uses an SDK provider whose batch processor feeds an exporter
that drops spans, plus the tracing interceptors on both servers and the
channels (the in-process cost, without the network). To damp noise on a
shared machine, the gRPC variants alternate call by call and the median is
kept; the CPU variants run interleaved rounds and the best round is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from typing import Any, Awaitable, Callable, Sequence

import grpc
import jinja2
import uvloop
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from switchyard.common import telemetry
from switchyard.common.channels import open_channel

REQUEST = json.dumps({"task_id": "bench-001", "payload": "summarize this doc", "metadata": {"user": "u1"}}).encode()
PASSAGE = "The event loop runs one callback at a time; a callback that blocks it stalls every task. "
TEMPLATE = jinja2.Environment(autoescape=False).from_string(
    "You answer with the context.\n{% for p in passages %}[{{ loop.index }}] {{ p }}\n{% endfor %}Question: {{ q }}\n"
)
TOKENS = 16

Span = Callable[[str], Any]  # name -> context manager yielding a span (or None)


def _no_span(_name: str) -> Any:
    return nullcontext()


def _plan(span: Span) -> dict[str, Any]:
    with span("orchestration.queue_wait"):
        request = json.loads(REQUEST)
    with span("plan") as s:
        steps = ["retrieve", "render_prompt", "count_tokens", "infer"]
        if s is not None:
            s.set_attribute("switchyard.plan.steps", len(steps))
    return request


def _render(span: Span, request: dict[str, Any], passages: list[str]) -> tuple[str, int]:
    with span("render_prompt"):
        prompt = TEMPLATE.render(passages=passages, q=request["payload"])
    with span("count_tokens") as s:
        tokens = len(prompt.split())
        if s is not None:
            s.set_attribute("gen_ai.usage.input_tokens", tokens)
    return prompt, tokens


def _retrieve(span: Span) -> list[str]:
    with span("retrieval.embed"):
        vector = [float(len(PASSAGE) % (i + 1)) for i in range(64)]
    with span("retrieval.search") as s:
        passages = [PASSAGE * 3 for _ in range(4)]
        if s is not None:
            s.set_attribute("retrieval.top_k", len(passages))
    return passages if vector else []


def cpu_work(span: Span) -> bytes:
    """The CPU stages of one task, with no I/O: plan, retrieve, render, count, encode."""
    request = _plan(span)
    passages = _retrieve(span)
    prompt, tokens = _render(span, request, passages)
    with span("infer") as s:
        text = " ".join(prompt.split()[:TOKENS])
        if s is not None:
            s.set_attribute("gen_ai.request.model", "sim-7b")
    return json.dumps({"task_id": request["task_id"], "output": text, "trace_id": telemetry.current_trace_id()}).encode()


# --------------------------------------------------------------------------- gRPC variant


def _span_for(tracer: trace.Tracer | None) -> Span:
    return _no_span if tracer is None else tracer.start_as_current_span


def _retrieval_handler(tracer: trace.Tracer | None) -> grpc.GenericRpcHandler:
    async def retrieve(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        span = _span_for(tracer if request == b"traced" else None)
        return "\n".join(_retrieve(span)).encode()

    return grpc.method_handlers_generic_handler(
        "bench.Retrieval", {"Retrieve": grpc.unary_unary_rpc_method_handler(retrieve)}
    )


def _front_handler(tracer: trace.Tracer | None, retrieval: grpc.aio.Channel) -> grpc.GenericRpcHandler:
    retrieve_call = retrieval.unary_unary("/bench.Retrieval/Retrieve")

    async def run_task(request: bytes, context: grpc.aio.ServicerContext):
        traced = request == b"traced"
        span = _span_for(tracer if traced else None)
        task = _plan(span)
        with span("retrieve"):
            passages = (await retrieve_call(request, timeout=10)).decode().split("\n")
        prompt, _ = _render(span, task, passages)
        with span("infer") as s:
            words = prompt.split()
            for i in range(TOKENS):
                yield words[i % len(words)].encode()
            if s is not None:
                s.set_attribute("gen_ai.usage.output_tokens", TOKENS)
        yield json.dumps({"task_id": task["task_id"], "trace_id": telemetry.current_trace_id()}).encode()

    return grpc.method_handlers_generic_handler(
        "bench.Agent", {"RunTask": grpc.unary_stream_rpc_method_handler(run_task)}
    )


async def _start(handler: Callable[[], grpc.GenericRpcHandler], interceptors: Sequence[Any]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers((handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class _Stack:
    """A front server and a retrieval server; ``provider`` None means no tracing interceptors."""

    def __init__(self, tracer: trace.Tracer | None, provider: TracerProvider | None) -> None:
        self.tracer, self.provider = tracer, provider
        self.servers: list[grpc.aio.Server] = []
        self.channels: list[grpc.aio.Channel] = []

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = open_channel(address, tracer_provider=self.provider)
        self.channels.append(channel)
        return channel

    async def start(self) -> Callable[[bytes], Awaitable[int]]:
        server_interceptors = telemetry.server_interceptors(self.provider) if self.provider else []
        srv, addr = await _start(lambda: _retrieval_handler(self.tracer), server_interceptors)
        self.servers.append(srv)
        retrieval = self._channel(addr)
        srv, addr = await _start(lambda: _front_handler(self.tracer, retrieval), server_interceptors)
        self.servers.append(srv)
        call = self._channel(addr).unary_stream("/bench.Agent/RunTask")

        async def run(request: bytes) -> int:
            return len([m async for m in call(request, timeout=10)])

        return run

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        for server in self.servers:
            await server.stop(None)


async def _median_async(variants: dict[str, Callable[[], Awaitable[Any]]], calls: int, rounds: int) -> dict[str, float]:
    """Median seconds per call; the variants alternate call by call, so load changes hit all alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(calls * rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            await fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _best_sync(variants: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


class _Drop(SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _print(title: str, best: dict[str, float]) -> None:
    print(title)
    for name, per_call in best.items():
        print(f"  {name:5s} {per_call * 1e6:9.1f} us/call   ratio vs none {per_call / best['none']:.3f}")


async def _grpc_bench(provider: TracerProvider, calls: int, rounds: int) -> dict[str, float]:
    plain = _Stack(telemetry.get_tracer("switchyard.bench"), None)  # the services' stage tracer, no provider: tracing off
    traced = _Stack(provider.get_tracer("switchyard.bench"), provider)
    run_plain, run_traced = await plain.start(), await traced.start()
    variants = {
        "none": lambda: run_plain(b"plain"),
        "off": lambda: run_plain(b"traced"),
        "on": lambda: run_traced(b"traced"),
    }
    try:
        for fn in variants.values():
            for _ in range(20):  # warm up channels and caches
                await fn()
        return await _median_async(variants, calls, rounds)
    finally:
        await plain.stop()
        await traced.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="gRPC calls per round and variant (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is kept (default 5)")
    args = parser.parse_args(argv)
    for flag, value in (("--calls", args.calls), ("--rounds", args.rounds)):  # 0: a traceback of StatisticsError
        if value < 1:
            parser.error(f"{flag}: expected a count >= 1, got {value}")
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        raise SystemExit("an SDK tracer provider is installed; run this without OTEL_* set-up")
    provider = telemetry.make_tracer_provider()
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 16))  # never drop: dropping is cheaper
    try:
        best = uvloop.run(_grpc_bench(provider, args.calls, args.rounds))
        _print(f"grpc: RunTask-like stream over 2 RPCs, 10 spans, median of {args.rounds * args.calls} alternating calls", best)
        off_grpc = best["off"] / best["none"] - 1
        off_tracer, on_tracer = telemetry.get_tracer("switchyard.bench"), provider.get_tracer("switchyard.bench")
        cpu = _best_sync(
            {
                "none": lambda: cpu_work(_no_span),
                "off": lambda: cpu_work(off_tracer.start_as_current_span),
                "on": lambda: cpu_work(on_tracer.start_as_current_span),
            },
            args.calls * 10,
            args.rounds,
        )
        _print(f"cpu: the stages alone, 8 spans, best of {args.rounds} rounds x {args.calls * 10}", cpu)
        per_span = (cpu["off"] - cpu["none"]) / 8
        print(f"tracing off: {off_grpc * 100:+.1f} % per gRPC task; {per_span * 1e6:.2f} us per no-op span")
    finally:
        provider.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
