"""Bearer-token authentication at the edge (the orchestrator's AgentService).

A caller sends gRPC metadata ``authorization: Bearer <token>``. Tokens come
from a file (``auth.tokens_file``, one per line) and/or an environment
variable (``auth.tokens_env``, comma-separated), read once at start-up. A line
may restrict its token to some methods: ``<token> agent.AgentService/GetTaskStatus
agent.AgentService/SubmitTask`` (``agent.AgentService/*`` for a whole service);
a token alone may call every method. A line may also name the token's tenant,
``<token> tenant=acme [methods ...]``: the tenant of every task the token
submits (common/tenant.py), which an ``x-tenant-id`` header cannot change.

- no ``authorization``, or not ``Bearer <token>``: UNAUTHENTICATED;
- a token that is not known: UNAUTHENTICATED;
- a known token not allowed the method: PERMISSION_DENIED.

Tokens are compared with :func:`hmac.compare_digest` against every known token
(no early exit), so the time taken does not reveal how much of a guess was
right. A token never appears in a log line, span, metric or error message.
Methods in ``auth.exempt_methods`` (health checks by default, so probes need no
token) skip the check. A refused call of any kind (unary, server-streaming,
client-streaming, bidirectional such as reflection's ServerReflectionInfo) is
answered at once, without waiting for a message from the caller. ``switchyard_auth_failures_total{reason}`` counts refusals.
"""

from __future__ import annotations

import hmac
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import grpc
from prometheus_client import Counter

from switchyard.common import envs
from switchyard.common.config import AuthConfig
from switchyard.common.errors import ORIGIN_KEY
from switchyard.common.tenant import TENANT_PATTERN
from switchyard.common.untrusted import undecodable_byte
from switchyard.common.tenant import EXPECTED as TENANT_EXPECTED

log = logging.getLogger(__name__)

AUTH_FAILURES = Counter(
    "switchyard_auth_failures_total",
    "Calls refused at the edge, by reason: missing (no authorization metadata), malformed (not 'Bearer "
    "<token>'), unknown_token, forbidden (the token may not call the method).",
    ["reason"],
)
REASONS = ("missing", "malformed", "unknown_token", "forbidden")
for _reason in REASONS:
    AUTH_FAILURES.labels(_reason)


class AuthConfigError(ValueError):
    """The token sources cannot be read or hold no token (names the file or variable, never a token)."""


@dataclass(frozen=True)
class _Token:
    secret: bytes
    methods: tuple[str, ...]  # empty: every method
    tenant: str = ""  # empty: the token names no tenant

    def allows(self, method: str) -> bool:
        if not self.methods:
            return True
        name = method.lstrip("/")
        service = name.partition("/")[0]
        return any(m == name or m == f"{service}/*" for m in self.methods)


def _parse(lines: list[str], source: str) -> list[_Token]:
    tokens = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        tenants = [f.partition("=")[2] for f in fields[1:] if f.startswith("tenant=")]
        methods = [f for f in fields[1:] if not f.startswith("tenant=")]
        bad = [m for m in methods if m.count("/") != 1 or m.startswith("/")]
        if bad:
            raise AuthConfigError(f"{source} line {number}: expected '<token> [tenant=<id>] [service/method ...]', "
                                  f"methods as agent.AgentService/RunTask or agent.AgentService/*")
        if len(tenants) > 1 or (tenants and not TENANT_PATTERN.fullmatch(tenants[0])):
            raise AuthConfigError(f"{source} line {number}: expected at most one tenant=<id>, the id {TENANT_EXPECTED}")
        tokens.append(_Token(fields[0].encode(), tuple(methods), tenants[0] if tenants else ""))
    return tokens


def load_tokens(config: AuthConfig) -> list[_Token]:
    """The known tokens, from ``tokens_file`` and ``tokens_env``.

    Raises:
        AuthConfigError: the file cannot be read, a line is malformed, or no token is configured.
    """
    tokens: list[_Token] = []
    if config.tokens_file:
        try:
            raw = Path(config.tokens_file).read_bytes()
            text = raw.decode("utf-8-sig")  # a leading BOM, as some editors save UTF-8, is no token's
        except OSError as exc:
            from switchyard.common.config.loader import set_by_environment

            raise AuthConfigError(
                f"auth.tokens_file {config.tokens_file}{set_by_environment('orchestrator', 'auth.tokens_file')}: "
                f"{exc.strerror or exc}; expected a file this user can read, a token a line") from None
        except UnicodeDecodeError as exc:  # the line, never its bytes: they are a token's
            line = raw.count(b"\n", 0, exc.start) + 1
            raise AuthConfigError(f"auth.tokens_file {config.tokens_file} line {line}: expected UTF-8 text (a byte "
                                  "there is not UTF-8)") from None
        tokens += _parse(text.splitlines(), f"auth.tokens_file {config.tokens_file}")
    if config.tokens_env and (value := envs.read_secret(config.tokens_env)):
        if undecodable_byte(value) is not None:  # kept by Python as a surrogate escape: a token no header can carry
            raise AuthConfigError(f"the variable {config.tokens_env}: expected UTF-8 text (a byte of it is not UTF-8)")
        tokens += _parse(value.split(","), f"the variable {config.tokens_env}")
    if not tokens:
        raise AuthConfigError(
            f"auth is enabled but no token is configured: put tokens in auth.tokens_file ({config.tokens_file or 'unset'})"
            f" or in the variable {config.tokens_env or '(auth.tokens_env unset)'}"
        )
    return tokens


class BearerTokens:
    """The known tokens and the check of one call against them (gRPC metadata or an HTTP header alike).

    Args:
        config: ``orchestrator.auth``.

    Raises:
        AuthConfigError: see :func:`load_tokens`.
    """

    def __init__(self, config: AuthConfig) -> None:
        self._tokens = load_tokens(config)
        self.exempt = frozenset(config.exempt_methods)

    def __len__(self) -> int:
        return len(self._tokens)

    def token_for(self, method: str) -> str | None:
        """The first known token that may call ``method`` (``agent.AgentService/RunTask``); None when none may
        (exempt methods need none: None too)."""
        return next((t.secret.decode() for t in self._tokens if t.allows(method)), None)

    def check(self, method: str, authorization: str | Sequence[str] | None) -> tuple[grpc.StatusCode, str] | None:
        """None when ``authorization`` (``Bearer <token>``, None when absent; or every value the call carried,
        of which two different ones are refused as malformed: which one counts is not a proxy's order to
        decide) may call ``method`` (``agent.AgentService/RunTask``); else the refusal's (code, message),
        counted in ``switchyard_auth_failures_total``. Exempt methods always pass."""
        name = method.lstrip("/")
        if name in self.exempt or f"{name.partition('/')[0]}/*" in self.exempt:  # service/*, as a token's methods
            return None
        refused = self._refusal(method, authorization)
        if refused is None:
            return None
        reason, code, details = refused
        AUTH_FAILURES.labels(reason).inc()
        return code, details

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant the token in ``authorization`` (``Bearer <token>``) names; "" when it names none or is not
        known (a call that reached a handler passed :meth:`check` already)."""
        scheme, _, presented = str(authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip() or undecodable_byte(presented) is not None:
            return ""
        match = self._match(presented.strip().encode())
        return match.tenant if match is not None else ""

    def _match(self, secret: bytes) -> _Token | None:
        match = None
        for token in self._tokens:  # every comparison runs: no early exit
            if hmac.compare_digest(token.secret, secret) and match is None:
                match = token
        return match

    def _refusal(self, method: str, authorization: str | Sequence[str] | None
                 ) -> tuple[str, grpc.StatusCode, str] | None:
        if authorization is not None and not isinstance(authorization, str):
            values = {str(value) for value in authorization}
            if len(values) > 1:
                return ("malformed", grpc.StatusCode.UNAUTHENTICATED,
                        "'authorization' metadata was sent more than once, with different values: send one")
            authorization = values.pop() if values else None
        if authorization is None:
            return ("missing", grpc.StatusCode.UNAUTHENTICATED,
                    "missing 'authorization' metadata: send 'authorization: Bearer <token>'")
        if (byte := undecodable_byte(str(authorization))) is not None:  # an HTTP header's bytes, not UTF-8
            return ("malformed", grpc.StatusCode.UNAUTHENTICATED,
                    f"'authorization' metadata must be 'Bearer <token>' in ASCII (byte 0x{byte:02X} is not UTF-8)")
        scheme, _, presented = str(authorization).partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return ("malformed", grpc.StatusCode.UNAUTHENTICATED,
                    "'authorization' metadata must be 'Bearer <token>'")
        match = self._match(presented.strip().encode())  # UTF-8 once the byte check above passed
        if match is None:
            return "unknown_token", grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid"
        if not match.allows(method):
            return ("forbidden", grpc.StatusCode.PERMISSION_DENIED,
                    f"the bearer token may not call {method.lstrip('/')}")
        return None


class TokenGuarded(ABC):
    """A service whose edge checks bearer tokens (the orchestrator): what else it serves in its process (the
    HTTP face, ``/debug/pprof/profile``) is guarded by the same tokens."""

    @abstractmethod
    def bearer_tokens(self) -> BearerTokens | None:
        """The tokens, read once and shared; None with authentication off.

        Raises:
            AuthConfigError: authentication is on and no token can be read.
        """


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known bearer token (see the module docstring).

    Args:
        config: ``orchestrator.auth``, or the :class:`BearerTokens` already loaded from it.

    Raises:
        AuthConfigError: see :func:`load_tokens`.
    """

    def __init__(self, config: AuthConfig | BearerTokens) -> None:
        self.tokens = config if isinstance(config, BearerTokens) else BearerTokens(config)
        log.info("auth: bearer tokens required (%d known); exempt: %s", len(self.tokens),
                 ", ".join(sorted(self.tokens.exempt)) or "none")

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        values = [str(v) for k, v in (handler_call_details.invocation_metadata or ()) if k == "authorization"]
        refused = self.tokens.check(handler_call_details.method, values or None)
        if refused is None:
            return handler
        code, details = refused

        return refusing_handler(handler, code, details)


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s own kind that answers ``code`` at once.

    Of the same kind, so that a client-streaming or bidirectional call is answered
    as soon as it arrives: a unary-request handler put in its place would make grpc
    wait for the caller's first message, and a caller that sends none (a silent
    bidirectional client) would hang until its deadline. The request stream is never
    read.
    """
    trailers = ((ORIGIN_KEY, "orchestrator"),)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details, trailing_metadata=trailers)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details, trailing_metadata=trailers)
        yield  # pragma: no cover - abort raised above

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    kind = (bool(handler.request_streaming), bool(handler.response_streaming))
    behaviour = refuse_stream if kind[1] else refuse
    return kinds[kind](behaviour, handler.request_deserializer, handler.response_serializer)
