"""Pure pieces of the gateway: SSE framing, chunk decoding, fault specs, nearest model id, proxy routing."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_fixtures import clean_proxy_env  # noqa: F401

from switchyard.gateway.classify import error_for_status
from switchyard.gateway.decode import StreamDecoder
from switchyard.gateway.errors import ContextWindowExceeded, GatewayError, StreamBroken, StreamProtocolError
from switchyard.gateway.events import Finished, Reasoning, Token, ToolCallOut, Usage
from switchyard.gateway.keys import NO_KEY, ApiKey
from switchyard_harness.faults import Fault, parse_fault, parse_flag, split_model
from switchyard.gateway.models import nearest, resolve
from switchyard.gateway.proxy import ProxyRoute, proxy_for
from switchyard.gateway.sse import iter_events, opening, opens_as_events


def sse_response(body: str) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=body.encode())


@pytest.mark.parametrize(("body", "expected"), [
    (": keep-alive\n\nevent: x\ndata: a\ndata: b\n\ndata:[DONE]\n\n", ["a\nb", "[DONE]"]),  # comments, multi-line
    ("data: a\n\ndata: [DONE]", ["a"]),  # an event cut before its empty line is not dispatched (WHATWG)
    ("data: one\r\n\r\ndata: two\r\rdata: three\n\n", ["one", "two", "three"]),  # CRLF, CR, LF line ends
    ("retry: 3000\nid: 7\n\nevent: ping\n\ndata:\n\ndata: x\n\n", ["x"]),  # events without data skipped
    ("data:  two spaces\n\ndata:no space\n\n", [" two spaces", "no space"]),  # one leading space removed
    ("event: error\ndata: {\"error\": {\"message\": \"overloaded\"}}\n\n", ['{"error": {"message": "overloaded"}}']),
])
async def test_sse_follows_the_whatwg_event_stream_format(body, expected):
    assert [e.data async for e in iter_events(sse_response(body).aiter_bytes())] == expected


@pytest.mark.parametrize("head, events", [
    (b"data: {", True), (b"data:{", True), (b": ping\n\n", True), (b"event: message\n", True),
    (b"id: 1\n", True), (b"retry: 3000\n", True), (b"error: {", True),  # every field, a comment, llama.cpp's
    (b"\xef\xbb\xbf\r\n\ndata: x", True),  # a byte order mark and blank lines first
    (b'{"choices": [', False), (b'{"error": {', False), (b"<html>", False), (b"OK", False), (b"", False),
    (b"  data: x", False), (b"dat", False),  # a field name after spaces is no field; a body of three bytes
])
def test_a_body_opens_as_an_event_stream_by_its_first_line(head, events):
    assert opens_as_events(head) is events


async def test_opening_reads_enough_to_tell_and_gives_the_whole_body_back():
    async def pieces():
        for piece in (b"\xef\xbb\xbf", b"\n", b"da", b"ta: x\n", b"\ndata: [DONE]\n\n"):
            yield piece
    head, body = await opening(pieces())
    assert head == b"\xef\xbb\xbf\ndata: x\n" and opens_as_events(head)
    assert [e.data async for e in iter_events(body)] == ["x", "[DONE]"]


async def test_llama_cpp_s_error_field_is_an_error_event_of_its_data():
    """llama.cpp writes a streamed error as 'error: {...}', a field the format ignores: it was dropped, and the
    'data: [DONE]' after it ended an empty stream as a success."""
    body = 'error: {"code":400,"message":"too long"}\n\ndata: [DONE]\n\n'
    events = [(e.event, e.data) async for e in iter_events(sse_response(body).aiter_bytes())]
    assert events == [("error", '{"code":400,"message":"too long"}'), ("message", "[DONE]")]


def chunk(delta: dict, finish: str | None = None, **extra) -> str:
    return json.dumps({"model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


def test_decoder_assembles_tool_call_deltas_and_reads_usage():
    decoder = StreamDecoder("m")
    events = []
    for data in [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "calc", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"expression":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "1+1"}'}}]}),
        chunk({}, "tool_calls"),
        json.dumps({"model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        "[DONE]",
    ]:
        events += decoder.feed(data)
    events += decoder.end()
    assert events == [ToolCallOut("call_1", "calc", '{"expression": "1+1"}'),
                      Finished("tool_calls", Usage(3, 4, 7), "m")]


def test_decoder_errors_name_what_was_received():
    decoder = StreamDecoder("m")
    assert decoder.feed(chunk({"content": "hi"})) == [Token("hi")]
    with pytest.raises(StreamBroken, match="before any finish_reason and without 'data: \\[DONE\\]' \\(no end "
                                           "marker\\) after 1 chunk"):
        decoder.end()  # content came, then the body ended with no finish_reason: cut
    no_choice = StreamDecoder("m")
    assert no_choice.feed('{"id": 1}') == [] and no_choice.feed("[DONE]") == []
    with pytest.raises(StreamProtocolError, match="reading choices.*'\\{\"id\": 1\\}'"):
        no_choice.end()  # chunks came, but none carried a choice
    with pytest.raises(StreamProtocolError, match="'choices' that is not a list"):
        StreamDecoder("m").feed('{"choices": "x"}')
    with pytest.raises(StreamProtocolError, match="non-integer index"):
        StreamDecoder("m").feed(chunk({"tool_calls": [{"index": "first", "id": "a"}]}))
    with pytest.raises(StreamProtocolError, match="not JSON"):
        StreamDecoder("m").feed('{"choices": [')
    # json's own message can end in "at" ("Unterminated string starting at"): the position must
    # follow it as json words it ("...starting at: char N"), never as "starting at at char N".
    with pytest.raises(StreamProtocolError, match="Unterminated string starting at: char 35;") as cut:
        StreamDecoder("m").feed('{"choices": [{"delta": {"content": "tru')
    assert " at at " not in str(cut.value)
    with pytest.raises(StreamBroken, match="error inside the stream: 'overloaded'"):
        StreamDecoder("m").feed('{"error": {"message": "overloaded"}}')


@pytest.mark.parametrize("payload, says", [
    ({"choices": [{"index": 0, "delta": "hi", "finish_reason": "stop"}]}, "has a 'delta' that is not an object"),
    ({"choices": [{"index": 0, "delta": ["hi"]}]}, "has a 'delta' that is not an object"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]},
     "has a 'function' that is not an object"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": 5}}]}}]},
     "has a function name that is not a string"),
])
def test_a_chunk_field_of_the_wrong_type_is_a_protocol_error_naming_it(payload, says):
    """A delta, a tool call's function or its name of the wrong type escaped the gateway's error table as an
    AttributeError or TypeError (INTERNAL with Python's words, no chunk named)."""
    with pytest.raises(StreamProtocolError, match=says):
        StreamDecoder("m").feed(json.dumps(payload))


def test_a_model_that_is_no_name_is_not_taken():
    decoder = StreamDecoder("m")
    decoder.feed(json.dumps({"model": 5, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}))
    assert decoder.end()[-1].model == "m"


def test_an_error_event_is_an_error_whatever_its_data_holds():
    """The data of an 'error' event is the error: a bare object (llama.cpp's code, message, type), one with
    'error', or text. A bare object without 'choices' was read as a choiceless chunk and, after a token, ignored."""
    decoder = StreamDecoder("m")
    assert decoder.feed(chunk({"content": "hi"})) == [Token("hi")]
    with pytest.raises(GatewayError, match="inside the stream \\(status 400\\): 'too long'") as caught:
        decoder.feed('{"code":400,"message":"too long","type":"exceed_context_size_error"}', "error")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and decoder.ending == "error"
    with pytest.raises(StreamBroken, match="inside the stream: 'engine died'"):
        StreamDecoder("m").feed("engine died", "error")
    with pytest.raises(GatewayError, match="status 429"):
        StreamDecoder("m").feed('{"error": {"message": "slow down", "type": "rate_limit_error"}}', "error")


def test_an_error_beside_or_inside_a_choice_is_the_error_it_carries_not_a_failed_finish():
    """OpenRouter sends an error after tokens as a chunk with 'error' at its top level (or, in its schema, in the
    choice) and a choice finishing 'error': read by the choice alone it failed "inside the server" with the
    upstream's message lost, and a 429 or 400 there read as a broken stream. A null error beside choices is none."""
    top = StreamDecoder("m")
    assert top.feed(chunk({"content": "hi"}, error=None)) == [Token("hi")]
    assert top.feed(chunk({"content": "!"}, error=False)) == [Token("!")]  # a flag saying there is none
    with pytest.raises(GatewayError, match="'Provider disconnected unexpectedly'") as caught:
        top.feed(chunk({"content": ""}, "error", error={"code": "server_error",
                                                         "message": "Provider disconnected unexpectedly"}))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and top.ending == "error"
    inside = json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "error",
                                      "error": {"code": 429, "message": "Rate limit exceeded upstream"}}]})
    with pytest.raises(GatewayError, match="status 429.*'Rate limit exceeded upstream'") as caught:
        StreamDecoder("m").feed(inside)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_without_index_or_id_are_told_apart_by_their_names_and_a_stop_that_called_tools_is_tool_calls():
    """Gemini's OpenAI-compatible API sends each call whole with no index and an id of "" (several in one delta, or
    in a whole completion's message) and finishes with 'stop': two calls read as one (named by the last, its
    arguments two objects run together), and the answer as finished rather than waiting on its tools. A delta with
    provider metadata alone (its thought_signature) is no call; pieces without a name still join the latest."""
    two = [{"id": "", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
           {"id": "", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]
    decoder = StreamDecoder("m")
    events = decoder.feed(chunk({"tool_calls": [{"extra_content": {"google": {"thought_signature": "x"}}}]}))
    events += decoder.feed(chunk({"role": "assistant", "tool_calls": two}, "stop")) + decoder.end()
    assert [(e.name, e.arguments_json) for e in events if isinstance(e, ToolCallOut)] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert events[-1].finish_reason == "tool_calls"
    whole = StreamDecoder("m").whole_answer(json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None, "tool_calls": two}}]}))
    assert whole is not None and [e.name for e in whole if isinstance(e, ToolCallOut)] == ["get_weather", "get_time"]
    assert whole[-1].finish_reason == "tool_calls"
    pieces = StreamDecoder("m")  # a call in pieces with no index: the pieces name no function, so they join it
    for delta in ({"id": "c1", "function": {"name": "f", "arguments": '{"a"'}}, {"function": {"arguments": ": 1}"}}):
        pieces.feed(chunk({"tool_calls": [delta]}))
    calls = [e for e in pieces.feed(chunk({}, "length")) if isinstance(e, ToolCallOut)]
    assert [(c.name, c.arguments_json) for c in calls] == [("f", '{"a": 1}')]
    assert pieces.finish_reason == "length"  # a cut call stays cut
    text_only = StreamDecoder("m")
    assert text_only.feed(chunk({"content": "hi"}, "stop")) == [Token("hi")] and text_only.finish_reason == "stop"


def test_the_former_function_call_is_a_tool_call():
    """The OpenAI API's former single call streams as delta.function_call (its name, then its arguments in pieces)
    and finishes 'function_call': the finish was read as tool_calls, but the call itself was dropped."""
    decoder = StreamDecoder("m")
    for delta in ({"role": "assistant", "content": None, "function_call": {"name": "calc", "arguments": ""}},
                  {"function_call": {"arguments": '{"expression":'}}, {"function_call": {"arguments": ' "1+1"}'}}):
        assert decoder.feed(chunk(delta)) == []
    events = decoder.feed(chunk({}, "function_call")) + decoder.end()
    assert events == [ToolCallOut("call_0", "calc", '{"expression": "1+1"}'),
                      Finished("tool_calls", None, "m", "finish_reason")]


def test_a_refusal_is_the_answer_streamed_or_whole():
    """The OpenAI API sends a model's refusal (Structured Outputs) in 'refusal' with content null, in a stream's
    deltas and in a whole completion's message: it was dropped, an empty 'stop' answer that said nothing."""
    whole = StreamDecoder("m").whole_answer(json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": None, "refusal": "I can't help with that."}}]}))
    assert whole is not None and whole[0] == Token("I can't help with that.") and whole[-1].finish_reason == "stop"
    assert StreamDecoder("m").feed(chunk({"content": "hi", "refusal": None})) == [Token("hi")]


def _choices(*choices: dict, **extra) -> str:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": list(choices), **extra})


def test_a_message_after_the_deltas_is_the_answer_again_not_more_of_it():
    """A whole completion framed as a stream's one chunk is read by its ``message`` (as ``delta``); a server that
    streams deltas and then sends the answer so far as ``message`` (without ``delta``, or beside an empty one, at
    its finish) sends no more text: read as a delta there, the answer was sent twice. The recorded stream
    ``message_after_deltas.sse`` is the first shape; this is both."""
    for last in ({"index": 0, "message": {"role": "assistant", "content": "Hello there!"}, "finish_reason": "stop"},
                 {"index": 0, "delta": {}, "message": {"role": "assistant", "content": "Hello there!"},
                  "finish_reason": "stop"}):
        decoder = StreamDecoder("m")
        fed = [_choices({"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None}),
               _choices({"index": 0, "delta": {"content": " there!"}, "finish_reason": None}), _choices(last)]
        events = [e for data in fed for e in decoder.feed(data)]
        finished = Finished("stop", None, "m", "finish_reason")
        assert events + decoder.end() == [Token("Hello"), Token(" there!"), finished]
    alone = StreamDecoder("m")  # the whole completion as the stream's one chunk: its message is the answer
    assert alone.feed(_choices({"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
                               )) == [Token("Hi")]


def test_the_answer_is_the_choice_of_index_0_wherever_it_sits_in_a_chunk_or_a_whole_completion():
    """The decoder read ``choices[0]``: a server that sends another choice first (another index's piece, ordered as
    it likes) gave that choice's text as the answer's, and its finish_reason ended the answer; usage-only chunks
    (``choices: []``) between carry nothing. The choice of index 0 is read wherever it sits; a choice with no index
    is index 0 (a server sending one choice may leave it out); the other choices are not the answer. The whole
    completion (no stream) is read so too."""
    decoder = StreamDecoder("m")
    fed = [
        _choices({"index": 1, "delta": {"content": "other"}, "finish_reason": None},
                 {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}),
        _choices(),  # nothing
        _choices({"index": 1, "delta": {}, "finish_reason": "length"}),  # another choice ends: not the answer
        _choices({"delta": {"content": "lo"}, "finish_reason": None}),  # no index: index 0
        _choices({"index": 1, "delta": {"content": "x"}, "finish_reason": None},
                 {"index": 0, "delta": {}, "finish_reason": "stop"}),
        _choices(usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),  # usage-only: choices []
    ]
    events = [e for data in fed for e in decoder.feed(data)]
    assert decoder.ending == "finish_reason"
    assert events + decoder.end() == [Token("Hel"), Token("lo"), Finished("stop", Usage(5, 2, 7), "m", "finish_reason")]
    only_other = StreamDecoder("m")
    assert only_other.feed(_choices({"index": 1, "delta": {"content": "x"}, "finish_reason": "stop"})) == []
    assert only_other.feed("[DONE]") == []
    with pytest.raises(StreamProtocolError, match="none of the 1 stream chunk\\(s\\) carried a choice of index 0"):
        only_other.end()  # no answer came: an error naming what did, not an empty answer
    with pytest.raises(StreamProtocolError, match="a choice that is not an object"):
        StreamDecoder("m").feed(_choices({"index": 0, "delta": {}}, "x"))
    whole = StreamDecoder("m").whole_answer(json.dumps({"object": "chat.completion", "model": "m", "choices": [
        {"index": 1, "message": {"role": "assistant", "content": "other"}, "finish_reason": "length"},
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}]}))
    assert whole == [Token("Hello"), Finished("stop", None, "m", "whole_answer")]
    assert StreamDecoder("m").whole_answer(json.dumps({"choices": [
        {"index": 1, "message": {"role": "assistant", "content": "other"}, "finish_reason": "stop"}]})) is None


def test_a_whole_completion_reads_its_choices_as_a_streams_chunk_does():
    """One owner of "which choice is the answer" (decode.answer_choice): the whole completion's choices were picked
    inline, a choice that is not an object passed over there where a stream's chunk fails on it, so one body was
    an answer as a completion and an error as a stream. Now both fail it naming the choice, and the decoder's
    ending is the error's."""
    body = json.dumps({"choices": ["x", {"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                          "finish_reason": "stop"}]})
    decoder = StreamDecoder("m")
    with pytest.raises(StreamProtocolError, match="the whole completion has a choice that is not an object"):
        decoder.whole_answer(body)
    assert decoder.ending == "error"
    with pytest.raises(StreamProtocolError, match="stream chunk 1 has a choice that is not an object"):
        StreamDecoder("m").feed(body)
    # n choices, the answer's not first: the choice of index 0, its index a string as some proxies send it
    n_choices = StreamDecoder("m").whole_answer(json.dumps({"choices": [
        {"index": 2, "message": {"content": "two"}, "finish_reason": "stop"},
        {"index": "0", "message": {"content": "zero"}, "finish_reason": "length"},
        {"index": 1, "message": {"content": "one"}, "finish_reason": "stop"}]}))
    assert n_choices == [Token("zero"), Finished("length", None, "m", "whole_answer")]


def test_json_numbers_written_as_floats_are_the_integers_they_hold():
    """JSON has one number type, and some servers' serializers write every number as a float: a choice's ``index``
    of ``0.0`` was no index 0 ("none of the 2 stream chunk(s) carried a choice of index 0"), a tool call's of ``0.5``
    was call 0 and ``true`` call 1, an in-stream error's ``code`` of ``429.0`` was read by its type alone.
    One reader (untrusted.json_integer) takes an integral float as its integer and refuses the rest by name."""
    decoder = StreamDecoder("m")
    fed = [
        '{"id":"c","object":"chat.completion.chunk","created":1733400000.0,"model":"m",'
        '"choices":[{"index":0.0,"delta":{"role":"assistant","content":"Hi"},"logprobs":null,"finish_reason":null}]}',
        '{"id":"c","object":"chat.completion.chunk","created":1733400000.0,"model":"m",'
        '"choices":[{"index":0.0,"delta":{"tool_calls":[{"index":0.0,"id":"a","type":"function",'
        '"function":{"name":"f","arguments":"{}"}},{"index":1.0,"id":"b","type":"function",'
        '"function":{"name":"g","arguments":"{}"}}]},"finish_reason":"tool_calls"}],'
        '"usage":{"prompt_tokens":5.0,"completion_tokens":3.0,"total_tokens":8.0}}',
    ]
    events = [e for data in fed for e in decoder.feed(data)] + decoder.end()
    assert events == [Token("Hi"), ToolCallOut("a", "f", "{}"), ToolCallOut("b", "g", "{}"),
                      Finished("tool_calls", Usage(5, 3, 8), "m", "finish_reason")]
    whole = StreamDecoder("m").whole_answer(
        '{"object":"chat.completion","created":1733400000.0,"model":"m","choices":[{"index":0.0,'
        '"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],'
        '"usage":{"prompt_tokens":4.0,"completion_tokens":1.0,"total_tokens":5.0}}')
    assert whole == [Token("Hello"), Finished("stop", Usage(4, 1, 5), "m", "whole_answer")]
    # a count that is no whole number is no count: the dispatcher counts the tokens itself
    half = StreamDecoder("m")
    half.feed('{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}],'
              '"usage":{"prompt_tokens":5.5,"completion_tokens":1,"total_tokens":6.5}}')
    assert half.end()[-1].usage is None


LONG_DIGITS = '"%s"' % ("1" * 5000)
"""A string of more digits than Python's int() reads (4300): no integer, not a ValueError out of the decoder."""


@pytest.mark.parametrize("index", ["0.5", "true", '"first"', "1e400", LONG_DIGITS])
def test_a_choice_index_that_is_no_whole_number_is_refused_by_name(index):
    data = '{"choices":[{"index":%s,"delta":{"content":"x"},"finish_reason":"stop"}]}' % index
    with pytest.raises(StreamProtocolError, match="stream chunk 1 has a choice whose 'index' is not a whole number"):
        StreamDecoder("m").feed(data)


@pytest.mark.parametrize("index", ["0.5", "true", '"first"', LONG_DIGITS])
def test_a_tool_call_index_that_is_no_whole_number_is_refused_by_name(index):
    data = ('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":%s,"id":"a","function":{"name":"f"}}]},'
            '"finish_reason":null}]}' % index)
    with pytest.raises(StreamProtocolError, match="tool_calls delta has a non-integer index"):
        StreamDecoder("m").feed(data)


N_CHOICES_STREAM = [
    '{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"Hello"},'
    '"finish_reason":null},{"index":1,"delta":{"content":"Other"},"finish_reason":null}]}',
    '{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":1,"delta":{"content":" words here"},'
    '"finish_reason":"stop"}]}',
    '{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":" there"},'
    '"finish_reason":"stop"}]}',
    '{"id":"c","object":"chat.completion.chunk","model":"m","choices":[],'
    '"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}}',
]
N_CHOICES_WHOLE = (
    '{"id":"c","object":"chat.completion","model":"m","choices":[{"index":1,"message":{"role":"assistant",'
    '"content":"Other words here"},"finish_reason":"stop"},{"index":0,"message":{"role":"assistant",'
    '"content":"Hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":40,'
    '"total_tokens":52}}')


def test_an_answer_with_n_choices_counts_its_answers_tokens_toward_throughput_streamed_or_whole():
    """A whole completion with n choices counted the server's usage (every choice's tokens) toward the endpoint's
    throughput, where the same answer streamed counts its answer's events: one count of both
    (StreamDecoder.answer_tokens). A whole completion of the one choice asked still counts the server's usage."""
    streamed = StreamDecoder("m")
    events = [e for data in N_CHOICES_STREAM for e in streamed.feed(data)]
    per_event = sum(streamed.answer_tokens([e]) for e in events)
    assert [e.text for e in events] == ["Hello", " there"] and per_event == 2
    whole = StreamDecoder("m")
    answer = whole.whole_answer(N_CHOICES_WHOLE)
    assert answer[0] == Token("Hello there") and whole.other_choices
    assert whole.answer_tokens(answer) == per_event  # not the usage's 40
    one = StreamDecoder("m")
    answer = one.whole_answer(
        '{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant",'
        '"content":"Hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,'
        '"total_tokens":15}}')
    assert one.answer_tokens(answer) == 3  # the server's own count, where it is the answer's alone


def test_a_finish_reason_ends_a_stream_without_done_and_done_ends_one_without_finish_reason():
    """transformers serve ends with a finish chunk carrying usage and no [DONE]: finished, not cut."""
    no_marker = StreamDecoder("m")
    events = no_marker.feed(chunk({"content": "hi"})) + no_marker.feed(
        chunk({}, "length", usage={"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}))
    assert no_marker.ending == "finish_reason"
    assert events + no_marker.end() == [Token("hi"), Finished("length", Usage(4, 1, 5), "m")]
    marker_only = StreamDecoder("m")
    marker_only.feed(chunk({"content": "hi"}))
    assert marker_only.ending is None
    marker_only.feed("[DONE]")
    assert marker_only.ending == "done_marker" and marker_only.end()[-1].finish_reason is None


def test_fault_specs():
    assert parse_fault("status=503, fail_first=2") == Fault(status=503, fail_first=2)
    assert parse_fault("cut_after=3,mismatch") == Fault(cut_after=3, mismatch=True)
    assert parse_fault("status=502,said=connect to http://10.0.0.9:8000 failed") == \
        Fault(status=502, said="connect to http://10.0.0.9:8000 failed")  # the server's own words
    assert split_model("gpt-4o-mini#slow_ms=5") == ("gpt-4o-mini", Fault(slow_ms=5.0))
    assert split_model("gpt-4o-mini") == ("gpt-4o-mini", None)
    assert parse_flag("gpt-4o-mini=status=500") == ("gpt-4o-mini", Fault(status=500))
    assert parse_flag("status=500") == ("*", Fault(status=500))
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        parse_fault("bogus=1")
    with pytest.raises(ValueError, match="expected status=<a whole number>"):
        parse_fault("status=abc")
    for spec, expected in (("status=999", "an HTTP error status, 400 to 599"), ("status=200", "400 to 599"),
                           ("cut_after=-1", "a finite number >= 0"), ("slow_ms=nan", "a finite number >= 0")):
        with pytest.raises(ValueError, match=expected):  # 999 dropped the connection unanswered; -1 was no fault
            parse_fault(spec)


@pytest.mark.parametrize("spec", ["said=connect to http://10.0.0.9:8000 failed", "retry_after=30", "retry_after_ms=500",
                                  "retry_after_date=60", "fail_first=2", "cut_after=1,retry_after=3"])
def test_a_fault_that_shapes_a_status_answer_is_refused_without_a_status(spec):
    """``said``, the Retry-After keys and ``fail_first`` shape a status answer: alone they injected nothing and the
    server started as if they did (every call served)."""
    key = spec.split(",")[-1].partition("=")[0]
    with pytest.raises(ValueError, match=f"{key} shapes a status answer and injects nothing without one; add status="):
        parse_fault(spec)
    assert parse_fault(f"status=503,{spec}").status == 503


def test_a_fault_flags_head_that_is_both_a_key_and_a_served_model_is_refused():
    """``--model said --fault 'said=status=502,said=...'`` read ``said`` as the key: the model got no fault."""
    with pytest.raises(ValueError, match="'said' is both a fault key and a model served here"):
        parse_flag("said=status=502", ["said", "ok"])
    assert parse_flag("said=x,status=502", ["ok"]) == ("*", Fault(status=502, said="x"))


def test_one_parser_owns_the_fault_flags_syntax_and_names_the_flag_and_what_was_expected():
    """sim-openai split the flag's head itself beside parse_flag, which took any head as a model: parse_flag with
    the served models refuses what the server refused, in the same words, and reads a key with spaces around it
    as parse_fault reads it in a spec (' status=503' was model ' status' with "unknown key '503'")."""
    served = ["gpt-4o-mini", "flaky"]
    assert parse_flag(" status=503", served) == ("*", Fault(status=503))
    assert parse_flag("status =503") == ("*", Fault(status=503))
    assert parse_flag("flaky=status=503,fail_first=2", served) == ("flaky", Fault(status=503, fail_first=2))
    for flag, says in (
        ("nomodel=status=503", "'nomodel=status=503': 'nomodel' is neither a fault key nor a model served here; "
                               "expected [MODEL=]SPEC with MODEL one of gpt-4o-mini, flaky (serve another with "
                               "--model ID) and SPEC key=value items of: "),
        ("bogus=1", "'bogus' is neither a fault key nor a model served here"),
        ("=status=503", "'=status=503': a blank model id; expected [MODEL=]SPEC"),
        ("flaky=", "'flaky=': expected a fault (key=value items of: "),
        ("", "'': expected a fault (key=value items of: "),
        ("flaky=status=abc", "'flaky=status=abc': fault 'status=abc': expected status=<a whole number>, got 'abc'"),
    ):
        with pytest.raises(ValueError) as caught:
            parse_flag(flag, served)
        assert says in str(caught.value), (flag, str(caught.value))
    with pytest.raises(ValueError, match="a blank model id; expected .* MODEL a model id"):
        parse_flag("  =status=503")  # without the served models: any model id, but not a blank one


def test_nearest_model_and_model_map():
    known = ["claude-sonnet-4-5", "gpt-4o-mini", "sim-7b"]
    assert nearest("claude-sonnet-4.5", known) == "claude-sonnet-4-5"
    assert nearest("gpt-4o-mni", known) == "gpt-4o-mini"
    assert nearest("llama-3-70b", known) is None
    # the same name under another path or organisation (transformers serve lists a local model by its path)
    assert nearest("tiny", ["/srv/models/tiny", "other"]) == "/srv/models/tiny"
    assert nearest("Llama-3.1-8B-Instruct", ["meta-llama/Llama-3.1-8B-Instruct"]) == "meta-llama/Llama-3.1-8B-Instruct"
    assert resolve("", {"d": "x"}, "d") == "x" and resolve("fast", {}, "d") == "fast"


def test_proxy_for_honours_no_proxy(clean_proxy_env, monkeypatch):
    assert proxy_for("http://127.0.0.1:8400/v1") is None
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:3128")
    monkeypatch.setenv("HTTPS_PROXY", "proxy.corp:8080")
    assert proxy_for("http://127.0.0.1:8400/v1") == ProxyRoute("HTTP_PROXY", "http://127.0.0.1:3128")
    assert proxy_for("https://api.example.com/v1").host_port() == ("proxy.corp", 8080)
    monkeypatch.setenv("NO_PROXY", "localhost,.example.com,10.0.0.0/8")
    assert proxy_for("https://api.example.com/v1") is None
    assert proxy_for("http://10.1.2.3/v1") is None
    assert proxy_for("http://127.0.0.1/v1") is not None


def test_all_proxy_is_used_when_no_scheme_variable_is_set(clean_proxy_env, monkeypatch):
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:3129")
    assert proxy_for("https://api.example.com/v1") == ProxyRoute("ALL_PROXY", "http://127.0.0.1:3129")


def test_sim_openai_cli_rejects_bad_flags(monkeypatch, capsys):
    from switchyard_harness import sim_openai

    with pytest.raises(SystemExit) as caught:
        sim_openai.main(["--fault", "status=abc"])
    assert caught.value.code == 2 and "expected status=<a whole number>" in capsys.readouterr().err
    # --fault flags that could never act were taken, and the server served every request unharmed
    for argv, says in [
        # a model not served: its requests are answered 404 before any fault; bogus=1 said "unknown key '1'"
        (["--fault", "nomodel=status=503"], "--fault 'nomodel=status=503': 'nomodel' is neither a fault key nor a "
                                            "model served here; expected [MODEL=]SPEC with MODEL one of "
                                            "claude-sonnet-4-5, gpt-4o-mini, sim-7b (serve another with --model ID)"),
        (["--fault", "bogus=1"], "'bogus' is neither a fault key nor a model served here"),
        (["--fault", "=status=503"], "--fault '=status=503': a blank model id"),
        (["--model", "flaky", "--fault", "flaky="], "--fault 'flaky=': expected a fault (key=value items of: "),
        (["--fault", ""], "--fault '': expected a fault"),
        (["--fault", "status=503", "--fault", "cut_after=2"],  # the second replaced the first
         "--fault 'cut_after=2': a second fault for every model (the first would be replaced)"),
        (["--model", "flaky", "--fault", "flaky=status=503", "--fault", "flaky=cut_after=2"],
         "a second fault for model 'flaky'"),
    ]:
        with pytest.raises(SystemExit) as caught:
            sim_openai.main(argv)
        assert caught.value.code == 2, argv
        assert says in capsys.readouterr().err, argv
    monkeypatch.delenv("SIM_KEY_UNSET", raising=False)
    with pytest.raises(SystemExit):
        sim_openai.main(["--api-key-env", "SIM_KEY_UNSET"])
    assert "SIM_KEY_UNSET" in capsys.readouterr().err
    for port in ("-1", "70000"):  # bind()'s OverflowError was a traceback
        with pytest.raises(SystemExit) as caught:
            sim_openai.main(["--port", port])
        assert caught.value.code == 2
        assert f"--port: expected 0 (any free port) to 65535, got {port}" in capsys.readouterr().err


def test_sim_openai_names_a_bad_config_dir_and_exits_2_without_a_traceback(tmp_path, capsys):
    from switchyard_harness import sim_openai

    assert sim_openai.main(["--config-dir", str(tmp_path / "missing")]) == 2
    assert "bad configuration" in capsys.readouterr().err


async def test_sim_openai_fault_header_and_bad_requests(clean_proxy_env):
    import httpx

    from gateway_fixtures import start_sim

    with start_sim() as server:
        async with httpx.AsyncClient(base_url=server.base_url + "/") as http:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            injected = await http.post("chat/completions", json=body, headers={"x-sim-fault": "status=502"})
            bad_fault = await http.post("chat/completions", json=body, headers={"x-sim-fault": "nope"})
            no_messages = await http.post("chat/completions", json={"model": "gpt-4o-mini"})
            # the model suffix's spec is checked as the header's ('no_done no_finish': a space, not a comma);
            # it was a 500 'Internal Server Error', the reason only in the server's log
            bad_suffix = await http.post("chat/completions", json={**body, "model": "gpt-4o-mini#no_done no_finish"})
    assert injected.status_code == 502 and injected.json()["error"]["code"] == "server_error"
    assert bad_fault.status_code == 400 and "unknown key 'nope'" in bad_fault.json()["error"]["message"]
    assert bad_suffix.status_code == 400 and bad_suffix.json()["error"]["param"] == "model"
    assert "unknown key 'no_done no_finish'" in bad_suffix.json()["error"]["message"]
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"


def _shapes() -> list[dict]:
    import pathlib

    return json.loads((pathlib.Path(__file__).parent / "data" / "stream_shapes.json").read_text())["cases"]


@pytest.mark.parametrize("case", _shapes(), ids=lambda case: case["name"])
def test_stream_shapes_seen_in_the_wild_decode(case):
    decoder = StreamDecoder("m")
    events = []
    for data in case["data"]:
        events += decoder.feed(data)
    events += decoder.end()
    text = "".join(e.text for e in events if isinstance(e, Token))
    assert text == case["text"]
    text.encode("utf-8")  # what protobuf will do with it
    calls = [[c.call_id, c.name, c.arguments_json] for c in events if isinstance(c, ToolCallOut)]
    assert calls == case["tool_calls"]
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == case["finish_reason"]
    if "usage" in case:
        assert finished.usage == Usage(*case["usage"])


@pytest.mark.parametrize("error, kind, code", [
    # vLLM: the request's own fault, inside the stream (its status in "code")
    ({"message": "This model's maximum context length is 10 tokens", "type": "BadRequestError", "code": 400},
     "ContextWindowExceeded", grpc.StatusCode.INVALID_ARGUMENT),  # a BadUpstreamRequest
    ({"message": "bad", "code": "422"}, "BadUpstreamRequest", grpc.StatusCode.INVALID_ARGUMENT),
    ({"message": "too long", "type": "invalid_request_error", "code": None},  # OpenAI: by its type
     "BadUpstreamRequest", grpc.StatusCode.INVALID_ARGUMENT),
    ({"message": "slow down", "type": "rate_limit_exceeded"}, "UpstreamRateLimited",
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    ({"message": "slow down", "code": 429}, "UpstreamRateLimited", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ({"message": "slow down", "code": 429.0}, "UpstreamRateLimited", grpc.StatusCode.RESOURCE_EXHAUSTED),  # a float
    ({"message": "overloaded", "type": "server_error", "code": None}, "UpstreamStreamError",
     grpc.StatusCode.UNAVAILABLE),
    ({"message": "oops", "code": 500}, "UpstreamStreamError", grpc.StatusCode.UNAVAILABLE),
    ({"message": "odd", "code": True}, "UpstreamStreamError", grpc.StatusCode.UNAVAILABLE),
    ({"message": "odd", "code": "4" * 5000}, "UpstreamStreamError", grpc.StatusCode.UNAVAILABLE),  # past int()'s digits
    ({"message": "bad key", "code": 401}, "UpstreamAuthError", grpc.StatusCode.UNAUTHENTICATED),
    ({"message": "no right", "code": 403}, "UpstreamAuthError", grpc.StatusCode.PERMISSION_DENIED),
    ({"message": "no such model", "code": 404}, "BadUpstreamRequest", grpc.StatusCode.NOT_FOUND),
    ({"message": "bad key", "type": "authentication_error"}, "UpstreamAuthError", grpc.StatusCode.UNAUTHENTICATED),
    # Anthropic's error event ({"type": "error", "error": {"type", "message"}}) through a gateway: by its type
    ({"type": "overloaded_error", "message": "Overloaded"}, "UpstreamServerError", grpc.StatusCode.UNAVAILABLE),
    ({"type": "api_error", "message": "Internal server error"}, "UpstreamStreamError", grpc.StatusCode.UNAVAILABLE),
    ({"type": "billing_error", "message": "credit balance too low"}, "UpstreamQuotaExhausted",
     grpc.StatusCode.FAILED_PRECONDITION),
])
def test_an_error_inside_the_stream_is_classified_as_the_same_answer_as_a_status(error, kind, code):
    with pytest.raises(GatewayError) as caught:
        StreamDecoder("m").feed(json.dumps({"error": error}))
    assert type(caught.value).__name__ == kind and caught.value.code == code
    assert caught.value.retryable == (kind in ("UpstreamRateLimited", "UpstreamStreamError", "UpstreamServerError"))
    assert caught.value.refuses_load == (kind in ("UpstreamRateLimited", "UpstreamServerError"))  # a 429, a 529


@pytest.mark.parametrize("error", [
    # LiteLLM's proxy relaying vLLM's in-stream 400 (tests/data/upstream_streams/litellm_stream_error_context.sse)
    {"message": "litellm.APIConnectionError: APIConnectionError: OpenAIException - The decoder prompt (length 8193) "
                "is longer than the maximum model length of 8192.", "type": None, "param": None, "code": "500"},
    {"message": "This model's maximum context length is 4096 tokens.", "code": "context_length_exceeded"},  # no status
    {"message": "the request exceeds the available context size, try increasing it", "code": 500},  # llama.cpp
    {"message": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` "
                "tokens and 200 `max_new_tokens`", "code": 502},  # TGI's words behind a proxy
    {"message": "prompt is too long: 210000 tokens > 200000 maximum", "type": "api_error"},  # Anthropic's words
    # LiteLLM's proxy relaying vLLM's renderer's words
    {"message": "litellm.APIConnectionError: OpenAIException - You passed 98305 input tokens and requested 32768 "
                "output tokens. However, the model's context length is only 131072 tokens, resulting in a maximum "
                "input length of 98304 tokens.", "code": "500"},
    "This model's maximum prompt length is 131072 but the request contains 136973 tokens.",  # xAI's, as a string
], ids=["litellm_vllm", "openai_code", "llama_cpp_500", "tgi_502", "anthropic_words", "litellm_vllm_renderer", "xai"])
def test_a_request_too_long_for_the_context_is_its_own_fault_whatever_status_it_came_with(error):
    """A proxy relays a prompt too long for the model as a 500 inside the stream (LiteLLM: every in-stream error is
    "code": "500"): read by its status, it was a broken stream, retried and sent to the fallback model. It is the
    request's fault: INVALID_ARGUMENT, not retried, no fallback, saying what to shorten."""
    with pytest.raises(GatewayError) as caught:
        StreamDecoder("m").feed(json.dumps({"error": error}))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, str(caught.value)
    assert not caught.value.retryable and not caught.value.fallback_ok
    assert "does not fit model 'm''s context window" in str(caught.value)


@pytest.mark.parametrize("body, counted", [
    ("This model's maximum context length is 2048 tokens. However, you requested 2301 tokens (601 in the messages, "
     "1700 in the completion). Please reduce the length of the messages or completion.", 601),  # vLLM 0.x
    ("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens in the messages, Please "
     "reduce the length of the messages.", 2100),  # vLLM 0.x, the prompt alone past the window
    ("'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens "
     "and your request has 2778 input tokens (8000 > 4096 - 2778).", 2778),  # vLLM
    ("This model's maximum context length is 128000 tokens. However, your messages resulted in 130512 tokens. Please "
     "reduce the length of the messages.", 130512),  # the OpenAI API
    ("The decoder prompt (length 8193) is longer than the maximum model length of 8192.", 8193),  # vLLM's V1 engine
    ("The input (9000 tokens) is longer than the model's context length (8192 tokens).", 9000),  # SGLang
    ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and "
     "200 `max_new_tokens`", 4000),  # TGI
    ("prompt is too long: 210000 tokens > 200000 maximum", 210000),  # Anthropic
    ('{"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": '
     '"exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}', 5000),  # llama.cpp
    ("litellm.ContextWindowExceededError: context window exceeded", None),  # no count said
    # the OpenAI API with functions (tools): the prompt is the messages and the functions, as its usage counts it,
    # not the messages' part alone (the first number in parentheses)
    ("This model's maximum context length is 8192 tokens. However, you requested 8213 tokens (6683 in the messages, "
     "730 in the functions, and 800 in the completion). Please reduce the length of the messages, functions, or "
     "completion.", 7413),
    ("This model's maximum context length is 128000 tokens. However, your messages resulted in 202868 tokens (202767 "
     "in the messages, 101 in the functions). Please reduce the length of the messages or functions.", 202868),
    ('{"error": {"message": "litellm.BadRequestError: OpenAIException - This model\'s maximum context length is 8192 '
     'tokens. However, you requested 9455 tokens (2426 in the messages, 2933 in the functions, and 4096 in the '
     'completion).", "code": "400"}}', 5359),  # the same behind LiteLLM, as JSON
    ("This model's maximum context length is 16384 tokens. However, you requested 500 output tokens and your prompt "
     "contains 16000 input tokens, for a total of 16500 tokens. Please reduce the length of the input prompt or the "
     "number of requested output tokens. (parameter=input_tokens, value=16000)", 16000),  # vLLM's renderer
    ("This model's maximum context length is 16384 tokens. However, you requested 8192 output tokens and your prompt "
     "contains at least 16385 input tokens, for a total of at least 24577 tokens. Please reduce the length of the "
     "input prompt or the number of requested output tokens. (parameter=input_tokens, value=16385)", None),  # a bound
    ("Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5000 "
     "tokens: 4000 tokens from the input messages and 1000 tokens for the completion. Please reduce the number of "
     "tokens in the input messages or the completion to fit within the limit.", 4000),  # SGLang, prompt + max_tokens
    ('{"object": "error", "message": "Prompt contains 40960 tokens and 0 draft tokens, too large for model with 32768 '
     'maximum context length", "type": "invalid_request_message_error", "param": null}', 40960),  # Mistral
    # vLLM's renderer (vllm/renderers/params.py, TokenizeParams._token_len_check), as its VLLMValidationError answers
    ('{"error": {"message": "You passed 98305 input tokens and requested 32768 output tokens. However, the model\'s '
     'context length is only 131072 tokens, resulting in a maximum input length of 98304 tokens. Please reduce the '
     'length of the input prompt. (parameter=input_tokens, value=98305)", "type": "BadRequestError", "param": '
     '"input_tokens", "code": 400}}', 98305),
    ("You passed 10243 input tokens and requested 6142 output tokens. However, the model's context length is only "
     "16384, resulting in a maximum input length of 10242. Please reduce the length of the input messages. "
     "(parameter=input_tokens, value=10243)", 10243),  # the same before it named the unit
    ("You passed 2097025 input characters and requested 1 output tokens. However, the model's context length is "
     "only 16384 tokens, resulting in a maximum input length of 16383 tokens (at most 2097024 characters). Please "
     "reduce the length of the input prompt. (parameter=input_text, value=2097025)", None),  # characters, no tokens
    ("max_tokens=20000 cannot be greater than max_model_len=8192. Please request fewer output tokens. "
     "(parameter=max_tokens, value=20000)", None),  # vLLM: max_tokens alone past the window
    ("max_tokens=140000cannot be greater than max_model_len=max_total_tokens=131072. Please request fewer output "
     "tokens.", None),  # the same in an earlier release's f-string
    ('{"object": "error", "message": "The prompt (total length 6287) is too long to fit into the model (context '
     'length 4096). Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal '
     'tokens.", "type": "BadRequestError", "param": null, "code": 400}', 6287),  # vLLM, a multimodal prompt
    ('{"code": "invalid-argument", "error": "This model\'s maximum prompt length is 131072 but the request contains '
     '136973 tokens."}', 136973),  # xAI
    ('{"error": {"code": 400, "message": "The input token count (1200293) exceeds the maximum number of tokens allowed '
     '(1048576).", "status": "INVALID_ARGUMENT"}}', 1200293),  # the Gemini API
    ('{"type": "error", "error": {"type": "invalid_request_error", "message": "input length and `max_tokens` exceed '
     'context limit: 178959 + 64000 > 200000, decrease input length or `max_tokens` and try again"}}', 178959),
    ('{"error": "{\\"error\\":{\\"code\\":400,\\"message\\":\\"request (9177 tokens) exceeds the available '
     'context size (4096 tokens), try increasing it\\",\\"type\\":\\"exceed_context_size_error\\"}}"}', 9177),
    ("Trying to keep the first 15857 tokens when context the overflows. However, the model is loaded with context "
     "length of only 4096 tokens, which is not enough. Try to load the model with a larger context length, or "
     "provide a shorter input", None),  # LM Studio: the tokens it keeps, not the prompt's
    ("The number of tokens to keep from the initial prompt is greater than the context length. Try to load the model "
     "with a larger context length, or provide a shorter input", None),  # LM Studio
    ("Please reduce the length of the messages or completion. Current length is 42328 while limit is 40000",
     None),  # Cerebras: the request with its completion
    ('{"error": {"message": "Please reduce the length of the messages or completion.", "type": '
     '"invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}', None),  # Groq
    ("This endpoint's maximum context length is 131072 tokens. However, you requested about 141607 tokens (10535 of "
     "text input, 131072 in the output). Please reduce the length of either one, or use the \"middle-out\" transform "
     "to compress your prompt automatically.", 10535),  # OpenRouter
    ("This endpoint's maximum context length is 204800 tokens. However, you requested about 205432 tokens (81684 of "
     "text input, 3748 of tool input, 120000 in the output). Please reduce the length of either one", 85432),
    ("This model's maximum context length is 131072 tokens. However, you requested 351430 tokens. Please reduce the "
     "length of the messages or completion.", None),  # vLLM 0.x: the prompt and the completion together
], ids=["vllm_messages", "vllm_prompt_alone", "vllm_input_tokens", "openai", "vllm_v1", "sglang", "tgi", "anthropic",
        "llama_cpp", "litellm", "openai_functions_requested", "openai_functions_resulted", "litellm_openai_functions",
        "vllm_renderer", "vllm_renderer_at_least", "sglang_total", "mistral", "vllm_passed", "vllm_passed_unitless",
        "vllm_passed_characters", "vllm_max_tokens_past_window", "vllm_max_tokens_past_window_old",
        "vllm_multimodal", "xai", "gemini", "anthropic_with_max_tokens", "ollama_llama_cpp", "lm_studio_keep",
        "lm_studio_keep_initial", "cerebras", "groq", "openrouter", "openrouter_tools", "vllm_requested_total"])
def test_a_refusal_too_long_for_the_context_carries_the_servers_count_of_the_prompt_where_it_says_it(body, counted):
    """The dispatcher learns the server's tokens per counted one from it (a first call refused so teaches the
    ratio a usage would): the count each server's words give, None where they give none."""
    err = error_for_status(400, body, {}, url="http://h/v1/chat/completions", model="m", key=NO_KEY)
    assert isinstance(err, ContextWindowExceeded) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.server_prompt_tokens, err.model) == (counted, "m")


@pytest.mark.parametrize("status, code", [(500, grpc.StatusCode.INVALID_ARGUMENT), (503, grpc.StatusCode.UNAVAILABLE),
                                          (429, grpc.StatusCode.RESOURCE_EXHAUSTED)])
def test_an_answered_status_says_too_long_only_where_it_refuses_or_fails_the_request(status, code):
    """A 500 whose body says the prompt is too long is the request's fault; a 503 or 429 saying it still refuses load."""
    body = json.dumps({"error": {"message": "This model's maximum context length is 4096 tokens"}})
    err = error_for_status(status, body, {}, url="http://h/v1/chat/completions", model="m", key=NO_KEY)
    assert err.code == code


@pytest.mark.parametrize("status", [400, 401, 403, 409, 413, 422, 429, 503])
def test_an_in_stream_error_and_the_same_status_as_an_answer_are_one_error(status):
    """One table (classify.error_for_status) for both: the same class, gRPC code and retry flags; the message
    names the endpoint and never the key's value."""
    url, key = "http://replica-2:8000/v1/chat/completions", ApiKey("MY_UPSTREAM_KEY", "sk-secret-1")
    answered = error_for_status(status, json.dumps({"error": {"message": "no sk-secret-1"}}), {}, url=url, model="m",
                                key=key)
    with pytest.raises(GatewayError) as in_stream:
        StreamDecoder("m", url=url, key=key).feed(json.dumps({"error": {"message": "no sk-secret-1", "code": status}}))
    assert type(in_stream.value) is type(answered) and in_stream.value.code == answered.code
    assert (in_stream.value.retryable, in_stream.value.fallback_ok) == (answered.retryable, answered.fallback_ok)
    assert in_stream.value.refuses_load == answered.refuses_load == (status in (429, 503))
    for error in (answered, in_stream.value):
        assert url in str(error) and "sk-secret-1" not in str(error)
        if status in (401, 403):
            assert "MY_UPSTREAM_KEY" in str(error)


@pytest.mark.parametrize("chunk, kind, code", [
    # TGI: the error is a string, its kind in error_type beside it
    ({"error": "Input validation error: `max_new_tokens` must be <= 2048", "error_type": "validation"},
     "BadUpstreamRequest", grpc.StatusCode.INVALID_ARGUMENT),
    ({"error": "Model is overloaded", "error_type": "overloaded"}, "UpstreamRateLimited",
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    ({"error": "CUDA error", "error_type": "generation"}, "UpstreamStreamError", grpc.StatusCode.UNAVAILABLE),
])
def test_tgis_in_stream_error_is_classified_by_its_error_type(chunk, kind, code):
    with pytest.raises(GatewayError) as caught:
        StreamDecoder("m").feed(json.dumps(chunk))
    assert type(caught.value).__name__ == kind and caught.value.code == code


def test_what_follows_done_is_not_read():
    decoder = StreamDecoder("m")
    events = decoder.feed(chunk({"content": "hi"}, "stop"))
    assert decoder.feed("[DONE]") == [] and decoder.feed("{garbage") == [] and decoder.feed('{"error": "x"}') == []
    assert events + decoder.end() == [Token("hi"), Finished("stop", None, "m")]


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 3, "completion_tokens": 2**40, "total_tokens": 2**40 + 3},  # past int32
    {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": "x"},
    {"prompt_tokens": -5, "completion_tokens": 2, "total_tokens": -3},
    {"prompt_tokens": 3.5, "completion_tokens": 1},
    {"prompt_tokens": True, "completion_tokens": 1},
    '{"prompt_tokens": NaN, "completion_tokens": Infinity, "total_tokens": 1}',  # parsers here accept these
])
def test_a_usage_that_is_no_count_is_taken_as_no_usage(usage):
    """The dispatcher then counts the tokens itself, as for a server that sends none; nothing fails."""
    decoder = StreamDecoder("m")
    if isinstance(usage, str):  # as the server wrote it: not JSON that json.dumps would write
        decoder.feed(chunk({"content": "hi"}, "stop")[:-1] + f', "usage": {usage}}}')
    else:
        decoder.feed(chunk({"content": "hi"}, "stop", usage=usage))
    assert decoder.end() == [Finished("stop", None, "m")]


def test_a_usage_with_null_counts_reads_them_as_zero_and_totals_itself():
    decoder = StreamDecoder("m")
    decoder.feed(chunk({"content": "hi"}, "stop", usage={"prompt_tokens": 4, "completion_tokens": 1,
                                                          "total_tokens": None}))
    assert decoder.end() == [Finished("stop", Usage(4, 1, 5), "m")]


def test_live_request_ids_hand_out_each_id_once_while_its_call_is_in_flight():
    from switchyard.common.request_ids import LiveRequestIds

    ids = LiveRequestIds()
    assert [ids.claim("bench-001:0") for _ in range(3)] == ["bench-001:0", "bench-001:0~1", "bench-001:0~2"]
    ids.release("bench-001:0")
    assert ids.claim("bench-001:0") == "bench-001:0"  # free again once its call ended
    assert ids.claim("bench-001:0") == "bench-001:0~3"  # the repeats count on: never an id handed out before
    assert ids.claim("") == ids.claim("") == ""  # no id: nothing held


@pytest.mark.parametrize("raw, meant", [
    ("stop", "stop"), ("length", "length"), ("tool_calls", "tool_calls"), ("content_filter", "content_filter"),
    ("function_call", "tool_calls"),  # OpenAI's former name
    ("eos_token", "stop"), ("stop_sequence", "stop"),  # TGI's own FinishReason
    ("eos", "stop"),  # Together AI's
    ("end_turn", "stop"), ("max_tokens", "length"), ("tool_use", "tool_calls"),  # Anthropic's, through a gateway
    ("model_length", "length"), ("STOP", "stop"),  # Mistral's; a server writing it in capitals
    ("refusal", "content_filter"), ("model_context_window_exceeded", "length"),  # Anthropic's other two ends
    ("guardrail_intervened", "content_filter"), ("content_filtered", "content_filter"),  # Bedrock's Converse
])
def test_a_finish_reason_is_read_as_the_one_of_openais_it_means(raw, meant):
    decoder = StreamDecoder("m")
    events = decoder.feed(chunk({"content": "hi"}, raw)) + decoder.end()
    assert events[-1].finish_reason == meant


@pytest.mark.parametrize("raw, says", [
    ("abort", "aborted the request"), ("error", "failed inside the server"), ("repetition", "kept repeating"),
    ("insufficient_system_resource", "for want of capacity"),  # DeepSeek's API
    ("cancelled", "cannot be told finished"), (7, "cannot be told finished"),
])
def test_a_finish_reason_of_an_answer_that_did_not_finish_is_an_error_naming_it(raw, says):
    """vLLM ends an aborted request with finish_reason 'abort' (and 'error', 'repetition'): it read as stop, so an
    answer cut by the server looked finished. Any word the gateway does not know is not taken for a finish."""
    decoder = StreamDecoder("m", url="http://u/v1/chat/completions")
    assert decoder.feed(chunk({"content": "The capital"})) == [Token("The capital")]
    with pytest.raises(StreamBroken) as caught:
        decoder.feed(chunk({}, raw))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.retryable
    assert f"finish_reason {str(raw)!r}" in str(caught.value) and says in str(caught.value)
    assert "http://u/v1/chat/completions" in str(caught.value) and decoder.ending == "error"


def test_a_stream_of_no_choice_whose_usage_counts_tokens_is_still_an_error_naming_them():
    """No choice but an empty answer's usage is an empty answer; tokens counted and never sent are lost ones."""
    decoder = StreamDecoder("m")
    decoder.feed(json.dumps({"model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}))
    decoder.feed("[DONE]")
    with pytest.raises(StreamProtocolError, match="reading choices.*counted 4 completion token"):
        decoder.end()


def test_reasoning_is_read_from_either_field_once_and_kept_apart_from_the_answer():
    """A delta carrying the thinking in both fields (a server between the two names) is one text; a surrogate pair
    split across reasoning deltas waits for its half as content's does, each field its own."""
    decoder = StreamDecoder("m")
    events = []
    for delta in [{"reasoning_content": "Think", "reasoning": "Think"}, {"reasoning": " \ud83d"},
                  {"content": "Ans\ud83d"}, {"reasoning": "\ude00"}, {"content": "\ude00"}]:
        events += decoder.feed(json.dumps({"model": "m", "choices": [{"index": 0, "delta": delta}]}))
    events += decoder.feed(chunk({}, "stop")) + decoder.end()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "Think \U0001f600"
    assert "".join(e.text for e in events if isinstance(e, Token)) == "Ans\U0001f600"


def test_a_fault_takes_a_word_where_it_names_one():
    assert parse_fault("finish=abort,reasoning=2") == Fault(finish="abort", reasoning=2)
    assert parse_fault("stream_type=application/x-ndjson") == Fault(stream_type="application/x-ndjson")
    with pytest.raises(ValueError, match="finish=<a word>"):
        parse_fault("finish")


@pytest.mark.parametrize(("spec", "says"), [
    ("stream_type=", "fault 'stream_type=': expected stream_type=<a word>, got ''"),
    ("finish= ", "fault 'finish=': expected finish=<a word>, got ''"),
    ("cut_after=1.5", "fault 'cut_after=1.5': expected cut_after=<a whole number>, got '1.5'"),
    ("fail_first", "fault 'fail_first': expected fail_first=<a whole number>"),
    ("slow_ms=fast", "fault 'slow_ms=fast': expected slow_ms=<a number>, got 'fast'"),
])
def test_a_fault_value_of_the_wrong_kind_is_named_with_the_kind_its_key_takes(spec, says):
    """A word left empty (stream_type=) and a fraction for a count (cut_after=1.5) were both told
    'expected ...=<number>': a number was what the first could never take and what the second was."""
    with pytest.raises(ValueError) as caught:
        parse_fault(spec)
    assert str(caught.value) == says


def test_each_tool_call_of_an_answer_has_an_id_of_its_own():
    """The next turn answers each call by its id (``tool_call_id``): a server repeating an id, or a given
    ``call_0`` beside a call without one (which is named ``call_<place>``), had two calls under one id."""
    decoder = StreamDecoder("m")
    deltas = [{"index": 0, "id": "dup", "function": {"name": "a", "arguments": "{}"}},
              {"index": 1, "id": "dup", "function": {"name": "b", "arguments": "{}"}},
              {"index": 2, "function": {"name": "c", "arguments": "{}"}},
              {"index": 3, "id": "call_2", "function": {"name": "d", "arguments": "{}"}}]
    for delta in deltas:
        decoder.feed(chunk({"tool_calls": [delta]}))
    calls = [e for e in decoder.feed(chunk({}, "tool_calls")) if isinstance(e, ToolCallOut)]
    assert [(c.call_id, c.name) for c in calls] == [("dup", "a"), ("dup_1", "b"), ("call_2", "c"), ("call_2_3", "d")]
