"""Streams as the servers users run send them, replayed byte for byte from a real local HTTP server.

Each file under ``tests/data/upstream_streams/`` holds one server's response body exactly as
that server writes it (its source is named in the file's ``#`` header: vLLM, SGLang, TGI,
llama.cpp, Ollama, ``transformers serve``, the OpenAI API; hosted APIs and other servers in their own words:
OpenRouter, Together AI, DeepSeek, Groq, Gemini, LitServe; and the framings around them:
CRLF, ``: ping`` comments, ``data:`` without a space, HTTP/1.0 close-delimited bodies, cut
streams; and LiteLLM's proxy in front of them). A TCP server on 127.0.0.1 answers the gateway's
real request with the file's status line, Content-Type, ``header NAME`` lines and framing, then the body; the gateway's real client parses it,
on both HTTP transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import pathlib
from dataclasses import dataclass, field

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401
from prometheus_client import REGISTRY

from switchyard.common.priority import PriorityClass
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Finished, Reasoning, Token, ToolCallOut
from switchyard_harness.faults import Fault
from switchyard.gateway.metrics import STREAM_ENDINGS

FIXTURES = pathlib.Path(__file__).parent / "data" / "upstream_streams"


@dataclass
class Recorded:
    """One fixture: its header fields and the body bytes after the ``---`` line."""

    name: str
    meta: dict[str, str]
    body: bytes


def load(path: pathlib.Path) -> Recorded:
    raw = path.read_bytes()
    head, body = raw.split(b"---\n", 1)
    meta = {}
    for line in head.decode().splitlines():
        key, _, value = line.removeprefix("# ").partition(": ")
        meta[key] = value
    return Recorded(path.stem, meta, body)


ALL = sorted(FIXTURES.glob("*.sse"))


def _events(body: bytes) -> list[bytes]:
    """The body split after each event's blank line (LF or CRLF), as a server flushes them."""
    out, start, i = [], 0, 0
    while i < len(body):
        for sep in (b"\r\n\r\n", b"\n\n"):
            if body.startswith(sep, i):
                i += len(sep)
                out.append(body[start:i])
                start = i
                break
        else:
            i += 1
    if start < len(body):
        out.append(body[start:])
    return out


@dataclass
class Replay:
    """What the replay server saw: each request's header lines (lower-cased names) and JSON body."""

    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)


@contextlib.asynccontextmanager
async def replay_server(recorded: Recorded):
    """An HTTP server on 127.0.0.1 answering every request with ``recorded``; yields (base_url, Replay)."""
    seen = Replay()
    status = recorded.meta["status"].encode()
    framing = recorded.meta["framing"]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        except asyncio.IncompleteReadError:
            writer.close()
            return
        lines = head.split("\r\n")[1:]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        length = int(headers.get("content-length", "0"))
        seen.headers.append(headers)
        seen.bodies.append(json.loads(await reader.readexactly(length)) if length else {})
        sent = "".join(f"{key.removeprefix('header ')}: {value}\r\n" for key, value in recorded.meta.items()
                       if key.startswith("header "))
        labelled = recorded.meta["content-type"]  # "": no Content-Type header at all
        out = [status + b"\r\n" + (b"content-type: " + labelled.encode() + b"\r\n" if labelled else b"")
               + sent.encode()]
        if framing == "close":
            writer.write(out[0] + b"\r\n" + recorded.body)
        else:
            writer.write(out[0] + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            events = _events(recorded.body)
            last = events.pop() if framing == "chunked-cut" else None
            for event in events:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            if last is None:
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"%x\r\n%s" % (len(last) + 500, last))  # a chunk announced, never completed
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", seen
    finally:
        server.close()


def ending_count(ending: str) -> float:
    return REGISTRY.get_sample_value("switchyard_upstream_stream_endings_total", {"ending": ending}) or 0.0


def ask() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello"}], model="claude-sonnet-4-5",
                       priority=PriorityClass.CORE, agent_id="agent-7", request_id="req-1")


def test_the_endings_counter_starts_at_zero_for_every_ending():
    for ending in STREAM_ENDINGS:
        assert REGISTRY.get_sample_value("switchyard_upstream_stream_endings_total", {"ending": ending}) is not None


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
async def test_every_recorded_stream_is_read_as_its_server_meant_it(clean_proxy_env, path, transport):
    recorded = load(path)
    meta = recorded.meta
    ending = meta["expect-ending"]
    before = ending_count(ending)
    async with replay_server(recorded) as (base, seen):
        cfg = gateway_config(base, http_transport=transport, fallback_model="", max_retries=0)
        async with GatewayClient(cfg) as client:
            if "expect-error" in meta:
                code, _, says = meta["expect-error"].partition(" ")
                with pytest.raises(GatewayError) as caught:
                    async for _ in client.stream_chat(ask()):
                        pass
                assert caught.value.code == getattr(grpc.StatusCode, code) and says in str(caught.value)
                assert caught.value.retry_after_s == (float(meta["expect-retry-after"])
                                                      if "expect-retry-after" in meta else None)
                assert ending_count(ending) == before + (ending != "none")  # none: no stream was opened
                return
            events = [e async for e in client.stream_chat(ask())]
    text = "".join(e.text for e in events if isinstance(e, Token))
    finished = events[-1]
    assert isinstance(finished, Finished) and sum(isinstance(e, Finished) for e in events) == 1
    assert text == meta["expect-text"]
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == meta.get("expect-reasoning", "")
    assert finished.finish_reason == meta["expect-finish"]
    usage = meta["expect-usage"]
    if usage == "none":
        assert finished.usage is None
    else:
        assert finished.usage is not None
        assert [finished.usage.prompt_tokens, finished.usage.completion_tokens,
                finished.usage.total_tokens] == [int(n) for n in usage.split()]
    calls = [e for e in events if isinstance(e, ToolCallOut)]
    if "expect-tool" in meta:
        name, _, arguments = meta["expect-tool"].partition(" ")
        assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [(name, json.loads(arguments))]
    else:
        assert calls == []
    assert ending_count(ending) == before + 1
    assert seen.headers[0]["x-agent-id"] == "agent-7" and seen.headers[0]["x-priority"] == "core"


async def test_sim_openai_without_done_is_a_finished_stream_and_without_finish_a_cut_one(clean_proxy_env):
    """``--fault no_done`` (transformers serve's ending) streams the whole answer; ``no_finish`` (a clean
    close before any finish_reason) stays UNAVAILABLE, counted as cut."""
    before = ending_count("finish_reason"), ending_count("cut")
    with start_sim(faults={"*": Fault(no_done=True)}) as server:
        async with GatewayClient(gateway_config(server.base_url, fallback_model="")) as client:
            events = [e async for e in client.stream_chat(ask())]
    assert [e for e in events if isinstance(e, Token)] and events[-1].finish_reason == "stop"
    assert events[-1].usage is not None and events[-1].usage.completion_tokens > 0
    with start_sim(faults={"*": Fault(no_finish=True)}) as server:
        async with GatewayClient(gateway_config(server.base_url, fallback_model="", max_retries=0)) as client:
            with pytest.raises(GatewayError) as caught:
                async for _ in client.stream_chat(ask()):
                    pass
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and "no end marker" in str(caught.value)
    assert (ending_count("finish_reason"), ending_count("cut")) == (before[0] + 1, before[1] + 1)


def all_endings() -> float:
    return sum(ending_count(ending) for ending in STREAM_ENDINGS)


@pytest.mark.parametrize("case, ending", [
    ("silent past read_timeout_s", "timeout"),
    ("past total_timeout_s mid-stream", "timeout"),
    ("past the caller's deadline mid-stream", "cancelled"),
    ("the caller leaves mid-stream", "cancelled"),
    ("the caller leaves before the first item", "cancelled"),
])
async def test_a_stream_not_read_to_its_end_is_counted_by_why_once(clean_proxy_env, case, ending):
    """Every stream the server answered is counted once: one the gateway stopped reading (its body silent past
    ``read_timeout_s``, the call past its deadline, its caller gone) too. They were counted nowhere, so the endings
    did not add up to the streams: a server that hung mid-answer, or callers that left, did not show."""
    before, total = ending_count(ending), all_endings()
    slow_ms = 1000 if case in ("silent past read_timeout_s", "the caller leaves before the first item") else 150
    request = ask()
    if case == "past the caller's deadline mid-stream":
        request = dataclasses.replace(request, timeout_s=0.5)
    with start_sim(faults={"*": Fault(slow_ms=slow_ms)}) as server:
        cfg = gateway_config(server.base_url, fallback_model="", max_retries=0,
                             read_timeout_s=0.2 if case == "silent past read_timeout_s" else 10.0,
                             total_timeout_s=0.5 if case == "past total_timeout_s mid-stream" else 300.0)
        async with GatewayClient(cfg) as client:
            if case.startswith("the caller leaves"):
                stream = client.stream_chat(request)
                if case == "the caller leaves mid-stream":
                    assert isinstance(await anext(stream), Token)  # the stream is open and read
                    await stream.aclose()
                else:  # it gives up while the gateway waits for the first item
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.3):
                            await anext(stream)
                    await stream.aclose()
            else:
                with pytest.raises(GatewayError):
                    async for _ in client.stream_chat(request):
                        pass
    assert (ending_count(ending), all_endings()) == (before + 1, total + 1)


async def test_a_whole_completion_answering_a_stream_request_is_the_answer_not_an_error(clean_proxy_env):
    """``--fault mismatch``: sim-openai answers ``stream: true`` with its whole chat completion as JSON, as a
    server that does not stream some requests, or a caching proxy, does. Read as "not a stream" it was INTERNAL
    and sent to the fallback model; the answer is all there: its text, finish reason and usage, counted as a
    ``whole_answer`` ending, once, with nothing sent again."""
    before = ending_count("whole_answer")
    with start_sim(faults={"*": Fault(mismatch=True)}) as server:
        async with GatewayClient(gateway_config(server.base_url)) as client:
            events = [e async for e in client.stream_chat(ask())]
            # the wait was the whole answer's: not sampled as a time to first token, which brakes the limit
            limit = next(iter(client.pool.endpoints.values())).limit
            assert limit.short_s is None
        assert sum(server.state.counts.values()) == 1
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "stop" and finished.ending == "whole_answer"
    assert "".join(e.text for e in events if isinstance(e, Token)).startswith("A short answer")
    assert finished.usage is not None and finished.usage.completion_tokens > 0
    assert ending_count("whole_answer") == before + 1


N_CHOICES_STREAM = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"Hello"},'
    b'"finish_reason":null},{"index":1,"delta":{"content":"Other"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":1,"delta":{"content":'
    b'" words here"},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":'
    b'" there"},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}}\n\ndata: [DONE]\n\n')
N_CHOICES_WHOLE = (
    b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":1,"message":{"role":"assistant",'
    b'"content":"Other words here"},"finish_reason":"stop"},{"index":0,"message":{"role":"assistant",'
    b'"content":"Hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":40,'
    b'"total_tokens":52}}')


@pytest.mark.parametrize(("content_type", "body"), [("text/event-stream", N_CHOICES_STREAM),
                                                    ("application/json", N_CHOICES_WHOLE)], ids=["streamed", "whole"])
async def test_an_answer_with_n_choices_counts_the_answers_tokens_toward_the_endpoints_throughput(
        clean_proxy_env, content_type, body):
    """A server that answers with n choices (a proxy asked for them) and ignores ``stream``: its whole completion
    counted the usage's 40 tokens of every choice toward the endpoint's throughput, where the same answer streamed
    counts its answer's 2 events. Both now count the answer the request asked for."""
    recorded = Recorded("n_choices", {"status": "HTTP/1.1 200 OK", "content-type": content_type,
                                      "framing": "close"}, body)
    window = {"window_s": 60.0, "memory_s": 600.0}  # one window holds the whole answer's count
    async with replay_server(recorded) as (base, _):
        async with GatewayClient(gateway_config(base, fallback_model="", concurrency=window)) as client:
            events = [e async for e in client.stream_chat(ask())]
            limit = next(iter(client.pool.endpoints.values())).limit
            counted = limit._tokens
    assert "".join(e.text for e in events if isinstance(e, Token)) == "Hello there"
    assert events[-1].usage.completion_tokens == 40  # the server's usage, as it reported it
    assert counted == 2


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_cookie_the_server_sets_is_sent_back_on_the_next_call(clean_proxy_env, transport):
    """Both transports keep the cookies an endpoint sets (a hosted API's load balancer) and send them on its next
    call, as httpx's client does: the aiohttp path sends without the client's layers but keeps its jar."""
    recorded = load(FIXTURES / "transformers_serve.sse")
    seen: list[dict[str, str]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])
                   if k}
        if not head.startswith("POST "):  # the gateway's read of the server's /metrics (its queue): none here
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        seen.append(headers)
        await reader.readexactly(int(headers.get("content-length", "0")))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nset-cookie: lb=replica-2; Path=/\r\n"
                     b"connection: close\r\n\r\n" + recorded.body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with GatewayClient(gateway_config(base, http_transport=transport, fallback_model="")) as client:
            for _ in range(2):
                events = [e async for e in client.stream_chat(ask())]
                assert isinstance(events[-1], Finished)
    finally:
        server.close()
    assert "cookie" not in seen[0]
    assert seen[1]["cookie"] == "lb=replica-2"


SSE_UTF8_BODY = (
    b'data: {"choices":[{"index":0,"delta":{"content":"h\xc3\xa9"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("content_type, body", [
    ("text/event-stream", b"\xef\xbb\xbf" + SSE_UTF8_BODY),  # one leading byte order mark: ignored
    ("text/event-stream; charset=iso-8859-1", SSE_UTF8_BODY),  # a charset other than UTF-8: still UTF-8
], ids=["bom", "latin1_charset"])
async def test_an_event_stream_is_utf8_whatever_its_charset_and_a_leading_bom_is_ignored(
        clean_proxy_env, transport, content_type, body):
    """WHATWG HTML, "Parsing an event stream": the stream is decoded as UTF-8 (a charset parameter says nothing),
    and one leading U+FEFF is ignored. Read as the header's charset, 'hé' became 'hÃ©'; with the BOM kept, the
    first line's field name was '\\ufeffdata', an unknown field, and the first chunk's text was lost."""
    recorded = Recorded("synthetic", {"status": "HTTP/1.1 200 OK", "content-type": content_type,
                                      "framing": "chunked"}, body)
    async with replay_server(recorded) as (base, _):
        async with GatewayClient(gateway_config(base, http_transport=transport, fallback_model="",
                                                max_retries=0)) as client:
            events = [e async for e in client.stream_chat(ask())]
    assert "".join(e.text for e in events if isinstance(e, Token)) == "héllo"
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"



@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("content_type", ["", "application/json", "text/plain; charset=utf-8",
                                          "application/octet-stream"], ids=["none", "json", "text", "octet"])
async def test_an_event_stream_under_another_label_is_read_as_the_stream_it_is(clean_proxy_env, transport, content_type,
                                                                                caplog):
    """The body decides, not its label: a stream request answered with events under no Content-Type (a proxy
    dropped it), ``application/json`` (Microsoft's Foundry Local), ``text/plain`` or ``application/octet-stream``
    failed INTERNAL "neither a stream nor a chat completion" quoting the very stream, which the OpenAI SDK reads
    whatever its label. It is read as the stream (a byte order mark and a comment first), and the label is kept
    on the endpoint and logged once, for ``switchyard doctor`` to name. LitServe's ``application/x-ndjson``:
    litserve_ndjson.sse."""
    body = b"\xef\xbb\xbf: keep-alive\r\n\r\n" + SSE_UTF8_BODY
    recorded = Recorded("synthetic", {"status": "HTTP/1.1 200 OK", "content-type": content_type,
                                      "framing": "chunked"}, body)
    async with replay_server(recorded) as (base, _):
        async with GatewayClient(gateway_config(base, http_transport=transport, fallback_model="",
                                                max_retries=0)) as client:
            for _ in range(2):
                events = [e async for e in client.stream_chat(ask())]
                assert "".join(e.text for e in events if isinstance(e, Token)) == "héllo"
                assert isinstance(events[-1], Finished) and events[-1].ending == "done_marker"
            assert [e.stream_label for e in client.pool.endpoints.values()] == [content_type]
    noted = [r.getMessage() for r in caplog.records if "not text/event-stream" in r.getMessage()]
    assert len(noted) == 1 and (repr(content_type) if content_type else "no Content-Type") in noted[0]


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("answer", [
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',  # an empty answer: no first item
], ids=["text", "empty"])
async def test_a_stream_ends_at_done_though_the_server_holds_the_body_open(clean_proxy_env, transport, answer):
    """``data: [DONE]`` ends the stream. The gateway read on for the body's end, so a server or proxy holding the
    response open after it failed a whole answer with a read timeout after its tokens. The body's end is still
    read (in the background), so that the connection serves the next calls."""
    release = asyncio.Event()
    posted_on: list[int] = []  # the connection each call came on

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not head.startswith(b"POST "):  # the gateway's read of the server's /metrics
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            posted_on.append(id(writer))
            body = answer + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
            await release.wait()  # the body's end only once the call has ended
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        cfg = gateway_config(base, http_transport=transport, fallback_model="", max_retries=0, read_timeout_s=5.0)
        async with GatewayClient(cfg) as client:
            for _ in range(3):
                events = [e async for e in client.stream_chat(ask())]
                release.set()
                assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"
                assert "".join(e.text for e in events if isinstance(e, Token)) == ("hi" if b"hi" in answer else "")
                while client._drains:  # the body's end, read in the background
                    await asyncio.gather(*client._drains)
                release.clear()
    finally:
        server.close()
    assert len(posted_on) == 3 and len(set(posted_on)) < 3  # a connection served a later call


async def test_a_body_held_open_after_done_is_closed_with_its_connection_not_held(clean_proxy_env, monkeypatch):
    """The rest of a body after ``[DONE]`` was read for up to read_timeout_s (60 s): against a server or proxy
    holding it open, connections no longer counted in flight piled up to max_connections. It is read for
    DRAIN_AFTER_DONE_S, then closed with its connection; the next call comes on another."""
    from switchyard.gateway import client as gateway_client
    monkeypatch.setattr(gateway_client, "DRAIN_AFTER_DONE_S", 0.05)
    never = asyncio.Event()
    posted_on: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not head.startswith(b"POST "):
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            posted_on.append(id(writer))
            body = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
            reading = asyncio.ensure_future(reader.read(1))  # the client closing the connection ends the wait
            await asyncio.wait([reading, asyncio.ensure_future(never.wait())], return_when=asyncio.FIRST_COMPLETED)
            break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        cfg = gateway_config(base, fallback_model="", max_retries=0, read_timeout_s=60.0)
        async with GatewayClient(cfg) as client:
            for _ in range(2):
                events = [e async for e in client.stream_chat(ask())]
                assert isinstance(events[-1], Finished)
                while client._drains:  # ends after DRAIN_AFTER_DONE_S, not read_timeout_s
                    await asyncio.wait_for(asyncio.gather(*client._drains), timeout=30)
    finally:
        never.set()
        server.close()
    assert len(posted_on) == 2 and len(set(posted_on)) == 2  # the held connection was closed, not kept


@pytest.mark.parametrize("body, code, says", [
    (b'{"error": {"message": "prompt is too long", "type": "invalid_request_error", "code": 400}}',
     grpc.StatusCode.INVALID_ARGUMENT, "'prompt is too long'"),
    (b"<html><body>502 Bad Gateway</body></html>\n", grpc.StatusCode.UNAVAILABLE,
     "the body held no server-sent event but '<html><body>502 Bad Gateway</body></html>'"),
    (b'{"error": {"message": "prompt is too long", "type": "invalid_request_error", "code": 400}}\n\n'
     b"data: [DONE]\n\n", grpc.StatusCode.INVALID_ARGUMENT, "'prompt is too long'"),
    (b'{"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n',
     grpc.StatusCode.INTERNAL, "the body held no server-sent event but '{\"choices\": [{\"index\": 0, \"delta\": "
     "{\"content\": \"hi\"}, \"finish_reason\": \"stop\"}]}', then 'data: [DONE]'"),
    (b'{"object": "list", "data": [{"id": "m", "object": "model"}]}', grpc.StatusCode.UNAVAILABLE,
     "the body held no server-sent event but '{\"object\": \"list\", \"data\": [{\"id\": \"m\""),
], ids=["json_error", "html", "json_error_then_done", "json_lines_then_done", "json_neither"])
async def test_an_event_stream_holding_no_event_names_what_it_held(clean_proxy_env, body, code, says):
    """A 200 labelled text/event-stream whose body is a whole JSON error (no ``data:`` line) or a proxy's page read
    as a stream cut after 0 chunks: the server's words were lost, and a prompt too long was retried as a cut.
    The JSON error is the error it carries; other text is named. With a ``data: [DONE]`` after them, such lines
    (chunks without ``data:``, a JSON error) ended an empty answer as a success: the answer was dropped. JSON
    that is neither an error nor a chat completion (a model list: a misrouted path) is named too; a whole chat
    completion under that label is the answer (whole_completion_event_stream_label.sse)."""
    recorded = Recorded("synthetic", {"status": "HTTP/1.1 200 OK", "content-type": "text/event-stream",
                                      "framing": "chunked"}, body)
    async with replay_server(recorded) as (base, seen):
        async with GatewayClient(gateway_config(base, fallback_model="", max_retries=0)) as client:
            with pytest.raises(GatewayError) as caught:
                async for _ in client.stream_chat(ask()):
                    pass
    assert caught.value.code == code and says in str(caught.value), str(caught.value)
