"""``switchyard bench pool``: the gateway's endpoint picker over three real sim-openai replicas.

Three ``switchyard serve sim-openai`` processes on free ports (latency model on,
``--max-running`` streams each, automatic prefix caching of ``--kv-tokens``),
one :class:`~switchyard.gateway.client.GatewayClient` whose ``model_gateway.pool``
lists them. Agents in groups: each group's agents open with the same system
prompt (a shared prefix), each agent then has its own context and a
conversation that grows by one exchange per turn; every agent runs its turns
one after another, all agents at once.

Phases, taking turns (each with its own agents, so no phase inherits another's
cached conversations): a warm-up not counted (round robin, three turns: fresh
processes, connections, the shared system prompts cached everywhere), then the
picker (``policy: score``), round robin, again each ``--rounds`` times; then the
picker with one replica SIGKILLed half-way.

Printed per policy: calls, affinity hit (calls on their agent's home endpoint),
calls per endpoint max/mean, streams in flight max/mean (sampled every 20 ms),
TTFT P50/P95 (client side: request sent -> first token), prefix-cache hit
(tokens the servers found cached / prompt tokens, from their ``/metrics``).
For the kill phase: calls that failed before their first token (target 0)
and after it (cut mid-stream: not retried, by rule).

Targets (issue): affinity hit >= 90 % at max/mean <= 1.25; TTFT P50 below round
robin's; 0 failed calls that had not streamed a token with one replica killed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from switchyard_harness import json_output
from switchyard.common import outputs
from switchyard.common.config import UpstreamConfig
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Token
from switchyard_harness.sim_openai import SpawnedSimOpenAI, spawn

HIT_TARGET = 0.90
BALANCE_TARGET = 1.25
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass
class PoolParams:
    """The workload of one phase."""

    replicas: int = 3
    agents: int = 12
    groups: int = 3
    """Agent groups; a group's agents share one system prompt."""
    turns: int = 6
    """Turns per agent per phase, one after another."""
    system_words: int = 600
    context_words: int = 1200
    """Words of an agent's own context, after the system prompt."""
    turn_words: int = 100
    """Words a turn adds (the user's message)."""
    max_tokens: int = 8
    max_running: int = 8
    kv_tokens: int = 12_000
    prefill_per_token_ms: float = 0.2
    """The servers' prefill cost per uncached prompt token, milliseconds (sim default 0.025, a 7B model on an
    H100; 0.2 is a larger model's, and keeps the modelled prefill above this machine's own noise)."""
    rounds: int = 2
    seed: int = 0


@dataclass
class PhaseResult:
    """What one phase measured."""

    policy: str
    calls: int = 0
    picks: int = 0
    """Attempts placed (a call that failed over is placed more than once)."""
    home_calls: int = 0
    """Attempts placed on their agent's home endpoint."""
    failed_before_token: int = 0
    failed_after_token: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_endpoint: dict[str, int] = field(default_factory=dict)
    in_flight_ratios: list[float] = field(default_factory=list)
    prefix_queried: float = 0.0
    """Prompt tokens the servers looked up in their prefix caches."""
    prefix_hits: float = 0.0
    """Of those, tokens found cached."""
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.home_calls / self.picks if self.picks else 0.0

    @property
    def prefix_hit(self) -> float:
        return self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0

    @property
    def balance(self) -> float:
        counts = list(self.per_endpoint.values())
        return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else 0.0

    @property
    def in_flight_balance(self) -> float:
        return statistics.fmean(self.in_flight_ratios) if self.in_flight_ratios else 0.0

    def ttft_quantile(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def merge(self, other: "PhaseResult") -> None:
        self.calls += other.calls
        self.picks += other.picks
        self.prefix_queried += other.prefix_queried
        self.prefix_hits += other.prefix_hits
        self.home_calls += other.home_calls
        self.failed_before_token += other.failed_before_token
        self.failed_after_token += other.failed_after_token
        self.ttft_s += other.ttft_s
        for name, n in other.per_endpoint.items():
            self.per_endpoint[name] = self.per_endpoint.get(name, 0) + n
        self.in_flight_ratios += other.in_flight_ratios
        for text, n in other.errors.items():
            self.errors[text] = self.errors.get(text, 0) + n


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens queried, tokens found cached) summed over the servers' /metrics."""
    queries = hits = 0.0
    async with httpx.AsyncClient(timeout=5) as http:
        for url in urls:
            try:
                text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def run_phase(replicas: list[SpawnedSimOpenAI], policy: str, params: PoolParams, tag: str,
                    kill_after_calls: int | None = None) -> PhaseResult:
    """One phase: every agent runs ``params.turns`` turns through a GatewayClient over ``replicas``."""
    urls = [r.base_url for r in replicas]
    config = UpstreamConfig.model_validate({
        "base_url": urls[0], "api_key_env": "SWITCHYARD_BENCH_NO_KEY", "api_key_required": False,
        "default_model": "sim-7b", "fallback_model": "", "retry_backoff_initial_s": 0.05,
        "retry_backoff_max_s": 0.2, "pool": {"endpoints": urls, "policy": policy, "scrape_interval_s": 0.2},
    })
    result = PhaseResult(policy)
    rng = random.Random(f"{params.seed}:{tag}")
    systems = [_text(random.Random(f"{params.seed}:system:{g}"), params.system_words) for g in range(params.groups)]
    before = await _prefix_counters(urls)
    done = asyncio.Event()
    killed = False

    async with GatewayClient(config) as client:
        pool = client.pool
        pick = pool.pick

        def recording_pick(key: str, tried: frozenset[str] = frozenset(), model: str = ""):  # type: ignore[no-untyped-def]
            endpoint, picked = pick(key, tried, model)
            result.per_endpoint[endpoint.name] = result.per_endpoint.get(endpoint.name, 0) + 1
            result.picks += 1
            result.home_calls += picked.reason == "affinity"
            return endpoint, picked

        pool.pick = recording_pick  # type: ignore[method-assign]

        async def sample() -> None:
            while not done.is_set():
                flights = [e.in_flight for e in pool.endpoints.values() if e.up]
                if sum(flights) >= len(flights):
                    result.in_flight_ratios.append(max(flights) / (sum(flights) / len(flights)))
                await asyncio.sleep(0.02)

        async def agent(index: int) -> None:
            nonlocal killed
            name = f"{tag}-agent-{index}"
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": systems[index % params.groups]},
                {"role": "user", "content": _text(rng, params.context_words)},
            ]
            for turn in range(params.turns):
                messages.append({"role": "user", "content": _text(rng, params.turn_words)})
                request = ChatRequest(messages=list(messages), model="sim-7b", max_tokens=params.max_tokens,
                                      request_id=f"{name}:{turn}", affinity_key=name)
                sent = time.monotonic()
                first = None
                reply = []
                try:
                    async for event in client.stream_chat(request):
                        if isinstance(event, Token):
                            if first is None:
                                first = time.monotonic() - sent
                            reply.append(event.text)
                except GatewayError as exc:
                    if first is None:
                        result.failed_before_token += 1
                    else:
                        result.failed_after_token += 1
                    text = f"{exc.code.name}: {str(exc)[:120]}"
                    result.errors[text] = result.errors.get(text, 0) + 1
                else:
                    if first is not None:
                        result.ttft_s.append(first)
                result.calls += 1
                if kill_after_calls is not None and not killed and result.calls >= kill_after_calls:
                    killed = True
                    replicas[0].kill()
                messages.append({"role": "assistant", "content": "".join(reply) or "ok"})

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(agent(i) for i in range(params.agents)))
        done.set()
        await sampler
    live = [r.base_url for r in replicas if r.process.poll() is None]
    if len(live) == len(urls):  # a killed server's counters are gone with it
        after = await _prefix_counters(live)
        result.prefix_queried, result.prefix_hits = after[0] - before[0], after[1] - before[1]
    return result


def report_lines(score: PhaseResult, rr: PhaseResult, kill: PhaseResult | None, params: PoolParams) -> list[str]:
    """The printed table and the targets."""
    lines = [
        f"switchyard bench pool: {params.replicas} sim-openai replicas (max_running {params.max_running}, "
        f"kv_tokens {params.kv_tokens}, prefix caching, prefill {params.prefill_per_token_ms:g} ms/token), {params.agents} agents in {params.groups} groups "
        f"(shared system prompt {params.system_words} words, own context {params.context_words}, "
        f"+{params.turn_words} a turn), {params.turns} turns each, {params.rounds} round(s) per policy",
        "",
        f"{'policy':<24} {'calls':>6} {'affinity hit':>13} {'calls max/mean':>15} {'in-flight max/mean':>19} "
        f"{'TTFT P50 ms':>12} {'P95 ms':>8} {'prefix hit':>11}",
    ]
    for r in (score, rr, *([kill] if kill else [])):
        prefix = f"{r.prefix_hit:.1%}" if r.prefix_queried else "-"
        lines.append(
            f"{r.policy:<24} {r.calls:>6} {r.hit_rate:>13.1%} {r.balance:>15.3f} {r.in_flight_balance:>19.3f} "
            f"{1000 * r.ttft_quantile(0.5):>12.1f} {1000 * r.ttft_quantile(0.95):>8.1f} {prefix:>11}")
    ok_hit = score.hit_rate >= HIT_TARGET and score.balance <= BALANCE_TARGET
    ok_ttft = score.ttft_quantile(0.5) < rr.ttft_quantile(0.5)
    lines += [
        "",
        f"target: affinity hit >= {HIT_TARGET:.0%} at calls max/mean <= {BALANCE_TARGET}: {score.hit_rate:.1%}, "
        f"{score.balance:.3f} -> {'met' if ok_hit else 'MISSED'}",
        f"target: TTFT P50 below round robin's: {1000 * score.ttft_quantile(0.5):.1f} ms vs "
        f"{1000 * rr.ttft_quantile(0.5):.1f} ms ({score.ttft_quantile(0.5) / rr.ttft_quantile(0.5):.2f}x) -> "
        f"{'met' if ok_ttft else 'MISSED'}",
    ]
    if kill is not None:
        lines.append(
            f"target: one replica killed, 0 failed calls that had not streamed a token: {kill.failed_before_token} "
            f"failed before a token, {kill.failed_after_token} cut after tokens (not retried, by rule), of "
            f"{kill.calls} -> {'met' if kill.failed_before_token == 0 else 'MISSED'}")
        for text, n in sorted(kill.errors.items(), key=lambda item: -item[1])[:5]:
            lines.append(f"  {n} x {text}")
    return lines


async def _main(params: PoolParams, kill: bool) -> tuple[PhaseResult, PhaseResult, PhaseResult | None]:
    args = ["--max-running", str(params.max_running), "--kv-tokens", str(params.kv_tokens),
            "--prefill-per-token-ms", str(params.prefill_per_token_ms)]
    replicas = await asyncio.gather(*(asyncio.to_thread(spawn, args) for _ in range(params.replicas)))
    try:
        # warm-up, not counted: fresh processes and connections, and the groups' system prompts cached on
        # every replica, so that neither policy's first phase pays for them
        await run_phase(replicas, "round_robin", dataclasses.replace(params, turns=3), "warm")
        score, rr = PhaseResult("score (picker)"), PhaseResult("round_robin")
        for round_ in range(params.rounds):  # taking turns
            score.merge(await run_phase(replicas, "score", params, f"s{round_}"))
            rr.merge(await run_phase(replicas, "round_robin", params, f"r{round_}"))
        killed = None
        if kill:
            total = params.agents * params.turns
            killed = await run_phase(replicas, "score", params, "kill", kill_after_calls=total // 2)
            killed.policy = "score, 1 replica killed"
        return score, rr, killed
    finally:
        for replica in replicas:
            replica.kill()


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard bench pool``."""
    d = PoolParams()
    parser = argparse.ArgumentParser(prog="switchyard bench pool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=d.agents)
    parser.add_argument("--groups", type=int, default=d.groups)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--rounds", type=int, default=d.rounds, help="phases per policy, taking turns (2)")
    parser.add_argument("--max-running", type=int, default=d.max_running)
    parser.add_argument("--kv-tokens", type=int, default=d.kv_tokens)
    parser.add_argument("--no-kill", action="store_true", help="skip the phase with one replica killed")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", type=Path, default=Path("bench-pool.json"), help="results (bench-pool.json)")
    args = parser.parse_args(argv)
    outputs.refuse_unwritable(parser, ("--json", args.json))  # now, not after the run
    for name in ("agents", "groups", "turns", "rounds", "max_running", "kv_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected at least 1, got {getattr(args, name)}")
    params = PoolParams(agents=args.agents, groups=args.groups, turns=args.turns, rounds=args.rounds,
                        max_running=args.max_running, kv_tokens=args.kv_tokens, seed=args.seed)
    started = time.perf_counter()
    score, rr, killed = asyncio.run(_main(params, not args.no_kill))
    print("\n".join(report_lines(score, rr, killed, params)))
    print(f"\n({time.perf_counter() - started:.1f} s)", file=sys.stderr)

    def summary(r: PhaseResult) -> dict[str, Any]:
        out = {k: v for k, v in asdict(r).items() if k not in ("ttft_s", "in_flight_ratios")}
        out.update(hit_rate=r.hit_rate, calls_max_over_mean=r.balance, in_flight_max_over_mean=r.in_flight_balance,
                   ttft_p50_s=r.ttft_quantile(0.5), ttft_p95_s=r.ttft_quantile(0.95))
        return out

    args.json.write_text(json_output.dumps({
        "params": asdict(params), "score": summary(score), "round_robin": summary(rr),
        "killed": summary(killed) if killed else None,
    }, indent=2) + "\n", encoding="utf-8")
    return 0
