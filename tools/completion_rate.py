"""Submitted tasks completed per second against a running stack, and each service's CPU per task.

Offers the field's submit body (react_loop, max_tokens 512, random agent-<1..1000> and priority class) to
the HTTP face at a fixed ``--rps`` for ``--seconds`` (open loop), and every ``--interval`` seconds prints
one row: tasks finished per second (the orchestrator's ``switchyard_tasks_total`` of that task type),
generated tokens per task and engine busy ratio (the dispatcher's counters), the orchestrator's RSS and
backlog, and each service's CPU as cores and as milliseconds per finished task (``/proc/PID/stat`` of
the service and its child processes, so the orchestrator's CPU-pool workers count). The last line sums
the run after its first row. At the end the tasks it submitted that have not finished (at the field's rate
most of them: the stack completes fewer than it is offered) are cancelled and one line reports them, as the
locustfile and ``switchyard bench http`` do (switchyard_harness.backlog), so no load goes on after it exits;
``--keep-backlog`` leaves them running.

    switchyard up --free-ports        # in one shell; writes the up file
    python tools/completion_rate.py --http http://127.0.0.1:8080 --rps 40 --seconds 150

The metrics URLs and pids come from the up file ``switchyard up`` writes (``$SWITCHYARD_UP_FILE``, else
its default place); the HTTP face's URL is not in it: pass ``--http`` (``switchyard up`` prints it). Linux
only (``/proc``). The load generator shares the machine: read CPU per task, not absolute rates, across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
import urllib.request
from pathlib import Path

import aiohttp

from switchyard.common.up_files import default_path, recorded_services
from switchyard.common.metrics import TASK_TYPES
from switchyard_harness import backlog
from switchyard_harness.arg_types import http_url, max_tokens, positive

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its direct children (0 for a process that is gone)."""
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def scrape(url: str, name: str, contains: str = "") -> float:
    """The sum of the samples of ``name`` at ``url`` whose line contains ``contains``."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or contains not in line:
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name:
            total += float(value)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", type=http_url, required=True, help="the HTTP face, e.g. http://127.0.0.1:8080")
    parser.add_argument("--rps", type=positive, default=40.0, help="submits offered per second (default 40)")
    parser.add_argument("--seconds", type=positive, default=150.0, help="how long (default 150)")
    parser.add_argument("--interval", type=positive, default=10.0, help="seconds per row (default 10)")
    parser.add_argument("--task-type", choices=TASK_TYPES, default="react_loop")
    parser.add_argument("--max-tokens", type=max_tokens, default=512, help="max_tokens of each task (default 512)")
    parser.add_argument("--keep-backlog", action="store_true", help="leave the submitted tasks that have not "
                        "finished at the end running (default: they are cancelled, and reported)")
    args = parser.parse_args()
    services = recorded_services(default_path())
    orchestrator, dispatcher = services["orchestrator"]["metrics_url"], services["dispatcher"]["metrics_url"]

    def snapshot() -> dict:
        return {"t": time.monotonic(),
                "done": scrape(orchestrator, "switchyard_tasks_total", f'task_type="{args.task_type}"'),
                "cpu": {name: cpu_seconds(s["pid"]) for name, s in services.items()},
                "tokens": scrape(dispatcher, "switchyard_generated_tokens_total"),
                "busy": scrape(dispatcher, "switchyard_engine_busy_seconds_total"),
                "rss_mb": scrape(orchestrator, "process_resident_memory_bytes") / 1e6,
                "queued": scrape(orchestrator, "switchyard_submitted_tasks", "queued")}

    def row(a: dict, b: dict, label: str) -> str:
        dt, done = b["t"] - a["t"], b["done"] - a["done"]
        cores = {k: round((b["cpu"][k] - a["cpu"][k]) / dt, 2) for k in b["cpu"]}
        per_task = {k: round((b["cpu"][k] - a["cpu"][k]) / done * 1000, 1) if done else None for k in b["cpu"]}
        return (f"{label} tasks/s {done / dt:6.2f}  tokens/task {(b['tokens'] - a['tokens']) / max(done, 1):4.0f}  "
                f"engine busy {(b['busy'] - a['busy']) / dt:.2f}  rss {b['rss_mb']:.0f} MB  queued {b['queued']:.0f}  "
                f"cores {cores}  CPU ms/task {per_task}")

    async def run() -> None:
        codes: dict[int, int] = {}
        task_ids: list[str] = []
        async with aiohttp.ClientSession() as session:
            async def submit() -> None:
                priority = random.choice(("core", "normal", "batch"))
                body = {"agent_id": f"agent-{random.randint(1, 1000)}", "priority": priority,
                        "task_type": args.task_type, "max_tokens": args.max_tokens}
                async with session.post(f"{args.http}/api/v1/agent/submit", json=body,
                                        headers={"X-Priority": priority}) as reply:
                    text = await reply.read()
                    codes[reply.status] = codes.get(reply.status, 0) + 1
                if reply.status == 200:
                    task_ids.append(json.loads(text)["task_id"])

            started, sent, pending = time.monotonic(), 0, set()
            rows = [await asyncio.to_thread(snapshot)]
            next_row = started + args.interval
            while (now := time.monotonic()) - started < args.seconds:
                while sent < (now - started) * args.rps:
                    pending.add(asyncio.create_task(submit()))
                    sent += 1
                pending = {p for p in pending if not p.done()}
                if now >= next_row:
                    rows.append(await asyncio.to_thread(snapshot))
                    print(row(rows[-2], rows[-1], f"t={rows[-2]['t'] - started:5.0f}s"), flush=True)
                    next_row += args.interval
                await asyncio.sleep(0.005)
            await asyncio.gather(*pending)
            rows.append(await asyncio.to_thread(snapshot))
        print(f"answers by status: {codes}")
        if len(rows) > 2:
            print(row(rows[1], rows[-1], "after the first row:"))
        outcomes = await backlog.settle(args.http, task_ids, args.keep_backlog)
        print(backlog.backlog_summary(outcomes, 0, args.keep_backlog, who="the run", when="at the end"), flush=True)
        if any(result.startswith("error") for _, result in outcomes.values()) and not args.keep_backlog:
            raise SystemExit(1)  # load nobody asked for goes on

    asyncio.run(run())


if __name__ == "__main__":
    main()
