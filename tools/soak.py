"""Soak: mixed load with injected faults for a while; checks that nothing leaks and nothing is lost.

Usage: python tools/soak.py [--minutes 10] [--concurrency 24] [--out soak.json]

Starts the three services as separate processes on the ``openai`` engine
against ``switchyard serve sim-openai`` (a real HTTP upstream on 127.0.0.1),
then runs RunTask calls from ``--concurrency`` workers, each task one of:

- chat or rag_answer that should succeed;
- an upstream 5xx (the task names :data:`FLAKY_MODEL`, a model sim-openai lists and
  answers 503: ``--fault flaky-503=status=503``), served by the fallback model;
- an upstream stream cut after 3 items (the task names :data:`CUT_MODEL`,
  ``--fault cut-after-3=cut_after=3``): a named error;
- a client cancel after the first token.

The faults are models the upstream lists: a name it does not list (the ``MODEL#SPEC``
suffix sim-openai also reads) is refused NOT_FOUND before it is accepted, so a soak
naming them exercised no fault at all and still passed.

Half-way through, the dispatcher is killed (``kill -9``) and started again on
its port. At the end it prints, and writes to ``--out``:

- tasks by outcome, with the first error message of each kind's; **unaccounted**: a call that
  ended with neither a final event nor an error with a code and details (or a
  CANCELLED the client did not ask for) — must be 0;
- **unexpected**: an error of a code no kind should end with (all but UNAVAILABLE:
  the cut streams and the tasks the dispatcher restart caught) — must be 0;
- **kinds not exercised**: a kind that never ended as it is meant to (an upstream 5xx
  never served by the fallback, no stream cut, no cancel) — must be none;
- each service's RSS after the warm-up (the first fifth) and at the end —
  growth must stay under 10 %;
- every in-flight gauge (running/waiting sequences, concurrent agents, queue
  depth, busy workers) once the load stops — must be 0.

Exit status 0 when all five hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.children import dying_with_parent
from switchyard.common.server import GRPC_SERVICES
from switchyard.launcher import healthy
from switchyard_harness.arg_types import count, positive

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT_GAUGES = ("switchyard_agents_concurrent", "switchyard_running_sequences", "switchyard_waiting_sequences",
                    "switchyard_queue_depth", "switchyard_queue_busy_workers")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """sim-openai plus the three services, each its own process, on free ports."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.config_dir = workdir / "config"
        shutil.copytree(ROOT / "config", self.config_dir)
        self.ports = {name: (free_port(), free_port()) for name in ("retrieval", "dispatcher", "orchestrator")}
        self.upstream_port = free_port()
        queue = json.loads((self.config_dir / "queue.json").read_text())
        queue["model_gateway"]["base_url"] = f"http://127.0.0.1:{self.upstream_port}/v1"
        queue["model_gateway"]["api_key_required"] = False
        (self.config_dir / "queue.json").write_text(json.dumps(queue, indent=2))
        service = json.loads((self.config_dir / "switchyard.json").read_text())
        service["orchestrator"]["retrieval_addr"] = f"127.0.0.1:{self.ports['retrieval'][0]}"
        service["orchestrator"]["dispatcher_addr"] = f"127.0.0.1:{self.ports['dispatcher'][0]}"
        service["orchestrator"].setdefault("task_store", {})["sqlite_path"] = str(workdir / "tasks.sqlite3")
        (self.config_dir / "switchyard.json").write_text(json.dumps(service, indent=2))
        self.env = {**os.environ, "SWITCHYARD_ENGINE": "openai", "PYTHONUNBUFFERED": "1"}
        self.env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        self.procs: dict[str, subprocess.Popen] = {}
        self.log = open(workdir / "services.log", "w")  # noqa: SIM115 - closed in stop()

    def _start(self, name: str) -> None:
        port, metrics = self.ports[name]
        self.procs[name] = subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "switchyard.cli", "serve", name, "--port", str(port),
                               "--metrics-port", str(metrics), "--config-dir", str(self.config_dir)], signal.SIGTERM),
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def _wait(self, name: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not healthy(f"127.0.0.1:{self.ports[name][0]}", GRPC_SERVICES[name]):
            if self.procs[name].poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{name} did not start; see {self.workdir / 'services.log'}")
            time.sleep(0.05)  # as switchyard up's start (launcher.START_POLL_S): ready as soon as it answers

    def start(self) -> None:
        self.procs["upstream"] = subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "switchyard.cli", "serve", "sim-openai", "--port",
                               str(self.upstream_port), "--config-dir", str(self.config_dir),
                               *(f"--model={m}" for m in UPSTREAM_MODELS),
                               *(f"--fault={f}" for f in UPSTREAM_FAULTS)], signal.SIGTERM),
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        for name in ("retrieval", "dispatcher", "orchestrator"):
            self._start(name)
        for name in ("retrieval", "dispatcher", "orchestrator"):
            self._wait(name)

    def restart_dispatcher(self) -> None:
        self.procs["dispatcher"].kill()
        self.procs["dispatcher"].wait()
        self._start("dispatcher")
        self._wait("dispatcher")

    def rss_mib(self) -> dict[str, float]:
        out = {}
        for name in ("retrieval", "dispatcher", "orchestrator"):
            status = Path(f"/proc/{self.procs[name].pid}/status").read_text()
            out[name] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        return out

    def gauges(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for name, (_, metrics) in self.ports.items():
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
            for line in text.splitlines():
                metric = line.split("{")[0].split(" ")[0]
                if metric in IN_FLIGHT_GAUGES:
                    found[f"{name}:{line.rsplit(' ', 1)[0]}"] = float(line.rsplit(" ", 1)[1])
        return found

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.log.close()


KINDS = (("ok_chat", 0.45), ("ok_rag", 0.15), ("upstream_5xx", 0.15), ("stream_cut", 0.1), ("client_cancel", 0.15))
MEANT = {"ok_chat": "final", "ok_rag": "final", "upstream_5xx": "final", "stream_cut": "error:UNAVAILABLE",
         "client_cancel": "cancelled"}
"""How each kind is meant to end; a kind that never did was not exercised."""
EXPECTED_ERRORS = frozenset({"error:UNAVAILABLE"})
"""The error outcomes a kind may end with: the cut streams, and the tasks caught by the dispatcher's restart."""
FLAKY_MODEL = "flaky-503"
CUT_MODEL = "cut-after-3"
UPSTREAM_MODELS = ("claude-sonnet-4-5", "gpt-4o-mini", "sim-7b", FLAKY_MODEL, CUT_MODEL)
UPSTREAM_FAULTS = (f"{FLAKY_MODEL}=status=503", f"{CUT_MODEL}=cut_after=3")


def request_for(kind: str, number: int) -> agent_pb2.RunTaskRequest:
    model = {"upstream_5xx": FLAKY_MODEL, "stream_cut": CUT_MODEL}.get(kind, "")
    return agent_pb2.RunTaskRequest(
        task_id=f"soak-{number}", payload="Explain how the with statement works.", model=model, max_tokens=64,
        task_type="rag_answer" if kind == "ok_rag" else "chat")


async def one(stub, kind: str, number: int, examples: dict[str, str]) -> str:
    """The outcome: final, error:<CODE>, cancelled (by us), or unaccounted; the first error message of each kind's
    outcome goes into ``examples``."""
    call = stub.RunTask(request_for(kind, number), timeout=60)
    try:
        async for event in call:
            if event.HasField("final"):
                return "final"
            if kind == "client_cancel" and event.HasField("token"):
                call.cancel()
                return "cancelled"
        return "unaccounted"  # the stream ended without a final event or an error
    except grpc.aio.AioRpcError as err:
        outcome = ("unaccounted" if err.code() == grpc.StatusCode.CANCELLED or not err.details()
                   else f"error:{err.code().name}")  # unaccounted: a CANCELLED we did not ask for, or a nameless error
        examples.setdefault(f"{kind} {outcome}", f"{err.code().name}: {err.details()}"[:400])
        return outcome


async def load(stack: Stack, seconds: float, concurrency: int) -> tuple[Counter, dict, dict, dict, dict]:
    outcomes: Counter = Counter()
    examples: dict[str, str] = {}
    failed_at: list[float] = []  # when tasks that should have succeeded failed (the restart's outage)
    restart: dict[str, float] = {}
    by_kind: dict[str, Counter] = {k: Counter() for k, _ in KINDS}
    rss: dict[str, dict[str, float]] = {}
    numbers = iter(range(10**9))
    start = time.monotonic()
    end = start + seconds
    restarted = False
    kinds, weights = zip(*KINDS)
    async with open_channel(f"127.0.0.1:{stack.ports['orchestrator'][0]}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)

        async def worker() -> None:
            while time.monotonic() < end:
                kind = random.choices(kinds, weights)[0]
                outcome = await one(stub, kind, next(numbers), examples)
                if outcome.startswith("error") and kind != "stream_cut":
                    failed_at.append(time.monotonic())
                outcomes[outcome] += 1
                by_kind[kind][outcome] += 1

        async def chaos() -> None:
            nonlocal restarted
            await asyncio.sleep(seconds / 5)
            rss["warm"] = stack.rss_mib()
            await asyncio.sleep(max(0.0, start + seconds / 2 - time.monotonic()))
            restart["killed"] = time.monotonic()
            await asyncio.to_thread(stack.restart_dispatcher)
            restart["serving"] = time.monotonic()
            restarted = True

        await asyncio.gather(chaos(), *(worker() for _ in range(concurrency)))
    rss["end"] = stack.rss_mib()
    assert restarted
    near = [t for t in failed_at if restart["killed"] - 1 <= t <= restart["serving"] + 30]
    outage = {
        "dispatcher_down_s": round(restart["serving"] - restart["killed"], 2),  # kill -9 -> SERVING again
        "failed_tasks_near_restart": len(near),
        "failed_tasks_elsewhere": len(failed_at) - len(near),
        "last_failure_after_serving_s": round(max(near) - restart["serving"], 2) if near else None,
    }
    return outcomes, by_kind, rss, outage, examples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=positive, default=10.0, help="load window, minutes (default 10)")
    parser.add_argument("--concurrency", type=count, default=24, help="calls at once (default 24)")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
    stack = Stack(workdir)
    try:
        stack.start()
        outcomes, by_kind, rss, outage, examples = asyncio.run(load(stack, args.minutes * 60, args.concurrency))
        time.sleep(3)
        gauges = stack.gauges()
    finally:
        stack.stop()
    growth = {name: (rss["end"][name] - rss["warm"][name]) / rss["warm"][name] for name in rss["warm"]}
    left = {k: v for k, v in gauges.items() if v != 0}
    unexpected = {o: n for o, n in outcomes.items() if o.startswith("error:") and o not in EXPECTED_ERRORS}
    not_exercised = sorted(kind for kind, meant in MEANT.items() if not by_kind[kind][meant])
    report = {
        "minutes": args.minutes, "concurrency": args.concurrency, "tasks": sum(outcomes.values()),
        "outcomes": dict(outcomes), "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "examples": examples, "unexpected_errors": unexpected, "kinds_not_exercised": not_exercised,
        "restart": outage, "rss_mib": rss, "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "in_flight_gauges_not_zero": left, "in_flight_gauges_checked": len(gauges),
        "ok": (outcomes["unaccounted"] == 0 and not unexpected and not not_exercised
               and all(g < 0.10 for g in growth.values()) and not left),
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
