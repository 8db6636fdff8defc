"""OutputStream: a request's items reach its session in order, the reader told of each push; the one
token-merge rule (common/coalescing.py) merges tokens waiting together, on both hops."""

import asyncio

import pytest

from switchyard.common.coalescing import merge_tokens
from switchyard.dispatcher.output import OutputStream, StreamDone, StreamError, StreamToken, StreamToolCall, coalesce
from switchyard.dispatcher.request import ToolCall


def test_the_listener_hears_every_push_and_a_reader_that_keeps_up_gets_every_token_alone():
    stream = OutputStream()
    got = []
    heard = []
    stream.listener = lambda item: heard.append((len(got), type(item).__name__))
    for i, text in enumerate(["a ", "b ", "c "]):
        stream.token(text, i)
        got.extend(coalesce(stream.drain()))  # the reader takes each token before the next is pushed
    stream.done("stop")
    assert heard == [(0, "StreamToken"), (1, "StreamToken"), (2, "StreamToken"), (3, "StreamDone")]
    assert got == [StreamToken("a ", 0), StreamToken("b ", 1), StreamToken("c ", 2)]
    assert stream.pending() and coalesce(stream.drain()) == [StreamDone("stop")] and not stream.pending()


def test_tokens_waiting_together_come_as_one_and_other_items_keep_their_place():
    stream = OutputStream()
    call = ToolCall(call_id="c1", name="search_docs", arguments_json="{}")
    for i, text in enumerate(["one ", "two ", "three "]):
        stream.token(text, i)
    stream.tool_call(call)
    stream.token("four ", 3)
    stream.token("five", 4)
    stream.done("tool_calls")
    assert coalesce(stream.drain()) == [
        StreamToken("one two three ", 0, 3),
        StreamToolCall(call),
        StreamToken("four five", 3, 2),
        StreamDone("tool_calls"),
    ]


def test_an_error_ends_the_stream_after_the_tokens_before_it():
    stream = OutputStream()
    stream.token("x", 0)
    stream.error(RuntimeError("engine failed"))
    first, item = coalesce(stream.drain())
    assert first == StreamToken("x", 0)
    assert isinstance(item, StreamError) and str(item.error) == "engine failed"


def test_drain_returns_each_push_unmerged():
    stream = OutputStream()
    stream.token("a", 0)
    stream.token("b", 1)
    assert stream.drain() == [StreamToken("a", 0), StreamToken("b", 1)]
    assert stream.drain() == []


@pytest.mark.parametrize(("counts", "merged"), [((1, 1, 1), 3), ((0, 2, 0), 4), ((5,), 5)])
def test_the_merge_rule_joins_texts_keeps_the_first_index_and_sums_counts(counts, merged):
    run = [StreamToken(f"t{i} ", 7 + i, c) for i, c in enumerate(counts)]
    assert merge_tokens(run) == ("".join(t.text for t in run), 7, merged)  # a count of 0 is one token


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


async def test_a_held_get_gathers_tokens_until_its_time_and_any_other_event_ends_the_hold():
    from switchyard.api import agent_pb2
    from switchyard.orchestrator.events import event_stream

    def token(text: str, i: int) -> agent_pb2.TaskEvent:
        return agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=text, index=i))

    loop = asyncio.get_running_loop()
    events = event_stream()
    events.put(token("a", 0))
    held = asyncio.create_task(events.get(hold_tokens_until=loop.time() + 60))
    await asyncio.sleep(0.01)
    events.put(token("b", 1))
    events.put(token("c", 2))
    await asyncio.sleep(0.01)
    assert not held.done()  # tokens alone do not end the hold
    final = agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(task_id="t1"))
    events.put(final)
    assert await asyncio.wait_for(held, 5) == agent_pb2.TaskEvent(
        token=agent_pb2.TokenEvent(text="abc", index=0, count=3))
    assert await events.get() == final

    events.put(token("d", 3))
    events.put(token("e", 4))
    assert await asyncio.wait_for(events.get(hold_tokens_until=loop.time() + 0.05), 5) == agent_pb2.TaskEvent(
        token=agent_pb2.TokenEvent(text="de", index=3, count=2))  # the hold ends at its time
    events.put(token("f", 5))
    events.close()
    assert await asyncio.wait_for(events.get(hold_tokens_until=loop.time() + 60), 5) == token("f", 5)  # close ends it
