"""Typed configuration: one class per concern, each field with its unit, under one aggregate.

:class:`SwitchyardConfig` has one attribute per concern (``server``, ``limits``,
``orchestrator``, ``retrieval``, ``dispatcher``, ``sim``, ``torch``,
``upstream``, ``queues``, ``batching``, ``scheduler``, ``memory``, ``slo``);
:data:`SECTIONS` says which file and key each comes from. The files (in
``SWITCHYARD_CONFIG_DIR``, default ``config/``) and their keys are the ones
operators already have:

- ``queue.json``: ``queues`` (:class:`QueuesConfig`), ``flush``
  (:class:`BatchingConfig`), ``model_gateway`` (:class:`UpstreamConfig`).
- ``scheduler_config.json``: the whole file is :class:`SchedulerConfig`.
- ``memory_policy.toml``: one table per tier or policy (:class:`MemoryTiersConfig`).
- ``switchyard.json``: one table per service, engine, limits and SLO.

Every field has a default, a range check and a description naming its unit;
durations end in ``_ms`` or ``_s``. The former ``*_sec`` keys of
``memory_policy.toml`` and ``orchestrator.task_store``, and the keys of
``FORMER_NAMES`` (renamed to say what the code does with them), are still
read, with a warning naming the new name (both names at once is an error).

Each service loads only the sections it reads (``load_config(service=...)``,
:data:`SERVICE_SECTIONS`): a bad value elsewhere does not stop it, and reading
another service's section raises :class:`ConfigError`. A bad value raises
:class:`ConfigError` naming the file, the key, the value and what was expected.
docs/architecture.md ("Where each limit lives") lists the sections by service.

One module per concern: :mod:`.server` (gRPC, TLS, ports), :mod:`.auth`,
:mod:`.limits`, :mod:`.orchestrator`, :mod:`.retrieval`, :mod:`.dispatcher`,
:mod:`.engines` (sim, torch), :mod:`.model_gateway` (the openai engine's
upstream), :mod:`.queues`, :mod:`.batching`, :mod:`.scheduler`,
:mod:`.memory` (tiers), :mod:`.slo`; :mod:`.sections` (which file and key,
which service), :mod:`.aggregate` (:class:`SwitchyardConfig`),
:mod:`.gating` (the stand-in for a section a service does not read) and
:mod:`.loader` (files, former names, environment overrides). Every public
name is importable from this package.
"""

from switchyard.common.config.aggregate import SwitchyardConfig
from switchyard.common.config.auth import AuthConfig
from switchyard.common.config.base import ConfigError
from switchyard.common.config.batching import BatchingConfig
from switchyard.common.config.dispatcher import DispatcherConfig
from switchyard.common.config.engines import SimEngineConfig, TorchEngineConfig
from switchyard.common.config.limits import RequestLimitsConfig
from switchyard.common.config.loader import builtin_config, config_folder, load_config
from switchyard.common.config.memory import (
    AgentMemoryConfig,
    DramTierConfig,
    HbmTierConfig,
    MemoryTiersConfig,
    OssTierConfig,
    ScanConfig,
    ValueScoreConfig,
)
from switchyard.common.config.model_gateway import (
    AdaptiveConcurrencyConfig,
    CooldownConfig,
    EndpointScorerWeights,
    UpstreamConfig,
    UpstreamPoolConfig,
)
from switchyard.common.config.orchestrator import (
    AffinityConfig,
    HttpFaceConfig,
    OrchestratorConfig,
    ProgramConfig,
    ReactConfig,
    TaskStoreConfig,
)
from switchyard.common.config.queues import InferenceQueueConfig, QueueConfig, QueuesConfig
from switchyard.common.config.retrieval import RetrievalConfig
from switchyard.common.config.scheduler import ComputeScoreWeights, PriorityBoost, SchedulerConfig
from switchyard.common.config.sections import (
    ENGINE_SECTIONS,
    FILES,
    SECTIONS,
    SERVICE_SECTIONS,
    Section,
    sections_read_by,
)
from switchyard.common.config.server import ServerConfig, TlsConfig
from switchyard.common.config.slo import SloConfig, TtftSloConfig

__all__ = [
    "ENGINE_SECTIONS", "FILES", "SECTIONS", "SERVICE_SECTIONS",
    "AdaptiveConcurrencyConfig", "AffinityConfig", "AgentMemoryConfig", "AuthConfig", "BatchingConfig",
    "ComputeScoreWeights", "ConfigError", "CooldownConfig", "DispatcherConfig", "DramTierConfig",
    "EndpointScorerWeights", "HbmTierConfig", "HttpFaceConfig", "InferenceQueueConfig", "MemoryTiersConfig", "OrchestratorConfig",
    "OssTierConfig", "PriorityBoost", "ProgramConfig", "QueueConfig", "QueuesConfig", "ReactConfig", "RequestLimitsConfig",
    "RetrievalConfig", "ScanConfig", "SchedulerConfig", "Section", "ServerConfig", "SimEngineConfig",
    "SloConfig", "SwitchyardConfig", "TaskStoreConfig", "TlsConfig", "TorchEngineConfig", "TtftSloConfig",
    "UpstreamConfig", "UpstreamPoolConfig", "ValueScoreConfig",
    "builtin_config", "config_folder", "load_config", "sections_read_by",
]
