"""Load generator: paced ``agent.AgentService.RunTask`` streaming calls over grpc.aio.

Semantics follow ghz (https://ghz.sh/docs/options) so that results compare:

- ``concurrency`` workers share one channel per process and issue calls back to back;
- ``rps`` > 0 paces call starts at a constant rate (call ``i`` may start at
  ``t0 + i / rps``; a late worker starts at once), 0 means as fast as workers go;
- ``total`` calls, or with ``duration_s`` > 0 as many as start before the
  deadline (``total`` ignored, in-flight calls finish; ghz ``--duration-stop wait``):
  the run lasts ``duration_s`` plus the calls still in flight then, whatever the
  pacing (a worker whose next call would be due past the deadline stops there);
- ``timeout_s`` bounds each call; 0 means no deadline (ghz ``-t 0``);
- a call's latency runs from the RPC start to the end of its stream;
- interrupted (SIGINT, Ctrl-C) once calls have started, a run asked to be
  interruptible stops: no call starts any more, the calls in flight are
  cancelled and left out, and the result holds the calls that completed, its
  end reason ``cancel`` (ghz's, whose report on Ctrl-C covers what completed).

One Python process drives a few hundred streams per second before its own CPU
becomes the bottleneck, so :func:`run_load` can split the plan over several
client processes (spawned, one channel each, started together behind a barrier)
and reports the client's CPU seconds so a saturated client is visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import grpc

from switchyard.api import agent_pb2_grpc
from switchyard_harness.bench.calldata import priority_name, request_for
from switchyard.common.channels import MAX_CALL_TIMEOUT_S, open_channel
from switchyard.common.children import die_with_parent
from switchyard.common.config import RequestLimitsConfig, ServerConfig, TlsConfig
from switchyard.common.grpc_target import address_problem
from switchyard.common.tls_check import speaks_tls

# One client process receives roughly this many stream messages per second on a
# fully used core (grpc.aio + protobuf decode). Measured: 14,200 token events/s at
# 69 % of one core against a server that streams 128 tokens per call without
# delay (docs/benchmarks.md). Used only to pick --procs auto.
MESSAGES_PER_PROC_S = 20_000


_ZERO = {"--rps": "unpaced", "--duration": "run -n calls instead", "--timeout": "no deadline per call"}
"""What 0 means for each of :class:`LoadPlan`'s rates and times, for its error messages."""


@dataclass(frozen=True)
class LoadPlan:
    """What to run. Units: seconds and calls per second.

    Attributes:
        host: ``host:port`` of the orchestrator.
        calldata: ghz call data items (see :mod:`switchyard_harness.bench.calldata`).
        total: calls to make (ignored when ``duration_s`` > 0).
        concurrency: workers issuing calls at once (all processes together).
        rps: call starts per second, all processes together; 0 = unpaced.
        duration_s: run this long instead of ``total`` calls; 0 = off.
        timeout_s: deadline of each call (ghz ``--timeout``, default 20 s); 0 = none (ghz ``-t 0``).
        procs: client processes.
    """

    host: str
    calldata: list[dict[str, Any]]
    total: int = 200
    concurrency: int = 50
    rps: float = 0.0
    duration_s: float = 0.0
    timeout_s: float = 20.0
    procs: int = 1
    metadata: dict[str, str] = field(default_factory=dict)
    """gRPC metadata sent with every call (ghz ``-m``), e.g. ``authorization``."""
    tls: dict[str, str] = field(default_factory=dict)
    """Empty: plain text (ghz ``--insecure``). Else ``ca_file`` (ghz ``--cacert``), optional
    ``cert_file``/``key_file`` for mTLS (``--cert``/``--key``), ``server_name`` (``--cname``)."""

    def server_config(self) -> ServerConfig | None:
        """The channel settings for :func:`switchyard.common.channels.open_channel` (TLS when asked)."""
        if not self.tls:
            return None
        return ServerConfig(tls=TlsConfig(
            enabled=True, ca_file=self.tls["ca_file"], cert_file=self.tls.get("cert_file", ""),
            key_file=self.tls.get("key_file", ""), require_client_auth=bool(self.tls.get("cert_file")),
            server_name=self.tls.get("server_name", ""),
        ))

    def __post_init__(self) -> None:
        if problem := address_problem(self.host):
            raise ValueError(f"target: expected the orchestrator's host:port, a port in 1-65535, got {self.host!r} "
                             f"({problem})")
        # each names its flag (ghz's, and the ghz config's key) and the way out, as the checks below do
        if self.total < 1 and self.duration_s <= 0:
            raise ValueError(f"-n/--total: expected at least 1 call (or -z/--duration instead), got {self.total}")
        if self.concurrency < 1:
            raise ValueError(f"-c/--concurrency: expected at least 1, got {self.concurrency}")
        if self.duration_s <= 0 and self.total < self.concurrency:
            raise ValueError(f"-n/--total: expected at least as many calls as -c/--concurrency ({self.concurrency}, "
                             f"given or by default), got {self.total}: raise -n or lower -c")
        for flag, value in (("--rps", self.rps), ("--duration", self.duration_s), ("--timeout", self.timeout_s)):
            if not 0 <= value < math.inf:  # NaN too; --rps inf was an OverflowError traceback
                raise ValueError(f"{flag}: expected a finite value >= 0 (0: {_ZERO[flag]}), got {value:g}")
        if self.timeout_s > MAX_CALL_TIMEOUT_S:  # every call failed at once, DEADLINE_EXCEEDED
            raise ValueError(f"--timeout: expected at most {MAX_CALL_TIMEOUT_S:g} s (gRPC's deadline overflows past "
                             f"it; 0: {_ZERO['--timeout']}), got {self.timeout_s:g}")
        if self.procs < 1:
            raise ValueError(f"--procs: expected auto or at least 1, got {self.procs}")


@dataclass
class CallResult:
    """One RunTask call as the client saw it (seconds; wall-clock start in epoch seconds)."""

    number: int
    started_at: float
    latency_s: float
    status: str
    error: str
    priority: str
    task_type: str
    ttft_s: float | None = None
    tokens: int = 0
    queue_wait_s: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    """Every call of a run plus the run's wall time and the client's CPU use."""

    results: list[CallResult]
    wall_s: float
    cpu_s: float
    procs: int
    end_reason: str  # ghz StopReason: "normal", "timeout" (duration reached) or "cancel" (interrupted)

    @property
    def cpu_saturation(self) -> float:
        """Client CPU seconds / (wall seconds x client processes), 0-1; near 1 = client-bound."""
        return self.cpu_s / (self.wall_s * self.procs) if self.wall_s > 0 else 0.0


CONNECT_TIMEOUT_S = 10.0
"""How long a load run waits for the target to accept a connection, seconds."""

INTERRUPT_WAIT_S = 10.0
"""How long an interrupted run of several client processes waits for their calls that completed, seconds."""


def go_code_name(code: grpc.StatusCode) -> str:
    """gRPC status as Go's ``codes.Code.String()`` spells it (what ghz reports): OK, ResourceExhausted, ..."""
    if code == grpc.StatusCode.OK:
        return "OK"
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(word.capitalize() for word in code.name.split("_"))


def auto_procs(plan: LoadPlan, cpu_count: int | None = None) -> int:
    """Client processes for ``--procs auto``: enough that none passes MESSAGES_PER_PROC_S.

    Expected messages per call = max_tokens of the call data (0 or none: ``limits.default_max_tokens``'s
    default, what the stack sends for it) + 8
    non-token events. Unpaced runs use one process per 64 concurrent streams.
    Never more than the machine's cores nor the concurrency.
    """
    cores = cpu_count or os.cpu_count() or 1
    if plan.rps > 0:
        default = RequestLimitsConfig.model_fields["default_max_tokens"].default
        tokens = max(int(item.get("max_tokens") or default) for item in plan.calldata)
        wanted = math.ceil(plan.rps * (tokens + 8) / MESSAGES_PER_PROC_S)
    else:
        wanted = math.ceil(plan.concurrency / 64)
    return max(1, min(wanted, cores, plan.concurrency))


# --------------------------------------------------------------------------- one process


async def _call(stub: agent_pb2_grpc.AgentServiceStub, number: int, plan: LoadPlan) -> CallResult:
    request = request_for(plan.calldata, number)
    result = CallResult(
        number, time.time(), 0.0, "OK", "", priority_name(request), request.task_type or "rag_answer"
    )
    t0 = time.perf_counter()
    try:
        async for event in stub.RunTask(request, timeout=plan.timeout_s or None,  # 0: no deadline, as ghz's -t 0
                                        metadata=tuple(plan.metadata.items()) or None):
            kind = event.WhichOneof("event")
            if kind == "token":
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - t0
                result.tokens += max(1, event.token.count)  # an event may carry several tokens
            elif kind == "final":
                result.queue_wait_s = dict(event.final.timings.queue_wait_s)
    except grpc.aio.AioRpcError as exc:
        result.status = go_code_name(exc.code())
        result.error = f"rpc error: code = {result.status} desc = {exc.details()}"
    result.latency_s = time.perf_counter() - t0
    return result


async def _not_grpc_here(channel: grpc.aio.Channel, host: str) -> str | None:
    """What answers at ``host``, where ``channel`` found no gRPC server, when it is something else (an HTTP/1.x
    server, a Redis): one call's error says (:func:`switchyard.client.not_grpc_here`); None where nothing answers."""
    from switchyard.client import not_grpc_here

    try:
        await channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=CONNECT_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        return not_grpc_here(host, err.details() or "")
    return None


async def run_part(plan: LoadPlan, part: int = 0, parts: int = 1, barrier: Any = None,
                   interruptible: bool = False, client_process: bool = False) -> LoadResult:
    """Run share ``part`` of ``parts`` of the plan in this process and event loop.

    Part ``k`` makes calls ``k, k + parts, k + 2*parts, ...`` with its share of
    the concurrency and rps, so the parts together make the plan's calls.
    ``barrier`` (a multiprocessing barrier) lines up the parts' start.
    ``interruptible``: once the calls start, SIGINT stops the run (the calls in flight are cancelled and left out)
    and the result, end reason ``cancel``, holds those that completed; only on the main thread, the one signals
    reach (elsewhere it is ignored). A SIGINT before the calls start is the event loop's own (``KeyboardInterrupt``).
    ``client_process``: this is one of ``--procs N``'s client processes: from the end of its calls on it ignores
    SIGINT. It may get two (the parent forwards Ctrl-C to it, and a terminal's Ctrl-C reaches the whole process
    group), and a second one during the channel's close printed a KeyboardInterrupt traceback from gRPC's
    shutdown; the parent bounds its wait for the process.
    """
    concurrency = plan.concurrency // parts + (1 if part < plan.concurrency % parts else 0)
    numbers = range(part, plan.total, parts)
    results: list[CallResult] = []
    async with open_channel(plan.host, plan.server_config(), peer="orchestrator") as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=CONNECT_TIMEOUT_S)
        except TimeoutError:
            from switchyard.client import up_stack_elsewhere

            up_stack = up_stack_elsewhere(plan.host, "bench run")  # up --free-ports: not the config's ports
            elsewhere = "" if up_stack is None else f"; {up_stack}"
            answers = await _not_grpc_here(channel, plan.host)
            if plan.server_config() is None and await speaks_tls(plan.host):
                raise TimeoutError(f"cannot reach the orchestrator at {plan.host}: it serves TLS and this run sent "
                                   "plain text: pass --cacert FILE, the CA bundle that signs its certificate (ghz's "
                                   f"flag){elsewhere}") from None
            if answers is not None:
                raise TimeoutError(f"cannot reach the orchestrator at {plan.host}: {answers}{elsewhere}") from None
            raise TimeoutError(
                f"cannot reach the orchestrator at {plan.host} within {CONNECT_TIMEOUT_S:g} s: start it "
                f"(`switchyard up`) or pass its host:port{elsewhere}"
            ) from None
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        if barrier is not None:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        cpu0, wall0, t0 = time.process_time(), time.time(), time.monotonic()
        deadline = t0 + plan.duration_s if plan.duration_s > 0 else math.inf
        next_index = 0
        timed_out = False

        async def worker() -> None:
            nonlocal next_index, timed_out
            while True:
                i = next_index
                next_index += 1
                if plan.duration_s > 0:
                    number = part + i * parts
                else:
                    if i >= len(numbers):
                        return
                    number = numbers[i]
                if plan.rps > 0:
                    due = t0 + number / plan.rps
                    if due >= deadline:
                        # No call starts at or past the deadline: wait for the deadline itself (the run
                        # lasts its duration, as ghz's does) rather than for a start that will not happen.
                        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                        timed_out = True
                        return
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                if time.monotonic() >= deadline:
                    timed_out = True
                    return
                results.append(await _call(stub, number, plan))

        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()
        interruptible = interruptible and threading.current_thread() is threading.main_thread()
        if interruptible:
            loop.add_signal_handler(signal.SIGINT, interrupted.set)
        try:
            workers = asyncio.gather(*(worker() for _ in range(max(concurrency, 1))))
            stopper = asyncio.ensure_future(interrupted.wait())
            await asyncio.wait({workers, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not workers.done():  # interrupted: the calls in flight are cancelled, and not counted
                workers.cancel()
            await asyncio.gather(workers, stopper, return_exceptions=True)
        finally:
            if interruptible:
                loop.remove_signal_handler(signal.SIGINT)
                if client_process:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
        wall = time.time() - wall0
        cpu = time.process_time() - cpu0
    results.sort(key=lambda r: r.number)
    reason = "cancel" if interrupted.is_set() else "timeout" if timed_out else "normal"
    return LoadResult(results, wall, cpu, 1, reason)


# --------------------------------------------------------------------------- several processes


def _child(plan: LoadPlan, part: int, parts: int, barrier: Any, out: Any, parent_pid: int,
           interruptible: bool = False) -> None:
    die_with_parent(parent_pid, signal.SIGKILL)  # a killed bench leaves no client process behind
    try:
        import uvloop

        res = uvloop.run(run_part(plan, part, parts, barrier, interruptible, client_process=True))
        out.put(("ok", part, [asdict(r) for r in res.results], res.wall_s, res.cpu_s, res.end_reason))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        if barrier is not None:
            barrier.abort()
        out.put(("error", part, f"{type(exc).__name__}: {exc}", 0.0, 0.0, ""))


def run_load(plan: LoadPlan, in_process: bool | None = None, interruptible: bool = False) -> LoadResult:
    """Run the plan and return every call's result.

    Args:
        plan: what to run; ``plan.procs`` client processes.
        in_process: run in this process (only with procs == 1; the default
            then). ``False`` forces a child process even for one part, which
            keeps the caller's event loop free to serve (``bench compare``).
        interruptible: called on the main thread (a command's run): SIGINT (Ctrl-C) once the calls started
            ends the run with the calls that completed, end reason ``cancel`` (:func:`run_part`); the client
            processes are sent it too (Ctrl-C on a terminal reaches them anyway).

    Raises:
        RuntimeError: a client process failed (its error is in the message).
        ValueError: bad plan (see :class:`LoadPlan`).
        KeyboardInterrupt: ``interruptible``, SIGINT before any call started (or a second one).
    """
    if in_process is None:
        in_process = plan.procs == 1
    if in_process:
        if plan.procs != 1:
            raise ValueError("in_process needs procs == 1")
        import uvloop

        return uvloop.run(run_part(plan, interruptible=interruptible))
    parts = min(plan.procs, plan.concurrency)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(parts)
    out = ctx.Queue()
    children = [ctx.Process(target=_child, args=(plan, k, parts, barrier, out, os.getpid(), interruptible),
                            daemon=True) for k in range(parts)]
    for child in children:
        child.start()
    results: list[CallResult] = []
    walls, cpu, reasons, errors = [], 0.0, set(), []
    received = 0
    interrupted_at: float | None = None  # monotonic time of the SIGINT that stopped the run
    try:
        while received < parts:
            if interrupted_at is not None and time.monotonic() - interrupted_at > INTERRUPT_WAIT_S:
                break  # a part that has not sent its calls by now sends none (the finally stops it)
            try:
                status, part, payload, wall, cpu_s, reason = out.get(timeout=1.0)
            except queue_mod.Empty:
                crashed = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                if (interrupted_at is None and crashed) or not any(c.is_alive() for c in children):
                    if interrupted_at is not None:  # the parts that had calls sent them; the rest stopped before
                        break
                    raise RuntimeError(
                        f"client processes exited (codes {crashed}) with {parts - received} results missing"
                    ) from None
                continue
            except KeyboardInterrupt:
                if not interruptible or interrupted_at is not None:
                    raise
                interrupted_at = time.monotonic()  # each client process stops and sends what completed
                _interrupt(children)
                continue
            received += 1
            if status == "error":
                errors.append(f"client process {part}: {payload}")
                if interruptible and payload.startswith("KeyboardInterrupt") and interrupted_at is None:
                    interrupted_at = time.monotonic()  # Ctrl-C reached the client processes (their group) first
                    _interrupt(children)
                continue
            results.extend(CallResult(**r) for r in payload)
            walls.append(wall)
            cpu += cpu_s
            reasons.add(reason)
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    interrupted = interrupted_at is not None
    if errors and not interrupted:  # interrupted, a part stopped before its calls started has nothing to report
        raise RuntimeError("; ".join(errors))
    if interrupted and not walls:
        raise KeyboardInterrupt  # interrupted before any part's calls started: nothing to report
    results.sort(key=lambda r: r.number)
    reason = "cancel" if interrupted or "cancel" in reasons else "timeout" if "timeout" in reasons else "normal"
    return LoadResult(results, max(walls), cpu, parts, reason)


def _interrupt(children: list[Any]) -> None:
    """SIGINT to each client process still running: it stops and sends the calls that completed."""
    for child in children:
        if child.is_alive() and child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGINT)


def with_procs(plan: LoadPlan, procs: int | str) -> LoadPlan:
    """``plan`` with ``procs`` set; ``"auto"`` picks :func:`auto_procs`."""
    return replace(plan, procs=auto_procs(plan) if procs == "auto" else int(procs))
