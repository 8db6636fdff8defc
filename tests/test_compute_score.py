"""Compute score sources: NVML with GPM tensor activity, and the sim engine's modelled utilisation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard.dispatcher.engines.sim import SimEngine, decode_seconds, prefill_seconds
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.request import Request

pytestmark = pytest.mark.no_gpu


class FakeGpmNvml:
    """pynvml stand-in with GPM: utilisation and tensor activity set by the test."""

    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5

    class NVMLError(Exception):
        pass

    def __init__(self, gpu: float, memory: float, tensor: float, supported: bool = True) -> None:
        self.gpu, self.memory, self.tensor, self.supported = gpu, memory, tensor, supported
        self.samples_taken = 0
        self.freed = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.gpu, memory=self.memory)

    def nvmlGpmQueryDeviceSupport(self, handle):
        return SimpleNamespace(isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self):
        return object()

    def nvmlGpmSampleFree(self, sample):
        self.freed += 1

    def nvmlGpmSampleGet(self, handle, sample):
        self.samples_taken += 1

    def c_nvmlGpmMetricsGet_t(self):
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, value=0.0)])

    def nvmlGpmMetricsGet(self, request):
        assert request.sample1 is not request.sample2
        assert request.metrics[0].metricId == self.NVML_GPM_METRIC_ANY_TENSOR_UTIL
        request.metrics[0].value = self.tensor


def monitor(nvml, engine=None) -> ComputeScoreMonitor:
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1})
    return ComputeScoreMonitor(config.scheduler, nvml=nvml, engine=engine)


def test_gpm_tensor_activity_replaces_the_estimate_once_two_samples_exist():
    nvml = FakeGpmNvml(gpu=90, memory=70, tensor=12)
    m = monitor(nvml)
    first = m.read(0.0)
    assert m.sample.source == "nvml"  # one GPM sample so far: the field report's estimate, 0.8 x 90
    assert first == pytest.approx(0.2 * 90 + 0.2 * 70 + 0.6 * 72)
    second = m.read(1.0)
    assert m.sample.source == "nvml_gpm" and m.sample.tensor_util == 12
    assert second == pytest.approx(0.2 * 90 + 0.2 * 70 + 0.6 * 12)
    assert m.gpu_available is True
    m.close()
    assert nvml.freed == 2


def test_gpu_without_gpm_keeps_the_estimate():
    m = monitor(FakeGpmNvml(gpu=50, memory=10, tensor=99, supported=False))
    m.read(0.0)
    m.read(1.0)
    assert m.sample.source == "nvml" and m.sample.tensor_util == pytest.approx(40)


def _decoding(n: int, context: int) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(f"d{i}", prompt="x", prompt_tokens=context, max_tokens=10_000)
        req.output_tokens.append("x")
        req.num_computed_tokens = context
        reqs.append(req)
    return reqs


async def test_sim_decode_is_memory_bound_so_the_score_leaves_room_to_admit():
    config = SwitchyardConfig()
    engine = SimEngine(config)
    m = monitor(False, engine)
    m.read(0.0)
    reqs = _decoding(10, context=1000)
    for _ in range(5):
        await EngineDriver(engine).decode(reqs)
    m.read(engine.busy_seconds)  # a window exactly as long as the engine was busy
    sample = m.sample
    assert sample.source == "engine_model" and sample.cuda_util == pytest.approx(100)
    assert 70 < sample.bandwidth_util <= 100  # weights and KV stream from HBM every step
    assert sample.tensor_util < 5  # 2 x 7e9 x 10 FLOPs per 5.7 ms step: ~2.5 % of the tensor peak
    assert m.score < config.scheduler.admission_score_limit - 20
    assert engine.busy_seconds == pytest.approx(5 * decode_seconds(config.sim, 10))


async def test_sim_prefill_is_compute_bound():
    config = SwitchyardConfig()
    engine = SimEngine(config)
    m = monitor(False, engine)
    m.read(0.0)
    reqs = [Request(f"p{i}", prompt="x", prompt_tokens=4000, max_tokens=4) for i in range(4)]
    await EngineDriver(engine).prefill(reqs)
    m.read(engine.busy_seconds)
    assert engine.busy_seconds == pytest.approx(prefill_seconds(config.sim, 16000))
    assert m.sample.tensor_util > 50  # ~0.025 ms per token is ~57 % of the H100's dense BF16 peak
    assert m.sample.bandwidth_util < m.sample.tensor_util


async def test_busy_ratio_only_when_configured():
    config = SwitchyardConfig().with_overrides(**{
        "scheduler.score_sample_interval_ms": 1, "scheduler.score_without_nvml": "busy_ratio"})
    engine = SimEngine(config)
    m = ComputeScoreMonitor(config.scheduler, nvml=False, engine=engine)
    m.read(0.0)
    await EngineDriver(engine).decode(_decoding(2, context=10))
    m.read(engine.busy_seconds)
    assert m.sample.source == "busy_ratio" and m.sample.cuda_util == pytest.approx(100)
    assert m.sample.bandwidth_util == 0 and m.sample.tensor_util == pytest.approx(80)  # the field report's estimate


def test_gauge_is_read_at_scrape_time_not_when_the_scheduler_last_ran():
    """No scheduler runs here: each collection of the gauge samples NVML itself."""
    from prometheus_client import REGISTRY

    from switchyard.dispatcher.metrics import publish_compute_score_at_scrape

    nvml = FakeGpmNvml(gpu=90, memory=70, tensor=0, supported=False)
    m = monitor(nvml)
    publish_compute_score_at_scrape(m)  # what the step loop does when it starts
    try:
        busy = REGISTRY.get_sample_value("switchyard_compute_score")
        assert busy == pytest.approx(0.2 * 90 + 0.2 * 70 + 0.6 * 72)
        nvml.gpu, nvml.memory = 0, 0  # the GPU goes idle; nothing calls read()
        m._next_read = float("-inf")  # as if score_sample_interval_ms had passed since the last scrape
        assert REGISTRY.get_sample_value("switchyard_compute_score") == 0
        nvml.gpu = 50
        # within one sample interval a scrape gets the cached sample, not a new NVML read
        m._next_read = float("inf")
        assert REGISTRY.get_sample_value("switchyard_compute_score") == 0
    finally:
        m.close()
    nvml.gpu = 100
    m._next_read = float("-inf")
    assert REGISTRY.get_sample_value("switchyard_compute_score") == 0, "a closed monitor is no longer read"


def test_a_monitor_told_to_skip_nvml_says_so_at_info_and_a_failing_nvml_warns(caplog):
    """A stream engine's dispatcher (and the benches) build the monitor without NVML on purpose: its GPU is its model
    server's. That was logged as a WARNING, 'GPU utilisation not readable (NVML not used (no GPU expected))', at
    every openai dispatcher's first decision; an NVML that fails is what deserves one."""
    import logging

    config = SwitchyardConfig().scheduler
    with caplog.at_level(logging.INFO, logger="switchyard.dispatcher.scheduler.compute_score"):
        skipped = ComputeScoreMonitor(config, nvml=False)
        skipped.read(1.0)
    assert skipped.gpu_available is False
    [record] = caplog.records
    assert record.levelno == logging.INFO and "NVML not used" in record.getMessage()

    class FailingNvml(FakeGpmNvml):
        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="switchyard.dispatcher.scheduler.compute_score"):
        failing = ComputeScoreMonitor(config, nvml=FailingNvml(0, 0, 0))
        failing.read(1.0)
    assert failing.gpu_available is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "Driver Not Loaded" in caplog.records[0].getMessage()
