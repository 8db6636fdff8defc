"""The orchestrator's side of ``agent.InferenceService.GenerateStream``: many requests, one stream.

Every task's generation used to be a Generate call of its own; on this hop the
calls' own cost (an HTTP/2 stream, headers, a deadline, a task per call on both
sides) was most of what the stack added to its caller's RunTask stream. A
:class:`GenerateStreamClient` keeps one GenerateStream open per dispatcher
channel and carries every request over it (the protocol:
:mod:`switchyard.dispatcher.generate_stream`):

- a writer task sends the starts and cancels waiting, in one message when they fit
  in the dispatcher's ``server.max_message_bytes`` (a message past it would end the
  stream, and every request on it);
- a reader task hands each request its chunks as they come, in order;
- a request's deadline (the task's time left) is kept here, and sent along so
  that the dispatcher's scheduler and upstream engines see it too; at the
  deadline the request is cancelled and fails DEADLINE_EXCEEDED, as a call
  whose ``grpc-timeout`` ran out;
- a request whose caller goes away (the task was cancelled) is cancelled on
  the stream, so the dispatcher frees its place and KV at once;
- when the stream breaks (the dispatcher died, the connection was lost), every
  request it carried fails with the stream's status, as their calls would
  have, and the next request opens a new stream.

A stream takes new requests for :data:`STREAM_MAX_AGE_S`, then is closed for
writing and ends when its last request does. A server's GOAWAY for the
connection's age (``server.max_connection_age_s``) then moves the new
requests to the new connection as it moved new calls, and the requests still
running keep ``max_connection_age_grace_s``, as calls did.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from typing import AsyncIterator

import grpc
from opentelemetry import propagate

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.coalescing import Wakeup
from switchyard.common.errors import ORIGIN_KEY
from switchyard.common.tasks import settle

STREAM_MAX_AGE_S = 1.0
"""Seconds a stream takes new requests before the next one is opened (see the module docstring)."""

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""A message's size limit when none is given: gRPC's default for what a server receives, bytes."""

_FIELD_OVERHEAD_BYTES = 6
"""What a repeated field adds to an entry's own size in a message: its tag (1 byte) and length (up to 5)."""

_CLEAN = contextvars.Context()  # the streams' tasks run outside any task's deadline scope and span


class RequestFailed(Exception):
    """One request on a stream failed, as a call fails with a status.

    Attributes:
        code: the gRPC status code.
        details: the status message.
        origin: the hop that answered (:data:`~switchyard.common.errors.ORIGIN_KEY`): ``dispatcher``,
            or the upstream model it relays; "" when nothing answered (the stream itself broke).
    """

    def __init__(self, code: grpc.StatusCode, details: str, origin: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.origin = origin


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Request:
    """One request's chunks, from the reader task to its caller: a FIFO with one waiter."""

    __slots__ = ("items", "waiter", "finished")

    def __init__(self) -> None:
        self.items: deque[agent_pb2.GenerateChunk | RequestFailed] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.finished = False  # its done chunk or its error was received

    def put(self, item: agent_pb2.GenerateChunk | RequestFailed) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, deadline: float | None) -> agent_pb2.GenerateChunk | RequestFailed:
        """The next item; TimeoutError at ``deadline`` (``time.monotonic()``) when none came by then."""
        while not self.items:
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                timer = loop.call_later(left, _expire, waiter)
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
        return self.items.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Stream:
    """One GenerateStream call: its writer and reader tasks and the requests it carries."""

    def __init__(self, stub: agent_pb2_grpc.InferenceServiceStub, max_message_bytes: int) -> None:
        self.opened_at = time.monotonic()
        self.requests: dict[str, _Request] = {}
        self.cancelled: set[str] = set()  # ids cancelled here: the dispatcher may still send chunks for them
        self.retired = False  # takes no new requests; half-closed once the last one ended
        self.broken = False
        self._max_message_bytes = max_message_bytes
        self._starts: deque[tuple[agent_pb2.StreamedGenerate, int]] = deque()  # not sent yet; with their sizes
        self._cancels: deque[str] = deque()
        self._sending = False  # a write is in flight, or one failed: the call's INTERNAL status is then ours
        self._wake = Wakeup()
        self._call = stub.GenerateStream()
        loop = asyncio.get_running_loop()
        # A retired stream is let go once its reader ends, its tasks unawaited: settle reads their outcome.
        self._writer = settle(loop.create_task(self._write(), name="generate-stream-writer", context=_CLEAN.copy()),
                              expected=lambda e: False)
        self._reader = settle(loop.create_task(self._read(), name="generate-stream-reader", context=_CLEAN.copy()),
                              expected=lambda e: False)

    def start(self, start: agent_pb2.StreamedGenerate) -> _Request:
        """Queue ``start`` for the writer; its request's items come through the returned :class:`_Request`.

        A start larger than a message may be (``max_message_bytes``) is not sent: its request fails at
        once, RESOURCE_EXHAUSTED, as a Generate call whose request is too large fails alone.
        """
        request = _Request()
        size = start.ByteSize() + _FIELD_OVERHEAD_BYTES
        if size > self._max_message_bytes:
            request.finished = True
            request.put(RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"Sent message larger than max ({size} vs. {self._max_message_bytes})", ""))
            return request
        self.requests[start.request.request_id] = request
        self._starts.append((start, size))
        self._notify()
        return request

    def cancel(self, request_id: str) -> None:
        """The caller gave up on ``request_id``: forget it, and tell the dispatcher unless the stream is
        gone or its start was not sent yet (then it is not sent at all)."""
        self.requests.pop(request_id, None)
        self.cancelled.add(request_id)
        queued = next((q for q in self._starts if q[0].request.request_id == request_id), None)
        if queued is not None:
            self._starts.remove(queued)
        elif not self.broken:
            self._cancels.append(request_id)
        self._notify()

    def retire(self) -> None:
        self.retired = True
        self._notify()

    def _notify(self) -> None:
        self._wake.notify()

    async def _write(self) -> None:
        call = self._call
        try:
            while True:
                if not self._starts and not self._cancels:
                    if self.retired and not self.requests:
                        await call.done_writing()
                        return
                    await self._wake.wait()
                    continue
                message = self._take()
                self._sending = True
                await call.write(message)
                self._sending = False
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            return  # the call ended: the reader fails what the stream carried with its status

    def _take(self) -> agent_pb2.GenerateStreamRequest:
        """The next message: the cancels and starts waiting, oldest first, as many as fit in
        ``max_message_bytes`` (at least one; a message past the limit would end the whole stream)."""
        message = agent_pb2.GenerateStreamRequest()
        room = self._max_message_bytes
        cancels, starts = self._cancels, self._starts
        while cancels:
            size = len(cancels[0].encode()) + _FIELD_OVERHEAD_BYTES
            if size > room and (message.cancel or message.start):
                return message
            message.cancel.append(cancels.popleft())
            room -= size
        while starts and (starts[0][1] <= room or not (message.cancel or message.start)):
            start, size = starts.popleft()
            message.start.append(start)
            room -= size
        return message

    async def _read(self) -> None:
        call = self._call
        failure: RequestFailed
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    failure = RequestFailed(grpc.StatusCode.UNAVAILABLE, "the dispatcher ended the stream", "")
                    break
                requests = self.requests
                for streamed in message.chunks:
                    request = requests.get(streamed.request_id)
                    if request is None:
                        continue  # cancelled by its caller
                    if streamed.HasField("error"):
                        error = streamed.error
                        request.finished = True
                        del requests[streamed.request_id]
                        request.put(RequestFailed(_CODES.get(error.code, grpc.StatusCode.UNKNOWN),
                                                  error.details, error.origin))
                        continue
                    chunk = streamed.chunk
                    if chunk.HasField("done"):
                        request.finished = True
                        del requests[streamed.request_id]
                    request.put(chunk)
                if self.retired and not self.requests:
                    self._notify()  # the writer half-closes
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INTERNAL and self._sending:
                # grpc fails a call INTERNAL ("Internal error from Core") when a write meets a stream
                # the dispatcher already ended (a drain) or a connection already gone: nothing answered
                failure = RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                        f"the stream ended while requests were sent on it ({err.details()})", "")
            else:
                origin = dict(err.trailing_metadata() or ()).get(ORIGIN_KEY, "")
                failure = RequestFailed(err.code(), err.details() or err.code().name, origin)
        except asyncio.CancelledError:
            failure = RequestFailed(grpc.StatusCode.CANCELLED, "the orchestrator closed the stream", "")
        self.broken = True
        self._writer.cancel()
        for request in self.requests.values():
            request.finished = True
            request.put(failure)
        self.requests.clear()

    @property
    def done(self) -> bool:
        """The call ended and every request it carried has been told."""
        return self._reader.done()

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class GenerateStreamClient:
    """Generation requests over GenerateStream on one channel (see the module docstring).

    Args:
        channel: a channel to one dispatcher (or a target its round_robin spreads).
        max_message_bytes: the largest message the dispatcher takes (``server.max_message_bytes``),
            bytes: the starts waiting are sent in messages within it, and a start larger than it
            fails alone, RESOURCE_EXHAUSTED, as its Generate call would.
    """

    def __init__(self, channel: grpc.aio.Channel, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._max_message_bytes = max_message_bytes
        self._stub = agent_pb2_grpc.InferenceServiceStub(channel)
        self._stream: _Stream | None = None
        self._retired: set[_Stream] = set()

    def _stream_for(self, request_id: str) -> _Stream:
        """The stream to start ``request_id`` on: the current one, or a new one when it is broken, past
        :data:`STREAM_MAX_AGE_S`, or knows the id already. An id running there would be refused; one
        cancelled there may still have chunks on the way (the dispatcher sends until it reads the cancel),
        which the new request would take for its own, and the dispatcher reads a message's starts before
        its cancels."""
        stream = self._stream
        if (stream is None or stream.broken or stream.retired or request_id in stream.requests
                or request_id in stream.cancelled or time.monotonic() - stream.opened_at > STREAM_MAX_AGE_S):
            self._retired = {s for s in self._retired if not s.done}
            if stream is not None:
                stream.retire()  # it ends when its last request does; held here until then
                self._retired.add(stream)
            stream = self._stream = _Stream(self._stub, self._max_message_bytes)
        return stream

    async def generate(
        self, request: agent_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """The chunks of ``request`` (``request_id`` set), as Generate streams them.

        Args:
            timeout_s: the request's time left, seconds; None for no deadline.

        Raises:
            RequestFailed: the dispatcher ended the request with an error, the stream broke
                (``origin`` ""), or ``timeout_s`` ran out (DEADLINE_EXCEEDED, ``origin`` "").
        """
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # nothing while tracing is off
        stream = self._stream_for(request.request_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = stream.start(agent_pb2.StreamedGenerate(
            request=request, timeout_s=timeout_s or 0.0, trace_context=carrier))
        try:
            while True:
                try:
                    item = await pending.get(deadline)
                except TimeoutError:
                    raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "") from None
                if isinstance(item, RequestFailed):
                    raise item
                yield item
                if item.HasField("done"):
                    return
        finally:
            if not pending.finished:
                stream.cancel(request.request_id)

    async def close(self) -> None:
        """Cancel the open streams (what they carry fails CANCELLED)."""
        streams = [s for s in (self._stream, *self._retired) if s is not None]
        self._stream, self._retired = None, set()
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
