"""``switchyard.json`` ``orchestrator.auth``: bearer tokens required at the edge (common/auth.py)."""

from __future__ import annotations

from pydantic import Field

from switchyard.common.config.base import _Strict


class AuthConfig(_Strict):
    """Bearer-token authentication of AgentService calls (common/auth.py). Off by default (``make run``)."""

    enabled: bool = Field(False, description="Require 'authorization: Bearer <token>' on AgentService calls.")
    tokens_file: str = Field(
        "", description="File of tokens, one per line, each optionally followed by the methods it may call."
    )
    tokens_env: str = Field(
        "SWITCHYARD_AUTH_TOKENS", description="Name of a variable holding comma-separated tokens (a Secret in Kubernetes)."
    )
    exempt_methods: list[str] = Field(
        default_factory=lambda: ["grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch",
                                 "grpc.health.v1.Health/List"],
        description="Methods callable without a token (service/method): probes by default. Add "
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo for grpcurl without a token.",
    )
