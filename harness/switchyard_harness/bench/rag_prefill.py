"""rag_answer early prefill, with and without: ``switchyard bench agents --rag-prefill``.

A rag_answer task knows its static prompt part (system prompt and question)
before retrieval returns its passages. With early prefill the orchestrator sends
that part as a ``prefill_only`` request while retrieval runs
(``orchestrator.program.rag_early_prefill``); the answer's request (static part +
passages) then finds those blocks in the engine's prefix cache and prefills the
passages only. This bench runs the same rag_answer arrivals twice, without and
with the early request, on the dispatcher's real scheduler (the ``fair``
policy, :func:`~switchyard.dispatcher.scheduler.make_scheduler`) and the sim
latency model on the simulated clock (the step loop of ``bench sched``), with the
sim engine's automatic prefix cache (:class:`~switchyard.dispatcher.engines.sim.SimKV`,
block hashes of the prompt's word pieces) on that clock (:class:`PrefixSimEngine`).

The load: rag_answer tasks arriving as a Poisson process at ``rate`` per second
for ``seconds``; each has a static part of ``static_words`` words and passages
of ``passage_words`` words, both its own (no prefix shared between tasks, so the
only hit is the early prefill's); retrieval takes ``retrieval_s`` median
(lognormal, sigma 0.4); the answer is 64-256 tokens. TTFT is measured from the
answer request's arrival (retrieval done) to its first token, in simulated
seconds.

The issue's target: TTFT P50 with early prefill lower than without by at least
half of min(retrieval P50, the static part's prefill time), the prefill time
being the sim's (``prefill_overhead_ms + tokens x prefill_per_token_ms``) of the
static part's tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engines.base import StepBatch, StepResult
from switchyard.dispatcher.engines.sim import SimKV, prefill_seconds
from switchyard.dispatcher.request import Request, word_pieces
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.tiers import MemoryTiers
from switchyard_harness.bench.report import percentile
from switchyard_harness.bench.sched_bench import VirtualSimEngine, quiet_score_log, run_slice, schedule_turn

RETRIEVAL_SIGMA = 0.4
"""Log-space spread of retrieval's duration (lognormal)."""
ANSWER_TOKENS = (64, 256)
"""Tokens of each answer, uniform."""


class PrefixSimEngine(VirtualSimEngine):
    """:class:`VirtualSimEngine` with the sim engine's prefix cache: a prompt whose prefill completes caches
    its blocks (``SimKV.cache_prompt``), and a fresh prompt takes the blocks cached before it
    (``SimKV.match_prefix``, read when the scheduler composes the step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv = SimKV(self)  # type: ignore[arg-type]
        self.cached: dict[str, int] = {}
        """Prompt tokens each request found in the prefix cache, by request id."""
        match = self.kv.match_prefix

        def match_prefix(req: Request) -> int:
            hit = match(req)
            self.cached[req.request_id] = max(hit, self.cached.get(req.request_id, 0))
            return hit

        self.kv.match_prefix = match_prefix  # type: ignore[method-assign]

    def forget(self, req: Request) -> None:
        """The sim engine's reply plan of ``req`` ends (this engine keeps none)."""

    async def execute_model(self, batch: StepBatch) -> StepResult:
        completes = [req for req, tokens in batch.prefill if req.num_computed_tokens + tokens >= req.prompt_tokens]
        result = await super().execute_model(batch)
        for req in completes:
            self.kv.cache_prompt(req)
        return result


@dataclass(frozen=True)
class RagLoad:
    """The rag_answer load (see the module docstring)."""

    rate: float = 4.0
    seconds: float = 30.0
    static_words: int = 1000
    passage_words: int = 1500
    retrieval_s: float = 0.2
    seed: int = 11


@dataclass
class RagRun:
    """One arm's figures (simulated seconds)."""

    early: bool
    ttft: list[float]
    answer_prefill_tokens: int
    """Prompt tokens the answers' prefills computed (the rest came from the prefix cache)."""
    retrieval: list[float]
    static_tokens: list[int]


def _words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(10 ** 6)}" for _ in range(n))


async def _run(load: RagLoad, config: SwitchyardConfig, early: bool) -> RagRun:
    config = config.with_overrides(**{"queues.inference.capacity": 1_000_000, "queues.inference.timeout_ms": 3_600_000})
    engine = PrefixSimEngine(config.sim)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=False)
    sched = make_scheduler(config, engine, policy="fair", monitor=monitor, tiers=tiers)
    rng = random.Random(load.seed)
    arrivals: list[tuple[float, Request]] = []
    answers: list[Request] = []
    retrieval: list[float] = []
    static_tokens: list[int] = []
    start, n = 0.0, 0
    while True:
        start += rng.expovariate(load.rate)
        if start >= load.seconds:
            break
        static = _words(rng, load.static_words, f"s{n}w")
        full = static + " " + _words(rng, load.passage_words, f"p{n}w")
        took = load.retrieval_s * math.exp(rng.gauss(0, RETRIEVAL_SIGMA))
        retrieval.append(took)
        static_tokens.append(len(word_pieces(static)))
        answer = Request(request_id=f"rag-{n}", task_type="rag_answer", prompt=full,
                         prompt_tokens=len(word_pieces(full)), max_tokens=rng.randint(*ANSWER_TOKENS),
                         arrival=start + took)
        answers.append(answer)
        arrivals.append((answer.arrival, answer))
        if early:  # the orchestrator's prefill_only request, sent when retrieval starts
            arrivals.append((start, Request(request_id=f"rag-{n}:prefill", task_type="rag_answer", prompt=static,
                                            prompt_tokens=static_tokens[-1], max_tokens=1, arrival=start,
                                            prefill_only=True)))
        n += 1
    arrivals.sort(key=lambda item: item[0])
    first: dict[str, float] = {}
    slice_s = config.scheduler.time_slice_ms / 1000

    def settle(running: list[Request], t: float) -> bool:
        ended = False
        for req in running:
            if req.output_tokens and req.request_id not in first:
                first[req.request_id] = t
            ended = ended or req.is_finished
        return ended

    t, i = 0.0, 0
    while t < load.seconds * 10:
        while i < len(arrivals) and arrivals[i][0] <= t:
            req = arrivals[i][1]
            sched.add_request(req, t)
            sched.flush(FlushReason.STEP, t)
            i += 1
        if not sched.has_work:
            if i >= len(arrivals):
                break
            t = arrivals[i][0]
            continue
        t, running, _ = await schedule_turn(sched, tiers, t)
        if not running:
            t += slice_s
            continue
        due = arrivals[i][0] if i < len(arrivals) else math.inf
        t = await run_slice(sched, engine, running, t, slice_s, settle, interrupt=lambda now: now >= due)
    sched.shutdown()
    await tiers.aclose()
    ttft = [first[a.request_id] - a.arrival for a in answers if a.request_id in first]
    if len(ttft) != len(answers):
        raise RuntimeError(f"{len(answers) - len(ttft)} of {len(answers)} answers produced no token")
    cached = sum(engine.cached.get(a.request_id, 0) for a in answers)
    return RagRun(early, ttft, sum(a.prompt_tokens for a in answers) - cached, retrieval, static_tokens)


def run_rag_prefill(load: RagLoad, config: SwitchyardConfig) -> dict[str, Any]:
    """Both arms on the same arrivals; the report (simulated seconds)."""
    with quiet_score_log():
        without = asyncio.run(_run(load, config, early=False))
        with_early = asyncio.run(_run(load, config, early=True))
    static_p50 = percentile([float(n) for n in without.static_tokens], 50)
    static_prefill_s = prefill_seconds(config.sim, int(static_p50))
    retrieval_p50 = percentile(without.retrieval, 50)
    gain = percentile(without.ttft, 50) - percentile(with_early.ttft, 50)
    bound = 0.5 * min(retrieval_p50, static_prefill_s)
    return {
        "load": load.__dict__,
        "tasks": len(without.ttft),
        "ttft_p50_s": {"without": round(percentile(without.ttft, 50), 4), "early": round(percentile(with_early.ttft, 50), 4)},
        "ttft_p95_s": {"without": round(percentile(without.ttft, 95), 4), "early": round(percentile(with_early.ttft, 95), 4)},
        "retrieval_p50_s": round(retrieval_p50, 4),
        "static_tokens_p50": int(static_p50),
        "static_prefill_s": round(static_prefill_s, 4),
        "answer_prefill_tokens": {"without": without.answer_prefill_tokens, "early": with_early.answer_prefill_tokens},
        "ttft_p50_gain_s": round(gain, 4),
        "target_gain_s": round(bound, 4),
        "met": gain >= bound,
    }


def render(report: dict[str, Any]) -> str:
    """The printed report."""
    load, p50, p95 = report["load"], report["ttft_p50_s"], report["ttft_p95_s"]
    return "\n".join([
        "rag_answer early prefill: the real scheduler (fair), sim latency model with its prefix cache, simulated clock",
        f"{report['tasks']} tasks at {load['rate']:g}/s for {load['seconds']:g} s; static part {load['static_words']} "
        f"words ({report['static_tokens_p50']} tokens P50), passages {load['passage_words']} words; retrieval "
        f"~{load['retrieval_s']:g} s (P50 {report['retrieval_p50_s']:.3f} s); seed {load['seed']}",
        f"  answer TTFT P50 / P95 (s)   without {p50['without']:.4f} / {p95['without']:.4f}   "
        f"early prefill {p50['early']:.4f} / {p95['early']:.4f}",
        f"  prompt tokens the answers prefilled: without {report['answer_prefill_tokens']['without']}, "
        f"early prefill {report['answer_prefill_tokens']['early']} (the rest from the prefix cache)",
        f"  P50 gain {report['ttft_p50_gain_s']:.4f} s; target >= half of min(retrieval P50, static part's prefill "
        f"{report['static_prefill_s']:.4f} s) = {report['target_gain_s']:.4f} s: {'met' if report['met'] else 'missed'}",
    ])


__all__ = ["PrefixSimEngine", "RagLoad", "render", "run_rag_prefill"]
