"""``switchyard bench route``: agent routing over many dispatcher replicas, simulated.

A discrete-event simulation at a scale one machine cannot run for real (100
replicas, 10,000 agents by default). Each agent runs sessions of turns (a turn
is one inference request; between turns it waits on a tool or its user; after
a session it is idle for a while, then starts a new one with an empty context).
A turn's cost follows the ``sim`` engine's latency model
(:func:`~switchyard.dispatcher.engines.sim.prefill_seconds`,
:func:`~switchyard.dispatcher.engines.sim.decode_seconds`).

Warm state: after a turn, the agent's KV (its whole context) stays in the HBM
of the replica that served it (an LRU bounded by the sim GPU's KV budget:
``hbm_gb x capacity_ratio`` minus the weights). States evicted from HBM, and
those of a replica that leaves (drained), go to the shared DRAM tier (one LRU
of ``--dram-gb``, Redis in a deployment). A turn on the replica holding the
agent's state reuses its context; elsewhere the context is restored from DRAM
when it is there, otherwise recomputed (prefilled again, which costs time).

Policies, each run on the same agents (per-agent random streams):

- ``affinity``: consistent hashing with bounded loads
  (:class:`~switchyard.common.affinity.BoundedLoadRing`, the class the
  orchestrator routes with), ``--balance`` 1.25;
- ``consistent``: the same ring without the load bound;
- ``random`` and ``round_robin``: per call, as a round_robin channel does.

One replica leaves at ``--leave-at`` of the run and a new one joins at
``--join-at``. Printed per policy: affinity hit rate (turns with a context
that went to the replica holding it), agent load max/mean (agents whose state
a replica holds; sampled every second after the warm-up: mean and worst),
in-flight max/mean, tokens reused / restored / recomputed, and the agents
moved when the replica left (target: at most 1.5/N of them).

A second run (:func:`simulate_skew`) sends open-loop calls from agents of very
unequal activity (one agent ``--hot-share`` of them, the rest Zipf) to a few
replicas and prints the calls-in-flight balance beside the placed-agent
balance, for the ring bounding calls in flight, the ring bounding only agents
placed (one busy agent is one agent however many calls it sends), and round
robin. Target: in-flight max/mean <= 1.25.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from switchyard_harness import json_output
from switchyard.common import outputs
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.sim import decode_seconds, prefill_seconds
from switchyard.common.affinity import DEFAULT_BALANCE, DEFAULT_VNODES, BoundedLoadRing

POLICIES = ("affinity", "consistent", "random", "round_robin")
HIT_TARGET = 0.90
BALANCE_TARGET = 1.25
MOVE_TARGET = 1.5  # x 1/N


@dataclass
class RouteParams:
    """The simulated fleet and workload (times in simulated seconds)."""

    replicas: int = 100
    agents: int = 10_000
    duration_s: float = 300.0
    warmup_s: float = 60.0
    think_s: float = 4.0
    """Mean wait between the turns of a session (a tool call, the user), exponential."""
    idle_s: float = 30.0
    """Mean wait between sessions, exponential."""
    turns: float = 6.0
    """Mean turns per session (geometric)."""
    new_tokens: tuple[int, int] = (200, 600)
    """Prompt tokens a turn adds (uniform): tool results, the user's message."""
    output_tokens: tuple[int, int] = (50, 200)
    balance: float = DEFAULT_BALANCE
    vnodes: int = DEFAULT_VNODES
    routers: int = 1
    """Orchestrators routing independently, each with its own view of the loads; a turn reaches one at random."""
    dram_gb: float = 1024.0
    leave_at: float = 1 / 3
    join_at: float = 2 / 3
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the first field out of range."""
        if self.replicas < 2:
            raise ValueError(f"replicas: expected at least 2, got {self.replicas}")
        if self.agents < 1:
            raise ValueError(f"agents: expected at least 1, got {self.agents}")
        if not 0 < self.duration_s < math.inf:  # inf simulated forever; nan read as no time at all
            raise ValueError(f"duration: expected a finite number of seconds > 0, got {self.duration_s}")
        if not 1 < self.balance < math.inf:  # nan and inf were ValueError and OverflowError tracebacks
            raise ValueError(f"balance: expected a finite number > 1, got {self.balance}")
        if self.vnodes < 1:  # BoundedLoadRing's ValueError, raised past the parser: a traceback
            raise ValueError(f"vnodes: expected at least 1, got {self.vnodes}")
        if not 0 < self.dram_gb < math.inf:
            raise ValueError(f"dram_gb: expected a finite number of GB > 0, got {self.dram_gb}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s: expected 0 <= warmup < duration ({self.duration_s}), got {self.warmup_s}")
        if self.routers < 1:
            raise ValueError(f"routers: expected at least 1, got {self.routers}")
        if not 0 < self.leave_at < self.join_at < 1:
            raise ValueError(f"leave_at, join_at: expected 0 < leave < join < 1, got {self.leave_at}, {self.join_at}")


# ---------------------------------------------------------------------------- policies


class _Ring:
    def __init__(self, replicas: list[str], params: RouteParams, bounded: bool, rng: random.Random) -> None:
        balance = params.balance if bounded else 1e9  # no bound: plain consistent hashing
        self.rings = [BoundedLoadRing(replicas, params.vnodes, balance) for _ in range(params.routers)]
        self.rng = rng

    def route(self, agent: str, now: float, in_flight: dict[str, int] | None = None) -> str:
        ring = self.rings[self.rng.randrange(len(self.rings))] if len(self.rings) > 1 else self.rings[0]
        if in_flight is None:
            return ring.assign(agent, now)  # placed keys bounded, calls in flight not
        return ring.route(agent, in_flight, now)[0]

    def release(self, agent: str) -> None:
        for ring in self.rings:
            ring.release(agent)

    def remove(self, replica: str) -> set[str]:
        return {agent for ring in self.rings for agent in ring.remove(replica)}

    def add(self, replica: str) -> None:
        for ring in self.rings:
            ring.add(replica)


class _PerCall:
    def __init__(self, replicas: list[str], kind: str, rng: random.Random) -> None:
        self.replicas, self.kind, self.rng, self.next = list(replicas), kind, rng, 0

    def route(self, agent: str, now: float, in_flight: dict[str, int] | None = None) -> str:
        if self.kind == "random":
            return self.rng.choice(self.replicas)
        self.next = (self.next + 1) % len(self.replicas)
        return self.replicas[self.next]

    def release(self, agent: str) -> None:
        pass

    def remove(self, replica: str) -> set[str]:
        self.replicas.remove(replica)
        return set()

    def add(self, replica: str) -> None:
        self.replicas.append(replica)


def make_policy(name: str, replicas: list[str], params: RouteParams, rng: random.Random):
    """The router called ``name`` (one of :data:`POLICIES`)."""
    if name in ("affinity", "consistent"):
        return _Ring(replicas, params, bounded=name == "affinity", rng=rng)
    if name in ("random", "round_robin"):
        return _PerCall(replicas, name, rng)
    raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {name!r}")


# ---------------------------------------------------------------------------- simulation


class _Lru:
    """Agent -> context tokens, least recently used first, bounded in tokens."""

    def __init__(self, capacity_tokens: float) -> None:
        self.capacity, self.used, self.items = capacity_tokens, 0, OrderedDict()

    def pop(self, agent: int) -> int:
        tokens = self.items.pop(agent, 0)
        self.used -= tokens
        return tokens

    def put(self, agent: int, tokens: int) -> list[tuple[int, int]]:
        """Store; returns what was evicted to make room (agent, tokens)."""
        self.pop(agent)
        evicted = []
        while self.items and self.used + tokens > self.capacity:
            victim, victim_tokens = self.items.popitem(last=False)
            self.used -= victim_tokens
            evicted.append((victim, victim_tokens))
        if tokens <= self.capacity:
            self.items[agent] = tokens
            self.used += tokens
        return evicted


@dataclass
class PolicyResult:
    """What one policy did over the run."""

    policy: str
    turns: int = 0
    continuing_turns: int = 0
    affinity_hits: int = 0
    reused_tokens: int = 0
    restored_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_seconds: float = 0.0
    load_ratio_mean: float = 0.0
    load_ratio_max: float = 0.0
    inflight_ratio_mean: float = 0.0
    moved_on_leave: int = 0
    placed_at_leave: int = 0
    preferred_moved_on_leave: float = 0.0
    load_series: list[tuple[float, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.affinity_hits / self.continuing_turns if self.continuing_turns else 0.0

    @property
    def moved_fraction(self) -> float:
        return self.moved_on_leave / self.placed_at_leave if self.placed_at_leave else 0.0

    def summary(self, replicas: int) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "load_series"}
        out.update(hit_rate=self.hit_rate, moved_fraction=self.moved_fraction,
                   moved_times_n=self.moved_fraction * replicas)
        return out


def simulate(policy_name: str, params: RouteParams, config: SwitchyardConfig | None = None) -> PolicyResult:
    """Run one policy over the whole workload; deterministic for a given ``params.seed``."""
    params.check()
    config = config or SwitchyardConfig()
    sim = config.sim
    hbm_budget = sim.hbm_gb * 1e9 * config.memory.hbm.capacity_ratio - sim.params_billion * 1e9 * sim.bytes_per_param
    hbm_tokens = max(0.0, hbm_budget / sim.kv_bytes_per_token)
    replicas = [f"dispatcher-{i}" for i in range(params.replicas)]
    policy = make_policy(policy_name, replicas, params, random.Random(params.seed + 1))
    hbm = {r: _Lru(hbm_tokens) for r in replicas}
    dram = _Lru(params.dram_gb * 1e9 / sim.kv_bytes_per_token)
    inflight = {r: 0 for r in replicas}
    holds = {r: 0 for r in replicas}  # active agents whose state a replica holds
    live = set(replicas)
    rngs = [random.Random(params.seed * 1_000_003 + a) for a in range(params.agents)]
    names = [f"agent-{a}" for a in range(params.agents)]
    context = [0] * params.agents
    turns_left = [0] * params.agents
    home: list[str | None] = [None] * params.agents
    result = PolicyResult(policy_name)

    START, END, SAMPLE, LEAVE, JOIN = range(5)
    events: list[tuple[float, int, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, agent: int = -1, data: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, agent, data))

    for a in range(params.agents):  # staggered first sessions
        push(rngs[a].uniform(0, params.idle_s), START, a)
    t_sample = params.warmup_s
    while t_sample < params.duration_s:
        push(t_sample, SAMPLE)
        t_sample += 1.0
    push(params.duration_s * params.leave_at, LEAVE)
    push(params.duration_s * params.join_at, JOIN)
    samples: list[float] = []
    inflight_samples: list[float] = []
    counting = False

    def set_home(a: int, replica: str | None) -> None:
        if home[a] is not None and home[a] in holds:
            holds[home[a]] -= 1
        home[a] = replica
        if replica is not None:
            holds[replica] += 1

    while events:
        now, _, kind, a, data = heapq.heappop(events)
        if now >= params.duration_s and kind != END:
            continue
        if kind == START:
            rng = rngs[a]
            if turns_left[a] == 0:  # a new session
                turns_left[a] = max(1, math.ceil(math.log(1 - rng.random()) / math.log(1 - 1 / params.turns)))
            replica = policy.route(names[a], now, inflight)
            counting = now >= params.warmup_s
            recompute = 0
            if context[a] and counting:
                result.continuing_turns += 1
                result.affinity_hits += replica == home[a]
            if context[a]:
                if home[a] == replica and a in hbm[replica].items:
                    hbm[replica].items.move_to_end(a)
                    reused = context[a]
                    if counting:
                        result.reused_tokens += reused
                elif a in dram.items:
                    if counting:
                        result.restored_tokens += context[a]
                else:
                    recompute = context[a]
                    if counting:
                        result.recomputed_tokens += recompute
                        result.recompute_seconds += prefill_seconds(sim, recompute) - prefill_seconds(sim, 0)
            new, out = rng.randint(*params.new_tokens), rng.randint(*params.output_tokens)
            inflight[replica] += 1
            seconds = prefill_seconds(sim, new + recompute) + out * decode_seconds(sim, inflight[replica])
            if counting:
                result.turns += 1
            push(now + seconds, END, a, (replica, new + out))
        elif kind == END:
            replica, added = data
            inflight[replica] -= 1
            rng = rngs[a]
            context[a] += added
            if home[a] is not None and home[a] != replica and home[a] in hbm:
                hbm[home[a]].pop(a)  # the stale copy on its former replica is freed
            turns_left[a] -= 1
            if turns_left[a] == 0:  # session over: its state is released everywhere
                if home[a] in hbm:
                    hbm[home[a]].pop(a)
                if replica in hbm:
                    hbm[replica].pop(a)
                dram.pop(a)
                set_home(a, None)
                context[a] = 0
                policy.release(names[a])
                push(now + rng.expovariate(1 / params.idle_s), START, a)
                continue
            if replica in live:
                dram.pop(a)
                for victim, tokens in hbm[replica].put(a, context[a]):
                    dram.put(victim, tokens)  # demoted, not lost
                set_home(a, replica)
            else:  # its replica left while it ran: drained to DRAM
                dram.put(a, context[a])
                set_home(a, None)
            push(now + rng.expovariate(1 / params.think_s), START, a)
        elif kind == SAMPLE:
            n = len(live)
            total = sum(holds[r] for r in live)
            if total:
                ratio = max(holds[r] for r in live) / (total / n)
                samples.append(ratio)
                result.load_series.append((now, ratio))
            running = sum(inflight[r] for r in live)
            if running:
                inflight_samples.append(max(inflight[r] for r in live) / (running / n))
        elif kind == LEAVE:
            leaving = sorted(live)[0]
            before = None
            if isinstance(policy, _Ring):
                ring = policy.rings[0]
                before = {agent: ring.preferred(agent) for agent in names}
            if isinstance(policy, _Ring):  # agents placed on the ring(s): active, in a turn or between turns
                result.placed_at_leave = len({agent for ring in policy.rings for agent in ring.placed})
            else:
                result.placed_at_leave = sum(1 for a2 in range(params.agents) if home[a2] is not None)
            moved = policy.remove(leaving)
            result.moved_on_leave = len(moved) if isinstance(policy, _Ring) else holds[leaving]
            live.discard(leaving)
            for agent, tokens in list(hbm[leaving].items.items()):
                dram.put(agent, tokens)  # a drained replica hands its agents' state to the DRAM tier
            hbm.pop(leaving)
            for a2 in range(params.agents):
                if home[a2] == leaving:
                    set_home(a2, None)
            holds.pop(leaving)
            if before is not None:
                after = policy.rings[0]
                result.preferred_moved_on_leave = sum(
                    after.preferred(agent) != where for agent, where in before.items()) / len(before)
        elif kind == JOIN:
            joining = f"dispatcher-{params.replicas}"
            live.add(joining)
            hbm[joining] = _Lru(hbm_tokens)
            inflight[joining] = 0
            holds[joining] = 0
            policy.add(joining)
    if samples:
        result.load_ratio_mean = sum(samples) / len(samples)
        result.load_ratio_max = max(samples)
    if inflight_samples:
        result.inflight_ratio_mean = sum(inflight_samples) / len(inflight_samples)
    return result


# ---------------------------------------------------------------------------- skewed traffic

SKEW_POLICIES = ("in_flight_bound", "placed_bound", "round_robin")
"""``in_flight_bound``: the ring's :meth:`~BoundedLoadRing.route` (calls in flight bounded, overflow spills);
``placed_bound``: :meth:`~BoundedLoadRing.assign` only (agents placed bounded, what the router did before);
``round_robin``: per call."""


@dataclass
class SkewParams:
    """Open-loop calls from agents of very unequal activity (times in simulated seconds)."""

    replicas: int = 3
    agents: int = 30
    rate: float = 30.0
    """Calls per second, all agents together (Poisson arrivals)."""
    hot_share: float = 0.6
    """Fraction of the calls sent by the busiest agent; the rest follow Zipf over the other agents."""
    zipf_s: float = 1.1
    """Zipf exponent of the other agents' shares (rank k gets 1/k^s)."""
    prompt_tokens: tuple[int, int] = (200, 600)
    output_tokens: tuple[int, int] = (100, 300)
    duration_s: float = 300.0
    warmup_s: float = 30.0
    balance: float = BALANCE_TARGET
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the first field out of range."""
        if self.replicas < 2:
            raise ValueError(f"replicas: expected at least 2, got {self.replicas}")
        if self.agents < 2:
            raise ValueError(f"agents: expected at least 2, got {self.agents}")
        if not 0 <= self.hot_share < 1:
            raise ValueError(f"hot_share: expected a fraction in [0, 1), got {self.hot_share}")
        if not 0 < self.rate < math.inf:  # nan simulated no call; inf none at all past the first
            raise ValueError(f"rate: expected a finite number of calls/s > 0, got {self.rate}")
        if not 0 <= self.zipf_s < math.inf:  # nan was "ValueError: Total of weights must be finite", a traceback
            raise ValueError(f"zipf_s: expected a finite exponent >= 0, got {self.zipf_s}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s: expected 0 <= warmup < duration ({self.duration_s}), got {self.warmup_s}")


@dataclass
class SkewResult:
    """What one policy did with the skewed calls."""

    policy: str
    calls: int = 0
    home_calls: int = 0
    """Calls served by their agent's home replica (affinity hits)."""
    in_flight_ratio_mean: float = 0.0
    """Max/mean calls in flight over the replicas, averaged over time (sampled at every arrival)."""
    in_flight_ratio_p99: float = 0.0
    placed_ratio_mean: float = 0.0
    """Max/mean agents placed per replica (ring policies; round robin places none)."""
    hot_share_on_one: float = 0.0
    """Fraction of all calls served by the replica that served the most."""

    @property
    def hit_rate(self) -> float:
        return self.home_calls / self.calls if self.calls else 0.0


def simulate_skew(policy_name: str, params: SkewParams, config: SwitchyardConfig | None = None) -> SkewResult:
    """One policy over Poisson calls, ``hot_share`` of them from one agent; deterministic for ``params.seed``.

    A call lasts the ``sim`` latency model's prefill plus its output tokens' decode steps at the replica's
    in-flight batch size when it starts. Raises ValueError for a parameter out of range or an unknown policy.
    """
    params.check()
    if policy_name not in SKEW_POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(SKEW_POLICIES)}, got {policy_name!r}")
    sim = (config or SwitchyardConfig()).sim
    rng = random.Random(params.seed)
    replicas = [f"dispatcher-{i}" for i in range(params.replicas)]
    ring = BoundedLoadRing(replicas, DEFAULT_VNODES, params.balance)
    names = [f"agent-{a}" for a in range(params.agents)]
    weights = [params.hot_share] + [
        (1 - params.hot_share) * w for w in _zipf(params.agents - 1, params.zipf_s)]
    in_flight = {r: 0 for r in replicas}
    served = {r: 0 for r in replicas}
    ends: list[tuple[float, str]] = []
    result = SkewResult(policy_name)
    ratios: list[float] = []
    placed: list[float] = []
    turn = -1
    now = 0.0
    while now < params.duration_s:
        now += rng.expovariate(params.rate)
        while ends and ends[0][0] <= now:
            in_flight[heapq.heappop(ends)[1]] -= 1
        agent = names[rng.choices(range(params.agents), weights)[0]]
        if policy_name == "in_flight_bound":
            replica, home = ring.route(agent, in_flight, now)
        elif policy_name == "placed_bound":
            replica, home = ring.assign(agent, now), True
        else:
            turn = (turn + 1) % len(replicas)
            replica, home = replicas[turn], False
        in_flight[replica] += 1
        seconds = (prefill_seconds(sim, rng.randint(*params.prompt_tokens))
                   + rng.randint(*params.output_tokens) * decode_seconds(sim, in_flight[replica]))
        heapq.heappush(ends, (now + seconds, replica))
        if now < params.warmup_s:
            continue
        result.calls += 1
        result.home_calls += home
        served[replica] += 1
        running = sum(in_flight.values())
        ratios.append(max(in_flight.values()) / (running / len(replicas)))
        if ring.placed:
            placed.append(max(ring.loads.values()) / (len(ring.placed) / len(replicas)))
    ratios.sort()
    if ratios:
        result.in_flight_ratio_mean = sum(ratios) / len(ratios)
        result.in_flight_ratio_p99 = ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))]
    if placed:
        result.placed_ratio_mean = sum(placed) / len(placed)
    if result.calls:
        result.hot_share_on_one = max(served.values()) / result.calls
    return result


def _zipf(n: int, s: float) -> list[float]:
    raw = [1 / (k ** s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def skew_lines(results: list[SkewResult], params: SkewParams) -> list[str]:
    """The printed table of the skewed run and its target."""
    lines = [
        f"skewed traffic: {params.replicas} replicas, {params.agents} agents, {params.rate:g} calls/s, one agent "
        f"sends {params.hot_share:.0%} of the calls, the rest Zipf s={params.zipf_s:g}; balance {params.balance:g}",
        "",
        f"{'policy':<16} {'in-flight max/mean':>19} {'p99':>6} {'placed max/mean':>16} {'calls on busiest':>17} "
        f"{'at home':>8}",
    ]
    for r in results:
        placed = f"{r.placed_ratio_mean:.3f}" if r.policy != "round_robin" else "-"
        lines.append(f"{r.policy:<16} {r.in_flight_ratio_mean:>19.3f} {r.in_flight_ratio_p99:>6.2f} {placed:>16} "
                     f"{r.hot_share_on_one:>17.1%} {r.hit_rate:>8.1%}")
    by = {r.policy: r for r in results}
    if "in_flight_bound" in by:
        r = by["in_flight_bound"]
        ok = r.in_flight_ratio_mean <= BALANCE_TARGET
        lines += ["", f"target (in_flight_bound): in-flight max/mean <= {BALANCE_TARGET}: "
                      f"{r.in_flight_ratio_mean:.3f} -> {'met' if ok else 'MISSED'}"]
    return lines


# ---------------------------------------------------------------------------- report


def report_lines(results: list[PolicyResult], params: RouteParams) -> list[str]:
    """The printed table and the targets."""
    n = params.replicas
    lines = [
        f"switchyard bench route: {n} replicas, {params.agents} agents, {params.duration_s:g} s simulated "
        f"(warm-up {params.warmup_s:g} s), {params.routers} router(s), balance {params.balance:g}, "
        f"one replica leaves at {params.duration_s * params.leave_at:g} s, one joins at "
        f"{params.duration_s * params.join_at:g} s",
        "",
        f"{'policy':<12} {'hit':>7} {'load max/mean':>14} {'worst':>6} {'in-flight':>10} "
        f"{'reused':>12} {'restored':>12} {'recomputed':>12} {'recompute s':>12} {'moved':>8}",
    ]
    for r in results:
        moved = f"{r.moved_fraction * n:.2f}/N" if r.policy in ("affinity", "consistent") else "-"
        lines.append(
            f"{r.policy:<12} {r.hit_rate:>7.1%} {r.load_ratio_mean:>14.3f} {r.load_ratio_max:>6.3f} "
            f"{r.inflight_ratio_mean:>10.2f} {r.reused_tokens:>12,} {r.restored_tokens:>12,} "
            f"{r.recomputed_tokens:>12,} {r.recompute_seconds:>12.1f} {moved:>8}")
    by = {r.policy: r for r in results}
    if "affinity" in by:
        r = by["affinity"]
        lines += [
            "",
            f"targets (affinity): hit >= {HIT_TARGET:.0%} with max/mean <= {BALANCE_TARGET}: "
            f"{r.hit_rate:.1%}, {r.load_ratio_mean:.3f} (worst sample {r.load_ratio_max:.3f}) -> "
            f"{'met' if r.hit_rate >= HIT_TARGET and r.load_ratio_mean <= BALANCE_TARGET else 'MISSED'}",
            f"  one replica leaving moves <= {MOVE_TARGET}/N of the agents: {r.moved_on_leave} of "
            f"{r.placed_at_leave} placed = {r.moved_fraction * n:.2f}/N (preferred replica changed for "
            f"{r.preferred_moved_on_leave * n:.2f}/N of all agents) -> "
            f"{'met' if r.moved_fraction * n <= MOVE_TARGET else 'MISSED'}",
        ]
    return lines


def plot(results: list[PolicyResult], params: RouteParams, path: Path) -> Path:
    """Three panels: hit rate per policy; agent load max/mean over time; tokens reused/restored/recomputed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    names = [r.policy for r in results]
    axes[0].bar(names, [100 * r.hit_rate for r in results], color="tab:blue")
    axes[0].axhline(100 * HIT_TARGET, color="red", linestyle="--", label=f"target {HIT_TARGET:.0%}")
    axes[0].set_ylabel("affinity hit rate (%)")
    axes[0].set_title("turns sent to the replica holding the agent's state")
    axes[0].legend()
    for r in results:
        if r.load_series:
            t, ratio = zip(*r.load_series)
            axes[1].plot(t, ratio, label=r.policy, linewidth=1)
    axes[1].axhline(BALANCE_TARGET, color="red", linestyle="--", label=f"target {BALANCE_TARGET}")
    for frac, what in ((params.leave_at, "leave"), (params.join_at, "join")):
        axes[1].axvline(params.duration_s * frac, color="grey", linestyle=":")
        axes[1].text(params.duration_s * frac, axes[1].get_ylim()[0], f" {what}", ha="left", va="bottom", fontsize=8)
    axes[1].set_xlabel("simulated time (s)")
    axes[1].set_ylabel("agent load max / mean")
    axes[1].set_title("agents whose state a replica holds")
    axes[1].legend(fontsize=8)
    gtok = [[r.reused_tokens / 1e9, r.restored_tokens / 1e9, r.recomputed_tokens / 1e9] for r in results]
    bottom = [0.0] * len(results)
    for i, (label, color) in enumerate((("reused (HBM)", "tab:green"), ("restored (DRAM)", "tab:orange"),
                                        ("recomputed", "tab:red"))):
        values = [g[i] for g in gtok]
        axes[2].bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].set_ylabel("context tokens (billions)")
    axes[2].set_title("where each turn's context came from")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"switchyard bench route: {params.replicas} replicas, {params.agents} agents, "
                 f"{params.routers} router(s), balance {params.balance:g}, sim engine cost model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard bench route``."""
    d = RouteParams()
    parser = argparse.ArgumentParser(prog="switchyard bench route", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=d.replicas)
    parser.add_argument("--agents", type=int, default=d.agents)
    parser.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds (default 300)")
    parser.add_argument("--warmup", type=float, default=d.warmup_s, help="simulated seconds not counted (default 60)")
    parser.add_argument("--balance", type=float, default=d.balance, help=f"load bound of the affinity ring ({d.balance:g})")
    parser.add_argument("--vnodes", type=int, default=d.vnodes, help="ring points per replica (100)")
    parser.add_argument("--routers", type=int, default=d.routers,
                        help="orchestrators routing independently, each seeing only its own loads (1)")
    parser.add_argument("--dram-gb", type=float, default=d.dram_gb, help="shared DRAM tier size (1024 GB)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--seed", type=int, default=d.seed)
    k = SkewParams()
    parser.add_argument("--skew-replicas", type=int, default=k.replicas,
                        help=f"replicas of the skewed-traffic run ({k.replicas}); 0 skips it")
    parser.add_argument("--skew-rate", type=float, default=k.rate, help=f"its calls/s ({k.rate:g})")
    parser.add_argument("--hot-share", type=float, default=k.hot_share,
                        help=f"share of its calls sent by one agent ({k.hot_share:g})")
    parser.add_argument("--zipf", type=float, default=k.zipf_s, help=f"Zipf exponent of the others ({k.zipf_s:g})")
    parser.add_argument("--json", type=Path, default=Path("bench-route.json"), help="results (bench-route.json)")
    parser.add_argument("--plot", type=Path, default=Path("bench-route.png"), help="figure (bench-route.png)")
    args = parser.parse_args(argv)
    outputs.refuse_unwritable(parser, ("--json", args.json), ("--plot", args.plot))  # now, not after the run
    params = RouteParams(replicas=args.replicas, agents=args.agents, duration_s=args.duration, warmup_s=args.warmup,
                         balance=args.balance, vnodes=args.vnodes, routers=args.routers, dram_gb=args.dram_gb,
                         seed=args.seed)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        params.check()
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise ValueError(f"policies: expected some of {', '.join(POLICIES)}, got {args.policies!r}")
        skew = SkewParams(replicas=args.skew_replicas or 2, rate=args.skew_rate, hot_share=args.hot_share,
                          zipf_s=args.zipf, seed=args.seed)
        skew.check()
    except ValueError as exc:
        parser.error(str(exc))
    results = []
    for name in policies:
        started = time.perf_counter()
        results.append(simulate(name, params))
        print(f"  {name}: simulated in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    print("\n".join(report_lines(results, params)))
    skewed = [simulate_skew(name, skew) for name in SKEW_POLICIES] if args.skew_replicas else []
    if skewed:
        print()
        print("\n".join(skew_lines(skewed, skew)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json_output.dumps({
        "params": asdict(params),
        "targets": {"hit_rate": HIT_TARGET, "load_max_over_mean": BALANCE_TARGET, "moved_times_n": MOVE_TARGET},
        "results": {r.policy: r.summary(params.replicas) for r in results},
        "skewed": {"params": asdict(skew), "results": {r.policy: {**asdict(r), "hit_rate": r.hit_rate}
                                                        for r in skewed}} if skewed else None,
    }, indent=2) + "\n", encoding="utf-8")
    plot(results, params, args.plot)
    print(f"\nresults written to {args.json}, figure to {args.plot}")
    return 0
