"""``switchyard bench isolation``: what background load costs a core task, and what an idle dispatcher costs.

Three figures, measured on a real dispatcher (gRPC on 127.0.0.1, the
configured engine, in this process):

- **idle wait**: the inference-queue wait (``GenerateDone.queue_wait_s``) of a
  lone request on an idle dispatcher: an idle engine must take it at once,
  not after a flush interval;
- **core TTFT under load**: the TTFT of CORE requests, one at a time, first on
  an idle dispatcher, then while ``--batch`` BATCH requests run (long
  one after another, each worker keeping one running slot busy). Reported as
  P50/P95 and the loaded/unloaded ratio;
- **what it costs the batch work**: the BATCH requests' inter-token latency,
  as their streams receive the tokens (a gap of an event carrying ``count``
  tokens is split evenly among them), P50/P95 over the last half of the
  warm-up, before any core request, and while the core requests run: a core
  prefill that preempts a step in flight (``scheduler.core_preemption``
  ``layer``), or that runs between two steps, lengthens that step's gap.

The same prompt is used throughout, so the two TTFTs differ only by the load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.bench.report import percentile
from switchyard.common.config import ConfigError, load_config
from switchyard.common.server import start_server
from switchyard.common.channels import open_channel
from switchyard.common.cli_text import parser_for

PROMPT = (
    "<context>\n[1] The with statement\nThe with statement is used to wrap the execution of a block with "
    "methods defined by a context manager.\n</context>\n<question>How does the with statement work?</question>"
)


async def _ttft(stub: Any, priority: int, max_tokens: int) -> agent_pb2.GenerateDone:
    request = agent_pb2.GenerateRequest(prompt=PROMPT, priority=priority, max_tokens=max_tokens)
    done = None
    async for chunk in stub.Generate(request, timeout=60):
        if chunk.HasField("done"):
            done = chunk.done
    assert done is not None
    return done


async def measure(config: Any, samples: int, batch: int) -> dict[str, Any]:
    """Run the measurements; returns the figures in seconds."""
    from switchyard.dispatcher.service import DispatcherService

    service = DispatcherService(config)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    try:
        async with open_channel(f"127.0.0.1:{srv.port}", peer="dispatcher") as channel:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            await _ttft(stub, agent_pb2.CORE, 4)  # warm-up
            idle_waits, unloaded = [], []
            for _ in range(samples):
                done = await _ttft(stub, agent_pb2.CORE, 4)
                idle_waits.append(done.queue_wait_s)
                unloaded.append(done.ttft_s)
                await asyncio.sleep(0.01)
            stop = asyncio.Event()
            gaps: list[tuple[float, float]] = []  # (received at, seconds per token) of the batch streams

            async def keep_busy() -> None:  # one BATCH request after another: one running slot kept full
                while not stop.is_set():
                    await _batch_stream(stub, gaps)

            background = [asyncio.create_task(keep_busy()) for _ in range(batch)]
            await asyncio.sleep(0.25)
            quiet_from = time.monotonic()
            await asyncio.sleep(0.25)
            loaded_from = time.monotonic()
            loaded, running = [], []
            for _ in range(samples):
                running.append(service.scheduler.num_running)
                loaded.append((await _ttft(stub, agent_pb2.CORE, 4)).ttft_s)
                await asyncio.sleep(0.01)
            loaded_until = time.monotonic()
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
    finally:
        await srv.stop(1.0)
    return {
        "idle_queue_wait_s": {"p50": percentile(idle_waits, 50), "p95": percentile(idle_waits, 95)},
        "core_ttft_unloaded_s": {"p50": percentile(unloaded, 50), "p95": percentile(unloaded, 95)},
        "core_ttft_loaded_s": {"p50": percentile(loaded, 50), "p95": percentile(loaded, 95)},
        "batch_itl_quiet_s": _p50_p95([g for at, g in gaps if quiet_from <= at < loaded_from]),
        "batch_itl_loaded_s": _p50_p95([g for at, g in gaps if loaded_from <= at < loaded_until]),
        "batch_running": sum(running) / len(running),
        "p95_ratio": percentile(loaded, 95) / percentile(unloaded, 95),
        "core_preemption": config.scheduler.core_preemption,
    }


def _p50_p95(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95)}


async def _batch_stream(stub: Any, gaps: list[tuple[float, float]]) -> None:
    """One BATCH request of 256 tokens; appends each token's gap after the previous one, as received."""
    request = agent_pb2.GenerateRequest(prompt=PROMPT, priority=agent_pb2.BATCH, max_tokens=256)
    last = None
    async for chunk in stub.Generate(request, timeout=60):
        if not chunk.HasField("token"):
            continue
        now = time.monotonic()
        count = max(1, chunk.token.count)
        if last is not None:
            gaps.extend([(now, (now - last) / count)] * count)
        last = now


def main(argv: list[str]) -> int:
    """``switchyard bench isolation [--samples N] [--batch N] [--json]``."""
    parser = parser_for("switchyard bench isolation", __doc__)
    parser.add_argument("--samples", type=int, default=50, help="core requests per measurement (default 50)")
    parser.add_argument("--batch", type=int, default=30, help="BATCH requests running in the background (default 30)")
    parser.add_argument("--config-dir", help="config folder (default $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch < 0:
        parser.error("--samples must be >= 1 and --batch >= 0")
    try:
        config = load_config(args.config_dir)
    except ConfigError as exc:
        print(f"switchyard bench isolation: {exc}", file=sys.stderr)
        return 2
    import uvloop

    figures = uvloop.run(measure(config, args.samples, args.batch))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    ms = {k: {p: v * 1000 for p, v in d.items()} for k, d in figures.items() if isinstance(d, dict)}
    print(f"idle dispatcher, lone request: inference-queue wait P50 {ms['idle_queue_wait_s']['p50']:.3f} ms, "
          f"P95 {ms['idle_queue_wait_s']['p95']:.3f} ms")
    print(f"core TTFT unloaded:            P50 {ms['core_ttft_unloaded_s']['p50']:.1f} ms, "
          f"P95 {ms['core_ttft_unloaded_s']['p95']:.1f} ms")
    print(f"core TTFT, {figures['batch_running']:.0f} batch running:   P50 {ms['core_ttft_loaded_s']['p50']:.1f} ms, "
          f"P95 {ms['core_ttft_loaded_s']['p95']:.1f} ms")
    print(f"loaded / unloaded P95: {figures['p95_ratio']:.2f}x (scheduler.core_preemption "
          f"{figures['core_preemption']})")
    print(f"batch inter-token latency, before any core request: P50 {ms['batch_itl_quiet_s']['p50']:.1f} ms, "
          f"P95 {ms['batch_itl_quiet_s']['p95']:.1f} ms; beside the core requests: "
          f"P50 {ms['batch_itl_loaded_s']['p50']:.1f} ms, P95 {ms['batch_itl_loaded_s']['p95']:.1f} ms")
    return 0
