"""The compute score: how loaded the GPU is, 0-100, for admission.

Rule (``scheduler_config.json``, from the field reports in docs/architecture.md)::

    score = w_cuda * cuda_util + w_bandwidth * bandwidth_util + w_tensor * tensor_util

with every utilisation in percent (0-100), so the score is on the same 0-100
scale as ``admission_score_limit``.

- ``cuda_util``: NVML GPU utilisation (percent of the sample period a kernel ran),
  ``nvmlDeviceGetUtilizationRates().gpu``.
- ``bandwidth_util``: NVML memory utilisation (percent of the period device
  memory was read or written), ``nvmlDeviceGetUtilizationRates().memory``.
- ``tensor_util``: tensor-core activity, read through NVML's GPU Performance
  Monitoring (GPM) metric ``NVML_GPM_METRIC_ANY_TENSOR_UTIL`` on GPUs that
  support it (Hopper and newer); elsewhere it is not readable through NVML
  (only through DCGM profiling), so it is estimated by the field report's rule (docs/architecture.md):
  ``0.8 * cuda_util`` when ``cuda_util > 30``, else 0.

Without a GPU or without NVML (no driver, no pynvml, or any NVML error), the
engine stands in for the GPU. An engine that models its own activity (the
``sim`` engine: ``memory_busy_seconds`` and ``tensor_busy_seconds`` beside
``busy_seconds``, from a roofline model of the GPU it simulates) gives all
three readings (``score_without_nvml: engine_model``, the default; ``busy_ratio``
uses the busy ratio alone); any other engine gives only its busy ratio for ``cuda_util``,
bandwidth then counts 0 and the tensor estimate applies. The monitor says so
once in the log (a WARNING when NVML failed, INFO when it was built without
NVML, as the monitor of an engine that does not compute on this host's GPU is:
the sim engine, whose GPU is its model's, a stream engine, whose GPU is its
model server's, and the torch engine on the CPU; ``runs_on_host_gpu``) and reports ``gpu_available`` False (``switchyard_gpu_available``
0). An NVML error never propagates: the monitor switches to the fallback for good.

The monitor records no metric: the engine loop publishes its readings
(:func:`switchyard.dispatcher.metrics.publish_stats`), and makes the gauge
``switchyard_compute_score`` call :meth:`ComputeScoreMonitor.scrape` at scrape
time (:func:`switchyard.dispatcher.metrics.publish_compute_score_at_scrape`):
each scrape re-samples (at most every ``score_sample_interval_ms``), so an
autoscaler reading it sees the load of the last sample interval, not the load
of the scheduler's last decision.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from switchyard.common.config import ComputeScoreWeights, SchedulerConfig

log = logging.getLogger(__name__)

TENSOR_ESTIMATE_FACTOR = 0.8
"""tensor_util = 0.8 x cuda_util above :data:`TENSOR_ESTIMATE_MIN_UTIL` (docs/architecture.md)."""
TENSOR_ESTIMATE_MIN_UTIL = 30.0


class NvmlUnavailable(Exception):
    """NVML cannot be loaded or read (no driver, no GPU, or an NVML error)."""


@dataclass(frozen=True)
class UtilSample:
    """One utilisation reading, each field in percent (0-100).

    ``source`` is ``"nvml"`` or ``"busy_ratio"`` (the fallback).
    """

    cuda_util: float
    bandwidth_util: float
    tensor_util: float
    source: str


def tensor_estimate(cuda_util: float) -> float:
    """Estimated tensor-core activity (percent) from GPU utilisation (percent), per the field report's rule (docs/architecture.md)."""
    return TENSOR_ESTIMATE_FACTOR * cuda_util if cuda_util > TENSOR_ESTIMATE_MIN_UTIL else 0.0


def sample_from(cuda_util: float, bandwidth_util: float, source: str) -> UtilSample:
    """A :class:`UtilSample` with both inputs clamped to 0-100 and tensor_util estimated."""
    cuda = min(100.0, max(0.0, float(cuda_util)))
    bandwidth = min(100.0, max(0.0, float(bandwidth_util)))
    return UtilSample(cuda, bandwidth, tensor_estimate(cuda), source)


def weighted_score(sample: UtilSample, weights: ComputeScoreWeights) -> float:
    """The compute score (0-100) of ``sample`` under ``weights`` (which sum to 1)."""
    score = (
        weights.cuda_util * sample.cuda_util
        + weights.bandwidth_util * sample.bandwidth_util
        + weights.tensor_util * sample.tensor_util
    )
    return min(100.0, max(0.0, score))


class NvmlReader:
    """Reads GPU and memory utilisation of one device through pynvml (nvidia-ml-py).

    Args:
        device_index: NVML index of the GPU (``nvml_device_index``).
        nvml: the pynvml module, or a stand-in with the same functions
            (``nvmlInit``, ``nvmlDeviceGetHandleByIndex``,
            ``nvmlDeviceGetUtilizationRates``, ``nvmlShutdown``, ``NVMLError``);
            None imports pynvml on first use.
    """

    def __init__(self, device_index: int = 0, nvml: ModuleType | Any | None = None) -> None:
        self.device_index = device_index
        self._nvml = nvml
        self._handle: Any = None
        self._gpm: list[Any] | bool | None = None
        """GPM state: None untried, False unsupported, else the two sample buffers."""

    def _error_types(self) -> tuple[type[BaseException], ...]:
        try:
            nvml_error = self._nvml.NVMLError
        except AttributeError:  # a stand-in module without pynvml's error type
            nvml_error = None
        base = (OSError, RuntimeError, AttributeError)
        return (nvml_error, *base) if isinstance(nvml_error, type) else base

    def _open(self) -> None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"pynvml not installed ({exc})") from None
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except self._error_types() as exc:
            self._handle = None
            raise NvmlUnavailable(f"NVML init for GPU {self.device_index} failed: {exc}") from None

    def read(self) -> tuple[float, float]:
        """``(gpu_util, memory_util)`` in percent, initialising NVML on first call.

        Raises:
            NvmlUnavailable: pynvml missing, no driver or device, or any NVML error.
        """
        if self._handle is None:
            self._open()
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            return float(rates.gpu), float(rates.memory)
        except self._error_types() as exc:
            raise NvmlUnavailable(f"NVML utilisation read for GPU {self.device_index} failed: {exc}") from None

    def read_tensor(self) -> float | None:
        """Tensor-core utilisation (percent) since the previous call, through NVML GPM; None when unknown.

        None on the first call (GPM needs two samples), on GPUs without GPM
        support, and after any GPM error (GPM is then not tried again; the
        caller estimates tensor activity instead).
        """
        if self._handle is None or self._gpm is False:
            return None
        nvml = self._nvml
        try:
            if self._gpm is None:
                if not nvml.nvmlGpmQueryDeviceSupport(self._handle).isSupportedDevice:
                    self._gpm = False
                    return None
                self._gpm = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
                nvml.nvmlGpmSampleGet(self._handle, self._gpm[0])
                return None
            previous, current = self._gpm
            nvml.nvmlGpmSampleGet(self._handle, current)
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 1
            request.sample1 = previous
            request.sample2 = current
            request.metrics[0].metricId = nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            nvml.nvmlGpmMetricsGet(request)
            self._gpm = [current, previous]
            return float(request.metrics[0].value)
        except (*self._error_types(), TypeError) as exc:
            log.info("NVML GPM tensor utilisation not readable (%s); estimating it from GPU utilisation", exc)
            self._gpm = False
            return None

    def close(self) -> None:
        """Shut NVML down if it was initialised; never raises."""
        if self._handle is None:
            return
        if isinstance(self._gpm, list):
            for sample in self._gpm:
                try:
                    self._nvml.nvmlGpmSampleFree(sample)
                except Exception:  # noqa: BLE001 - shutting down
                    pass
        self._gpm = None
        self._handle = None
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down; nothing to do about it
            pass


class EngineActivity:
    """Utilisation the engine reports of itself (percent, 0-100) between two readings.

    Reads the cumulative ``busy_seconds`` and, when the engine models them
    (``models_activity``), ``memory_busy_seconds`` and ``tensor_busy_seconds``.
    """

    def __init__(self, engine: Any, use_model: bool = True) -> None:
        self._engine = engine
        self.modelled = use_model and bool(engine.models_activity)
        self._last: tuple[float, float, float, float] | None = None

    def totals(self) -> tuple[float, float, float]:
        """The engine's cumulative (busy, memory-busy, tensor-busy) seconds now."""
        e = self._engine
        return (
            float(e.busy_seconds or 0.0),
            float(e.memory_busy_seconds or 0.0),
            float(e.tensor_busy_seconds or 0.0),
        )

    def read(self, now: float) -> UtilSample:
        """The sample since the previous call (all zero on the first call)."""
        totals = self.totals()
        last, self._last = self._last, (now, *totals)
        if last is None or now <= last[0]:
            return UtilSample(0.0, 0.0, 0.0, "engine_model" if self.modelled else "busy_ratio")
        return self.between(last[1:], totals, now - last[0])

    def between(self, then: tuple[float, ...], totals: tuple[float, ...], span: float) -> UtilSample:
        """The utilisation over ``span`` seconds (> 0) in which the :meth:`totals` went from ``then`` to
        ``totals``."""
        def pct(delta: float) -> float:
            return min(100.0, max(0.0, 100.0 * delta / span))

        if self.modelled:
            return UtilSample(pct(totals[0] - then[0]), pct(totals[1] - then[1]), pct(totals[2] - then[2]),
                              "engine_model")
        return sample_from(pct(totals[0] - then[0]), 0.0, "busy_ratio")


class ComputeScoreMonitor:
    """The current compute score, from NVML or from the engine busy ratio.

    Readings are cached for ``score_sample_interval_ms``; NVML itself averages
    utilisation over a sample period of 1/6 s to 1 s, so reading it more often
    adds cost without information.

    Args:
        config: ``scheduler_config.json`` (weights, sample interval, device index).
        busy_seconds: the engine's cumulative busy seconds, for the fallback;
            None counts the engine as idle. Ignored when ``engine`` is given.
        engine: the engine itself, for the fallback (see :class:`EngineActivity`).
        nvml: the pynvml module or a stand-in (tests); None imports pynvml;
            ``False`` skips NVML (the engine does not compute on this host's GPU).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        busy_seconds: Callable[[], float] | None = None,
        nvml: ModuleType | Any | None = None,
        engine: Any = None,
    ) -> None:
        self.weights = config.compute_score_weights
        self.sample_interval_s = config.score_sample_interval_ms / 1000.0
        self._reader: NvmlReader | None = (
            None if nvml is False else NvmlReader(config.nvml_device_index, nvml)
        )
        if engine is None:
            engine = _BusyOnly(busy_seconds or (lambda: 0.0))
        self._activity = EngineActivity(engine, use_model=config.score_without_nvml == "engine_model")
        self._next_read = float("-inf")
        self.gpu_available: bool | None = None
        """True once NVML answered, False once the fallback is in use, None before the first read."""
        self.sample = UtilSample(0.0, 0.0, 0.0, "none")
        self.score = 0.0
        # The scheduler reads on the event loop, a Prometheus scrape on the metrics
        # server's thread: one sample window at a time.
        self._lock = threading.Lock()
        self.closed = False
        """True once :meth:`close` ran: NVML released, the gauge no longer re-samples this monitor."""

    def read(self, now: float) -> float:
        """The compute score (0-100) at ``now``; re-samples at most every sample interval."""
        with self._lock:
            return self._read(now)

    def scrape(self) -> float:
        """The compute score now (:meth:`read` at ``time.monotonic()``): the gauge's value at scrape time."""
        return self.read(time.monotonic())

    def activity(self) -> tuple[float, float, float]:
        """The engine's cumulative activity now: the mark a stretch of running is measured from
        (:meth:`score_over`)."""
        return self._activity.totals()

    def score_over(self, since: float, mark: tuple[float, ...], now: float) -> float:
        """The compute score (0-100) over the stretch ``[since, now]``, whose :meth:`activity` at ``since``
        was ``mark``: the engine's own activity over exactly that stretch where the score comes from the
        engine; NVML's current sample where NVML answers (NVML averages over 1/6 s to 1 s itself); the
        current sample for an empty stretch. The cached sample describes the interval before it was taken:
        a request that ran between two samples after an idle one was charged the idle engine's 0."""
        with self._lock:
            if now <= since or self.sample.source.startswith("nvml"):
                return self.score
            return weighted_score(self._activity.between(mark, self._activity.totals(), now - since), self.weights)

    def _read(self, now: float) -> float:
        if now < self._next_read:
            return self.score
        self._next_read = now + self.sample_interval_s
        fallback = self._activity.read(now)  # keep the window aligned even while NVML answers
        sample = self._read_nvml()
        if sample is None:
            sample = fallback
        self.sample = sample
        self.score = weighted_score(sample, self.weights)
        return self.score

    def _read_nvml(self) -> UtilSample | None:
        if self._reader is None:
            self._fall_back("NVML not used: the engine does not compute on this host's GPU", expected=True)
            return None
        try:
            gpu, memory = self._reader.read()
        except NvmlUnavailable as exc:
            self._reader.close()
            self._reader = None
            self._fall_back(str(exc))
            return None
        if self.gpu_available is not True:
            self.gpu_available = True
            log.info("compute score from NVML utilisation of GPU %d", self._reader.device_index)
        tensor = self._reader.read_tensor()
        if tensor is None:
            return sample_from(gpu, memory, "nvml")
        return UtilSample(min(100.0, max(0.0, gpu)), min(100.0, max(0.0, memory)),
                          min(100.0, max(0.0, tensor)), "nvml_gpm")

    def _fall_back(self, reason: str, expected: bool = False) -> None:
        """The compute score comes from the engine from now on, said once: a WARNING when NVML failed, INFO when
        ``expected`` (the monitor was built without NVML: a stream engine's GPU is its model server's)."""
        if self.gpu_available is False:
            return
        self.gpu_available = False
        source = "its modelled utilisation" if self._activity.modelled else "its busy ratio"
        log.log(logging.INFO if expected else logging.WARNING,
                "GPU utilisation not readable (%s); the compute score comes from the engine: %s", reason, source)

    def close(self) -> None:
        """Release NVML and stop re-sampling at scrape time (the gauge keeps the last score); never raises."""
        self.closed = True
        if self._reader is not None:
            self._reader.close()


class _BusyOnly:
    """An engine stand-in that reports only cumulative busy seconds."""

    models_activity = False
    memory_busy_seconds = 0.0
    tensor_busy_seconds = 0.0

    def __init__(self, busy_seconds: Callable[[], float]) -> None:
        self._busy_seconds = busy_seconds

    @property
    def busy_seconds(self) -> float:
        return self._busy_seconds()
