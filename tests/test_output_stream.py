"""OutputStream: a request's items reach its Generate handler in order; tokens waiting together come as one."""

import asyncio

from switchyard.dispatcher.output import OutputStream, StreamDone, StreamError, StreamToken, StreamToolCall
from switchyard.dispatcher.request import ToolCall


async def test_a_reader_that_keeps_up_gets_every_token_alone():
    stream = OutputStream()
    got = []

    async def read():
        while not isinstance(item := await stream.get(), StreamDone):
            got.append(item)

    reader = asyncio.create_task(read())
    for i, text in enumerate(["a ", "b ", "c "]):
        await asyncio.sleep(0)  # the reader takes each token before the next is pushed
        stream.token(text, i)
        await asyncio.sleep(0)
    stream.done("stop")
    await reader
    assert got == [StreamToken("a ", 0), StreamToken("b ", 1), StreamToken("c ", 2)]


async def test_tokens_waiting_together_come_as_one_and_other_items_keep_their_place():
    stream = OutputStream()
    call = ToolCall(call_id="c1", name="search_docs", arguments_json="{}")
    for i, text in enumerate(["one ", "two ", "three "]):
        stream.token(text, i)
    stream.tool_call(call)
    stream.token("four ", 3)
    stream.token("five", 4)
    stream.done("tool_calls")
    items = [await stream.get() for _ in range(4)]
    assert items == [
        StreamToken("one two three ", 0, 3),
        StreamToolCall(call),
        StreamToken("four five", 3, 2),
        StreamDone("tool_calls"),
    ]


async def test_an_error_ends_the_stream_after_the_tokens_before_it():
    stream = OutputStream()
    stream.token("x", 0)
    stream.error(RuntimeError("engine failed"))
    assert await stream.get() == StreamToken("x", 0)
    item = await stream.get()
    assert isinstance(item, StreamError) and str(item.error) == "engine failed"


async def test_a_reader_that_gives_up_leaves_the_stream_usable():
    stream = OutputStream()
    waiting = asyncio.create_task(stream.get())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    stream.token("late", 0)
    assert await stream.get() == StreamToken("late", 0)


def test_drain_returns_each_push_unmerged():
    stream = OutputStream()
    stream.token("a", 0)
    stream.token("b", 1)
    assert stream.drain() == [StreamToken("a", 0), StreamToken("b", 1)]
    assert stream.drain() == []


async def test_a_task_event_stream_merges_waiting_token_events_and_ends_after_the_last():
    from switchyard.api import agent_pb2
    from switchyard.orchestrator.events import event_stream

    events = event_stream()
    stage = agent_pb2.TaskEvent(stage=agent_pb2.StageEvent(name="retrieve"))
    events.put(stage)
    for i, text in enumerate(["The ", "answer", "."]):
        events.put(agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=text, index=i)))
    final = agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(task_id="t1", output="The answer."))
    events.put(final)
    events.close()
    got = []
    while (event := await events.get()) is not None:
        got.append(event)
    assert got == [
        stage,
        agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text="The answer.", index=0, count=3)),
        final,
    ]
    assert await events.get() is None  # stays ended


async def test_a_closed_stream_wakes_a_waiting_reader():
    from switchyard.orchestrator.events import event_stream

    events = event_stream()
    reader = asyncio.create_task(events.get())
    await asyncio.sleep(0)
    events.close()
    assert await reader is None
