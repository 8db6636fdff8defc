"""``switchyard.json`` ``orchestrator.auth``: bearer tokens required at the edge (common/auth.py)."""

from __future__ import annotations

from pydantic import Field, field_validator

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
        description="Methods callable without a token (service/method, or service/* for all of a service's, as "
        "a token file names them): probes by default. Add "
        "grpc.reflection.v1.ServerReflection/ServerReflectionInfo (newer grpcurl asks it first) and "
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo for grpcurl without a token.",
    )

    @field_validator("tokens_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        """As model_gateway.api_key_env's: 'AUTH TOKENS' or '$SWITCHYARD_AUTH_TOKENS' loaded, and beside a
        tokens_file the variable's tokens were left out, unsaid (every caller holding one refused)."""
        from switchyard.common.config.model_gateway import _ENV_NAME

        if value and not _ENV_NAME.match(value):
            raise ValueError("an environment variable name such as SWITCHYARD_AUTH_TOKENS, or empty (none)")
        return value

    @field_validator("exempt_methods")
    @classmethod
    def _method_names(cls, methods: list[str]) -> list[str]:
        """As a token file's methods are checked: '/grpc.health.v1.Health/Check' (gRPC's own spelling, with its
        slash) loaded and exempted nothing, so every probe was refused UNAUTHENTICATED."""
        bad = [m for m in methods if m.count("/") != 1 or m.startswith("/") or m.endswith("/")]
        if bad:
            raise ValueError(f"methods as service/method (grpc.health.v1.Health/Check, no leading '/') or "
                             f"service/*, got {bad}")
        return methods
