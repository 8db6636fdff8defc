"""gRPC clients of the orchestrator's two downstream services.

Channels come from :func:`switchyard.common.channels.open_channel`: no HTTP
proxy, keepalive, and each call bounded by the task's deadline.

A downstream failure is re-raised with the service's name and address, so a
caller of RunTask learns which service is down, not just "UNAVAILABLE".
"""

from __future__ import annotations

from typing import AsyncIterator

import grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.errors import ORIGIN_KEY, ServiceUnavailable, SwitchyardError
from switchyard.common.channels import open_channel
from switchyard.common.config import ServerConfig


def _downstream_error(service: str, address: str, err: grpc.aio.AioRpcError) -> SwitchyardError:
    """The error to raise for a failed call to ``service``, naming the hop that failed.

    An answer from the service carries its origin (:data:`ORIGIN_KEY`): the service itself, or the
    upstream model or proxy it relays. Without one, nothing answered: the service is unreachable.
    """
    origin = dict(err.trailing_metadata() or ()).get(ORIGIN_KEY, "")
    details = err.details() or err.code().name
    if not origin:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            return ServiceUnavailable(service, address, details)
        error = SwitchyardError(f"{service} ({address}): {details}", err.code())
    elif origin == service:
        error = SwitchyardError(f"{service} ({address}): {details}", err.code())
    else:
        error = SwitchyardError(f"{origin} (via {service} at {address}): {details}", err.code())
    error.origin = origin or service
    return error


class RetrievalClient:
    """RetrievalService.Retrieve over one channel."""

    def __init__(self, address: str, config: ServerConfig, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, config)
        self._stub = agent_pb2_grpc.RetrievalServiceStub(self._channel)

    async def retrieve(self, query: str, top_k: int = 0) -> agent_pb2.RetrieveResponse:
        """Passages for ``query``.

        Raises:
            ServiceUnavailable: retrieval is down.
            SwitchyardError: retrieval answered with an error (its code kept).
        """
        try:
            return await self._stub.Retrieve(
                agent_pb2.RetrieveRequest(query=query, top_k=top_k), timeout=self.timeout_s, wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            raise _downstream_error("retrieval", self.address, err) from None

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel calls take (readiness checks health over it too)."""
        return self._channel

    async def close(self) -> None:
        await self._channel.close()


class InferenceClient:
    """InferenceService.Generate over one channel."""

    def __init__(self, address: str, config: ServerConfig) -> None:
        self.address = address
        self._channel = open_channel(address, config)
        self._stub = agent_pb2_grpc.InferenceServiceStub(self._channel)

    async def generate(
        self, request: agent_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """Stream the chunks of one generation.

        Raises:
            ServiceUnavailable: the dispatcher is down.
            SwitchyardError: the dispatcher answered with an error (its code kept).
        """
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as err:
            raise _downstream_error("dispatcher", self.address, err) from None
        finally:
            call.cancel()

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel calls take (readiness checks health over it too)."""
        return self._channel

    async def close(self) -> None:
        await self._channel.close()
