"""Scheduler tests: stepped by hand with a fake clock and a fake NVML; no GPU."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from nvml_fixtures import FakeNvml
from registry_values import metric

from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2
from switchyard_harness.testing.capacity import FixedSlots
from switchyard.common.config import ConfigError, SwitchyardConfig
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.metrics import publish_stats
from switchyard.dispatcher.scheduler import (
    ComputeScoreMonitor,
    FifoScheduler,
    PriorityScheduler,
    Scheduler,
    should_park,
)
from switchyard.dispatcher.scheduler import make_scheduler as build_scheduler
from switchyard.dispatcher.scheduler.admission import ADMISSION_WAVE, COMPUTE_SCORE
from switchyard.dispatcher.scheduler.capacity import KV_MEMORY, KvBudget, MemoryInfo
from switchyard.dispatcher.scheduler.compute_score import UtilSample, tensor_estimate, weighted_score
from switchyard.dispatcher.output import StreamDone, StreamToken
from switchyard.dispatcher.engines.base import KVCacheManager, SeqOutput, StepBatch, StepEngine, StepResult
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.request import Request, RequestStatus
from switchyard_harness.testing.scheduling import accept, finish, publish, step

pytestmark = pytest.mark.no_gpu

CORE, NORMAL, BATCH = agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH


# --------------------------------------------------------------------------- builders


class FakeKV(KVCacheManager):
    """KV bookkeeping only: ``per_token`` bytes (100) per computed token; every free recorded."""

    def __init__(self) -> None:
        self.per_token = 100
        self.released: list[Request] = []

    def kv_bytes(self, req: Request) -> int:
        return self.per_token * req.num_computed_tokens

    def free(self, req: Request) -> None:
        self.released.append(req)


class FakeEngine(StepEngine):
    """A step engine that is never stepped here: busy time and its :class:`FakeKV`."""

    def __init__(self) -> None:
        self.busy_seconds = 0.0
        self.kv = FakeKV()

    @property
    def released(self) -> list[Request]:
        return self.kv.released

    async def execute_model(self, batch: StepBatch) -> StepResult:
        raise AssertionError("the scheduler tests step no FakeEngine")


def make_scheduler(
    *, nvml: Any = None, engine: Any = None, running: int | None = None, **overrides: Any
) -> PriorityScheduler | FifoScheduler:
    """A scheduler from the default config with ``scheduler.<key>`` overrides and a fake NVML.

    ``running``: the engine holds this many requests (a fixed-slots capacity, standing in for a KV budget
    that holds that many requests); default: the engine's own memory.
    """
    config = SwitchyardConfig().with_overrides(
        **{"scheduler.score_sample_interval_ms": 1, **{f"scheduler.{k}": v for k, v in overrides.items()}}
    )
    engine = engine if engine is not None else FakeEngine()
    monitor = ComputeScoreMonitor(
        config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=nvml if nvml is not None else FakeNvml()
    )
    capacity = FixedSlots(running) if running is not None else None
    return build_scheduler(config, engine, monitor=monitor, capacity=capacity)  # type: ignore[return-value]


_ids = iter(range(1_000_000))


def make_requests(
    n: int,
    priority: int = NORMAL,
    arrival: float = 0.0,
    spacing: float = 0.0,
    task_type: str = "chat",
    prompt_tokens: int = 16,
    max_tokens: int = 8,
    **fields: Any,
) -> list[Request]:
    """``n`` requests of one class, arriving ``spacing`` seconds apart from ``arrival``."""
    return [
        Request(
            request_id=f"r{next(_ids)}",
            prompt="How does the with statement work?",
            priority=PriorityClass.from_proto(priority),
            task_type=task_type,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival=arrival + i * spacing,
            **fields,
        )
        for i in range(n)
    ]


def ids(reqs: list[Request]) -> list[str]:
    return [s.request_id for s in reqs]


# --------------------------------------------------------------------------- factory and config


def test_factory_picks_the_policy_from_config() -> None:
    assert isinstance(make_scheduler(), PriorityScheduler)
    fifo = make_scheduler(policy="fifo")
    assert isinstance(fifo, FifoScheduler) and isinstance(fifo, Scheduler)
    with pytest.raises(ValueError, match="expected one of"):
        build_scheduler(SwitchyardConfig(), policy="lottery")


def test_bad_scheduler_config_names_key_and_expectation() -> None:
    with pytest.raises(ConfigError, match="policy"):
        SwitchyardConfig().with_overrides(**{"scheduler.policy": "lottery"})
    with pytest.raises(ConfigError, match="aging_max_wait_ms"):
        SwitchyardConfig().with_overrides(**{"scheduler.aging_max_wait_ms": 0})


# --------------------------------------------------------------------------- priority classes and aging


def test_classes_are_admitted_core_then_normal_then_batch() -> None:
    sched = make_scheduler(running=4)
    batch = make_requests(2, BATCH)
    normal = make_requests(2, NORMAL)
    core = make_requests(2, CORE)
    accept(sched, batch + normal + core, now=0.0)
    assert ids(sched.waiting) == ids(core + normal + batch)

    out = sched.schedule(now=0.0)
    assert ids(out.admitted) == ids(core + normal)
    assert ids(sched.waiting) == ids(batch)
    assert ids(out.running) == ids(core + normal)
    publish_stats(sched.make_stats())  # what the step loop does after each decision
    running = {c: metric("switchyard_running_agents", priority_class=c) for c in ("core", "normal", "batch")}
    waiting = {c: metric("switchyard_waiting_agents", priority_class=c) for c in ("core", "normal", "batch")}
    assert running == {"core": 2, "normal": 2, "batch": 0} and waiting == {"core": 0, "normal": 0, "batch": 2}


def test_unset_priority_counts_as_normal_and_class_keeps_fifo() -> None:
    sched = make_scheduler(running=1)
    unset = make_requests(1, agent_pb2.PRIORITY_UNSPECIFIED, arrival=0.0)
    normal = make_requests(3, NORMAL, arrival=0.001, spacing=0.001)
    batch = make_requests(1, BATCH, arrival=-1.0)
    accept(sched, batch + normal[::-1] + unset, now=0.01)
    assert ids(sched.waiting) == ids(unset + normal + batch)


def test_aging_bounds_how_long_batch_work_waits() -> None:
    """A batch task that has waited aging_max_wait_ms is passed by no later arrival."""
    sched = make_scheduler(running=1, aging_max_wait_ms=1000, preemption_enabled=False)
    [blocker] = make_requests(1, NORMAL, arrival=0.0)
    accept(sched, [blocker], now=0.0)
    sched.schedule(now=0.0)
    [batch] = make_requests(1, BATCH, arrival=0.0)
    accept(sched, [batch], now=0.0)
    # core work keeps arriving faster than it is served: every 0.1 s, one finishes every 0.2 s
    admitted: list[Request] = []
    running = [blocker]
    t = 0.0
    for step in range(1, 60):
        t = step * 0.1
        accept(sched, make_requests(1, CORE, arrival=t), now=t)
        if step % 2 == 0:
            finish(sched, running.pop(0), t)
        out = sched.schedule(now=t)
        admitted += out.admitted
        running += out.admitted
        if batch in out.admitted:
            break
    assert batch in admitted, "batch task starved"
    cores_before = [s for s in admitted if s is not batch]
    assert all(s.arrival <= batch.arrival + 1.0 for s in cores_before)
    assert any(s.priority is PriorityClass.CORE for s in sched.waiting), "core work was still waiting, yet batch got in"


def test_without_aging_bound_batch_waits_behind_all_core_work() -> None:
    sched = make_scheduler(running=1, aging_max_wait_ms=3_600_000, preemption_enabled=False)
    [batch] = make_requests(1, BATCH, arrival=0.0)
    core = make_requests(5, CORE, arrival=10.0, spacing=10.0)
    accept(sched, [batch, *core], now=50.0)
    assert sched.waiting[-1] is batch


# --------------------------------------------------------------------------- admission


def test_admission_stops_when_the_engine_is_full() -> None:
    sched = make_scheduler(running=2)
    publish(sched)
    before = metric("switchyard_admissions_refused_total", reason=KV_MEMORY)
    reqs = make_requests(3)
    accept(sched, reqs, now=0.0)
    out = sched.schedule(now=0.0)
    assert ids(out.admitted) == ids(reqs[:2]) and ids(sched.waiting) == ids(reqs[2:])
    assert sched.admission.refusals[KV_MEMORY] == 1
    publish(sched)
    assert metric("switchyard_admissions_refused_total", reason=KV_MEMORY) == before + 1

    finish(sched, reqs[0], now=0.5)
    assert ids(sched.schedule(now=0.5).admitted) == ids(reqs[2:])


def test_max_admitted_per_decision_is_the_admission_wave_not_a_cap_on_the_running_set() -> None:
    sched = make_scheduler(max_admitted_per_decision=10, expected_score_initial=0)
    reqs = make_requests(25)
    accept(sched, reqs, now=0.0)
    waves = [len(sched.schedule(now=0.001 * i).admitted) for i in range(4)]
    assert waves == [10, 10, 5, 0]
    assert sched.num_running == 25  # the field's 10 never caps the GPU at ten requests
    assert sched.admission.refusals[ADMISSION_WAVE] == 2


def test_kv_budget_admits_what_fits_the_hbm_budget_and_counts_parked_state() -> None:
    from switchyard.common.config import HbmTierConfig

    info = MemoryInfo(device_bytes=10_000, weight_bytes=500, kv_bytes_per_token=10)
    parked = {"bytes": 0}
    budget = KvBudget(HbmTierConfig(capacity_ratio=0.85), info, lambda: parked["bytes"])
    assert budget.budget_bytes == 8000  # 0.85 x 10000 - 500
    [a, b, c] = make_requests(3, prompt_tokens=200, max_tokens=100)  # 300 tokens = 3000 bytes each
    assert budget.need(a) == 3000
    budget.take(a)
    budget.take(b)
    assert budget.refusal(c) == KV_MEMORY  # 6000 used, 2000 free
    budget.give(a)
    assert budget.refusal(c) is None
    parked["bytes"] = 2500
    assert budget.refusal(c) == KV_MEMORY  # parked agents' KV counts too
    [huge] = make_requests(1, prompt_tokens=700, max_tokens=200)
    assert "HBM budget" in (budget.never_fits(huge) or "")
    with pytest.raises(ValueError, match="capacity_ratio"):
        KvBudget(HbmTierConfig(capacity_ratio=0.04), info)


def test_sim_engine_budget_is_the_modelled_h100() -> None:
    engine = SimEngine(SwitchyardConfig())
    sched = build_scheduler(SwitchyardConfig(), engine)
    budget = sched.capacity
    assert isinstance(budget, KvBudget)
    assert budget.budget_bytes == int(0.85 * 80e9) - int(14e9)  # capacity_ratio x 80 GB - 7B fp16 weights
    # The field's reference request (458 prompt + 128 max tokens) fits about 180 times.
    [req] = make_requests(1, prompt_tokens=458, max_tokens=128)
    assert budget.budget_bytes // budget.need(req) > 150


def test_admission_stops_at_the_admission_score_limit() -> None:
    nvml = FakeNvml(gpu=20, memory=10)  # score 0.2*20 + 0.2*10 + 0 = 6
    sched = make_scheduler(nvml=nvml, expected_score_initial=10, admission_score_limit=80)
    first = make_requests(1)
    accept(sched, first, now=0.0)
    assert sched.schedule(now=0.0).admitted == first

    nvml.gpu, nvml.memory = 90, 50  # 0.2*90 + 0.2*50 + 0.6*72 = 71.2; + 10 expected >= 80
    waiting = make_requests(1)
    accept(sched, waiting, now=0.1)
    out = sched.schedule(now=0.1)
    assert sched.score == pytest.approx(71.2)
    assert out.admitted == [] and sched.waiting == waiting
    assert sched.admission.refusals == {COMPUTE_SCORE: 1}

    nvml.gpu, nvml.memory = 50, 20  # 10 + 4 + 24 = 38
    more = make_requests(4)
    accept(sched, more, now=0.2)
    out = sched.schedule(now=0.2)
    # 38 + 10 per admitted task: 48, 58, 68, 78 < 80 then 88
    assert ids(out.admitted) == ids(waiting + more[:3])
    assert sched.admission.refusals[COMPUTE_SCORE] == 2


def test_idle_engine_admits_its_head_whatever_the_score() -> None:
    sched = make_scheduler(nvml=FakeNvml(gpu=100, memory=100))
    reqs = make_requests(2)
    accept(sched, reqs, now=0.0)
    assert sched.schedule(now=0.0).admitted == reqs[:1]


def test_expected_score_is_learned_from_tasks_admitted_beside_running_work() -> None:
    nvml = FakeNvml(gpu=20, memory=10)  # score 6 while the engine is idle
    sched = make_scheduler(nvml=nvml, expected_score_initial=10, expected_score_ema_alpha=0.5, admission_score_limit=95)
    [alone] = make_requests(1, task_type="rag_answer")
    accept(sched, [alone], now=0.0)
    sched.schedule(now=0.0)
    nvml.gpu, nvml.memory = 50, 20  # score 38 while it runs
    sched.schedule(now=1.0)  # one second alone at score 38
    [beside] = make_requests(1, task_type="rag_answer")
    accept(sched, [beside], now=1.0)
    assert sched.schedule(now=1.0).admitted == [beside]
    finish(sched, alone, 2.0)  # another second: admitted onto the idle engine, it taught nothing
    assert alone.compute_score_used == pytest.approx(38.0 + 38.0 / 2)
    assert sched.admission.expected.get("rag_answer") == 10

    nvml.gpu, nvml.memory = 60, 25  # 12 + 5 + 28.8 = 45.8: NVML's sample at 2.0 describes the second before
    sched.schedule(now=2.0)
    finish(sched, beside, 3.0)
    # it ran at 45.8 beside work that ran at 38 when it came: expected 10 -> 10 + 0.5 * (7.8 - 10)
    assert sched.admission.expected.get("rag_answer") == pytest.approx(10 + 0.5 * (45.8 - 38 - 10))
    assert sched.admission.expected.get("chat") == 10

    # two admitted together beside work, on an engine that stays at 45.8, add nothing each
    learnt = sched.admission.expected.get("rag_answer")
    [runner] = make_requests(1, task_type="chat")
    accept(sched, [runner], now=3.0)
    sched.schedule(now=3.0)  # onto the idle engine
    pair = make_requests(2, task_type="rag_answer")
    accept(sched, pair, now=3.5)
    assert sched.schedule(now=3.5).admitted == pair
    for req in pair:
        finish(sched, req, 4.0)
    assert sched.admission.expected.get("rag_answer") == pytest.approx(learnt * 0.5 * 0.5)


def test_a_task_that_joins_one_decode_is_not_taught_the_decodes_score_and_the_next_is_admitted_beside_it() -> None:
    """The score is a sample cached for ``score_sample_interval_ms`` (100), and the one a request admitted
    beside running work was measured from was that sample: 0 when the engine had been idle before the work
    now running started. A rag answer that joined one decode then taught its type the whole decode's
    busy-ratio score (68 on the sim engine), and admission (score + expected >= ``admission_score_limit``,
    80) held every later answer behind one running decode: ``bench agents --rag-prefill --seed 4`` read
    answer TTFT P95 3.06 s, 0.13 s once the baseline is the running work's own last stretch."""
    engine = FakeEngine()
    sched = make_scheduler(nvml=False, engine=engine, score_sample_interval_ms=100)
    sched.schedule(now=0.0)  # the first sample
    first, second, third = make_requests(3, task_type="rag_answer")
    accept(sched, [first], now=0.5)
    sched.schedule(now=0.5)  # samples the idle half second: score 0
    engine.busy_seconds += 0.05  # busy from here on
    accept(sched, [second], now=0.55)
    assert sched.schedule(now=0.55).admitted == [second]
    assert sched.score == 0.0  # the cached sample still says idle
    engine.busy_seconds += 0.05
    finish(sched, second, 0.6)
    assert sched.admission.expected.get("rag_answer") < sched.admission.expected.initial
    busy = weighted_score(UtilSample(100.0, 0.0, tensor_estimate(100.0), "busy_ratio"),
                          SwitchyardConfig().scheduler.compute_score_weights)
    engine.busy_seconds += 0.1
    accept(sched, [third], now=0.7)
    assert sched.schedule(now=0.7).admitted == [third]  # 68 busy + the expected stays under 80
    assert sched.score == pytest.approx(busy) and busy + sched.admission.expected.initial < 80


def test_a_second_decision_at_the_same_instant_keeps_the_running_works_score() -> None:
    """What an admitted task is measured from is the running work's score over its last charged stretch. A
    decision at the instant of the one before charges a stretch of no length, whose score is the monitor's cached
    sample (still the idle interval before the running work started): it replaced that baseline, and a task
    admitted then taught its type the running decode's whole busy-ratio score, as before the baseline existed."""
    engine = FakeEngine()
    sched = make_scheduler(nvml=False, engine=engine, score_sample_interval_ms=100)
    sched.schedule(now=0.0)  # the first sample
    first, second = make_requests(2, task_type="rag_answer")
    accept(sched, [first], now=0.5)
    sched.schedule(now=0.5)  # samples the idle half second: score 0; the decode starts
    engine.busy_seconds += 0.05
    sched.schedule(now=0.55)  # its first busy stretch is charged
    busy = sched.accounting.running_score
    assert busy > 50 and sched.score == 0.0  # the cached sample still says idle
    accept(sched, [second], now=0.55)
    assert sched.schedule(now=0.55).admitted == [second]  # the same instant: a stretch of no length
    assert sched.accounting.running_score == busy
    engine.busy_seconds += 0.05
    finish(sched, second, 0.6)
    assert sched.admission.expected.get("rag_answer") < sched.admission.expected.initial


def test_compute_score_used_is_the_share_of_the_score() -> None:
    engine = FakeEngine()
    sched = make_scheduler(nvml=FakeNvml(gpu=50, memory=20), engine=engine)  # score 38
    a, b = make_requests(2)
    accept(sched, [a, b], now=0.0)
    sched.schedule(now=0.0)
    a.num_computed_tokens, b.num_computed_tokens = 30, 10
    sched.schedule(now=2.0)
    finish(sched, a, 2.0)
    assert a.compute_score_used == pytest.approx(38.0) and b.compute_score_used == pytest.approx(38.0)
    assert a.memory_peak_bytes == 3000 and b.memory_peak_bytes == 1000


def test_a_request_that_runs_between_two_score_samples_is_charged_the_activity_of_its_own_run() -> None:
    """The score is sampled every ``score_sample_interval_ms`` (100) and describes the interval before its
    sample: a short task admitted onto an idle engine and ended before the next sample was charged the idle
    engine's 0 (4 of 6 identical chat tasks printed "compute score used 0.000"). Each stretch is charged at the
    engine's activity over that stretch itself."""
    engine = FakeEngine()
    sched = make_scheduler(nvml=False, engine=engine)
    sched.schedule(now=0.0)  # the first sample
    [req] = make_requests(1)
    accept(sched, [req], now=0.5)
    sched.schedule(now=0.5)  # samples the idle half second: score 0
    assert sched.score == 0.0 and req.status is RequestStatus.RUNNING
    engine.busy_seconds += 0.03  # busy 30 of the next 40 ms
    finish(sched, req, 0.54)  # before the next sample (0.6)
    busy = weighted_score(UtilSample(75.0, 0.0, tensor_estimate(75.0), "busy_ratio"),
                          SwitchyardConfig().scheduler.compute_score_weights)
    assert req.compute_score_used == pytest.approx(busy * 0.04) and busy > 0


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_a_prefill_only_warm_up_teaches_admission_nothing_of_its_task_types_expected_score(policy) -> None:
    """A rag_answer task's warm-up (``prefill_only``: its static prompt part, one token) is a burst of prefill,
    no answer of its type. It was learnt as one: a warm-up alone on an idle engine taught rag_answer an expected
    score near the prefill's, and admission then held the answers back behind one running decode (score + the
    expected >= admission_score_limit): ``bench agents --rag-prefill --seed 11`` read answer TTFT P95 2.13 s
    with the warm-ups against 0.63 s without. The warm-up's own score is still charged (compute_score_used)."""
    engine = FakeEngine()
    sched = make_scheduler(nvml=False, engine=engine, policy=policy)
    sched.schedule(now=0.0)  # the first sample
    initial = sched.admission.expected.get("rag_answer")
    [decode] = make_requests(1, task_type="chat", max_tokens=1000)
    accept(sched, [decode], now=0.4)
    sched.schedule(now=0.4)  # one decode runs: what the warm-up and the answer join
    engine.busy_seconds += 0.1
    [warm] = make_requests(1, task_type="rag_answer", max_tokens=1, prefill_only=True)
    accept(sched, [warm], now=0.5)
    sched.schedule(now=0.5)
    assert warm.status is RequestStatus.RUNNING
    engine.busy_seconds += 0.04  # busy the whole 40 ms it ran
    finish(sched, warm, 0.54)
    assert warm.compute_score_used > 0
    assert sched.admission.expected.get("rag_answer") == initial
    engine.busy_seconds += 0.46
    [answer] = make_requests(1, task_type="rag_answer")
    accept(sched, [answer], now=1.0)
    sched.schedule(now=1.0)
    engine.busy_seconds += 0.04
    finish(sched, answer, 1.04)
    assert sched.admission.expected.get("rag_answer") != initial  # an answer is learnt


# --------------------------------------------------------------------------- compute score and NVML


def test_compute_score_formula_with_tensor_estimate() -> None:
    weights = SwitchyardConfig().scheduler.compute_score_weights
    assert tensor_estimate(50) == 40 and tensor_estimate(30) == 0
    assert weighted_score(UtilSample(50, 20, 40, "nvml"), weights) == pytest.approx(0.2 * 50 + 0.2 * 20 + 0.6 * 40)


def test_nvml_read_error_falls_back_to_busy_ratio_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml(gpu=60, memory=40)
    engine = FakeEngine()
    sched = make_scheduler(nvml=nvml, engine=engine)
    accept(sched, make_requests(2), now=0.0)
    sched.schedule(now=0.0)
    publish(sched)
    assert sched.monitor.gpu_available is True and metric("switchyard_gpu_available") == 1
    publish(sched)
    assert metric("switchyard_gpu_utilization_ratio") == pytest.approx(0.6)

    nvml.fail_read = True
    with caplog.at_level(logging.WARNING):
        for step in range(1, 5):
            engine.busy_seconds += 0.5  # busy half of each second
            sched.schedule(now=float(step))
    publish(sched)
    assert sched.monitor.gpu_available is False and metric("switchyard_gpu_available") == 0
    assert sched.monitor.sample.source == "busy_ratio"
    # busy ratio 0.5 stands in for GPU utilisation: 0.2*50 + 0.6*(0.8*50)
    assert sched.score == pytest.approx(34.0)
    publish(sched)
    assert metric("switchyard_compute_score") == pytest.approx(34.0)
    fallbacks = [r for r in caplog.records if "the compute score comes from the engine: its busy ratio" in r.getMessage()]
    assert len(fallbacks) == 1 and "GPU is lost" in fallbacks[0].getMessage()
    assert nvml.reads == 2, "NVML is not read again after an error"


def test_nvml_init_error_and_missing_nvml_never_raise() -> None:
    nvml = FakeNvml()
    nvml.fail_init = True
    sched = make_scheduler(nvml=nvml)
    accept(sched, make_requests(1), now=0.0)
    assert len(sched.schedule(now=0.0).admitted) == 1
    assert sched.monitor.gpu_available is False

    no_gpu = ComputeScoreMonitor(SwitchyardConfig().scheduler, nvml=False)
    assert no_gpu.read(0.0) == 0.0 and no_gpu.gpu_available is False


# --------------------------------------------------------------------------- preemption


def _streamed(req: Request) -> list[StreamToken]:
    items = req.output.drain()
    assert isinstance(items[-1], StreamDone)
    return [item for item in items if isinstance(item, StreamToken)]


async def test_core_preempts_batch_after_grace_and_batch_resumes_without_losing_tokens() -> None:
    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(engine=engine, running=1, core_wait_before_preempt_ms=50)
    [batch] = make_requests(1, BATCH, arrival=0.0, max_tokens=12)
    accept(sched, [batch], now=0.0)
    out = sched.schedule(now=0.0)
    await step(sched, engine, prefill=out.admitted, now=0.0)
    for _ in range(4):
        await step(sched, engine, decode=[batch], now=0.05)
    streamed_before = len(batch.output_tokens)
    assert streamed_before == 5

    [core] = make_requests(1, CORE, arrival=0.10, max_tokens=3)
    accept(sched, [core], now=0.10)
    out = sched.schedule(now=0.12)  # waited 20 ms < grace
    assert out.preempted == [] and out.admitted == []
    publish(sched)
    before = metric("switchyard_preemptions_total", priority_class="batch")
    out = sched.schedule(now=0.16)  # waited 60 ms >= grace
    assert out.preempted == [batch] and out.admitted == [core] and out.running == [core]
    publish(sched)
    assert metric("switchyard_preemptions_total", priority_class="batch") == before + 1
    assert batch.preemptions == 1 and batch.num_computed_tokens == 0  # the scheduler dropped its KV
    assert sched.waiting == [batch]

    await step(sched, engine, prefill=[core], now=0.17)
    while not core.is_finished:  # the scheduler's stop check ends it (max_tokens)
        await step(sched, engine, decode=[core], now=0.18)
    publish(sched)
    resumes = metric("switchyard_resumes_total", resume="preempted")
    out = sched.schedule(now=0.2)
    assert out.admitted == [batch]
    publish(sched)
    assert metric("switchyard_resumes_total", resume="preempted") == resumes + 1
    await step(sched, engine, prefill=[batch], now=0.2)
    while not batch.is_finished:
        await step(sched, engine, decode=[batch], now=0.3)

    tokens = _streamed(batch)
    assert [t.index for t in tokens] == list(range(12)), "a token was lost or repeated"
    assert "".join(t.text for t in tokens) == "".join(batch.output_tokens)
    assert batch.preemptions == 1
    # the whole prefix is recomputed (less the newest token, whose KV state the next step computes)
    prefix = batch.prompt_tokens + streamed_before
    assert prefix - 1 <= batch.recomputed_tokens <= prefix


def test_preempted_task_keeps_its_place_ahead_of_newer_work_of_its_class() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=1, core_wait_before_preempt_ms=0)
    [old] = make_requests(1, BATCH, arrival=0.0)
    accept(sched, [old], now=0.0)
    sched.schedule(now=0.0)
    newer = make_requests(2, BATCH, arrival=0.5, spacing=0.1)
    accept(sched, newer, now=0.7)
    [core] = make_requests(1, CORE, arrival=1.0)
    accept(sched, [core], now=1.0)
    out = sched.schedule(now=1.0)
    assert out.preempted == [old]
    assert ids(sched.waiting) == ids([old, *newer])


def test_victim_is_the_lowest_priority_running_task_and_core_never_preempts_core() -> None:
    sched = make_scheduler(running=3, core_wait_before_preempt_ms=0)
    core_running = make_requests(1, CORE, arrival=0.0)
    normal = make_requests(1, NORMAL, arrival=0.0)
    batch = make_requests(1, BATCH, arrival=0.0)
    accept(sched, core_running + normal + batch, now=0.0)
    sched.schedule(now=0.0)
    waiting_core = make_requests(3, CORE, arrival=1.0)
    accept(sched, waiting_core, now=1.0)
    out = sched.schedule(now=1.0)
    assert out.preempted == batch + normal
    assert ids(out.admitted) == ids(waiting_core[:2])
    assert sched.waiting[0] is waiting_core[2]
    assert sched.schedule(now=2.0).preempted == []


def test_a_request_buffered_while_admit_core_expires_others_keeps_its_queue_timeout() -> None:
    """``queues.inference.timeout_ms`` is enforced from the earliest expiry of every never-admitted request, the
    double buffer's included. admit_core (a core arrival mid-step) expired what was due and computed the next
    expiry over the waiting set alone: a request still buffered then was forgotten, and timed out only at a later
    request's expiry (here 0.1 s past its own)."""
    config = SwitchyardConfig().with_overrides(**{"queues.inference.timeout_ms": 1000,
                                                  "scheduler.core_wait_before_preempt_ms": 60_000,
                                                  "scheduler.score_sample_interval_ms": 1})
    engine = FakeEngine()
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: 0.0, nvml=FakeNvml())
    sched = build_scheduler(config, engine, monitor=monitor, capacity=FixedSlots(1))
    [running] = make_requests(1, BATCH, arrival=0.0)
    accept(sched, [running], now=0.0)
    assert sched.schedule(now=0.0).admitted == [running]
    [old] = make_requests(1, NORMAL, arrival=0.1)
    accept(sched, [old], now=0.1)
    assert sched.schedule(now=0.1).admitted == []  # the one slot is taken: it waits, due at 1.1
    [buffered] = make_requests(1, NORMAL, arrival=1.0)
    sched.add_request(buffered, now=1.0)  # arrives during a step: buffered, due at 2.0
    [core] = make_requests(1, CORE, arrival=1.2)
    sched.add_request(core, now=1.2)
    out = sched.admit_core(now=1.2)  # mid-step: the core request may not preempt yet; the old one is due
    assert out.admitted == [] and old.is_finished and buffered.status is RequestStatus.BUFFERED
    out = sched.schedule(now=2.1)  # the buffered request has waited 1.1 s of its 1.0
    assert buffered in out.expired and buffered.is_finished
    assert "queues.inference.timeout_ms" in str(buffered.error)


def test_the_inference_queue_wait_is_observed_for_requests_that_expire_or_leave_while_waiting() -> None:
    """switchyard_queue_wait_seconds{queue="inference"} was observed at admission only: a request whose
    queues.inference.timeout_ms or own deadline passed in the queue, the waits of an overload, was left out, and
    the quantiles read low exactly then. Each wait is observed once, under its outcome."""
    config = SwitchyardConfig().with_overrides(**{"queues.inference.timeout_ms": 1000,
                                                  "scheduler.core_wait_before_preempt_ms": 60_000,
                                                  "scheduler.score_sample_interval_ms": 1})
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: 0.0, nvml=FakeNvml())
    sched = build_scheduler(config, FakeEngine(), monitor=monitor, capacity=FixedSlots(1))

    def counts() -> dict[str, float]:
        return {outcome: metric("switchyard_queue_wait_seconds_count", queue="inference", outcome=outcome)
                for outcome in ("admitted", "expired", "cancelled")}

    def waited(outcome: str) -> float:
        return metric("switchyard_queue_wait_seconds_sum", queue="inference", outcome=outcome)

    before, sums = counts(), {outcome: waited(outcome) for outcome in ("admitted", "expired", "cancelled")}
    [running] = make_requests(1, BATCH, arrival=0.0)
    accept(sched, [running], now=0.0)
    assert sched.schedule(now=0.0).admitted == [running]
    [timed_out, left] = make_requests(2, NORMAL, arrival=0.1)
    [past_deadline] = make_requests(1, NORMAL, arrival=0.1, deadline=0.6)
    accept(sched, [timed_out, left, past_deadline], now=0.1)
    sched.finish_requests([left], RequestStatus.FINISHED_ABORTED, now=0.4)  # its caller went while it waited
    out = sched.schedule(now=1.2)  # the deadline (0.6) and the queue's 1 s (1.1) have passed
    assert {timed_out, past_deadline} <= set(out.expired)
    publish(sched)
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"admitted": 1, "expired": 2, "cancelled": 1}
    assert waited("expired") - sums["expired"] == pytest.approx(1.1 + 1.1)  # each its whole wait, to 1.2
    assert waited("cancelled") - sums["cancelled"] == pytest.approx(0.3)
    sched.finish_requests([running], RequestStatus.FINISHED_ABORTED, now=1.3)  # it had been admitted: no wait
    publish(sched)
    assert counts() == after


def test_a_full_admission_wave_preempts_nothing_at_a_decision_or_mid_step() -> None:
    """The wave (``max_admitted_per_decision``) bounds what one decision admits; preempting frees no room in it.
    A core request the wave left waiting waits for the next decision: it took a batch request's place, and the
    decision admitted one past its wave (at a step boundary and mid-step alike)."""
    for mid_step in (False, True):
        sched = make_scheduler(max_admitted_per_decision=1, expected_score_initial=0)
        batch = make_requests(3, BATCH)
        for i, req in enumerate(batch):
            accept(sched, [req], now=0.0)
            assert sched.schedule(now=0.001 * (i + 1)).admitted == [req]
        cores = make_requests(2, CORE, arrival=1.0)
        for core in cores:
            sched.add_request(core, now=1.0)
        out = sched.admit_core(now=1.0) if mid_step else sched.schedule(now=1.0)
        assert out.admitted == cores[:1] and out.preempted == [] and sched.preempting == []
        assert sched.running == [*batch, cores[0]] and sched.waiting == cores[1:]
        out = sched.schedule(now=1.1)  # the next decision's wave takes it, still preempting nothing
        assert out.admitted == cores[1:] and out.preempted == [] and sched.preempting == []
        assert all(req.preemptions == 0 for req in batch)


def test_no_preemption_when_disabled_or_under_fifo() -> None:
    disabled = make_scheduler(running=1, preemption_enabled=False)
    fifo = make_scheduler(policy="fifo", running=1)
    for sched in (disabled, fifo):
        accept(sched, make_requests(1, BATCH, arrival=0.0), now=0.0)
        sched.schedule(now=0.0)
        accept(sched, make_requests(1, CORE, arrival=0.0), now=0.0)
        assert sched.schedule(now=10.0).preempted == []


def test_fifo_ignores_classes() -> None:
    sched = make_scheduler(policy="fifo", running=2, nvml=FakeNvml(gpu=100, memory=100))
    batch = make_requests(1, BATCH, arrival=0.0)
    core = make_requests(2, CORE, arrival=1.0)
    accept(sched, core + batch, now=1.0)
    assert ids(sched.schedule(now=1.0).admitted) == ids(batch + core[:1])


# --------------------------------------------------------------------------- core work admitted mid-step


def test_admit_core_takes_core_work_mid_step_and_leaves_the_rest_for_the_step_boundary() -> None:
    from switchyard.dispatcher.double_buffer import FlushReason

    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=3)
    [running] = make_requests(1, BATCH, arrival=0.0)
    accept(sched, [running], now=0.0)
    sched.schedule(now=0.0)
    [late_batch] = make_requests(1, BATCH, arrival=0.01)
    [core] = make_requests(1, CORE, arrival=0.02)
    publish(sched)
    flushes = metric("switchyard_flushes_total", reason="preempt")
    sched.add_request(late_batch, now=0.01)
    sched.add_request(core, now=0.02)

    assert sched.admit_core(now=0.03).admitted == [core]
    assert sched.running == [running, core] and core.status is RequestStatus.RUNNING
    assert core.flush_reason == FlushReason.PREEMPT and core.admitted_at == 0.03
    publish(sched)
    assert metric("switchyard_flushes_total", reason="preempt") == flushes + 1
    assert sched.intake.active_size == 1 and late_batch.status is RequestStatus.BUFFERED  # it joins at the step boundary
    assert engine.released == []  # nothing preempted
    assert sched.admit_core(now=0.04).admitted == []  # nothing more to take

    out = sched.schedule(now=0.05)
    assert out.admitted == [late_batch] and late_batch.flush_reason == FlushReason.STEP
    assert sched.running == [running, core, late_batch]


def test_admit_core_preempts_at_once_and_the_victims_kv_leaves_when_the_step_ends() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=1)  # the default: a core request preempts at once
    [batch] = make_requests(1, BATCH, arrival=0.0, max_tokens=12)
    accept(sched, [batch], now=0.0)
    sched.schedule(now=0.0)
    batch.num_computed_tokens = 20
    publish(sched)
    preempted = metric("switchyard_preemptions_total", priority_class="batch")
    [core] = make_requests(1, CORE, arrival=0.1)
    sched.add_request(core, now=0.1)

    assert sched.admit_core(now=0.1).admitted == [core]  # mid-step: it takes the batch request's place now
    assert sched.running == [core] and batch.status is RequestStatus.PREEMPTING
    assert engine.released == [] and batch.num_computed_tokens == 20  # its KV stays until the step ends
    assert sched.has_work and sched.waiting == []

    out = sched.schedule(now=0.2)  # the step in flight ended: the victim's KV leaves, it waits again
    assert out.preempted == [batch] and engine.released == [batch] and batch.preemptions == 1
    assert batch.num_computed_tokens == 0 and batch.status is RequestStatus.WAITING and sched.waiting == [batch]
    publish(sched)
    assert metric("switchyard_preemptions_total", priority_class="batch") == preempted + 1


def test_a_victim_that_finished_in_the_step_in_flight_ends_and_one_aborted_meanwhile_frees_its_kv() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=2)
    done_batch, gone_batch = make_requests(2, BATCH, arrival=0.0, max_tokens=12)
    accept(sched, [done_batch, gone_batch], now=0.0)
    sched.schedule(now=0.0)
    cores = make_requests(2, CORE, arrival=0.1)
    for core in cores:
        sched.add_request(core, now=0.1)
    assert sched.admit_core(now=0.1).admitted == cores
    assert {done_batch.status, gone_batch.status} == {RequestStatus.PREEMPTING}
    finish(sched, gone_batch, 0.15, RequestStatus.FINISHED_ABORTED)  # its caller went away meanwhile
    # the step in flight ends: its last token came in it
    sched.update_from_output(StepBatch(decode=[done_batch, gone_batch]),
                             StepResult({done_batch.seq_id: SeqOutput(texts=["x"], length_capped=True),
                                         gone_batch.seq_id: SeqOutput(texts=["y"])}), now=0.19)
    assert done_batch.finish_reason == "length" and gone_batch.finish_reason == "cancelled"
    assert gone_batch.is_finished and engine.released == [gone_batch, done_batch]  # freed once each
    out = sched.schedule(now=0.2)
    assert out.preempted == [] and done_batch.is_finished and engine.released == [gone_batch, done_batch]
    assert sched.waiting == [] and sched.running == cores


def test_a_core_request_that_must_wait_before_preempting_waits_for_the_step_boundary() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=1, core_wait_before_preempt_ms=50)
    [batch] = make_requests(1, BATCH, arrival=0.0, max_tokens=12)
    accept(sched, [batch], now=0.0)
    sched.schedule(now=0.0)
    [core] = make_requests(1, CORE, arrival=0.1)
    sched.add_request(core, now=0.1)
    assert sched.admit_core(now=0.1).admitted == []
    assert sched.running == [batch] and sched.waiting == [core] and engine.released == []
    assert sched.schedule(now=0.12).preempted == []  # waited 20 ms of its 50
    out = sched.schedule(now=0.2)
    assert out.preempted == [batch] and out.admitted == [core]


def test_admit_core_keeps_the_policy_order_and_its_kv_budget() -> None:
    per_token = SwitchyardConfig().sim.kv_bytes_per_token
    for policy, admitted in (("fifo", 0), ("priority", 1)):
        engine = FakeEngine()
        info = MemoryInfo(device_bytes=10_000 * per_token, weight_bytes=0, kv_bytes_per_token=per_token)
        capacity = KvBudget(SwitchyardConfig().memory.hbm.model_copy(update={"capacity_ratio": 0.05}), info)
        config = SwitchyardConfig().with_overrides(**{"scheduler.policy": policy})
        sched = build_scheduler(config, engine, capacity=capacity)  # a budget of 500 tokens of KV
        [first] = make_requests(1, BATCH, arrival=0.0, prompt_tokens=100, max_tokens=200)
        accept(sched, [first], now=0.0)
        sched.schedule(now=0.0)
        [big] = make_requests(1, BATCH, arrival=0.1, prompt_tokens=100, max_tokens=200)
        accept(sched, [big], now=0.1)
        sched.schedule(now=0.1)
        assert sched.waiting == [big]  # 300 tokens do not fit beside 300
        [core] = make_requests(1, CORE, arrival=0.2, prompt_tokens=50, max_tokens=50)
        sched.add_request(core, now=0.2)
        # fifo: the batch request waits ahead of it; priority: core work comes first, and 100 tokens fit
        assert len(sched.admit_core(now=0.2).admitted) == admitted, policy
        assert (core.status is RequestStatus.RUNNING) == bool(admitted)
        assert capacity.reserved_bytes == (300 + 100 * admitted) * per_token
        [huge] = make_requests(1, CORE, arrival=0.3, prompt_tokens=100, max_tokens=100)
        sched.add_request(huge, now=0.3)
        if policy == "fifo":  # still behind the batch request: it preempts nothing
            assert sched.admit_core(now=0.3).admitted == []
            assert huge.status is RequestStatus.WAITING and engine.released == []
            continue
        # priority: 200 tokens do not fit beside 400. The running batch request's live KV stays held until
        # the step in flight ends, so preempting it frees only its reserved-but-unused tokens: with 250 of
        # its 300 computed, 100 free + 50 is not enough, and nothing is preempted
        engine.kv.per_token = per_token
        first.num_computed_tokens = 250
        assert sched.admit_core(now=0.3).admitted == [] and first.status is RequestStatus.RUNNING and huge.status is RequestStatus.WAITING
        first.num_computed_tokens = 50  # 100 free + 250 unused: it fits at once
        assert sched.admit_core(now=0.3).admitted == [huge]
        assert first.status is RequestStatus.PREEMPTING and engine.released == []
        assert capacity.reserved_bytes == 300 * per_token and capacity.leaving_bytes == 50 * per_token
        out = sched.schedule(now=0.4)  # the step ended: its KV is dropped (no DRAM tier), it waits again
        assert out.preempted == [first] and engine.released == [first] and capacity.leaving_bytes == 0
        assert ids(sched.waiting) == ids([first, big])


# --------------------------------------------------------------------------- tool-waiting agents


def _react(agent_id: str, arrival: float, *, resume: bool = False, prompt_tokens: int = 40) -> Request:
    [req] = make_requests(
        1, NORMAL, arrival=arrival, task_type="react_loop", prompt_tokens=prompt_tokens,
        agent_id=agent_id, resume=resume,
    )
    return req


def test_agent_waiting_on_a_tool_holds_no_slot_and_resumes_ahead_of_new_work() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=1, tool_wait_ttl_s=5)
    think = _react("agent-1", arrival=0.0)
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    think.num_computed_tokens = 50  # prompt 40 + 10 generated tool-call tokens
    finish(sched, think, 0.5, RequestStatus.FINISHED_TOOL_CALLS)
    assert should_park(think) and think.status is RequestStatus.PARKED
    assert sched.running == [] and sched.parked == [think]
    assert sched.parked_kv_bytes == 5000 and metric("switchyard_parked_kv_bytes") == 5000
    assert engine.released == []

    new_work = make_requests(2, NORMAL, arrival=0.6, spacing=0.1)
    accept(sched, new_work, now=0.8)
    observe = _react("agent-1", arrival=1.0, resume=True, prompt_tokens=70)
    accept(sched, [observe], now=1.0)
    assert sched.waiting[0] is observe
    assert engine.released == [], "the prefix state is kept until the resumed step runs"
    out = sched.schedule(now=1.0)
    assert out.admitted == [observe]
    assert observe.num_computed_tokens == 50 and observe.num_uncomputed_tokens == 20 and observe.needs_prefill
    assert observe.recomputed_tokens == 0
    assert engine.released == [think] and sched.parked == [] and sched.parked_kv_bytes == 0


def test_parked_prefix_state_is_released_when_the_ttl_runs_out() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, tool_wait_ttl_s=2)
    think = _react("agent-2", arrival=0.0)
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    think.num_computed_tokens = 50
    finish(sched, think, 1.0, RequestStatus.FINISHED_TOOL_CALLS)
    sched.schedule(now=2.9)
    assert sched.parked == [think]
    publish(sched)
    expired = metric("switchyard_tool_wait_expired_total")
    sched.schedule(now=3.1)
    assert sched.parked == [] and sched.parked_kv_bytes == 0 and engine.released == [think]
    publish(sched)
    assert metric("switchyard_tool_wait_expired_total") == expired + 1

    observe = _react("agent-2", arrival=4.0, resume=True, prompt_tokens=70)
    accept(sched, [observe], now=4.0)
    assert observe.num_computed_tokens == 0 and observe.recomputed_tokens == 50


def test_every_way_out_of_the_parking_remembers_the_prefix_within_one_bound(monkeypatch) -> None:
    # a parked state leaves HBM at its TTL, to make room, or by its tool-wait decision: each way its next step
    # finds the prefix it left (tokens, and whether DRAM holds it), and the memory of them keeps one bound
    from switchyard.dispatcher.scheduler import parking

    monkeypatch.setattr(parking, "COLD_PREFIX_MEMORY", 2)
    released: list[Request] = []
    lot = parking.ParkedAgents(1.0, released.append, lambda req: 100 * req.num_computed_tokens,
                               demote=lambda req: req.agent_id == "swapped")
    steps = {name: _react(name, arrival=0.0) for name in ("expired", "evicted", "swapped", "dropped")}
    for i, req in enumerate(steps.values()):
        req.num_computed_tokens = 10 + i
        lot.park(req, now=0.0)
    lot.expire(now=0.5)
    assert released == []
    lot.expire(now=1.5)  # every TTL ran out: all four leave through the TTL's way
    assert released == list(steps.values())
    for req in steps.values():
        lot.park(req, now=2.0)
    assert lot.evict_lowest(lambda entry: entry.req.num_computed_tokens) is steps["expired"]
    assert lot.move_out(steps["swapped"].program_key, demote=True)
    assert not lot.move_out(steps["dropped"].program_key, demote=False)
    lost = lot.take(steps["expired"].program_key, 2.5, _react("expired", arrival=2.5, resume=True))
    assert (lost.warm, lost.prefix_tokens) == (False, 0)  # the oldest of three remembered: forgotten
    found = lot.take(steps["swapped"].program_key, 2.5, _react("swapped", arrival=2.5, resume=True))
    assert (found.warm, found.prefix_tokens, found.in_dram) == (False, 12, True)
    found = lot.take(steps["dropped"].program_key, 2.5, _react("dropped", arrival=2.5, resume=True))
    assert (found.warm, found.prefix_tokens, found.in_dram) == (False, 13, False)
    assert lot.counters.tool_wait_expired == 4 and lot.counters.parked_evicted == 1


def test_finished_or_cancelled_work_leaves_every_set() -> None:
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, running=1)
    a, b = make_requests(2)
    accept(sched, [a, b], now=0.0)
    sched.schedule(now=0.0)
    finish(sched, b, 0.1, RequestStatus.FINISHED_ABORTED)  # cancelled while waiting
    finish(sched, a, 0.2)
    finish(sched, a, 0.3, RequestStatus.FINISHED_ABORTED)  # idempotent: it keeps its end
    assert (a.finish_reason, b.finish_reason) == ("stop", "cancelled")
    assert (sched.waiting, sched.running, sched.parked) == ([], [], [])
    parked = _react("agent-3", arrival=0.0)
    accept(sched, [parked], now=0.3)
    sched.schedule(now=0.3)
    finish(sched, parked, 0.4, RequestStatus.FINISHED_TOOL_CALLS)  # parked: its agent waits on a tool
    assert parked.finish_reason == "tool_calls" and sched.parked == [parked]
    finish(sched, parked, 0.5, RequestStatus.FINISHED_ABORTED)  # finished for its caller: no id to end
    assert (sched.waiting, sched.running, sched.parked) == ([], [], [parked])
    assert engine.released == [a]  # KV released once, by the scheduler; the parked prefix stays warm


async def test_nvml_is_shut_down_when_the_dispatcher_drains() -> None:
    from switchyard.dispatcher.engine_loop import StepLoop

    nvml = FakeNvml(gpu=10)
    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(nvml=nvml, engine=engine)
    sched.schedule(now=0.0)  # the first decision opens NVML
    loop = StepLoop(SwitchyardConfig(), engine, sched)
    loop.start()
    await loop.drain()
    assert getattr(nvml, "shutdowns", 0) == 1


async def test_compute_score_is_refreshed_while_the_engine_idles() -> None:
    import asyncio

    from switchyard.dispatcher.engine_loop import StepLoop

    nvml = FakeNvml(gpu=90, memory=90)
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 10})
    engine = SimEngine(config)
    sched = make_scheduler(nvml=nvml, engine=engine, score_sample_interval_ms=10)
    sched.schedule(now=0.0)
    loop = StepLoop(config, engine, sched)
    loop.start()
    # read once the loop publishes its scheduler's monitor: before, the process-wide gauge showed whatever an
    # earlier test's loop or report left there (0 when this test ran alone, and the gauge could not fall below it)
    busy = metric("switchyard_compute_score")
    assert busy > 0  # the busy GPU's score, this scheduler's own
    nvml.gpu = nvml.memory = 0  # the GPU went idle; nothing is scheduled
    for _ in range(100):
        await asyncio.sleep(0.01)
        if metric("switchyard_compute_score") < busy:
            break
    await loop.drain()
    assert metric("switchyard_compute_score") < busy  # the gauge followed without any request


async def test_parked_agents_give_their_kv_back_when_the_ttl_runs_out_on_an_idle_engine() -> None:
    import asyncio

    from switchyard.dispatcher.engine_loop import StepLoop

    config = SwitchyardConfig().with_overrides(**{"scheduler.tool_wait_ttl_s": 0.05,
                                                  "scheduler.score_sample_interval_ms": 10})
    engine = FakeEngine()
    sched = make_scheduler(engine=engine, tool_wait_ttl_s=0.05, score_sample_interval_ms=10)
    import time as _time

    now = _time.monotonic()
    think = _react("agent-idle", arrival=now)
    accept(sched, [think], now=now)
    sched.schedule(now=now)
    think.num_computed_tokens = 50
    finish(sched, think, now, RequestStatus.FINISHED_TOOL_CALLS)
    assert sched.parked == [think]
    loop = StepLoop(config, engine, sched)
    loop.start()  # no request arrives from here on
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not sched.parked:
            break
    await loop.drain()
    assert sched.parked == [] and engine.released == [think]


async def test_requests_that_reuse_a_callers_request_id_are_each_served() -> None:
    """A caller may send the same request_id twice at once (the reference load does): the scheduler and the
    engine key requests by their seq_id, so each gets its own tokens and end."""
    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(engine=engine, running=2)
    first, second = (Request(request_id="bench-001:0", prompt="How does the with statement work?",
                             prompt_tokens=16, max_tokens=3) for _ in range(2))
    assert first.seq_id != second.seq_id
    accept(sched, [first, second], now=0.0)
    assert sched.schedule(now=0.0).admitted == [first, second]
    await step(sched, engine, prefill=[first, second], now=0.1)
    while not (first.is_finished and second.is_finished):
        await step(sched, engine, decode=[r for r in (first, second) if not r.is_finished], now=0.2)
    for req in (first, second):
        assert req.finish_reason == "length" and len(_streamed(req)) == 3


@pytest.mark.parametrize("reason, status", [
    ("stop", RequestStatus.FINISHED_STOPPED), ("length", RequestStatus.FINISHED_LENGTH_CAPPED),
    ("tool_calls", RequestStatus.FINISHED_TOOL_CALLS), ("content_filter", RequestStatus.FINISHED_CONTENT_FILTERED),
])
def test_an_upstreams_finish_reason_is_normalised_in_one_place(reason, status):
    """The gateway reads a server's word as one of OpenAI's (``decode.FINISH_REASONS``; an answer that did not
    finish, such as vLLM's abort, is an error there); RequestStatus.finished_with maps those four to statuses."""
    assert RequestStatus.finished_with(reason) is status


@pytest.mark.parametrize("word", ["function_call", "eos_token", "abort", "", "STOP"])
def test_a_finish_reason_the_gateway_did_not_read_is_an_error_not_a_stop(word):
    """Words other than OpenAI's four read as stop: an engine that skipped the gateway's one table
    (function_call was mapped in a second one) would have ended answers as finished that were not."""
    with pytest.raises(ValueError, match="finish_reason: expected one of"):
        RequestStatus.finished_with(word)


def test_the_waiting_gauges_agree_buffered_requests_counted_by_class_too() -> None:
    """switchyard_waiting_sequences counted buffered requests and switchyard_waiting_agents did not: three
    requests in the double buffer read 3 in total and 0 in every class."""
    sched = make_scheduler(running=1)
    core, batch = make_requests(1, CORE), make_requests(2, BATCH)
    for req in (*core, *batch):
        sched.add_request(req, 0.0)
    stats = sched.make_stats()
    assert stats.num_waiting == 3 and stats.waiting == {"core": 1, "normal": 0, "batch": 2}
    sched.flush(FlushReason.STEP, 0.0)
    stats = sched.make_stats()
    assert stats.num_waiting == 3 and stats.waiting == {"core": 1, "normal": 0, "batch": 2}


def test_the_kv_budget_follows_a_capacity_replaced_after_the_scheduler_was_built() -> None:
    """A bench replaces capacity with fixed slots after building the scheduler (bench compare's no-batching run):
    a budget kept from construction went on pricing tool waits and holding restores against bytes no longer
    counted."""
    config = SwitchyardConfig()
    sched = build_scheduler(config, SimEngine(config))
    assert isinstance(sched.kv_budget, KvBudget)
    sched.capacity = FixedSlots(4)
    assert sched.kv_budget is None
