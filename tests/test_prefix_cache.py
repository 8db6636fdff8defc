"""Automatic prefix caching: block keys chain, LRU eviction, the sim engine's reuse, the KV budget's view."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard_harness.testing.scheduling import accept
from switchyard.dispatcher.engines.prefix_cache import PrefixCache
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.capacity import KV_MEMORY
from switchyard.dispatcher.request import Request

pytestmark = pytest.mark.no_gpu

SYSTEM = " ".join(f"rule{i}" for i in range(64))  # a shared 64-token opening


def test_a_block_is_reused_only_after_the_very_same_prefix() -> None:
    cache = PrefixCache(block_tokens=4, block_bytes=100)
    a = cache.keys("a b c d e f g h i".split())
    assert len(a) == 2  # full blocks only: the ninth token is not cached
    cache.insert(a)
    assert cache.match(cache.keys("a b c d e f g h x y".split())) == 2
    assert cache.match(cache.keys("z b c d e f g h".split())) == 0  # same second block, other parent
    assert cache.match(cache.keys("a b c d z z z z".split())) == 1
    assert cache.nbytes == 200


def test_eviction_drops_least_recently_used_blocks_first() -> None:
    cache = PrefixCache(block_tokens=2, block_bytes=10)
    old, new = cache.keys("o1 o2".split()), cache.keys("n1 n2".split())
    cache.insert(old)
    cache.insert(new)
    cache.match(old)  # used again: now the most recent
    assert cache.evict(5) == 10
    assert cache.match(old) == 1 and cache.match(new) == 0


def _req(name: str, question: str) -> Request:
    prompt = f"{SYSTEM} <question>{question}</question>"
    return Request(name, prompt=prompt, prompt_tokens=70, max_tokens=4)


async def test_sim_engine_skips_the_cached_opening_of_a_repeated_prompt() -> None:
    engine = SimEngine(SwitchyardConfig())
    hits = REGISTRY.get_sample_value("switchyard_prefix_cache_blocks_total", {"result": "hit"}) or 0.0
    first = _req("a", "what is a list?")
    await EngineDriver(engine).prefill([first])
    cold = engine.busy_seconds
    second = _req("b", "what is a dict?")
    await EngineDriver(engine).prefill([second])
    warm = engine.busy_seconds - cold
    assert warm < cold  # the 64 shared tokens were not computed again
    assert (REGISTRY.get_sample_value("switchyard_prefix_cache_blocks_total", {"result": "hit"}) or 0) - hits == 4
    assert engine.kv.prefix_cache_bytes() > 0
    off = SimEngine(SwitchyardConfig().with_overrides(**{"sim.prefix_caching": False}))
    await EngineDriver(off).prefill([_req("c", "what is a list?")])
    await EngineDriver(off).prefill([_req("d", "what is a dict?")])
    assert off.kv.prefix_cache_bytes() == 0 and off.busy_seconds == pytest.approx(2 * cold)


async def test_cached_blocks_count_against_the_hbm_budget_and_make_room_for_running_work() -> None:
    # A GPU whose budget holds 400 tokens of KV beside the weights.
    sim = SwitchyardConfig().sim
    weights = sim.params_billion * 1e9 * sim.bytes_per_param
    hbm_gb = (weights + 400 * sim.kv_bytes_per_token + 1) / 0.85 / 1e9
    config = SwitchyardConfig().with_overrides(**{"sim.hbm_gb": hbm_gb, "scheduler.expected_score_initial": 0})
    engine = SimEngine(config)
    sched = make_scheduler(config, engine)
    warmup = Request("w", prompt=" ".join(f"t{i}" for i in range(320)), prompt_tokens=320, max_tokens=4)
    await EngineDriver(engine).prefill([warmup])  # 20 blocks of 16 tokens now cached: 320 tokens of the 400
    assert engine.kv.prefix_cache_bytes() == 320 * sim.kv_bytes_per_token
    big = Request("big", prompt="something else entirely", prompt_tokens=200, max_tokens=100)
    assert sched.capacity.refusal(big) == KV_MEMORY  # 300 tokens do not fit beside the cache
    accept(sched, [big], now=0.0)
    out = sched.schedule(now=0.0)
    assert out.admitted == [big]  # the cache gave back what the running request needed
    assert engine.kv.prefix_cache_bytes() <= 100 * sim.kv_bytes_per_token
