"""The orchestrator's side of ``agent.InferenceService.GenerateStream``: many requests, one stream.

Every task's generation used to be a Generate call of its own; on this hop the
calls' own cost (an HTTP/2 stream, headers, a deadline, a task per call on both
sides) was most of what the stack added to its caller's RunTask stream. A
:class:`GenerateStreamClient` keeps one GenerateStream open per dispatcher
channel and carries every request over it (the protocol both ends follow:
:mod:`switchyard.common.generate_protocol`; the dispatcher's side:
:mod:`switchyard.dispatcher.generate_stream`):

- a writer task sends the starts and cancels waiting, in one message when they fit
  in the dispatcher's ``server.max_message_bytes`` (a message past it would end the
  stream, and every request on it);
- a reader task hands each request its chunks as they come, in order;
- a request's deadline (the task's time left) is kept here, and sent along so
  that the dispatcher's scheduler and upstream engines see it too; at the
  deadline the request is cancelled and fails DEADLINE_EXCEEDED, as a call
  whose ``grpc-timeout`` ran out, once the answer to its cancel came (below);
- a request whose caller goes away (the task was cancelled) is cancelled on
  the stream, so the dispatcher stops it and frees its place and KV at once;
  the dispatcher answers the cancel with the request's done chunk as it
  stands (``finish_reason`` ``cancelled``: what it consumed until then), or
  with its error when it failed meanwhile (its ``consumed``), which the
  caller waits for, up to :data:`CANCEL_ANSWER_WAIT_S` (a cancellation that
  comes meanwhile waits for it too), and hands to its ``on_consumed`` (a task
  counts its step's usage, compute score and KV peak by it);
- a request the dispatcher fails after it ran (its own deadline, its upstream,
  its engine) carries what it consumed with its error (``StreamedError.consumed``):
  it goes to the same ``on_consumed`` before the failure is raised. Every step
  that did not finish is counted by that one call, once;
- a cancelled request whose answer does not come within
  :data:`CANCEL_ANSWER_WAIT_S` (a dispatcher that stopped answering) leaves the
  stream's map then, not when the stream ends: what comes for it later is
  dropped, and its id is not reused on that stream;
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
from typing import AsyncIterator, Callable

import grpc
from opentelemetry import propagate

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.coalescing import Wakeup
from switchyard.common.errors import ORIGIN_KEY
from switchyard.common.generate_protocol import (
    RequestFailed,
    RequestState,
    StreamedRequest,
    deadline_after,
    deadline_exceeded,
    decode_error,
    encode_timeout,
    entry_bytes,
    pack,
    too_large,
)
from switchyard.common.tasks import settle

__all__ = ["GenerateStreamClient", "RequestFailed", "STREAM_MAX_AGE_S"]

STREAM_MAX_AGE_S = 1.0
"""Seconds a stream takes new requests before the next one is opened (see the module docstring)."""

CANCEL_ANSWER_WAIT_S = 0.5
"""Seconds a request cancelled by its caller (or at its deadline) waits, at most, for the dispatcher's answer to the
cancel (its done chunk, or its error's ``consumed``: what it consumed); the answer takes one round trip. Past it (a
dispatcher that stopped answering), what the caller knew is all it reports, and the request leaves its stream's map.
A stream that breaks ends the wait at once."""

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""A message's size limit when none is given: gRPC's default for what a server receives, bytes."""

_CLEAN = contextvars.Context()  # the streams' tasks run outside any task's deadline scope and span


class _Request(StreamedRequest):
    """One request on a stream, this side: its protocol state, its deadline, and its chunks on their way
    from the reader task to its caller (a FIFO with one waiter)."""

    __slots__ = ("deadline", "items", "waiter", "answer")

    def __init__(self, request_id: str, timeout_s: float | None) -> None:
        super().__init__(request_id)
        self.deadline = deadline_after(timeout_s)
        self.items: deque[agent_pb2.GenerateChunk | RequestFailed] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.answer: asyncio.Future[agent_pb2.GenerateDone | None] | None = None
        """Cancelled on the wire: the dispatcher's answer to the cancel, its done (None: an error, or the stream
        broke); None until then."""

    def answered(self, done: agent_pb2.GenerateDone | None) -> None:
        """The last word on this cancelled request came: its done chunk's or its error's ``consumed``, or None (an
        error with none, the stream broke, no answer within :data:`CANCEL_ANSWER_WAIT_S`)."""
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(done)

    def unread_end(self) -> agent_pb2.GenerateDone | None:
        """What this request consumed, when its last item came but its caller has not read it (the caller was
        cancelled as it came: its wake-up was due, the cancellation came first): the done chunk's, or the failure's
        ``consumed``; None when no such item waits."""
        if not self.items:
            return None
        last = self.items[-1]
        if isinstance(last, RequestFailed):
            return last.consumed
        return last.done if last.HasField("done") else None

    def put(self, item: agent_pb2.GenerateChunk | RequestFailed) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, failure: RequestFailed) -> None:
        """End the request with ``failure``, unless it had ended already."""
        if self.end(RequestState.FAILED):
            self.put(failure)

    async def get(self) -> agent_pb2.GenerateChunk | RequestFailed:
        """The next item; TimeoutError at the request's deadline when none came by then (an item that came as the
        deadline timer fired, before the caller woke, is the next item: the request had ended, or had more)."""
        while not self.items:
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = None
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                timer = loop.call_later(left, _expire, waiter)
            try:
                await waiter
            except TimeoutError:
                if not self.items:
                    raise
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
        return self.items.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Stream:
    """One GenerateStream call: its writer and reader tasks and the requests it carries.

    One map holds the requests (request id -> :class:`_Request`, its
    :class:`~switchyard.common.generate_protocol.RequestState`): a request leaves
    it once done or failed; one cancelled here stays until the dispatcher's
    answer to the cancel (its last chunk), so that the chunks the dispatcher
    sent before it read the cancel are dropped, the answer reaches its caller
    (:meth:`cancel`), and a new request under its id meanwhile goes under an id
    of its own; at most :data:`CANCEL_ANSWER_WAIT_S`, after which it leaves
    unanswered (:meth:`_unanswered`), its id kept in :attr:`unanswered` while
    the stream takes new requests (the dispatcher may still run it under that id).
    """

    def __init__(self, stub: agent_pb2_grpc.InferenceServiceStub, max_message_bytes: int) -> None:
        self.opened_at = time.monotonic()
        self.requests: dict[str, _Request] = {}
        self.unanswered: set[str] = set()
        """Ids of cancelled requests that left :attr:`requests` unanswered (:meth:`_unanswered`): a new request
        under one goes under an id of its own, as under a live id. Emptied when the stream retires (it takes no
        new requests then): at most the ids of the requests it took."""
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

    def start(self, start: agent_pb2.StreamedGenerate, timeout_s: float | None) -> _Request:
        """Queue ``start`` for the writer; its request's items come through the returned :class:`_Request`.

        A start larger than a message may be (``max_message_bytes``) is not sent: its request fails at
        once, RESOURCE_EXHAUSTED, as a Generate call whose request is too large fails alone.
        """
        request = _Request(start.request.request_id, timeout_s)
        size = entry_bytes(start)
        failure = too_large(size, self._max_message_bytes)
        if failure is not None:
            request.fail(failure)
            return request
        self.requests[request.request_id] = request
        self._starts.append((start, size))
        self._notify()
        return request

    def cancel(self, request: _Request) -> asyncio.Future[agent_pb2.GenerateDone | None] | None:
        """The caller gave up on ``request``: nothing more is delivered for it; the dispatcher is told
        unless the stream is gone or the start was not sent yet (then it is not sent at all, and it leaves
        the map). Returns the future of the dispatcher's answer (:attr:`_Request.answer`) when one will come;
        None when the request had ended, or never reached the dispatcher (nothing consumed)."""
        if not request.end(RequestState.CANCELLED) or self.requests.get(request.request_id) is not request:
            return None
        queued = next((q for q in self._starts if q[0].request.request_id == request.request_id), None)
        answer = None
        if queued is not None:
            self._starts.remove(queued)
            del self.requests[request.request_id]
        elif not self.broken:
            self._cancels.append(request.request_id)
            loop = asyncio.get_running_loop()
            answer = request.answer = loop.create_future()
            loop.call_later(CANCEL_ANSWER_WAIT_S, self._unanswered, request)
        self._notify()
        return answer

    def _unanswered(self, request: _Request) -> None:
        """:data:`CANCEL_ANSWER_WAIT_S` after ``request``'s cancel was sent: unanswered by then (a dispatcher that
        stopped answering), it leaves the map now rather than when the stream ends, and its answer is None. Its id
        stays in :attr:`unanswered` while the stream takes new requests. Nothing once it was answered."""
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
            if not self.retired:
                self.unanswered.add(request.request_id)
            if self._ended():
                self._notify()  # the writer half-closes
        request.answered(None)

    def holds(self, request_id: str) -> bool:
        """``request_id`` is live on this stream (running, cancelled and not answered yet, or left unanswered): a
        new request under it goes under an id of its own."""
        return request_id in self.requests or request_id in self.unanswered

    def retire(self) -> None:
        self.retired = True
        self.unanswered.clear()  # no new request comes to this stream: nothing to keep apart
        self._notify()

    def _notify(self) -> None:
        self._wake.notify()

    def _ended(self) -> bool:
        """Retired, and every request it carried has ended (the map holds only the cancelled ones)."""
        return self.retired and all(r.state is RequestState.CANCELLED for r in self.requests.values())

    async def _write(self) -> None:
        call = self._call
        try:
            while True:
                if not self._starts and not self._cancels:
                    if self._ended():
                        await call.done_writing()
                        return
                    await self._wake.wait()
                    continue
                for message in self._take():
                    self._sending = True
                    await call.write(message)
                    self._sending = False
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            return  # the call ended: the reader fails what the stream carried with its status

    def _take(self) -> list[agent_pb2.GenerateStreamRequest]:
        """The cancels and starts waiting, oldest first, in as few messages as fit ``max_message_bytes``
        (:func:`~switchyard.common.generate_protocol.pack`)."""
        entries: list[tuple[str | agent_pb2.StreamedGenerate, int]] = [
            (request_id, entry_bytes(request_id)) for request_id in self._cancels]
        entries.extend(self._starts)
        self._cancels.clear()
        self._starts.clear()
        messages = []
        for group in pack(entries, self._max_message_bytes):
            message = agent_pb2.GenerateStreamRequest()
            for entry in group:
                if isinstance(entry, str):
                    message.cancel.append(entry)
                else:
                    message.start.append(entry)
            messages.append(message)
        return messages

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
                        continue
                    if request.state is RequestState.CANCELLED:  # by its caller: only its last chunk matters
                        if streamed.HasField("error"):  # it failed meanwhile: what it used came with the error
                            request.answered(streamed.error.consumed if streamed.error.HasField("consumed") else None)
                        elif streamed.chunk.HasField("done"):
                            request.answered(streamed.chunk.done)
                        else:
                            continue
                        del requests[streamed.request_id]
                        continue
                    if streamed.HasField("error"):
                        request.fail(decode_error(streamed.error))
                    else:
                        chunk = streamed.chunk
                        request.chunk_sent(chunk)
                        request.put(chunk)
                    if request.state.ended:
                        del requests[streamed.request_id]
                if self._ended():
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
            request.fail(failure)
            request.answered(None)  # a cancelled one's answer will not come
        self.requests.clear()

    @property
    def done(self) -> bool:
        """The call ended and every request it carried has been told."""
        return self._reader.done()

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


async def _counted(answer: asyncio.Future[agent_pb2.GenerateDone | None],
                   on_consumed: Callable[[agent_pb2.GenerateDone], None]) -> None:
    """Hand the answer to a cancel to ``on_consumed`` once it comes. The stream settles ``answer`` within
    :data:`CANCEL_ANSWER_WAIT_S` (None by then: :meth:`_Stream._unanswered`, armed with the cancel; at once when the
    stream breaks), so that clock is the one bound of this wait. A cancellation of the caller meanwhile (its task's
    time limit, a second cancel) waits for it too, and is raised after: a step's usage is not lost to it."""
    cancelled: asyncio.CancelledError | None = None
    while not answer.done():
        try:
            await asyncio.wait((answer,))  # not ``await answer``: a cancellation here must not cancel the answer
        except asyncio.CancelledError as exc:
            cancelled = exc
    done = answer.result() if answer.done() and not answer.cancelled() else None
    if done is not None:
        on_consumed(done)
    if cancelled is not None:
        raise cancelled


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
        self._repeats = 0
        """Requests sent under a suffixed id because theirs was live on the stream (see :meth:`generate`)."""

    def _stream_for(self) -> _Stream:
        """The stream to start a request on: the current one, or a new one when it is broken or past
        :data:`STREAM_MAX_AGE_S`."""
        stream = self._stream
        if (stream is None or stream.broken or stream.retired
                or time.monotonic() - stream.opened_at > STREAM_MAX_AGE_S):
            self._retired = {s for s in self._retired if not s.done}
            if stream is not None:
                stream.retire()  # it ends when its last request does; held here until then
                self._retired.add(stream)
            stream = self._stream = _Stream(self._stub, self._max_message_bytes)
        return stream

    async def generate(
        self, request: agent_pb2.GenerateRequest, timeout_s: float | None, token_hold_s: float = 0.0,
        on_consumed: Callable[[agent_pb2.GenerateDone], None] | None = None,
    ) -> AsyncIterator[agent_pb2.GenerateChunk]:
        """The chunks of ``request`` (``request_id`` set), as Generate streams them.

        Args:
            timeout_s: the request's time left, seconds; None for no deadline.
            token_hold_s: how long the dispatcher may hold its tokens after the first, seconds (the caller
                merges them over that long anyway); 0: the stream's own rule. Never set on a CORE request
                (refused INVALID_ARGUMENT).
            on_consumed: called once, with what the request consumed, when it did not finish: the caller was
                cancelled (``asyncio.CancelledError`` while it waits for a chunk), stopped reading (closed this
                generator: ``aclose``, its loop left by an exception of its own), or ``timeout_s`` ran out while
                it ran at the dispatcher (the dispatcher's answer to the cancel: its done as it stood,
                ``finish_reason`` ``cancelled``, or the ``consumed`` of the error it failed with meanwhile; waited
                for up to :data:`CANCEL_ANSWER_WAIT_S`, then the cancellation or the DEADLINE_EXCEEDED goes on),
                or the dispatcher failed it after it ran (its error's ``consumed``, before the error is raised).
                Not called when no answer came in time, when the stream broke, or when the request never reached
                the dispatcher or was refused there (nothing consumed). A finished request's done is the
                caller's to count (its last chunk), unless the caller is cancelled before it reads it (the
                cancellation came as the done did): the done goes to ``on_consumed`` then, as a failure's
                ``consumed`` unread at that moment does.

        Raises:
            RequestFailed: the dispatcher ended the request with an error, the stream broke
                (``origin`` ""), or ``timeout_s`` ran out (DEADLINE_EXCEEDED, ``origin`` "").
        """
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # nothing while tracing is off
        stream = self._stream_for()
        if stream.holds(request.request_id):
            # The id is live on this stream: a caller running one task_id twice at once (the reference load
            # does), or a request cancelled here whose chunks may still be on the way (the dispatcher sends until
            # it reads the cancel, and reads a message's starts before its cancels). It goes on the wire under
            # an id of its own; a new stream per repeated id would cost a stream open per request.
            self._repeats += 1
            wired = agent_pb2.GenerateRequest()
            wired.CopyFrom(request)
            wired.request_id = f"{request.request_id}~{self._repeats}"
            request = wired
        pending = stream.start(agent_pb2.StreamedGenerate(
            request=request, timeout_s=encode_timeout(timeout_s), trace_context=carrier, token_hold_s=token_hold_s),
            timeout_s)
        try:
            while True:
                try:
                    item = await pending.get()
                except TimeoutError:  # its deadline here: cancelled there, what it used counted, then it fails
                    answer = stream.cancel(pending)
                    if answer is not None and on_consumed is not None:
                        await _counted(answer, on_consumed)
                    raise deadline_exceeded() from None
                if isinstance(item, RequestFailed):
                    if item.consumed is not None and on_consumed is not None:
                        on_consumed(item.consumed)
                    raise item
                yield item
                if item.HasField("done"):
                    return
        except (asyncio.CancelledError, GeneratorExit):  # the caller was cancelled, or stopped reading (aclose)
            answer = stream.cancel(pending)
            if on_consumed is not None:
                if answer is not None:
                    await _counted(answer, on_consumed)
                elif (unread := pending.unread_end()) is not None:
                    # it had ended, its last item in but unread: a cancellation that came as that item woke the
                    # caller (a task's time limit firing as its step's done arrives) is raised in place of the item
                    on_consumed(unread)
            raise
        finally:
            stream.cancel(pending)  # nothing when it ended (done, failed, or cancelled above)

    async def close(self) -> None:
        """Cancel the open streams (what they carry fails CANCELLED)."""
        streams = [s for s in (self._stream, *self._retired) if s is not None]
        self._stream, self._retired = None, set()
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
