"""Test dispatchers written as Generate handlers also serve GenerateStream, the orchestrator's hop.

:class:`GenerateStreamFromGenerate` runs the servicer's own ``Generate`` for
each request a GenerateStream starts, with a context that answers
``time_remaining()`` from the request's ``timeout_s`` and turns ``abort`` into
the request's error; a cancel from the caller cancels that request's task and
is answered, as the dispatcher answers it, with the request's done chunk
(``finish_reason`` cancelled; what it consumed: the servicer's
:meth:`GenerateStreamFromGenerate.cancelled_done`). An abort after the request
ran carries what it consumed when the servicer says
(:meth:`GenerateStreamFromGenerate.failed_consumed`), as the dispatcher's error does.
"""

from __future__ import annotations

import asyncio

import grpc

from switchyard.api import agent_pb2


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, origin: str) -> None:
        super().__init__(details)
        self.code, self.details, self.origin = code, details, origin


class _RequestContext:
    """What a Generate handler asks of its context, for one request of a stream."""

    def __init__(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s if timeout_s > 0 else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        origin = dict(trailing_metadata).get("switchyard-error-origin", "dispatcher")
        raise _Aborted(code, details, origin)


class GenerateStreamFromGenerate:
    """Mixin: ``GenerateStream`` served by the class's ``Generate``, a task per request."""

    answers_cancels = True
    """Whether a cancel is answered (False: as a dispatcher that stopped answering, none comes)."""

    def cancelled_done(self, request: agent_pb2.GenerateRequest, tokens: int) -> agent_pb2.GenerateDone:
        """The answer to a cancel of ``request`` after it streamed ``tokens`` tokens (what the dispatcher
        charges it: here a fixed compute score and KV peak once a token came, zeros before)."""
        return agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=tokens, total_tokens=10 + tokens),
            compute_score_used=0.25 if tokens else 0.0, memory_peak_bytes=700 if tokens else 0,
            finish_reason="cancelled", model="fake")

    def failed_consumed(self, request: agent_pb2.GenerateRequest, tokens: int) -> agent_pb2.GenerateDone | None:
        """What ``request`` consumed when its Generate aborted after ``tokens`` tokens (``StreamedError.consumed``);
        None: nothing said (a refusal, or a dispatcher of an earlier build)."""
        return None

    async def GenerateStream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        lock = asyncio.Lock()
        tasks: dict[str, asyncio.Task] = {}

        async def send(streamed: agent_pb2.StreamedChunk) -> None:
            async with lock:
                await context.write(agent_pb2.GenerateStreamResponse(chunks=[streamed]))

        cancelled: set[str] = set()

        async def run(start: agent_pb2.StreamedGenerate) -> None:
            request_id = start.request.request_id
            tokens = 0
            try:
                async for chunk in self.Generate(start.request, _RequestContext(start.timeout_s)):
                    tokens += chunk.HasField("token")
                    await send(agent_pb2.StreamedChunk(request_id=request_id, chunk=chunk))
            except asyncio.CancelledError:
                if request_id in cancelled and self.answers_cancels:  # by the caller's cancel: answered
                    done = self.cancelled_done(start.request, tokens)
                    await send(agent_pb2.StreamedChunk(request_id=request_id, chunk=agent_pb2.GenerateChunk(done=done)))
                raise
            except _Aborted as exc:
                await send(agent_pb2.StreamedChunk(request_id=request_id, error=agent_pb2.StreamedError(
                    code=exc.code.value[0], details=exc.details, origin=exc.origin,
                    consumed=self.failed_consumed(start.request, tokens))))
            finally:
                tasks.pop(request_id, None)
                cancelled.discard(request_id)

        try:
            async for message in request_iterator:
                for start in message.start:
                    tasks[start.request.request_id] = asyncio.create_task(run(start))
                for request_id in message.cancel:
                    task = tasks.get(request_id)
                    if task is not None:
                        cancelled.add(request_id)
                        task.cancel()
            await asyncio.gather(*list(tasks.values()), return_exceptions=True)
        finally:
            for task in list(tasks.values()):
                task.cancel()
