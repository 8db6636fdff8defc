"""Circuit breaker per upstream model: LiteLLM's cooldowns, on purgatory.

A model whose calls fail ``model_gateway.cooldown.failures`` times in a row is
*open* for ``cooldown_s``: its requests are refused at once with
:class:`~switchyard.gateway.errors.ModelCoolingDown` (UNAVAILABLE, fallback
allowed), so the fallback model serves them without paying the dead model's
timeouts and retries first. After the cooldown one trial request is let through
(*half-open*); its success closes the circuit, its failure opens it again.

Only upstream faults count: UNAVAILABLE (5xx, connection refused, stream cut
before the first token), DEADLINE_EXCEEDED (timeouts) and INTERNAL. A rate limit
(429), a request's own fault (400, 404 for a named model, 413, 422),
authentication, and a dead local proxy (not the model's doing) never open a circuit.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from purgatory import AsyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState

from switchyard.common.config import UpstreamConfig
from switchyard.gateway import models as model_names
from switchyard.gateway.errors import GatewayError, ModelCoolingDown
from switchyard.gateway.metrics import GATEWAY_CIRCUIT_OPEN, GATEWAY_COOLDOWNS

log = logging.getLogger(__name__)
T = TypeVar("T")

UPSTREAM_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL})
"""What counts against a model. Not RESOURCE_EXHAUSTED (429): "slow down" is answered by Retry-After and
the dispatcher's adaptive concurrency limit; opening the circuit on it would refuse all the traffic the
upstream can still take."""


def _not_the_models_fault(exc: BaseException) -> bool:
    """purgatory's exclude predicate: True for an error that must not count against the model."""
    if not isinstance(exc, GatewayError):
        return True  # cancellation, bugs: not an upstream answer
    return exc.code not in UPSTREAM_FAULTS or exc.origin == "proxy" or isinstance(exc, ModelCoolingDown)


class Cooldowns:
    """One circuit per upstream model id, in this process.

    Args:
        config: ``model_gateway``; ``cooldown`` gives the threshold and cooldown.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._breakers = AsyncCircuitBreakerFactory(
            default_threshold=config.cooldown.failures,
            default_ttl=config.cooldown.cooldown_s,
            exclude=[(BaseException, _not_the_models_fault)],
        )
        self._breakers.add_listener(self._on_event)
        for model in model_names.configured_models(config):
            GATEWAY_CIRCUIT_OPEN.labels(model_names.model_label(model, config)).set(0)
            GATEWAY_COOLDOWNS.labels(model_names.model_label(model, config))

    def _on_event(self, model: str, event_type: str, event: Any) -> None:
        if event_type != "state_changed":
            return
        label = model_names.model_label(model, self.config)
        opened = event.state == "opened"
        GATEWAY_CIRCUIT_OPEN.labels(label).set(1 if opened else 0)
        if opened:
            GATEWAY_COOLDOWNS.labels(label).inc()
            log.warning("upstream model %r: circuit open after %d failures in a row; skipped for %g s "
                        "(model_gateway.cooldown)", model, self.config.cooldown.failures, self.config.cooldown.cooldown_s)
        elif event.state == "closed":
            log.info("upstream model %r: circuit closed, serving again", model)

    async def call(self, model: str, once: Callable[[], Awaitable[T]]) -> T:
        """``await once()`` unless ``model``'s circuit is open.

        Raises:
            ModelCoolingDown: the circuit is open (UNAVAILABLE, fallback allowed).
            GatewayError: whatever ``once`` raised, after counting it.
        """
        if not self.config.cooldown.enabled:
            return await once()
        breaker = await self._breakers.get_breaker(model)
        try:
            async with breaker:
                return await once()
        except OpenedState as exc:
            left = max(0.0, exc.opened_at + self.config.cooldown.cooldown_s - time.time())
            raise ModelCoolingDown(
                f"upstream model {model!r} is cooling down: {self.config.cooldown.failures} failures in a row "
                f"at {self.config.base_url}; skipped for {left:.1f} s more (model_gateway.cooldown.cooldown_s)"
            ) from None
