"""What the operator's view costs: series and bytes per scrape, and one `switchyard top` frame.

Usage: switchyard up --free-ports &   then   python tools/operator_view_cost.py [--tasks 5] [--frames 20]

It reads the endpoints `switchyard up` wrote to its up file, runs ``--tasks``
RunTasks of each priority class (core, normal, batch) at once, then prints per
service the size of one ``/metrics`` scrape (bytes, samples: what Prometheus
stores per scrape) and the mean time of one `switchyard top` frame (three
scrapes on threads, the snapshot, the rich renderables), over ``--frames``
frames.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.up_files import default_path, recorded_services
from switchyard_harness import top
from switchyard_harness.arg_types import count


async def _tasks(address: str, per_class: int) -> None:
    async with open_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)

        async def one(priority: int) -> None:
            request = agent_pb2.RunTaskRequest(payload="What does the with statement do?", priority=priority)
            [e async for e in stub.RunTask(request, timeout=120)]

        await asyncio.gather(*(one(p) for p in (agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH)
                               for _ in range(per_class)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=count, default=5, help="RunTasks per priority class (default 5)")
    parser.add_argument("--frames", type=count, default=20, help="top frames to time (default 20)")
    args = parser.parse_args()
    services = recorded_services(default_path())
    asyncio.run(_tasks(services["orchestrator"]["address"], args.tasks))
    endpoints = {name: s["metrics_url"] for name, s in services.items()}
    for name, url in endpoints.items():
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        print(f"{name:<13} scrape {len(text):>6} bytes  {samples:>4} samples")
    with ThreadPoolExecutor(len(endpoints)) as pool:
        previous = top.scrape_all(endpoints, pool)
        started = time.perf_counter()
        for _ in range(args.frames):
            current = top.scrape_all(endpoints, pool)
            top.render(top.snapshot(current, previous), "up file")
            previous = current
        print(f"top frame: {(time.perf_counter() - started) / args.frames * 1000:.1f} ms "
              f"(mean of {args.frames}; the refresh interval is 1000 ms)")


if __name__ == "__main__":
    main()
