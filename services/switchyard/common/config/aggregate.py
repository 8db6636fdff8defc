"""The aggregate :class:`SwitchyardConfig`, the checks across its sections, and how it is assembled."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from pydantic import BaseModel, Field, ValidationError

from switchyard.common.config.base import ConfigError, _describe, _Strict
from switchyard.common.config.batching import BatchingConfig
from switchyard.common.config.dispatcher import DispatcherConfig
from switchyard.common.config.engines import SimEngineConfig, TorchEngineConfig
from switchyard.common.config.gating import _Unread
from switchyard.common.config.limits import RequestLimitsConfig
from switchyard.common.config.memory import MemoryTiersConfig
from switchyard.common.config.model_gateway import UpstreamConfig
from switchyard.common.config.orchestrator import OrchestratorConfig
from switchyard.common.config.queues import QueuesConfig
from switchyard.common.config.retrieval import RetrievalConfig
from switchyard.common.config.scheduler import SchedulerConfig
from switchyard.common.config.sections import SECTIONS
from switchyard.common.config.server import ServerConfig
from switchyard.common.config.slo import SloConfig


class SwitchyardConfig(_Strict):
    """Every section of every file, one attribute per concern. Build it with :func:`load_config`.

    The attributes are named after what they configure, not after the file that
    holds them; :data:`SECTIONS` maps each to its file and key. A service
    loaded with ``load_config(service=...)`` holds only the sections it reads
    (:data:`SERVICE_SECTIONS`): reading another raises :class:`ConfigError`.
    """

    server: ServerConfig = Field(ServerConfig(), description="gRPC servers and channels of every service.")
    limits: RequestLimitsConfig = Field(RequestLimitsConfig(), description="What one request may ask for.")
    orchestrator: OrchestratorConfig = Field(OrchestratorConfig(), description="The orchestrator.")
    retrieval: RetrievalConfig = Field(RetrievalConfig(), description="Retrieval.")
    dispatcher: DispatcherConfig = Field(DispatcherConfig(), description="The dispatcher.")
    sim: SimEngineConfig = Field(SimEngineConfig(), description="The sim engine's latency model.")
    torch: TorchEngineConfig = Field(TorchEngineConfig(), description="The torch engine's model.")
    upstream: UpstreamConfig = Field(UpstreamConfig(), description="The openai engine's model server.")
    queues: QueuesConfig = Field(QueuesConfig(), description="One work queue per service.")
    batching: BatchingConfig = Field(BatchingConfig(), description="The dispatcher's double buffer.")
    scheduler: SchedulerConfig = Field(SchedulerConfig(), description="The dispatcher's scheduler.")
    memory: MemoryTiersConfig = Field(MemoryTiersConfig(), description="Memory tiers of agent state.")
    slo: SloConfig = Field(SloConfig(), description="Service-level objectives of the alert rules.")
    config_dir: str = Field("config", description="Folder the files were read from, a path.")

    def with_overrides(self, **values: Any) -> "SwitchyardConfig":
        """A copy with dotted keys replaced, e.g. ``{"batching.max_batch_size": 1}``.

        Raises:
            ConfigError: a replaced value fails validation, or names a section this
                config does not hold.
        """
        if not values:
            return self
        sections = {name: _get(self, name) for name in SECTIONS}
        grouped: dict[str, dict[str, Any]] = {}
        for dotted, value in values.items():
            name = _section_of(dotted)
            grouped.setdefault(name, {})[dotted[len(name) + 1:]] = value
        problems = []
        for name, replaced in grouped.items():
            current = sections[name]
            if isinstance(current, _Unread):
                raise ConfigError(f"overrides: {name} is not among the sections the {current._reader} reads")
            data = current.model_dump()
            for dotted, value in replaced.items():
                if not dotted:
                    data = value
                    continue
                node = data
                *parents, leaf = dotted.split(".")
                for key in parents:
                    node = node[key]
                node[leaf] = value
            try:
                sections[name] = SECTIONS[name].model.model_validate(data)
            except ValidationError as exc:
                problems.append(_describe("overrides", exc, prefix=name, model=SECTIONS[name].model))
        if problems:
            raise ConfigError("\n".join(problems))
        return _assemble(sections, self.config_dir, "overrides")


    def with_overrides_from(self, values: Mapping[str, Any], sources: Mapping[str, str],
                            fallback: str) -> "SwitchyardConfig":
        """:meth:`with_overrides` of ``values`` set by the environment or the command line: a refusal names, on
        each line, where the keys it names were set (``sources``: dotted key -> what set it, as it was set:
        ``environment variable SWITCHYARD_X='v'``, ``--port 70000``), else ``fallback``, where it read
        ``overrides:``, which the operator never wrote.

        Raises:
            ConfigError: as :meth:`with_overrides`.
        """
        try:
            return self.with_overrides(**values)
        except ConfigError as exc:
            lines = []
            for line in str(exc).splitlines():
                named = dict.fromkeys(source for key, source in sources.items()
                                      if key in values and re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", line))
                lines.append(f"{' and '.join(named) or fallback}: {line.removeprefix('overrides: ')}")
            raise ConfigError("\n".join(lines)) from None


# Checks across sections, each run when every section it names is held: (sections, check).
_CROSS_CHECKS: tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], str | None]], ...] = (
    (("server", "orchestrator"), lambda s: _grace_covers_tasks(s)),
)


def _grace_covers_tasks(sections: dict[str, Any]) -> str | None:
    """A connection sent GOAWAY for its age closes after the grace: a task's streams must fit in it."""
    grace = sections["server"].max_connection_age_grace_s
    limits = sections["orchestrator"].task_time_limit_s
    task_type = max(limits, key=limits.get)
    if grace < limits[task_type]:
        return (
            f"key 'server.max_connection_age_grace_s' has value {grace:g}; expected: at least the longest "
            f"orchestrator.task_time_limit_s ({task_type}: {limits[task_type]:g} s), or a connection that ages out "
            "(server.max_connection_age_s) cuts the streams of a task still running within its limit"
        )
    return None


def _get(config: BaseModel, dotted: str) -> Any:
    """The section at ``dotted`` (a key of :data:`SECTIONS`), or its :class:`_Unread` stand-in."""
    node: Any = config
    for part in dotted.split("."):
        node = dict(node)[part]  # a model's fields as (name, value) pairs, values as they are
    return node


def _section_of(dotted: str) -> str:
    for name in sorted(SECTIONS, key=len, reverse=True):
        if dotted == name or dotted.startswith(name + "."):
            return name
    raise ConfigError(f"overrides: key {dotted!r} is in no section; expected one under {', '.join(SECTIONS)}")


def _assemble(sections: dict[str, Any], config_dir: str, source: str) -> SwitchyardConfig:
    """One :class:`SwitchyardConfig` from validated sections (or :class:`_Unread` stand-ins).

    Raises:
        ConfigError: a check across sections fails; ``source`` names where the values came from.
    """
    problems = [
        f"{source}: {problem}" for names, check in _CROSS_CHECKS
        if not any(isinstance(sections[n], _Unread) for n in names) and (problem := check(sections))
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    queues = QueuesConfig.model_construct(
        **{name: sections[f"queues.{name}"] for name in ("orchestration", "retrieval", "inference")}
    )
    memory = MemoryTiersConfig.model_construct(
        **{name: sections[f"memory.{name}"] for name in ("hbm", "dram", "agent_memory", "oss", "scan", "value")}
    )
    top = {name: value for name, value in sections.items() if "." not in name}
    return SwitchyardConfig.model_construct(queues=queues, memory=memory, config_dir=config_dir, **top)
