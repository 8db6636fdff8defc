"""Benchmark: event-loop lag of the orchestrator with CPU steps on the loop, in threads, in processes.

    python -m switchyard_harness.bench.orchestrator_lag [--tasks 400] [--concurrency 32] [--words 3000]

Starts a dispatcher (sim engine) as a separate process and an orchestrator in
this process, drives it with ``switchyard bench run`` from a third process, and
runs the same set of ``chat`` tasks with large payloads
(so rendering and counting the prompt cost real CPU) twice, against a
dispatcher whose sim engine costs almost nothing (``--real-engine`` keeps the
7B latency model, where the engine is the bottleneck instead),: with
``orchestrator.cpu_executor`` = loop, thread and process. A probe task sleeps 1 ms in a loop on the orchestrator's
event loop and records how late it wakes (the lag every stream's next token
would see). Prints tasks/s and lag percentiles per mode; asserts nothing. The orchestrators have no
DRAM tier and a task store in the run's temporary folder (never the configured Redis and
``data/tasks.sqlite3``, which a stack that ``switchyard up`` runs here owns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from switchyard.common import envs
from switchyard.common.config import load_config
from switchyard_harness.bench.sched_bench import own_tier_overrides
from switchyard.common.server import running
from switchyard.common.children import dying_with_parent
from switchyard.launcher import healthy
from switchyard.orchestrator.service import OrchestratorService


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _probe(lags: list[float], stop: asyncio.Event, interval: float = 0.001) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(time.perf_counter() - start - interval)


async def _run_mode(executor: str, dispatcher: str, args: argparse.Namespace, store_dir: str) -> dict[str, float]:
    cfg = load_config(args.config_dir).with_overrides(**{
        # no DRAM tier and a task store in the run's folder: never the configured [dram] Redis and
        # data/tasks.sqlite3, which a stack that switchyard up runs here owns
        **own_tier_overrides(None, store_dir),
        "orchestrator.dispatcher_addr": dispatcher,
        "orchestrator.cpu_executor": executor,
        "limits.default_context_window_tokens": 200_000,
        "limits.context_window_tokens": {},
    })
    words = " ".join(f"word{i % 97} and {{{{ braces }}}} text" for i in range(args.words // 4))
    data = [{"payload": f"{i} {words}", "task_type": "chat", "max_tokens": 8} for i in range(16)]
    async with running([OrchestratorService(cfg)], cfg.server) as srv:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as data_file:
            json.dump(data, data_file)
            data_file.flush()
            lags: list[float] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_probe(lags, stop))
            started = time.perf_counter()
            # The load comes from another process so that only the orchestrator runs on this loop.
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "switchyard.cli", "bench", "run", "--host", f"127.0.0.1:{srv.port}",
                "-n", str(args.tasks), "-c", str(args.concurrency), "-D", data_file.name, "--procs", "1",
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if await client.wait() != 0:
                raise SystemExit("the load generator failed")
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


def _fast_engine_config(source: str | None, target: Path) -> str:
    """A copy of the config folder whose sim engine costs ~nothing, so the orchestrator is the bottleneck."""
    shutil.copytree(source or envs.SWITCHYARD_CONFIG_DIR.get(), target)
    path = target / "switchyard.json"
    data = json.loads(path.read_text())
    data["sim"].update(prefill_overhead_ms=0.1, prefill_per_token_ms=0.0, decode_base_ms=0.2, decode_per_seq_ms=0.0)
    path.write_text(json.dumps(data))
    return str(target)


async def _main(args: argparse.Namespace) -> None:
    tmp = tempfile.TemporaryDirectory()
    port_file = Path(tmp.name) / "ports.json"  # the dispatcher binds port 0 itself and reports it here
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--port", "0", "--metrics-port", "0",
           "--port-file", str(port_file)]
    config_dir = args.config_dir if args.real_engine else _fast_engine_config(args.config_dir, Path(tmp.name) / "c")
    if config_dir:
        cmd += ["--config-dir", config_dir]
    proc = subprocess.Popen(dying_with_parent(cmd, signal.SIGTERM), env=dict(os.environ, SWITCHYARD_ENGINE="sim"),
                            stderr=subprocess.DEVNULL)
    try:
        while not port_file.exists() or not healthy(
                address := f"127.0.0.1:{json.loads(port_file.read_text())['port']}", "agent.InferenceService"):
            if proc.poll() is not None:
                raise SystemExit("dispatcher failed to start")
            await asyncio.sleep(0.2)
        workers = load_config(args.config_dir).orchestrator.cpu_workers
        rows = []
        for label, executor in (("event loop", "loop"), (f"{workers} threads", "thread"),
                                (f"{workers} processes", "process")):
            rows.append((label, await _run_mode(executor, address, args, tmp.name)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        tmp.cleanup()
    print(f"orchestrator CPU steps: {args.tasks} chat tasks, concurrency {args.concurrency}, "
          f"~{args.words}-word payloads, {os.cpu_count()} CPUs")
    print(f"{'CPU steps run':<22}{'tasks/s':>9}{'lag p50 ms':>12}{'lag p99 ms':>12}{'lag max ms':>12}")
    for label, r in rows:
        print(f"{label:<22}{r['tasks_per_s']:>9.1f}{r['lag_p50_ms']:>12.2f}{r['lag_p99_ms']:>12.2f}{r['lag_max_ms']:>12.2f}")
    base = rows[0][1]
    for label, r in rows[1:]:
        ratio = base["lag_p99_ms"] / r["lag_p99_ms"] if r["lag_p99_ms"] else float("inf")
        print(f"{label}: p99 lag {ratio:.2f}x lower than on the loop; "
              f"throughput {r['tasks_per_s'] / base['tasks_per_s']:.2f}x")

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchyard_harness.bench.orchestrator_lag", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--words", type=int, default=3000, help="approximate payload size in words")
    parser.add_argument("--config-dir")
    parser.add_argument("--real-engine", action="store_true",
                        help="keep the sim engine's 7B latency model (default: near-zero cost, so CPU steps dominate)")
    args = parser.parse_args(argv)
    # --tasks 0 or -1 started a dispatcher and three orchestrators to end in "the load generator failed"; --words
    # 0 or -5 measured one-word payloads, reported as "~0-word payloads"
    for flag, value in (("--tasks", args.tasks), ("--concurrency", args.concurrency), ("--words", args.words)):
        if value < 1:
            parser.error(f"{flag}: expected a count >= 1, got {value}")
    uvloop.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
