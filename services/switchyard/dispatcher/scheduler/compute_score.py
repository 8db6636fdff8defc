"""The compute score: how loaded the GPU is, 0-100, for admission.

Rule (``scheduler_config.json``, from the field reports quoted in DESIGN.md)::

    score = w_cuda * cuda_util + w_bandwidth * bandwidth_util + w_tensor * tensor_util

with every utilisation in percent (0-100), so the score is on the same 0-100
scale as ``low_load_threshold`` and ``high_load_threshold``.

- ``cuda_util``: NVML GPU utilisation (percent of the sample period a kernel ran),
  ``nvmlDeviceGetUtilizationRates().gpu``.
- ``bandwidth_util``: NVML memory utilisation (percent of the period device
  memory was read or written), ``nvmlDeviceGetUtilizationRates().memory``.
- ``tensor_util``: tensor-core activity is not readable through NVML (only
  through DCGM profiling), so it is estimated as DESIGN.md says:
  ``0.8 * cuda_util`` when ``cuda_util > 30``, else 0.

Without a GPU or without NVML (no driver, no pynvml, or any NVML error), the
engine's busy ratio stands in for ``cuda_util``: both measure the share of
wall time the device (or the engine) was running work. Memory bandwidth is then
not observable and counts 0; the tensor estimate applies unchanged. The
monitor says so once in the log and sets ``switchyard_gpu_available`` to 0. An
NVML error never propagates: the monitor switches to the fallback for good.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from switchyard.common.config import ComputeScoreWeights, SchedulerFile
from switchyard.dispatcher.scheduler import metrics

log = logging.getLogger(__name__)

TENSOR_ESTIMATE_FACTOR = 0.8
"""tensor_util = 0.8 x cuda_util above :data:`TENSOR_ESTIMATE_MIN_UTIL` (DESIGN.md)."""
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
    """Estimated tensor-core activity (percent) from GPU utilisation (percent), per DESIGN.md."""
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

    def _error_types(self) -> tuple[type[BaseException], ...]:
        nvml_error = getattr(self._nvml, "NVMLError", None)
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

    def close(self) -> None:
        """Shut NVML down if it was initialised; never raises."""
        if self._handle is None:
            return
        self._handle = None
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down; nothing to do about it
            pass


class BusyRatio:
    """Share of wall time an engine was busy (0-1) between two readings.

    Args:
        busy_seconds: returns the engine's cumulative busy seconds
            (``StepEngine.busy_seconds``).
    """

    def __init__(self, busy_seconds: Callable[[], float]) -> None:
        self._busy_seconds = busy_seconds
        self._last: tuple[float, float] | None = None

    def read(self, now: float) -> float:
        """Busy ratio since the previous call (0 on the first call)."""
        busy = float(self._busy_seconds())
        if self._last is None:
            self._last = (now, busy)
            return 0.0
        last_now, last_busy = self._last
        if now <= last_now:
            return 0.0
        self._last = (now, busy)
        return min(1.0, max(0.0, (busy - last_busy) / (now - last_now)))


class ComputeScoreMonitor:
    """The current compute score, from NVML or from the engine busy ratio.

    Readings are cached for ``score_sample_interval_ms``; NVML itself averages
    utilisation over a sample period of 1/6 s to 1 s, so reading it more often
    adds cost without information.

    Args:
        config: ``scheduler_config.json`` (weights, sample interval, device index).
        busy_seconds: the engine's cumulative busy seconds, for the fallback;
            None counts the engine as idle.
        nvml: the pynvml module or a stand-in (tests); None imports pynvml;
            ``False`` skips NVML (no GPU expected).
    """

    def __init__(
        self,
        config: SchedulerFile,
        busy_seconds: Callable[[], float] | None = None,
        nvml: ModuleType | Any | None = None,
    ) -> None:
        self.weights = config.compute_score_weights
        self.sample_interval_s = config.score_sample_interval_ms / 1000.0
        self._reader: NvmlReader | None = (
            None if nvml is False else NvmlReader(config.nvml_device_index, nvml)
        )
        self._busy = BusyRatio(busy_seconds or (lambda: 0.0))
        self._next_read = float("-inf")
        self.gpu_available: bool | None = None
        """True once NVML answered, False once the fallback is in use, None before the first read."""
        self.sample = UtilSample(0.0, 0.0, 0.0, "none")
        self.score = 0.0

    def read(self, now: float) -> float:
        """The compute score (0-100) at ``now``; re-samples at most every sample interval."""
        if now < self._next_read:
            return self.score
        self._next_read = now + self.sample_interval_s
        busy = self._busy.read(now)  # keep the busy window aligned even while NVML answers
        sample = self._read_nvml()
        if sample is None:
            sample = sample_from(busy * 100.0, 0.0, "busy_ratio")
        self.sample = sample
        self.score = weighted_score(sample, self.weights)
        metrics.COMPUTE_SCORE.set(self.score)
        if sample.source == "nvml":
            metrics.GPU_UTILIZATION.set(sample.cuda_util / 100.0)
            metrics.GPU_MEMORY_UTILIZATION.set(sample.bandwidth_util / 100.0)
        return self.score

    def _read_nvml(self) -> UtilSample | None:
        if self._reader is None:
            self._fall_back("NVML not used (no GPU expected)")
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
            metrics.GPU_AVAILABLE.set(1)
            log.info("compute score from NVML utilisation of GPU %d", self._reader.device_index)
        return sample_from(gpu, memory, "nvml")

    def _fall_back(self, reason: str) -> None:
        if self.gpu_available is False:
            return
        self.gpu_available = False
        metrics.GPU_AVAILABLE.set(0)
        log.warning("GPU utilisation not readable (%s); compute score falls back to the engine busy ratio", reason)

    def close(self) -> None:
        """Release NVML; never raises."""
        if self._reader is not None:
            self._reader.close()
