"""``agent.InferenceService.GenerateStream``: many requests over one long-lived stream.

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

Each request's chunks are exactly those Generate would stream for it, in
order; a request that fails ends with a :class:`~agent_pb2.StreamedError`
carrying the status Generate would end with and its origin. A request the
caller cancels is aborted (its place and KV freed) and nothing more is sent
for it. When the stream ends, whatever it still carries is aborted, as a
Generate call whose caller went away.

The stream ends OK once the caller has half-closed it and its requests are
done, or, when the dispatcher drains (SIGTERM), once its requests are done:
new requests are then refused UNAVAILABLE, and the caller starts them on
another replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, AsyncIterator

import grpc
from opentelemetry import propagate, trace

from switchyard.api import agent_pb2
from switchyard.common import telemetry
from switchyard.common.errors import InvalidArgument, SwitchyardError, status_for
from switchyard.common.coalescing import Wakeup
from switchyard.dispatcher.output import coalesce

if TYPE_CHECKING:
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.service import DispatcherService

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)


class _Running:
    """One request of a session: its state and its ``dispatcher.generate`` span."""

    __slots__ = ("request_id", "req", "span")

    def __init__(self, request_id: str, req: Request | None, span: trace.Span) -> None:
        self.request_id = request_id
        self.req = req
        self.span = span


class GenerateSession:
    """One GenerateStream call on the dispatcher: reads starts and cancels, writes chunks.

    A reader task takes the caller's messages; the handler's own task writes.
    Requests push their output (:class:`~switchyard.dispatcher.output.OutputStream`)
    and mark themselves ready; the writer takes every ready request's items in
    one message. While a write is in flight more requests get ready, so the
    next message carries them all: under load a message per engine step, not
    per token per request.
    """

    def __init__(self, service: DispatcherService, context: grpc.aio.ServicerContext) -> None:
        self._service = service
        self._context = context
        self._running: dict[str, _Running] = {}
        self._ready: dict[str, _Running] = {}  # insertion-ordered: requests first ready are sent first
        self._failed: list[agent_pb2.StreamedChunk] = []  # refused starts, sent with the next message
        self._wake = Wakeup()
        self._reading = True
        self._draining = service.draining  # a stream that arrives once the drain began ends as soon as it is idle
        self._max_bytes = service.config.server.max_message_bytes

    # ------------------------------------------------------------------ the handler's task: writing

    async def run(self, request_iterator: AsyncIterator[agent_pb2.GenerateStreamRequest]) -> None:
        """Serve the stream until it is done (see the module docstring); abort what it still carries."""
        reader = asyncio.create_task(self._read(request_iterator), name="generate-stream-reader")
        try:
            while True:
                if not self._ready and not self._failed:
                    if not self._running and (not self._reading or self._draining):
                        return
                    await self._wake.wait()
                    if reader.done() and reader.exception() is not None:
                        reader.result()  # the caller's side broke: raise; the finally below aborts the rest
                    continue
                for response in _messages(self._collect(), self._max_bytes):
                    await self._context.write(response)
        finally:
            reader.cancel()
            for running in list(self._running.values()):
                self._end(running, cancelled=True)

    def _collect(self) -> list[agent_pb2.StreamedChunk]:
        """Every ready request's output items (tokens waiting together merged), and refused starts."""
        chunks = self._failed
        self._failed = []
        ready, self._ready = self._ready, {}
        service = self._service
        for running in ready.values():
            req = running.req
            if req is None or self._running.get(running.request_id) is not running:
                continue  # cancelled by the caller since it got ready
            for item in coalesce(req.output.drain()):
                try:
                    chunk = service.chunk(req, item)
                except SwitchyardError as exc:
                    chunks.append(_error_chunk(running.request_id, exc))
                    running.span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
                    self._end(running)
                    break
                chunks.append(agent_pb2.StreamedChunk(request_id=running.request_id, chunk=chunk))
                if chunk.HasField("done"):
                    service.record_done(req, running.span)
                    self._end(running)
                    break
        return chunks

    def _end(self, running: _Running, cancelled: bool = False) -> None:
        """Forget ``running``; when it ends unfinished (cancelled, or the stream ended), abort it."""
        self._running.pop(running.request_id, None)
        req, loop = running.req, self._service.loop
        if req is not None:
            req.output.listener = None
            if not req.is_finished and loop is not None:
                loop.abort(req)
        if cancelled:
            running.span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
        running.span.end()

    def _notify(self) -> None:
        self._wake.notify()

    def drain(self) -> None:
        """The dispatcher drains: refuse new requests, end the stream once its requests are done."""
        self._draining = True
        self._notify()

    # ------------------------------------------------------------------ the reader task

    async def _read(self, request_iterator: AsyncIterator[agent_pb2.GenerateStreamRequest]) -> None:
        try:
            async for message in request_iterator:
                for start in message.start:
                    await self._start(start)
                for request_id in message.cancel:
                    running = self._running.get(request_id)
                    if running is not None:
                        self._end(running, cancelled=True)
        finally:
            self._reading = False
            self._notify()

    async def _start(self, start: agent_pb2.StreamedGenerate) -> None:
        request = start.request
        request_id = request.request_id
        carrier = dict(start.trace_context)
        parent = propagate.extract(carrier) if carrier else None
        span = tracer.start_span("dispatcher.generate", parent, kind=trace.SpanKind.SERVER)
        running = _Running(request_id, None, span)
        try:
            if not request_id:
                raise InvalidArgument("request_id", "a non-empty id, unique among the stream's running requests", "")
            if request_id in self._running:
                raise InvalidArgument("request_id", "an id not already running on this stream", request_id)
            self._running[request_id] = running
            req = await self._service.open_request(request, start.timeout_s or None, span)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the stream's others
            if not isinstance(exc, SwitchyardError):
                log.exception("dispatcher: starting request %s failed", request_id)
                span.record_exception(exc)
                exc = SwitchyardError(f"starting the request failed: {type(exc).__name__}: {exc}",
                                      grpc.StatusCode.INTERNAL)
            if self._running.get(request_id) is running:  # not the request already running under this id
                del self._running[request_id]
            span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
            span.end()
            self._failed.append(_error_chunk(request_id, exc))
            self._notify()
            return
        if self._running.get(request_id) is not running:  # cancelled while it was being counted
            if not req.is_finished and self._service.loop is not None:
                self._service.loop.abort(req)
            return
        running.req = req
        req.output.listener = lambda: self._mark_ready(running)
        if req.output.pending():
            self._mark_ready(running)

    def _mark_ready(self, running: _Running) -> None:
        self._ready[running.request_id] = running
        self._notify()


MESSAGE_OVERHEAD_BYTES = 1024
"""Room left under ``server.max_message_bytes`` when chunks are packed into one message."""


def _messages(chunks: list[agent_pb2.StreamedChunk], max_bytes: int) -> list[agent_pb2.GenerateStreamResponse]:
    """``chunks`` packed in order into as few messages as fit ``max_bytes`` each (a message larger than the
    peer's limit would end the stream and every request on it). A chunk that alone exceeds the limit goes
    in a message of its own, as Generate would send it."""
    budget = max_bytes - MESSAGE_OVERHEAD_BYTES
    messages: list[agent_pb2.GenerateStreamResponse] = []
    batch: list[agent_pb2.StreamedChunk] = []
    size = 0
    for chunk in chunks:
        n = chunk.ByteSize() + 8  # field tag and length prefix
        if batch and size + n > budget:
            messages.append(agent_pb2.GenerateStreamResponse(chunks=batch))
            batch, size = [], 0
        batch.append(chunk)
        size += n
    if batch:
        messages.append(agent_pb2.GenerateStreamResponse(chunks=batch))
    return messages


def _error_chunk(request_id: str, exc: SwitchyardError) -> agent_pb2.StreamedChunk:
    code, details = status_for(exc)
    origin = getattr(exc, "origin", "") or "dispatcher"
    return agent_pb2.StreamedChunk(
        request_id=request_id, error=agent_pb2.StreamedError(code=code.value[0], details=details, origin=origin)
    )
