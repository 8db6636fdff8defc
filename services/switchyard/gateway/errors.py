"""The gateway's rows of the error table, as SwitchyardError subclasses with their gRPC status.

Each error says what was received and what to do. Two flags steer the client:
``retryable`` (tenacity retries the same model, before the first token only)
and ``fallback_ok`` (the fallback model may succeed where the primary failed).
Auth and proxy failures do neither: the same key and proxy serve every model.

Source of the table: docs/architecture.md "Errors users meet". The quoted phrases
("reading choices", "unexpected end of JSON input", "local proxy failed") are
the messages other gateways print for the same causes.
"""

from __future__ import annotations

import re

import grpc

from switchyard.common.errors import SwitchyardError

SNIPPET_CHARS = 200


def snippet(text: str | bytes, limit: int = SNIPPET_CHARS) -> str:
    """``text`` shortened to ``limit`` characters for an error message, as a repr."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


class GatewayError(SwitchyardError):
    """An upstream call failed; the message names the cause and the fix."""

    code = grpc.StatusCode.UNAVAILABLE
    origin = "upstream model"
    retryable = False
    fallback_ok = True
    tokens_sent = 0
    refuses_load = False
    """The upstream refused the call for its load (a 429, or a 503 or 529 from a server that is overloaded): the one
    rule by which the endpoint's limit backs off (:meth:`EndpointPool.finished`) and the dispatcher's stream loop
    queues the request again (:meth:`OpenAIEngine.refused_for_load`)."""
    retry_after_s: float | None = None
    """Seconds the upstream asked to wait before a retry (Retry-After), when it said."""
    overloaded_status: int | None = None
    """The status of a server's 'overloaded' answer (503, or Anthropic's 529: ``classify.OVERLOADED_STATUSES``)."""
    callers_deadline = False
    """The call ran out of its caller's time (``ChatRequest.timeout_s``), not the gateway's own bound: its caller
    gave up, as a cancel does (``switchyard_gateway_requests_total`` counts it ``CANCELLED``; the caller hears
    DEADLINE_EXCEEDED)."""

    def after_tokens(self, count: int) -> "GatewayError":
        """Mark that ``count`` items were already streamed: no retry, no fallback, message says so."""
        if count and not self.tokens_sent:
            self.tokens_sent = count
            self.retryable = False
            self.fallback_ok = False
            self.args = (
                f"{self.args[0]} (after {count} streamed item(s); not retried and no fallback, "
                "so no token is repeated)",
            )
        return self

    replica = ""
    """The replica of a pool that answered, by its place in ``model_gateway.pool.endpoints`` (from 1): what a
    tenant may read of which one it was (:meth:`from_replica`); "" for one endpoint or a DNS-resolved pool."""

    def from_replica(self, base_url: str, replica: str) -> "GatewayError":
        """Say which replica of a pool answered: ``(replica N)`` after the first URL under ``base_url`` (the
        endpoint's) that the message names, else ``(from replica N)`` at its end; nothing when ``replica`` is ""
        or it is said already. ``N`` is a place in the operator's list, never an address: where the orchestrator
        hides the URL from a tenant (``the model server``), the replica stays, so a tenant of a pool can tell a
        failing replica from the others (each read "the model server" alike)."""
        if not replica or self.replica:
            return self
        self.replica = replica
        message = self.args[0]
        found = re.search(re.escape(base_url) + r"[^\s'\"<>`]*", message) if base_url else None
        if found is None:
            self.args = (f"{message} (from replica {replica})",)
            return self
        start, end = found.span()
        while end > start and message[end - 1] in ".,;:!?)]}":  # a sentence's or a parenthesis' end, not the URL's
            url, opener = message[start:end], {")": "(", "]": "[", "}": "{"}.get(message[end - 1])
            if opener is not None and url.count(opener) >= url.count(message[end - 1]):
                break  # the URL's own bracket
            end -= 1
        self.args = (f"{message[:end]} (replica {replica}){message[end:]}",)
        return self

    def naming(self, url: str) -> "GatewayError":
        """Say which upstream answered (``url``), where the message does not already: with a pool of
        replicas, the one that failed."""
        if url not in self.args[0]:
            self.args = (f"{self.args[0]} (from {url})",)
        return self

    def with_note(self, note: str) -> "GatewayError":
        """Append ``note`` (e.g. what the fallback model did) to the message."""
        self.args = (f"{self.args[0]}; {note}",)
        return self


class UpstreamAuthError(GatewayError):
    """401/403, a missing key, a key with whitespace, or an expired OAuth token."""

    code = grpc.StatusCode.UNAUTHENTICATED
    fallback_ok = False


class ModelNotFound(GatewayError):
    """The upstream does not serve the model id: a 404, or a 400/422 naming the model while
    ``GET /v1/models`` does not list it (``transformers serve``: "Server is pinned to ...").

    ``setting``: the setting that named ``model`` where the request did not (``model_gateway.default_model``, or
    the variable that overrides it: :func:`~switchyard.gateway.classify.model_key`), for the fix to name; "" when
    the request named it. ``served``: the ids ``/v1/models`` lists (None when it could not be read); the message
    names up to ten of them. ``named_as``: who named ``model`` by another name that ``model_gateway.model_map``
    mapped to it, and that name (``"the request's 'sonnet'"``, ``"model_gateway.fallback_model 'fast'"``: the
    message names both, as the one who wrote it knows it); "" when ``model`` was named as it is.
    """

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, model: str, nearest: str | None, detail: str = "",
                 served: list[str] | None = None, named_as: str = "", setting: str = "") -> None:
        where = f"{setting} (or name it in the request)" if setting else "the request or in model_gateway.model_map"
        hint = (
            f"did you mean {nearest!r}? set it in {where}"
            if nearest
            else "list the ids with GET /v1/models (switchyard doctor does) and use one of them"
            + (f" in {setting}" if setting else "")
        )
        tail = f" (upstream said {detail})" if detail else ""
        listed = ""
        if served is not None:
            shown = ", ".join(repr(m) for m in served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
            listed = f"; the server serves {shown or 'no model'}"
        mapped = f" ({named_as}, through model_gateway.model_map)" if named_as else ""
        super().__init__(f"model {model!r}{mapped} not found upstream{tail}{listed}; {hint}")
        self.model = model
        self.nearest = nearest
        self.served = served


class EndpointNotFound(GatewayError):
    """404 on a path: the base URL is likely wrong (missing or doubled /v1), or the server there serves no chat
    completions (it lists the model all the same)."""

    code = grpc.StatusCode.NOT_FOUND
    fallback_ok = False


class BadUpstreamRequest(GatewayError):
    """400/413/422 (and the other 4xx no row of :func:`~switchyard.gateway.classify.error_for_status` names): the
    upstream refused the request body; names the field when it says which.

    The request's own fault (too long for the context window, a bad field): another
    model would refuse it too, or worse accept it silently, so it never falls back.
    """

    code = grpc.StatusCode.INVALID_ARGUMENT
    fallback_ok = False


class ContextWindowExceeded(BadUpstreamRequest):
    """The upstream refused the call as too long for the model's context window
    (:func:`~switchyard.gateway.classify.too_long_for_context`), under whatever status it came with.

    Args:
        message: what the upstream said, and the fix.
        server_prompt_tokens: the prompt as the server counted it, where its words say
            (:func:`~switchyard.gateway.classify.server_prompt_tokens`); None where they do not.
        model: the upstream model id the call was sent as (the one whose window it is).
    """

    def __init__(self, message: str, server_prompt_tokens: int | None = None, model: str = "") -> None:
        super().__init__(message)
        self.server_prompt_tokens = server_prompt_tokens
        self.model = model


class UpstreamRateLimited(GatewayError):
    """429: the upstream is rate limiting this key or model."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True
    refuses_load = True


class UpstreamQuotaExhausted(GatewayError):
    """402 Payment Required, or OpenAI's 429 ``insufficient_quota``: the account behind the key has no credit or
    quota left. FAILED_PRECONDITION (gRPC's code for "do not retry until the system state has been explicitly
    fixed"), not RESOURCE_EXHAUSTED, which says retry later: a top-up fixes it, not waiting. Not retried, and no
    fallback: the same key and account serve every model."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    fallback_ok = False


class UpstreamConflict(GatewayError):
    """409 Conflict: the request met the state of something the server holds (a request id still in flight, as a
    server that keys requests by ``X-Request-Id`` may answer). ABORTED, gRPC's code for a conflict retried at a
    higher level; retried here at once, since each attempt goes under its own request id."""

    code = grpc.StatusCode.ABORTED
    retryable = True


class UpstreamRetryLater(GatewayError):
    """421 Misdirected Request or 425 Too Early: the server asks for the same request again, over another
    connection or once the connection's handshake is done. UNAVAILABLE, retried."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class UpstreamGone(GatewayError):
    """410 Gone: what the request named (a retired model, a removed route) is gone for good. NOT_FOUND, not
    retried; the fallback model may be served."""

    code = grpc.StatusCode.NOT_FOUND


class UpstreamNotImplemented(GatewayError):
    """501 Not Implemented: the server does not support what the request needs (a feature llama.cpp serves only
    with a flag, say). UNIMPLEMENTED, not retried; the fallback model may support it."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ProxyAuthRequired(GatewayError):
    """407 Proxy Authentication Required: the proxy named by HTTP_PROXY/HTTPS_PROXY wants credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED
    origin = "proxy"
    fallback_ok = False


class UpstreamServerError(GatewayError):
    """5xx from the upstream (a 503 or 529 says it refuses load: ``refuses_load``)."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class UpstreamUnavailable(GatewayError):
    """The base URL did not answer (refused, DNS, TLS, connect timeout)."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True
    fallback_ok = False


class EndpointMarkedDown(UpstreamUnavailable):
    """A pool's endpoint was marked down (its ``/metrics`` read failed) while a call on it waited for its first
    item: the call goes to another endpoint."""


class ProxyUnavailable(GatewayError):
    """The proxy named by HTTP_PROXY/HTTPS_PROXY did not answer ("local proxy failed")."""

    code = grpc.StatusCode.UNAVAILABLE
    origin = "proxy"
    retryable = True
    fallback_ok = False


class UpstreamTimeout(GatewayError):
    """The upstream went silent longer than read_timeout_s (UNAVAILABLE) or total_timeout_s (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class StreamBroken(GatewayError):
    """The SSE stream was cut: the connection broke (this class), the body ended before any ``finish_reason``
    and without ``data: [DONE]`` (:class:`NoEndMarker`), or the server ended it with an error that reads as a
    broken stream (:class:`UpstreamStreamError`). All three are retried alike before the first token."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class NoEndMarker(StreamBroken):
    """The body ended cleanly before any choice carried a ``finish_reason`` and without ``data: [DONE]``."""


class UpstreamStreamError(StreamBroken):
    """The server sent an error object inside the stream (vLLM's failure mid-answer, an ``event: error``,
    llama.cpp's ``error:`` line) with no status, a 408 or a 5xx other than 503 and 529: it failed the request
    itself."""


class StreamProtocolError(GatewayError):
    """A chunk is not JSON, has no ``choices``, or the stream flag was not honoured."""

    code = grpc.StatusCode.INTERNAL


class ModelCoolingDown(GatewayError):
    """The model's circuit is open after repeated upstream failures: skipped until its cooldown passes."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = False
    fallback_ok = True


class NoEndpointUp(GatewayError):
    """Every endpoint of ``model_gateway.pool`` is down (or failed this call before its first token)."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True
    fallback_ok = False


class UpstreamAskedToWait(ModelCoolingDown):
    """The model asked (Retry-After on a 429 or 503) for no request before a time that has not come.

    Refused locally with the upstream's own status (RESOURCE_EXHAUSTED after a 429, UNAVAILABLE after a
    503); ``retry_after_s`` is the time left, so a retry waits it out or, when it is longer than
    ``model_gateway.retry_after_max_s`` or the call's time left, the fallback model is asked instead.
    """

    retryable = True
    fallback_ok = True
