"""``agent.InferenceService.GenerateStream``, and ``Generate`` as a stream of one: one path per request.

A Generate call costs an HTTP/2 stream, its headers, a deadline timer and a
servicer task, and sends one message per chunk. On the orchestrator's hop,
where every task makes such a call, that per-call cost was most of what the
stack spent beyond its caller's own RunTask stream (``tools/pipeline_overhead.py``,
``docs/benchmarks.md``). GenerateStream carries many requests over one
bidirectional stream, as Triton's ``ModelStreamInfer`` does:

- the caller sends :class:`~agent_pb2.GenerateStreamRequest` messages that
  start requests (a ``GenerateRequest`` with its own ``timeout_s`` and W3C
  ``trace_context``) and cancel them;
- the dispatcher answers with :class:`~agent_pb2.GenerateStreamResponse`
  messages, each holding the chunks of every request whose output moved since
  the last one. An engine step appends a token to every request of its batch
  in one go, so a step's tokens leave in one message, as vLLM's engine core
  sends its outputs per step rather than per request.

A request whose start carries ``token_hold_s`` (the orchestrator's BATCH
calls: the interval its RunTask stream merges that task's tokens by) has its
tokens after the first held up to that long: its caller shows them no sooner,
so they leave the dispatcher about as often as the caller shows them, not once
per ``dispatcher.stream_flush_interval_ms``. Its first token, tool calls, last
output (done or error) are never held; a message still leaves as soon as any
request's output is due (:meth:`GenerateSession.hold`).

Each request's chunks are exactly those Generate would stream for it, in
order; a request that fails ends with a :class:`~agent_pb2.StreamedError`
carrying the status Generate would end with, its origin, and what it consumed
until then (``consumed``: the done chunk it would have sent, with what it was
waiting on; unset for a start refused before it became a request), so that a
step its deadline, its upstream or its engine ended is counted as a cancelled
one is. A request the
caller cancels is aborted (its engine work stops, its place and KV are freed)
and answered with one last chunk, its done chunk as it stands then: what it
consumed (its tokens, ``compute_score_used``, ``memory_peak_bytes``),
``finish_reason`` ``cancelled`` (or the reason it had finished with, when
its end crossed the cancel); one cancelled before its engine took it carries
zeros. A request refused while its cancel was on the way answers its error
instead. Nothing is sent for it after that chunk, and a cancel of an id not
running answers nothing: every start gets exactly one last chunk (done or
error), which the caller's side waits for to count what a cancelled step
used. When the stream ends, whatever it still carries is aborted, as a
Generate call whose caller went away.

``Generate`` runs its one request through the same session
(:meth:`switchyard.dispatcher.service.DispatcherService.Generate`)
and streams its chunks as ``GenerateChunk`` messages; its error ends the call
with the same status, the origin trailer and what it consumed
(:data:`~switchyard.common.generate_protocol.CONSUMED_KEY`). The protocol both ends follow
(states, deadline, size, errors, ids) is :mod:`switchyard.common.generate_protocol`.

The stream ends OK once the caller has half-closed it and its requests are
done, or, when the dispatcher drains (SIGTERM), once its requests are done:
new requests are then refused UNAVAILABLE, and the caller starts them on
another replica.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, AsyncIterator

import grpc
from opentelemetry import propagate, trace

from switchyard.api import agent_pb2
from switchyard.common.coalescing import Wakeup
from switchyard.common.errors import SwitchyardError
from switchyard.common.grpc_tracing import record_status
from switchyard.common.generate_protocol import (
    RequestState,
    StreamedRequest,
    check_stream_request_id,
    decode_timeout,
    decode_token_hold,
    encode_error,
)
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.output import OutputItem, StreamDone, StreamError, StreamToken, coalesce
from switchyard.dispatcher.processor import RequestProcessor, consumed, request_span

if TYPE_CHECKING:
    from switchyard.dispatcher.request import Request

log = logging.getLogger(__name__)


HOLD_SLACK_S = 0.001
"""Held tokens due within this many seconds leave with the message going now, rather than wake the stream again."""


class _Running(StreamedRequest):
    """One request of a session: its protocol state, its engine request once opened, its
    ``dispatcher.generate`` span, and its token hold (its start's ``token_hold_s``)."""

    __slots__ = ("req", "span", "hold_s", "held_until", "due")

    def __init__(self, request_id: str, span: trace.Span) -> None:
        super().__init__(request_id)
        self.req: Request | None = None  # None while it is validated and counted
        self.span = span
        self.hold_s = 0.0  # its tokens after the first wait up to this long, seconds (0: not held)
        self.held_until = 0.0  # loop time: its tokens wait until then (its last chunks left + hold_s)
        self.due = False  # its output waiting must leave now, hold or not (a first output, a tool call, an end)


class GenerateSession:
    """The requests of one GenerateStream call, or of one Generate call, on the dispatcher.

    Starts and cancels come in (:meth:`read` takes them off a GenerateStream's
    request stream; Generate calls :meth:`start` once); the handler takes what
    is ready to send with :meth:`replies`: every chunk its requests' output
    (:class:`~switchyard.dispatcher.output.OutputStream`) holds, tokens waiting
    together merged. While the handler writes, more output comes, so the next
    replies carry it all: under load a message per engine step, not per token
    per request.

    A request with a token hold (its start's ``token_hold_s``) sends its tokens
    at most once per hold: :meth:`replies` leaves them waiting until the hold
    is over (a timer wakes it then), unless something of the request is due
    now (its first output, a tool call, its end).

    One map holds the requests (request id -> :class:`_Running`, its
    :class:`~switchyard.common.generate_protocol.RequestState`); a request
    leaves it when it ends. Refused starts have no place in it (the id may be
    running): their error chunks wait in the write buffer.
    """

    def __init__(self, processor: RequestProcessor) -> None:
        self._processor = processor
        self._requests: dict[str, _Running] = {}
        self._unsent: list[agent_pb2.StreamedChunk] = []  # encoded, not yet taken by replies()
        self._wake = Wakeup()  # replies() waits on it for output
        self._hold = Wakeup()  # hold() waits on it for its time or for output that must not wait
        self._urgent = False  # output that must not wait is ready (a first output, a refusal)
        self._intake_open = True
        self._intake_error: Exception | None = None
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None  # wakes replies() when the first held tokens are due
        self._timer_at = math.inf

    # ------------------------------------------------------------------ the handler's side

    async def replies(self) -> list[agent_pb2.StreamedChunk] | None:
        """The chunks ready to send, oldest first per request, waiting until there are some; None once the
        session is done (no request left, and no start to come or the dispatcher drains).

        Raises:
            Exception: what broke the caller's side of the stream (:meth:`read`).
        """
        while True:
            chunks = self._collect()
            if chunks:
                return chunks
            if self._intake_error is not None:
                raise self._intake_error
            # the dispatcher drains (the processor reads the one flag): a stream ends as soon as it is idle
            if not self._requests and (not self._intake_open or self._processor.draining):
                return None
            await self._wake.wait()

    async def hold(self, seconds: float) -> None:
        """Let output gather for up to ``seconds`` before the next :meth:`replies`, while more than one
        request is open (a request alone is never held); cut short when a request's first output (its
        TTFT), its last (its end), any output of a CORE request or a refusal becomes ready, or the session
        can end. NORMAL and BATCH tokens between the first and the last are what waits: at most ``seconds``
        more inter-token latency, and no later an end. A request with a token hold waits its own hold
        besides (:meth:`replies` takes its tokens once that is over)."""
        if len(self._requests) < 2 or self._urgent:
            return
        handle = asyncio.get_running_loop().call_later(seconds, self._hold.notify)
        try:
            await self._hold.wait()
        finally:
            handle.cancel()

    def _collect(self) -> list[agent_pb2.StreamedChunk]:
        chunks, self._unsent = self._unsent, []
        self._urgent = False
        processor = self._processor
        ended: list[_Running] = []
        now = self._loop.time()
        next_due = math.inf  # when the first tokens held back here are due
        for running in self._requests.values():
            req = running.req
            if req is None or not req.output.pending():
                continue
            if running.hold_s:
                if not running.due and running.held_until - now > HOLD_SLACK_S:
                    next_due = min(next_due, running.held_until)
                    continue
                running.held_until = now + running.hold_s
            running.due = False
            request_id = running.request_id
            for item in coalesce(req.output.drain()):
                try:
                    chunk = processor.chunk(req, item)
                except SwitchyardError as exc:  # it ran (or waited): what it used goes with the error
                    chunks.append(agent_pb2.StreamedChunk(request_id=request_id,
                                                          error=encode_error(exc, consumed(req))))
                    record_status(running.span, exc.code, str(exc), client=False)
                    running.end(RequestState.FAILED)
                    break
                if chunk is None:  # nothing for the caller (a prefill_only request's token)
                    continue
                chunks.append(agent_pb2.StreamedChunk(request_id=request_id, chunk=chunk))
                running.chunk_sent(chunk)
                if running.state is RequestState.DONE:
                    processor.record_done(req, running.span)
                    break
            if running.state.ended:
                ended.append(running)
        for running in ended:
            self._release(running)
        if next_due != math.inf:
            self._wake_at(next_due)
        return chunks

    def _wake_at(self, when: float) -> None:
        """Wake :meth:`replies` at loop time ``when`` (held tokens are due), unless it is woken sooner."""
        if when >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._wake.notify()

    def close(self) -> None:
        """The call ends: cancel what it still carries (each aborted, its place and KV freed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        for running in list(self._requests.values()):
            self.cancel(running.request_id)

    def drain(self) -> None:
        """The dispatcher drains (its scheduler's intake closed, read through the processor): wake the session,
        which ends once its requests are done."""
        self._urgent_now()
        self._wake.notify()

    # ------------------------------------------------------------------ the caller's side

    async def read(self, request_iterator: AsyncIterator[agent_pb2.GenerateStreamRequest]) -> None:
        """Take a GenerateStream's starts and cancels until the caller half-closes (a message's starts
        before its cancels); what breaks the stream is raised by :meth:`replies`."""
        try:
            async for message in request_iterator:
                arrived = time.monotonic()  # every start of a message arrived now, however long those before it take
                for start in message.start:
                    await self.start(start.request, start.timeout_s, dict(start.trace_context), streamed=True,
                                     token_hold_s=start.token_hold_s, arrived=arrived)
                for request_id in message.cancel:
                    self.cancel(request_id)
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which ends the call with it
            self._intake_error = exc
        finally:
            self.close_intake()

    def close_intake(self) -> None:
        """No start follows: the session ends once its requests have."""
        self._intake_open = False
        self._urgent_now()
        self._wake.notify()

    async def start(self, request: agent_pb2.GenerateRequest, timeout_s: float | None,
                    trace_context: dict[str, str] | None, streamed: bool = False, token_hold_s: float = 0.0,
                    arrived: float | None = None) -> None:
        """Start ``request`` with ``timeout_s`` seconds left when it ``arrived`` (None: no deadline); a refusal is
        its error chunk.

        ``arrived``: when its start arrived, ``time.monotonic()`` seconds (the GenerateStream message that carried
        it; None: now, a Generate call's): its ``Request.arrival``, which its deadline, queue wait and TTFT count
        from (:meth:`RequestProcessor.open_request`), whatever validating it, or the starts before it in its
        message, took.

        ``trace_context``: the W3C carrier of a stream's start (its span is then the request's server
        span); None for Generate, whose span is a child of the call's own. ``streamed``: ``timeout_s`` and
        ``token_hold_s`` (how long its tokens after the first may wait, seconds; 0: the stream's own rule)
        are the start's wire values (:func:`decode_timeout`, :func:`decode_token_hold`; a bad one refuses
        this request alone, INVALID_ARGUMENT naming the field).
        """
        arrived = time.monotonic() if arrived is None else arrived
        request_id = request.request_id
        if trace_context is None:
            span = request_span(None, trace.SpanKind.INTERNAL)
        else:
            parent = propagate.extract(trace_context) if trace_context else None
            span = request_span(parent, trace.SpanKind.SERVER)
        running = _Running(request_id, span)
        existing = self._requests.get(request_id)
        try:
            check_stream_request_id(request_id, self._requests)
            self._requests[request_id] = running
            if streamed:
                timeout_s = decode_timeout(timeout_s)
                running.hold_s = decode_token_hold(token_hold_s, request.priority)
            req = await self._processor.open_request(request, timeout_s, span, arrived)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the stream's others
            if not isinstance(exc, SwitchyardError):
                log.exception("dispatcher: starting request %s failed", request_id)
                span.record_exception(exc)
                exc = SwitchyardError(f"starting the request failed: {type(exc).__name__}: {exc}",
                                      grpc.StatusCode.INTERNAL)
            if self._requests.get(request_id) is running:  # not the request already running under this id
                del self._requests[request_id]
            used = None  # this start never became a request: nothing it consumed
            if existing is not None and existing.end(RequestState.FAILED):
                # a second start under a running id: the caller cannot tell the two apart, so the one error chunk
                # the id gets ends both (the first is aborted, and what it used goes with the error; else it went
                # on generating for nobody)
                record_status(existing.span, exc.code, str(exc), client=False)
                self._release(existing)
                if existing.req is not None:
                    used = consumed(existing.req)
            # its last chunk, also when it was cancelled meanwhile (the error answers the cancel: nothing ran)
            if running.end(RequestState.FAILED) or running.state is RequestState.CANCELLED:
                record_status(span, exc.code, str(exc), client=False)
                span.end()
                self._send_now(agent_pb2.StreamedChunk(request_id=request_id, error=encode_error(exc, used)))
            return
        running.req = req
        if running.state.ended:  # ended while it was checked: it runs for nobody
            self._abort(req)
            if running.state is RequestState.CANCELLED:  # cancelled: answered with its done chunk now
                self._answer_cancel(running, req)
            return  # failed (the drain's end, :meth:`end_all`): its error went out then
        req.output.listener = lambda item: self._output_ready(running, item)
        if req.output.pending():
            self._output_ready(running, None)

    def _output_ready(self, running: _Running, item: OutputItem | None) -> None:
        """``running``'s output moved (``item`` pushed; None: output pushed before the session listened): wake
        replies(), and cut a hold short when the output must not wait: the request's first (its TTFT), its
        last (its end, which the caller's next step waits on), or any of a CORE request's (its inter-token
        latency). A token of a request with a token hold wakes nothing before that hold is over (a timer
        does then); its tool call ends the hold. Its end is told by the item (``StreamDone``, ``StreamError``),
        not by asking the request while the loop's publish, below on the stack, pushes it."""
        req = running.req
        if (running.state is RequestState.STARTED or isinstance(item, (StreamDone, StreamError))
                or (req is not None and req.priority is PriorityClass.CORE)):
            running.due = True
            self._urgent_now()
        elif running.hold_s and not running.due:
            if not isinstance(item, StreamToken):
                running.due = True
            elif running.held_until - self._loop.time() > HOLD_SLACK_S:
                self._wake_at(running.held_until)
                return
        self._wake.notify()

    def _urgent_now(self) -> None:
        self._urgent = True
        self._hold.notify()

    def cancel(self, request_id: str) -> None:
        """The caller gave up on ``request_id``: abort it (its engine work stops now, its place and KV are freed)
        and answer with its done chunk as it stands (:meth:`_answer_cancel`); nothing else is sent for it.
        Nothing happens when it is not running. One still being validated is answered once that ends
        (:meth:`start`)."""
        running = self._requests.get(request_id)
        if running is not None and running.end(RequestState.CANCELLED):
            record_status(running.span, grpc.StatusCode.CANCELLED, None, client=False)
            self._release(running)
            if running.req is not None:
                self._answer_cancel(running, running.req)

    def end_all(self, error: SwitchyardError) -> None:
        """The dispatcher's drain ran out (``server.shutdown_grace_s``): end every request still running here with
        ``error`` and what it consumed until now (its engine work stops, its place and KV freed), as its last
        chunk; the session then ends (the dispatcher drains). The server's own cancel, which came next, read only
        'Cancelling all calls', and what the requests had used was lost with it."""
        for running in list(self._requests.values()):
            if not running.end(RequestState.FAILED):
                continue
            record_status(running.span, error.code, str(error), client=False)
            self._release(running)
            used = None
            if running.req is not None:
                running.req.output.drain()  # the caller takes no more of its output: the error is its end
                used = consumed(running.req)
            self._send_now(agent_pb2.StreamedChunk(request_id=running.request_id, error=encode_error(error, used)))

    def _answer_cancel(self, running: _Running, req: Request) -> None:
        """Send ``req``'s done chunk, aborted: what it consumed until its cancel (its usage, compute score and
        KV peak, all charged by the scheduler as it ended; zeros for one the engine never took), finish reason
        ``cancelled`` (or the one it finished with before the cancel came). Its output still waiting is
        dropped: the caller wants none of it."""
        req.output.drain()
        self._send_now(agent_pb2.StreamedChunk(request_id=running.request_id,
                                               chunk=agent_pb2.GenerateChunk(done=consumed(req))))

    def _send_now(self, chunk: agent_pb2.StreamedChunk) -> None:
        """Queue ``chunk`` for the next :meth:`replies`, a hold cut short: a request's last chunk."""
        self._unsent.append(chunk)
        self._urgent_now()
        self._wake.notify()

    # ------------------------------------------------------------------ both

    def _release(self, running: _Running) -> None:
        """``running`` ended: out of the map, its span ended, and aborted when it ended unfinished."""
        if self._requests.get(running.request_id) is running:
            del self._requests[running.request_id]
        req = running.req
        if req is not None:
            req.output.listener = None
            self._abort(req)
            if running.state is not RequestState.DONE:  # a done one's were written with its done chunk
                self._processor.record_unfinished(req, running.span)
        running.span.end()

    def _abort(self, req: Request) -> None:
        loop = self._processor.loop
        if not req.is_finished and loop is not None:
            loop.abort(req)
