"""Memory tiers: value score, swap to a real Redis (tests/redis_fixtures.py) and back, outages, HBM scans, the cold folder."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from nvml_fixtures import FakeNvml
from registry_values import metric
from redis_fixtures import RedisDb, redis_db, redis_server, start_redis  # noqa: F401

from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard_harness.testing.capacity import FixedSlots
from switchyard.common.channels import open_channel
from switchyard.common.config import ConfigError, PriorityBoost, SwitchyardConfig, ValueScoreConfig
from switchyard.common.dram import DramClient
from switchyard.common.server import start_server
from switchyard.dispatcher.engine_loop import StepLoop
from switchyard.dispatcher.engines.sim import SimEngine, SimKV, export_modelled_kv
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.output import StreamDone, StreamToken
from switchyard.dispatcher.request import Request, RequestStatus, SchedulerOutput
from switchyard.dispatcher.service import DispatcherService
from switchyard.dispatcher.tiers import ColdStore, KvStore, MemoryTiers
from switchyard.dispatcher.tiers.value import GIB, ValueScore
from switchyard.dispatcher.engines.base import StepBatch, StepResult
from switchyard_harness.testing.scheduling import accept, finish, publish, step

pytestmark = pytest.mark.no_gpu

CORE, NORMAL, BATCH = agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH


def kv_store(db: RedisDb) -> KvStore:
    """A KV store on the test Redis (a client of its own, for this test's event loop)."""
    return KvStore(DramClient(db.dram_config), SwitchyardConfig().memory.dram.kv_ttl_s)


def build(engine: Any, store: KvStore | None, *, running: int | None = None, **overrides: Any) -> Any:
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1, **overrides})
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    capacity = FixedSlots(running) if running is not None else None
    return make_scheduler(config, engine, monitor=monitor, capacity=capacity, tiers=tiers)


def request(rid: str, priority: int = NORMAL, *, arrival: float = 0.0, prompt_tokens: int = 800,
            max_tokens: int = 12, task_type: str = "chat", **fields: Any) -> Request:
    return Request(request_id=rid, prompt="How does the with statement work?", priority=PriorityClass.from_proto(priority),
                    task_type=task_type, prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival=arrival,
                    **fields)


async def run_to_end(sched: Any, engine: SimEngine, req: Request, now: float) -> None:
    """Step ``req`` through the scheduler until its stop check ends it."""
    if req.needs_prefill:
        await step(sched, engine, prefill=[req], now=now)
    while not req.is_finished:
        await step(sched, engine, decode=[req], now=now)


def streamed(req: Request) -> list[StreamToken]:
    items = req.output.drain()
    assert isinstance(items[-1], StreamDone)
    return [item for item in items if isinstance(item, StreamToken)]


# --------------------------------------------------------------------------- value score


def test_value_score_orders_by_priority_frequency_recency_and_cost_per_byte() -> None:
    value = ValueScore(ValueScoreConfig(recency_half_life_s=300), PriorityBoost())
    base = dict(priority_class="normal", hits=0, reuse_seconds=0.030, nbytes=GIB // 2, idle_s=0.0)
    v = value.score(**base)
    assert v == pytest.approx(5 * 1 * 30_000 / 0.5)  # the docstring's scale: 3e5
    assert value.score(**{**base, "priority_class": "core"}) == pytest.approx(2 * v)
    assert value.score(**{**base, "priority_class": "batch"}) == pytest.approx(v / 5)
    assert value.score(**{**base, "hits": 2}) == pytest.approx(3 * v)
    assert value.score(**{**base, "idle_s": 300}) == pytest.approx(v / 2)  # one half-life
    assert value.score(**{**base, "idle_s": 3000, "pinned": True}) == pytest.approx(v)  # tool-wait TTL
    assert value.score(**{**base, "nbytes": GIB}) == pytest.approx(v / 2)  # same saving, twice the bytes
    # with the seed's thresholds: fresh normal state may be evicted (< 1e6), often-reused core state not
    assert v < 1e6 <= value.score(**{**base, "priority_class": "core", "hits": 2})
    # nine idle half-lives take it below demote_threshold (1e3)
    assert value.score(**{**base, "idle_s": 9 * 300}) < 1e3


def test_swap_is_chosen_only_when_cheaper_than_prefill() -> None:
    engine = SimEngine(SwitchyardConfig())
    config = SwitchyardConfig()
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv)
    tokens = 1000
    nbytes = tokens * engine.params.kv_bytes_per_token
    # 524 MB at 50 GB/s: 10.5 ms + 0.5 ms each way, against 5 + 25 ms of prefill
    assert tiers.transfer_seconds(nbytes) == pytest.approx(nbytes / 50e9 + 0.0005)
    assert 2 * tiers.transfer_seconds(nbytes) < tiers.recompute_seconds(tokens)
    slow = SwitchyardConfig().with_overrides(**{"memory.dram.transfer_gb_per_s": 10.0}).memory
    slow_tiers = MemoryTiers(slow, config.scheduler.priority_boost, engine.kv)
    assert 2 * slow_tiers.transfer_seconds(nbytes) > slow_tiers.recompute_seconds(tokens)


def test_bad_memory_policy_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"memory.hbm.*emergency_evict_ratio \(0.8\) must be at least capacity_ratio"):
        SwitchyardConfig().with_overrides(**{"memory.hbm.emergency_evict_ratio": 0.8})
    with pytest.raises(ConfigError, match=r"memory.dram.transfer_gb_per_s"):
        SwitchyardConfig().with_overrides(**{"memory.dram.transfer_gb_per_s": 0.0})


# --------------------------------------------------------------------------- swap to Redis and back


async def test_preempted_kv_goes_to_redis_and_comes_back_instead_of_being_recomputed(redis_db: RedisDb) -> None:
    engine = SimEngine(SwitchyardConfig())
    client = redis_db.client()
    store = kv_store(redis_db)
    sched = build(engine, store, running=1, **{"scheduler.core_wait_before_preempt_ms": 0})
    batch = request("swap-b", BATCH)
    accept(sched, [batch], now=0.0)
    out = sched.schedule(now=0.0)
    await step(sched, engine, prefill=out.admitted)
    for _ in range(4):
        await step(sched, engine, decode=[batch])
    held = batch.num_computed_tokens
    assert held == batch.prompt_tokens + 4

    core = request("swap-c", CORE, arrival=0.1, prompt_tokens=20, max_tokens=3)
    accept(sched, [core], now=0.1)
    restored_before = metric("switchyard_kv_restored_tokens_total")
    publish(sched)
    evicted, demoted = metric("switchyard_tier_evictions_total", tier="hbm"), metric("switchyard_tier_demotions_total", tier="hbm")
    counted = sched.counters.hbm_evictions
    out = sched.schedule(now=0.2)
    assert out.preempted == [batch] and batch.swap_key == sched.tiers.request_key(batch) and batch.swap_tokens == held
    assert batch.num_computed_tokens == 0  # gone from HBM
    # one eviction from HBM, counted by the scheduler (its one counter of state that left HBM, moved or dropped),
    # once on the series; the move down is the tiers' demotion
    assert sched.counters.hbm_evictions == counted + 1
    publish(sched)
    assert metric("switchyard_tier_evictions_total", tier="hbm") == evicted + 1
    assert metric("switchyard_tier_demotions_total", tier="hbm") == demoted + 1
    await run_to_end(sched, engine, core, now=0.3)
    # the copy is in Redis, as a hash with its metadata and a TTL
    await sched.tiers._writes[sched.tiers.request_key(batch)]
    assert int(await client.hget(sched.tiers.request_key(batch), "tokens")) == held
    assert 0 < await client.ttl(sched.tiers.request_key(batch)) <= 7200

    hits = metric("switchyard_tier_hits_total", tier="dram")
    out = sched.schedule(now=0.4)
    assert out.admitted == [batch] and out.restore == [batch]
    assert await sched.tiers.restore(batch) == held
    assert sched.tiers.take_owed_seconds() > 0  # the sim's modelled transfer time, out and back
    assert batch.num_computed_tokens == held and not batch.needs_prefill
    await run_to_end(sched, engine, batch, now=0.5)
    tokens = streamed(batch)
    assert [t.index for t in tokens] == list(range(12)), "a token was lost or repeated"
    assert batch.recomputed_tokens == 0 and batch.restored_tokens == held
    assert metric("switchyard_tier_hits_total", tier="dram") == hits + 1
    assert metric("switchyard_kv_restored_tokens_total") == restored_before + held
    for _ in range(500):  # the background delete of the restored copy (a fixed 0.05 s could pass before it ran)
        if not await client.exists(sched.tiers.request_key(batch)):
            break
        await asyncio.sleep(0.01)
    assert not await client.exists(sched.tiers.request_key(batch))
    await sched.tiers.aclose()


async def test_two_preempted_requests_sharing_a_caller_id_each_get_their_own_copy_back(redis_db: RedisDb) -> None:
    """A caller's ``request_id`` is not unique (two callers, or one reusing an id): the DRAM copy of a preempted
    request was keyed by it, so a second request of that id preempted meanwhile replaced the first's copy (its
    write cancelled), the first took the second's copy back and deleted it, and the second recomputed. A copy is
    keyed by the request itself (``seq_id``, under an id of this dispatcher's own)."""
    engine = SimEngine(SwitchyardConfig())
    store = kv_store(redis_db)
    sched = build(engine, store, running=2, **{"scheduler.core_wait_before_preempt_ms": 0})
    first, second = request("dup", BATCH, prompt_tokens=800), request("dup", BATCH, prompt_tokens=300)
    assert sched.tiers.request_key(first) != sched.tiers.request_key(second)
    accept(sched, [first, second], now=0.0)
    out = sched.schedule(now=0.0)
    assert out.admitted == [first, second]
    await step(sched, engine, prefill=out.admitted)
    await step(sched, engine, decode=[first, second])
    held = {id(first): first.num_computed_tokens, id(second): second.num_computed_tokens}
    assert held[id(first)] != held[id(second)]

    cores = [request(f"core-{i}", CORE, arrival=0.1, prompt_tokens=20, max_tokens=2) for i in range(2)]
    accept(sched, cores, now=0.1)
    out = sched.schedule(now=0.2)
    assert sorted(map(id, out.preempted)) == sorted([id(first), id(second)])
    assert first.swap_key and second.swap_key and first.swap_key != second.swap_key
    for core in cores:
        await run_to_end(sched, engine, core, now=0.3)
    out = sched.schedule(now=0.4)
    assert sorted(map(id, out.restore)) == sorted([id(first), id(second)])
    for req in out.restore:
        assert await sched.tiers.restore(req) == held[id(req)]
        assert req.recomputed_tokens == 0
    await sched.tiers.aclose()


async def test_a_parked_agent_past_its_ttl_resumes_from_dram(redis_db: RedisDb) -> None:
    engine = SimEngine(SwitchyardConfig())
    client = redis_db.client()
    store = kv_store(redis_db)
    sched = build(engine, store, **{"scheduler.tool_wait_ttl_s": 1.0})
    think = request("agent-think", agent_id="agent-t", task_type="react_loop", prompt_tokens=600)
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    await step(sched, engine, prefill=[think])
    finish(sched, think, 0.1, RequestStatus.FINISHED_TOOL_CALLS)
    assert sched.parked == [think]
    prefix = think.num_computed_tokens

    sched.on_idle(now=5.0)  # the tool took longer than the TTL: the prefix leaves HBM for DRAM
    assert sched.parked == [] and think.num_computed_tokens == 0
    await sched.tiers._writes[sched.tiers.parked_key("agent-t")]
    assert int(await client.hget(sched.tiers.parked_key("agent-t"), "tokens")) == prefix

    publish(sched)
    restored = metric("switchyard_resumes_total", resume="restored")
    back = request("agent-back", agent_id="agent-t", task_type="react_loop", prompt_tokens=700, arrival=5.0)
    sched.resume(back, now=5.0)
    out = sched.schedule(now=5.0)
    assert out.restore == [back]
    assert await sched.tiers.restore(back) == prefix
    assert back.num_computed_tokens == prefix and back.needs_prefill  # only the new tokens are prefilled
    publish(sched)
    assert metric("switchyard_resumes_total", resume="restored") == restored + 1
    await run_to_end(sched, engine, back, now=5.1)
    assert back.recomputed_tokens == 0 and back.restored_tokens == prefix
    await sched.tiers.aclose()


async def test_redis_outage_degrades_to_recompute_with_a_log_line_and_a_metric(
        caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis()  # a server of its own, stopped: an outage
    store = KvStore(DramClient(RedisDb(server.host, server.port, 0).dram_config), 7200)
    server.stop()
    engine = SimEngine(SwitchyardConfig())
    sched = build(engine, store, running=1, **{"scheduler.core_wait_before_preempt_ms": 0})
    batch = request("outage-b", BATCH)
    accept(sched, [batch], now=0.0)
    sched.schedule(now=0.0)
    await step(sched, engine, prefill=[batch])
    core = request("outage-c", CORE, arrival=0.1, prompt_tokens=20, max_tokens=3)
    accept(sched, [core], now=0.1)
    degraded = metric("switchyard_dram_degraded_operations_total")
    with caplog.at_level(logging.WARNING, logger="switchyard.common.dram"):
        out = sched.schedule(now=0.2)
        assert out.preempted == [batch] and batch.swap_key  # chosen before Redis was asked
        await run_to_end(sched, engine, core, now=0.3)
        out = sched.schedule(now=0.4)
        assert out.restore == [batch]
        assert await sched.tiers.restore(batch) == 0  # the write failed: a miss
    assert metric("switchyard_dram_degraded_operations_total") == degraded + 1
    assert "DRAM tier unavailable" in caplog.text and "KV swap degrade to recompute" in caplog.text
    assert not store.available()  # no more waiting on a dead Redis for retry_interval_s
    await run_to_end(sched, engine, batch, now=0.5)  # the task goes on: its prefix is recomputed
    assert batch.finish_reason == "length" and batch.recomputed_tokens >= batch.prompt_tokens
    assert [t.index for t in streamed(batch)] == list(range(12))
    # within the retry window the scheduler does not even try
    assert not sched.tiers.worth_swapping(1000, 1000 * engine.params.kv_bytes_per_token)
    await sched.tiers.aclose()


async def test_dram_scan_keeps_valuable_entries_and_archives_stale_ones_to_the_cold_folder(
        redis_db: RedisDb, tmp_path: Path) -> None:
    client = redis_db.client()
    config = SwitchyardConfig()
    store = kv_store(redis_db)
    cold = ColdStore(str(tmp_path / "cold"), config.memory.dram.key_prefix)
    engine = SimEngine(config)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store, cold)
    source = request("x", prompt_tokens=1000)
    source.num_computed_tokens = 1000
    record = export_modelled_kv(source, 524_288)
    assert record is not None
    common = dict(tokens=1000, nbytes=1000 * 524_288, cost_us=30_000.0)
    for name, priority, hits in (("hot", "core", 5), ("young", "batch", 0), ("stale", "batch", 0)):
        await store.put(store.key("seq", name), record, priority=priority, hits=hits, **common)
    now = float(await client.hget(store.key("seq", "stale"), "stored_at"))
    await client.hset(store.key("seq", "stale"), "stored_at", now - 3 * 3600)  # idle three hours
    await client.hset(store.key("seq", "young"), "stored_at", now - 1800)  # worth little, but not yet archive_after_s old
    demotions = metric("switchyard_tier_demotions_total", tier="dram")
    hot, moved = await tiers.scan_dram(now)
    assert (hot, moved) == (1, 1)
    assert await client.exists(store.key("seq", "hot")) and await client.exists(store.key("seq", "young"))
    assert not await client.exists(store.key("seq", "stale"))
    assert (tmp_path / "cold" / "seq" / "stale.kv").is_file()
    assert metric("switchyard_tier_demotions_total", tier="dram") == demotions + 1
    assert cold.nbytes == 1000 * 524_288 and metric("switchyard_tier_bytes", tier="cold") == cold.nbytes

    # on access it comes back up, from the cold folder, to HBM
    req = request("stale", prompt_tokens=1000)
    req.status, req.swap_key, req.swap_tokens = RequestStatus.RUNNING, store.key("seq", "stale"), 1000
    hits = metric("switchyard_tier_hits_total", tier="cold")
    assert await tiers.restore(req) == 999  # all but the newest token, whose KV its next step computes
    assert metric("switchyard_tier_hits_total", tier="cold") == hits + 1
    assert not (tmp_path / "cold" / "seq" / "stale.kv").exists() and cold.nbytes == 0
    for name in ("hot", "young"):
        await client.delete(store.key("seq", name))
    await tiers.aclose()


def test_a_cold_path_fsspec_cannot_open_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"\[oss\] path 'nosuchproto://bucket/x'"):
        ColdStore("nosuchproto://bucket/x")


# --------------------------------------------------------------------------- HBM: admission, emergency, OOM


def test_admission_refusal_for_kv_memory_counts_one_oom_avoided_per_request() -> None:
    engine = SimEngine(SwitchyardConfig().with_overrides(**{"sim.hbm_gb": 20.0}))
    sched = build(engine, None, **{"sim.hbm_gb": 20.0})
    budget = sched.capacity.budget_bytes  # 0.85 x 20 GB - 14 GB of weights = 3 GB
    per_token = engine.params.kv_bytes_per_token
    big = [request(f"oom-{i}", prompt_tokens=budget // per_token // 2, max_tokens=1) for i in range(3)]
    publish(sched)
    avoided = metric("switchyard_kv_oom_avoided_total")
    accept(sched, big, now=0.0)
    out = sched.schedule(now=0.0)
    assert len(out.admitted) == 1
    sched.schedule(now=0.1)
    sched.schedule(now=0.2)
    publish(sched)
    assert metric("switchyard_kv_oom_avoided_total") == avoided + 1  # the same head, refused three times


def test_emergency_ratio_evicts_until_below_whatever_the_value() -> None:
    class GpuKV(SimKV):
        """The sim's KV with device memory in use read as NVML would (another process holds some)."""

        used = 0

        def device_used_bytes(self) -> int:
            return self.used + 14 * 10**9 + sched.capacity.held_bytes

    engine = SimEngine(SwitchyardConfig())
    engine.kv = gpu = GpuKV(engine)
    sched = build(engine, None, **{"scheduler.tool_wait_ttl_s": 3600.0})
    agents = []
    for i in range(3):
        req = request(f"emerg-{i}", CORE, agent_id=f"agent-e{i}", task_type="react_loop", prompt_tokens=4000)
        req.num_computed_tokens = 4000
        req.kv_hits = 5  # valuable: above evict_first_below, so admission alone would never evict it
        sched.parking.park(req, now=0.0)
        agents.append(req)
    publish(sched)
    scans = metric("switchyard_tier_scans_total", tier="hbm")
    publish(sched)
    evicted = metric("switchyard_parked_evicted_total")
    sched.on_idle(now=0.0)  # usage far below 0.9: nothing moves
    assert len(sched.parked) == 3
    gpu.used = int(0.9 * 80e9) - 14 * 10**9 - sched.capacity.held_bytes + 2 * 10**9  # 2 GB past the ratio
    sched.on_idle(now=400.0)  # the next hbm scan
    publish(sched)
    assert metric("switchyard_tier_scans_total", tier="hbm") == scans + 2
    assert len(sched.parked) == 2 and sched.capacity.usage_ratio() < 0.9  # one 2.1 GB prefix was enough
    publish(sched)
    assert metric("switchyard_parked_evicted_total") == evicted + 3 - len(sched.parked)


async def test_emergency_with_nothing_parked_preempts_the_lowest_value_running_work_into_dram(
        redis_db: RedisDb) -> None:
    class GpuKV(SimKV):
        other_process = 0

        def device_used_bytes(self) -> int:
            return self.other_process + 14 * 10**9 + sched.capacity.held_bytes

    engine = SimEngine(SwitchyardConfig())
    engine.kv = gpu = GpuKV(engine)
    client = redis_db.client()
    sched = build(engine, kv_store(redis_db))
    core, batch = request("em-core", CORE, prompt_tokens=3000), request("em-batch", BATCH, prompt_tokens=3000)
    accept(sched, [core, batch], now=0.0)
    sched.schedule(now=0.0)
    await step(sched, engine, prefill=[core, batch])
    gpu.other_process = int(0.9 * 80e9) - 14 * 10**9 - sched.capacity.held_bytes + 10**9  # 1 GB past 0.9
    out = SchedulerOutput()
    sched.hbm_scan(now=1.0, out=out)
    assert out.preempted == [batch] and sched.running == [core]  # batch state is worth least
    assert batch.swap_key == sched.tiers.request_key(batch) and batch.swap_tokens == batch.prompt_tokens
    await sched.tiers.aclose()
    await client.delete(sched.tiers.request_key(batch))


async def test_a_real_out_of_memory_step_is_counted_and_the_tasks_go_on() -> None:
    class OutOfMemoryError(RuntimeError):
        """Stand-in for torch.cuda.OutOfMemoryError (no GPU here); matched by name."""

    class FlakyGpu(SimEngine):
        failures = 1

        async def execute_model(self, batch: StepBatch) -> StepResult:
            if self.failures and batch.prefill and batch.decode:  # the mixed step the second request joins
                self.failures -= 1
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return await super().execute_model(batch)

    config = SwitchyardConfig()
    engine = FlakyGpu(config)
    sched = build(engine, None)
    loop = StepLoop(config, engine, sched)
    oom = metric("switchyard_kv_oom_total")
    loop.start()
    first = request("oom-a", max_tokens=30, prompt_tokens=50, arrival=time.monotonic())
    loop.submit(first)
    for _ in range(2000):
        if len(first.output_tokens) >= 3 or first.is_finished:
            break
        await asyncio.sleep(0.005)
    assert len(first.output_tokens) >= 3, (first.status, first.finish_reason, first.output_tokens)
    second = request("oom-b", max_tokens=5, prompt_tokens=50, arrival=time.monotonic())  # joins in a mixed step, which fails once
    loop.submit(second)
    await asyncio.wait_for(asyncio.gather(*(wait_done(s) for s in (first, second))), 10)
    await loop.drain()
    assert metric("switchyard_kv_oom_total") == oom + 1
    assert first.finish_reason in ("stop", "length") and second.finish_reason in ("stop", "length")
    assert first.preemptions == 1 and second.preemptions == 1  # preempted, retried, not failed
    assert [t.index for t in streamed(first)] == list(range(len(first.output_tokens))), "a token was lost or repeated"


async def test_a_prefill_that_runs_out_of_memory_reports_no_kv_held() -> None:
    """A prefill's allocation counts while its step runs (``Request.step_kv_bytes``); a step that ran out of device
    memory allocated nothing, and its request, failed RESOURCE_EXHAUSTED at the second such step, held no KV: its
    ``memory_peak_bytes`` is 0, not the prompt's allocation the device refused."""
    class OutOfMemoryError(RuntimeError):
        """Stand-in for torch.cuda.OutOfMemoryError (no GPU here); matched by name."""

    class NoRoomGpu(SimEngine):
        async def execute_model(self, batch: StepBatch) -> StepResult:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    config = SwitchyardConfig()
    engine = NoRoomGpu(config)
    loop = StepLoop(config, engine, build(engine, None))
    loop.start()
    req = request("oom-prefill", max_tokens=5, prompt_tokens=500, arrival=time.monotonic())
    loop.submit(req)
    await asyncio.wait_for(wait_done(req), 10)
    await loop.drain()
    assert req.status is RequestStatus.FINISHED_ERROR and req.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert req.oom_retries == 2 and req.memory_peak_bytes == 0


async def wait_done(req: Request) -> None:
    while not req.is_finished:
        await asyncio.sleep(0.005)


def test_a_cold_folder_that_is_a_file_or_under_one_is_refused_naming_its_setting(tmp_path) -> None:
    """The dispatcher failed to start with a bare "[Errno 20] Not a directory" naming no setting."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for path, why in ((a_file, "a file is there"), (a_file / "cold", "Not a directory")):
        with pytest.raises(ValueError, match=rf"memory_policy.toml \[oss\] path '{path}': expected a folder this user "
                                             rf"can read and write \({why}\)"):
            ColdStore(str(path))
    assert ColdStore(str(tmp_path / "not-yet")).local  # a folder not made yet is made at the first archive


def test_a_cold_store_whose_server_cannot_be_reached_is_refused_naming_its_setting() -> None:
    """``[oss] path = "ftp://host/cold"`` with the host unknown or not answering: fsspec's FTP backend connects when
    the store is opened, and the dispatcher failed to start with a bare "[Errno -2] Name or service not known"
    (or "[Errno 111] Connection refused") naming neither the setting nor the URL."""
    path = "ftp://127.0.0.1:1/cold"  # nothing listens on port 1
    with pytest.raises(ValueError, match=rf"memory_policy.toml \[oss\] path '{path}': expected a store that can be "
                                         r"opened \(ConnectionRefusedError: .*Connection refused\)"):
        ColdStore(path)


# --------------------------------------------------------------------------- fragmentation, defragmentation


def test_fragmentation_is_the_share_of_allocated_kv_holding_no_tokens() -> None:
    engine = SimEngine(SwitchyardConfig().with_overrides(**{"sim.prefix_caching": False}))
    sched = build(engine, None, **{"sim.prefix_caching": False})
    req = request("frag", prompt_tokens=300, max_tokens=100)
    accept(sched, [req], now=0.0)
    sched.schedule(now=0.0)
    assert req.kv_reserved_bytes == 400 * engine.params.kv_bytes_per_token
    assert sched.fragmentation_ratio() == 1.0  # reserved, nothing computed yet
    req.num_computed_tokens = 300
    assert sched.fragmentation_ratio() == pytest.approx(0.25)  # 100 of 400 reserved tokens hold nothing
    sched.schedule(now=2.0)
    publish(sched)
    assert metric("switchyard_kv_fragmentation_ratio") == pytest.approx(0.25)


def test_an_engine_gone_idle_reports_the_fragmentation_of_what_it_holds_now_not_its_last_busy_step() -> None:
    """The ratio was computed only by schedule(): once the last request ended the loop called on_idle alone,
    and the gauge read the last busy step's 1.0 (all reserved, nothing computed) for as long as it idled."""
    engine = SimEngine(SwitchyardConfig().with_overrides(**{"sim.prefix_caching": False}))
    sched = build(engine, None, **{"sim.prefix_caching": False})
    req = request("gone", prompt_tokens=300, max_tokens=100)
    accept(sched, [req], now=0.0)
    sched.schedule(now=0.0)  # admitted (the ratio is read before admission)
    sched.schedule(now=2.0)
    publish(sched)
    assert metric("switchyard_kv_fragmentation_ratio") == 1.0  # reserved, nothing computed yet
    finish(sched, req, now=2.5)
    sched.on_idle(now=2.6)  # within the second: the reading is not due yet
    publish(sched)
    assert metric("switchyard_kv_fragmentation_ratio") == 1.0
    sched.on_idle(now=3.5)
    publish(sched)
    assert metric("switchyard_kv_fragmentation_ratio") == 0.0  # nothing allocated


def test_defragmentation_runs_only_below_the_trigger_score_at_the_scan_interval() -> None:
    class CompactableKV(SimKV):
        compactions = 0
        holders: list = []

        def compact(self, holders) -> int:
            self.compactions += 1
            self.holders = list(holders)
            return 4096

    engine = SimEngine(SwitchyardConfig())
    engine.kv = CompactableKV(engine)
    sched = build(engine, None)
    publish(sched)
    runs, freed = metric("switchyard_kv_defragmentations_total"), metric("switchyard_kv_defrag_freed_bytes_total")
    sched.score = 80.0  # a busy GPU: no compaction
    sched.hbm_scan(now=0.0, out=SchedulerOutput())
    assert engine.kv.compactions == 0
    held = request("held", prompt_tokens=300, max_tokens=100)
    accept(sched, [held], now=0.5)
    sched.schedule(now=0.5)
    sched.score = 10.0  # below defrag_below_score (30)
    sched.hbm_scan(now=1.0, out=SchedulerOutput())
    assert engine.kv.compactions == 1
    assert held in engine.kv.holders  # every request the scheduler holds is compacted
    publish(sched)
    assert metric("switchyard_kv_defragmentations_total") == runs + 1
    publish(sched)
    assert metric("switchyard_kv_defrag_freed_bytes_total") == freed + 4096
    # scans follow hbm_scan_interval_s (300 s): none at 100 s, one at 301 s
    sched.on_idle(now=100.0)
    assert engine.kv.compactions == 1
    sched.on_idle(now=301.0)
    assert engine.kv.compactions == 2


# --------------------------------------------------------------------------- the dispatcher over gRPC


async def test_dispatcher_over_grpc_parks_an_agent_in_redis_and_resumes_it_from_there(redis_db: RedisDb) -> None:
    config = SwitchyardConfig().with_overrides(**{
        **redis_db.overrides,
        "scheduler.tool_wait_ttl_s": 0.0,  # the tool outlives the HBM TTL at once: the prefix goes to DRAM
    })
    service = DispatcherService(config)
    client = redis_db.client()
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}", config.server)
    try:
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        question = agent_pb2.ChatMessage(role="user", content="<question>what does the with statement do?</question>")
        tools = [agent_pb2.ToolSpec(name="search_docs", parameters_json='{"type": "object"}')]
        first = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
            request_id="e2e-1", agent_id="e2e-agent", task_type="react_loop", messages=[question], tools=tools,
        ), timeout=30)]
        call = [c.tool_call for c in first if c.HasField("tool_call")][0]
        assert first[-1].done.finish_reason == "tool_calls"
        key = service.tiers.parked_key("e2e-agent")
        for _ in range(400):  # the idle engine's next tick expires the TTL and writes the copy
            if await client.exists(key):
                break
            await asyncio.sleep(0.01)
        prefix = int(await client.hget(key, "tokens"))
        assert prefix > 0 and service.scheduler.parked == []

        restored = metric("switchyard_kv_restored_tokens_total")
        resumes = metric("switchyard_resumes_total", resume="restored")
        follow = [
            question,
            agent_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            agent_pb2.ChatMessage(role="tool", tool_call_id=call.call_id, name="search_docs",
                                  content="[1] Compound statements\nThe with statement wraps a block."),
        ]
        second = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
            request_id="e2e-2", agent_id="e2e-agent", task_type="react_loop", messages=follow, tools=tools,
            resume=True,
        ), timeout=30)]
        assert second[-1].done.finish_reason == "stop"
        assert metric("switchyard_resumes_total", resume="restored") == resumes + 1
        assert metric("switchyard_kv_restored_tokens_total") == restored + prefix
        for _ in range(100):
            if not await client.exists(key):
                break
            await asyncio.sleep(0.01)
        assert not await client.exists(key), "the copy went back up to HBM"
    finally:
        await channel.close()
        await srv.stop(1.0)
        await client.aclose()


async def test_an_agent_spilled_to_another_dispatcher_restores_its_prefix_from_the_shared_dram(
        redis_db: RedisDb) -> None:
    """Affinity spills an agent's step to the next replica: that replica finds the copy its home parked in the
    shared DRAM tier (keyed by agent, not by replica) and restores it instead of recomputing the prefix."""
    config = SwitchyardConfig().with_overrides(**{**redis_db.overrides, "scheduler.tool_wait_ttl_s": 0.0})
    home, spill = DispatcherService(config), DispatcherService(config)
    client = redis_db.client()
    servers = [await start_server([service], "127.0.0.1", 0, config.server) for service in (home, spill)]
    channels = [open_channel(f"127.0.0.1:{srv.port}", config.server) for srv in servers]
    try:
        home_stub, spill_stub = (agent_pb2_grpc.InferenceServiceStub(channel) for channel in channels)
        question = agent_pb2.ChatMessage(role="user", content="<question>what does the with statement do?</question>")
        tools = [agent_pb2.ToolSpec(name="search_docs", parameters_json='{"type": "object"}')]
        first = [c async for c in home_stub.Generate(agent_pb2.GenerateRequest(
            request_id="spill-1", agent_id="spill-agent", task_type="react_loop", messages=[question], tools=tools,
        ), timeout=30)]
        call = [c.tool_call for c in first if c.HasField("tool_call")][0]
        key = home.tiers.parked_key("spill-agent")
        assert key == spill.tiers.parked_key("spill-agent")
        for _ in range(400):  # the home's idle tick expires the TTL and writes the copy
            if await client.exists(key):
                break
            await asyncio.sleep(0.01)
        prefix = int(await client.hget(key, "tokens"))
        assert prefix > 0 and home.scheduler.parked == []

        restored = metric("switchyard_kv_restored_tokens_total")
        recomputed = metric("switchyard_kv_recomputed_tokens_total")
        hits = metric("switchyard_tier_hits_total", tier="dram")
        follow = [
            question,
            agent_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            agent_pb2.ChatMessage(role="tool", tool_call_id=call.call_id, name="search_docs",
                                  content="[1] Compound statements\nThe with statement wraps a block."),
        ]
        second = [c async for c in spill_stub.Generate(agent_pb2.GenerateRequest(
            request_id="spill-2", agent_id="spill-agent", task_type="react_loop", messages=follow, tools=tools,
            resume=True,
        ), timeout=30)]
        assert second[-1].done.finish_reason == "stop"
        assert metric("switchyard_kv_restored_tokens_total") == restored + prefix
        assert metric("switchyard_kv_recomputed_tokens_total") == recomputed
        assert metric("switchyard_tier_hits_total", tier="dram") == hits + 1
    finally:
        for channel in channels:
            await channel.close()
        for srv in servers:
            await srv.stop(1.0)
        await client.aclose()


async def test_closing_the_tiers_lets_a_discard_under_way_end_first(redis_db: RedisDb, caplog) -> None:
    """A discard's delete runs in the background; closing the Redis client under it logged a false outage at
    every shutdown (and the copy stayed). aclose waits for it."""
    client = redis_db.client()
    config = SwitchyardConfig()
    store = kv_store(redis_db)
    engine = SimEngine(config)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    key = store.key("seq", "gone")
    await store.put(key, b"kv bytes", priority="batch", hits=0, tokens=100, nbytes=100 * 524_288, cost_us=1000.0)
    assert await client.exists(key)
    with caplog.at_level(logging.WARNING, logger="switchyard.common.dram"):
        tiers.discard(key)
        await tiers.aclose()
    assert not await client.exists(key)
    assert "DRAM tier unavailable" not in caplog.text


@pytest.mark.parametrize("ident", ["a" * 256, "ü" * 128 + ":3", "日本語" * 80, "short-id"])
async def test_every_id_the_edge_accepts_is_archived_and_taken_back(tmp_path: Path, ident: str) -> None:
    """An agent id of 256 characters, or about 42 of two UTF-8 bytes, made a file name past the 255 bytes a file
    system allows (ENAMETOOLONG): the entry was never archived and its KV was recomputed."""
    from switchyard.dispatcher.tiers.dram import Entry

    cold = ColdStore(str(tmp_path / "cold"), "sy:")
    key = f"sy:kv:agent:{ident}"  # KvStore.key: {key_prefix}kv:{kind}:{ident}
    entry = Entry(key=key, tokens=10, nbytes=100, priority="batch", hits=0, cost_us=1.0, stored_at=time.time(),
                  payload=b"kv" * 50)
    assert await cold.put(entry)
    back = await cold.take(key)
    assert back is not None and back.payload == entry.payload and back.key == key
    assert await cold.take(key) is None  # taken: gone


async def test_an_entry_archived_under_its_former_long_name_is_still_found(tmp_path: Path) -> None:
    """Names of 161 to 250 characters were stored as they were before long names were hashed: still a hit."""
    from urllib.parse import quote

    from switchyard.dispatcher.tiers import blob
    from switchyard.dispatcher.tiers.dram import META_FIELDS, Entry

    ident = "a" * 200
    key = f"sy:kv:agent:{ident}"  # KvStore.key: {key_prefix}kv:{kind}:{ident}
    entry = Entry(key=key, tokens=10, nbytes=100, priority="batch", hits=0, cost_us=1.0, stored_at=time.time(),
                  payload=b"kv" * 50)
    folder = tmp_path / "cold" / "agent"
    folder.mkdir(parents=True)
    meta = {name: getattr(entry, name) for name in META_FIELDS}
    (folder / f"{quote(ident, safe='')}.kv").write_bytes(blob.seal(key, meta, entry.payload))
    back = await ColdStore(str(tmp_path / "cold"), "sy:").take(key)
    assert back is not None and back.payload == entry.payload
    assert not any(folder.iterdir())  # taken: removed
