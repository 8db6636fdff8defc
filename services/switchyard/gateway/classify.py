"""Map upstream HTTP statuses and httpx transport failures to the gateway's errors.

Every message passes through :func:`switchyard.gateway.redact.redact` so an
upstream that echoes the key cannot leak it.
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import Mapping

import grpc
import httpx

from switchyard.common import untrusted
from switchyard.gateway.errors import (
    BadUpstreamRequest,
    EndpointNotFound,
    GatewayError,
    ProxyUnavailable,
    StreamBroken,
    UpstreamAuthError,
    UpstreamRateLimited,
    UpstreamServerError,
    UpstreamTimeout,
    UpstreamUnavailable,
    snippet,
)
from switchyard.gateway.keys import ApiKey
from switchyard.gateway.proxy import ProxyRoute
from switchyard.gateway.redact import redact

_EXPIRED = re.compile(r"(?i)expired")
_MODEL_WORDS = re.compile(
    r"(?i)model[_ ]not[_ ]found|\bmodel\b.*(does not exist|not found|unknown|no such)|unknown model"
    r"|server is pinned to"  # transformers serve: 400 "Server is pinned to 'X'; requested 'Y'."
)


def upstream_message(body: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body itself."""
    try:
        payload = untrusted.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload))
        if isinstance(err, dict):
            return str(err.get("message") or err.get("code") or err)
        return str(err)
    return body.strip()


def is_model_not_found(status: int, body: str) -> bool:
    """True for a 404 (or 400/422, as some servers answer) whose body says the model is unknown."""
    return status in (400, 404, 422) and bool(_MODEL_WORDS.search(body))


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the upstream asked to wait, from ``retry-after-ms`` or ``Retry-After``; None when it did not say.

    ``Retry-After`` is delta-seconds or an HTTP-date (RFC 9110, section 10.2.3);
    ``retry-after-ms`` (milliseconds) is what OpenAI and Azure OpenAI send
    beside it. ``now`` is the wall clock (``time.time()``) for an HTTP-date.
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = (headers.get("retry-after") or "").strip()
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def error_for_status(
    status: int, body: str, headers: Mapping[str, str], *, url: str, model: str, key: ApiKey
) -> GatewayError:
    """The error for a non-2xx answer, other than an unknown model (see :func:`is_model_not_found`); every
    message names ``url`` (with a pool of replicas, which one answered)."""
    said = redact(upstream_message(body), key.value)
    quoted = snippet(said)
    if status in (401, 403):
        challenge = headers.get("www-authenticate", "")
        if _EXPIRED.search(said) or _EXPIRED.search(challenge):
            return UpstreamAuthError(
                f"upstream {status} from {url}: the OAuth token has expired (upstream said {quoted}); re-authenticate "
                f"to get a fresh token, or use an API key in {key.env}"
            )
        if key.value:
            what = "rejected the key" if status == 401 else "refused access with the key"
            detail = (f"{what} from {key.describe()} (upstream said {quoted}); check that {key.env} holds a valid "
                      f"key for this base URL and model {model!r}")
        else:  # no key was sent (model_gateway.api_key_required false): the server wants one
            detail = (f"refused a call sent without a key (upstream said {quoted}); it wants one: export "
                      f"{key.env}=<its key> (model_gateway.api_key_env)")
        auth = UpstreamAuthError(f"upstream {status}: {url} {detail}")
        if status == 403:  # a known key without the right: gRPC's own mapping of HTTP 403
            auth.code = grpc.StatusCode.PERMISSION_DENIED
        return auth
    if status == 404:
        return EndpointNotFound(
            f"upstream 404 for {url} (upstream said {quoted}); model_gateway.base_url must be the "
            "OpenAI-compatible root ending in /v1, e.g. http://127.0.0.1:8000/v1"
        )
    retry_after = retry_after_s(headers)
    if status == 429:
        wait = f"; it asked to retry after {retry_after:g} s" if retry_after is not None else ""
        error: GatewayError = UpstreamRateLimited(
            f"upstream 429 rate limit from {url} for model {model!r} (upstream said {quoted}){wait}; the dispatcher's "
            "adaptive concurrency limit backs off; raise the key's quota or lower model_gateway.concurrency.max_limit"
        )
        error.retry_after_s = retry_after
        return error
    if 400 <= status < 500 and status != 408:  # the request's own fault (400, 409, 413, 422, 451, ...)
        return BadUpstreamRequest(f"upstream {status} from {url} rejected the request for model {model!r}: {quoted}")
    if status >= 500:
        error = UpstreamServerError(
            f"upstream {status} from {url} for model {model!r} (upstream said {quoted}); the model server "
            "failed, retry later or check its logs"
        )
        error.retry_after_s = retry_after if status == 503 else None
        return error
    return UpstreamServerError(f"upstream answered {status} for {url}: {quoted}")


def error_for_transport(exc: httpx.HTTPError, *, url: str, proxy: ProxyRoute | None, key: ApiKey) -> GatewayError:
    """The error for an httpx failure (no HTTP status): proxy, connect, timeout, cut connection."""
    detail = redact(f"{type(exc).__name__}: {exc}".rstrip(": "), key.value)
    if isinstance(exc, httpx.ProxyError) or (
        proxy is not None and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    ):
        where = f"{proxy.variable}={proxy.address}" if proxy else "the configured proxy"
        return ProxyUnavailable(
            f"local proxy failed: {where} did not answer ({detail}) while calling {url}; start the proxy, fix "
            f"{proxy.variable if proxy else 'the proxy variable'}, or add the host to NO_PROXY"
        )
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamUnavailable(
            f"model gateway upstream unavailable at {url} ({detail}); start the model server "
            "(e.g. `switchyard serve sim-openai`) or fix model_gateway.base_url"
        )
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)):
        return UpstreamTimeout(
            f"upstream at {url} timed out ({type(exc).__name__}); raise model_gateway."
            f"{_timeout_key(exc)} or check the model server's load"
        )
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return StreamBroken(f"connection to {url} closed mid-response ({detail}); the upstream or a proxy cut it")
    return UpstreamUnavailable(f"request to {url} failed ({detail})")


def _timeout_key(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.WriteTimeout):
        return "write_timeout_s"
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout_s (or max_connections)"
    return "read_timeout_s"
