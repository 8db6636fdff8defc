"""Decode OpenAI chat-completion chunks and bodies into gateway events.

Stream shape (OpenAI API reference, "The chat completion chunk object"): each
``data:`` payload is a JSON object with ``choices[].delta`` holding ``content``
text or ``tool_calls`` deltas (``index``, then ``id``/``function.name`` once and
``function.arguments`` in pieces), ``choices[].finish_reason`` once, an optional
last chunk with ``choices: []`` and ``usage`` (``stream_options.include_usage``),
then ``data: [DONE]``.

How a stream ends (:attr:`StreamDecoder.ending`): ``data: [DONE]`` (``done_marker``),
or, with no marker, a body that ends cleanly after a choice carried its
``finish_reason`` (``finish_reason``): Hugging Face's ``transformers serve`` sends
no ``[DONE]``, and the OpenAI Python SDK accepts a stream that simply ends. A body
that ends before any ``finish_reason`` and without the marker was cut (NoEndMarker, a StreamBroken).
The streams of vLLM, SGLang, TGI, llama.cpp, Ollama, ``transformers serve`` and the
OpenAI API, and of hosted APIs and servers whose words differ (OpenRouter, Together AI, DeepSeek, Groq, Gemini,
LitServe), are kept byte for byte under ``tests/data/upstream_streams/``, each naming its source.

Shapes seen in the wild that are decoded too (each is a test case):

- a chunk whose choices are not in index order, or that carries another choice beside the answer's: the answer is
  the choice of ``index`` 0 wherever it sits (one with no ``index`` is 0), in a chunk and in a whole completion
  (:func:`answer_choice`; read as ``choices[0]``, another choice's text and finish were the answer's);
- chunks with ``choices: []`` or no ``choices`` at all and no usage (Azure's
  ``prompt_filter_results`` preamble): no events; a stream none of whose chunks
  carries a choice is an error ("reading choices"), unless its usage counts no completion token (an empty
  answer, sent as the usage chunk alone: no finish_reason, which the dispatcher reads as stop);
- tool calls whose ``index`` repeats with a new ``id`` (Ollama sends every call
  as index 0), or whose ``index`` is missing: a new id starts a new call, or with no id a new function name;
- the OpenAI API's former ``delta.function_call`` (``name``, then ``arguments`` in pieces; ``finish_reason``
  ``function_call``): one tool call (read as the finish alone, its call was dropped);
- ``function.arguments`` as a JSON string in pieces, or whole as a JSON object;
- ``content: null`` (llama.cpp's role chunk), ``delta: null``, a role-only first chunk,
  the last content in the finish chunk (TGI, Ollama), ``usage`` in the finish chunk
  (``transformers serve``, llama.cpp), in its choice (Moonshot's Kimi API: ``choices[0].usage``; read only
  beside it, the server's counts were lost for estimates), in Groq's ``x_groq.usage`` of the finish chunk, or in a
  usage-only chunk after it, or nowhere;
  an ``id`` that changes (TGI's usage chunk has ``id: ""``) and a ``model`` other than the
  requested one: neither is checked;
- no stream at all but the whole chat completion (``choices[].message``), as ``application/json`` or under any
  other label, ``text/event-stream`` included (no ``data:`` line: the body decides, not its label): a server that
  ignores ``stream`` for some requests, or a caching proxy (:meth:`StreamDecoder.whole_answer`, ending
  ``whole_answer``); or that whole completion as the one ``data:`` event of a stream (its choice's ``message``
  read where a chunk has ``delta``; read as an empty delta, the answer was dropped and an empty one finished),
  but not a ``message`` in a stream's later chunk, beside ``delta`` or without it (some servers end a stream with
  the answer so far as ``message``): that is the streamed text again, not more of it;
- an error inside a 200 stream as an object with ``error`` (vLLM, OpenAI; OpenRouter's beside a choice finishing
  ``error``, or inside that choice: :func:`carries_error`) or as an ``error`` event whose data
  is the bare error object (llama.cpp's ``error:`` field, :mod:`switchyard.gateway.sse`): classified by its status;
- a ``finish_reason`` in another server's words (TGI's ``eos_token``, Anthropic's ``end_turn``): read as the one
  of OpenAI's it means (:data:`FINISH_REASONS`); one of an answer that did not finish (vLLM's ``abort``) or one
  not known is an error naming it (:func:`finish_reason_of`);
- a refusal in ``delta.refusal`` (the OpenAI API's, with ``content: null``, when a model declines a request
  under Structured Outputs): the model's answer, read as answer text (dropped, it ended an empty ``stop`` answer
  that said nothing of why);
- a reasoning model's thinking in ``delta.reasoning_content`` or ``delta.reasoning``
  (:data:`REASONING_FIELDS`): :class:`Reasoning` events, never answer text;
- ``delta.content`` as a list of typed parts (Mistral's Magistral models: ``thinking`` parts, then ``text``
  parts; :func:`content_parts`): the text parts are answer text, the thinking parts :class:`Reasoning`
  (read as a string only, they were dropped: an empty answer finishing ``stop``);
- numbers written as floats (``"index": 0.0``, ``"prompt_tokens": 12.0``: JSON has one number type, and some
  serializers write every number so): an integral float is its integer, in a choice's and a tool call's ``index``,
  ``usage`` and an error's ``code`` (:func:`switchyard.common.untrusted.json_integer`; read as no integer, an index
  of ``0.0`` was no answer); an index that is no whole number (``0.5``, ``true``) is an error naming it;
- a character outside the BMP sent as a JSON surrogate pair split across two
  chunks (``"\\ud83d"`` then ``"\\ude00"``): the high half waits for the low one;
  a lone half becomes U+FFFD rather than failing the stream.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from switchyard.common import untrusted
from switchyard.gateway.classify import error_for_status
from switchyard.gateway.errors import GatewayError, NoEndMarker, StreamProtocolError, UpstreamStreamError, snippet
from switchyard.gateway.keys import NO_KEY, ApiKey
from switchyard.gateway.sse import DONE, ERROR_EVENT
from switchyard.gateway.events import Finished, Reasoning, StreamEvent, Token, ToolCallOut, Usage, estimated_tokens


_SURROGATE = re.compile("[\ud800-\udfff]")


def fix_surrogates(text: str) -> str:
    """``text`` with surrogate pairs joined into their characters and lone halves replaced by U+FFFD.

    JSON may escape a character outside the BMP as two ``\\uXXXX`` halves; a
    decoder that meets them in different chunks holds lone halves, which UTF-8
    (and so protobuf) cannot encode.
    """
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass
class _PartialCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ToolCallAssembler:
    """Collects tool-call deltas into complete calls, in the order they started.

    A delta belongs to the call at its ``index``, unless it carries an ``id``
    other than that call's: then it starts a new call (Ollama repeats index 0
    for every call). Without an ``index`` it belongs to the call with its
    ``id``, else to the latest call, unless it names a function and the latest call has its name already: then
    it starts a new one (Gemini's OpenAI-compatible API sends each call whole with no ``index`` and an ``id`` of
    ``""``, several in one delta; read as one call, two calls were one, named by the last, its arguments two JSON
    objects run together).
    """

    def __init__(self) -> None:
        self._calls: list[_PartialCall] = []
        self._by_index: dict[int, _PartialCall] = {}

    def add(self, delta: dict[str, Any]) -> None:
        """Merge one ``tool_calls[]`` delta. Raises StreamProtocolError when it is not an object."""
        if not isinstance(delta, dict):
            raise StreamProtocolError(f"tool_calls delta is not an object: received {snippet(json.dumps(delta))}")
        call_id = str(delta.get("id") or "")
        index = _index(delta)
        fn = delta.get("function") or {}
        if not isinstance(fn, dict):
            raise StreamProtocolError(f"tool_calls delta has a 'function' that is not an object: received "
                                      f"{snippet(json.dumps(delta))}")
        if index is not None:
            call = self._by_index.get(index)
        elif call_id:
            call = next((c for c in self._calls if c.call_id == call_id), None)
        else:
            call = self._calls[-1] if self._calls else None
            if call is not None and call.name and fn.get("name"):
                call = None  # a whole call of its own, not a piece of the latest
        if call is None and not call_id and not fn:
            return  # no call and nothing of one: provider metadata alone (Gemini's extra_content thought_signature)
        if call is None or (call_id and call.call_id and call_id != call.call_id):
            call = _PartialCall()
            self._calls.append(call)
            if index is not None:
                self._by_index[index] = call
        call.call_id = call_id or call.call_id
        name = fn.get("name")
        if name is not None and not isinstance(name, str):
            raise StreamProtocolError(f"tool_calls delta has a function name that is not a string: received "
                                      f"{snippet(json.dumps(delta))}")
        call.name = name or call.name
        arguments = fn.get("arguments")
        if isinstance(arguments, (dict, list)):  # some servers send the arguments as a JSON object
            call.arguments.append(json.dumps(arguments))
        elif arguments:
            call.arguments.append(str(arguments))

    def drain(self) -> list[ToolCallOut]:
        """The calls gathered so far, in the order they started, each under an id of its own; the assembler is
        empty afterwards. A call without an id is ``call_<i>`` (its place); an id already taken in the answer (a
        server repeating one, or a given ``call_0`` beside a missing one) gets ``_<i>`` added: the next turn
        answers each call by its id (``tool_call_id``), and the OpenAI API refuses a turn whose results share
        one."""
        out: list[ToolCallOut] = []
        taken: set[str] = set()
        for i, c in enumerate(self._calls):
            call_id = c.call_id or f"call_{i}"
            while call_id in taken:
                call_id = f"{call_id}_{i}"
            taken.add(call_id)
            out.append(ToolCallOut(call_id, fix_surrogates(c.name), fix_surrogates("".join(c.arguments)) or "{}"))
        self._calls.clear()
        self._by_index.clear()
        return out


def _index(delta: dict[str, Any]) -> int | None:
    """A tool-call delta's ``index`` (:func:`untrusted.json_integer`: ``1.0`` is 1, ``"1"`` too); None when it
    carries none. Raises StreamProtocolError when it is no integer (``0.5``, ``true``, ``"first"``): read with
    ``int()``, 0.5 was call 0 and true call 1."""
    raw = delta.get("index")
    if raw is None:
        return None
    index = untrusted.json_integer(raw, digits=True)
    if index is None:
        raise StreamProtocolError(f"tool_calls delta has a non-integer index (expected a whole number): received "
                                  f"{snippet(json.dumps(delta))}")
    return index


MAX_USAGE_TOKENS = 2**31 - 1
"""The largest token count taken from an upstream's ``usage`` (the wire's int32): one past it is no count."""


def _count(raw: dict[str, Any], key: str) -> int | None:
    """``raw[key]`` as a token count: absent or null is 0; None when it is no count (not an integer, negative,
    or past :data:`MAX_USAGE_TOKENS`). ``12.0`` is 12 (:func:`untrusted.json_integer`); NaN, the infinities
    (JSON parsers here accept them), ``12.5``, ``true`` and ``"12"`` are no count."""
    value = raw.get(key)
    if value is None:
        return 0
    count = untrusted.json_integer(value)
    return count if count is not None and 0 <= count <= MAX_USAGE_TOKENS else None


def _usage(raw: Any) -> Usage | None:
    """The upstream's ``usage``, or None when it reports none or a count that is no count (a string, a negative
    or an overflowing number): the dispatcher then counts the tokens itself, as for a server sending no usage."""
    if not isinstance(raw, dict):
        return None
    prompt, completion, total = (_count(raw, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if prompt is None or completion is None or total is None:
        return None
    return Usage(prompt, completion, total or prompt + completion)


def _loads(data: str, what: str) -> dict[str, Any]:
    try:
        value = untrusted.loads(data)
    except json.JSONDecodeError as exc:
        raise StreamProtocolError(
            f"upstream sent a {what} that is not JSON ({exc.msg}: char {exc.pos}; other gateways report "
            f"'unexpected end of JSON input'): received {snippet(data)}; the server does not "
            "speak OpenAI's format, or a proxy rewrote the response"
        ) from None
    except ValueError as exc:
        raise StreamProtocolError(f"upstream sent a {what} that cannot be read ({exc}): received {snippet(data)}") from None
    if not isinstance(value, dict):
        raise StreamProtocolError(f"upstream sent a {what} that is not a JSON object: received {snippet(data)}")
    return value


_ERROR_TYPE_STATUS = {
    "badrequesterror": 400, "invalid_request_error": 400, "notfounderror": 404, "not_found_error": 404,
    "ratelimiterror": 429, "rate_limit_error": 429, "rate_limit_exceeded": 429,
    "authenticationerror": 401, "authentication_error": 401, "permissiondeniederror": 403,
    "permission_error": 403, "validation": 400, "tokenizer": 400, "overloaded": 429, "insufficient_quota": 429,
    "overloaded_error": 529, "api_error": 500, "request_too_large": 413, "billing_error": 402,
}
"""HTTP status of an in-stream error by its type where it carries no numeric ``code``: vLLM's
``BadRequestError``, OpenAI's ``invalid_request_error``, ``rate_limit_exceeded`` and ``insufficient_quota`` (its
429 of an account out of credit), Anthropic's
``rate_limit_error``, ``authentication_error``, ``overloaded_error`` (its 529: the service short of capacity, which
refuses load as an answered 529 does, not a broken stream), ``api_error`` (500), ``request_too_large`` (413) and
``billing_error`` (402) (``error.type``, its error event's ``{"type": "error", "error": {...}}``); TGI's ``validation``, ``tokenizer`` and
``overloaded`` (its ``error_type`` beside an ``error`` string; TGI answers ``overloaded`` with 429)."""


FINISH_REASONS = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter",
    "function_call": "tool_calls",
    "eos_token": "stop", "eos": "stop", "stop_sequence": "stop", "end_turn": "stop",
    "max_tokens": "length", "model_length": "length", "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter", "guardrail_intervened": "content_filter", "content_filtered": "content_filter",
}
"""An upstream's ``finish_reason`` -> the one of OpenAI's four it means (the OpenAI API reference, "The chat
completion chunk object": stop, length, tool_calls, content_filter, and the deprecated function_call, now
tool_calls). Other servers' words for the same ends: Hugging Face TGI's ``eos_token`` and ``stop_sequence``
(its own ``FinishReason``, which early releases of its OpenAI route sent as is); Together AI's ``eos`` (the model's
end-of-sequence token, sent for most of its open models where OpenAI says stop); Anthropic's ``end_turn``,
``stop_sequence``, ``max_tokens``, ``tool_use``, ``refusal`` (the model declined: its classifiers stopped it) and
``model_context_window_exceeded`` (the answer filled the context: truncated) (its ``stop_reason``, passed on by
OpenAI-compatible gateways in front of it; read as errors, they failed answers that had ended, after their
tokens); Amazon Bedrock's ``guardrail_intervened`` and ``content_filtered`` (its Converse ``stopReason``, the others
being Anthropic's words); Mistral's ``model_length`` (the model's context was reached). Anthropic's ``pause_turn``
(a turn paused, to be continued) is no end. Matched without regard to case."""

_FAILED_FINISH = {
    "abort": "the server aborted the request before it finished (vLLM and SGLang: shut down, cancelled, or its "
             "KV cache lost)",
    "error": "the request failed inside the server (vLLM's engine, Mistral's API)",
    "repetition": "the server stopped an answer that kept repeating itself (vLLM's repetition detection)",
    "insufficient_system_resource": "the server interrupted the answer for want of capacity (DeepSeek's API: its "
                                    "inference system ran short of resources); retry later or on another model",
}
"""Finish reasons of an answer that did not finish (vLLM's ``FINISH_REASON_STRINGS`` in
``vllm/v1/engine/__init__.py``: stop, length, abort, error, repetition; DeepSeek's API's
``insufficient_system_resource``): each is an error naming it."""


def finish_reason_of(raw: Any, *, url: str = "") -> str:
    """The OpenAI finish reason an upstream's ``raw`` one means (:data:`FINISH_REASONS`).

    Raises:
        UpstreamStreamError: ``raw`` says the answer did not finish (vLLM's ``abort``, ``error``,
            ``repetition``), or is none of the known words: an answer whose end is not known is not
            reported as finished (a broken stream: retried before the first item, named after it).
    """
    word = raw.lower() if isinstance(raw, str) else None
    if word in FINISH_REASONS:
        return FINISH_REASONS[word]
    where = f"upstream answer from {url}" if url else "upstream answer"  # a caller reads the URL "the model server"
    if word in _FAILED_FINISH:
        why = _FAILED_FINISH[word]
    else:
        why = ("none of OpenAI's (stop, length, tool_calls, content_filter) nor another server's word for one of "
               "them, so the answer cannot be told finished; report it to have it mapped")
    raise UpstreamStreamError(f"{where} ended with finish_reason {snippet(str(raw))}: {why}")


def carries_error(payload: dict[str, Any]) -> bool:
    """Whether a chunk (or a whole body) is an upstream's error object: it has ``error`` and no ``choices`` (vLLM's,
    OpenAI's, LiteLLM's ``{"error": {...}}``), or an ``error`` beside its ``choices`` that is not empty (nor null,
    false or 0): OpenRouter sends an error after tokens as a chunk of the stream with ``error`` at its top level
    and one choice whose ``finish_reason`` is ``error`` (its API reference, "Streaming": "Handling errors during
    streaming"). Read by its choice, the upstream's words were lost: an answer that failed "inside the server"
    with no word of what failed."""
    return ("error" in payload and "choices" not in payload) or bool(payload.get("error"))


def stream_error_status(payload: dict[str, Any]) -> int | None:
    """The HTTP status an in-stream error chunk stands for: its ``error.code`` when that is one (vLLM sends
    ``{"error": {"message", "type": "BadRequestError", "code": 400}}``), else its type (``error.type``, or TGI's
    ``error_type`` beside ``"error": "<text>"``); None when it says neither (OpenAI's ``server_error`` with
    ``code: null``)."""
    err = payload.get("error")
    code, kind = (err.get("code"), err.get("type")) if isinstance(err, dict) else (None, payload.get("error_type"))
    status = untrusted.json_integer(code, digits=True)  # 429, 429.0 and "429" alike; true is none
    if status is not None and 400 <= status <= 599:
        return status
    return _ERROR_TYPE_STATUS.get(kind.lower()) if isinstance(kind, str) else None


def _index_of(choice: dict[str, Any]) -> int | None:
    """A choice's ``index``: 0 when it carries none (a server that sends one choice may leave it out); an integral
    float is its integer (``0.0`` is 0: JSON has one number type, and some servers' serializers write floats) and a
    string of digits too (``"0"``: some proxies quote it), :func:`untrusted.json_integer`; None when it is no
    integer (``0.5``, ``true``, ``"first"``)."""
    raw = choice.get("index", 0)
    if type(raw) is int:  # noqa: E721 - the index almost every chunk carries (a bool is an int, and no index)
        return raw
    return 0 if raw is None else untrusted.json_integer(raw, digits=True)


def answer_choice(choices: list[Any], where: str, data: str) -> dict[str, Any] | None:
    """The answer's choice among the ``choices`` of a stream chunk or of a whole completion (``where``: which, and
    ``data``: as received, both named by an error); None when none is of index 0: the one whose ``index`` is 0 (or
    that carries none, :func:`_index_of`), wherever it sits. A request asks for one choice (no ``n``), but servers
    order the choices as they like, and some send others beside it (another index's pieces, a usage-only chunk's
    ``choices: []``, the ``n`` choices a proxy asked for); read as ``choices[0]``, another choice's text was the
    answer's, and its ``finish_reason`` ended the answer. The one reader of "which choice is the answer": the
    stream decoder's chunks, its whole completion (:meth:`StreamDecoder.whole_answer`) and the benchmark's direct
    client read it here.

    Raises:
        StreamProtocolError: a choice is not an object, or its ``index`` is no integer (:func:`_index_of`; read as
            another choice, an answer whose index was ``0.5`` or ``true`` failed as "no choice of index 0")
            ("error reading choices").
    """
    answer = None
    for choice in choices:  # one pass: read for every chunk of a stream, each token's
        if not isinstance(choice, dict):
            raise StreamProtocolError(
                f"error reading choices: {where} has a choice that is not an object: received {snippet(data)}"
            )
        index = _index_of(choice)
        if index is None:
            raise StreamProtocolError(
                f"error reading choices: {where} has a choice whose 'index' is not a whole number "
                f"(received {snippet(json.dumps(choice.get('index')))}): received {snippet(data)}"
            )
        if index == 0 and answer is None:
            answer = choice
    return answer


def _whole_characters(carry: str, text: str) -> tuple[str, str]:
    """``text`` after ``carry`` (a high surrogate held from the last chunk), and the trailing high surrogate it
    holds back in turn ("" when none)."""
    text = carry + text
    if "\ud800" <= text[-1] <= "\udbff":
        return fix_surrogates(text[:-1]), text[-1]
    return fix_surrogates(text), ""


REASONING_FIELDS = ("reasoning_content", "reasoning")
"""The delta fields of a reasoning model's thinking, the first that holds text: ``reasoning_content`` (vLLM with
``--reasoning-parser``, SGLang, llama.cpp's ``--reasoning-format deepseek``, DeepSeek's API) and ``reasoning``
(vLLM since it renamed the field, Ollama, OpenRouter); a server sending both in one delta sends one text twice."""


def content_parts(content: Any) -> tuple[str, str]:
    """The answer text and the thinking a ``content`` holds: a string is text; a list of typed parts (Mistral's
    Magistral models stream ``delta.content`` as ``[{"type": "thinking", "thinking": [{"type": "text", "text":
    ...}]}]`` and ``[{"type": "text", "text": ...}]``; OpenAI's content-part shape) holds text in its ``text``
    parts and thinking in its ``thinking`` parts (a string, or a list of text parts). Other parts (an image, a
    reference) and anything else hold neither."""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return "", ""
    text: list[str] = []
    thinking: list[str] = []
    for part in content:
        if isinstance(part, str):
            text.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif isinstance(part, dict) and part.get("type") == "thinking":
            inner = part.get("thinking")
            thought, more = content_parts(inner if isinstance(inner, (str, list)) else "")
            thinking.append(thought + more)
    return "".join(text), "".join(thinking)


class StreamDecoder:
    """Turns the ``data`` payloads of one stream into :class:`Token`, :class:`Reasoning`, :class:`ToolCallOut`,
    :class:`Finished`.

    Tool calls are emitted whole, when their choice finishes (or at the end).
    :meth:`end` checks that the stream finished (``[DONE]``, or a ``finish_reason``)
    and emits :class:`Finished`.
    """

    def __init__(self, model: str, *, url: str = "", key: ApiKey = NO_KEY) -> None:
        self.model = model
        self.url = url  # named by an in-stream error's message
        self.key = key  # redacted from, and named by, an in-stream error's message
        self.chunks = 0
        self.done = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.last = ""
        self.choices_seen = 0
        self._carries = {"content": "", "reasoning": ""}  # a high surrogate waiting for its low half, per field
        self._calls = ToolCallAssembler()
        self.called = False
        """A tool call came (:meth:`_drain_calls`)."""
        self.failed = False
        """The stream carried an error object, or something that cannot be read (:attr:`ending` ``error``)."""
        self.error_data: str | None = None
        """The data of the error object the stream carried, as received; None while it carried none."""
        self.error_status: int | None = None
        """The HTTP status that error stands for (:func:`stream_error_status`; None where it names none)."""
        self.whole = False
        """The answer came as one chat completion, not a stream (:meth:`whole_answer`)."""
        self.other_choices = False
        """A choice other than the answer's came (``n`` choices, which a proxy may ask for): the server's ``usage``
        counts its tokens too, so it is not the answer's count (:meth:`answer_tokens`)."""
        self.stray = ""
        """What a body that carried no event held instead (lines that are no field of the SSE format: a whole
        JSON error, a proxy's HTML page), named by :meth:`end`; "" when none."""

    def feed(self, data: str, event: str = "") -> list[StreamEvent]:
        """Events carried by one ``data`` payload; ``event``: the SSE event's type.

        Raises:
            StreamProtocolError: not JSON, not an object, or no ``choices`` list ("reading choices").
            GatewayError: the chunk is an upstream error object (an object with ``error`` and no ``choices``, or
                any data of an ``error`` event: llama.cpp's is the bare object), classified by its status (its code
                or type, :func:`stream_error_status`) in the one table,
                :func:`switchyard.gateway.classify.error_for_status`.
        """
        try:
            return self._feed(data, event)
        except GatewayError:
            self.failed = True
            raise

    def _feed(self, data: str, event: str) -> list[StreamEvent]:
        if self.done:
            return []  # the stream ended at [DONE]: whatever a server or proxy sends after it is not read
        if data.strip() == DONE:
            self.done = True
            return []
        self.last = data
        if event == ERROR_EVENT:
            raise self._error(data)
        chunk = _loads(data, "stream chunk")
        if carries_error(chunk):
            raise self._error(data)
        return self._chunk(chunk, data)

    def _chunk(self, chunk: dict[str, Any], data: str) -> list[StreamEvent]:
        """The events of one chunk (``data``: as received, named by an error)."""
        self.chunks += 1
        if isinstance(model := chunk.get("model"), str) and model:  # a model that is no name is not taken
            self.model = model
        if isinstance(groq := chunk.get("x_groq"), dict):  # Groq's usage, in its extension of the finish chunk
            self.usage = _usage(groq.get("usage")) or self.usage
        self.usage = _usage(chunk.get("usage")) or self.usage
        choices = chunk.get("choices")
        if choices is None:
            choices = []  # a preamble (prompt_filter_results) or usage-only chunk
        if not isinstance(choices, list):
            raise StreamProtocolError(
                f"error reading choices: stream chunk {self.chunks} has 'choices' that is not a list: "
                f"received {snippet(data)}"
            )
        choice = answer_choice(choices, f"stream chunk {self.chunks}", data)
        self.other_choices = self.other_choices or len(choices) > (choice is not None)  # a choice besides it
        if choice is None:
            return []
        events: list[StreamEvent] = []
        self.choices_seen += 1
        if choice.get("error"):  # OpenRouter's schema: a choice may carry its own error object
            raise self._error(json.dumps({"error": choice["error"]}))
        if "usage" in choice:  # Moonshot (Kimi) sends its usage in the finish chunk's choice, not beside it
            self.usage = _usage(choice["usage"]) or self.usage
        delta = choice.get("delta")
        if delta is None and self.choices_seen == 1:
            # a whole completion framed as the stream's one chunk carries its choice's "message" where a chunk
            # has "delta"; a "message" after deltas is the answer so far again (some servers end a stream with
            # one), not more of it: read, the answer was sent twice
            delta = choice.get("message")
        delta = delta or {}
        if not isinstance(delta, dict):
            raise StreamProtocolError(
                f"error reading choices: stream chunk {self.chunks} has a 'delta' that is not an object: "
                f"received {snippet(data)}"
            )
        text, thinking = content_parts(delta.get("content"))
        if isinstance(refusal := delta.get("refusal"), str):  # the model's answer when it declines: its words
            text += refusal
        thought = next((t for k in REASONING_FIELDS if isinstance(t := delta.get(k), str) and t), "") + thinking
        if thought:
            thought, self._carries["reasoning"] = _whole_characters(self._carries["reasoning"], thought)
            if thought:
                events.append(Reasoning(thought))
        if text:
            text, self._carries["content"] = _whole_characters(self._carries["content"], text)
            if text:
                events.append(Token(text))
        for call in delta.get("tool_calls") or []:
            self._calls.add(call)
        if delta.get("function_call") is not None:  # the former single call (finish_reason function_call)
            self._calls.add({"function": delta["function_call"]})
        if choice.get("finish_reason"):
            self.finish_reason = finish_reason_of(choice["finish_reason"], url=self.url)
            events.extend(self._drain_calls())
        return events

    def _drain_calls(self) -> list[StreamEvent]:
        """The tool calls gathered so far; once any came, a ``stop`` finish (or none, at ``[DONE]``) is
        ``tool_calls``: Gemini's OpenAI-compatible API ends an answer that calls tools with ``stop``, as the OpenAI
        API does for a function named in ``tool_choice`` and SGLang for some models. Read as ``stop``, the calls
        went out but the answer read as finished, so a react_loop agent waiting on its tools was not parked."""
        calls = self._calls.drain()
        self.called = self.called or bool(calls)
        if self.called and self.finish_reason in (None, "stop"):
            self.finish_reason = "tool_calls"
        return list(calls)

    def whole_answer(self, body: str) -> list[StreamEvent] | None:
        """The events of a whole chat completion answering a stream request, ending with :class:`Finished`
        (:attr:`ending` ``whole_answer``); None when ``body`` is no chat completion (a JSON object whose choice of
        index 0, :func:`answer_choice`, carries a ``message`` object).

        A server that cannot stream a request (some do not for tool calls), or a caching proxy between, may
        answer ``stream: true`` with the whole completion as ``application/json`` (or under the stream's own
        label, ``text/event-stream``, with no ``data:`` line: the body decides), as it would answer without
        it (OpenAI API reference, "The chat completion object": ``choices[].message`` where a chunk has
        ``choices[].delta``). The answer is all there: it is read as one chunk whose delta is the message.
        Read as "not a stream", every such answer failed.

        Raises:
            StreamProtocolError: a choice is not an object (as in a stream's chunk).
            GatewayError: as :meth:`feed`, for the chunk the message makes.
        """
        try:
            payload = untrusted.loads(body)
        except ValueError:
            return None
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            return None
        try:
            choice = answer_choice(choices, "the whole completion", body)
            if choice is None or not isinstance(choice.get("message"), dict):
                return None
            self.whole = True
            self.last = body
            self.other_choices = len(choices) > 1
            chunk = {**payload, "choices": [{**choice, "delta": choice["message"]}]}
            return [*self._chunk(chunk, body), *self.end()]
        except GatewayError:
            self.failed = True
            raise

    def answer_tokens(self, events: Iterable[StreamEvent]) -> int:
        """The completion tokens the answer's ``events`` count toward the endpoint's throughput (its limit's
        tokens per second): the estimate of each (:func:`~switchyard.gateway.events.estimated_tokens`), as a
        stream's events count as they come; for a whole completion (:attr:`whole`), the server's ``usage`` count
        where it is the answer's alone (no other choice came, :attr:`other_choices`) and not 0. The one count of
        both: a stream with ``n`` choices counts its answer's events (the other choices' chunks carry none), and
        so does a whole completion with ``n`` choices; counted by its usage, every choice's tokens went to the
        endpoint's throughput, ``n`` times what the same answer streamed counted."""
        usage = self.usage
        if self.whole and not self.other_choices and usage is not None and usage.completion_tokens:
            return usage.completion_tokens
        return sum(estimated_tokens(e) for e in events)

    def answered_error(self, body: str, headers: Mapping[str, str] | None = None) -> GatewayError | None:
        """The error a whole non-SSE ``body`` answering a stream request carries, classified as one inside the
        stream (:meth:`feed`: by its code or type); None when it is no error object (an object with ``error``
        and no ``choices``). A server or gateway that fails a request before streaming may answer 200 with its
        JSON error body; read as "not a stream", its status (a prompt too long, a rate limit, an overload) was
        lost and every such answer was INTERNAL. ``headers``: the response's, for the wait a 429 or 503 asks
        (Retry-After)."""
        try:
            payload = untrusted.loads(body)
        except ValueError:
            return None
        if not isinstance(payload, dict) or not carries_error(payload):
            return None
        self.failed = True
        return self._error(body, headers or {})

    def _error(self, data: str, headers: Mapping[str, str] | None = None) -> GatewayError:
        """The error an in-stream error's ``data`` stands for: an object with ``error`` (OpenAI's, vLLM's), or
        the error object itself (llama.cpp's ``error:`` field), or text; classified by its status."""
        try:
            payload = untrusted.loads(data)
        except ValueError:
            payload = data
        error = payload if isinstance(payload, dict) and "error" in payload else {"error": payload}
        self.error_data, self.error_status = data, stream_error_status(error)
        return error_for_status(self.error_status, data, headers or {}, url=self.url, model=self.model, key=self.key,
                                in_stream=True)


    @property
    def _empty_answer(self) -> bool:
        """The stream carried no choice but the server's usage says it generated nothing: an empty answer, as
        legal as one whose only choice finishes with no content (a server may send no choice for it and only
        the usage chunk ``stream_options.include_usage`` asks for)."""
        return self.usage is not None and self.usage.completion_tokens == 0

    @property
    def ending(self) -> str | None:
        """How the stream ended so far: ``error`` (it carried an error object or could not be read),
        ``whole_answer`` (no stream: one whole chat completion, :meth:`whole_answer`), ``done_marker``
        (``data: [DONE]`` came), ``finish_reason`` (no marker, but a choice finished), or None (none of these: a
        body ending now was cut)."""
        if self.failed:
            return "error"
        if self.whole:
            return "whole_answer"
        if self.done:
            return "done_marker"
        return "finish_reason" if self.finish_reason else None

    def end(self) -> list[StreamEvent]:
        """Events due when the body ended cleanly.

        Raises:
            NoEndMarker: the body ended before any choice carried a ``finish_reason`` and
                without ``data: [DONE]`` (a cut stream).
            StreamProtocolError: chunks came but none carried a choice ("reading choices"), unless the server's
                usage counts no completion token: an empty answer, finished with no finish_reason; or none came,
                only lines that are no field of the format (:attr:`stray`), before ``data: [DONE]`` (read as an empty
                answer, a server's whole reply in another format was dropped).
        """
        if self.ending is None:
            last = f"; last chunk: {snippet(self.last)}" if self.last else ""
            if self.stray and not self.chunks:
                last = f"; the body held no server-sent event but {snippet(self.stray)}"
            raise NoEndMarker(
                f"stream ended before any finish_reason and without 'data: [DONE]' (no end marker) after "
                f"{self.chunks} chunk(s){last}; the upstream or a proxy between cut the response"
            )
        if self.done and self.stray and not self.chunks:
            self.failed = True
            raise StreamProtocolError(
                f"the body held no server-sent event but {snippet(self.stray)}, then 'data: [DONE]': no chunk of "
                "OpenAI's stream (each a 'data:' line) came, so the answer is not known; the server streams "
                "another format (lines of JSON without 'data:'), or a proxy rewrote the response"
            )
        if self.chunks and not self.choices_seen and not self._empty_answer:
            self.failed = True
            counted = (f"; the server counted {self.usage.completion_tokens} completion token(s) that none carried"
                       if self.usage is not None else "")
            raise StreamProtocolError(
                f"error reading choices: none of the {self.chunks} stream chunk(s) carried a choice of index 0 (the answer's){counted}: "
                f"last received {snippet(self.last)}"
            )
        carried = self._carries
        tail: list[StreamEvent] = [Reasoning(fix_surrogates(carried["reasoning"]))] if carried["reasoning"] else []
        tail += [Token(fix_surrogates(carried["content"]))] if carried["content"] else []
        self._carries = {"content": "", "reasoning": ""}
        return [*tail, *self._drain_calls(), Finished(self.finish_reason, self.usage, self.model, self.ending)]
