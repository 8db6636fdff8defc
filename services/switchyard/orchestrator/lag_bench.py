"""Benchmark: event-loop lag of the orchestrator with CPU steps on the loop vs in the pool.

    python -m switchyard.orchestrator.lag_bench [--tasks 400] [--concurrency 32] [--words 3000]

Starts a dispatcher (sim engine) as a separate process and an orchestrator in
this process, then runs the same set of ``chat`` tasks with large payloads
(so render_prompt and count_tokens cost real CPU) twice: with
``orchestrator.cpu_pool_threads = 0`` (CPU steps on the event loop) and with
the shipped pool. A probe task sleeps 1 ms in a loop on the orchestrator's
event loop and records how late it wakes (the lag every stream's next token
would see). Prints tasks/s and lag percentiles per mode; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import grpc
import uvloop

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.launcher import free_port, healthy
from switchyard.orchestrator.service import OrchestratorService


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _probe(lags: list[float], stop: asyncio.Event, interval: float = 0.001) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(time.perf_counter() - start - interval)


async def _run_mode(threads: int, dispatcher: str, args: argparse.Namespace) -> dict[str, float]:
    cfg = load_config(args.config_dir).with_overrides(**{
        "service.orchestrator.dispatcher_addr": dispatcher,
        "service.orchestrator.cpu_pool_threads": threads,
        "service.orchestrator.max_prompt_tokens": 100_000,
    })
    words = " ".join(f"word{i % 97} and {{{{ braces }}}} text" for i in range(args.words // 4))
    async with running([OrchestratorService(cfg)], cfg.service.server) as srv:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with sem:
                    request = agent_pb2.RunTaskRequest(payload=f"{i} {words}", task_type="chat", max_tokens=8)
                    async for _ in stub.RunTask(request):
                        pass

            lags: list[float] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_probe(lags, stop))
            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.tasks)))
            elapsed = time.perf_counter() - started
            stop.set()
            await probe
    return {
        "tasks_per_s": args.tasks / elapsed,
        "lag_p50_ms": _pct(lags, 0.50) * 1000,
        "lag_p99_ms": _pct(lags, 0.99) * 1000,
        "lag_max_ms": max(lags) * 1000 if lags else 0.0,
        "lag_mean_ms": statistics.fmean(lags) * 1000 if lags else 0.0,
    }


async def _main(args: argparse.Namespace) -> None:
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--port", str(port), "--metrics-port", "0"]
    if args.config_dir:
        cmd += ["--config-dir", args.config_dir]
    proc = subprocess.Popen(cmd, env=dict(os.environ, SWITCHYARD_ENGINE="sim"), stderr=subprocess.DEVNULL)
    try:
        while not healthy(address, "agent.InferenceService"):
            if proc.poll() is not None:
                raise SystemExit("dispatcher failed to start")
            await asyncio.sleep(0.2)
        pool_threads = load_config(args.config_dir).service.orchestrator.cpu_pool_threads or 4
        rows = []
        for label, threads in (("on the event loop", 0), (f"thread pool ({pool_threads})", pool_threads)):
            rows.append((label, await _run_mode(threads, address, args)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(f"orchestrator CPU steps: {args.tasks} chat tasks, concurrency {args.concurrency}, "
          f"~{args.words}-word payloads, {os.cpu_count()} CPUs")
    print(f"{'CPU steps run':<22}{'tasks/s':>9}{'lag p50 ms':>12}{'lag p99 ms':>12}{'lag max ms':>12}")
    for label, r in rows:
        print(f"{label:<22}{r['tasks_per_s']:>9.1f}{r['lag_p50_ms']:>12.2f}{r['lag_p99_ms']:>12.2f}{r['lag_max_ms']:>12.2f}")
    base, pool = rows[0][1], rows[1][1]
    if pool["lag_p99_ms"] > 0:
        print(f"p99 lag ratio loop/pool: {base['lag_p99_ms'] / pool['lag_p99_ms']:.2f}x; "
              f"throughput ratio pool/loop: {pool['tasks_per_s'] / base['tasks_per_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchyard.orchestrator.lag_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--words", type=int, default=3000, help="approximate payload size in words")
    parser.add_argument("--config-dir")
    args = parser.parse_args(argv)
    uvloop.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
