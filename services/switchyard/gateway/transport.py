"""aiohttp under httpx's client API: the upstream pool of ``model_gateway.http_transport`` "aiohttp".

httpx-aiohttp's :class:`~httpx_aiohttp.AiohttpTransport` carries httpx
requests over an aiohttp ``ClientSession``: aiohttp's connection pool and C
HTTP parser cost the dispatcher less CPU per stream than httpcore's pool,
which checks every pooled connection for each request it places
(docs/benchmarks.md). Two things are added here so that the gateway behaves
as it does on httpx's own transport:

- **Every aiohttp failure is an httpx error naming aiohttp's.** httpx-aiohttp
  maps connection, timeout and payload errors (their messages are given
  aiohttp's type here, and the httpx type httpcore raises for the same
  failure where httpx-aiohttp's misnames it: :func:`_httpx_kind`); the rest (``ClientResponseError`` for a bad
  status line or an over-long header, any other ``aiohttp.ClientError``)
  would escape the gateway's error table as INTERNAL. They become
  ``httpx.RemoteProtocolError`` (what httpcore raises for the same input), so
  they are retried, fall back and read "closed mid-response" as before.
- **Headers as long as httpx accepts.** aiohttp refuses a header line over
  8,190 bytes; h11 (httpx) takes up to 16 KiB per event. Large
  Content-Security-Policy or cookie headers from a proxy must not fail a call
  that httpx would serve: the limit here is :data:`MAX_HEADER_BYTES`.

Requests through a proxy do not come here: the client mounts httpx's own
transport for proxied URLs (:func:`switchyard.gateway.proxy.client_settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError
from httpx_aiohttp import AiohttpTransport

MAX_HEADER_BYTES = 65_536
"""Longest status or header line accepted, bytes (aiohttp's default is 8,190)."""


async def get_whole(http: httpx.AsyncClient, url: str, timeout_s: float, setting: str = "",
                    **kwargs: Any) -> httpx.Response:
    """``GET url`` with ``http`` (``kwargs``: its other arguments), its whole answer within ``timeout_s`` seconds.
    httpx's timeout bounds each read, not the answer: a server sending its answer a byte at a time (a slow-loris, a
    hung server behind a proxy that keeps the response alive) held the read for as long as it went on. For the
    answers read whole: the model list (the client's, doctor's), the pool's ``/metrics`` reads and health checks.

    Raises:
        httpx.HTTPError: the transport failed; httpx.ReadTimeout, naming ``timeout_s`` and ``setting`` (the key
            that sets it, "": none named), when the whole answer did not come in time.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await http.get(url, **kwargs)
    except TimeoutError:
        named = f" ({setting})" if setting else ""
        raise httpx.ReadTimeout(f"no whole answer within {timeout_s:g} s{named}") from None


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except aiohttp.ClientError as exc:  # what httpx-aiohttp left unmapped
        raise httpx.RemoteProtocolError(describe(exc)) from exc
    except httpx.TransportError as exc:
        cause = exc.__cause__
        if not isinstance(cause, aiohttp.ClientError):
            raise
        raise _httpx_kind(exc, cause)(describe(cause)) from cause  # httpx attaches the request


def _httpx_kind(exc: httpx.TransportError, cause: aiohttp.ClientError) -> type[httpx.TransportError]:
    """The httpx error httpcore raises for what aiohttp raised as ``cause``. httpx-aiohttp maps every
    ``ClientConnectionError`` that is not a timeout to ``ConnectTimeout``: a refused connection
    (``ClientConnectorError``; httpcore: ``ConnectError``), and also a connection made and then closed
    (``ServerDisconnectedError``, a server that closes before its headers; httpcore: ``RemoteProtocolError``)
    or reset (``ClientOSError``; httpcore: ``ReadError``). Those two read as an endpoint that cannot be reached
    (marked down in a pool, "start the model server") when it had answered the connection."""
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError
    if isinstance(exc, httpx.ConnectTimeout) and not isinstance(cause, TimeoutError):
        return httpx.RemoteProtocolError if isinstance(cause, aiohttp.ServerDisconnectedError) else httpx.ReadError
    return type(exc)


def describe(exc: aiohttp.ClientError) -> str:
    """aiohttp's error as one line naming its type. A body cut short reads "the response ended before its body
    did (<the parser's words>)": aiohttp quotes its parser's error there with the parser's own code, 400, which
    reads as an HTTP status no server sent."""
    inner = exc.__cause__
    if isinstance(exc, aiohttp.ClientPayloadError) and isinstance(inner, HttpProcessingError):
        return f"{type(exc).__name__}: the response ended before its body did ({type(inner).__name__}: {inner.message})"
    return f"{type(exc).__name__}: {exc}"


class _Body(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for chunk in self._inner:
                yield chunk

    async def aclose(self) -> None:
        with _as_httpx_errors():
            await self._inner.aclose()


class UpstreamTransport(AiohttpTransport):
    """:class:`AiohttpTransport` whose every failure is an httpx error, with httpx's header allowance.

    Args:
        verify: TLS verification, as httpx takes it (an ``ssl.SSLContext`` here).
        limits: pool size (``max_connections``) and idle keep-alive (``keepalive_expiry``).
    """

    def __init__(self, *, verify: object, limits: httpx.Limits) -> None:
        super().__init__(verify=verify, limits=limits, trust_env=False, client=self._session)  # type: ignore[arg-type]

    def _session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self.limits.max_connections or 0,
            keepalive_timeout=self.limits.keepalive_expiry,
            ssl=self.ssl_context,
        )
        return aiohttp.ClientSession(
            connector=connector, max_line_size=MAX_HEADER_BYTES, max_field_size=MAX_HEADER_BYTES
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with _as_httpx_errors():
            response = await super().handle_async_request(request)
        response.stream = _Body(response.stream)  # type: ignore[arg-type]
        return response
