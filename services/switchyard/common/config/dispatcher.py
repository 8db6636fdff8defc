"""``switchyard.json`` ``dispatcher``: the dispatcher (InferenceService)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from switchyard.common.config.base import _Strict
from switchyard.common.config.server import _health_port, _metrics_port, _port, distinct_ports


class DispatcherConfig(_Strict):
    """The dispatcher (InferenceService): ``switchyard.json`` ``dispatcher``."""

    port: int = _port(50053)
    metrics_port: int = _metrics_port(9103)
    health_port: int | None = _health_port()

    @model_validator(mode="after")
    def _ports_of_its_own(self) -> "DispatcherConfig":
        distinct_ports("dispatcher", {"port": self.port, "metrics_port": self.metrics_port,
                                      "health_port": self.health_port})
        return self

    engine: Literal["sim", "openai", "torch"] = Field(
        "sim",
        description="Inference engine, a name (SWITCHYARD_ENGINE): sim reads the sim section, torch the torch "
        "section, openai queue.json model_gateway.",
    )
    stream_flush_interval_ms: float = Field(
        5.0, ge=0, le=1000,
        description="Shortest time between two messages of one GenerateStream while it carries more than one "
        "request, ms: output that becomes ready within it leaves together in the next message (one write and "
        "one read for many requests' tokens instead of one each). A request alone on its stream, a request's first "
        "and last output and a CORE request's output are never held. A request whose caller merges its tokens "
        "anyway (a BATCH task's call: its start's token_hold_s, orchestrator.batch_token_flush_interval_ms) "
        "sends them at most once per that interval instead. "
        "0: each message leaves as soon as the last one was written.",
    )
