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
- **core TTFT with the KV budget full** (step engines with a KV budget): the
  same CORE requests while ``--batch`` BATCH workers each keep a long request
  going (``--full-output`` output tokens, the prompt sized so that
  ``--full-running`` of them fill the KV budget to less than one core
  request's reservation; the rest wait), so every core request must preempt
  to fit. The KV budget's free bytes are read before each probe, and the
  preemptions it took are counted;
- **what it costs the batch work**: the BATCH requests' inter-token latency,
  as their streams receive the tokens (a gap of an event carrying ``count``
  tokens is split evenly among them), P50/P95 over the last half of the
  warm-up, before any core request, and while the core requests run: a core
  prefill that preempts a step in flight (``scheduler.core_preemption``
  ``layer``), or that runs between two steps, lengthens that step's gap.

The same prompt is used throughout, so the TTFTs differ only by the load.
The DRAM tier is a real Redis (``--dram``, as ``bench sched``: an embedded
redis-server by default), so a preempted victim's KV may be swapped out.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any


from switchyard_harness import json_output
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard_harness.bench.report import percentile
from switchyard_harness.bench.sched_bench import _dram_arg, _dram_tier
from switchyard.common.config import ConfigError, load_config
from switchyard.common.server import start_server
from switchyard.common.channels import open_channel
from switchyard.common.cli_text import parser_for
from switchyard.dispatcher.request import word_pieces

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


async def measure(config: Any, samples: int, batch: int, full_running: int = 26,
                  full_output: int = 512) -> dict[str, Any]:
    """Run the measurements; returns the figures in seconds (the KV-full ones absent without a KV budget)."""
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
            full = await _kv_full(service, stub, samples, batch, full_running, full_output)
    finally:
        await srv.stop(1.0)
    return {
        **full,
        "idle_queue_wait_s": {"p50": percentile(idle_waits, 50), "p95": percentile(idle_waits, 95)},
        "core_ttft_unloaded_s": {"p50": percentile(unloaded, 50), "p95": percentile(unloaded, 95)},
        "core_ttft_loaded_s": {"p50": percentile(loaded, 50), "p95": percentile(loaded, 95)},
        "batch_itl_quiet_s": _p50_p95([g for at, g in gaps if quiet_from <= at < loaded_from]),
        "batch_itl_loaded_s": _p50_p95([g for at, g in gaps if loaded_from <= at < loaded_until]),
        "batch_running": sum(running) / len(running),
        "p95_ratio": percentile(loaded, 95) / percentile(unloaded, 95),
        **({"kv_full_p95_ratio": full["core_ttft_kv_full_s"]["p95"] / percentile(unloaded, 95)} if full else {}),
        "core_preemption": config.scheduler.core_preemption,
    }


async def _kv_full(service: Any, stub: Any, samples: int, batch: int, running: int,
                   output: int) -> dict[str, Any]:
    """Core TTFT while ``batch`` BATCH workers' long requests fill the KV budget (``running`` of them fit)."""
    from switchyard.dispatcher.scheduler.capacity import KvBudget
    from switchyard.dispatcher.metrics import PREEMPTIONS

    scheduler = service.scheduler
    budget = scheduler.capacity
    if not isinstance(budget, KvBudget) or batch < running:
        return {}
    per_token = budget.info.kv_bytes_per_token
    prompt_tokens = budget.budget_bytes // per_token // running - output
    stop = asyncio.Event()
    request = agent_pb2.GenerateRequest(prompt=PROMPT, priority=agent_pb2.BATCH, max_tokens=output,
                                        prompt_tokens=prompt_tokens)

    async def keep_full() -> None:
        while not stop.is_set():
            async for _ in stub.Generate(request, timeout=120):
                pass

    background = [asyncio.create_task(keep_full()) for _ in range(batch)]
    try:
        for _ in range(600):  # up to 30 s for the workers' prefills to fill the budget
            await asyncio.sleep(0.05)
            if scheduler.num_running >= running and scheduler.num_waiting >= 1:
                break
        probe_need = len(word_pieces(PROMPT)) + 4  # the probe's KV reservation: its prompt and 4 tokens
        ttfts, full, running_seen, preempted = [], 0, [], []

        def preemptions() -> float:
            return sum(PREEMPTIONS.labels(name)._value.get() for name in ("normal", "batch"))

        for _ in range(samples):
            full += budget.free_bytes < probe_need * per_token
            running_seen.append(scheduler.num_running)
            before = preemptions()
            done = await _ttft(stub, agent_pb2.CORE, 4)
            ttfts.append(done.ttft_s)
            preempted.append(preemptions() - before)
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    return {
        "core_ttft_kv_full_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "kv_full": {"batch_prompt_tokens": prompt_tokens, "batch_output_tokens": output,
                    "batch_running": sum(running_seen) / len(running_seen), "probes": len(ttfts),
                    "probes_finding_kv_full": full, "preemptions_per_probe": sum(preempted) / len(preempted)},
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
    parser.add_argument("--full-running", type=int, default=26,
                        help="KV-full variant: BATCH requests that fill the KV budget (default 26; the rest of "
                             "--batch wait)")
    parser.add_argument("--full-output", type=int, default=512,
                        help="KV-full variant: output tokens of each BATCH request (default 512)")
    parser.add_argument("--dram", type=_dram_arg, default="embedded",
                        help="DRAM tier: embedded (a private redis-server, default), HOST:PORT, or off")
    parser.add_argument("--config-dir", help="config folder (default $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch < 0 or args.full_running < 1 or args.full_output < 1:
        parser.error("--samples, --full-running and --full-output must be >= 1 and --batch >= 0")
    try:
        config = load_config(args.config_dir)
    except ConfigError as exc:
        print(f"switchyard bench isolation: {exc}", file=sys.stderr)
        return 2
    import uvloop

    with contextlib.ExitStack() as stack:
        dram, dram_text = _dram_tier(args.dram, config.memory.dram, stack)
        if dram is None:
            config = config.with_overrides(**{"memory.dram.kv_swap": False})
        else:
            config = config.with_overrides(**{"memory.dram.host": dram.host, "memory.dram.port": dram.port,
                                              "memory.dram.embedded": False})
        figures = uvloop.run(measure(config, args.samples, args.batch, args.full_running, args.full_output))
    figures["dram"] = dram_text
    if args.json:
        print(json_output.dumps(figures, indent=2))
        return 0
    print(f"DRAM tier: {dram_text}")
    ms = {k: {p: v * 1000 for p, v in d.items()} for k, d in figures.items() if isinstance(d, dict)}
    print(f"idle dispatcher, lone request: inference-queue wait P50 {ms['idle_queue_wait_s']['p50']:.3f} ms, "
          f"P95 {ms['idle_queue_wait_s']['p95']:.3f} ms")
    print(f"core TTFT unloaded:            P50 {ms['core_ttft_unloaded_s']['p50']:.1f} ms, "
          f"P95 {ms['core_ttft_unloaded_s']['p95']:.1f} ms")
    print(f"core TTFT, {figures['batch_running']:.0f} batch running:   P50 {ms['core_ttft_loaded_s']['p50']:.1f} ms, "
          f"P95 {ms['core_ttft_loaded_s']['p95']:.1f} ms")
    print(f"loaded / unloaded P95: {figures['p95_ratio']:.2f}x (scheduler.core_preemption "
          f"{figures['core_preemption']})")
    if "kv_full" in figures:
        full = figures["kv_full"]
        print(f"core TTFT, KV budget full:     P50 {ms['core_ttft_kv_full_s']['p50']:.1f} ms, "
              f"P95 {ms['core_ttft_kv_full_s']['p95']:.1f} ms ({full['batch_running']:.0f} batch running of "
              f"{full['batch_prompt_tokens']} + {full['batch_output_tokens']} tokens, the rest waiting; "
              f"{full['probes_finding_kv_full']}/{full['probes']} probes found no room, "
              f"{full['preemptions_per_probe']:.2f} preemptions per probe)")
        print(f"KV full / unloaded P95: {figures['kv_full_p95_ratio']:.2f}x")
    else:
        print("core TTFT, KV budget full: not measured (the engine has no KV budget, or --batch < --full-running)")
    print(f"batch inter-token latency, before any core request: P50 {ms['batch_itl_quiet_s']['p50']:.1f} ms, "
          f"P95 {ms['batch_itl_quiet_s']['p95']:.1f} ms; beside the core requests: "
          f"P50 {ms['batch_itl_loaded_s']['p50']:.1f} ms, P95 {ms['batch_itl_loaded_s']['p95']:.1f} ms")
    return 0
