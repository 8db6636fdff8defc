"""NVML stand-in for a machine without a GPU (the edge of the world): the ``pynvml`` calls the compute score
monitor makes, utilisation set by the test, errors on demand."""

from __future__ import annotations

from types import SimpleNamespace


class FakeNvml:
    """Stand-in for the pynvml module: utilisation ``gpu`` and ``memory`` (percent) as the test sets them,
    ``fail_init`` / ``fail_read`` raise :class:`NVMLError` as a driver would; ``reads`` counts reads."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpu: float = 0.0, memory: float = 0.0) -> None:
        self.gpu, self.memory = gpu, memory
        self.fail_init = False
        self.fail_read = False
        self.reads = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        self.reads += 1
        if self.fail_read:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(gpu=self.gpu, memory=self.memory)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
