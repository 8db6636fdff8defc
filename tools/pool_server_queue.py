"""Each pool endpoint's adaptive limit against the server's own queue: a real dispatcher over two sim-openai.

    python tools/pool_server_queue.py [--seconds 30] [--streams 24] [--max-running 2]

Two ``sim-openai`` replicas, each running at most ``--max-running`` streams at once (vLLM's ``--max-num-seqs``:
later ones wait inside the server, reported as ``vllm:num_requests_waiting``); a dispatcher on the ``openai``
engine with ``model_gateway.pool`` listing both; ``--streams`` BATCH Generate calls kept running (32 tokens
each, an agent each). Every 2 s the per-endpoint limit, streams in flight and server-reported waiting are read
from the dispatcher's metrics. Prints calls/s and the means of those figures per endpoint: a limit past the
server's knee shows as requests waiting inside the server, where a CORE stream would queue behind BATCH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import time

from prometheus_client import REGISTRY, generate_latest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.service import DispatcherService
from switchyard_harness.arg_types import count, positive
from switchyard_harness.sim_openai import SimOpenAIOptions, run_in_thread

FIGURES = ("concurrency_limit", "in_flight", "server_waiting")


def sample() -> dict[tuple[str, str], float]:
    found = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if m := re.match(r'switchyard_gateway_endpoint_(\w+)\{endpoint="([^"]+)"\} (\S+)', line):
            if m.group(1) in FIGURES:
                found[(m.group(2), m.group(1))] = float(m.group(3))
    return found


async def run(seconds: float, streams: int, max_running: int) -> None:
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(run_in_thread(SimOpenAIOptions(max_running=max_running))) for _ in range(2)]
        cfg = load_config("config").with_overrides(**{
            "dispatcher.engine": "openai", "upstream.base_url": sims[0].base_url, "upstream.fallback_model": "",
            "upstream.pool.endpoints": [s.base_url for s in sims], "upstream.api_key_required": False})
        async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as server:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                stop, calls, samples = time.monotonic() + seconds, [0], []

                async def caller(i: int) -> None:
                    while time.monotonic() < stop:
                        request = agent_pb2.GenerateRequest(prompt=f"tell me about lists {i} {calls[0]}", max_tokens=32,
                                                            priority=agent_pb2.BATCH, agent_id=f"agent-{i}")
                        async for _ in stub.Generate(request):
                            pass
                        calls[0] += 1

                async def watch() -> None:
                    await asyncio.sleep(min(5.0, seconds / 4))  # past the first probes
                    while time.monotonic() < stop:
                        samples.append(sample())
                        await asyncio.sleep(2.0)

                started = time.monotonic()
                await asyncio.gather(watch(), *(caller(i) for i in range(streams)))
                elapsed = time.monotonic() - started
    print(f"{calls[0]} calls in {elapsed:.1f} s: {calls[0] / elapsed:.1f} calls/s "
          f"({streams} BATCH streams, 2 replicas of --max-running {max_running})")
    for endpoint in sorted({e for s in samples for e, _ in s}):
        means = {f: statistics.fmean(s.get((endpoint, f), 0.0) for s in samples) for f in FIGURES}
        print(f"  {endpoint}: limit {means['concurrency_limit']:.1f}, in flight {means['in_flight']:.1f}, "
              f"waiting inside the server {means['server_waiting']:.1f} (means of {len(samples)} reads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=positive, default=30.0, help="load window, seconds (default 30)")
    parser.add_argument("--streams", type=count, default=24, help="BATCH streams at once (default 24)")
    parser.add_argument("--max-running", type=count, default=2, help="sequences each replica runs at once (default 2)")
    args = parser.parse_args()
    asyncio.run(run(args.seconds, args.streams, args.max_running))


if __name__ == "__main__":
    main()
