"""``switchyard bench http``: the orchestrator's HTTP face under load, against a running stack.

Three phases, each printing its numbers (``-o FILE`` also writes them as JSON):

- ``submit``: ``POST /api/v1/agent/submit`` at ``--rps`` (default 200, the
  reference rate of ghz/reference.json) from ``--concurrency`` workers (default
  64) for ``--duration`` seconds, the field's body (random agent-<1..1000>,
  priority class and its ``X-Priority`` header, ``--task-type`` react_loop,
  ``--max-tokens`` 512). Open loop: call *i* starts at ``i / rps`` or as soon as
  a worker is free. Latency P50/P95/P99 (ghz's nearest-rank rule) and errors by
  status. ``grpc-submit`` (not run by default) is the same over gRPC SubmitTask,
  to tell the HTTP face's cost from the stack's. After each submit phase the
  tasks it submitted that have not finished (the react_loop tasks wait in the
  orchestrator's backlog, minutes of work at the reference rate) are cancelled
  (``POST /api/v1/tasks/{task_id}/cancel``) and one line reports them, so that
  they load neither the phases after it nor the stack after the command exits;
  ``--keep-backlog`` leaves them running.
- ``stream``: RunTask to its final event, over HTTP (SSE, ``/api/v1/agent/run``)
  and over gRPC, taking turns (``--rounds`` of ``--stream-seconds`` each, the
  order alternating), each with ``--streams`` calls in flight (closed loop) and
  the same request. Throughput in completed tasks per second of each, and their
  ratio SSE / gRPC in the same run.
- ``profile``: gRPC RunTask throughput at the same closed-loop load while the
  orchestrator records a CPU profile of ``--profile-seconds`` (its
  ``/debug/pprof/profile``) and while it does not, taking turns; the ratio.

The load generator is one process (asyncio, aiohttp's client, grpc.aio); it
shares the machine's cores with the stack, so compare ratios measured in one
run, not absolute numbers between machines.

Against a stack with ``orchestrator.auth`` on, every call (HTTP and gRPC, and
the profile's request) sends ``Authorization: Bearer <token>``: the value of
``SWITCHYARD_AUTH_TOKEN`` (``--token-env NAME`` for another variable), as
``switchyard run`` sends it, or the contents of ``--token-file FILE``, which
wins over the variable (switchyard.common.client_token).

Exit status: 0; 1 when the stack cannot be reached, when every call of a
phase (or of one kind in it) failed, each such named on stderr (a 401 with a
word on the token), or when some task of a submit phase's backlog could not be
cancelled (load that goes on); 2 for bad arguments.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from switchyard_harness import backlog, json_output
from switchyard_harness.arg_types import grpc_address, http_url
from switchyard.common.client_token import TokenError, add_token_options, authorization, bearer_token
from switchyard_harness.bench.report import percentile
from switchyard.common.cli_text import parser_for
from switchyard.common.metrics import TASK_TYPES
from switchyard.common.priority import LABELS

PRIORITIES = LABELS
STREAM_BODY = {"agent_id": "bench-stream", "payload": "How does the with statement work?", "task_type": "chat",
               "max_tokens": 64}
"""The stream phase's request, the same over SSE and gRPC (the HTTP face requires agent_id and task_type)."""


@dataclass
class Calls:
    """Latencies (seconds) of successful calls and a count of failures by status."""

    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    task_ids: list[str] = field(default_factory=list)
    """The task_id of each accepted submit, in order (the submit phases)."""

    def fail(self, status: str) -> None:
        self.failures[status] = self.failures.get(status, 0) + 1

    def summary(self) -> dict[str, Any]:
        done = len(self.latencies)
        return {
            "ok": done, "errors": sum(self.failures.values()), "failures": dict(self.failures),
            "wall_s": round(self.wall_s, 3), "per_s": round(done / self.wall_s, 2) if self.wall_s else 0.0,
            **{f"p{p}_ms": round(1000 * percentile(self.latencies, p), 3) for p in (50, 95, 99)},
        }


def _grpc_auth(token: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata carrying ``token`` (empty for none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def field_body() -> tuple[dict[str, Any], dict[str, str]]:
    priority = random.choice(PRIORITIES)
    return ({"agent_id": f"agent-{random.randint(1, 1000)}", "priority": priority, "task_type": "react_loop",
             "max_tokens": 512}, {"X-Priority": priority})


async def submit_phase(http: str, rps: float, concurrency: int, duration_s: float, task_type: str,
                       max_tokens: int, grpc_addr: str = "", token: str | None = None) -> Calls:
    """Open-loop submits (see the module docstring); with ``grpc_addr``, gRPC SubmitTask with the same fields
    (agent and priority in the request, ``x-priority`` in the metadata) instead of HTTP. ``token``: the bearer
    token every call sends (``Authorization`` header, ``authorization`` metadata), None for none."""
    import aiohttp
    import grpc

    from switchyard.api import agent_pb2, agent_pb2_grpc
    from switchyard.common.channels import open_channel

    calls = Calls()
    total = int(rps * duration_s)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    connector = aiohttp.TCPConnector(limit=concurrency)
    auth = _grpc_auth(token)
    async with aiohttp.ClientSession(http, connector=connector, headers=authorization(token)) as session, \
            open_channel(grpc_addr or "127.0.0.1:1") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        start = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                delay = start + i / rps - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                body, headers = field_body()
                body.update(task_type=task_type, max_tokens=max_tokens)
                t0 = time.perf_counter()
                if grpc_addr:
                    request = agent_pb2.RunTaskRequest(
                        agent_id=body["agent_id"], task_type=task_type, max_tokens=max_tokens,
                        payload="Continue the agent's task: take its next step.",
                        priority=agent_pb2.Priority.Value(body["priority"].upper()))
                    try:
                        reply = await stub.SubmitTask(request, metadata=(("x-priority", body["priority"]), *auth),
                                                      timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        calls.fail(exc.code().name)
                        continue
                    calls.latencies.append(time.perf_counter() - t0)
                    calls.task_ids.append(reply.task_id)
                    continue
                try:
                    async with session.post("/api/v1/agent/submit", json=body, headers=headers) as reply:
                        text = await reply.read()
                        status = reply.status
                except aiohttp.ClientError as exc:
                    calls.fail(type(exc).__name__)
                    continue
                if status == 200:
                    calls.latencies.append(time.perf_counter() - t0)
                    calls.task_ids.append(json.loads(text)["task_id"])
                else:
                    calls.fail(str(status))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        calls.wall_s = time.perf_counter() - start
    return calls


async def closed_loop(one: Callable[[], Awaitable[str | None]], streams: int, seconds: float) -> Calls:
    """``streams`` workers calling ``one`` back to back for ``seconds``; ``one`` returns None or a failure."""
    calls = Calls()
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            failure = await one()
            if failure is None:
                calls.latencies.append(time.perf_counter() - t0)
            else:
                calls.fail(failure)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    calls.wall_s = time.perf_counter() - start
    return calls


def sse_call(session: Any) -> Callable[[], Awaitable[str | None]]:
    async def one() -> str | None:
        import aiohttp

        try:
            async with session.post("/api/v1/agent/run", json=STREAM_BODY,
                                    headers={"Accept": "text/event-stream"}) as reply:
                if reply.status != 200:
                    await reply.read()
                    return str(reply.status)
                # Lines split per chunk (a line cut by a chunk's end carried over), not read one await
                # at a time: the client should cost about what the gRPC client's C-core framing does.
                name, rest = b"", b""
                async for chunk in reply.content.iter_any():
                    lines = (rest + chunk).split(b"\n")
                    rest = lines.pop()
                    for line in lines:
                        if line.startswith(b"event: "):
                            name = line[7:]
                name = name.decode()
                return None if name == "final" else f"ended with {name or 'nothing'}"
        except aiohttp.ClientError as exc:
            return type(exc).__name__

    return one


def grpc_call(stub: Any, token: str | None = None) -> Callable[[], Awaitable[str | None]]:
    import grpc

    from switchyard.api import agent_pb2

    request = agent_pb2.RunTaskRequest(**STREAM_BODY)
    metadata = _grpc_auth(token) or None

    async def one() -> str | None:
        try:
            last = None
            async for event in stub.RunTask(request, timeout=120, metadata=metadata):
                last = event
            return None if last is not None and last.HasField("final") else "no final"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    return one


async def stream_phase(http: str, grpc_addr: str, streams: int, seconds: float, rounds: int,
                       token: str | None = None, warmup_s: float = 1.0) -> dict[str, Calls]:
    """SSE and gRPC RunTask, taking turns, each kind first ``warmup_s`` seconds unmeasured; the calls of each,
    summed over rounds (``token`` as :func:`submit_phase`'s)."""
    import aiohttp

    from switchyard.api import agent_pb2_grpc
    from switchyard.common.channels import open_channel

    out = {"sse": Calls(), "grpc": Calls()}
    async with aiohttp.ClientSession(http, connector=aiohttp.TCPConnector(limit=streams),
                                     headers=authorization(token)) as session, \
            open_channel(grpc_addr) as channel:
        kinds = {"sse": sse_call(session), "grpc": grpc_call(agent_pb2_grpc.AgentServiceStub(channel), token)}
        for kind in kinds:  # warm-up: connections, the dispatcher's first batch
            await closed_loop(kinds[kind], streams, warmup_s)
        for r in range(rounds):
            for kind in (("sse", "grpc") if r % 2 == 0 else ("grpc", "sse")):
                calls = await closed_loop(kinds[kind], streams, seconds)
                total = out[kind]
                total.latencies += calls.latencies
                total.wall_s += calls.wall_s
                for status, n in calls.failures.items():
                    total.failures[status] = total.failures.get(status, 0) + n
    return out


def profile_url(metrics: str, seconds: float) -> str:
    base = metrics.rsplit("/metrics", 1)[0]
    return f"{base}/debug/pprof/profile?seconds={seconds:g}"


async def profile_phase(grpc_addr: str, metrics: str, streams: int, seconds: float, rounds: int,
                        token: str | None = None, warmup_s: float = 1.0) -> dict[str, Any]:
    """gRPC RunTask throughput with and without a profile of the orchestrator running, taking turns after
    ``warmup_s`` seconds unmeasured (``token`` sent with every call and the profile's request)."""
    from switchyard.api import agent_pb2_grpc
    from switchyard.common.channels import open_channel

    out = {"without": Calls(), "with": Calls()}
    sizes: list[int] = []
    async with open_channel(grpc_addr) as channel:
        one = grpc_call(agent_pb2_grpc.AgentServiceStub(channel), token)
        await closed_loop(one, streams, warmup_s)
        for r in range(rounds):
            for kind in (("without", "with") if r % 2 == 0 else ("with", "without")):
                fetch = None
                if kind == "with":
                    url = profile_url(metrics, seconds)
                    request = urllib.request.Request(url, headers=authorization(token))
                    fetch = asyncio.create_task(asyncio.to_thread(
                        lambda: urllib.request.urlopen(request, timeout=seconds + 60).read()))
                    await asyncio.sleep(0.2)  # the profiler is installed on the orchestrator's loop
                calls = await closed_loop(one, streams, seconds - 0.4)  # inside the profile window either way
                if fetch is not None:
                    sizes.append(len(await fetch))
                total = out[kind]
                total.latencies += calls.latencies
                total.wall_s += calls.wall_s
                for status, n in calls.failures.items():
                    total.failures[status] = total.failures.get(status, 0) + n
    return {**out, "profile_bytes": sizes}


def rounds_text(rounds: int, seconds: float) -> str:
    """'1 round of 2 s', '3 rounds of 2 s each': how long each kind of a phase ran."""
    return f"1 round of {seconds:g} s" if rounds == 1 else f"{rounds} rounds of {seconds:g} s each"


def profiles_text(sizes: list[int]) -> str:
    """'a profile of 19803 bytes', 'profiles of 19803, 20114 bytes': the profiles a profile phase took."""
    if len(sizes) == 1:
        return f"a profile of {sizes[0]} bytes"
    return f"profiles of {', '.join(str(size) for size in sizes)} bytes" if sizes else "no profile taken"


def _endpoints(args: Any) -> tuple[str, str, str]:
    """HTTP base URL, gRPC address and the orchestrator's metrics URL (flags, else the up file, else defaults)."""
    from switchyard.common import up_files

    http, grpc_addr, metrics = "http://127.0.0.1:8080", "127.0.0.1:50051", "http://127.0.0.1:9101/metrics"
    path = up_files.default_path()
    up_files.remove_stale(path)  # a killed launcher's: its ports serve nothing
    try:
        recorded = up_files.recorded_services(path)["orchestrator"]
        grpc_addr, metrics = recorded["address"], recorded["metrics_url"]
        if "http_port" in recorded:  # the same stack's HTTP face (switchyard up --free-ports picks its port)
            http = f"http://{grpc_addr.rpartition(':')[0]}:{int(recorded['http_port'])}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return args.http or http, args.grpc or grpc_addr, args.orchestrator_metrics or metrics


async def _main(args: Any) -> dict[str, Any]:
    http, grpc_addr, metrics = _endpoints(args)
    results: dict[str, Any] = {"http": http, "grpc": grpc_addr}
    phases = args.phases.split(",")
    for phase, over in (("submit", ""), ("grpc-submit", grpc_addr)):
        if phase not in phases:
            continue
        calls = await submit_phase(http, args.rps, args.concurrency, args.duration, args.task_type, args.max_tokens,
                                   over, args.token)
        results[phase] = {"offered_rps": args.rps, "concurrency": args.concurrency, **calls.summary()}
        s = results[phase]
        name = "HTTP submit" if phase == "submit" else "gRPC SubmitTask"
        print(f"{name}: {s['ok']} ok, {s['errors']} errors "
              f"{s['failures'] or ''} in {s['wall_s']:.1f} s ({s['per_s']:.1f}/s, offered {args.rps:g}); "
              f"P50 {s['p50_ms']:.2f} ms, P95 {s['p95_ms']:.2f} ms, P99 {s['p99_ms']:.2f} ms", flush=True)
        if calls.task_ids:
            outcomes = await backlog.settle(http, calls.task_ids, args.keep_backlog, authorization(args.token))
            results[phase]["backlog"] = backlog.backlog_counts(outcomes)
            print(backlog.backlog_summary(outcomes, 0, args.keep_backlog, who="the phase",
                                          when=f"after {name}"), flush=True)
            if results[phase]["backlog"]["errors"] and not args.keep_backlog:
                results["backlog_errors"] = results.get("backlog_errors", 0) + results[phase]["backlog"]["errors"]
    if "stream" in phases:
        out = await stream_phase(http, grpc_addr, args.streams, args.stream_seconds, args.rounds, args.token,
                                 args.warmup_s)
        sse, grpc_ = out["sse"].summary(), out["grpc"].summary()
        ratio = sse["per_s"] / grpc_["per_s"] if grpc_["per_s"] else 0.0
        results["stream"] = {"streams": args.streams, "sse": sse, "grpc": grpc_, "sse_over_grpc": round(ratio, 3)}
        for name, s in (("SSE ", sse), ("gRPC", grpc_)):
            print(f"RunTask {name}: {s['per_s']:.1f} tasks/s ({s['ok']} ok, {s['errors']} errors), "
                  f"P50 {s['p50_ms']:.1f} ms, P95 {s['p95_ms']:.1f} ms", flush=True)
        print(f"RunTask throughput SSE / gRPC = {ratio:.3f} ({args.streams} streams, "
              f"{rounds_text(args.rounds, args.stream_seconds)})", flush=True)
    if "profile" in phases:
        out = await profile_phase(grpc_addr, metrics, args.streams, args.profile_seconds, args.rounds, args.token,
                                  args.warmup_s)
        with_, without = out["with"].summary(), out["without"].summary()
        ratio = with_["per_s"] / without["per_s"] if without["per_s"] else 0.0
        results["profile"] = {"with": with_, "without": without, "with_over_without": round(ratio, 3),
                              "profile_bytes": out["profile_bytes"]}
        print(f"RunTask gRPC while profiling: {with_['per_s']:.1f} tasks/s, without: {without['per_s']:.1f} tasks/s; "
              f"ratio {ratio:.3f} ({rounds_text(args.rounds, args.profile_seconds)}; "
              f"{profiles_text(out['profile_bytes'])})", flush=True)
    return results


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard bench http", __doc__)
    parser.add_argument("--http", type=http_url, help="the HTTP face (default: the up file's, else http://127.0.0.1:8080)")
    parser.add_argument("--grpc", type=grpc_address, help="the orchestrator's gRPC address (default: the up file's, else 127.0.0.1:50051)")
    parser.add_argument("--orchestrator-metrics", type=http_url, help="the orchestrator's /metrics URL (default: the up file's)")
    parser.add_argument("--phases", default="submit,stream,profile", help="which phases, comma-separated")
    parser.add_argument("--rps", type=float, default=200.0, help="submit: offered calls per second (default 200)")
    parser.add_argument("-c", "--concurrency", type=int, default=64, help="submit: workers (default 64)")
    parser.add_argument("--duration", type=float, default=10.0, help="submit: seconds (default 10)")
    parser.add_argument("--task-type", choices=TASK_TYPES, default="react_loop", help="submit: task_type of the body (default react_loop)")
    parser.add_argument("--max-tokens", type=int, default=512, help="submit: max_tokens of the body (default 512)")
    parser.add_argument("--streams", type=int, default=16, help="stream/profile: calls in flight (default 16)")
    parser.add_argument("--stream-seconds", type=float, default=5.0, help="stream: seconds per turn (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="stream/profile: turns of each kind (default 2)")
    parser.add_argument("--profile-seconds", type=float, default=10.0, help="profile: seconds per turn (default 10)")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="stream/profile: seconds of unmeasured calls of "
                        "each kind before the rounds (connections, the dispatcher's first batch; default 1, 0: none)")
    parser.add_argument("-o", "--output", help="also write the numbers as JSON here")
    parser.add_argument("--keep-backlog", action="store_true", help="leave the tasks a submit phase submitted and "
                        "that had not finished running (default: they are cancelled after the phase, and reported)")
    add_token_options(parser)
    args = parser.parse_args(argv)
    unknown = set(args.phases.split(",")) - {"submit", "grpc-submit", "stream", "profile"}
    if unknown:
        parser.error(f"--phases: expected submit, grpc-submit, stream and/or profile (got {', '.join(sorted(unknown))})")
    for flag, value, ok, what in (  # nan passed `<= 0`, and inf (or a negative time) never ended or never began
        ("--rps", args.rps, 0 < args.rps < math.inf, "a finite number of calls/s > 0"),
        ("--concurrency", args.concurrency, args.concurrency >= 1, "at least 1"),
        ("--duration", args.duration, 0 < args.duration < math.inf, "a finite number of seconds > 0"),
        ("--streams", args.streams, args.streams >= 1, "at least 1"),
        ("--stream-seconds", args.stream_seconds, 0 < args.stream_seconds < math.inf, "a finite number of seconds > 0"),
        ("--rounds", args.rounds, args.rounds >= 1, "at least 1"),
        # -1 ran the whole phase to print 2000 errors {'400': 2000}: each submit refused for its max_tokens
        ("--max-tokens", args.max_tokens, args.max_tokens >= 0, "at least 0 (0: the stack's default)"),
        ("--profile-seconds", args.profile_seconds, 1 <= args.profile_seconds < math.inf,
         "a finite number of seconds >= 1"),
        ("--warmup-s", args.warmup_s, 0 <= args.warmup_s < math.inf, "a finite number of seconds >= 0"),
    ):
        if not ok:
            parser.error(f"{flag}: expected {what}, got {value}")
    try:
        args.token = bearer_token(args.token_file, args.token_env)
    except TokenError as exc:
        parser.error(str(exc))
    import uvloop

    try:
        results = uvloop.run(_main(args))
    except OSError as exc:
        print(f"switchyard bench http: {exc}; is the stack running (switchyard up)?", file=sys.stderr)
        return 1
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json_output.dumps(results, indent=2) + "\n")
    return _all_failed(results, args)


def _all_failed(results: dict[str, Any], args: Any) -> int:
    """1, each named on stderr, when every call of some measured load failed (a number over no successful call
    means nothing; a 401 hints at the token); else 0."""
    loads = {phase: results[phase] for phase in ("submit", "grpc-submit") if phase in results}
    for phase, kinds in (("stream", ("sse", "grpc")), ("profile", ("with", "without"))):
        loads.update({f"{phase} {kind}": results[phase][kind] for kind in kinds if phase in results})
    failed = {name: s for name, s in loads.items() if s["ok"] == 0 and s["errors"] > 0}
    for name, s in failed.items():
        print(f"switchyard bench http: {name}: every call failed ({s['errors']}: {s['failures']})", file=sys.stderr)
    if any(code in s["failures"] for s in failed.values() for code in ("401", "UNAUTHENTICATED")):
        print(f"switchyard bench http: the stack checks bearer tokens (orchestrator.auth): set {args.token_env} "
              "to one, or pass --token-file FILE" + (" (the token sent was refused)" if args.token else ""),
              file=sys.stderr)
    return 1 if failed or results.get("backlog_errors") else 0
