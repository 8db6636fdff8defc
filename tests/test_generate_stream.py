"""GenerateStream, the orchestrator's hop to the dispatcher: many requests over one bidirectional stream.

Real sim dispatchers on 127.0.0.1:0. The dispatcher's side is driven by hand
(:class:`RawStream`: starts and cancels written as the caller chooses, what
comes back collected per request); the orchestrator's side through
:class:`GenerateStreamClient` and :class:`InferenceClient`. Each request's
chunks are compared with what Generate streams for the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import defaultdict
from typing import AsyncIterator

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import SwitchyardError
from switchyard.common.server import RunningServer, start_server
from switchyard.dispatcher.engines.base import StreamEngine
from switchyard.dispatcher.processor import COUNT_IN_THREAD_BYTES
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator import generate_stream
from switchyard.orchestrator.clients import InferenceClient
from switchyard.orchestrator.program import Budget
from switchyard.orchestrator.generate_stream import GenerateStreamClient, RequestFailed
from switchyard.orchestrator.validation import TaskSpec
from fast_sim import FAST
from token_events import positions_follow_on, token_count

pytestmark = pytest.mark.no_gpu

PROMPT = ("<context>\n[1] The with statement\nThe with statement works " + " ".join(f"step{i}" for i in range(600))
          + ".\n</context>\n<question>How does the with statement work?</question>")
"""The sim answers it with ~600 tokens: a request runs to its max_tokens (finish_reason length)."""

SLOW = {"sim.decode_base_ms": 20.0}  # a step every ~20 ms: requests stay running while the test acts
MEDIUM = {"sim.decode_base_ms": 10.0}  # for requests the test lets run to their end
HANG_BOUND_S = 10.0  # what "did not wait out the grace (30 s)" means below: a bound on a hang, not a speed


def make_config(**overrides: object) -> SwitchyardConfig:
    return SwitchyardConfig().with_overrides(**{**FAST, **overrides})


@contextlib.asynccontextmanager
async def dispatcher(engine: StreamEngine | None = None, **overrides: object) -> AsyncIterator[
        tuple[DispatcherService, RunningServer, grpc.aio.Channel]]:
    """A dispatcher served on 127.0.0.1:0 (the sim engine, or ``engine``), and a channel to it."""
    service = DispatcherService(make_config(**overrides), engine=engine)
    srv = await start_server([service], "127.0.0.1", 0, service.config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}")
    try:
        yield service, srv, channel
    finally:
        await channel.close()
        await srv.stop(1.0)


def held(service: DispatcherService) -> int:
    """Requests the dispatcher's scheduler still holds (running, waiting or queued)."""
    s = service.scheduler
    return s.num_running + s.num_waiting + s.num_queued


async def wait_until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def start(request_id: str, timeout_s: float = 0.0, token_hold_s: float = 0.0,
          **fields: object) -> agent_pb2.StreamedGenerate:
    fields.setdefault("prompt", PROMPT)
    return agent_pb2.StreamedGenerate(
        request=agent_pb2.GenerateRequest(request_id=request_id, **fields), timeout_s=timeout_s,
        token_hold_s=token_hold_s)


class RawStream:
    """One GenerateStream call driven by hand; what comes back is collected per request id."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
        self.chunks: dict[str, list[agent_pb2.GenerateChunk]] = defaultdict(list)
        self.errors: dict[str, list[agent_pb2.StreamedError]] = defaultdict(list)
        self.messages = 0  # GenerateStreamResponse messages received
        self._changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while (message := await self.call.read()) is not grpc.aio.EOF:
            self.messages += 1
            for streamed in message.chunks:
                if streamed.HasField("error"):
                    self.errors[streamed.request_id].append(streamed.error)
                else:
                    self.chunks[streamed.request_id].append(streamed.chunk)
            self._changed.set()
        self._changed.set()

    async def send(self, *starts: agent_pb2.StreamedGenerate, cancel: tuple[str, ...] = ()) -> None:
        await self.call.write(agent_pb2.GenerateStreamRequest(start=starts, cancel=cancel))

    def done(self, request_id: str) -> bool:
        """Whether ``request_id``'s done chunk came."""
        chunks = self.chunks.get(request_id, [])
        return bool(chunks and chunks[-1].HasField("done"))

    def ended(self, request_id: str) -> bool:
        """Whether ``request_id``'s done chunk or an error for it came."""
        return self.done(request_id) or bool(self.errors.get(request_id))

    async def until(self, predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
        async def wait() -> None:
            while not predicate():
                if self.reader.done():
                    self.reader.result()
                    raise AssertionError(f"the stream ended before: {what}")
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(wait(), timeout)

    async def close(self) -> grpc.StatusCode:
        """Half-close, read to the end; the call's status."""
        await self.call.done_writing()
        await self.reader
        return await self.call.code()


def summary(chunks: list[agent_pb2.GenerateChunk]) -> tuple:
    """What a request's chunks say, however its tokens were grouped into chunks."""
    tokens = [c.token for c in chunks if c.HasField("token")]
    assert positions_follow_on(tokens)
    kinds = [c.WhichOneof("chunk") for c in chunks]
    assert kinds.count("done") == 1 and kinds[-1] == "done"
    done = chunks[-1].done
    calls = [(c.tool_call.name, c.tool_call.arguments_json) for c in chunks if c.HasField("tool_call")]
    assert calls or done.usage.completion_tokens == token_count(tokens)  # a tool call's tokens are not sent as text
    return ("".join(t.text for t in tokens), token_count(tokens), calls, done.usage.prompt_tokens,
            done.usage.completion_tokens, done.usage.total_tokens, done.finish_reason, done.model)


# --------------------------------------------------------------------------- the dispatcher's side


async def test_many_requests_on_one_stream_get_what_generate_streams() -> None:
    requests = [start(f"r{i}", max_tokens=3 + 7 * i) for i in range(8)]
    requests.append(start("chat", prompt="", messages=[agent_pb2.ChatMessage(role="user", content="hello there")],
                          max_tokens=12))
    requests.append(start("tools", prompt="", tools=[agent_pb2.ToolSpec(name="search_docs",
                                                                         parameters_json='{"type": "object"}')],
                          messages=[agent_pb2.ChatMessage(role="user", content="<question>what is with?</question>")]))
    async with dispatcher() as (service, _srv, channel):
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        expected = {s.request.request_id: summary([c async for c in stub.Generate(s.request, timeout=30)])
                    for s in requests}
        stream = RawStream(channel)
        await stream.send(*requests[:5])  # several starts in one message, and one a message
        for s in requests[5:]:
            await stream.send(s)
        await stream.until(lambda: all(stream.ended(s.request.request_id) for s in requests), "every request ends")
        assert await stream.close() == grpc.StatusCode.OK
        assert not stream.errors
        assert {rid: summary(chunks) for rid, chunks in stream.chunks.items()} == expected
        assert expected["r7"][4] == 52 and expected["r7"][6] == "length"
        assert expected["tools"][2] == [("search_docs", '{"query": "what is with?"}')]
        assert expected["tools"][6] == "tool_calls"
        assert held(service) == 0 and not service._sessions


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (start("bad", max_tokens=10**6), "max_tokens"),
        (start("bad", prompt=""), "prompt"),
        (start("", max_tokens=4), "request_id"),
        (start("bad", messages=[agent_pb2.ChatMessage(role="robot", content="hi")]), "messages[0].role"),
        (start("a", max_tokens=4), "request_id"),  # "a" is running on this stream
        (start("bad", max_tokens=4, timeout_s=float("nan")), "timeout_s"),  # read as "no deadline"
        (start("bad", max_tokens=4, timeout_s=-1.0), "timeout_s"),
        (start("bad", max_tokens=4, timeout_s=float("inf")), "timeout_s"),
        (start("bad", max_tokens=4, agent_id="a\x00b"), "agent_id"),  # the orchestrator refuses it
    ],
    ids=["max_tokens", "empty-prompt", "empty-request_id", "role", "running-request_id", "nan-timeout",
         "negative-timeout", "infinite-timeout", "nul-agent_id"],
)
async def test_a_bad_request_is_invalid_argument_naming_the_field_and_the_others_go_on(
    bad: agent_pb2.StreamedGenerate, field: str
) -> None:
    async with dispatcher(**MEDIUM) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=20))
        await stream.until(lambda: stream.chunks["a"], "a streams")
        await stream.send(bad, start("b", max_tokens=10))
        bad_id = bad.request.request_id
        await stream.until(lambda: stream.errors.get(bad_id), "the bad request is refused")
        [error] = stream.errors[bad_id]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert error.details.startswith(field), error.details
        assert error.origin == "dispatcher"
        if bad_id == "a":  # a second start under the running id: the one error ends both
            await stream.until(lambda: stream.done("b"), "b ends")
            assert not stream.done("a")
        else:
            await stream.until(lambda: stream.done("a") and stream.done("b"), "a and b end")
            assert summary(stream.chunks["a"])[4] == 20
        assert await stream.close() == grpc.StatusCode.OK
        assert summary(stream.chunks["b"])[4] == 10
        assert list(stream.errors) == [bad_id]
        assert held(service) == 0


async def test_a_cancelled_request_is_freed_and_answered_with_what_it_consumed_then_nothing_more() -> None:
    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("long", max_tokens=500), start("short", max_tokens=15))
        await stream.until(lambda: stream.chunks["long"], "long streams")
        assert service.scheduler.num_running == 2
        await stream.send(cancel=("long",))
        await wait_until(lambda: service.scheduler.num_running == 1, "long is freed")
        await stream.until(lambda: stream.ended("long"), "the cancel is answered")
        got = len(stream.chunks["long"])
        done = stream.chunks["long"][-1].done  # its last chunk: what it consumed until the cancel
        assert done.finish_reason == "cancelled" and "long" not in stream.errors
        assert done.compute_score_used > 0 and done.memory_peak_bytes > 0
        streamed = token_count([c.token for c in stream.chunks["long"] if c.HasField("token")])
        assert streamed <= done.usage.completion_tokens < 500  # tokens made after the last one sent count too
        assert done.usage.prompt_tokens > 0
        await stream.send(start("after", max_tokens=5))  # read after the cancel: its chunks come after
        await stream.until(lambda: stream.ended("short") and stream.ended("after"), "short and after end")
        assert len(stream.chunks["long"]) == got  # nothing after its answer
        assert summary(stream.chunks["short"])[4] == 15
        await stream.send(cancel=("long", "never-started"))  # cancelling what is not running: nothing happens
        assert await stream.close() == grpc.StatusCode.OK
        assert len(stream.chunks["long"]) == got and not stream.chunks["never-started"]
        assert not stream.errors
        assert held(service) == 0 and service.scheduler.capacity.reserved_bytes == 0  # type: ignore[attr-defined]


async def test_a_cancel_in_the_message_of_its_start_frees_it_large_or_small() -> None:
    large = start("large", max_tokens=300, tools=[agent_pb2.ToolSpec(name="t", description="d" * COUNT_IN_THREAD_BYTES)])
    assert large.request.ByteSize() > COUNT_IN_THREAD_BYTES  # validated and counted in a thread
    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(large, start("small", max_tokens=300), start("kept", max_tokens=6), cancel=("large", "small"))
        await stream.send(start("large2", max_tokens=300))
        await stream.send(cancel=("large2",))  # arrives while large2 may still be counted in its thread
        await stream.until(lambda: stream.ended("kept"), "kept ends")
        await wait_until(lambda: held(service) == 0, "the cancelled requests are freed")
        assert summary(stream.chunks["kept"])[4] == 6
        assert not stream.errors
        assert await stream.close() == grpc.StatusCode.OK
        for rid in ("large", "small"):  # cancelled before the engine took them: answered, nothing consumed
            assert [c.WhichOneof("chunk") for c in stream.chunks[rid]] == ["done"]
            done = stream.chunks[rid][0].done
            assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
            assert done.compute_score_used == 0 and done.memory_peak_bytes == 0
        # large2 may have run a step before its cancel came: answered all the same, with what it consumed
        assert stream.chunks["large2"][-1].done.finish_reason == "cancelled"


async def test_cancelling_the_call_frees_every_request_it_carried() -> None:
    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(*(start(f"r{i}", max_tokens=400) for i in range(5)))
        await stream.until(lambda: all(stream.chunks[f"r{i}"] for i in range(5)), "all stream")
        assert service.scheduler.num_running == 5
        await stream.send(start("large", max_tokens=400, tools=[
            agent_pb2.ToolSpec(name="t", description="d" * COUNT_IN_THREAD_BYTES)]))  # counted in a thread...
        stream.call.cancel()  # ...while the call goes away
        await wait_until(lambda: held(service) == 0 and not service._sessions, "everything is freed")
        assert service.scheduler.capacity.reserved_bytes == 0  # type: ignore[attr-defined]


async def test_concurrent_requests_come_one_message_per_engine_step() -> None:
    n, max_tokens = 16, 24
    async with dispatcher(**{"sim.decode_base_ms": 2.0}) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(*(start(f"r{i}", max_tokens=max_tokens) for i in range(n)))
        await stream.until(lambda: all(stream.ended(f"r{i}") for i in range(n)), "all end")
        assert await stream.close() == grpc.StatusCode.OK
        chunks = sum(len(c) for c in stream.chunks.values())
        assert all(summary(stream.chunks[f"r{i}"])[4] == max_tokens for i in range(n))
        # a step advances every request of its batch, and its tokens leave together: one message a step,
        # holding a chunk for each request (the scheduler admits the 16 in a few groups, so ~40 messages)
        assert chunks >= n * 2 and stream.messages * 4 <= chunks, (stream.messages, chunks)


async def test_output_ready_within_the_flush_interval_leaves_in_one_message() -> None:
    # steps every ~20 ms: with no interval the writer keeps up and sends about a message a step; held for
    # 200 ms, each message carries ~10 steps of both requests' tokens, a request's tokens merged
    max_tokens = 20
    async with dispatcher(**SLOW, **{"dispatcher.stream_flush_interval_ms": 200.0}) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=max_tokens), start("b", max_tokens=max_tokens))
        await stream.until(lambda: stream.ended("a") and stream.ended("b"), "both end")
        assert await stream.close() == grpc.StatusCode.OK
        assert [summary(stream.chunks[r])[1] for r in "ab"] == [max_tokens, max_tokens]
        assert stream.messages <= 10, stream.messages
        assert max(c.token.count for r in "ab" for c in stream.chunks[r] if c.HasField("token")) >= 4


async def test_a_request_alone_on_its_stream_is_never_held_for_the_flush_interval() -> None:
    max_tokens = 20
    async with dispatcher(**SLOW, **{"dispatcher.stream_flush_interval_ms": 100.0}) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("alone", max_tokens=max_tokens))
        await stream.until(lambda: stream.ended("alone"), "it ends")
        assert await stream.close() == grpc.StatusCode.OK
        assert summary(stream.chunks["alone"])[1] == max_tokens
        # a message a step (~20 ms apart, the writer keeps up): held, it would be 100 ms apart, 4 or 5 in all
        assert stream.messages >= 12, stream.messages


async def test_a_requests_first_output_is_not_held_for_the_flush_interval() -> None:
    # "a" streams with messages held for 1 s; "b" joins: its first token must leave at once, alone in its
    # chunk (held, it would wait up to 1 s and leave merged with the ~50 tokens after it)
    async with dispatcher(**SLOW, **{"dispatcher.stream_flush_interval_ms": 1000.0}) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=400))
        await stream.until(lambda: len(stream.chunks["a"]) >= 3, "a streams")
        await stream.send(start("b", max_tokens=60))
        await stream.until(lambda: stream.ended("b"), "b ends")
        first = stream.chunks["b"][0]
        assert first.HasField("token") and (first.token.count or 1) == 1, first
        await stream.send(cancel=("a",))
        assert await stream.close() == grpc.StatusCode.OK


async def test_a_requests_end_is_not_held_for_the_flush_interval() -> None:
    # "a" streams with messages held for 1 s; "b" (10 tokens) runs beside it, a token of each a step. b's end
    # must leave as soon as b's last step is done: by then a has received about b's 10 tokens more. Held, b's
    # end would wait out the 1 s, and a's tokens of the whole hold (~50 steps) would arrive with it.
    b_tokens = 10
    async with dispatcher(**SLOW, **{"dispatcher.stream_flush_interval_ms": 1000.0}) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=400))
        await stream.until(lambda: len(stream.chunks["a"]) >= 3, "a streams")
        a_before = token_count([c.token for c in stream.chunks["a"] if c.HasField("token")])
        await stream.send(start("b", max_tokens=b_tokens))
        await stream.until(lambda: stream.ended("b"), "b ends")
        a_at_b_end = token_count([c.token for c in stream.chunks["a"] if c.HasField("token")])
        assert summary(stream.chunks["b"])[1] == b_tokens
        # b is admitted at a step boundary and its first token is never held: a few steps of slack
        assert a_at_b_end - a_before <= b_tokens + 8, (a_before, a_at_b_end)
        await stream.send(cancel=("a",))
        assert await stream.close() == grpc.StatusCode.OK


async def test_a_core_requests_tokens_are_not_held_beside_held_batch_ones() -> None:
    # 1 s holds: the BATCH request's tokens gather; the CORE request's leave as they come, about one a step
    async with dispatcher(**SLOW, **{"dispatcher.stream_flush_interval_ms": 1000.0}) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("batch", max_tokens=400, priority=agent_pb2.BATCH),
                          start("core", max_tokens=20, priority=agent_pb2.CORE))
        await stream.until(lambda: stream.ended("core"), "core ends")
        assert summary(stream.chunks["core"])[1] == 20
        assert len(stream.chunks["core"]) >= 12, [c.token.count for c in stream.chunks["core"]]
        await stream.send(cancel=("batch",))
        assert await stream.close() == grpc.StatusCode.OK

# --------------------------------------------------------------------------- a request's token hold (token_hold_s)

LONG_HOLD_S = 10.0  # the longest hold: what a test shows held waits for its end, not for this


def tokens_of(stream: RawStream, request_id: str) -> int:
    return token_count([c.token for c in stream.chunks[request_id] if c.HasField("token")])


async def test_a_batch_requests_tokens_after_its_first_wait_out_its_token_hold_but_never_its_first_or_end() -> None:
    # "clock" (NORMAL, no hold) streams a token a step (~20 ms) beside "b" (BATCH, held 10 s, 30 tokens, ~0.6 s):
    # b sends its first token alone, then nothing until its end, which carries the other 29 merged and its done,
    # and is not held: the clock has received about b's 30 tokens meanwhile (held, ~500, and the clock's 400
    # would have ended first). The clock keeps about a message a step, NORMAL's rule.
    b_tokens = 30
    async with dispatcher(**SLOW) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("clock", max_tokens=400))
        await stream.until(lambda: len(stream.chunks["clock"]) >= 3, "the clock streams")
        clock_before, clock_chunks_before = tokens_of(stream, "clock"), len(stream.chunks["clock"])
        await stream.send(start("b", max_tokens=b_tokens, priority=agent_pb2.BATCH, token_hold_s=LONG_HOLD_S))
        await stream.until(lambda: stream.ended("b"), "b ends")
        assert not stream.ended("clock")
        clock_ticks = tokens_of(stream, "clock") - clock_before
        assert clock_ticks <= b_tokens + 8, clock_ticks
        assert len(stream.chunks["clock"]) - clock_chunks_before >= clock_ticks // 2  # not held beside b
        assert [c.WhichOneof("chunk") for c in stream.chunks["b"]] == ["token", "token", "done"]
        first, rest, _done = stream.chunks["b"]
        assert (first.token.index, first.token.count or 1) == (0, 1)
        assert (rest.token.index, rest.token.count) == (1, b_tokens - 1)
        await stream.send(cancel=("clock",))
        assert await stream.close() == grpc.StatusCode.OK

        # what b's caller reads is what it reads unheld
        unheld = RawStream(channel)
        await unheld.send(start("b", max_tokens=b_tokens, priority=agent_pb2.BATCH))
        await unheld.until(lambda: unheld.ended("b"), "b ends")
        assert await unheld.close() == grpc.StatusCode.OK
        assert len(unheld.chunks["b"]) > 3
        assert summary(stream.chunks["b"]) == summary(unheld.chunks["b"])


async def test_held_tokens_leave_in_fewer_messages_than_tokens_and_a_request_alone_is_held_too() -> None:
    # the hop's point: a BATCH stream's tokens leave about as often as its caller shows them. Alone on its
    # stream (where NORMAL's rule never holds), 40 tokens held 10 s leave in 2 messages: the first, the rest
    async with dispatcher(**SLOW) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("b", max_tokens=40, priority=agent_pb2.BATCH, token_hold_s=LONG_HOLD_S))
        await stream.until(lambda: stream.ended("b"), "b ends")
        assert await stream.close() == grpc.StatusCode.OK
        assert summary(stream.chunks["b"])[1] == 40
        assert stream.messages == 2, stream.messages


async def test_a_core_request_beside_a_held_batch_one_leaves_as_it_comes() -> None:
    async with dispatcher(**SLOW) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("batch", max_tokens=400, priority=agent_pb2.BATCH, token_hold_s=LONG_HOLD_S))
        await stream.until(lambda: stream.chunks["batch"], "batch's first token")
        await stream.send(start("core", max_tokens=20, priority=agent_pb2.CORE))
        await stream.until(lambda: stream.ended("core"), "core ends")
        assert summary(stream.chunks["core"])[1] == 20
        assert len(stream.chunks["core"]) >= 12, [c.token.count for c in stream.chunks["core"]]
        assert len(stream.chunks["batch"]) == 1  # its tokens do not ride along on core's messages
        await stream.send(cancel=("batch",))
        assert await stream.close() == grpc.StatusCode.OK


@pytest.mark.parametrize("priority, hold_s, expected", [
    (agent_pb2.CORE, 0.05, "0 on a CORE request"),
    (agent_pb2.BATCH, -0.05, "from 0 to 10"),
    (agent_pb2.BATCH, float("nan"), "from 0 to 10"),
    (agent_pb2.BATCH, float("inf"), "from 0 to 10"),
    (agent_pb2.NORMAL, 10.5, "from 0 to 10"),
])
async def test_a_bad_token_hold_refuses_its_request_alone_naming_the_field(priority, hold_s, expected) -> None:
    async with dispatcher(**MEDIUM) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("bad", max_tokens=5, priority=priority, token_hold_s=hold_s))
        await stream.send(start("good", max_tokens=5, priority=agent_pb2.NORMAL, token_hold_s=0.05))
        await stream.until(lambda: stream.ended("bad") and stream.ended("good"), "both end")
        [error] = stream.errors["bad"]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and error.origin == "dispatcher"
        assert error.details.startswith("token_hold_s: expected ") and expected in error.details, error.details
        assert summary(stream.chunks["good"])[1] == 5
        assert await stream.close() == grpc.StatusCode.OK
        assert held(service) == 0


class _ToolCallStreamEngine(StreamEngine):
    """A stream engine: "clock" streams a token every 10 ms; "tool" streams 5 tokens, a tool call, then waits for
    :attr:`release` before 5 tokens more (a model server that streams a call mid-answer)."""

    model = "tool-1"
    stream_slots = None

    def __init__(self) -> None:
        self.called = asyncio.Event()  # "tool" yielded its call
        self.release = asyncio.Event()

    async def generate(self, req):  # type: ignore[no-untyped-def]
        from switchyard.dispatcher.engines.base import Usage
        from switchyard.dispatcher.request import ToolCall

        if req.request_id == "tool":
            for i in range(5):
                await asyncio.sleep(0.01)
                yield f"a{i} "
            yield ToolCall(call_id="c1", name="search_docs", arguments_json="{}")
            self.called.set()
            await self.release.wait()
            for i in range(5):
                yield f"b{i} "
            yield Usage(prompt_tokens=3, completion_tokens=10)
            return
        async for item in _tokens_every_10_ms(req):
            yield item

    async def aclose(self) -> None:
        pass


async def _tokens_every_10_ms(req):  # type: ignore[no-untyped-def]
    """A test stream engine's plain answer: ``max_tokens`` tokens 10 ms apart, then its usage."""
    from switchyard.dispatcher.engines.base import Usage

    for i in range(req.max_tokens):
        await asyncio.sleep(0.01)
        yield f"w{i} "
    yield Usage(prompt_tokens=3, completion_tokens=req.max_tokens)


async def test_a_held_requests_tool_call_is_not_held() -> None:
    # the call leaves as it comes, with the tokens held before it: the clock (a token every 10 ms) has sent only a
    # few tokens more in between (held, it would wait out the 10 s hold: ~1000)
    engine = _ToolCallStreamEngine()
    async with dispatcher(engine) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("clock", max_tokens=3000))
        await stream.send(start("tool", max_tokens=20, priority=agent_pb2.BATCH, token_hold_s=LONG_HOLD_S))
        await asyncio.wait_for(engine.called.wait(), 30)
        clock_at_call = tokens_of(stream, "clock")
        await stream.until(lambda: any(c.HasField("tool_call") for c in stream.chunks["tool"]), "the tool call")
        assert tokens_of(stream, "clock") - clock_at_call <= 30
        assert [(c.WhichOneof("chunk"), c.token.count or 1) for c in stream.chunks["tool"]] == [
            ("token", 1), ("token", 4), ("tool_call", 1)]
        engine.release.set()
        await stream.until(lambda: stream.ended("tool"), "tool ends")
        assert [c.WhichOneof("chunk") for c in stream.chunks["tool"][3:]] == ["token", "done"]
        assert "".join(c.token.text for c in stream.chunks["tool"]) == "a0 a1 a2 a3 a4 b0 b1 b2 b3 b4 "
        await stream.send(cancel=("clock",))
        assert await stream.close() == grpc.StatusCode.OK


async def test_drain_finishes_running_requests_refuses_new_ones_and_ends_the_stream() -> None:
    async with dispatcher(**MEDIUM) as (service, srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=30), start("b", max_tokens=20))
        await stream.until(lambda: stream.chunks["a"] and stream.chunks["b"], "both stream")
        await service.begin_drain()
        assert service.draining and service.scheduler.intake.closed  # one flag: the scheduler's own refuses too
        await stream.send(start("late", max_tokens=5))
        await stream.until(lambda: stream.ended("late"), "late is refused")
        [error] = stream.errors["late"]
        assert (error.code, error.origin) == (grpc.StatusCode.UNAVAILABLE.value[0], "dispatcher")
        await asyncio.wait_for(stream.reader, 30)  # the dispatcher ends the stream: the caller never half-closed
        assert await stream.call.code() == grpc.StatusCode.OK
        assert summary(stream.chunks["a"])[4] == 30 and summary(stream.chunks["b"])[4] == 20
        started = time.monotonic()
        await srv.stop(30.0)
        assert time.monotonic() - started < HANG_BOUND_S


async def test_server_stop_drains_open_streams_without_waiting_out_the_grace() -> None:
    async with dispatcher(**MEDIUM) as (service, srv, channel):
        busy, idle = RawStream(channel), RawStream(channel)
        await busy.send(start("a", max_tokens=25))
        await busy.until(lambda: busy.chunks["a"], "a streams")
        await idle.send(start("quick", max_tokens=2))
        await idle.until(lambda: idle.ended("quick"), "quick ends")  # idle now: open, carrying nothing
        started = time.monotonic()
        await srv.stop(30.0)
        assert time.monotonic() - started < HANG_BOUND_S
        for stream in (busy, idle):
            await stream.reader  # what the server sent before it stopped, all read (the reader may lag the stop)
            assert await stream.call.code() == grpc.StatusCode.OK
        assert summary(busy.chunks["a"])[4] == 25


async def test_a_request_still_running_when_the_drain_ends_gets_an_error_naming_the_stop_and_what_it_used() -> None:
    """A dispatcher's SIGTERM alone (a pod's termination, a `kill` of one replica): a request still running when
    `server.shutdown_grace_s` ran out was cut by the server's cancel, 'Cancelling all calls', which the orchestrator
    relayed as 'dispatcher service unavailable ...: stream cut after 1638 chunk(s): Cancelling all calls; is it
    running (switchyard up)?', and what the request used was lost. It ends UNAVAILABLE naming the stop, on
    GenerateStream and Generate alike, with what it consumed; the stream then ends OK."""
    async with dispatcher(**SLOW) as (service, srv, channel):
        stream = RawStream(channel)
        await stream.send(start("long", max_tokens=500))
        unary = agent_pb2_grpc.InferenceServiceStub(channel).Generate(request("unary", max_tokens=500))
        first = await unary.read()
        assert first.HasField("token")
        await stream.until(lambda: len(stream.chunks["long"]) >= 2, "long streams")
        await srv.stop(0.3)
        await asyncio.wait_for(stream.reader, HANG_BOUND_S)
        assert await stream.call.code() == grpc.StatusCode.OK
        [error] = stream.errors["long"]
        assert (error.code, error.origin) == (grpc.StatusCode.UNAVAILABLE.value[0], "dispatcher"), error
        assert error.details.startswith("dispatcher is stopping: the request was still running after "
                                        "server.shutdown_grace_s = 0.3 s of draining and was ended"), error.details
        assert error.consumed.usage.completion_tokens >= 2, error
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            while await unary.read() is not grpc.aio.EOF:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert cut.value.details().startswith("dispatcher is stopping: "), cut.value.details()


async def test_a_request_ended_by_a_server_fault_is_an_error_span_with_the_phases_it_reached(monkeypatch) -> None:
    """A request of a GenerateStream ended UNAVAILABLE (the drain ran out on it) or failed by its engine: its
    ``dispatcher.generate`` span, a SERVER span per request that no interceptor ends, read status unset with
    ``rpc.grpc.status_code`` 14, where the RPC spans' rule (docs: a server span is an error for a server fault)
    makes it an error, and it had no queue wait, prefill or decode under it. A cancelled one stays unset."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from switchyard.dispatcher import processor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(processor, "tracer", provider.get_tracer(processor.__name__))
    try:
        async with dispatcher(**SLOW) as (service, srv, channel):
            stream = RawStream(channel)
            await stream.send(start("cut", max_tokens=500))
            await stream.send(start("dropped", max_tokens=500))
            await stream.until(lambda: len(stream.chunks["cut"]) >= 2 and len(stream.chunks["dropped"]) >= 2,
                               "both stream")
            await stream.send(cancel=("dropped",))
            await stream.until(lambda: any(c.HasField("done") for c in stream.chunks["dropped"]), "the cancel")
            await srv.stop(0.3)
            await asyncio.wait_for(stream.reader, HANG_BOUND_S)
        spans = exporter.get_finished_spans()
        requests = sorted((s for s in spans if s.name == "dispatcher.generate"), key=lambda s: s.start_time)
        cut, dropped = requests  # started in this order
        assert cut.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert cut.status.status_code is StatusCode.ERROR, cut.status
        assert dropped.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
        assert dropped.status.status_code is StatusCode.UNSET, dropped.status
        for request in (cut, dropped):
            under = {s.name for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id}
            assert {"dispatcher.queue_wait", "inference.prefill", "inference.decode"} <= under, under
    finally:
        provider.shutdown()


async def test_a_stream_opened_after_the_drain_began_ends_too() -> None:
    async with dispatcher(**SLOW) as (service, srv, channel):
        await service.begin_drain()  # SIGTERM: the server is not stopped yet, a stream may still arrive
        stream = RawStream(channel)
        with contextlib.suppress(grpc.aio.AioRpcError):  # the dispatcher may have ended it already
            await stream.send(start("late", max_tokens=5))
        # ended by the dispatcher, not left open (OK; or INTERNAL here when the write met the ended stream)
        ended, _ = await asyncio.wait({stream.reader}, timeout=HANG_BOUND_S)
        assert ended and stream.call.done()
        assert not stream.chunks
        assert all(e.code == grpc.StatusCode.UNAVAILABLE.value[0] for e in stream.errors["late"])
        client = GenerateStreamClient(channel)  # the orchestrator's side: its request fails, to be retried
        with pytest.raises(RequestFailed) as err:
            await asyncio.wait_for(collect(client, request("late2", max_tokens=5)), HANG_BOUND_S)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.origin in ("", "dispatcher")
        await client.close()
        started = time.monotonic()
        await srv.stop(30.0)
        assert time.monotonic() - started < HANG_BOUND_S


# --------------------------------------------------------------------------- the orchestrator's side


def spec(task_id: str, max_tokens: int) -> TaskSpec:
    return TaskSpec(task_id=task_id, payload="p", workflow="chat", priority=0, max_tokens=max_tokens, model="",
                    agent_id="")


async def collect(client: GenerateStreamClient, request: agent_pb2.GenerateRequest,
                  timeout_s: float | None = 30.0) -> list[agent_pb2.GenerateChunk]:
    return [c async for c in client.generate(request, timeout_s)]


def request(request_id: str, **fields: object) -> agent_pb2.GenerateRequest:
    fields.setdefault("prompt", PROMPT)
    return agent_pb2.GenerateRequest(request_id=request_id, **fields)


def stream_tasks() -> list[asyncio.Task]:
    """The orchestrator side's stream tasks still running (a writer and a reader per open stream)."""
    return [t for t in asyncio.all_tasks()
            if not t.done() and getattr(t.get_coro(), "__qualname__", "").startswith("_Stream.")]


async def test_client_deadline_is_deadline_exceeded_and_the_dispatcher_lets_go() -> None:
    async with dispatcher(**SLOW) as (service, _srv, channel):
        client = GenerateStreamClient(channel)
        with pytest.raises(RequestFailed) as err:
            await collect(client, request("slow", max_tokens=500), timeout_s=0.3)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: held(service) == 0, "the dispatcher lets go")
        assert summary(await collect(client, request("slow", max_tokens=4)))[4] == 4  # same id, same client
        await client.close()


async def test_a_request_past_its_deadline_at_the_dispatcher_ends_with_what_it_consumed() -> None:
    """The dispatcher's own deadline ends a running request DEADLINE_EXCEEDED; its error carries what the step
    consumed until then (its done as it stood), as a cancel's answer does. The error used to carry nothing: a task
    cut by its time limit read compute_score_used 0 after seconds on the engine."""
    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("late", timeout_s=2.0, max_tokens=500))  # ~10 s of decode: the deadline ends it
        await stream.until(lambda: stream.ended("late"), "the deadline ends it")
        [error] = stream.errors["late"]
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and error.origin == "dispatcher"
        assert error.HasField("consumed")
        streamed = token_count([c.token for c in stream.chunks["late"] if c.HasField("token")])
        assert 0 < streamed <= error.consumed.usage.completion_tokens < 500
        assert error.consumed.compute_score_used > 0 and error.consumed.memory_peak_bytes > 0
        assert error.consumed.usage.prompt_tokens > 0 and error.consumed.finish_reason == ""
        await stream.send(start("refused", max_tokens=10**6))  # a start refused consumed nothing: none is sent
        await stream.until(lambda: stream.ended("refused"), "the refusal")
        assert not stream.errors["refused"][0].HasField("consumed")
        assert await stream.close() == grpc.StatusCode.OK
        assert held(service) == 0


async def test_a_request_past_its_deadline_hands_what_it_consumed_to_its_caller_once() -> None:
    """Whichever side's timer ends it (the caller's, which cancels it and counts the answer, or the dispatcher's,
    whose error carries it), the caller is handed what the step consumed, once, then DEADLINE_EXCEEDED."""
    async with dispatcher(**SLOW) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        answers: list[agent_pb2.GenerateDone] = []
        with pytest.raises(SwitchyardError) as err:
            async for _ in client.generate(spec("t", 500), 0, prompt=PROMPT, timeout_s=2.0,
                                           on_consumed=answers.append):
                pass
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        [done] = answers
        assert 0 < done.usage.completion_tokens < 500
        assert done.compute_score_used > 0 and done.memory_peak_bytes > 0
        await wait_until(lambda: held(service) == 0, "the dispatcher lets go")
        await client.close()


async def test_one_id_running_twice_at_once_shares_the_stream_under_an_id_of_its_own() -> None:
    """A caller that reuses a task_id (the reference load sends every call as task bench-001) starts the same
    request id while it runs: the repeat goes on the open stream under a suffixed id, not on a new stream."""
    async with dispatcher() as (service, _srv, channel):
        client = GenerateStreamClient(channel)
        results = await asyncio.gather(*(collect(client, request("bench-001:0", max_tokens=n)) for n in (3, 8, 17)))
        assert [summary(chunks)[4] for chunks in results] == [3, 8, 17]
        assert client._stream is not None and not client._retired  # one stream carried all three: none retired
        await client.close()


async def test_inference_client_deadline_is_a_switchyard_error_deadline_exceeded() -> None:
    async with dispatcher(**SLOW) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        with pytest.raises(SwitchyardError) as err:
            async for _ in client.generate(spec("t", 500), 0, prompt=PROMPT, timeout_s=0.3):
                pass
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert f"127.0.0.1:{srv.port}" in str(err.value)
        await wait_until(lambda: held(service) == 0, "the dispatcher lets go")
        await client.close()


async def test_inference_client_carries_a_batch_tasks_token_hold_and_no_other_classes() -> None:
    """The orchestrator's one reading of ``orchestrator.batch_token_flush_interval_ms`` (``token_hold_s``) goes with
    a BATCH task's call: held 10 s, its tokens after the first leave the dispatcher with its end, one chunk; CORE
    and NORMAL calls carry none (a CORE call carrying one would be refused) and stream a chunk a step."""
    orchestrator = make_config(**{"orchestrator.batch_token_flush_interval_ms": 10_000.0}).orchestrator
    async with dispatcher(**SLOW) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server,
                                 token_hold_s=orchestrator.token_hold_s)
        got = {}
        for priority in (agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH):
            task = dataclasses.replace(spec(f"t{priority}", 30), priority=priority)
            got[priority] = [c async for c in client.generate(task, 0, prompt=PROMPT, timeout_s=30)]
        assert [c.WhichOneof("chunk") for c in got[agent_pb2.BATCH]] == ["token", "token", "done"]
        assert got[agent_pb2.BATCH][0].token.count in (0, 1)
        assert len(got[agent_pb2.CORE]) > 10 and len(got[agent_pb2.NORMAL]) > 10
        assert summary(got[agent_pb2.CORE])[:2] == summary(got[agent_pb2.NORMAL])[:2] == \
            summary(got[agent_pb2.BATCH])[:2]
        await client.close()


async def test_a_step_sent_at_its_tasks_deadline_is_late_not_without_a_deadline() -> None:
    """0 s left on the wire reads "not given": a step whose task had no time left went to the fair policy as a
    request without a deadline, and was served. It goes with the least time left there is, and is refused by
    name as one that cannot make its deadline."""
    async with dispatcher(**{"scheduler.policy": "fair"}) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        with pytest.raises(SwitchyardError) as err:
            async for _ in client.generate(spec("late", 8), 0, prompt=PROMPT, timeout_s=30,
                                           budget=Budget(time_left_s=0.0, this_step_s=0.0, remaining_after_s=0.0)):
                pass
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in str(err.value)
        await client.close()


async def test_a_dispatcher_stopped_mid_stream_fails_what_it_carried_unavailable() -> None:
    async with dispatcher(**SLOW) as (service, srv, channel):
        client = GenerateStreamClient(channel)
        first = asyncio.Event()

        async def one(i: int) -> None:
            async for chunk in client.generate(request(f"r{i}", max_tokens=500), 30):
                first.set()

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(first.wait(), 30)
        await srv.stop(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:  # ended by the dispatcher naming its stop (its grace, 0 s, ran out), not cut
            assert isinstance(result, RequestFailed), result
            assert (result.code, result.origin) == (grpc.StatusCode.UNAVAILABLE, "dispatcher"), result
            assert result.details.startswith("dispatcher is stopping: "), result.details
        await client.close()
        assert not stream_tasks()


async def test_the_orchestrator_relays_a_request_the_dispatchers_stop_ended_in_its_words_not_as_a_cut() -> None:
    """After tokens streamed, the dispatcher's own UNAVAILABLE (its drain ran out) read 'dispatcher service
    unavailable at ...: stream cut after N chunk(s): ...; is it running (switchyard up)?', as if nothing had
    answered; what the request used reaches the caller."""
    async with dispatcher(**SLOW) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        answers: list[agent_pb2.GenerateDone] = []
        received = 0
        with pytest.raises(SwitchyardError) as err:
            async for _ in client.generate(spec("t", 500), 0, prompt=PROMPT, timeout_s=30,
                                           on_consumed=answers.append):
                received += 1
                if received == 3:
                    asyncio.ensure_future(srv.stop(0.1))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.origin == "dispatcher"
        message = str(err.value)
        assert message.startswith(f"dispatcher (127.0.0.1:{srv.port}): dispatcher is stopping: "), message
        assert "chunk(s)" in message and "is it running" not in message, message
        [done] = answers
        assert done.usage.completion_tokens >= 3
        await client.close()


async def test_rotation_keeps_every_request_right_and_ends_the_old_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate_stream, "STREAM_MAX_AGE_S", 0.0)  # every request opens a stream
    async with dispatcher() as (service, _srv, channel):
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        expected = {n: summary([c async for c in stub.Generate(request("x", max_tokens=n), timeout=30)])
                    for n in (3, 8, 17)}
        client = GenerateStreamClient(channel)
        for round_ in range(3):
            results = await asyncio.gather(*(collect(client, request(f"r{round_}-{i}", max_tokens=(3, 8, 17)[i % 3]))
                                             for i in range(12)))
            for i, chunks in enumerate(results):
                assert summary(chunks) == expected[(3, 8, 17)[i % 3]]
        # every retired stream half-closed once its last request ended: the dispatcher's sessions end,
        # and only the newest stream's tasks are left on this side
        await wait_until(lambda: len(service._sessions) <= 1, "retired streams end")
        await wait_until(lambda: len(stream_tasks()) <= 2, "retired streams' tasks end")
        await client.close()
        assert not stream_tasks()
        await wait_until(lambda: not service._sessions, "the last stream ends")
        assert held(service) == 0


async def test_a_task_cancelled_mid_generation_cancels_its_request_and_learns_what_it_consumed() -> None:
    async with dispatcher(**SLOW) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        first = asyncio.Event()
        answers: list[agent_pb2.GenerateDone] = []

        async def run() -> None:
            async for _ in client.generate(spec("t", 500), 0, prompt=PROMPT, timeout_s=30,
                                           on_consumed=answers.append):
                first.set()

        task = asyncio.create_task(run())
        await asyncio.wait_for(first.wait(), 30)
        assert service.scheduler.num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held(service) == 0  # the cancel was read (its answer came): the request is freed
        [done] = answers  # handed over before the cancellation went on
        assert done.finish_reason == "cancelled" and 0 < done.usage.completion_tokens < 500
        assert done.compute_score_used > 0 and done.memory_peak_bytes > 0
        chunks = [c async for c in client.generate(spec("t2", 3), 0, prompt=PROMPT, timeout_s=30)]
        assert chunks[-1].done.usage.completion_tokens == 3  # the stream carries on
        await client.close()


# --------------------------------------------------------------------------- trying to break it


async def test_a_request_id_started_again_right_after_its_cancel_gets_only_its_own_chunks() -> None:
    """A RunTask retried under the same task_id after its first try was cancelled: same request_id."""
    async with dispatcher(**SLOW) as (service, _srv, channel):
        client = GenerateStreamClient(channel)
        first = client.generate(request("t:0", max_tokens=500), 30)
        await first.__anext__()
        await first.aclose()  # the cancel waits to be written...
        chunks = await collect(client, request("t:0", max_tokens=6))  # ...beside the new start
        assert summary(chunks)[4] == 6
        first = client.generate(request("t:0", max_tokens=500), 30)
        await first.__anext__()
        await first.aclose()
        await asyncio.sleep(0.05)  # the cancel is written; chunks the dispatcher sent before it arrive
        chunks = await collect(client, request("t:0", max_tokens=6))
        assert summary(chunks)[4] == 6
        await wait_until(lambda: held(service) == 0, "the cancelled ones are freed")
        await client.close()


class PeerRecording(DispatcherService):
    """A sim dispatcher that records the peer (client address and port: its connection) of each GenerateStream."""

    def __init__(self, config: SwitchyardConfig) -> None:
        super().__init__(config)
        self.peers: list[str] = []

    async def GenerateStream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        self.peers.append(context.peer())
        await super().GenerateStream(request_iterator, context)


async def test_requests_run_across_a_goaway_for_the_connections_age(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate_stream, "STREAM_MAX_AGE_S", 0.3)  # streams opened before and after the GOAWAY
    config = make_config(**{**MEDIUM, "server.max_connection_age_s": 1.0, "server.max_connection_age_grace_s": 600.0})
    service = PeerRecording(config)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    channel = open_channel(f"127.0.0.1:{srv.port}")
    client = GenerateStreamClient(channel)
    try:
        async def one(i: int) -> tuple:
            await asyncio.sleep(0.1 * i)
            return summary(await collect(client, request(f"r{i}", max_tokens=40 + i)))

        results = await asyncio.gather(*(one(i) for i in range(16)))  # starts over 1.5 s, each runs 0.4 s+
        assert [r[4] for r in results] == [40 + i for i in range(16)]
        assert len(set(service.peers)) >= 2  # the first connection got its GOAWAY while requests ran on it
        assert held(service) == 0
    finally:
        await client.close()
        await channel.close()
        await srv.stop(1.0)


async def test_a_replica_going_away_under_an_ipv4_target_moves_its_requests() -> None:
    config = make_config(**MEDIUM)
    services = [DispatcherService(config) for _ in range(2)]
    servers = [await start_server([s], "127.0.0.1", 0, config.server) for s in services]
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    client = InferenceClient(target, config.server)
    try:
        async def one(i: int, max_tokens: int = 4) -> agent_pb2.GenerateDone:
            chunks = [c async for c in client.generate(spec(f"t{i}", max_tokens), 0, prompt=PROMPT, timeout_s=30)]
            return chunks[-1].done

        assert all(d.usage.completion_tokens == 4 for d in await asyncio.gather(*(one(i) for i in range(6))))
        long = [asyncio.create_task(one(100 + i, 40)) for i in range(4)]  # running on both replicas
        await wait_until(lambda: all(s.scheduler.num_running for s in services), "both replicas run requests")
        stopping = asyncio.create_task(servers[0].stop(30.0))  # SIGTERM: drain
        await asyncio.sleep(0.05)
        later = await asyncio.gather(*(one(200 + i) for i in range(6)))  # refused there, served by the other
        assert all(d.usage.completion_tokens == 4 for d in later)
        assert all(d.usage.completion_tokens == 40 for d in await asyncio.gather(*long))  # drained, not cut
        started = time.monotonic()
        await asyncio.wait_for(stopping, HANG_BOUND_S)
        assert time.monotonic() - started < HANG_BOUND_S
        assert all(d.usage.completion_tokens == 4 for d in await asyncio.gather(*(one(300 + i) for i in range(6))))
    finally:
        await client.close()
        for srv in servers:
            await srv.stop(0)


async def test_a_request_sent_as_a_draining_dispatcher_ends_the_stream_fails_unavailable_not_internal() -> None:
    """grpc fails a call INTERNAL when a write meets a stream the server has just ended; the start never
    reached the dispatcher, so its request must fail UNAVAILABLE with no origin (retried elsewhere)."""
    async with dispatcher() as (service, _srv, channel):
        await service.begin_drain()  # each new stream now ends at once: its first write races that end
        for i in range(8):
            client = GenerateStreamClient(channel)
            with pytest.raises(RequestFailed) as err:
                await asyncio.wait_for(collect(client, request(f"r{i}", max_tokens=2)), HANG_BOUND_S)
            assert (err.value.code, err.value.origin) == (grpc.StatusCode.UNAVAILABLE, ""), err.value.details
            await client.close()


async def test_starts_waiting_together_are_sent_within_the_message_size_limit() -> None:
    """Eight 15 kB starts queued together are 120 kB: in one message past a 64 kB limit they would end the
    stream (every request on it failed INTERNAL) where eight Generate calls each succeed."""
    async with dispatcher(**{"server.max_message_bytes": 65536}) as (service, srv, _channel):
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        prompt = PROMPT + " pad" * 2500
        assert 14_000 < len(prompt) < 16_000

        async def one(i: int, prompt: str = prompt) -> int:
            chunks = [c async for c in client.generate(spec(f"t{i}", 3), 0, prompt=prompt, timeout_s=30)]
            return chunks[-1].done.usage.completion_tokens

        results = await asyncio.gather(*(one(i) for i in range(8)), one(8, prompt * 5), return_exceptions=True)
        assert results[:8] == [3] * 8
        too_large = results[8]
        # a start larger than the limit fails alone, as its Generate call would, and is not sent
        assert isinstance(too_large, SwitchyardError) and too_large.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in str(too_large) and f"127.0.0.1:{srv.port}" in str(too_large)
        await client.close()
        assert held(service) == 0


async def test_replies_are_packed_within_the_message_size_limit() -> None:
    """96 starts refused in one message owe 96 error chunks at once, about 10 kB: in one reply past a
    4 kB limit the dispatcher's write would fail the stream, and every request on it, RESOURCE_EXHAUSTED."""
    n = 96
    async with dispatcher(**{"server.max_message_bytes": 4096}) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(*(start(f"r{i}", max_tokens=10**6, prompt="hi") for i in range(n)))  # 2.5 kB
        await stream.send(start("ok", max_tokens=3, prompt="say hi"))
        await stream.until(lambda: len(stream.errors) == n and stream.done("ok"), "every refusal and the answer")
        assert {e[0].code for e in stream.errors.values()} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
        assert all("max_tokens" in e[0].details for e in stream.errors.values())
        assert summary(stream.chunks["ok"])[4] == 3
        assert stream.messages > 2  # the refusals came in several replies
        assert await stream.close() == grpc.StatusCode.OK
        assert held(service) == 0


def test_packing_keeps_the_order_and_every_message_under_the_limit() -> None:
    from switchyard.common.generate_protocol import entry_bytes, pack

    chunks = [agent_pb2.StreamedChunk(request_id=f"r{i}", chunk=agent_pb2.GenerateChunk(
        token=agent_pb2.TokenEvent(text="x" * (i % 50), index=i, count=1))) for i in range(500)]
    limit = 4096

    def messages(entries: list[agent_pb2.StreamedChunk]) -> list[agent_pb2.GenerateStreamResponse]:
        return [agent_pb2.GenerateStreamResponse(chunks=g) for g in pack([(c, entry_bytes(c)) for c in entries], limit)]

    packed = messages(chunks)
    assert [c.request_id for m in packed for c in m.chunks] == [f"r{i}" for i in range(500)]
    assert len(packed) > 1 and all(m.ByteSize() <= limit for m in packed)
    # as few as fit: the next message's first chunk would not have fit in the one before
    assert all(sum(map(entry_bytes, m.chunks)) + entry_bytes(n.chunks[0]) > limit for m, n in zip(packed, packed[1:]))
    huge = agent_pb2.StreamedChunk(request_id="big", chunk=agent_pb2.GenerateChunk(
        token=agent_pb2.TokenEvent(text="y" * 10_000)))
    assert [len(m.chunks) for m in messages([chunks[0], huge, chunks[1]])] == [1, 1, 1]
    assert messages([]) == []
    # the caller's side: a start and cancels packed by the same rule
    starts = agent_pb2.GenerateStreamRequest(start=[start(f"s{i}", prompt="p" * 900) for i in range(3)], cancel=["c"])
    assert starts.ByteSize() <= sum(entry_bytes(e) for e in [*starts.start, *starts.cancel])


async def test_an_unexpected_failure_starting_one_request_fails_that_request_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with dispatcher() as (service, _srv, channel):
        opened = service.processor.open_request

        async def open_request(request, timeout_s, span, arrived=None):  # type: ignore[no-untyped-def]
            if request.request_id == "broken":
                raise RuntimeError("boom")
            return await opened(request, timeout_s, span, arrived)

        monkeypatch.setattr(service.processor, "open_request", open_request)
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=3), start("broken", max_tokens=3), start("b", max_tokens=3))
        await stream.until(lambda: stream.done("a") and stream.done("b") and stream.ended("broken"), "all end")
        (error,) = stream.errors["broken"]
        assert error.code == grpc.StatusCode.INTERNAL.value[0] and "RuntimeError: boom" in error.details
        assert error.origin == "dispatcher"
        assert await stream.close() == grpc.StatusCode.OK
        assert held(service) == 0


class _HeldStreamEngine(StreamEngine):
    """A stream engine whose "held-*" requests send nothing until cancelled (counted), the rest a token every
    10 ms: a server that is slow to answer one request while others stream."""

    model = "held-1"
    stream_slots = None  # the dispatcher keeps the limit

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def generate(self, req):  # type: ignore[no-untyped-def]
        if req.request_id.startswith("held"):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(req.request_id)
                raise
        async for item in _tokens_every_10_ms(req):
            yield item

    async def aclose(self) -> None:
        pass


@contextlib.asynccontextmanager
async def held_stream_dispatcher(**overrides: object) -> AsyncIterator[
        tuple[_HeldStreamEngine, DispatcherService, grpc.aio.Channel]]:
    """A dispatcher on a :class:`_HeldStreamEngine` served on 127.0.0.1:0, and a channel to it."""
    engine = _HeldStreamEngine()
    async with dispatcher(engine, **overrides) as (service, _srv, channel):
        yield engine, service, channel


class _ClosingHeldStreamEngine(_HeldStreamEngine):
    """:class:`_HeldStreamEngine` that records, as it is closed, which calls had been cancelled by then."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled_when_closed: list[str] | None = None

    async def aclose(self) -> None:
        self.cancelled_when_closed = list(self.cancelled)


async def test_a_stopping_dispatcher_closes_its_engine_after_the_upstream_calls_it_cancelled_have_ended():
    """A stop past its grace cancels the upstream calls still streaming; it closed the engine (the openai engine:
    its HTTP pools) at once, under them: their cancels ran after, and their slots came back after the stop
    returned."""
    engine = _ClosingHeldStreamEngine()
    async with dispatcher(engine, **{"server.shutdown_grace_s": 0.2}) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("held-x", max_tokens=4))
        await wait_until(lambda: service.stream_slots is not None and service.stream_slots.in_flight == 1,
                         "its call in flight")
        await service.stop()
        assert engine.cancelled_when_closed == ["held-x"], engine.cancelled_when_closed
        assert service.stream_slots.in_flight == 0


class _SlowModelListEngine(StreamEngine):
    """A stream engine whose model list takes :data:`LIST_READ_S` to read for each request's check (an upstream
    slow to answer its ``GET /v1/models``); it records when each check began and every request it streamed."""

    model = "slow-list-1"
    stream_slots = None

    def __init__(self) -> None:
        self.checked_at: list[float] = []  # time.monotonic() as each request's check began
        self.streamed: dict[str, object] = {}  # request id -> its Request

    async def await_model_list(self, model, wait_s, *, read_unread=False):  # type: ignore[no-untyped-def]
        self.checked_at.append(time.monotonic())
        await asyncio.sleep(LIST_READ_S)

    async def generate(self, req):  # type: ignore[no-untyped-def]
        self.streamed[req.request_id] = req
        async for item in _tokens_every_10_ms(req):
            yield item

    async def aclose(self) -> None:
        pass


LIST_READ_S = 0.2


async def test_a_requests_deadline_ttft_and_queue_wait_count_from_its_arrival_not_from_after_its_check():
    """A request's deadline, queue wait and TTFT count from when its start arrived: the wait for the upstream's model
    list during its check is in them, and so, for the second start of a message, is the first one's check. They
    counted from after the check: a start with 30 s left got a deadline 30 s after it (its caller's passed first, by
    up to a second of model-list wait, more behind the starts before it), and TTFT and queue wait left it out."""
    engine = _SlowModelListEngine()
    async with dispatcher(engine) as (_service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", timeout_s=30.0, max_tokens=2), start("b", timeout_s=30.0, max_tokens=2))
        await stream.until(lambda: stream.done("a") and stream.done("b"), "both done")
        unary = [chunk async for chunk in agent_pb2_grpc.InferenceServiceStub(channel).Generate(
            agent_pb2.GenerateRequest(request_id="g", prompt=PROMPT, max_tokens=2), timeout=30.0)]
        assert await stream.close() == grpc.StatusCode.OK
    first_check = {"a": engine.checked_at[0], "b": engine.checked_at[0], "g": engine.checked_at[2]}
    dones = {"a": stream.chunks["a"][-1].done, "b": stream.chunks["b"][-1].done, "g": unary[-1].done}
    for request_id, checked in first_check.items():
        req = engine.streamed[request_id]
        assert req.arrival <= checked, (request_id, req.arrival - checked)  # type: ignore[attr-defined]
        if request_id != "g":  # a Generate's time left is gRPC's (its deadline header rounds it, up to ~0.1 s)
            assert req.deadline <= checked + 30.0, request_id  # type: ignore[attr-defined]
        done = dones[request_id]
        assert done.ttft_s >= req.first_token_at - checked, (request_id, done.ttft_s)  # type: ignore[attr-defined]
        assert done.queue_wait_s >= req.admitted_at - checked, (request_id, done.queue_wait_s)  # type: ignore[attr-defined]


class _HeldModelListEngine(_SlowModelListEngine):
    """:class:`_SlowModelListEngine` whose model list answers a request's check only once :attr:`answer` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def await_model_list(self, model, wait_s, *, read_unread=False):  # type: ignore[no-untyped-def]
        self.checked_at.append(time.monotonic())
        await self.answer.wait()


async def test_a_request_the_drains_end_failed_during_its_check_is_not_run_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's end (``end_streams``: every request still held ends UNAVAILABLE) came while a start's check
    waited for the upstream's model list: its error went out, but once the check ended the request was submitted
    all the same, out of its session's map: it ran to its end for nobody, and the drain waited for it."""
    engine = _HeldModelListEngine()
    opened: list = []
    async with dispatcher(engine) as (service, _srv, channel):
        open_request = service.processor.open_request

        async def recording(request, timeout_s, span, arrived=None):  # type: ignore[no-untyped-def]
            req = await open_request(request, timeout_s, span, arrived)
            opened.append(req)
            return req

        monkeypatch.setattr(service.processor, "open_request", recording)
        stream = RawStream(channel)
        await stream.send(start("late", max_tokens=50))
        await wait_until(lambda: engine.checked_at, "its check waiting on the model list")
        ending = asyncio.create_task(service.end_streams(0.0))
        await stream.until(lambda: stream.errors.get("late"), "its error")
        assert stream.errors["late"][0].code == grpc.StatusCode.UNAVAILABLE.value[0]
        engine.answer.set()
        await wait_until(lambda: opened, "its check ended")
        (req,) = opened
        await wait_until(lambda: req.is_finished, "it ended")
        assert req.finish_reason == "cancelled" and "late" not in engine.streamed, req.status
        assert held(service) == 0 and stream.chunks["late"] == [] and len(stream.errors["late"]) == 1
        await stream.close()
        await ending


async def test_a_stream_past_its_deadline_ends_its_upstream_call_wherever_its_end_was_decided():
    """B waits for its first token past its deadline while A streams; A's next token reaching the scheduler
    ended B (DEADLINE_EXCEEDED) but only the time slice's decision cancelled an upstream call: B's went on,
    counted by its endpoint, beside a slot given back."""
    async with held_stream_dispatcher(**{"scheduler.time_slice_ms": 5000}) as (engine, _service, channel):
        # (a time slice of 5 s: the decision's own expiry comes too late)
        stream = RawStream(channel)
        await stream.send(start("a-streams", max_tokens=60), start("held-b", timeout_s=0.2, max_tokens=4))
        await stream.until(lambda: stream.errors.get("held-b"), "held-b's deadline error")
        assert stream.errors["held-b"][0].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        await wait_until(lambda: engine.cancelled == ["held-b"], "held-b's upstream call cancelled")
        await stream.until(lambda: stream.done("a-streams"), "a-streams done")
        assert await stream.close() == grpc.StatusCode.OK


async def test_an_engine_loop_that_fails_fails_what_it_held_refuses_the_rest_and_reports_not_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in one scheduler decision ended the loop's task, and nothing noticed: requests stayed waiting
    past their deadlines, new ones were accepted and never answered, and the health check said SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("a", max_tokens=400))
        await stream.until(lambda: stream.chunks.get("a"), "a's first token")
        scheduler = service.scheduler

        def broken(now: float) -> None:
            raise RuntimeError("a bug in one decision")

        monkeypatch.setattr(scheduler, "schedule", broken)
        await stream.send(start("b", max_tokens=4))  # its arrival asks the loop for a decision
        await stream.until(lambda: stream.errors.get("a") and stream.errors.get("b"), "a's and b's errors")
        for request_id in ("a", "b"):
            (error,) = stream.errors[request_id]
            assert error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "engine loop failed (RuntimeError: a bug in one decision)" in error.details
        call = agent_pb2_grpc.InferenceServiceStub(channel).Generate(
            agent_pb2.GenerateRequest(request_id="c", prompt=PROMPT, max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine loop failed (RuntimeError: a bug in one decision)" in (refused.value.details() or "")
        assert held(service) == 0
        probe = health_pb2_grpc.HealthStub(channel)
        for name in ("agent.InferenceService", ""):  # readiness, and liveness: the pod is restarted
            await wait_until(lambda: service._health_update is not None and service._health_update.done(),
                             "health updated")
            answer = await probe.Check(health_pb2.HealthCheckRequest(service=name))
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING, name


async def test_a_second_start_under_a_running_id_ends_both_with_one_error() -> None:
    """The second start was refused with an error chunk under the id, which its caller reads as the id's end,
    while the first request went on generating chunks under the same id for nobody."""
    async with dispatcher(**SLOW) as (service, _srv, channel):
        stream = RawStream(channel)
        await stream.send(start("twice", max_tokens=400))
        await stream.until(lambda: stream.chunks.get("twice"), "the first start's first token")
        await stream.send(start("twice", max_tokens=4), start("other", max_tokens=3))
        await stream.until(lambda: stream.errors.get("twice") and stream.done("other"), "the refusal, and other done")
        (error,) = stream.errors["twice"]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in error.details
        await wait_until(lambda: held(service) == 0, "the first request aborted")
        tokens = len(stream.chunks["twice"])
        await asyncio.sleep(0.1)  # a step every ~20 ms: a request still running would have sent more
        assert len(stream.chunks["twice"]) == tokens
        assert await stream.close() == grpc.StatusCode.OK


async def test_a_core_request_starts_at_once_in_its_reserved_slot_while_batch_streams_take_the_limit() -> None:
    """Ten BATCH streams that send nothing, admitted under a limit of 12, then a 429 takes the limit down to 4:
    CORE's reserved slot is its own even then, and its arrival admits it without waiting for a stream's end or
    the time slice (10 s here)."""
    async with held_stream_dispatcher(**{"scheduler.time_slice_ms": 10_000, "upstream.concurrency": {
            "min_limit": 1, "initial_limit": 12, "max_limit": 12, "core_reserved_slots": 2}}) as (
            engine, service, channel):
        stream = RawStream(channel)
        held = [f"held-{i}" for i in range(10)]
        await stream.send(*(start(rid, priority=agent_pb2.BATCH) for rid in held))
        await wait_until(lambda: service.stream_slots.in_flight == 10, "the BATCH streams admitted (the lower classes' 10)")
        assert service.stream_slots is not None
        service.stream_slots.source.on_overload(time.monotonic())  # no stream measured on it: halved, to 6
        assert int(service.stream_slots.limit) == 6 < service.stream_slots.in_flight
        began = time.monotonic()
        await stream.send(start("core", priority=agent_pb2.CORE, max_tokens=3))
        await stream.until(lambda: stream.done("core"), "the CORE request done", timeout=HANG_BOUND_S)
        assert time.monotonic() - began < HANG_BOUND_S
        await stream.send(cancel=tuple(held))
        await wait_until(lambda: sorted(engine.cancelled) == sorted(held), "the held streams cancelled")
        assert await stream.close() == grpc.StatusCode.OK
