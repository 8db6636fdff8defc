"""The GenerateStream protocol, written once for both ends: the dispatcher's session and the orchestrator's client.

``agent.InferenceService.GenerateStream`` (``proto/agent.proto``) carries many
generation requests over one bidirectional stream; the dispatcher's
``Generate`` is a stream of one request served by the same session
(:mod:`switchyard.dispatcher.generate_stream`). What both ends must agree on
lives here:

- **one request's states** (:class:`RequestState`, :class:`StreamedRequest`):
  ``started`` (its start was sent or taken) -> ``streaming`` (a chunk of it
  went by) -> one of ``done`` (its done chunk), ``failed`` (its error) or
  ``cancelled`` (its caller gave up, or the stream ended under it). Nothing is
  delivered to a request's caller once it is in one of the last three. The
  dispatcher sends every start exactly one last chunk, done or error; a
  cancel makes it come at once: the request is aborted and answered with its
  done chunk as it stands (``finish_reason`` ``cancelled``: its tokens,
  compute score and KV peak until then), or its error when it was refused
  meanwhile. A request that fails after it became one (its deadline, its
  upstream, its engine) carries what it consumed with its error
  (``StreamedError.consumed``, the done chunk it would have sent). The caller's
  side keeps a cancelled request in its map until that answer (what it sent
  before may still come, and is dropped), for at most a bounded wait, and hands
  what a request that did not finish consumed (a cancel's answer, an error's
  ``consumed``) to whoever counts it, once;
- **the deadline** (:func:`deadline_after`, :func:`encode_timeout`,
  :func:`decode_timeout`, :func:`deadline_exceeded`): ``timeout_s`` is the
  caller's time left in seconds, 0 on the wire for none (Generate's
  ``grpc-timeout``). Both ends hold the request to ``time.monotonic()`` + it:
  the caller fails the request DEADLINE_EXCEEDED and cancels it there; the
  dispatcher's scheduler and upstream engines bound it by the same deadline;
- **the token hold** (:func:`decode_token_hold`): ``token_hold_s`` is how long
  the caller merges the request's tokens anyway (a BATCH task's RunTask
  interval); the dispatcher may hold its tokens after the first that long;
- **the size rule** (:func:`entry_bytes`, :func:`pack`, :func:`too_large`):
  both messages (``GenerateStreamRequest``, ``GenerateStreamResponse``) are
  repeated fields only, so a message is as large as the sum of its entries,
  each ``ByteSize()`` plus its tag and length (:data:`ENTRY_OVERHEAD_BYTES`).
  Entries waiting together leave in as few messages as fit
  ``server.max_message_bytes``: a message past the peer's limit would end the
  stream, and every request on it. A start larger than the limit is not sent
  and fails alone, RESOURCE_EXHAUSTED, as its Generate call would;
- **errors** (:func:`encode_error`, :func:`decode_error`, :class:`RequestFailed`):
  a request that fails ends with a ``StreamedError`` holding the gRPC status it
  would end a Generate call with, and its origin (the hop that answered:
  ``dispatcher``, or the upstream model it relays; Generate's
  :data:`~switchyard.common.errors.ORIGIN_KEY` trailer), and what the request
  consumed until then (``consumed``; Generate's :data:`CONSUMED_KEY` trailer).
  On the caller's side an origin of "" means nothing answered (the stream
  itself broke);
- **request ids** (:func:`check_stream_request_id`, :func:`new_request_id`):
  on a stream an id is required and unique among the stream's running
  requests (a start reusing a running id is refused INVALID_ARGUMENT under
  that id, and the running request goes on); Generate's is optional, one is
  made when it is empty. The caller sends a request under an id its stream
  still knows (running, or cancelled there: chunks sent before the cancel may
  still come, and one whose cancel went unanswered may still run) under an id
  of its own (the orchestrator's: ``<id>~<n>``).
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Container, Sequence, TypeVar

import grpc
from google.protobuf.message import Message

from switchyard.api import agent_pb2
from switchyard.common import untrusted
from switchyard.common.errors import InvalidArgument, SwitchyardError, status_for

T = TypeVar("T")

DISPATCHER_ORIGIN = "dispatcher"
"""The origin of an error the dispatcher raised itself."""

CONSUMED_KEY = "switchyard-consumed-bin"
"""Trailer of a Generate call that failed after its request ran: what it consumed, a serialized ``GenerateDone``
(``StreamedError.consumed`` of a GenerateStream request)."""


# --------------------------------------------------------------------------- one request's states


class RequestState(enum.Enum):
    """Where one request on a stream stands (see the module docstring)."""

    STARTED = "started"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """Done, failed or cancelled: nothing more is sent or delivered for the request."""
        return self in _ENDED


_ENDED = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED})


class StreamedRequest:
    """One request on a stream: its id and its :class:`RequestState`.

    Each end keeps one map of these per stream (request id -> its state), and
    adds what it needs to carry the request (subclasses: the caller's adds the
    request's deadline, :func:`deadline_after`).
    """

    __slots__ = ("request_id", "state")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = RequestState.STARTED

    def chunk_sent(self, chunk: agent_pb2.GenerateChunk) -> None:
        """A chunk of the request went by: it is streaming, or done with its done chunk."""
        self.state = RequestState.DONE if chunk.HasField("done") else RequestState.STREAMING

    def end(self, state: RequestState) -> bool:
        """Move to ``state`` (one that ends the request); False, and nothing changes, when it had already
        ended (a cancel that crossed its done chunk, say)."""
        if self.state in _ENDED:
            return False
        self.state = state
        return True


# --------------------------------------------------------------------------- the deadline


def deadline_after(timeout_s: float | None) -> float | None:
    """The ``time.monotonic()`` a request with ``timeout_s`` seconds left must end by; None for none."""
    return None if timeout_s is None else time.monotonic() + timeout_s


def encode_timeout(timeout_s: float | None) -> float:
    """``StreamedGenerate.timeout_s`` for a caller with ``timeout_s`` seconds left (None: no deadline,
    0 on the wire); a deadline already passed stays a deadline (the smallest positive value)."""
    if timeout_s is None:
        return 0.0
    return max(timeout_s, 1e-6)


def decode_timeout(timeout_s: float) -> float | None:
    """The time left a ``StreamedGenerate.timeout_s`` gives, seconds; None for 0 (no deadline).

    Raises:
        InvalidArgument: negative or NaN (they read as "no deadline"; ``Generate`` refuses NaN time left).
    """
    return untrusted.check_seconds(timeout_s, "timeout_s", "no deadline") or None


MAX_TOKEN_HOLD_S = 10.0
"""The longest ``StreamedGenerate.token_hold_s``, seconds (``orchestrator.batch_token_flush_interval_ms``'s bound)."""


def decode_token_hold(token_hold_s: float, priority: int) -> float:
    """The hold a ``StreamedGenerate.token_hold_s`` asks for, seconds (0: none), for a request of ``priority``
    (an ``agent.Priority``).

    Raises:
        InvalidArgument: naming ``token_hold_s``: negative, NaN, infinite or over :data:`MAX_TOKEN_HOLD_S`; or not
            0 on a CORE request, whose output is never held.
    """
    untrusted.check_seconds(token_hold_s, "token_hold_s", "the stream's own rule", at_most=MAX_TOKEN_HOLD_S)
    if token_hold_s and priority == agent_pb2.CORE:
        raise InvalidArgument("token_hold_s", "0 on a CORE request (its output is never held)", token_hold_s)
    return token_hold_s


def deadline_exceeded() -> RequestFailed:
    """The caller's failure of a request past its deadline, as a call whose ``grpc-timeout`` ran out."""
    return RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "")


# --------------------------------------------------------------------------- the size rule


ENTRY_OVERHEAD_BYTES = 6
"""What a repeated field adds to an entry's own size in a message: its tag (1 byte) and length (up to 5)."""


def entry_bytes(entry: Message | str) -> int:
    """Bytes ``entry`` (a message, or a string such as a cancel's request id) takes in a GenerateStream
    message: its size, tag and length."""
    if isinstance(entry, str):
        return len(entry.encode()) + ENTRY_OVERHEAD_BYTES
    return entry.ByteSize() + ENTRY_OVERHEAD_BYTES


def pack(entries: Sequence[tuple[T, int]], max_bytes: int) -> list[list[T]]:
    """``entries`` (each with its :func:`entry_bytes`) in order, in as few groups as fit ``max_bytes``
    each; an entry that alone exceeds it makes a group of its own."""
    groups: list[list[T]] = []
    group: list[T] = []
    size = 0
    for entry, n in entries:
        if group and size + n > max_bytes:
            groups.append(group)
            group, size = [], 0
        group.append(entry)
        size += n
    if group:
        groups.append(group)
    return groups


def too_large(size: int, max_bytes: int) -> RequestFailed | None:
    """The failure of a start of ``size`` bytes (:func:`entry_bytes`) past ``max_bytes``: RESOURCE_EXHAUSTED,
    as gRPC fails a call whose message is too large; None when it fits."""
    if size <= max_bytes:
        return None
    return RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {max_bytes})",
                         "")


# --------------------------------------------------------------------------- errors


class RequestFailed(SwitchyardError):
    """One request on a stream failed, as a call fails with a status.

    Attributes:
        code: the gRPC status code.
        details: the status message.
        origin: the hop that answered (:data:`~switchyard.common.errors.ORIGIN_KEY`): ``dispatcher``,
            or the upstream model it relays; "" when nothing answered (the stream itself broke).
        consumed: what the request consumed until it failed (``StreamedError.consumed``: usage, compute score,
            KV peak, what it waited on); None when the dispatcher sent none (it never ran, or nothing answered).
    """

    def __init__(self, code: grpc.StatusCode, details: str, origin: str,
                 consumed: agent_pb2.GenerateDone | None = None) -> None:
        super().__init__(details, code)
        self.details = details
        self.origin = origin
        self.consumed = consumed


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def encode_error(exc: SwitchyardError, consumed: agent_pb2.GenerateDone | None = None) -> agent_pb2.StreamedError:
    """The ``StreamedError`` that ends a request failing with ``exc``: its status, its origin (``exc.origin``,
    else :data:`DISPATCHER_ORIGIN`), and ``consumed``: what the request used until then (None: it never ran)."""
    code, details = status_for(exc)
    return agent_pb2.StreamedError(code=code.value[0], details=details, origin=exc.origin or DISPATCHER_ORIGIN,
                                   consumed=consumed)


def decode_error(error: agent_pb2.StreamedError) -> RequestFailed:
    """The failure a ``StreamedError`` stands for (an unknown code is UNKNOWN), with what it consumed."""
    return RequestFailed(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.details, error.origin,
                         error.consumed if error.HasField("consumed") else None)


# --------------------------------------------------------------------------- request ids


def check_stream_request_id(request_id: str, running: Container[str]) -> None:
    """Refuse a stream's start whose id is empty or running on the stream (``running``).

    Raises:
        InvalidArgument: naming ``request_id``.
    """
    if not request_id:
        raise InvalidArgument("request_id", "a non-empty id, unique among the stream's running requests", "")
    if request_id in running:
        raise InvalidArgument("request_id", "an id not already running on this stream (this start is refused, and "
                              "the request running under the id ends with it: their chunks could not be told apart)",
                              request_id)


def new_request_id() -> str:
    """An id for a Generate request that came without one (32 hex characters)."""
    return uuid.uuid4().hex
