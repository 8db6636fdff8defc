"""Where each section lives (file and keys) and which service reads it."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from switchyard.common.config.batching import BatchingConfig
from switchyard.common.config.dispatcher import DispatcherConfig
from switchyard.common.config.engines import SimEngineConfig, TorchEngineConfig
from switchyard.common.config.limits import RequestLimitsConfig
from switchyard.common.config.memory import (
    AgentMemoryConfig, DramTierConfig, HbmTierConfig, OssTierConfig, ScanConfig, ValueScoreConfig,
)
from switchyard.common.config.model_gateway import UpstreamConfig
from switchyard.common.config.orchestrator import OrchestratorConfig
from switchyard.common.config.queues import InferenceQueueConfig, QueueConfig
from switchyard.common.config.retrieval import RetrievalConfig
from switchyard.common.config.scheduler import SchedulerConfig
from switchyard.common.config.server import ServerConfig
from switchyard.common.config.slo import SloConfig


@dataclass(frozen=True)
class Section:
    """Where one section of :class:`SwitchyardConfig` lives: a file and the keys down to its table."""

    file: str
    keys: tuple[str, ...]
    model: type[BaseModel]

    def where(self) -> str:
        return ".".join(self.keys) or "(top level)"


# SwitchyardConfig attribute (dotted) -> file and keys. Each is validated on its own, so a bad
# value in one section stops only the services that read it.
SECTIONS: dict[str, Section] = {
    "server": Section("switchyard.json", ("server",), ServerConfig),
    "limits": Section("switchyard.json", ("limits",), RequestLimitsConfig),
    "orchestrator": Section("switchyard.json", ("orchestrator",), OrchestratorConfig),
    "retrieval": Section("switchyard.json", ("retrieval",), RetrievalConfig),
    "dispatcher": Section("switchyard.json", ("dispatcher",), DispatcherConfig),
    "sim": Section("switchyard.json", ("sim",), SimEngineConfig),
    "torch": Section("switchyard.json", ("torch",), TorchEngineConfig),
    "slo": Section("switchyard.json", ("slo",), SloConfig),
    "upstream": Section("queue.json", ("model_gateway",), UpstreamConfig),
    "queues.orchestration": Section("queue.json", ("queues", "orchestration"), QueueConfig),
    "queues.retrieval": Section("queue.json", ("queues", "retrieval"), QueueConfig),
    "queues.inference": Section("queue.json", ("queues", "inference"), InferenceQueueConfig),
    "batching": Section("queue.json", ("flush",), BatchingConfig),
    "scheduler": Section("scheduler_config.json", (), SchedulerConfig),
    "memory.hbm": Section("memory_policy.toml", ("hbm",), HbmTierConfig),
    "memory.dram": Section("memory_policy.toml", ("dram",), DramTierConfig),
    "memory.agent_memory": Section("memory_policy.toml", ("agent_memory",), AgentMemoryConfig),
    "memory.oss": Section("memory_policy.toml", ("oss",), OssTierConfig),
    "memory.scan": Section("memory_policy.toml", ("scan",), ScanConfig),
    "memory.value": Section("memory_policy.toml", ("value",), ValueScoreConfig),
}

FILES = ("queue.json", "scheduler_config.json", "memory_policy.toml", "switchyard.json")

# The engine's own section, read by the dispatcher for the engine it runs.
ENGINE_SECTIONS = {"sim": "sim", "torch": "torch", "openai": "upstream"}

# The sections each service reads (its engine's section is added for the dispatcher).
SERVICE_SECTIONS: dict[str, tuple[str, ...]] = {
    "orchestrator": ("server", "limits", "orchestrator", "queues.orchestration", "memory.dram", "memory.agent_memory"),
    "retrieval": ("server", "limits", "retrieval", "queues.retrieval"),
    "dispatcher": (
        "server", "limits", "dispatcher", "queues.inference", "batching", "scheduler",
        "memory.hbm", "memory.dram", "memory.oss", "memory.scan", "memory.value",
    ),
}


def sections_read_by(service: str, engine: str | None = None) -> tuple[str, ...]:
    """The sections ``service`` reads; for the dispatcher, ``engine``'s section too when given."""
    names = SERVICE_SECTIONS[service]
    return (*names, ENGINE_SECTIONS[engine]) if engine is not None else names
