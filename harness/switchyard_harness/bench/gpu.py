"""NVML GPU utilisation sampling for benchmark runs (None without a GPU).

``nvmlDeviceGetUtilizationRates().gpu`` is the percent of the last sample
period (1/6 s to 1 s, driver-dependent) in which a kernel ran on the GPU
(NVML API reference, ``nvmlUtilization_t``). The sampler polls it from a thread
and averages; without pynvml (nvidia-ml-py), a driver or a GPU it reports None.
"""

from __future__ import annotations

import threading
from typing import Any


class GpuSampler:
    """Average GPU utilisation (ratio 0-1) of one device over a ``with`` block.

    Args:
        device_index: NVML index of the GPU.
        period_s: seconds between samples.
    """

    def __init__(self, device_index: int = 0, period_s: float = 0.1) -> None:
        self.device_index = device_index
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def __enter__(self) -> "GpuSampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no module, no driver, no device: all mean "no GPU"
            self._handle = None
            return self
        self._thread = threading.Thread(target=self._poll, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100)
            except Exception:  # noqa: BLE001 - a transient NVML error skips one sample
                continue

    def mean(self) -> float | None:
        """Mean utilisation 0-1, or None without a GPU or samples."""
        return sum(self.samples) / len(self.samples) if self.samples else None
