"""Decode OpenAI chat-completion chunks and bodies into gateway events.

Stream shape (OpenAI API reference, "The chat completion chunk object"): each
``data:`` payload is a JSON object with ``choices[].delta`` holding ``content``
text or ``tool_calls`` deltas (``index``, then ``id``/``function.name`` once and
``function.arguments`` in pieces), ``choices[].finish_reason`` once, an optional
last chunk with ``choices: []`` and ``usage`` (``stream_options.include_usage``),
then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from switchyard.gateway.errors import StreamBroken, StreamProtocolError, snippet
from switchyard.gateway.sse import DONE
from switchyard.gateway.events import Completion, Finished, StreamEvent, Token, ToolCallOut, Usage


@dataclass
class _PartialCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ToolCallAssembler:
    """Collects tool-call deltas by ``index`` into complete calls."""

    def __init__(self) -> None:
        self._calls: dict[int, _PartialCall] = {}

    def add(self, delta: dict[str, Any]) -> None:
        """Merge one ``tool_calls[]`` delta. Raises StreamProtocolError when it is not an object."""
        if not isinstance(delta, dict):
            raise StreamProtocolError(f"tool_calls delta is not an object: received {snippet(json.dumps(delta))}")
        index = delta.get("index", len(self._calls))
        call = self._calls.setdefault(int(index), _PartialCall())
        call.call_id = delta.get("id") or call.call_id
        fn = delta.get("function") or {}
        call.name = fn.get("name") or call.name
        if fn.get("arguments"):
            call.arguments.append(str(fn["arguments"]))

    def drain(self) -> list[ToolCallOut]:
        """The calls gathered so far, in index order; the assembler is empty afterwards."""
        out = [
            ToolCallOut(c.call_id or f"call_{i}", c.name, "".join(c.arguments) or "{}")
            for i, c in sorted(self._calls.items())
        ]
        self._calls.clear()
        return out


def _usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    return Usage(prompt, completion, int(raw.get("total_tokens") or prompt + completion))


def _loads(data: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise StreamProtocolError(
            f"upstream sent a {what} that is not JSON ({exc.msg} at char {exc.pos}; other gateways report "
            f"'unexpected end of JSON input'): received {snippet(data)}; the server at base_url does not "
            "speak OpenAI's format, or a proxy rewrote the response"
        ) from None
    if not isinstance(value, dict):
        raise StreamProtocolError(f"upstream sent a {what} that is not a JSON object: received {snippet(data)}")
    return value


def _upstream_error(payload: dict[str, Any], data: str) -> StreamBroken:
    err = payload.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    return StreamBroken(f"upstream sent an error inside the stream: {snippet(str(message or data))}")


class StreamDecoder:
    """Turns the ``data`` payloads of one stream into :class:`Token`, :class:`ToolCallOut`, :class:`Finished`.

    Tool calls are emitted whole, when their choice finishes (or at the end).
    :meth:`end` checks that ``[DONE]`` arrived and emits :class:`Finished`.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.chunks = 0
        self.done = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.last = ""
        self._calls = ToolCallAssembler()

    def feed(self, data: str) -> list[StreamEvent]:
        """Events carried by one ``data`` payload.

        Raises:
            StreamProtocolError: not JSON, not an object, or no ``choices`` list ("reading choices").
            StreamBroken: the chunk is an upstream error object.
        """
        if data.strip() == DONE:
            self.done = True
            return []
        self.last = data
        chunk = _loads(data, "stream chunk")
        if "error" in chunk and "choices" not in chunk:
            raise _upstream_error(chunk, data)
        self.chunks += 1
        self.model = chunk.get("model") or self.model
        self.usage = _usage(chunk.get("usage")) or self.usage
        choices = chunk.get("choices")
        if not isinstance(choices, list) or (not choices and "usage" not in chunk):
            raise StreamProtocolError(
                f"error reading choices: stream chunk {self.chunks} has no 'choices' list: received {snippet(data)}"
            )
        events: list[StreamEvent] = []
        for choice in choices[:1]:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                events.append(Token(text))
            for call in delta.get("tool_calls") or []:
                self._calls.add(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                events.extend(self._calls.drain())
        return events

    def end(self) -> list[StreamEvent]:
        """Events due when the body ended.

        Raises:
            StreamBroken: ``[DONE]`` never came.
        """
        if not self.done:
            last = f"; last chunk: {snippet(self.last)}" if self.last else ""
            raise StreamBroken(
                f"stream ended without 'data: [DONE]' after {self.chunks} chunk(s){last}; "
                "the upstream or a proxy between cut the response"
            )
        return [*self._calls.drain(), Finished(self.finish_reason, self.usage, self.model)]


def parse_completion(text: str, model: str) -> Completion:
    """A non-streamed ``chat.completion`` body.

    Raises:
        StreamProtocolError: not a JSON object, or no ``choices[0].message``.
    """
    body = _loads(text, "response body")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0].get("message"), dict):
        raise StreamProtocolError(
            f"error reading choices: response has no 'choices[0].message': received {snippet(text)}"
        )
    message = choices[0]["message"]
    assembler = ToolCallAssembler()
    for index, call in enumerate(message.get("tool_calls") or []):
        assembler.add({"index": index, **call})
    return Completion(
        text=message.get("content") or "",
        tool_calls=assembler.drain(),
        finish_reason=choices[0].get("finish_reason"),
        usage=_usage(body.get("usage")),
        model=body.get("model") or model,
    )
