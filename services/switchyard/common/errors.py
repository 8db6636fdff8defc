"""Mapping from Switchyard's exceptions to gRPC status codes, and the hop that failed.

Errors leave a servicer through :func:`abort`: ``context.abort(code, details)``
with the hop that produced the error in the trailing metadata
(:data:`ORIGIN_KEY`). The details always name what failed (queue, field,
service, model) and the fix.

Which hop failed: an error that carries :data:`ORIGIN_KEY` was answered by a
Switchyard service (its own, or one it relays from the upstream model or a
proxy); an error without it was never answered, so the transport to that
service failed (:class:`ServiceUnavailable`: "is it running?"). An upstream
stream cut or a dead proxy is therefore never blamed on a healthy dispatcher.
"""

from __future__ import annotations

import re
from typing import Callable

import grpc

from switchyard.common import untrusted


ORIGIN_KEY = "switchyard-error-origin"
"""Trailing-metadata key: the hop that produced an error (orchestrator, retrieval, dispatcher,
upstream model, proxy)."""


class SwitchyardError(Exception):
    """An error that carries its gRPC status code, and the hop it came from when not the raiser's."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    origin: str = ""
    """The hop that failed, when it is not the service that raises this (e.g. ``upstream model``)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(SwitchyardError):
    """A request field is missing or out of range; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, expected: str, value: object = None) -> None:
        got = "" if value is None else f" (got {untrusted.shown(value)})"
        if len(field) > untrusted.SHOWN_CHARS:  # a caller's own key (an unknown field), cut as its values are
            field = f"{field[:untrusted.SHOWN_CHARS]}... ({len(field)} characters)"
        super().__init__(f"{field}: expected {expected}{got}")
        self.field = field


class ServiceUnavailable(SwitchyardError):
    """A downstream service did not answer."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, service: str, address: str, detail: str = "") -> None:
        tail = f": {detail}" if detail else ""
        super().__init__(f"{service} service unavailable at {address}{tail}; is it running (switchyard up)?")


class DispatcherNotServing(SwitchyardError):
    """The dispatcher itself serves no request now (UNAVAILABLE, its own answer, so its origin is ``dispatcher``):
    ``reason`` says why (not started yet or stopped; shutting down, draining; its engine loop failed). A request
    it refuses did nothing, so the orchestrator tries it on another replica (``InferenceClient.generate``);
    one it held when its engine loop failed ends with it too."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, reason: str) -> None:
        super().__init__(f"dispatcher not serving: {reason}; retry on another replica, or on this one shortly")
        self.reason = reason


class TaskDeadlineExceeded(SwitchyardError):
    """A task ran out of time: its own time limit or its caller's gRPC deadline (DEADLINE_EXCEEDED). ``ran_s``: how
    long it ran, seconds (from its start: ``Task.t0``); ``source``: what set its deadline. ``waited_on``:
    what its model step was waiting on as it was cut short, as the dispatcher said (``GenerateDone.waited_on``:
    "the model server at http://host:port (model m) for 4 s"); "" when not known."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, task_id: str, ran_s: float, source: str, waited_on: str = "") -> None:
        waiting = f" waiting for {waited_on}" if waited_on else ""
        super().__init__(f"task {untrusted.shown(task_id)} ran out of time after {ran_s:.3g} s ({source}){waiting}; "
                         "every step it started was cancelled")
        self.task_id = task_id


class TaskRefusedEarly(SwitchyardError):
    """A task refused before a model step: its time left is below the work it is expected to need
    (DEADLINE_EXCEEDED; the rule: orchestrator/program.py). ``deadline_source``: what set the deadline, as
    :class:`TaskDeadlineExceeded` names it (``orchestrator.task_time_limit_s.<type> = 600``, or the caller's gRPC
    deadline), so the caller knows which to give more time."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, task_id: str, time_left_s: float, expected_work_s: float, model_steps_done: int,
                 margin_s: float, deadline_source: str = "") -> None:
        source = f" ({deadline_source})" if deadline_source else ""
        super().__init__(
            f"task {untrusted.shown(task_id)} refused early before model step {model_steps_done}: "
            f"{time_left_s:.3f} s left before its deadline{source}, {expected_work_s:.3f} s of work expected "
            f"(the measured mean times of the steps it has left), short by more than "
            f"orchestrator.program.refuse_early_margin_s = {margin_s:g} s")
        self.task_id = task_id


class RequestDeadlineExceeded(SwitchyardError):
    """A request passed its own deadline (its caller's ``timeout_s`` or gRPC deadline) in the dispatcher
    (DEADLINE_EXCEEDED); its place and KV are freed. Its id is quoted (:func:`request_named`)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, request_id: str, timeout_s: float, where: str) -> None:
        super().__init__(f"request {request_named(request_id)} passed its deadline of {timeout_s:.3g} s {where}; "
                         "its place and KV cache were freed")
        self.request_id = request_id


def request_named(request_id: str) -> str:
    """A dispatcher request's id as its errors name it: quoted (``untrusted.shown``), as every error quotes a
    caller's id, or ``(no id)``. An orchestrator's request id is ``<task_id>:<turn>``: unquoted, a task id such as
    ``run.2024`` made ``run.2024:3`` read as a host and port, hidden from the task's caller as an address; quoted,
    the edge keeps it (``EdgeText.text``)."""
    return untrusted.shown(request_id) if request_id else "(no id)"


class QueueFullError(SwitchyardError):
    """A queue holds ``capacity`` items: refused at once (RESOURCE_EXHAUSTED), never dropped."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, queue: str, capacity: int) -> None:
        super().__init__(f"{queue} queue full: {capacity} items waiting (queues.{queue}.capacity); retry later")
        self.queue = queue


class QueueTimeoutError(SwitchyardError):
    """An item waited longer than the queue's ``timeout_ms`` (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, queue: str, waited_s: float, timeout_ms: int, waiting_for: str = "a free worker") -> None:
        super().__init__(
            f"waited {waited_s * 1000:.0f} ms in the {queue} queue for {waiting_for} "
            f"(queues.{queue}.timeout_ms = {timeout_ms})"
        )
        self.queue = queue


# gRPC codes that mean the server failed, not the caller; after
# the OpenTelemetry semantic conventions for gRPC server spans (span status).
SERVER_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


# The HTTP status of each gRPC code, after google.rpc.Code's documented mapping (googleapis,
# google/rpc/code.proto) and gRPC's "HTTP to gRPC Status Code Mapping" (doc/http-grpc-status-mapping.md).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, service: str,
                trailing: tuple[tuple[str, str | bytes], ...] = (),
                shown: Callable[[str, str], str] | None = None) -> None:
    """End the RPC with ``exc``'s status, naming its hop (``exc.origin``, else ``service``) in the
    trailing metadata under :data:`ORIGIN_KEY`, beside ``trailing`` (more trailers: a key ending ``-bin`` carries
    bytes). ``shown``: what the caller reads of the details, given them and the hop (the orchestrator's edge
    hides internal addresses from tenants: orchestrator/addresses.py); None: the details as they are.
    Always raises (``grpc.aio.AbortError``)."""
    code, details = _status_whole(exc)
    origin = hop_of(exc, service)
    if shown is not None:  # the whole message, then bounded: an address is never cut in two, half of it shown
        details = shown(details, origin)
    await context.abort(code, bounded(details), trailing_metadata=((ORIGIN_KEY, origin), *trailing))


def hop_of(exc: BaseException, service: str) -> str:
    """The hop that produced ``exc``: its ``origin`` when it is a :class:`SwitchyardError` that names one, else
    ``service`` (the one that raised it)."""
    return (exc.origin if isinstance(exc, SwitchyardError) else "") or service


def own_fault(exc: BaseException, service: str) -> bool:
    """Whether ``exc`` is a fault of ``service`` itself: INTERNAL, and raised there (no other hop named as its
    origin, :func:`hop_of`). Such a failure is logged with its traceback where it happened; an INTERNAL that
    another hop answered (a model server's malformed stream, a dispatcher's engine failure, which the
    dispatcher logs) is that hop's, and its traceback here would show only this service's client code."""
    return status_for(exc)[0] == grpc.StatusCode.INTERNAL and hop_of(exc, service) == service


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, details) a servicer should abort with for ``exc``; details at most
    :data:`MAX_DETAILS_CHARS` (:func:`bounded`)."""
    code, details = _status_whole(exc)
    return code, bounded(details)


def _status_whole(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """:func:`status_for`, the details not bounded."""
    if isinstance(exc, SwitchyardError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


MAX_DETAILS_CHARS = 4096
"""The longest status details a servicer sends, characters: gRPC carries them in the ``grpc-message``
trailer, and trailers past 16 KiB in all (its hard metadata limit) end the call RESOURCE_EXHAUSTED in place
of the status sent."""


def bounded(details: str) -> str:
    """``details`` cut to at most :data:`MAX_DETAILS_CHARS` characters, saying so. The cut falls between words
    where it can: a word (an address, a URL) is kept whole or left out whole, never shown in part, so that a
    cut message still reads whole to whatever rewrites its words after (the edge hiding internal addresses,
    orchestrator/addresses.py); a first word longer than the bound is cut where the bound falls."""
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    head = details[:MAX_DETAILS_CHARS]
    if not details[MAX_DETAILS_CHARS].isspace():  # the bound falls inside a word: leave that word out
        head = _LAST_WORD.sub("", head) or head
    return f"{head.rstrip()} ... (cut from {len(details)} characters)"


_LAST_WORD = re.compile(r"\S+\Z")
