"""The field's agent load test: N react agents on the sim latency model, memory tiers acting.

``switchyard bench agents`` (or ``python -m switchyard_harness.bench.agents_bench``).
With ``--policies`` it compares scheduling policies on a tenant workload
instead (:mod:`switchyard_harness.bench.program_policies`).

In-process and on a simulated clock, like ``bench sched``
(:mod:`switchyard_harness.bench.sched_bench`, whose engine and step loop it reuses):
the dispatcher's scheduler, KV budget, parking and memory tiers run for real;
the engine's step times come from the sim's latency model, and a DRAM swap's
transfer time from ``[dram] transfer_gb_per_s``. The DRAM tier is a real
Redis (``--dram``, an embedded redis-server by default).

The load (the field's second report):

- ``--agents`` agents (default 100), each running react_loop tasks one after
  another; a task's priority class is drawn from ``--mix`` (core/normal/batch
  percent, summing to 100);
- a task opens with a prompt of ``--prompt-tokens`` (system prompt, tools,
  retrieved passages) and makes ``--tool-calls`` tool calls: each step
  generates a tool call (``--call-tokens``) and parks the agent, the tool
  answers after a think time drawn from ``--think`` seconds (0.1-0.5) with
  ``--result-tokens`` of result, and the agent's next step (``resume``)
  repeats the whole conversation so far; the last step answers (up to
  ``max_tokens`` 512);
- for ``--seconds`` of simulated time, then the tasks in flight drain.

Reported: engine busy ratio and roofline efficiency (generated tokens per busy
second / the sim model's decode bound at the largest batch seen), KV
fragmentation (mean and max of the fragmentation ratio), OOM count (real
allocation failures, tasks failed for memory) and OOMs avoided, evictions,
promotions and demotions per tier, every task started and how it ended
(completed, failed, or unfinished at the drain limit: the three add up to the
started, checked), restored against recomputed prefix tokens, how each
tool-return step got its prefix in the end (warm in HBM, restored from a tier,
recomputed: read from the finished step, so a step sent to DRAM whose lookup
missed counts as recomputed), and per-class P95 of step TTFT and task
completion time. Tasks under way when the load window closes drain: their next
steps still arrive. ``--out``
writes the JSON report and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prometheus_client import REGISTRY

from switchyard_harness import json_output
from switchyard_harness.arg_types import positive
from switchyard.common import outputs
from switchyard.common.config import ConfigError, DramTierConfig, SwitchyardConfig, load_config
from switchyard_harness.bench.sched_bench import (
    CLASSES,
    _dram_arg,
    _dram_tier,
    _mix,
    _pair,
    kv_store,
    percentile,
    quiet_score_log,
    run_slice,
    schedule_turn,
)
from switchyard_harness.testing.step_plan import StepPlan
from switchyard_harness.bench.program_policies import (
    POLICY_NAMES,
    SIMULATED_CLOCK,
    AgentSimEngine,
    Workload,
    capacity_scale,
    run_policies,
)
from switchyard_harness.bench.program_policies import render as render_policies
from switchyard_harness.bench.program_stack import ENGINES as STACK_ENGINES
from switchyard_harness.bench.program_stack import STACK_CLOCK, run_stack_policies
from switchyard_harness.bench.rag_prefill import RagLoad, run_rag_prefill
from switchyard_harness.bench.rag_prefill import render as render_rag
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engines.sim import ModelledKV, decode_seconds
from switchyard.dispatcher.metrics import publish_stats
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.scheduler.base import REACT_TASK_TYPE
from switchyard.dispatcher.scheduler.capacity import KvBudget
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.tiers import MemoryTiers
from switchyard.dispatcher.tiers.metrics import TIERS

MAX_TOKENS = 512
"""The field's max_tokens for every step."""


@dataclass
class Agent:
    """One agent's state between its steps."""

    agent_id: str
    rng: random.Random
    priority_class: str = "normal"
    context_tokens: int = 0
    calls_left: int = 0
    next_at: float = 0.0
    resume: bool = False
    task_started: float = 0.0
    tasks: int = 0
    step: int = 0
    busy: bool = False
    """A step of it is with the dispatcher."""
    in_task: bool = False
    """Its current task's first step has arrived and the task has not ended."""

    def has_step_due(self, window_s: float) -> bool:
        """A step waits to arrive: the next of a task under way (always, so tasks drain), or a new
        task's first one inside the load window."""
        return not self.busy and (self.in_task or self.next_at < window_s)


@dataclass
class Outcome:
    """What one run measured (simulated seconds)."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name, _ in CLASSES})
    completion: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name, _ in CLASSES})
    failed: dict[str, int] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in CLASSES})
    """Tasks whose first step arrived, by class: each ends completed, failed or unfinished."""
    unfinished: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in CLASSES})
    """Tasks still under way at the drain limit."""
    resumes: dict[str, int] = field(default_factory=lambda: {"warm": 0, "restored": 0, "recomputed": 0})
    """Tool-return steps by how they got their prefix in the end, read from each finished step: kept warm
    in HBM, restored from a tier (restored_tokens, nothing recomputed), or recomputed (some of it at least:
    lost, a DRAM miss, or preempted later)."""
    restored_tokens: int = 0
    recomputed_tokens: int = 0
    fragmentation: list[float] = field(default_factory=list)
    steps: int = 0
    makespan: float = 0.0
    swap_seconds: float = 0.0


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _counters() -> dict[str, float]:
    """The tier and scheduler counters this report reads, by a readable key."""
    out = {
        "oom": _sample("switchyard_kv_oom_total"),
        "oom_avoided": _sample("switchyard_kv_oom_avoided_total"),
        "preemptions": sum(_sample("switchyard_preemptions_total", priority_class=c) for c, _ in CLASSES),
    }
    for tier in TIERS:
        for family in ("evictions", "promotions", "demotions", "hits", "misses"):
            out[f"{family}_{tier}"] = _sample(f"switchyard_tier_{family}_total", tier=tier)
    return out


async def run_agents(args: argparse.Namespace, config: SwitchyardConfig,
                     dram: DramTierConfig | None) -> tuple[Outcome, dict[str, Any]]:
    """Run the load (``dram``: the DRAM tier's Redis, None for none); returns what was measured and the
    counters' increase."""
    engine = AgentSimEngine(config.sim)
    store = kv_store(dram)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=False)
    sched = make_scheduler(config, engine, monitor=monitor, tiers=tiers)
    master = random.Random(args.seed)
    agents = [Agent(f"agent-{i:03d}", random.Random(master.random())) for i in range(args.agents)]
    for agent in agents:
        agent.next_at = agent.rng.uniform(*args.think)
        _new_task(agent, args, agent.next_at)
    in_flight: dict[Request, Agent] = {}
    seen_first: set[Request] = set()
    result = Outcome()
    before = _counters()
    slice_s = config.scheduler.time_slice_ms / 1000
    limit = args.seconds * args.drain_limit
    t = 0.0

    def arrive() -> None:
        for agent in agents:
            if agent.next_at <= t and agent.has_step_due(args.seconds):
                if not agent.in_task:
                    agent.in_task = True
                    result.started[agent.priority_class] += 1
                agent.busy = True
                agent.step += 1
                last = agent.calls_left == 0
                length = agent.rng.randint(*(args.answer_tokens if last else args.call_tokens))
                req = Request(
                    request_id=f"{agent.agent_id}-{agent.tasks}-{agent.step}", agent_id=agent.agent_id,
                    task_type=REACT_TASK_TYPE, priority=dict(CLASSES)[agent.priority_class],
                    prompt_tokens=agent.context_tokens, max_tokens=MAX_TOKENS, arrival=agent.next_at,
                )
                engine.plans[req] = StepPlan(min(length, MAX_TOKENS), "stop" if last else "tool_calls", agent.next_at)
                in_flight[req] = agent
                if agent.resume:
                    sched.resume(req, t)
                else:
                    sched.add_request(req, t)
                    sched.flush(FlushReason.STEP, t)

    def settle(running: list[Request], t: float) -> bool:
        ended = False
        for req in running:
            agent = in_flight.get(req)
            if agent is None:
                continue
            if req.output_tokens and req not in seen_first:
                seen_first.add(req)
                result.ttft[agent.priority_class].append(t - req.arrival)
            if not req.is_finished:
                continue
            ended = True
            del in_flight[req]
            seen_first.discard(req)
            agent.busy = False  # ended (or parked, tool_calls) by the scheduler's stop check
            result.restored_tokens += req.restored_tokens
            result.recomputed_tokens += req.recomputed_tokens
            if agent.step > 1:  # a tool-return step
                kind = "recomputed" if req.recomputed_tokens else "restored" if req.restored_tokens else "warm"
                result.resumes[kind] += 1
            if req.finish_reason == "tool_calls":
                agent.calls_left -= 1
                agent.context_tokens += len(req.output_tokens) + agent.rng.randint(*args.result_tokens)
                agent.next_at = t + agent.rng.uniform(*args.think)
                agent.resume = True
            else:
                if req.finish_reason in ("stop", "length"):
                    result.completion[agent.priority_class].append(t - agent.task_started)
                else:
                    result.failed[agent.priority_class] = result.failed.get(agent.priority_class, 0) + 1
                agent.in_task = False
                _new_task(agent, args, t + agent.rng.uniform(*args.think))
        return ended

    def next_arrival() -> float:
        return min((a.next_at for a in agents if a.has_step_due(args.seconds)), default=float("inf"))

    while t < limit:
        arrive()
        if not sched.has_work:
            pending = [a.next_at for a in agents if a.has_step_due(args.seconds)]
            if not pending:
                break
            t = max(t, min(pending))
            sched.on_idle(t)
            continue
        t, running, owed = await schedule_turn(sched, tiers, t)
        result.swap_seconds += owed
        result.steps += 1
        if result.steps % 20 == 0:
            result.fragmentation.append(sched.fragmentation_ratio())
        if not running:
            t += slice_s
            continue
        t = await run_slice(sched, engine, running, t, slice_s, settle, interrupt=lambda now: now >= next_arrival())
    result.makespan = t
    for agent in agents:  # past the drain limit: a step with the dispatcher or the next one not yet due
        if agent.in_task:
            result.unfinished[agent.priority_class] += 1
    ended = {name: len(result.completion[name]) + result.failed.get(name, 0) + result.unfinished[name]
             for name, _ in CLASSES}
    if ended != result.started:
        raise RuntimeError(f"tasks started {result.started} but completed + failed + unfinished {ended}")
    publish_stats(sched.make_stats())  # what the scheduler counted since the last turn's report
    after = _counters()
    sched.shutdown()
    await tiers.aclose()
    counters = {key: after[key] - before[key] for key in after}
    counters["busy_seconds"] = engine.busy_seconds
    counters["generated_tokens"] = engine.generated
    counters["largest_batch"] = engine.largest_batch
    counters["budget_bytes"] = sched.kv_budget.budget_bytes if sched.kv_budget is not None else 0
    return result, counters


def _new_task(agent: Agent, args: argparse.Namespace, at: float) -> None:
    agent.priority_class = agent.rng.choices([c for c, _ in CLASSES], weights=args.mix)[0]
    agent.context_tokens = agent.rng.randint(*args.prompt_tokens)
    agent.calls_left = agent.rng.randint(*args.tool_calls)
    agent.next_at = at
    agent.task_started = at
    agent.resume = False
    agent.tasks += 1
    agent.step = 0


def summarize(args: argparse.Namespace, config: SwitchyardConfig, result: Outcome, counters: dict[str, Any],
              dram: str) -> dict[str, Any]:
    """The JSON report."""
    params = config.sim
    busy = counters["busy_seconds"]
    batch = max(1, counters["largest_batch"])
    bound = batch / decode_seconds(params, batch)
    resumes = result.resumes
    total_resumes = sum(resumes.values())
    restored, recomputed = result.restored_tokens, result.recomputed_tokens
    frag = result.fragmentation or [0.0]
    return {
        "load": {"agents": args.agents, "seconds": args.seconds, "mix": list(args.mix), "think_s": list(args.think),
                 "prompt_tokens": list(args.prompt_tokens), "tool_calls": list(args.tool_calls),
                 "max_tokens": MAX_TOKENS, "seed": args.seed},
        "hbm": {"device_gb": params.hbm_gb, "budget_bytes": counters["budget_bytes"],
                "capacity_ratio": config.memory.hbm.capacity_ratio},
        "dram": dram,
        "makespan_s": round(result.makespan, 3),
        "swap_seconds": round(result.swap_seconds, 3),
        "engine_busy_ratio": round(busy / result.makespan, 4) if result.makespan else 0.0,
        "roofline_efficiency": round(counters["generated_tokens"] / busy / bound, 4) if busy else 0.0,
        "fragmentation_ratio": {"mean": round(sum(frag) / len(frag), 4), "max": round(max(frag), 4)},
        "oom": int(counters["oom"]),
        "oom_avoided": int(counters["oom_avoided"]),
        "tasks_started": dict(result.started),
        "tasks_completed": {name: len(v) for name, v in result.completion.items()},
        "tasks_failed": {name: result.failed.get(name, 0) for name, _ in CLASSES},
        "tasks_unfinished": dict(result.unfinished),
        "preemptions": int(counters["preemptions"]),
        "tiers": {tier: {family: int(counters[f"{family}_{tier}"])
                         for family in ("evictions", "promotions", "demotions", "hits", "misses")} for tier in TIERS},
        "restored_tokens": int(restored),
        "recomputed_tokens": int(recomputed),
        "restored_token_share": round(restored / (restored + recomputed), 4) if restored + recomputed else None,
        "tool_resumes": {**{k: int(v) for k, v in resumes.items()},
                         "restored_share": round(resumes["restored"] / (resumes["restored"] + resumes["recomputed"]), 4)
                         if resumes["restored"] + resumes["recomputed"] else None,
                         "total": total_resumes},
        "per_class_p95_s": {name: {"ttft": round(percentile(result.ttft[name], 95), 4) if result.ttft[name] else None,
                                   "task_completion": round(percentile(result.completion[name], 95), 3)
                                   if result.completion[name] else None}  # None: the class ran no task
                            for name, _ in CLASSES},
    }


def render(report: dict[str, Any]) -> str:
    """The printed report."""
    load, hbm = report["load"], report["hbm"]
    resumes = report["tool_resumes"]
    share = resumes["restored_share"]
    token_share = report["restored_token_share"]

    def per_class(counts: dict[str, int]) -> str:
        return f"{sum(counts.values())} (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")"

    lines = [
        "switchyard agents benchmark: sim latency model, simulated clock",
        f"{load['agents']} react agents for {load['seconds']:g} s; classes {'/'.join(f'{m:g}' for m in load['mix'])} "
        f"(core/normal/batch %); prompt {load['prompt_tokens'][0]}-{load['prompt_tokens'][1]} tokens, "
        f"{load['tool_calls'][0]}-{load['tool_calls'][1]} tool calls per task, think "
        f"{load['think_s'][0]:g}-{load['think_s'][1]:g} s, max_tokens {load['max_tokens']}",
        f"HBM: {hbm['device_gb']:g} GB device, KV budget {hbm['budget_bytes'] / 1e9:.1f} GB "
        f"(capacity_ratio {hbm['capacity_ratio']:g}); DRAM tier: {report['dram']}",
        "",
        f"  engine busy ratio                 {report['engine_busy_ratio']:.3f} "
        f"(makespan {report['makespan_s']:.1f} s, of which swap transfers {report['swap_seconds']:.1f} s)",
        f"  roofline efficiency               {report['roofline_efficiency']:.3f}",
        f"  KV fragmentation (mean / max)     {report['fragmentation_ratio']['mean']:.3f} / "
        f"{report['fragmentation_ratio']['max']:.3f}",
        f"  OOM (real allocation failures)    {report['oom']}",
        f"  OOM avoided (admission refused)   {report['oom_avoided']}",
        f"  tasks started                     {per_class(report['tasks_started'])}",
        f"    completed                       {per_class(report['tasks_completed'])}",
        f"    failed                          {per_class(report['tasks_failed'])}",
        f"    unfinished at the drain limit   {per_class(report['tasks_unfinished'])}",
        f"  preemptions                       {report['preemptions']}",
        "  tier            evictions  demotions  promotions       hits     misses",
    ]
    for tier, row in report["tiers"].items():
        lines.append(f"    {tier:<12}{row['evictions']:>11}{row['demotions']:>11}{row['promotions']:>12}"
                     f"{row['hits']:>11}{row['misses']:>11}")
    lines += [
        f"  prefix tokens restored / recomputed  {report['restored_tokens']} / {report['recomputed_tokens']}"
        + (f": {100 * token_share:.1f} % of the prefix tokens that left HBM came back restored"
           if token_share is not None else ": no prefix left HBM"),
        f"  tool-return steps: warm in HBM {resumes['warm']}, restored from a tier {resumes['restored']}, "
        f"recomputed {resumes['recomputed']}"
        + (f": {100 * share:.1f} % of those that had left HBM were restored" if share is not None else ""),
        "  per-class P95 (s)       step TTFT   task completion",
    ]
    for name, row in report["per_class_p95_s"].items():
        ttft = "-" if row["ttft"] is None else f"{row['ttft']:.3f}"
        completion = "-" if row["task_completion"] is None else f"{row['task_completion']:.2f}"
        lines.append(f"    {name:<20}{ttft:>12}{completion:>18}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    """A PNG: evictions/demotions/promotions per tier, resume outcomes, per-class P95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tier, ax_resume, ax_p95) = plt.subplots(1, 3, figsize=(13, 4))
    tiers = list(report["tiers"])
    width = 0.27
    for k, family in enumerate(("evictions", "demotions", "promotions")):
        ax_tier.bar([i + (k - 1) * width for i in range(len(tiers))], [report["tiers"][t][family] for t in tiers],
                    width, label=family)
    ax_tier.set_xticks(range(len(tiers)), tiers)
    ax_tier.set_title("KV state moved, per tier")
    ax_tier.legend()
    resumes = report["tool_resumes"]
    ax_resume.bar(["warm (HBM)", "restored (tier)", "recomputed"],
                  [resumes["warm"], resumes["restored"], resumes["recomputed"]],
                  color=["tab:green", "tab:blue", "tab:red"])
    ax_resume.set_title("Tool-return resumes")
    classes = list(report["per_class_p95_s"])
    ax_p95.bar([i - 0.2 for i in range(len(classes))],
               [report["per_class_p95_s"][c]["ttft"] or 0 for c in classes], 0.4, label="step TTFT P95")
    ax_p95.bar([i + 0.2 for i in range(len(classes))],
               [report["per_class_p95_s"][c]["task_completion"] or 0 for c in classes], 0.4,
               label="task completion P95")
    ax_p95.set_xticks(range(len(classes)), classes)
    ax_p95.set_yscale("log")
    ax_p95.set_ylabel("s")
    ax_p95.legend()
    ax_p95.set_title("Per-class P95")
    load = report["load"]
    fig.suptitle(
        f"switchyard bench agents: {load['agents']} agents, {load['seconds']:g} s; busy {report['engine_busy_ratio']:.2f}, "
        f"roofline {report['roofline_efficiency']:.2f}, fragmentation {report['fragmentation_ratio']['mean']:.2f}, "
        f"OOM {report['oom']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _seconds_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    try:
        values = (float(low), float(high or low))
    except ValueError:
        values = (-1.0, -1.0)
    if not 0 <= values[0] <= values[1] < math.inf:  # inf: tool calls that never return, a run that never ends
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH seconds with 0 <= LOW <= HIGH, finite, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard bench agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-dir", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--agents", type=int, default=100, help="agents (default 100)")
    parser.add_argument("--seconds", type=positive, default=30.0, help="load window, simulated seconds (default 30)")
    parser.add_argument("--mix", type=_mix, default=(20.0, 50.0, 30.0),
                        help="core/normal/batch percent of the tasks, summing to 100 (20/50/30)")
    parser.add_argument("--think", type=_seconds_range, default=(0.1, 0.5), help="tool time, seconds (0.1-0.5)")
    parser.add_argument("--prompt-tokens", type=_pair, default=(1000, 3000), help="a task's opening prompt (1000-3000)")
    parser.add_argument("--tool-calls", type=_pair, default=(2, 4), help="tool calls per task (2-4)")
    parser.add_argument("--call-tokens", type=_pair, default=(20, 60), help="tokens of one tool call (20-60)")
    parser.add_argument("--result-tokens", type=_pair, default=(100, 400), help="tokens of one tool result (100-400)")
    parser.add_argument("--answer-tokens", type=_pair, default=(64, 512), help="tokens of a task's answer (64-512)")
    parser.add_argument("--hbm-gb", type=positive, help="device memory of the modelled GPU, GB (default sim.hbm_gb, 80)")
    parser.add_argument("--drain-limit", type=positive,
                        help="stop at this many load windows (default 4; with --policies 10)")
    parser.add_argument("--dram", type=_dram_arg, default="embedded",
                        help="DRAM tier: embedded (a private redis-server, default), HOST:PORT, or off")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", help="write the JSON report here, and a PNG beside it (same name, .png)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    policies = parser.add_argument_group(
        "scheduling policies", "--policies compares scheduling policies on one tenant workload instead "
        "(switchyard_harness.bench.program_policies: every policy on the real scheduler); --agents, --think and --out "
        "do not apply there (refused), nor these options without it")
    policies.add_argument("--policies", help="comma-separated policies, or all: " + ", ".join(POLICY_NAMES))
    policies.add_argument("--tenant-agents", type=int, default=10, help="agents of each of the 9 quiet tenants (10)")
    policies.add_argument("--noisy-agents", type=int, default=100, help="agents of the noisy tenant, long tools (100)")
    policies.add_argument("--load-scale", type=positive,
                          help="multiplies every tenant's agents (default: the load fcfs can hold, found by a sweep "
                          "on the simulated clock: the smallest scale at which fcfs's throughput peaks)")
    policies.add_argument("--double-load", action="store_true",
                          help="also run fcfs and switchyard at twice the load fcfs can hold (the CORE SLO target)")
    policies.add_argument("--stack", action="store_true",
                          help="run each policy on a real dispatcher (gRPC on 127.0.0.1, the sim engine on the real "
                          "clock, callers as the orchestrator: switchyard_harness.bench.program_stack) instead of "
                          "the simulated clock; --seconds is then wall seconds of load")
    policies.add_argument("--stack-engine", choices=STACK_ENGINES, default="sim",
                          help="--stack: the dispatcher's engine: sim (default), or openai in front of a sim-openai "
                          "process the run starts (the upstream's batching and prefix cache, upstream admission)")
    policies.add_argument("--tool-time-scale", type=positive, default=1.0,
                          help="multiplies every tool's drawn duration (default 1: the stated distribution; "
                          "below 1 for a quicker run)")
    rag = parser.add_argument_group(
        "rag_answer early prefill", "--rag-prefill runs rag_answer tasks without and with the early prefill of their "
        "static part instead (switchyard_harness.bench.rag_prefill); --seconds, --seed, --hbm-gb, --config-dir and "
        "--json apply, the other options are refused")
    rag.add_argument("--rag-prefill", action="store_true", help="rag_answer TTFT with and without early prefill")
    rag.add_argument("--rag-rate", type=positive, default=4.0, help="rag_answer tasks per second (4)")
    rag.add_argument("--retrieval-s", type=positive, default=0.2, help="retrieval's median seconds (0.2)")
    return parser


MODES = {"agents": "the agents load (neither --policies nor --rag-prefill)", "policies": "--policies",
         "rag": "--rag-prefill"}
"""The runs one ``bench agents`` makes, and how each is asked for."""
APPLIES: dict[str, tuple[str, ...]] = {
    "agents": ("agents",), "out": ("agents",), "think": ("agents",),
    "mix": ("agents", "policies"), "prompt_tokens": ("agents", "policies"), "tool_calls": ("agents", "policies"),
    "call_tokens": ("agents", "policies"), "result_tokens": ("agents", "policies"),
    "answer_tokens": ("agents", "policies"), "drain_limit": ("agents", "policies"), "dram": ("agents", "policies"),
    "tenant_agents": ("policies",), "noisy_agents": ("policies",), "load_scale": ("policies",),
    "double_load": ("policies",), "stack": ("policies",), "stack_engine": ("policies",),
    "tool_time_scale": ("policies",),
    "rag_rate": ("rag",), "retrieval_s": ("rag",),
}
"""Each option that only some runs read -> those runs (--config-dir, --seconds, --seed, --hbm-gb and --json: all)."""


def _misplaced(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Why ``args`` asks for an option the run it makes does not read (set to other than its default), or two
    runs at once; None when it does not. Such an option did nothing, silently: ``--rag-prefill --stack`` ran the
    simulated clock, ``--stack`` without ``--policies`` the agents load."""
    if args.rag_prefill and args.policies:
        return "--rag-prefill and --policies: expected one of them (each is a run of its own)"
    mode = "rag" if args.rag_prefill else "policies" if args.policies else "agents"
    defaults = vars(parser.parse_args([]))  # as parsed: each default through its option's type
    given = vars(args)
    for dest, modes in APPLIES.items():
        if mode not in modes and given[dest] != defaults[dest]:
            wanted = " or ".join(MODES[m] for m in modes)
            return f"--{dest.replace('_', '-')}: applies to {wanted} only, not to this run ({MODES[mode]})"
    if args.stack_engine != defaults["stack_engine"] and not args.stack:
        return (f"--stack-engine {args.stack_engine}: applies with --stack only (the simulated clock has no engine "
                "to pick)")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (2: bad config or arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _misplaced(parser, args)
    if problem is not None:
        print(f"switchyard bench agents: {problem}", file=sys.stderr)
        return 2
    if args.out and not (args.rag_prefill or args.policies):  # now, not after the run
        outputs.refuse_unwritable(parser, ("--out", args.out), ("--out's PNG", Path(args.out).with_suffix(".png")))
    if args.rag_prefill:
        return _main_rag(args)
    if args.policies:
        args.drain_limit = args.drain_limit or 10.0
        return _main_policies(args)
    args.drain_limit = args.drain_limit or 4.0
    if args.agents < 1:
        print("switchyard bench agents: --agents: expected at least 1", file=sys.stderr)
        return 2
    config = _config(args, **{"queues.inference.capacity": 1_000_000, "queues.inference.timeout_ms": 3_600_000})
    if config is None:
        return 2
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet_score_log())
        tier, dram = _dram_tier(args.dram, config.memory.dram, stack)
        result, counters = asyncio.run(run_agents(args, config, tier))
    report = summarize(args, config, result, counters, dram)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json_output.dumps(report, indent=2) + "\n", encoding="utf-8")
        plot(report, out.with_suffix(".png"))
    if args.json:
        print(json_output.dumps(report, indent=2))
    else:
        print(render(report))
        if args.out:
            print(f"\nwrote {args.out} and {Path(args.out).with_suffix('.png')}")
        print(f"(ran in {time.perf_counter() - started:.1f} s of wall time)")
    return 0


def _config(args: argparse.Namespace, **overrides: Any) -> SwitchyardConfig | None:
    """The config the run uses (``--config-dir``, ``--hbm-gb``, then ``overrides``); None, the problem printed,
    when it is bad or leaves the modelled GPU no room for KV (:func:`_kv_room`)."""
    try:
        config = load_config(args.config_dir) if args.config_dir else SwitchyardConfig()
        if args.hbm_gb:
            overrides = {"sim.hbm_gb": args.hbm_gb, **overrides}
        config = config.with_overrides(**overrides) if overrides else config
    except ConfigError as exc:
        print(f"switchyard bench agents: {exc}", file=sys.stderr)
        return None
    problem = _kv_room(config)
    if problem is not None:
        flag = f"--hbm-gb {args.hbm_gb:g}: " if args.hbm_gb else ""
        print(f"switchyard bench agents: {flag}{problem}", file=sys.stderr)
        return None
    return config


def _kv_room(config: SwitchyardConfig) -> str | None:
    """Why the modelled GPU (``sim``: device memory, weights) leaves no KV budget under ``[hbm]
    capacity_ratio``, in the scheduler's own words (its :class:`KvBudget` check); None when it leaves some."""
    try:
        KvBudget(config.memory.hbm, ModelledKV(config.sim).memory_info())
    except ValueError as exc:
        return str(exc)
    return None


def _main_rag(args: argparse.Namespace) -> int:
    """``--rag-prefill``: rag_answer TTFT without and with the early prefill (simulated clock)."""
    config = _config(args)
    if config is None:
        return 2
    started = time.perf_counter()
    report = run_rag_prefill(RagLoad(rate=args.rag_rate, seconds=args.seconds, retrieval_s=args.retrieval_s,
                                     seed=args.seed), config)
    if args.json:
        print(json_output.dumps(report, indent=2))
    else:
        print(render_rag(report))
        print(f"(ran in {time.perf_counter() - started:.1f} s of wall time)")
    return 0


def _policy_runner(args: argparse.Namespace, config: SwitchyardConfig, tier: DramTierConfig | None,
                   ) -> Callable[[list[str], Workload], list[dict[str, Any]]]:
    """How ``--policies`` runs a workload: on the simulated clock, or (``--stack``) on a real dispatcher."""
    if not args.stack:
        return lambda names, workload: run_policies(names, workload, config, tier)

    def on_stack(names: list[str], workload: Workload) -> list[dict[str, Any]]:
        print(f"switchyard bench agents --stack: {len(names)} policies, {workload.seconds:g} s of load each "
              f"(load scale {workload.load_scale:g})", file=sys.stderr)
        return run_stack_policies(names, workload, config, tier, args.stack_engine,
                                  progress=lambda policy: print(f"  {policy} done", file=sys.stderr))

    return on_stack


def _main_policies(args: argparse.Namespace) -> int:
    """``--policies``: the same tenant workload under each scheduling policy, each on the real scheduler
    (simulated clock)."""
    names = list(POLICY_NAMES) if args.policies == "all" else [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown or not names:
        print(f"switchyard bench agents: --policies: expected all or some of {', '.join(POLICY_NAMES)}, got "
              f"{args.policies!r}", file=sys.stderr)
        return 2
    if args.tenant_agents < 1 or args.noisy_agents < 1:
        print("switchyard bench agents: --tenant-agents and --noisy-agents: expected at least 1", file=sys.stderr)
        return 2
    config = _config(args)
    if config is None:
        return 2
    workload = Workload(tenant_agents=args.tenant_agents, noisy_agents=args.noisy_agents, mix=args.mix,
                        prompt_tokens=args.prompt_tokens, tool_calls=args.tool_calls, call_tokens=args.call_tokens,
                        result_tokens=args.result_tokens, answer_tokens=args.answer_tokens, seconds=args.seconds,
                        drain_limit=args.drain_limit, seed=args.seed, load_scale=args.load_scale or 1.0,
                        tool_time_scale=args.tool_time_scale)
    started = time.perf_counter()
    held = sweep = at_double = None
    with contextlib.ExitStack() as stack:
        tier, _ = _dram_tier(args.dram, config.memory.dram, stack)
        try:
            if args.load_scale is None:  # the load FCFS can hold (its throughput's knee)
                held, sweep = capacity_scale(workload, config, tier)
                workload = workload.scaled(held)
            run = _policy_runner(args, config, tier)
            rows = run(names, workload)
            if args.double_load:
                if held is None:
                    held, sweep = capacity_scale(workload, config, tier)
                at_double = run(["fcfs", "switchyard"], workload.scaled(2 * held))
        except ValueError as exc:
            print(f"switchyard bench agents: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json_output.dumps({"rows": rows, "load_scale": workload.load_scale, "fcfs_capacity_scale": held,
                          "fcfs_sweep": sweep, "at_double": at_double}, indent=2))
    else:
        print(render_policies(rows, workload, config, at_double=at_double, held=held, sweep=sweep,
                              clock=f"{STACK_CLOCK}, {args.stack_engine} engine" if args.stack else SIMULATED_CLOCK))
        print(f"(ran in {time.perf_counter() - started:.1f} s of wall time)")
    return 0


__all__ = ["AgentSimEngine", "main", "run_agents", "summarize"]

if __name__ == "__main__":
    sys.exit(main())
