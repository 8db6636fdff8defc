"""``switchyard bench upstream``: one load straight at a model server and through Switchyard, taking turns.

Switchyard's ``openai`` engine is meant to sit in front of a model server
someone else wrote. This benchmark puts the same chat load on such a server
directly (streamed ``/v1/chat/completions``, the messages the ``chat`` workflow
sends) and through a whole stack (orchestrator and dispatcher, each in its own
process, the dispatcher on the ``openai`` engine pointed at the server; load as
``RunTask`` chat tasks), in one run, the two taking turns so that they share
the machine's state. Phases, each ``--phase-s`` long (calls that end inside the
phase count; each phase drains before the next starts):

1. **direct sweep** at 1, 2, 4, 8, 16, 32 streams: the server's *knee*, the
   fewest streams whose calls/s reach 90 % of the sweep's highest; its
   *plateau* is the highest calls/s of any direct phase of the run;
2. **turns**: direct, through, direct, through... at 8 and at 32 streams
   (``--rounds`` rounds): through / direct calls/s at each;
3. **CORE unloaded**: one CORE task at a time through Switchyard (and the same
   directly);
4. **CORE beside 32 BATCH streams**: 32 BATCH tasks kept running through
   Switchyard and one CORE task at a time beside them (the first
   ``--settle-s`` of BATCH load not measured); the same directly, where the
   server serves first come, first served.

Figures printed: calls/s and TTFT P50/P95 per class for every phase, the
dispatcher's adaptive limit and knee estimate over time (read from its
metrics every 0.5 s), and: the direct knee and plateau, and the server's own
TTFT P50 at its knee over its TTFT at one stream (what a newcomer meets at
the knee whatever the dispatcher does); through / direct calls/s
at 8 and 32 streams; CORE TTFT P95 beside 32 BATCH / CORE unloaded (through
Switchyard, and directly for reference); BATCH calls/s through Switchyard in
that phase / the direct plateau; the limit under a steady 32-stream load (the
median of the samples in the through phases at 32 streams and the BATCH phase)
/ the direct knee; and the CPU the dispatcher and the orchestrator each spent
per call over the through turns (``process_cpu_seconds_total`` read from their
metrics before and after each such phase, divided by its calls), the cost the
stack's processes add on cores the server also needs.

The stack gets a DRAM tier of its own (``--dram``: by default a private
redis-server started for the run, as ``bench agents`` and ``switchyard up`` do;
``off`` turns agent memory and KV swap off) and a task store in a temporary
folder, so it never reaches for the default 127.0.0.1:6379 or another stack's
files. ``--set KEY=VALUE`` overrides any config key as docs/configuration.md
names it (``model_gateway.concurrency.initial_limit=2``;
:mod:`switchyard_harness.bench.settings`).

Default upstream: ``transformers serve --continuous-batching --device cpu``
serving a random-weight tiny Llama built offline
(:mod:`switchyard_harness.testing.transformers_serve`); ``--base-url`` (and
``--model``) for any other OpenAI-compatible server. The default run takes about
80 s plus start-up; ``--phase-s`` and ``--rounds`` run longer. The ``transformers
serve`` it starts ends with the run: at its end, on SIGTERM or Ctrl-C (the run
stops, exit status 143 or 130), and when the run is killed (``kill -9``: the
kernel's parent-death signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from switchyard_harness import json_output
from switchyard_harness.arg_types import model_server_url
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard_harness.bench.report import percentile
from switchyard.common import envs
from switchyard.common.cli_text import parser_for
from switchyard.common.config import ConfigError, DramTierConfig, SwitchyardConfig, load_config
from switchyard.gateway.decode import answer_choice
from switchyard_harness.bench.sched_bench import _dram_arg, _dram_tier, own_tier_overrides

SWEEP_STREAMS = (1, 2, 4, 8, 16, 32)
TURN_STREAMS = (8, 32)
LOADED_BATCH_STREAMS = 32
KNEE_FRACTION = 0.9
"""The knee: the fewest streams whose direct calls/s reach this fraction of the plateau (the issue's rule)."""
QUESTION = "How does the with statement work in Python, and when should a context manager be used?"
SYSTEM = "You are a helpful assistant. Answer briefly and accurately."
"""The ``chat`` workflow's system prompt (orchestrator/templates/chat.system.j2), sent as it sends it."""
SAMPLE_INTERVAL_S = 0.5


@dataclass
class Call:
    """One call as the client saw it: class, monotonic start/end seconds, TTFT seconds, tokens, error."""

    cls: str
    start: float
    end: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Phase:
    """One phase's calls and the limit samples taken while it ran."""

    name: str
    mode: str  # direct or through
    streams: int
    start: float
    end: float = 0.0
    calls: list[Call] = field(default_factory=list)
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)  # (t, limit, knee, in flight)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """Through phases: CPU seconds each stack process (dispatcher, orchestrator) spent from the phase's start
    until its calls had drained (``process_cpu_seconds_total`` read from its metrics)."""

    def ok(self, cls: str | None = None) -> list[Call]:
        """Calls that succeeded and ended inside the phase (of class ``cls``, or all)."""
        return [c for c in self.calls
                if not c.error and self.start <= c.end <= self.end and (cls is None or c.cls == cls)]

    def calls_per_s(self, cls: str | None = None) -> float:
        return len(self.ok(cls)) / (self.end - self.start) if self.end > self.start else 0.0

    def ttft(self, cls: str, p: int) -> float | None:
        values = [c.ttft_s for c in self.ok(cls) if c.ttft_s is not None]
        return percentile(values, p) if values else None

    @property
    def errors(self) -> int:
        return sum(1 for c in self.calls if c.error)


# --------------------------------------------------------------------------- clients


class DirectClient:
    """Streamed chat completions straight at the upstream (aiohttp, as the ``openai`` engine's transport); a chunk
    counts as a token where the answer's choice (:func:`switchyard.gateway.decode.answer_choice`, the choice of
    index 0 wherever it sits) carries content."""

    def __init__(self, base_url: str, model: str, max_tokens: int, api_key: str = "") -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.body = {
            "model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"<question>{QUESTION}</question>"}],
        }
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None

    async def __aenter__(self) -> "DirectClient":
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def call(self, cls: str) -> Call:
        call = Call(cls, time.monotonic())
        try:
            async with self._session.post(self.url, json=self.body, headers=self.headers) as response:
                if response.status != 200:
                    call.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                else:
                    async for raw in response.content:
                        line = raw.strip()
                        if not line.startswith(b"data:") or line == b"data: [DONE]":
                            continue
                        chunk = json.loads(line[5:])
                        # the answer is the choice of index 0 wherever it sits, as the gateway reads it
                        choice = answer_choice(chunk.get("choices") or [], "a stream chunk", line.decode())
                        if choice is not None and (choice.get("delta") or {}).get("content"):
                            if call.ttft_s is None:
                                call.ttft_s = time.monotonic() - call.start
                            call.tokens += 1
        except Exception as exc:  # noqa: BLE001 - counted as a failed call
            call.error = f"{type(exc).__name__}: {exc}"
        call.end = time.monotonic()
        return call


class ThroughClient:
    """``RunTask`` chat tasks through a Switchyard orchestrator."""

    def __init__(self, host: str, max_tokens: int) -> None:
        self.host = host
        self.max_tokens = max_tokens
        self._channel: Any = None
        self._stub: Any = None
        self._numbers = iter(range(10**9))

    async def __aenter__(self) -> "ThroughClient":
        from switchyard.common.channels import open_channel

        self._context = open_channel(self.host)
        self._channel = await self._context.__aenter__()
        await asyncio.wait_for(self._channel.channel_ready(), 30)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._context.__aexit__(None, None, None)

    async def call(self, cls: str) -> Call:
        request = agent_pb2.RunTaskRequest(
            task_id=f"upstream-bench-{next(self._numbers)}", payload=QUESTION, task_type="chat",
            priority=getattr(agent_pb2, cls), max_tokens=self.max_tokens,
        )
        call = Call(cls, time.monotonic())
        try:
            async for event in self._stub.RunTask(request, timeout=120):
                if event.WhichOneof("event") == "token":
                    if call.ttft_s is None:
                        call.ttft_s = time.monotonic() - call.start
                    call.tokens += max(1, event.token.count)
        except grpc.aio.AioRpcError as exc:
            call.error = f"{exc.code().name}: {exc.details()}"
        call.end = time.monotonic()
        return call


# --------------------------------------------------------------------------- phases


async def closed_loop(phase: Phase, loads: list[tuple[Callable[[str], Awaitable[Call]], str, int, float]]) -> Phase:
    """Run ``loads`` (call, class, streams, start delay s) as closed loops until ``phase.end``; drain.

    Each stream issues its next call as soon as the last one ended, and starts no call after the
    phase's end; the phase returns once every call in flight has ended.
    """
    async def stream(call: Callable[[str], Awaitable[Call]], cls: str, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        while time.monotonic() < phase.end:
            phase.calls.append(await call(cls))

    await asyncio.gather(*(stream(call, cls, delay) for call, cls, n, delay in loads for _ in range(n)))
    return phase


async def run_phase(name: str, mode: str, streams: int, seconds: float,
                    loads: list[tuple[Callable[[str], Awaitable[Call]], str, int, float]],
                    measure_from_s: float = 0.0) -> Phase:
    start = time.monotonic()
    phase = Phase(name, mode, streams, start + measure_from_s, start + seconds)
    return await closed_loop(phase, loads)


class LimitSampler:
    """Reads the dispatcher's limit, knee and streams in flight every 0.5 s (its Prometheus endpoint)."""

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self.samples: list[tuple[float, float, float, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        from switchyard_harness.top import read, total

        while True:
            try:
                samples = await asyncio.to_thread(read, self.url, 2.0)
                self.samples.append((time.monotonic(), total(samples, "switchyard_upstream_concurrency_limit"),
                                     total(samples, "switchyard_upstream_concurrency_knee"),
                                     total(samples, "switchyard_upstream_in_flight")))
            except (OSError, ValueError):
                pass
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def attach(self, phase: Phase) -> None:
        phase.samples = [s for s in self.samples if phase.start <= s[0] <= phase.end]


# --------------------------------------------------------------------------- the run


@contextlib.asynccontextmanager
async def upstream(base_url: str | None, model: str | None, kv_blocks: int) -> AsyncIterator[tuple[str, str]]:
    """The server to measure: ``base_url`` as given (model from ``--model`` or its ``/v1/models``), or a
    tiny Llama on ``transformers serve`` started here. Yields (base_url, model)."""
    if base_url:
        if not model:
            import httpx

            try:
                answer = httpx.get(base_url + "/models", timeout=10)
                answer.raise_for_status()
                model = answer.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:  # was a traceback
                why = (f"answered {exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError)
                       else f"{type(exc).__name__}: {exc}")
                raise RuntimeError(f"--base-url {base_url}: its models could not be listed (GET /models {why}); "
                                   "start the server there, or name the model with --model") from None
        yield base_url, model
        return
    from switchyard_harness.testing.transformers_serve import TransformersServer, build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="bench-upstream-") as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny-llama")
        server = TransformersServer(model_dir, kv_blocks=kv_blocks)
        try:
            # launched here, on the event loop's (main) thread: the server then ends if this process is killed;
            # only the wait for it to serve goes to a worker thread
            server.launch()
            await asyncio.to_thread(server.wait_ready)
            yield server.base_url, server.model
        finally:
            server.stop()  # here, not in a thread: a cancelled run (SIGTERM, Ctrl-C) still waits for it to end


@contextlib.asynccontextmanager
async def switchyard_stack(config: SwitchyardConfig) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Dispatcher (``openai`` engine) and orchestrator, each in its own process; yields
    (orchestrator host:port, {"dispatcher": metrics URL, "orchestrator": metrics URL})."""
    from switchyard_harness.bench import stack_process

    children = []
    try:
        dispatcher = await stack_process.start("dispatcher", config)
        children.append(dispatcher)
        wired = config.with_overrides(**{"orchestrator.dispatcher_addr": dispatcher.address,
                                         "orchestrator.retrieval_addr": "127.0.0.1:1"})  # chat tasks retrieve nothing
        orchestrator = await stack_process.start("orchestrator", wired)
        children.append(orchestrator)
        yield orchestrator.address, {"dispatcher": dispatcher.metrics_url, "orchestrator": orchestrator.metrics_url}
    finally:
        for child in reversed(children):
            await child.stop()


async def measure(args: Any, base: SwitchyardConfig) -> dict[str, Any]:
    """Run every phase (see the module docstring); returns the phases and the figures. SIGTERM cancels the run
    as Ctrl-C does (``asyncio.CancelledError`` then, ``KeyboardInterrupt`` for Ctrl-C): what it started, the
    model server and the stack, is stopped on the way out. Without it, SIGTERM ended the process at once and
    left the ``transformers serve`` it started running (in its own session, no signal of the caller's reaches
    it)."""
    loop = asyncio.get_running_loop()
    run = asyncio.current_task()
    assert run is not None
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        loop.add_signal_handler(signal.SIGTERM, run.cancel)
    try:
        return await _measure(args, base)
    finally:
        if on_main_thread:
            loop.remove_signal_handler(signal.SIGTERM)


async def _measure(args: Any, base: SwitchyardConfig) -> dict[str, Any]:
    phases: list[Phase] = []
    s = args.phase_s
    async with contextlib.AsyncExitStack() as stack:
        base_url, model = await stack.enter_async_context(upstream(args.base_url, args.model, args.kv_blocks))
        # The stack's own DRAM tier and task store: never the default 127.0.0.1:6379 and data/tasks.sqlite3,
        # which another stack on this machine (switchyard up) may own.
        tier, dram = _dram_tier(args.dram, base.memory.dram, stack.enter_context(contextlib.ExitStack()))
        store_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-upstream-tasks-"))
        config = stack_config(base, args, base_url, model, tier, store_dir)
        if not args.json:
            print(f"DRAM tier of the stack: {dram}", flush=True)
        key = (envs.read_secret(args.api_key_env) or "") if args.api_key_env else ""
        async with (switchyard_stack(config) as (host, metrics_urls), DirectClient(base_url, model, args.max_tokens, key)
                    as direct, ThroughClient(host, args.max_tokens) as through):
            sampler = LimitSampler(metrics_urls["dispatcher"])
            sampler.start()
            try:
                def log(phase: Phase) -> Phase:
                    sampler.attach(phase)
                    phases.append(phase)
                    if not args.json:
                        print(phase_line(phase), flush=True)
                    return phase

                await run_phase("warm-up", "direct", 8, min(s, 2.0), [(direct.call, "BATCH", 8, 0.0)])
                await run_phase("warm-up", "through", 8, min(s, 2.0), [(through.call, "BATCH", 8, 0.0)])
                for n in SWEEP_STREAMS:
                    log(await run_phase("sweep", "direct", n, s, [(direct.call, "BATCH", n, 0.0)]))
                for _ in range(args.rounds):
                    for n in TURN_STREAMS:
                        for mode, client in (("direct", direct), ("through", through)):
                            before = await stack_cpu_s(metrics_urls) if mode == "through" else {}
                            phase = await run_phase("turns", mode, n, s, [(client.call, "BATCH", n, 0.0)])
                            if before:
                                after = await stack_cpu_s(metrics_urls)
                                phase.cpu_s = {name: after[name] - before[name] for name in before}
                            log(phase)
                for mode, client in (("direct", direct), ("through", through)):
                    log(await run_phase("core unloaded", mode, 1, s, [(client.call, "CORE", 1, 0.0)]))
                for mode, client in (("through", through), ("direct", direct)):
                    settle = args.settle_s
                    log(await run_phase("core + 32 batch", mode, LOADED_BATCH_STREAMS, settle + 2 * s,
                                        [(client.call, "BATCH", LOADED_BATCH_STREAMS, 0.0),
                                         (client.call, "CORE", 1, settle)], measure_from_s=settle))
            finally:
                await sampler.stop()
    return {"base_url": base_url, "model": model, "phases": phases, "figures": {**figures(phases), "dram": dram}}


BENCH_OWNED_KEYS = frozenset({"dispatcher.engine", "upstream.base_url", "upstream.default_model",
                              "upstream.fallback_model", "upstream.api_key_env", "upstream.pool.endpoints",
                              "upstream.pool.dns_url"})
"""Config keys the run sets for its stack (:func:`stack_config`), as attribute paths: ``--set`` may not move them."""


def stack_config(base: SwitchyardConfig, args: Any, base_url: str, model: str, dram: DramTierConfig | None,
                 store_dir: str) -> SwitchyardConfig:
    """The config of the stack under test: ``base``, the ``openai`` engine on ``base_url``/``model``, the DRAM
    tier on ``dram``'s Redis (None: off: no agent memory, no KV swap, nothing asks a Redis), the task store's
    SQLite file in ``store_dir``, then ``args.overrides`` (``--set``, which win).

    Raises:
        ConfigError: an override fails validation.
    """
    return base.with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": base_url, "upstream.default_model": model,
        "upstream.fallback_model": "", "upstream.api_key_required": bool(args.api_key_env),
        **({"upstream.api_key_env": args.api_key_env} if args.api_key_env else {}),
        **own_tier_overrides(dram, store_dir),
        **args.overrides,
    })


async def stack_cpu_s(metrics_urls: dict[str, str]) -> dict[str, float]:
    """CPU seconds each stack process has used so far (its ``process_cpu_seconds_total``)."""
    from switchyard_harness.top import read, total

    out = {}
    for name, url in metrics_urls.items():
        samples = await asyncio.to_thread(read, url, 5.0)
        out[name] = total(samples, "process_cpu_seconds_total")
    return out


def figures(phases: list[Phase]) -> dict[str, Any]:
    """The headline figures (see the module docstring); a figure that could not be measured is None."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    sweep_phases = {p.streams: p for p in phases if p.name == "sweep"}
    sweep = {n: p.calls_per_s() for n, p in sweep_phases.items()}
    sweep_top = max(sweep.values()) if sweep else None
    knee = min((n for n, v in sweep.items() if sweep_top and v >= KNEE_FRACTION * sweep_top), default=None)
    # The plateau: the most calls/s any direct phase reached (the sweep, the turns, the direct BATCH phase
    # beside CORE), so that a machine that got faster after the sweep does not flatter the ratios against it.
    plateau = max((p.calls_per_s() for p in phases if p.mode == "direct"), default=None)

    def turns(mode: str, n: int) -> float:
        picked = [p for p in phases if p.name == "turns" and p.mode == mode and p.streams == n]
        return sum(len(p.ok()) for p in picked) / sum(p.end - p.start for p in picked) if picked else 0.0

    def one(name: str, mode: str) -> Phase | None:
        return next((p for p in phases if p.name == name and p.mode == mode), None)

    unloaded, loaded = one("core unloaded", "through"), one("core + 32 batch", "through")
    unloaded_d, loaded_d = one("core unloaded", "direct"), one("core + 32 batch", "direct")
    steady = [sample[1] for p in phases if p.mode == "through" and p.streams == 32
              for sample in p.samples[len(p.samples) // 2:]]
    limit_32 = statistics.median(steady) if steady else None
    knees = [sample[2] for p in phases if p.mode == "through" for sample in p.samples if sample[2] > 0]

    def ttft(phase: Phase | None, cls: str, p: int) -> float | None:
        return phase.ttft(cls, p) if phase is not None else None

    measured = [p for p in phases if p.cpu_s and p.calls]
    cpu_ms = {name: 1000 * sum(p.cpu_s[name] for p in measured) / sum(len(p.calls) for p in measured)
              for name in (measured[0].cpu_s if measured else {})}

    return {
        "direct_calls_per_s": sweep,
        "direct_plateau_calls_per_s": plateau,
        "direct_knee_streams": knee,
        # what any admission at the knee leaves a newcomer: the server's own TTFT there over its TTFT alone
        "direct_ttft_p50_at_knee_over_one_stream": ratio(
            sweep_phases[knee].ttft("BATCH", 50) if knee in sweep_phases else None,
            sweep_phases[1].ttft("BATCH", 50) if 1 in sweep_phases else None),
        "through_over_direct_8": ratio(turns("through", 8), turns("direct", 8)),
        "through_over_direct_32": ratio(turns("through", 32), turns("direct", 32)),
        "core_ttft_p95_loaded_over_unloaded": ratio(ttft(loaded, "CORE", 95), ttft(unloaded, "CORE", 95)),
        "core_ttft_p50_loaded_over_unloaded": ratio(ttft(loaded, "CORE", 50), ttft(unloaded, "CORE", 50)),
        "direct_core_ttft_p95_loaded_over_unloaded": ratio(ttft(loaded_d, "CORE", 95), ttft(unloaded_d, "CORE", 95)),
        "batch_through_over_direct_plateau": ratio(loaded.calls_per_s("BATCH") if loaded else None, plateau),
        "limit_steady_32": limit_32,
        "limit_steady_32_over_knee": ratio(limit_32, knee),
        "dispatcher_knee_estimate": knees[-1] if knees else None,
        # CPU of each stack process per call, over the through turns (every call of those phases, drained)
        "stack_cpu_ms_per_call": cpu_ms,
        "errors": sum(p.errors for p in phases),
    }


# --------------------------------------------------------------------------- output


def _ms(value: float | None) -> str:
    return f"{value * 1000:6.1f}" if value is not None else "     -"


def phase_line(p: Phase) -> str:
    classes = sorted({c.cls for c in p.calls}, key=["CORE", "NORMAL", "BATCH"].index)
    ttfts = "  ".join(f"{cls} TTFT P50 {_ms(p.ttft(cls, 50))} P95 {_ms(p.ttft(cls, 95))} ms" for cls in classes)
    limits = [s[1] for s in p.samples]
    limit = (f"  limit {min(limits):.1f}/{statistics.median(limits):.1f}/{max(limits):.1f} knee {p.samples[-1][2]:.0f}"
             if limits and p.mode == "through" else "")
    per_class = " ".join(f"{cls} {p.calls_per_s(cls):.1f}" for cls in classes) if len(classes) > 1 else ""
    errors = f"  errors {p.errors}" if p.errors else ""
    ok = p.ok()
    if ok:
        errors = (f"  {sum(c.tokens for c in ok) / len(ok):.0f} tok/call, latency P50 "
                  f"{_ms(percentile([c.end - c.start for c in ok], 50)).strip()} ms{errors}")
    return (f"{p.name:<16} {p.mode:<8} {p.streams:>3} streams  {p.calls_per_s():6.1f} calls/s {per_class:<20} "
            f"{ttfts}{limit}{errors}")


def summary(result: dict[str, Any]) -> str:
    f = result["figures"]

    def num(value: float | None, fmt: str = ".2f") -> str:
        return format(value, fmt) if value is not None else "-"

    lines = [
        "",
        f"upstream {result['base_url']} model {result['model']}",
        "direct sweep calls/s: " + ", ".join(f"{n}: {v:.1f}" for n, v in f["direct_calls_per_s"].items()),
        f"direct plateau {num(f['direct_plateau_calls_per_s'], '.1f')} calls/s; knee (90 % of plateau) "
        f"{f['direct_knee_streams']} streams; direct TTFT P50 at the knee / at 1 stream "
        f"{num(f['direct_ttft_p50_at_knee_over_one_stream'])}x",
        f"through / direct calls/s: 8 streams {num(f['through_over_direct_8'])}, 32 streams "
        f"{num(f['through_over_direct_32'])}   (target >= 0.9)",
        f"CORE TTFT P95 beside 32 BATCH / unloaded: through Switchyard {num(f['core_ttft_p95_loaded_over_unloaded'])}x "
        f"(P50 {num(f['core_ttft_p50_loaded_over_unloaded'])}x; target <= 1.5), directly "
        f"{num(f['direct_core_ttft_p95_loaded_over_unloaded'])}x",
        f"BATCH calls/s through Switchyard beside CORE / direct plateau: "
        f"{num(f['batch_through_over_direct_plateau'])}   (target >= 0.85)",
        f"limit under steady 32 streams {num(f['limit_steady_32'], '.1f')} / direct knee {f['direct_knee_streams']}: "
        f"{num(f['limit_steady_32_over_knee'])}   (target 0.5-1.5); dispatcher's knee estimate "
        f"{num(f['dispatcher_knee_estimate'], '.0f')}",
        "stack CPU per call, through turns: " + (", ".join(
            f"{name} {ms:.2f} ms" for name, ms in f["stack_cpu_ms_per_call"].items()) or "-"),
        f"failed calls: {f['errors']}; DRAM tier of the stack: {f.get('dram', '-')}",
        "",
        "limit over time (through phases: t s, limit, knee, in flight):",
    ]
    t0 = min((p.start for p in result["phases"]), default=0.0)
    for p in result["phases"]:
        if p.mode == "through" and p.samples:
            points = " ".join(f"{s[0] - t0:.0f}:{s[1]:.0f}/{s[2]:.0f}/{s[3]:.0f}" for s in p.samples[::2])
            lines.append(f"  {p.name} {p.streams}: {points}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``switchyard bench upstream [--base-url URL] [--model ID] [--phase-s S] [--rounds N] [--json]``."""
    from switchyard_harness.bench.settings import documented_names, parse_settings, resolve_key

    parser = parser_for("switchyard bench upstream", __doc__)
    parser.add_argument("--base-url", type=model_server_url, help="an OpenAI-compatible server ending in /v1 (default: start transformers "
                        "serve with a tiny random-weight Llama)")
    parser.add_argument("--model", help="model id to request (default: the first of the server's /v1/models)")
    parser.add_argument("--api-key-env", default="", help="environment variable holding the server's API key")
    parser.add_argument("--phase-s", type=float, default=3.0, help="length of each phase, seconds (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of direct/through at 8 and 32 streams (default 2)")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="BATCH load before CORE tasks are measured beside it, seconds (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every call (default 16)")
    parser.add_argument("--kv-blocks", type=int, default=512, help="paged KV blocks of the started transformers serve")
    parser.add_argument("--config-dir", help="config folder (default $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the stack, a key as docs/configuration.md names it, e.g. "
                        "model_gateway.concurrency.core_reserved_slots=4 (JSON values; "
                        "switchyard_harness.bench.settings)")
    parser.add_argument("--dram", type=_dram_arg, default="embedded",
                        help="the stack's DRAM tier: embedded (a private redis-server for the run, default), "
                        "HOST:PORT of a Redis to use, or off (no agent memory, no KV swap)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    for flag, value, ok, what in (  # nan passed `<= 0`, and inf never ended
        ("--phase-s", args.phase_s, 0 < args.phase_s < math.inf, "a finite number of seconds > 0"),
        ("--rounds", args.rounds, args.rounds >= 1, "at least 1"),
        ("--settle-s", args.settle_s, 0 <= args.settle_s < math.inf, "a finite number of seconds >= 0"),
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
        # 0 started a transformers serve with no KV cache, and every call of the run failed
        ("--kv-blocks", args.kv_blocks, args.kv_blocks >= 1, "at least 1"),
    ):
        if not ok:
            parser.error(f"{flag}: expected {what}, got {value}")
    try:
        args.overrides = parse_settings(args.set)
        base = load_config(args.config_dir)
        base.with_overrides(**args.overrides)
    except (ValueError, ConfigError, KeyError) as exc:
        print(f"switchyard bench upstream: {documented_names(str(exc))}", file=sys.stderr)
        return 2
    owned = sorted(key for key, _, _ in (item.partition("=") for item in args.set)
                   if resolve_key(key.strip()) in BENCH_OWNED_KEYS)  # named as the caller wrote them
    if owned:  # the run sets these itself: an override would point the stack away from what the report names
        parser.error(f"--set: {', '.join(owned)} is the run's own (the server measured directly: --base-url, "
                     "--model, --api-key-env); the stack must call the server the report names")
    import uvloop

    try:
        result = uvloop.run(measure(args, base))
    except (asyncio.CancelledError, KeyboardInterrupt) as exc:  # SIGTERM, Ctrl-C: what it started is stopped
        print("switchyard bench upstream: stopped; the model server and stack it started are stopped too",
              file=sys.stderr)
        return 128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    except ConfigError as exc:
        print(f"switchyard bench upstream: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"switchyard bench upstream: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json_output.dumps(result["figures"], indent=2))
    else:
        print(summary(result))
    return 0 if result["figures"]["errors"] == 0 else 1
