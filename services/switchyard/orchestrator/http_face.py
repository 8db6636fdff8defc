"""The orchestrator's HTTP face: AgentService as JSON and Server-Sent Events (aiohttp's server).

    POST /api/v1/agent/submit            SubmitTask     -> {"status":"accepted","queue_position":N,"task_id":...}
    POST /api/v1/agent/run               RunTask        -> text/event-stream, one event per TaskEvent
    GET  /api/v1/agent/{agent_id}/status GetTaskStatus  (the agent's latest task)
    GET  /api/v1/tasks/{task_id}         GetTaskStatus
    POST /api/v1/tasks/{task_id}/cancel  CancelTask     -> the task's status after it
    GET  /openapi.json                   the OpenAPI document (generated from http_models.py)
    GET  /healthz, /readyz               liveness, and readiness as gRPC health's agent.AgentService (503 naming why)
    OPTIONS <each path>                  a CORS preflight, where orchestrator.http.cors_allowed_origins lists origins

One path per request: each handler calls the servicer's own method
(:class:`OrchestratorService`) with an :class:`HttpCall` standing for the gRPC
context, so validation, the orchestration queue, the task store and the error
messages are the gRPC edge's. Bearer tokens are ``orchestrator.auth``'s (a
token restricted to methods may call the routes of those methods); TLS is
``server.tls`` (client certificates required under mTLS).

The headers ``X-Agent-Id`` and ``X-Priority`` fill ``agent_id`` and
``priority`` where the body leaves them out; the body's own fields win
(validation.py, :func:`apply_edge_headers`, the same rule as gRPC metadata).
``X-Tenant-Id`` names the task's tenant when the bearer token names none
(:func:`~switchyard.orchestrator.validation.edge_tenant`).

The submit and run bodies are JSON (``Content-Type: application/json``, else
415) of at most :attr:`HttpFace.body_max_bytes` (else 413); ``task_type`` is
required, and ``agent_id`` in the body or as ``X-Agent-Id`` (http_models.py).
Each route answers one media type (:data:`ANSWERS`: ``/run`` text/event-stream, every other route
application/json); a request whose ``Accept`` takes none of it (``Accept: application/json`` on ``/run``) is
refused 406 before its body is read, naming the header and the media type; no Accept header, or one taking
``*/*``, is served as before; the probes (``/healthz``, ``/readyz``) answer whatever the Accept. Errors are JSON on
every route.

Errors answer ``{"error": {"code", "message", "origin"}}`` (the message as the gRPC edge words it, internal
addresses hidden unless ``orchestrator.show_addresses_to_callers``: orchestrator/addresses.py) with the HTTP status
of the gRPC code (errors.HTTP_STATUS: 400, 401, 403, 404, 409, 429, 503, 504),
or the face's own: 405 (a wrong method), 406 (an Accept that takes none of the route's answer) and 501 (a method no route knows, a
Transfer-Encoding other than chunked alone) (UNIMPLEMENTED), 413, 415, 431 (a header line past 8190 bytes, or too many
header fields), 505 (a version other than HTTP/1.0 and HTTP/1.1; a request aiohttp's
parser refuses otherwise is 400) (INVALID_ARGUMENT), 417 (an Expect other than 100-continue, FAILED_PRECONDITION),
408 (the body not whole within
``orchestrator.http.body_read_timeout_s``, DEADLINE_EXCEEDED; the connection closes); a fault of the face is 500
(INTERNAL) and a TimeoutError out of a handler 504, in the same shape (:meth:`_JsonProtocolErrors.handle_error`).
408, 413, 501 and the parser's refusals close the connection.

Each write waits at most ``orchestrator.http.write_timeout_s`` for a client to take bytes
(:meth:`_JsonProtocolErrors._drain_helper`): past it the connection is aborted, and a RunTask stream's task
cancelled as on a disconnect. ``orchestrator.http.cors_allowed_origins`` (empty: off) lists the origins whose
browser pages may call the face: aiohttp-cors answers their preflights and marks the answers to them.
The ``accepted`` event's ``state`` is the state's lower-case name, as a submit answers it.
A stream that fails after its first event ends with an ``error`` event of the
same body. Each SSE event is ``event: <kind>`` (accepted, stage, token,
tool_call, tool_result, final, error) and ``data:`` the event as JSON (field
names as in agent.proto). A stream quiet for ``orchestrator.http.sse_keepalive_s`` while its task waits gets
a comment line (``:``, :class:`_KeepAlive`), so a client's or proxy's read timeout does not cut it. Each event
has an ``id`` (``<task_id>:<n>``, ``:end`` added on the last); a request carrying ``Last-Event-ID`` (an
EventSource-style client reconnecting) is answered 204 where that id ended its stream, else 409 (ABORTED): the
task is not run again, and a stream is not resumed (:func:`reconnection`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import re
import ssl
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable
from urllib.parse import unquote_to_bytes

import aiohttp_cors
import grpc
from aiohttp import ClientConnectionResetError, HttpVersion10, HttpVersion11, web, web_protocol
from aiohttp.helpers import parse_mimetype  # the Content-Type's parameters, a repeated one kept
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, HttpProcessingError, LineTooLong, PayloadEncodingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from pydantic import ValidationError

from switchyard import __version__
from switchyard.api import agent_pb2
from switchyard.common import http_telemetry, telemetry
from switchyard.common.config import SwitchyardConfig, TlsConfig
from switchyard.common.errors import HTTP_STATUS, ORIGIN_KEY, InvalidArgument, hop_of, status_for
from switchyard.common.metrics import SERVING
from switchyard.common.server import GRPC_SERVICES, Drains, HealthOwner
from switchyard.common.tasks import settle
from switchyard.common.untrusted import duplicate_key, shown
from switchyard.orchestrator.http_models import (CORS_REQUEST_HEADERS, EVENT_STREAM, EXPECTED, INT32_MAX, INT32_MIN,
                                                  PROBE_PATHS, TaskRequest, describe_error, message_dict, openapi, state_name,
                                                  status_json)
from switchyard.orchestrator.https_listener import HttpsSite
from switchyard.orchestrator.metrics import CLIENT_WRITE_TIMEOUTS
from switchyard.orchestrator.validation import AGENT_ID_HEADER, parse_priority

log = logging.getLogger(__name__)

SERVICE = GRPC_SERVICES["orchestrator"]
ROUTE_METHODS = {"submit": f"{SERVICE}/SubmitTask", "run": f"{SERVICE}/RunTask", "status": f"{SERVICE}/GetTaskStatus",
                 "cancel": f"{SERVICE}/CancelTask"}
"""The gRPC method each route stands for: what a bearer token restricted to methods must allow."""
JSON = "application/json"
TASK_BODY_ROUTES = frozenset({"submit", "run"})
"""The routes whose body is a task request (:meth:`HttpFace._task_request`)."""
ROUTES = {"submit": ("POST", "/api/v1/agent/submit"), "run": ("POST", "/api/v1/agent/run"),
          "status": ("GET", "/api/v1/agent/{agent_id}/status"), "task_status": ("GET", "/api/v1/tasks/{task_id}"),
          "cancel": ("POST", "/api/v1/tasks/{task_id}/cancel"), "openapi": ("GET", "/openapi.json"),
          "healthz": ("GET", "/healthz"), "readyz": ("GET", "/readyz")}
"""Route name -> (method, route template): the routes :meth:`HttpFace.app` serves, and the ``http_route``
label values of ``http_server_request_duration_seconds``."""
ANSWERS = {name: EVENT_STREAM if name == "run" else JSON for name in ROUTES}
"""Route name -> the media type of its answer: a request whose ``Accept`` takes none of it is refused 406
(:func:`acceptable`) before anything runs. Errors are JSON on every route (RFC 9110 section 15.5.7 lets an error
answer disregard ``Accept``), as the OpenAPI document says."""


PARSE_IN_THREAD_BYTES = 65536
"""A body longer than this is validated in a worker thread, off the event loop that serves every stream (the GIL
is handed back to the loop every few milliseconds while it runs); a shorter one costs less than the trip."""


class HttpAbort(Exception):
    """A call ended with a gRPC status (``HttpCall.abort``): its code, message and the hop that answered."""

    def __init__(self, code: grpc.StatusCode, details: str, origin: str, status: int | None = None) -> None:
        super().__init__(details)
        self.code, self.details, self.origin = code, details, origin
        self.status = HTTP_STATUS.get(code, 500) if status is None else status
        """The HTTP status of the answer: the code's (errors.HTTP_STATUS) unless the face says otherwise (413, 415)."""


class HttpCall:
    """What the servicer reads of a ``grpc.aio.ServicerContext``, for a call that came over HTTP.

    Args:
        headers: the request's headers; read as gRPC metadata (keys lower-case).
        max_tokens_sent: the body's ``max_tokens`` where it is past RunTaskRequest's int32 and the request
            carries it cut to that range (:func:`_wire_max_tokens`): a refusal quotes what was sent, not the cut.
    """

    def __init__(self, headers: Iterable[tuple[str, str]], max_tokens_sent: int | None = None) -> None:
        self._metadata = tuple((key.lower(), value) for key, value in headers)
        self._max_tokens_sent = max_tokens_sent

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        """No caller deadline: the task's own time limit (orchestrator.task_time_limit_s) bounds it."""
        return None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        """Raises :class:`HttpAbort` (as grpc's ``abort`` raises): always."""
        origin = dict(trailing_metadata or ()).get(ORIGIN_KEY, "orchestrator")
        sent = self._max_tokens_sent
        carried = f"(got {_wire_max_tokens(sent)})" if sent is not None else ""
        if carried and details.startswith("max_tokens: ") and details.endswith(carried):
            details = f"{details[:-len(carried)]}(got {sent})"
        raise HttpAbort(code, details, origin)


def _wire_max_tokens(value: int) -> int:
    """A body's ``max_tokens`` as RunTaskRequest's int32 carries it: one past that range cut to its end, which
    is past ``limits.max_tokens`` too (at most 1,000,000), so the servicer refuses it with the bound of every
    other max_tokens refusal (validation.max_tokens_refusal), and :class:`HttpCall` quotes the value sent."""
    return max(INT32_MIN, min(INT32_MAX, value))


def error_body(code: grpc.StatusCode, message: str, origin: str = "orchestrator") -> dict[str, Any]:
    return {"error": {"code": code.name, "message": message, "origin": origin}}


RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 or 503 answer, seconds (RFC 9110 section 10.2.3): a full backlog or a stopping
orchestrator has no time of its own to give; one second spaces the retries of a client that honours it."""


def _path_id(request: web.Request, name: str) -> str:
    """The id the path names in ``{name}``. A percent-escape that is not UTF-8 (``%FF``) is refused naming the
    byte: the URL library keeps it as the three characters ``%FF``, which is also what ``%25FF`` means, so two
    paths would name one id.

    Raises:
        HttpAbort: INVALID_ARGUMENT naming ``name`` and the byte.
    """
    for segment in request.raw_path.split("?", 1)[0].split("/"):
        try:
            unquote_to_bytes(segment).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, str(InvalidArgument(
                name, f"an id of UTF-8 text in the path (byte 0x{exc.object[exc.start]:02X} is not UTF-8)",
                segment)), "orchestrator") from None
    return request.match_info[name]


_CANNOT_DECODE = "Can not decode content-encoding: "
"""How aiohttp's decoder words a body it could not decode (``ContentEncodingError``), the coding after it."""


def _coding_refused(reason: str, coding: str | None = None) -> str:
    """The 400's message for a body not in the coding its ``Content-Encoding`` names: the coding and the
    decoder's ``reason`` (aiohttp's words, whitespace collapsed). ``coding`` None: read from ``reason``, as the
    parser's error names it (a deflate stream that never ended is ``ContentEncodingError('deflate')``, the
    coding's name alone, said here in full)."""
    reason = " ".join(reason.split())
    if coding is None:
        coding = reason[len(_CANNOT_DECODE):] if reason.startswith(_CANNOT_DECODE) else reason
    if reason == coding:
        reason = f"{_CANNOT_DECODE}{coding} (the body ended before its {coding} stream did)"
    return f"body: expected data in the coding its Content-Encoding names ({shown(coding)}): {reason}"


def _error(code: grpc.StatusCode, message: str, origin: str = "orchestrator", status: int | None = None) -> web.Response:
    status = HTTP_STATUS.get(code, 500) if status is None else status
    headers: dict[str, str] = {}
    # 408, 501: the body never arrived whole, or its coding is not read, and 413: a body the face will not read
    # (aiohttp still reads and drops what comes of it for up to 10 s, so the client can read this answer before
    # the close): the connection closes, and says so, so a client sends no further request on it
    closes = status in (408, 413, 501)
    if closes:
        headers["Connection"] = "close"
    elif status == 401:  # RFC 9110 section 11.6.1: a 401 names its scheme; RFC 6750 section 3: Bearer
        headers["WWW-Authenticate"] = 'Bearer realm="switchyard"'
    elif status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    response = web.json_response(error_body(code, message, origin), status=status, headers=headers or None)
    if closes:
        response.force_close()
    return response


def _code_of_status(status: int) -> grpc.StatusCode:
    """The gRPC code of an error answer aiohttp made with an HTTP status: the code errors.HTTP_STATUS maps to that
    status (the first, where several do), else INVALID_ARGUMENT for a 4xx and INTERNAL for a 5xx."""
    for code, mapped in HTTP_STATUS.items():
        if mapped == status:
            return code
    return grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL


def _abort_answer(exc: HttpAbort) -> web.Response:
    return _error(exc.code, exc.details, exc.origin, exc.status)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def event_bytes(event: agent_pb2.TaskEvent) -> bytes:
    """One TaskEvent as an SSE event. Tokens, most of a stream's events, are written directly (the same JSON
    as :func:`message_dict` gives, at a third of its cost); the rest through ``message_dict``."""
    kind = event.WhichOneof("event")
    if kind == "token":
        token = event.token
        return (f'event: token\ndata: {{"text":{json.dumps(token.text)},"index":{token.index},'
                f'"count":{token.count}}}\n\n').encode()
    data = message_dict(event)[kind]  # the set member of the oneof, as message_dict writes it
    if kind == "accepted":  # the state's lower-case name, as /submit and the status routes answer it
        data["state"] = state_name(event.accepted.state)
    return _sse(kind, data)


def acceptable(accept: list[str], media: str) -> bool:
    """Whether the ``Accept`` header fields ``accept`` (each a comma-separated list of media ranges) take
    ``media`` (``type/subtype``), as RFC 9110 section 12.5.1 reads them: no field, or only empty ones, takes
    anything; else the most specific range that matches ``media`` (``type/subtype`` over ``type/*`` over
    ``*/*``; ranges' other parameters are not told apart) decides, and a ``q`` of 0 refuses. A range that is not
    ``type/subtype``, or whose ``q`` is not a number from 0 to 1, matches nothing."""
    kind = media.split("/", 1)[0]
    best: tuple[int, float] | None = None  # (specificity, q) of the most specific matching range
    said = False
    for field in accept:
        for item in field.split(","):
            if not item.strip():
                continue
            said = True
            range_, *params = (part.strip() for part in item.split(";"))
            range_ = range_.lower()
            specific = {media: 3, f"{kind}/*": 2, "*/*": 1}.get(range_, 0)
            if not specific:
                continue
            q = 1.0
            for param in params:
                name, _, value = param.partition("=")
                if name.strip().lower() == "q":
                    try:
                        q = float(value.strip())
                    except ValueError:
                        q = -1.0
            if not 0 <= q <= 1:
                continue
            if best is None or specific > best[0] or (specific == best[0] and q > best[1]):
                best = (specific, q)
    return not said or (best is not None and best[1] > 0)


LAST_EVENT_ID = "Last-Event-ID"
"""The header an EventSource-style client reconnecting sends: the ``id`` of the last event it read (WHATWG HTML,
9.2.4). Such a client reconnects whenever a stream ends, the whole stream read included, and re-sends its POST."""
END_MARK = ":end"
"""The end of the ``id`` of a stream's last event (``final``, or the ``error`` that ends it)."""


def event_id(head: bytes, n: int, last: bool) -> bytes:
    """The ``id`` field of the ``n``-th event (0: accepted) of the stream whose :func:`id_head` is ``head``,
    marked with :data:`END_MARK` on the stream's last one: a client that reconnects after it read the whole
    stream, and one that lost the stream part way, are told apart by the id alone (:func:`reconnection`), with no
    state kept. A third of a microsecond per event (the head is made once per stream)."""
    return b"%s%d%s\n" % (head, n, _END_MARK if last else b"")


def id_head(task_id: str) -> bytes:
    """What every ``id`` field of task ``task_id``'s stream starts with."""
    return f"id: {task_id}:".encode()


_END_MARK = END_MARK.encode()


def reconnection(last_id: str) -> web.Response:
    """The answer to a RunTask request that carries ``Last-Event-ID``: 204 No Content, which tells an
    EventSource-style client to stop reconnecting (WHATWG HTML, 9.2.3), where that id ends a stream read whole;
    else 409 ABORTED: a stream is not resumed, because a RunTask whose connection closes is cancelled (its events
    are not kept). Before, the reconnection re-sent the POST, and the face ran the task again, every reconnection
    time, without end."""
    if last_id.endswith(END_MARK):
        return web.Response(status=204)
    return _error(grpc.StatusCode.ABORTED, f"{LAST_EVENT_ID}: a RunTask stream is not resumed (got "
                  f"{shown(last_id)}, not its last event): a RunTask is cancelled when its connection closes, "
                  "and its events are not kept. POST without "
                  f"{LAST_EVENT_ID} to run the task again, or submit it (POST /api/v1/agent/submit) and read "
                  "GET /api/v1/tasks/{task_id}, which outlive a connection")


KEEPALIVE = b":\n\n"
"""An SSE comment line (and the blank line that ends it): every SSE parser skips it (WHATWG HTML, 9.2.6)."""


class _KeepAlive:
    """The writes of one SSE stream, with :data:`KEEPALIVE` written whenever the stream has been quiet for
    ``every_s`` while its handler waits for the task's next event (:meth:`next_event`): a stream whose task waits
    (in a queue, on a tool, through a long prefill) sends bytes, so a client or proxy with a read timeout
    (httpx's default 5 s, nginx's ``proxy_read_timeout`` 60 s) does not cut it, as gRPC's own keepalive pings
    keep a RunTask call. One timer per stream, rearmed each ``every_s``; nothing per event but a clock read."""

    def __init__(self, response: web.StreamResponse, every_s: float) -> None:
        self._response = response
        self._every_s = every_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._idle = False
        self._writing: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(every_s, self._tick)

    def _tick(self) -> None:
        quiet_s = self._loop.time() - self._last
        if quiet_s >= self._every_s and self._idle and (self._writing is None or self._writing.done()):
            self._writing = self._loop.create_task(self._response.write(KEEPALIVE))
            self._writing.add_done_callback(_ignore_a_left_client)
            self._last, quiet_s = self._loop.time(), 0.0
        # quiet for a period and still no keepalive (an event's or a keepalive's write waits for a slow reader):
        # ask again a period later, not at once (re-armed with no delay, the timer ran every turn of the loop)
        wait_s = self._every_s - quiet_s
        self._timer = self._loop.call_later(wait_s if wait_s > 0 else self._every_s, self._tick)

    async def next_event(self, events: AsyncIterator[agent_pb2.TaskEvent]) -> agent_pb2.TaskEvent | None:
        """The task's next event, None after the last; a keepalive may be written while it is waited for."""
        self._idle = True
        try:
            return await anext(events, None)
        finally:
            self._idle = False

    async def write(self, data: bytes) -> None:
        """Write ``data`` once any keepalive being written is out (one writer at a time)."""
        if self._writing is not None:
            await self._writing
            self._writing = None
        await self._response.write(data)
        self._last = self._loop.time()

    async def stop(self) -> None:
        """No more keepalives; one still being written is cancelled and waited for (its outcome is read by its
        done callback). A cancel of the handler meanwhile is not swallowed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            writing, self._writing = self._writing, None
            if not writing.done():
                writing.cancel()
            await asyncio.wait([writing])


def _ignore_a_left_client(task: "asyncio.Task[None]") -> None:
    """Read a keepalive write's outcome: a client that left is the handler's to notice, not an error to log."""
    if not task.cancelled():
        exc = task.exception()
        if exc is not None and not isinstance(exc, ConnectionResetError):
            log.warning("HTTP face: an SSE keepalive failed: %r", exc)


def tls_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The server's TLS context from ``server.tls`` (None when off): its certificate, and under mTLS the CA
    that must sign client certificates.

    Raises:
        ConfigError-like ``ssl.SSLError``/``OSError``: a file cannot be read (the message names it).
    """
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.require_client_auth:
            context.load_verify_locations(cafile=tls.ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"server.tls for the HTTP face: {exc}") from exc
    return context


CONTENT_CODINGS = ("identity", "gzip", "deflate", "br")
"""Request body codings the face reads (aiohttp decodes them as the body comes; br with the Brotli package, in the
lock for this): another is refused 415 rather than read as if it were JSON."""

MAX_FIELD_BYTES = 8190
"""aiohttp's bound on one header line (and the request line), bytes: past it the request is refused as
431 (:class:`_JsonProtocolErrors`)."""


HTTP_VERSIONS = (HttpVersion10, HttpVersion11)
"""The versions of HTTP the face speaks: a request line naming another is refused 505 (RFC 9110 section 15.6.6)."""
VERSION_EXPECTED = "version: expected HTTP/1.0 or HTTP/1.1 (HTTP/2 is not served on this port)"


class _UnsupportedVersion(BadHttpMessage):
    """A request line of a version outside :data:`HTTP_VERSIONS` (HTTP/2.0, HTTP/0.9: aiohttp's parser reads
    both, and its answer echoed the version, ``HTTP/2.0 200 OK`` in HTTP/1.1's framing)."""


class _JsonProtocolErrors(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering a request its parser refused (a header or request line past
    :data:`MAX_FIELD_BYTES`, too many headers, a malformed request, a version of HTTP other than 1.0 and 1.1)
    in the face's JSON error shape: INVALID_ARGUMENT, 431 for a line too long, 505 for the version, else 400,
    with the parser's reason, logged as one line without a traceback (a client's mistake, not the server's).
    Other errors are aiohttp's own."""

    def data_received(self, data: bytes) -> None:
        """aiohttp's, with each request just parsed of a version outside :data:`HTTP_VERSIONS` turned into the
        parser's refusal (:meth:`handle_error`) before any route, token check or ``Expect`` sees it."""
        parsed = len(self._messages)  # aiohttp's queue of parsed requests: only appended to below
        super().data_received(data)
        for i in range(parsed, len(self._messages)):
            message, _ = self._messages[i]
            if isinstance(message, RawRequestMessage) and message.version not in HTTP_VERSIONS:
                got = f"HTTP/{message.version.major}.{message.version.minor}"
                refusal = _UnsupportedVersion(f"b'{message.method} {message.path} {got}'")
                self._messages[i] = (web_protocol._ErrInfo(status=400, exc=refusal, message=refusal.message),
                                     EMPTY_PAYLOAD)

    write_timeout_s: float = 30.0
    """The longest one write may wait for the client to take bytes, seconds (``orchestrator.http.write_timeout_s``;
    set by :class:`_JsonErrorServer` on each connection)."""

    async def _drain_helper(self) -> None:
        """aiohttp's wait for room in the socket's buffers, bounded by :attr:`write_timeout_s`: every write of the
        face past 64 KiB unsent waits here (an SSE event, a keepalive, a JSON body, the end of a stream). A client
        that stops reading without closing held the handler, its RunTask stream and the task without end once its
        buffers filled. Past the bound the connection is aborted (its unsent bytes dropped, as they would never
        leave), counted, and the write raises ConnectionResetError, the error of a client that left: the stream
        ends and its task is cancelled as on a disconnect.

        Raises:
            ClientConnectionResetError: the client took no bytes for :attr:`write_timeout_s`, or is gone.
        """
        if self.transport is None or not self._paused:
            return await super()._drain_helper()  # gone: raises; room: returns
        waiter = self._drain_waiter  # aiohttp's future, set when the transport has room again (or is lost)
        if waiter is None:
            waiter = self._drain_waiter = self._loop.create_future()
        # asyncio.wait, not a timeout around aiohttp's await: the waiter is one future for every writer waiting,
        # and a timeout would cancel it under them all
        done, _ = await asyncio.wait([waiter], timeout=self.write_timeout_s)
        if done:
            return waiter.result()  # ConnectionError where the connection was lost meanwhile
        if self.transport is not None:
            CLIENT_WRITE_TIMEOUTS.labels("http").inc()
            log.warning("HTTP face: the client %s took no bytes for %g s (orchestrator.http.write_timeout_s): its "
                        "connection is closed", self.transport.get_extra_info("peername"), self.write_timeout_s)
            self.transport.abort()  # its end wakes every other writer waiting, whose writes then fail as this one
        raise ClientConnectionResetError(f"the client took no bytes for {self.write_timeout_s:g} s "
                                         "(orchestrator.http.write_timeout_s)")

    def close_without_lingering(self) -> None:
        """Close the connection right after the answer being made now, without aiohttp's lingering read of
        the request's unread body (up to ``lingering_time``, 10 s): a client whose body stalled sends no
        more, and lingering held its connection (and the face's slot) that long after the 408; a body that is
        not in its Content-Encoding cannot be read on, and lingering raised its decoding error once more."""
        self._lingering_time = 0.0  # this connection's: aiohttp then closes it once the answer is written

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or status != 400:
            # A handler's fault (500) or a TimeoutError out of one (504): aiohttp logs it (with its traceback)
            # and refuses once an answer began; its own answer was text/plain or HTML, outside the error family.
            super().handle_error(request, status, exc, message)
            code, detail = ((grpc.StatusCode.DEADLINE_EXCEEDED, "request: the face's handler ran out of time")
                            if status == 504 else
                            (grpc.StatusCode.INTERNAL, "request: the HTTP face failed answering it (logged on the "
                             "server); retry, or report it with the time"))
            response = web.json_response(error_body(code, detail), status=status, headers={"Connection": "close"})
            response.force_close()
            return response
        code = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(exc, LineTooLong) or "too long" in str(exc.message).lower():
            status, detail = 431, (f"headers: a header line (or the request line) is past {MAX_FIELD_BYTES} bytes; "
                                   "send large values in the body")
        elif "too many headers" in str(exc.message).lower():  # RFC 6585 section 5: the fields together
            status, detail = 431, "headers: too many header fields; send large values in the body"
        elif isinstance(exc, _UnsupportedVersion) or "invalid http version" in str(exc.message).lower():
            # RFC 9110 section 15.6.6; the answer's status line is HTTP/1.0's, as for every request refused here
            sent = _SENT_VERSION.search(str(exc.message))
            status, detail = 505, f"{VERSION_EXPECTED} (got {sent.group(1) if sent else 'another'})"
        elif H2_PREFACE_REFUSED in str(exc.message):
            # HTTP/2 with prior knowledge (curl --http2-prior-knowledge, a gRPC client given this port): llhttp
            # stops at its preface, 'PRI * HTTP/2.0', and its words read as a malformed HTTP/1.1 request (400)
            status, detail = 505, f"{VERSION_EXPECTED} (got HTTP/2.0; gRPC is served on the orchestrator's port)"
        elif isinstance(exc, PayloadEncodingError):  # the parser decodes as it reads: a body not in its coding
            detail = _coding_refused(str(exc.message))
        elif isinstance(exc, BadHttpMethod) and _REQUEST_LINE.search(str(exc.message)):
            # RFC 9110 section 15.6.2: a well-formed request line whose method the server does not know
            code, status, detail = (grpc.StatusCode.UNIMPLEMENTED, 501,
                                    "method: expected GET, HEAD or POST (the methods this face serves; see /openapi.json)")
        else:
            detail = f"request: not a well-formed HTTP/1.1 request ({exc.message})"  # to its own client only
        # The parser's reason quotes the request's bytes (a header, perhaps a token): the log names its kind only.
        log.warning("HTTP face: refused a request from %s: %d (%s)", request.remote, status, type(exc).__name__)
        http_telemetry.observe_refused(status)  # no route, no middleware: the parser refused it
        # the rest of the connection's bytes cannot be trusted to start a request: closed, and said so (the answer
        # is HTTP/1.0's, no request line having been read, where a close is the default; a client reads it anyway)
        response = web.json_response(error_body(code, detail), status=status, headers={"Connection": "close"})
        response.force_close()
        return response


H2_PREFACE_REFUSED = "Pause on PRI/Upgrade"
"""How aiohttp's C parser (llhttp) refuses the HTTP/2 connection preface, ``PRI * HTTP/2.0``: the one request
line it stops at rather than reading its version (aiohttp's Python parser reads it as version 2.0)."""
_SENT_VERSION = re.compile(r" (HTTP/[^\s']{0,16})'")
"""The version of a request line as the parser quotes it (``b'GET / HTTP/1.2'``)."""
_REQUEST_LINE = re.compile(r"b'[!#$%&*+.^_`|~0-9A-Za-z-]+ \S+ HTTP/\d\.\d'")
"""A request line as the parser quotes it (``b'FOO / HTTP/1.1'``): method, target, version. A line of another
shape (``GARBAGE``) is a malformed request (400), not an unknown method (501)."""


class _JsonErrorServer(web.Server):
    """aiohttp's server, its connections handled by :class:`_JsonProtocolErrors`."""

    write_timeout_s: float = 30.0
    """Each connection's :attr:`_JsonProtocolErrors.write_timeout_s` (set by :class:`_Runner`)."""

    def __call__(self) -> web_protocol.RequestHandler:
        handler = _JsonProtocolErrors(self, loop=self._loop, **self._kwargs)
        handler.write_timeout_s = self.write_timeout_s
        return handler


class _Runner(web.AppRunner):
    """An AppRunner whose server is a :class:`_JsonErrorServer` (the application's own server, its class
    changed: the same handler, request factory and settings), its writes bounded by ``write_timeout_s``."""

    def __init__(self, app: web.Application, *, write_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._write_timeout_s = write_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        server.write_timeout_s = self._write_timeout_s
        return server


CORS_EXPOSED_HEADERS = ("Retry-After", "WWW-Authenticate", "Allow")
"""The answer headers such a page may read beyond the CORS-safelisted ones (Content-Type among them)."""
CORS_MAX_AGE_S = 600
"""How long a browser may keep a preflight's answer, seconds (Access-Control-Max-Age; Chromium caps it at 7200)."""


async def _vary_on_origin(request: web.Request, response: web.StreamResponse) -> None:
    """``Vary: Origin`` on an answer that names its caller's origin in Access-Control-Allow-Origin (aiohttp-cors
    echoes the origin and leaves Vary alone): a shared cache must not hand it to a page of another origin (Fetch
    standard, section 3.2.5)."""
    if "Access-Control-Allow-Origin" in response.headers:
        vary = response.headers.get("Vary")
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


class HttpFace(Drains, HealthOwner):
    """The HTTP face of ``service``, run by the server bootstrap beside its gRPC server (a Service:
    started after it, drained and stopped before it).

    Args:
        service: the orchestrator's servicer (started).
        config: ``orchestrator.http`` gives the port, ``server`` the host and TLS.
        port: overrides ``orchestrator.http.port`` (0: a free port).
        tracer_provider: the provider of the requests' SERVER spans (common/http_telemetry.py); None: the
            global one, and no spans while :func:`telemetry.tracing_enabled` is false.
    """

    name = "orchestrator-http"
    grpc_service_names: tuple[str, ...] = ()

    def __init__(self, service: Any, config: SwitchyardConfig, port: int | None = None,
                 tracer_provider: Any = None) -> None:
        self.service = service
        self.tracer_provider = tracer_provider
        self.config = config
        self.port = config.orchestrator.http.port if port is None else port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        limits = config.limits
        self._openapi = json.dumps(openapi(__version__, limits.max_tokens, limits.max_id_chars,
                                           limits.max_task_id_chars,
                                           cors=bool(config.orchestrator.http.cors_allowed_origins))).encode()
        self._expected = {**EXPECTED, "max_tokens": f"an integer from 0 (the default, {limits.default_max_tokens}, "
                          f"at most half the model's context window) to the lesser of limits.max_tokens "
                          f"({limits.max_tokens}) and the model's context window less the prompt's tokens"}
        """What each body field takes, with this face's limits in the words (:func:`describe_error`)."""

    def register(self, server: grpc.aio.Server) -> None:
        """Nothing on the gRPC server."""

    @property
    def body_max_bytes(self) -> int:
        """The largest request body read, bytes: room for the largest payload and metadata however their JSON
        is written, plus the rest of the body. A character takes up to 12 bytes in JSON (one outside the Basic
        Multilingual Plane written as two ``\\uXXXX`` escapes, as Python's ``json.dumps`` writes it by default;
        RFC 8259 section 7), a metadata byte of UTF-8 up to 3 (a 4-byte character in 12)."""
        limits = self.config.limits
        return 12 * limits.max_payload_chars + 3 * limits.max_metadata_bytes + 65536

    def app(self) -> web.Application:
        """The application: the HTTP server telemetry middleware outermost (every answer measured, 401s
        included), then bearer tokens, then the routes."""
        provider = self.tracer_provider
        measure = http_telemetry.middleware(ROUTES.values(), provider,
                                            traced=lambda: provider is not None or telemetry.tracing_enabled())
        app = web.Application(middlewares=[measure, self._authenticate], client_max_size=self.body_max_bytes)
        handlers = {"submit": self.submit, "run": self.run, "status": self.agent_status,
                    "task_status": self.task_status, "cancel": self.cancel, "openapi": self.openapi,
                    "healthz": self.healthz, "readyz": self.readyz}
        for name, (method, path) in ROUTES.items():
            expect = self._expect_task_body if name in TASK_BODY_ROUTES else self._expect
            if method == "GET":  # and HEAD, wherever GET is served (RFC 9110 section 9.3.2)
                app.router.add_get(path, handlers[name], name=name, expect_handler=expect)
            else:
                app.router.add_route(method, path, handlers[name], name=name, expect_handler=expect)
        origins = self.config.orchestrator.http.cors_allowed_origins
        if origins:  # aiohttp-cors: a preflight route on each path, and its headers on each answer to an origin listed
            options = aiohttp_cors.ResourceOptions(allow_headers=CORS_REQUEST_HEADERS,
                                                   expose_headers=CORS_EXPOSED_HEADERS, max_age=CORS_MAX_AGE_S)
            cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
            for route in list(app.router.routes()):
                cors.add(route)
            app.on_response_prepare.append(_vary_on_origin)
        return app

    async def start(self) -> None:
        """Bind ``server.host:port`` and serve.

        Raises:
            OSError: the port is taken (the message names host and port), or a TLS file cannot be read.
        """
        host = self.config.server.host
        # handler_cancellation: a client that leaves cancels its handler (aiohttp's default since 3.9 is to
        # let it run), so RunTask's task is cancelled as a gRPC call's is when its caller goes.
        self._runner = _Runner(self.app(), write_timeout_s=self.config.orchestrator.http.write_timeout_s,
                               access_log=None, handler_cancellation=True,
                               keepalive_timeout=self.config.orchestrator.http.keepalive_timeout_s,
                               shutdown_timeout=self.config.server.shutdown_grace_s, max_field_size=MAX_FIELD_BYTES,
                               max_line_size=MAX_FIELD_BYTES)
        await self._runner.setup()
        context = tls_context(self.config.server.tls)  # over TLS, plain HTTP is answered 400 (https_listener)
        site = web.TCPSite if context is None else HttpsSite
        self._site = site(self._runner, host, self.port, ssl_context=context, reuse_port=False)
        try:
            await self._site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(exc.errno, f"HTTP face {host}:{self.port} (orchestrator.http.port): {exc.strerror}") from exc
        server = self._site._server  # aiohttp keeps the asyncio server here; its socket says the bound port
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        scheme = "https" if self.config.server.tls.enabled else "http"
        log.info("orchestrator: HTTP face on %s://%s:%d (OpenAPI at /openapi.json)", scheme, host, self.port)

    async def watch_health(self, health: Any) -> None:
        """``switchyard_serving{service="orchestrator-http"}`` says what ``/readyz`` answers, read at each scrape:
        1 while the orchestrator takes tasks of its default type, 0 while it does not (a service it needs down,
        not checked yet) or drains. It read 1 from start-up to the drain whatever the orchestrator's readiness,
        so the dashboard's ready replicas counted a face whose ``/readyz`` answered 503. No gRPC names of its own."""
        SERVING.labels(self.name).set_function(lambda: 0.0 if self.service.not_ready() is not None else 1.0)

    async def begin_drain(self) -> None:
        """Stop accepting connections; requests in flight go on until :meth:`stop`."""
        if self._site is not None:
            await self._site.stop()

    async def stop(self) -> None:
        """Wait up to ``server.shutdown_grace_s`` for requests in flight, then close."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = self._site = None

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _authenticate(self, request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Bearer tokens as on the gRPC edge; the OpenAPI document, the probes and unknown paths need none."""
        refused = self._auth_refusal(request) or self._not_acceptable(request)
        if refused is not None:
            return refused
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _error(grpc.StatusCode.NOT_FOUND, f"path: no route {shown(request.path)} (see /openapi.json)")
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            return web.json_response(error_body(grpc.StatusCode.UNIMPLEMENTED,
                                                f"method: {request.method} {shown(request.path)} expected {allowed}"),
                                     status=405, headers={"Allow": allowed})
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            # any other answer made as an exception (its body text/plain; aiohttp-cors's refused preflight, 403,
            # among them): the face's error shape, with its words where it has its own
            said = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
            return _error(_code_of_status(exc.status), f"request: {said}", status=exc.status)

    # ------------------------------------------------------------------ handlers

    def _auth_refusal(self, request: web.Request) -> web.Response | None:
        """The 401/403 answer of a route behind bearer tokens whose caller's token does not let it in; None when
        it may go on (auth off, a good token, or a route that needs none)."""
        tokens = self.service.bearer_tokens()
        route = request.match_info.route.name
        if request.method == "OPTIONS":  # a CORS preflight, which runs nothing: a browser sends it with no token
            return None
        if tokens is not None and route in ("submit", "run", "status", "task_status", "cancel"):
            method = ROUTE_METHODS["status" if route == "task_status" else route]
            refused = tokens.check(method, request.headers.getall("Authorization", None))
            if refused is not None:
                code, message = refused
                return _error(code, message.replace("'authorization' metadata", "'Authorization' header"))
        return None

    def _not_acceptable(self, request: web.Request) -> web.Response | None:
        """The 406 answer of a route whose answer's media type (:data:`ANSWERS`) the request's ``Accept`` does not
        take (RFC 9110 section 15.5.7: ``Accept: application/json`` on ``/run`` was answered an event stream
        anyway); None when it does, or for a CORS preflight (which runs nothing), a probe (:data:`PROBE_PATHS`) or
        an unknown path."""
        route = request.match_info.route.name
        if request.method == "OPTIONS" or route not in ANSWERS or ROUTES[route][1] in PROBE_PATHS:
            return None
        media, accept = ANSWERS[route], request.headers.getall("Accept", [])
        if acceptable(accept, media):
            return None
        kind = media.split("/", 1)[0]
        return _error(grpc.StatusCode.INVALID_ARGUMENT,
                      f"Accept: expected a media range that takes {media} ({media}, {kind}/* or */*, with a q above "
                      f"0) or no Accept header; this route answers {media}, and its errors {JSON} "
                      f"(got {shown(', '.join(accept))})", status=406)

    async def _expect(self, request: web.Request, task_body: bool = False) -> web.StreamResponse | None:
        """``Expect: 100-continue`` answered ``100 Continue`` (aiohttp's rule) once the caller may send its body:
        a caller the bearer tokens refuse gets its 401/403 first (never an invitation to upload), and with
        ``task_body`` a body the route would refuse unread (415, 413) is refused first too; any other
        expectation is 417 in the face's JSON error shape (RFC 9110 section 10.1.1). Answered here, before the
        middleware, each refusal is counted in ``http_server_request_duration_seconds`` by itself."""
        answer = self._auth_refusal(request) or self._not_acceptable(request)
        if answer is None and task_body:
            refused = self._refusal_before_body(request)
            answer = _abort_answer(refused) if refused is not None else None
        expect = request.headers.get("Expect", "")
        if answer is None and request.version == HttpVersion11 and expect.lower() != "100-continue":
            answer = _error(grpc.StatusCode.FAILED_PRECONDITION,
                            f"Expect: expected 100-continue or no Expect header (got {shown(expect)})", status=417)
        if answer is not None:
            http_telemetry.observe_early(request, answer.status)
            return answer
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer's body has not started (as aiohttp's own handler)
        return None

    async def _expect_task_body(self, request: web.Request) -> web.StreamResponse | None:
        """:meth:`_expect` for a route that reads a task body."""
        return await self._expect(request, task_body=True)

    def _refusal_before_body(self, request: web.Request) -> HttpAbort | None:
        """501 for a Transfer-Encoding other than chunked alone (``gzip, chunked``: aiohttp's parser read the body
        as chunked and left the gzip undone, and the compressed bytes were refused as bad JSON, 400), 415 for a
        Content-Type other than application/json, or one naming a charset other than UTF-8 (JSON is
        UTF-8: RFC 8259 section 8.1; a Latin-1 body was read as UTF-8 and refused as bad JSON), 413 for a
        Content-Length past :attr:`body_max_bytes` (answered at once: aiohttp counts the bytes as they come, and a
        stalled client's 100 GB promise was a 408 after ``body_read_timeout_s``); None when the body may be read."""
        transfer = [c.strip().lower() for value in request.headers.getall("Transfer-Encoding", ())
                    for c in value.split(",") if c.strip()]
        if transfer and transfer != ["chunked"]:  # RFC 9112 section 6.1: a transfer coding not understood is 501
            if isinstance(request.protocol, _JsonProtocolErrors):  # closed after it, as every 501 of the face is
                request.protocol.close_without_lingering()
            return HttpAbort(grpc.StatusCode.UNIMPLEMENTED, "Transfer-Encoding: expected chunked alone (the one "
                             "transfer coding this face reads; name a compressed body's coding in Content-Encoding) "
                             f"(got {shown(', '.join(request.headers.getall('Transfer-Encoding')))})", "orchestrator",
                             status=501)
        sent = shown(request.headers.get("Content-Type", "none"))
        if request.content_type != JSON:
            return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"Content-Type: expected {JSON} (got {sent})",
                             "orchestrator", status=415)
        charsets = parse_mimetype(request.headers.get("Content-Type", "")).parameters.getall("charset", [])
        if charsets and (len(charsets) > 1 or charsets[0].lower().replace("_", "-") not in ("utf-8", "utf8")):
            return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"Content-Type: expected {JSON} in UTF-8, with no "
                             f"charset or charset=utf-8 (JSON is UTF-8, RFC 8259 section 8.1) (got {sent})",
                             "orchestrator", status=415)
        codings = [v.strip().lower() for v in request.headers.getall("Content-Encoding", ()) if v.strip()]
        if len(codings) > 1 or (codings and codings[0] not in CONTENT_CODINGS):  # an empty one names nothing
            return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "Content-Encoding: expected one of "
                             f"{', '.join(CONTENT_CODINGS)} (got {shown(', '.join(request.headers.getall('Content-Encoding')))})",
                             "orchestrator", status=415)  # RFC 9110 section 15.5.16: an unsupported coding is 415
        if request.content_length is not None and request.content_length > self.body_max_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> HttpAbort:
        limits = self.config.limits
        return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"body: expected at most {self.body_max_bytes} bytes; payload: at most "
                         f"{limits.max_payload_chars} characters (limits.max_payload_chars)", "orchestrator",
                         status=413)

    async def _task_request(self, request: web.Request) -> tuple[agent_pb2.RunTaskRequest, HttpCall]:
        """The body as a RunTaskRequest (JSON types and required fields checked here; bounds by the servicer),
        and the :class:`HttpCall` to pass it with (it quotes a max_tokens past int32 as sent).

        Raises:
            HttpAbort: INVALID_ARGUMENT naming the field and what was expected, or ``body`` when it is not
                a JSON object; ``status`` 415 for a Content-Type other than application/json, 413 for a
                body past :attr:`body_max_bytes`.
        """
        refused = self._refusal_before_body(request)
        if refused is not None:
            raise refused
        try:
            async with asyncio.timeout(self.config.orchestrator.http.body_read_timeout_s):
                raw = await request.read()
        except TimeoutError:
            if isinstance(request.protocol, _JsonProtocolErrors):
                request.protocol.close_without_lingering()
            promised = (f"its {request.content_length} bytes (Content-Length)" if request.content_length is not None
                        else "its last chunk (Transfer-Encoding: chunked)")  # a chunked body promises no length
            raise HttpAbort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"body: expected {promised} within "
                            f"{self.config.orchestrator.http.body_read_timeout_s:g} s "
                            "(orchestrator.http.body_read_timeout_s)", "orchestrator", status=408) from None
        except web.HTTPRequestEntityTooLarge:  # a chunked body, counted as it came
            raise self._too_large() from None
        except web_protocol.RequestPayloadError as exc:  # aiohttp decodes the body's Content-Encoding as it reads
            # The rest of the body cannot be read either: aiohttp's lingering read of it after the 400 raised the
            # same error again, logged as an unhandled exception with a traceback for every such request.
            if isinstance(request.protocol, _JsonProtocolErrors):
                request.protocol.close_without_lingering()
            # its reason is the decoder's error (the cause): the error's own text is aiohttp's status line form,
            # '400, message:\n  Can not decode ...', a newline and a status in the answer's message
            cause = exc.__cause__
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, _coding_refused(
                cause.message if isinstance(cause, HttpProcessingError) else str(exc),
                request.headers.get("Content-Encoding", "identity")), "orchestrator") from None
        if raw.startswith(codecs.BOM_UTF8):  # RFC 8259 section 8.1: a parser may ignore a byte order mark
            raw = raw[len(codecs.BOM_UTF8):]
        if len(raw) > PARSE_IN_THREAD_BYTES:  # a body of 140,000 unknown keys took the loop for half a second
            body = await asyncio.to_thread(self._parse, raw)
        else:
            body = self._parse(raw)
        if isinstance(body, str):
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, body, "orchestrator")
        if not body.agent_id and not any(request.headers.getall(AGENT_ID_HEADER, ())):  # two: RunTask's rule
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, str(InvalidArgument("agent_id", EXPECTED["agent_id"])),
                            "orchestrator")
        sent = body.max_tokens if _wire_max_tokens(body.max_tokens) != body.max_tokens else None
        return agent_pb2.RunTaskRequest(
            task_id=body.task_id,
            payload=self.config.orchestrator.http.default_payload if body.payload is None else body.payload,
            agent_id=body.agent_id,
            priority=parse_priority(body.priority, "priority") if body.priority else agent_pb2.PRIORITY_UNSPECIFIED,
            task_type=body.task_type,
            max_tokens=_wire_max_tokens(body.max_tokens),
            model=body.model,
            metadata=body.metadata,
        ), HttpCall(request.headers.items(), max_tokens_sent=sent)

    def _parse(self, raw: bytes) -> TaskRequest | str:
        """The body as a :class:`TaskRequest`, or the error message naming what is wrong with it: a key given
        twice in one object is refused by name, as a header sent twice with different values is (JSON parsers
        keep the last; RFC 8259 section 4 leaves it to them, so which value counts must not be left to one)."""
        try:
            body = TaskRequest.model_validate_json(raw)
        except ValidationError as exc:
            if any(error["type"] == "json_invalid" for error in exc.errors(include_url=False)):
                try:  # read only when the parse failed: the parser's words for a byte that is no UTF-8 were
                    raw.decode("utf-8")  # "invalid unicode code point", for UTF-16 "expected value at line 1"
                except UnicodeDecodeError as bad:
                    utf16 = raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
                    return str(InvalidArgument("body", "JSON in UTF-8 (RFC 8259 section 8.1): " + (
                        "this body is UTF-16 (it starts with UTF-16's byte order mark)" if utf16 else
                        f"byte 0x{raw[bad.start]:02X} at offset {bad.start} is not UTF-8")))
            return describe_error(exc, self._expected)
        if (twice := duplicate_key(raw)) is not None:
            return str(InvalidArgument(twice, "one value (the key appears more than once in its object)"))
        return body

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """Run a servicer call; its abort (or any error) becomes the JSON error answer."""
        try:
            return await make()
        except HttpAbort as exc:
            return _abort_answer(exc)
        except Exception as exc:  # noqa: BLE001 - a servicer fault: INTERNAL, as the gRPC edge answers it
            code, details = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("HTTP %s failed", make)
            origin = hop_of(exc, "orchestrator")
            return _error(code, self.service.shown(details, origin), origin)

    async def submit(self, request: web.Request) -> web.Response:
        async def call() -> web.Response:
            # Shielded: a client that leaves mid-submit does not cut the record from its run (the task is
            # recorded and runs; resubmitting its task_id answers it).
            submit = asyncio.ensure_future(
                self.service.SubmitTask(*await self._task_request(request)))
            accepted = await asyncio.shield(settle(submit))  # settle: a left client's answer is still read
            return web.json_response({"status": "accepted", "queue_position": accepted.queue_position,
                                      "task_id": accepted.task_id, "trace_id": accepted.trace_id,
                                      "state": state_name(accepted.state)})

        return await self._call(call)

    async def _status(self, request: web.Request, name: str) -> web.Response:
        async def call() -> web.Response:
            key = {name: _path_id(request, name)}
            status = await self.service.GetTaskStatus(agent_pb2.GetTaskStatusRequest(**key),
                                                      HttpCall(request.headers.items()))
            return web.json_response(status_json(status))

        return await self._call(call)

    async def agent_status(self, request: web.Request) -> web.Response:
        return await self._status(request, "agent_id")

    async def task_status(self, request: web.Request) -> web.Response:
        return await self._status(request, "task_id")

    async def cancel(self, request: web.Request) -> web.Response:
        async def call() -> web.Response:
            # Shielded as submit is: a client that leaves does not cut a cancel from its record.
            cancel = asyncio.ensure_future(self.service.CancelTask(
                agent_pb2.CancelTaskRequest(task_id=_path_id(request, "task_id")), HttpCall(request.headers.items())))
            status = await asyncio.shield(settle(cancel))
            return web.json_response(status_json(status))

        return await self._call(call)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type=JSON)

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness for an HTTP probe or load balancer: 200 while the process serves (gRPC health's ``""``)."""
        return web.json_response({"status": "serving"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness for an HTTP probe or load balancer (which cannot ask grpc.health.v1): 200 while the
        orchestrator takes tasks of its default type, else 503 (UNAVAILABLE, with Retry-After) naming why
        (:meth:`OrchestratorService.not_ready`), as its gRPC health name ``agent.AgentService`` answers."""
        problem = self.service.not_ready()
        if problem is not None:  # a probe's answer, asked every few seconds: hidden as an error is, not logged
            return _error(grpc.StatusCode.UNAVAILABLE, f"ready: {self.service.edge.text(problem)}")
        return web.json_response({"status": "serving"})

    async def run(self, request: web.Request) -> web.StreamResponse:
        """RunTask as Server-Sent Events. An error before the first event (validation, a full queue) is a
        JSON error answer with its HTTP status; after it, an ``error`` event ends the stream. Each event has an
        ``id`` (:func:`event_id`); a request with ``Last-Event-ID`` is an EventSource-style client reconnecting,
        answered by :func:`reconnection` without running the task again."""
        last_id = request.headers.get(LAST_EVENT_ID, "")
        if last_id:
            return reconnection(last_id)
        try:
            task, call = await self._task_request(request)
        except HttpAbort as exc:
            return _abort_answer(exc)
        events = self.service.RunTask(task, call)
        async with contextlib.aclosing(events):  # a client that leaves cancels the task (RunTask's finally)
            try:
                first = await anext(events)
            except HttpAbort as exc:
                return _abort_answer(exc)
            except StopAsyncIteration:  # pragma: no cover - RunTask always sends accepted or aborts
                return _error(grpc.StatusCode.INTERNAL, "RunTask ended without an event")
            response = web.StreamResponse(headers={"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no"})
            await response.prepare(request)
            event: agent_pb2.TaskEvent | None = first
            quiet = _KeepAlive(response, self.config.orchestrator.http.sse_keepalive_s)
            head, sent = id_head(first.accepted.task_id), 0
            try:
                try:
                    while event is not None:
                        last = event.HasField("final")  # RunTask's last event: the stream ends after it
                        await quiet.write(event_id(head, sent, last) + event_bytes(event))
                        sent += 1
                        event = await quiet.next_event(events)
                except HttpAbort as exc:
                    await quiet.write(event_id(head, sent, True)
                                      + _sse("error", error_body(exc.code, exc.details, exc.origin)))
                await quiet.stop()
                await response.write_eof()
            except ConnectionResetError:  # the client left (aiohttp's ClientConnectionResetError is one): not ours
                pass
            finally:
                await quiet.stop()
            return response
