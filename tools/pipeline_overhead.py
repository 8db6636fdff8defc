"""Pipeline overhead: RunTask through the stack against a bare grpc.aio server streaming the same messages.

Usage: python tools/pipeline_overhead.py [--seconds 10] [--rounds 5] [--concurrency 64] [--tracing off|on]
       [--stack processes|one-process]

Each server runs in child processes of its own; the same client
(``switchyard_harness.bench.loadgen``, in another process) drives them in turn, in
``--rounds`` windows each, so that other work on the machine weighs on all of
them alike:

- **stack**: the orchestrator and the dispatcher (a zero-cost sim engine:
  every latency parameter 0), each in its own process as deployed and as
  ``switchyard bench compare`` runs them (``--stack one-process``: both in
  one), serving ``task_type: chat``, ``max_tokens`` 8;
- **bare floor**: an ``agent.AgentService.RunTask`` servicer on grpc.aio and
  uvloop that streams the events the stack streamed for a typical such task
  (accepted, stages, token events, final; of 32 tasks run at once, one with
  the median number of events: token events carry the tokens that were ready
  together, so their number depends on the load), as they were, and does
  nothing else.

It prints both rates in calls per second and their ratio (stack / floor): the
share of the floor the pipeline keeps. A third server shows what a hop of a
call per task costs, with no Switchyard code on the path:

- **bare relay**: a RunTask servicer that streams the same events, taking
  the tokens from a Generate call to a bare ``agent.InferenceService``
  servicer (as many token chunks, then a done chunk), the two in processes of
  their own as the stack's are. It was the ceiling of the stack while the
  orchestrator made a Generate call per task; the stack now carries its
  requests over one GenerateStream per channel (``docs/architecture.md``),
  which a call-per-task relay cannot match.

Where ``/proc`` exists it also prints each server's CPU time per call (all its processes), a
figure that other processes sharing the cores disturb less than the rates do.
``--tracing on`` turns tracing on in the
stack as ``switchyard serve`` does (an SDK tracer provider, the RPC span
interceptors on both servers and every channel) with the sampler
``parentbased_traceidratio`` at 0.1 (``OTEL_TRACES_SAMPLER``, unless the
environment sets another) and a batch processor whose exporter drops the spans.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from typing import Any

CHAT = {"task_id": "overhead-{{.RequestNumber}}", "payload": "summarize this doc", "task_type": "chat",
        "max_tokens": 8}
ZERO_COST = {
    "sim.prefill_overhead_ms": 0.0, "sim.prefill_per_token_ms": 0.0,
    "sim.decode_base_ms": 0.0, "sim.decode_per_seq_ms": 0.0,
    "orchestrator.cpu_executor": "loop",
}


def _install_tracing() -> None:
    """Tracing on in this process, as setup_tracing would turn it on, but exporting nowhere."""
    os.environ.setdefault("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    os.environ.setdefault("OTEL_TRACES_SAMPLER_ARG", "0.1")
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from switchyard.common import telemetry

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = telemetry.make_tracer_provider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    telemetry.install_provider(provider)


async def _start(add_servicer: Any, servicer: Any) -> tuple[Any, int]:
    """A bare grpc.aio server on 127.0.0.1 serving ``servicer`` (added by ``add_servicer``), started,
    and its port."""
    import grpc

    server = grpc.aio.server()
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _serve_bare(ports: Any, events: list[bytes]) -> None:
    import asyncio

    import uvloop

    from switchyard.api import agent_pb2, agent_pb2_grpc

    messages = [agent_pb2.TaskEvent.FromString(e) for e in events]

    class Bare(agent_pb2_grpc.AgentServiceServicer):
        async def RunTask(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            for event in messages:
                yield event

    async def main() -> None:
        _server, port = await _start(agent_pb2_grpc.add_AgentServiceServicer_to_server, Bare())
        ports.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_stack(ports: Any, tracing: bool, names: tuple[str, ...], store_dir: str, dispatcher_port: int = 0) -> None:
    """Serve the services ``names`` ("dispatcher", "orchestrator" or both) in this process; put the
    port of the last one. The orchestrator calls the dispatcher here, or at ``dispatcher_port``. No DRAM tier and
    the task store in ``store_dir``: never the configured Redis and data/tasks.sqlite3, which a stack that
    ``switchyard up`` runs here owns."""
    import asyncio

    import uvloop

    from switchyard.common import telemetry
    from switchyard.common.config import load_config
    from switchyard.common.server import start_server
    from switchyard.serve import make_service
    from switchyard_harness.bench.sched_bench import own_tier_overrides

    if tracing:
        _install_tracing()

    async def main() -> None:
        config = load_config(None).with_overrides(**ZERO_COST, **own_tier_overrides(None, store_dir))
        interceptors = telemetry.server_interceptors()
        port = dispatcher_port
        if "dispatcher" in names:
            d = await start_server([make_service("dispatcher", config)], "127.0.0.1", 0, config.server,
                                   interceptors=interceptors)
            port = d.port
        if "orchestrator" in names:
            wired = config.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{port}",
                                             "orchestrator.retrieval_addr": "127.0.0.1:1"})
            o = await start_server([make_service("orchestrator", wired)], "127.0.0.1", 0, config.server,
                                   interceptors=interceptors)
            port = o.port
        ports.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_relay(ports: Any, events: list[bytes], names: tuple[str, ...], engine_port: int = 0) -> None:
    """The bare relay's servers ``names`` ("engine", "relay" or both) in this process; put the port of
    the last one. The relay calls the engine here, or at ``engine_port``."""
    import asyncio

    import grpc
    import uvloop

    from switchyard.api import agent_pb2, agent_pb2_grpc

    messages = [agent_pb2.TaskEvent.FromString(e) for e in events]
    chunks = [agent_pb2.GenerateChunk(token=m.token) for m in messages if m.HasField("token")]
    chunks.append(agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(model="relay")))

    class Engine(agent_pb2_grpc.InferenceServiceServicer):
        async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            for chunk in chunks:
                yield chunk

    async def main() -> None:
        nonlocal engine_port
        if "engine" in names:
            _engine, engine_port = await _start(agent_pb2_grpc.add_InferenceServiceServicer_to_server, Engine())
            if "relay" not in names:
                ports.put(engine_port)
                await asyncio.Event().wait()
        stub = agent_pb2_grpc.InferenceServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}"))

        class Relay(agent_pb2_grpc.AgentServiceServicer):
            async def RunTask(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
                stream = stub.Generate(agent_pb2.GenerateRequest(request_id=request.task_id, prompt=request.payload,
                                                                 max_tokens=request.max_tokens), timeout=30)
                for message in messages:
                    if message.HasField("token") or message.HasField("final"):  # its chunk, or the done chunk
                        await stream.read()
                    yield message

        _server, port = await _start(agent_pb2_grpc.add_AgentServiceServicer_to_server, Relay())
        ports.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _typical_call(port: int, calls: int = 32) -> list[bytes]:
    """The events of a typical chat task, serialized: of ``calls`` tasks run at once, one with the
    median number of events (the dispatcher sends tokens that were ready together as one event, so
    the count depends on the load)."""
    import asyncio

    import grpc

    from switchyard.api import agent_pb2, agent_pb2_grpc

    async def run() -> list[list[bytes]]:
        request = agent_pb2.RunTaskRequest(payload=CHAT["payload"], task_type="chat", max_tokens=CHAT["max_tokens"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)

            async def one() -> list[bytes]:
                return [event.SerializeToString() async for event in stub.RunTask(request, timeout=30)]

            return await asyncio.gather(*(one() for _ in range(calls)))

    runs = sorted(asyncio.run(run()), key=len)
    return runs[len(runs) // 2]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None without ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Server:
    """A server of this benchmark in child processes: its port, one call's events, its load so far.

    ``parts`` are (target, args) of its processes, started in order; each part after the first is
    given the port of the one before as its last argument, and the last part's port is the server's.
    """

    def __init__(self, *parts: tuple[Any, tuple]) -> None:
        ctx = mp.get_context("spawn")
        self.processes: list[Any] = []
        port: int | None = None
        for target, args in parts:
            ports = ctx.Queue()
            process = ctx.Process(target=target, args=(ports, *args, *(() if port is None else (port,))), daemon=True)
            process.start()
            self.processes.append(process)
            port = self._port_of(process, ports, target.__name__)
        assert port is not None
        self.port = port
        self.events = _typical_call(self.port)
        self.served = 0
        self.wall_s = 0.0
        self.cpu_s: float | None = 0.0
        self.cpu_by_process: list[float] = [0.0] * len(self.processes)

    @staticmethod
    def _port_of(process: Any, ports: Any, name: str, timeout_s: float = 60.0) -> int:
        """The port ``process`` reports on ``ports``, polled so that a child that exits at start (no config folder,
        a port taken) is reported by its exit code at once instead of after ``timeout_s``.

        Raises:
            RuntimeError: the child exited, or reported nothing within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return ports.get(timeout=0.2)
            except queue.Empty:
                if not process.is_alive():
                    raise RuntimeError(f"{name} exited at start (exit code {process.exitcode}); its error is above") \
                        from None
        raise RuntimeError(f"{name} reported no port within {timeout_s:g} s")

    def drive(self, seconds: float, concurrency: int, warm: bool = False) -> None:
        """Drive it for ``seconds`` (``warm``: 200 calls, not counted)."""
        from switchyard_harness.bench.calldata import parse_calldata
        from switchyard_harness.bench.loadgen import LoadPlan, run_load

        host, items = f"127.0.0.1:{self.port}", parse_calldata(CHAT)
        if warm:  # not measured: in this process (the servers are the children measured), not a client spawned for it
            run_load(LoadPlan(host=host, calldata=items, total=200, concurrency=concurrency), in_process=True)
            return
        before, each_before = self._cpu_seconds(), [_cpu_seconds(p.pid) or 0.0 for p in self.processes]
        load = run_load(LoadPlan(host=host, calldata=items, duration_s=seconds, concurrency=concurrency),
                        in_process=False)
        after, each_after = self._cpu_seconds(), [_cpu_seconds(p.pid) or 0.0 for p in self.processes]
        self.cpu_by_process = [t + a - b for t, a, b in zip(self.cpu_by_process, each_after, each_before)]
        errors = [r.error for r in load.results if r.error]
        if errors:
            print(f"  {len(errors)} calls failed, e.g. {errors[0]}", file=sys.stderr)
        self.served += len(load.results) - len(errors)
        self.wall_s += load.wall_s
        self.cpu_s = None if self.cpu_s is None or before is None or after is None else self.cpu_s + after - before

    def _cpu_seconds(self) -> float | None:
        seconds = [_cpu_seconds(process.pid) for process in self.processes]
        return None if None in seconds else sum(seconds)  # type: ignore[arg-type]

    @property
    def rate(self) -> float:
        """Calls per second served."""
        return self.served / self.wall_s

    @property
    def cpu_per_call_s(self) -> float | None:
        """The server's CPU seconds per call served; None without ``/proc``."""
        return None if self.cpu_s is None or not self.served else self.cpu_s / self.served

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per server (default 10)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent calls (default 64)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="the seconds of each server split into this many windows, taken in turn (default 5)")
    parser.add_argument("--tracing", choices=["off", "on"], default="off",
                        help="on: tracing as switchyard serve runs it, 10 %% ratio sampling, spans dropped "
                        "(default off)")
    parser.add_argument("--stack", choices=["processes", "one-process"], default="processes",
                        help="processes: the dispatcher and the orchestrator each in its own process, as deployed "
                        "and as switchyard bench compare runs them (and the bare relay's two servers likewise); "
                        "one-process: both in one (default processes)")
    args = parser.parse_args(argv)
    # nan or -1 ended in a traceback naming --duration (the load plan's own flag) and -0.2; 0 ran the load plan's
    # default call count instead and printed it as a measurement; --rounds 0 measured nothing
    if not 0 < args.seconds < math.inf:
        parser.error(f"--seconds: expected a finite number of seconds > 0, got {args.seconds:g}")
    for flag, value in (("--concurrency", args.concurrency), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag}: expected a count >= 1, got {value}")
    os.environ.setdefault("OTEL_SDK_DISABLED", "false")
    tracing = args.tracing == "on"
    servers: list[_Server] = []
    store = tempfile.TemporaryDirectory(prefix="pipeline-overhead-tasks-")
    try:
        if args.stack == "processes":
            servers.append(_Server((_serve_stack, (tracing, ("dispatcher",), store.name)),
                                   (_serve_stack, (tracing, ("orchestrator",), store.name))))
        else:
            servers.append(_Server((_serve_stack, (tracing, ("dispatcher", "orchestrator"), store.name))))
        events = servers[0].events
        servers.append(_Server((_serve_bare, (events,))))
        if args.stack == "processes":
            servers.append(_Server((_serve_relay, (events, ("engine",))), (_serve_relay, (events, ("relay",)))))
        else:
            servers.append(_Server((_serve_relay, (events, ("engine", "relay")))))
        for server in servers:
            server.drive(0, args.concurrency, warm=True)
        for _ in range(args.rounds):  # interleaved: a change in the machine's load meets all three alike
            for server in servers:
                server.drive(args.seconds / args.rounds, args.concurrency)
    except RuntimeError as exc:  # a server of the run did not start (_Server._port_of); its children are daemons
        print(f"pipeline_overhead.py: {exc}", file=sys.stderr)
        return 1
    finally:
        for server in servers:
            server.stop()
        store.cleanup()
    (stack, stack_cpu), (floor, floor_cpu), (relay, relay_cpu) = ((s.rate, s.cpu_per_call_s) for s in servers)
    print(f"bare grpc.aio floor: {floor:8.1f} calls/s ({len(events)} messages per call)")
    print(f"bare relay:          {relay:8.1f} calls/s (the same messages through a bare Generate stream)")
    print(f"stack (tracing {args.tracing}): {stack:8.1f} calls/s (chat, max_tokens 8, zero-cost sim engine, "
          f"{'a process per service' if args.stack == 'processes' else 'one process'})")
    print(f"pipeline / floor:    {stack / floor:8.2f} (bare relay / floor {relay / floor:.2f}: a Generate call per task)")
    if stack_cpu and floor_cpu and relay_cpu:
        print(f"server CPU per call: floor {floor_cpu * 1e6:.0f} us, bare relay {relay_cpu * 1e6:.0f} us, "
              f"stack {stack_cpu * 1e6:.0f} us (floor / stack {floor_cpu / stack_cpu:.2f}, "
              f"floor / bare relay {floor_cpu / relay_cpu:.2f})")
        if args.stack == "processes" and servers[0].served:
            dispatcher_s, orchestrator_s = servers[0].cpu_by_process
            print(f"stack CPU per call:  dispatcher {dispatcher_s / servers[0].served * 1e6:.0f} us, "
                  f"orchestrator {orchestrator_s / servers[0].served * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
