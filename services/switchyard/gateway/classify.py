"""Map upstream HTTP statuses and httpx transport failures to the gateway's errors.

Every message passes through :func:`switchyard.gateway.redact.redact` so an
upstream that echoes the key cannot leak it.
"""

from __future__ import annotations

import email.utils
import html
import math
import re
import time
from typing import Any, Mapping
from urllib.parse import urljoin

import grpc
import httpx

from switchyard.common import envs, untrusted
from switchyard.common.config import UpstreamConfig
from switchyard.gateway.errors import (
    BadUpstreamRequest,
    ContextWindowExceeded,
    EndpointNotFound,
    GatewayError,
    ProxyAuthRequired,
    ProxyUnavailable,
    StreamBroken,
    UpstreamAuthError,
    UpstreamConflict,
    UpstreamGone,
    UpstreamNotImplemented,
    UpstreamQuotaExhausted,
    UpstreamRateLimited,
    UpstreamRetryLater,
    UpstreamServerError,
    UpstreamStreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    snippet,
)
from switchyard.gateway.keys import ApiKey
from switchyard.gateway.proxy import ProxyRoute
from switchyard.gateway.redact import redact

BASE_URL_KEY = "model_gateway.base_url"


def url_key(cfg: UpstreamConfig) -> str:
    """The config key (or the environment variable that overrides it) that names the upstream URLs ``cfg``
    calls, for a fix to name: ``model_gateway.pool.endpoints``, ``model_gateway.pool.dns_url``,
    ``SWITCHYARD_UPSTREAM_BASE_URL`` where it is set (it overrides ``model_gateway.base_url``), else
    ``model_gateway.base_url``."""
    if cfg.pool.endpoints:
        return "model_gateway.pool.endpoints"
    if cfg.pool.dns_url:
        return "model_gateway.pool.dns_url"
    if envs.SWITCHYARD_UPSTREAM_BASE_URL.get() is not None:
        return f"SWITCHYARD_UPSTREAM_BASE_URL (it overrides {BASE_URL_KEY})"
    return BASE_URL_KEY


def model_key(field: str) -> str:
    """The setting that names the upstream model of ``field`` (``default_model`` or ``fallback_model``), for a fix
    to name: ``SWITCHYARD_UPSTREAM_MODEL (it overrides model_gateway.default_model)`` where that variable is set
    (SWITCHYARD_UPSTREAM_FALLBACK_MODEL for the fallback: a fix in the file alone changes nothing there), else
    ``model_gateway.<field>``."""
    variable = {"default_model": envs.SWITCHYARD_UPSTREAM_MODEL,
                "fallback_model": envs.SWITCHYARD_UPSTREAM_FALLBACK_MODEL}[field]
    if envs.raw_value(variable.name):
        return f"{variable.name} (it overrides model_gateway.{field})"
    return f"model_gateway.{field}"


_EXPIRED = re.compile(r"(?i)expired")
_MODEL_WORDS = re.compile(
    r"(?i)model[_ ]not[_ ]found|\bmodel\b.*(does not exist|not found|unknown|no such)|unknown model"
    r"|server is pinned to"  # transformers serve: 400 "Server is pinned to 'X'; requested 'Y'."
)


_PAGE = re.compile(r"(?is)\A\s*(?:<!doctype\s+html|<html|<head|<body)")
_TITLE = re.compile(r"(?is)<title[^>]*>(.*?)</title>")
_TAG_OR_HIDDEN = re.compile(r"(?is)<(script|style)\b.*?</\1\s*>|<!--.*?-->|<[^>]*>")


def upstream_message(body: str) -> str:
    """What an error body says: the ``error.message`` of an OpenAI-style body (or its ``error`` text, a top-level
    ``message``, FastAPI's ``detail`` text); FastAPI's request validation list (``{"detail": [{"loc": [...], "msg":
    ...}]}``, as ``transformers serve`` and other FastAPI servers answer 422) as ``body.field: msg`` per entry,
    never its ``input`` (the request echoed back); an HTML page (a proxy's, a load balancer's) as its title, else
    its text; else the body itself."""
    try:
        payload = untrusted.loads(body)
    except ValueError:
        return _page_text(body) if _PAGE.match(body) else body.strip()
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload))
        if isinstance(err, dict):
            return str(err.get("message") or err.get("code") or err)
        if isinstance(err, list) and err and all(isinstance(e, dict) and "msg" in e for e in err):
            return "; ".join(_validation_entry(e) for e in err)
        return str(err)
    return body.strip()


def _validation_entry(entry: dict[str, Any]) -> str:
    """One entry of FastAPI's (pydantic's) validation list: ``body.messages.0.content: Field required``."""
    loc = entry.get("loc")
    where = ".".join(map(str, loc)) if isinstance(loc, list) else ""
    return f"{where}: {entry['msg']}" if where else str(entry["msg"])


def _page_text(body: str) -> str:
    """An HTML page's title (nginx's "502 Bad Gateway", Cloudflare's "... | 524: A timeout occurred"), else its
    visible text, whitespace folded, then "(an HTML page)"."""
    title = _TITLE.search(body)
    text = title.group(1) if title and title.group(1).strip() else _TAG_OR_HIDDEN.sub(" ", body)
    return f"{' '.join(html.unescape(text).split())} (an HTML page)"


def upstream_error_type(body: str) -> str:
    """The ``error.type`` of an OpenAI-style error body; "" when it has none."""
    try:
        payload = untrusted.loads(body)
    except ValueError:
        return ""
    err = payload.get("error") if isinstance(payload, dict) else None
    kind = err.get("type") if isinstance(err, dict) else None
    return kind if isinstance(kind, str) else ""


KEY_REFUSED_TYPES = {
    "no_db_connection": (
        "LiteLLM's proxy runs without the database it looks up keys other than its master key in",
        "set {env} to its master key (general_settings.master_key, or LITELLM_MASTER_KEY where it runs), or "
        "connect the proxy's database for its virtual keys",
    ),
}
"""Error types a proxy refuses a key with under a status other than 401 (LiteLLM answers 400 ``no_db_connection``
to a key other than its master key while it runs without a database: ``proxy/auth/user_api_key_auth.py``), and
what each means and its fix. Read by its 400, it was the request's fault ("rejected, not retried"), the key never
named."""


def key_refused_as(status: int | None, body: str) -> tuple[str, str] | None:
    """What a refusal of the key under a 400 (:data:`KEY_REFUSED_TYPES`) means and its fix (``{env}`` for the key's
    variable); None for any other answer."""
    return KEY_REFUSED_TYPES.get(upstream_error_type(body)) if status == 400 else None


def is_model_not_found(status: int, body: str) -> bool:
    """True for a 404 (or 400/422, as some servers answer) whose body says the model is unknown."""
    return status in (400, 404, 422) and bool(_MODEL_WORDS.search(body))


RELAYED_HEADER_PREFIXES = ("", "llm_provider-")
"""Where a wait is named: under its own name (the server's, or the proxy's own), else under the prefix of a proxy
that relays the headers of the server behind it only under a prefix of its own. LiteLLM's proxy answers a 429 or
503 with the provider's (or its router's) ``retry-after`` as ``llm_provider-retry-after`` and no ``Retry-After``
(``litellm_core_utils/core_helpers.py``): read under its own name only, the wait was lost."""


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the upstream asked to wait, from ``retry-after-ms`` or ``Retry-After``; None when it did not say.

    ``Retry-After`` is delta-seconds or an HTTP-date (RFC 9110, section 10.2.3);
    ``retry-after-ms`` (milliseconds) is what OpenAI and Azure OpenAI send
    beside it. ``now`` is the wall clock (``time.time()``) for an HTTP-date.
    Each is read under its own name first, then as a proxy relays it (:data:`RELAYED_HEADER_PREFIXES`).
    """
    for prefix in RELAYED_HEADER_PREFIXES:
        wait = _wait_named(headers, prefix, now)
        if wait is not None:
            return wait
    return None


def _wait_named(headers: Mapping[str, str], prefix: str, now: float | None) -> float | None:
    """The wait ``prefix + "retry-after-ms"`` or ``prefix + "retry-after"`` names; None when neither does (a
    number that is not finite, ``inf`` or ``1e999``, says none: read, it closed the model's calls and froze its
    endpoint's limit steps for ever)."""
    raw_ms = headers.get(f"{prefix}retry-after-ms")
    if raw_ms and (wait_ms := _finite(raw_ms)) is not None:
        return max(0.0, wait_ms / 1000)
    raw = (headers.get(f"{prefix}retry-after") or "").strip()
    if not raw:
        return None
    if (wait := _finite(raw)) is not None:
        return max(0.0, wait)
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _finite(text: str) -> float | None:
    """``text`` as a finite number; None when it is none (not a number, NaN, an infinity)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


_NO_QUOTA = re.compile(r"(?i)insufficient_quota|exceeded your current quota|insufficient (balance|credit)")
"""A 429 that is no rate limit but an account out of credit: OpenAI's ``insufficient_quota`` ("You exceeded your
current quota, please check your plan and billing details": its API reference, "Error codes"), in the words a
provider answering 402 uses too (DeepSeek's "Insufficient Balance", OpenRouter's "insufficient credits")."""

OVERLOADED_STATUSES = frozenset({503, 529})
"""The HTTP statuses, besides 429, of a server refusing a call for its load: 503 Service Unavailable (vLLM, TGI, an
ingress with no free replica) and 529, Anthropic's ``overloaded_error`` (its API, and the OpenAI-compatible
gateways in front of it that pass the status on)."""


_TOO_LONG = re.compile(
    r"(?i)context_length_exceeded|context ?window ?exceeded|exceed_context_size|maximum context length"
    r"|longer than the (maximum model length|model's context length)|exceeds the available context size"
    r"|prompt is too long|tokens \+ `?max_new_tokens`? must be <="
    r"|the model's context length is only \d+|cannot be greater than max_model_len"
    r"|too long to fit into the model \(context length|maximum prompt length is \d+"
    r"|exceeds the maximum number of tokens allowed|exceed context limit"
    r"|when context the overflows|tokens to keep from the initial prompt is greater than the context length"
    r"|current length is \d+ while limit is \d+"
)
"""A server's words for a request that does not fit the model's context window: OpenAI's and vLLM's "This model's
maximum context length is N tokens" (``context_length_exceeded``), vLLM's "The decoder prompt (length N) is
longer than the maximum model length of M", SGLang's "longer than the model's context length", llama.cpp's
"exceeds the available context size" (``exceed_context_size_error``; Ollama relays it), TGI's "`inputs` tokens +
`max_new_tokens` must be <= N", Anthropic's "prompt is too long", and LiteLLM's ``ContextWindowExceededError``;
and:

- vLLM's renderer (``vllm/renderers/params.py``, ``TokenizeParams``): "You passed N input tokens and requested O
  output tokens. However, the model's context length is only M tokens, resulting in a maximum input length of K
  tokens" (its ``_token_len_check``; "... is only M, resulting in ... of K" before it named the unit), the same
  in "input characters" for a prompt refused before it is tokenized (``_text_len_check``), and "max_tokens=O
  cannot be greater than max_model_len=M" (``max_tokens`` alone past the window);
- vLLM's check of a multimodal prompt: "The prompt (total length N) is too long to fit into the model (context
  length M)" (vLLM issue 12165; its ``test_context_length_too_short``);
- xAI's API: "This model's maximum prompt length is M but the request contains N tokens." (cline issue 3120,
  Grok 3);
- the Gemini API: "The input token count (N) exceeds the maximum number of tokens allowed (M)." (400
  ``INVALID_ARGUMENT``; google-gemini/gemini-cli issues 4118 and 6678);
- Anthropic's "input length and `max_tokens` exceed context limit: N + O > M, decrease input length or
  `max_tokens` and try again" (docker/docker-agent issue 569, continuedev/continue issue 6080);
- LM Studio's "Trying to keep the first N tokens when context the overflows. However, the model is loaded with
  context length of only M tokens" and "The number of tokens to keep from the initial prompt is greater than the
  context length" (lmstudio-ai/lmstudio-bug-tracker issues 546 and 2205);
- Cerebras's "Please reduce the length of the messages or completion. Current length is N while limit is M" (cline
  issue 5140).

Groq's words ("Please reduce the length of the messages or completion.") come with OpenAI's
``context_length_exceeded`` code, DeepSeek's and OpenRouter's ("This endpoint's maximum context length is M
tokens") with OpenAI's "maximum context length"."""


def too_long_for_context(body: str) -> bool:
    """``body`` (an error body or message) says the request does not fit the model's context window."""
    return bool(_TOO_LONG.search(body))


_REQUESTED_BESIDE_COMPLETION = re.compile(
    r"requested (\d+) tokens \(\d+ in the messages, [^)]*?\b(\d+) in the completion\)")
"""vLLM 0.x's and the OpenAI API's "you requested T tokens (N in the messages, [F in the functions, and ]C in the
completion)": the prompt is T - C, the messages and the functions (tools) both, as a usage counts it; N is only
the messages' part of it."""

_REQUESTED_ABOUT = re.compile(r"requested about \d+ tokens \(([^)]*)\)")
_INPUT_PART = re.compile(r"(\d+) of (?:text|tool) input")
"""OpenRouter's "However, you requested about T tokens (N of text input[, F of tool input][, C in the output])"
(Aider-AI/aider issue 3721, boldsoftware/shelley issue 159, topoteretes/cognee issue 1061): the prompt is the text
and the tool input, not the output asked for."""

_PROMPT_COUNTS = (
    re.compile(r"requested (\d+) tokens in the messages"),  # vLLM 0.x, a prompt past the window alone
    re.compile(r"your request has (\d+) input tokens"),  # vLLM: "'max_tokens' ... is too large: ... and your request has N"
    # vLLM since its renderer's length check: "you requested O output tokens and your prompt contains N input
    # tokens"; its "contains at least N" is no count (the prompt tokenized only to past the window): not read
    re.compile(r"your prompt contains (\d+) input tokens"),
    # vLLM's renderer (TokenizeParams._token_len_check): "You passed N input tokens and requested O output tokens";
    # its "N input characters" (refused before tokenizing) is no count of tokens: not read
    re.compile(r"You passed (\d+) input tokens"),
    re.compile(r"The prompt \(total length (\d+)\) is too long to fit"),  # vLLM, a multimodal prompt
    # the OpenAI API; with functions (tools) "T tokens (N in the messages, F in the functions)": the prompt is T
    re.compile(r"your messages resulted in (\d+) tokens"),
    re.compile(r"decoder prompt \(length (\d+)\)"),  # vLLM's V1 engine
    re.compile(r"The input \((\d+) tokens\)"),  # SGLang: "The input (N tokens) is longer than the model's context length"
    # SGLang, the prompt fitting alone: "You requested a total of T tokens: N tokens from the input messages and M ..."
    re.compile(r"(\d+) tokens from the input messages"),
    re.compile(r"Given: (\d+) `?inputs`? tokens"),  # TGI: "Given: N `inputs` tokens and M `max_new_tokens`"
    # Mistral's API: "Prompt contains N tokens and 0 draft tokens, too large for model with M maximum context length"
    re.compile(r"Prompt contains (\d+) tokens and \d+ draft tokens"),
    re.compile(r"prompt is too long: (\d+) tokens"),  # Anthropic: "prompt is too long: N tokens > M maximum"
    # Anthropic, the prompt fitting alone: "input length and `max_tokens` exceed context limit: N + O > M"
    re.compile(r"exceed context limit: (\d+) \+ \d+ >"),
    re.compile(r"the request contains (\d+) tokens"),  # xAI: "... prompt length is M but the request contains N tokens"
    re.compile(r"The input token count \((\d+)\) exceeds"),  # the Gemini API
    re.compile(r'"n_prompt_tokens"\s*:\s*(\d+)'),  # llama.cpp's exceed_context_size_error: n_prompt_tokens, n_ctx
    # llama.cpp's message, as Ollama relays it without the fields: "request (N tokens) exceeds the available context
    # size (M tokens)"
    re.compile(r"request \((\d+) tokens\) exceeds the available context size"),
)
"""Where a server's refusal of a prompt too long for the context window says how many tokens it counted the
prompt (its tokenizer's, chat template included), in the words of each server :data:`_TOO_LONG` names. LM
Studio's "Trying to keep the first N tokens" counts the tokens it keeps, and Cerebras's "Current length is N" the
request with its completion, neither the prompt: not read."""


def server_prompt_tokens(body: str) -> int | None:
    """The prompt tokens a server counted, as its refusal of a request too long for the context window says
    (:data:`_REQUESTED_BESIDE_COMPLETION`, :data:`_REQUESTED_ABOUT`, :data:`_PROMPT_COUNTS`): the whole prompt,
    its functions (tools) included where the words count them apart from the messages; None where they do not
    say (a proxy's words, LiteLLM's, a count of characters)."""
    if (found := _REQUESTED_BESIDE_COMPLETION.search(body)) is not None:
        return int(found.group(1)) - int(found.group(2))
    if (found := _REQUESTED_ABOUT.search(body)) is not None and (parts := _INPUT_PART.findall(found.group(1))):
        return sum(map(int, parts))
    for pattern in _PROMPT_COUNTS:
        if (found := pattern.search(body)) is not None:
            return int(found.group(1))
    return None


def wrong_root(root: str, body: str, url_source: str) -> str:
    """What to do about a base URL ``root`` (named in the message before this) under which the server answered 404 (or 405) where an
    OpenAI-compatible server serves ``/models`` or ``/chat/completions``; ``body``: what it answered,
    ``url_source``: what set the URL (:func:`url_key`).

    Switchyard's own HTTP face answering (its JSON error, ``origin`` orchestrator) is named as such: TGI and
    llama.cpp's server listen on 8080 by default, as the face does. A root ending in ``/v1`` already is told
    the server there serves no OpenAI-compatible API under it; another root, to end in ``/v1``."""
    example = "e.g. http://127.0.0.1:8000/v1"
    try:
        payload = untrusted.loads(body)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("origin") == "orchestrator" and "code" in error:
        return (f"{url_source} is Switchyard's own HTTP face (an orchestrator's orchestrator.http.port), "
                f"not a model server: set it to the model server's OpenAI-compatible root, {example}")
    if root.rstrip("/").endswith("/v1"):
        return (f"{url_source} ends in /v1 already, but the server there serves no OpenAI-compatible API under it: "
                f"set it to the root the model server gives OpenAI clients ({example}; Ollama's "
                "http://127.0.0.1:11434/v1), or check that a model server, not another service, listens there")
    return f"{url_source} must be the OpenAI-compatible root ending in /v1, {example}"


def _root_of(url: str) -> str:
    """The base URL of a call to ``url`` (its ``/chat/completions`` or ``/models`` taken off)."""
    for tail in ("/chat/completions", "/completions", "/models"):
        if url.endswith(tail):
            return url[: -len(tail)]
    return url


def error_for_status(
    status: int | None, body: str, headers: Mapping[str, str], *, url: str, model: str, key: ApiKey,
    in_stream: bool = False, url_source: str = BASE_URL_KEY,
) -> GatewayError:
    """The error for an upstream's answer of ``status``: the one table of the gateway's errors by HTTP status.

    A non-2xx answer (``in_stream`` false) is classified here, other than an unknown model (see
    :func:`is_model_not_found`). An error object inside a 200 stream (``in_stream`` true; ``status`` from
    :func:`switchyard.gateway.decode.stream_error_status`, None where the chunk says none) is the same
    answer as its status would be, but for two rows: a 404 there is the request's (its model, say), not
    the endpoint's, and a 5xx other than 503 and 529 (:data:`OVERLOADED_STATUSES`), a 408 or an unknown status
    is a broken stream (retried before the first token); a 503 or 529 there refuses load as an answered one does.
    Every message names ``url`` where it is known (with a pool of replicas, which one answered) and
    never shows the key; a 404 names ``url_source`` (:func:`url_key`), what set the URL.

    The rows: 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, a 400 of :data:`KEY_REFUSED_TYPES` UNAUTHENTICATED (the key); 402, and OpenAI's 429 ``insufficient_quota``,
    FAILED_PRECONDITION (the account: :class:`UpstreamQuotaExhausted`); 404 and 405 NOT_FOUND (the base URL);
    407 UNAUTHENTICATED (the proxy); 409 ABORTED, 421 and 425 UNAVAILABLE (retried); 410 NOT_FOUND; 429
    RESOURCE_EXHAUSTED (a rate limit: refuses load); 501 UNIMPLEMENTED; 408, 424 and 5xx UNAVAILABLE (the
    server's, retried; 503 and 529 refuse load); any other 4xx INVALID_ARGUMENT (the request's own fault, not
    retried and no fallback). A request too long for the model's context window (:func:`too_long_for_context`) is
    INVALID_ARGUMENT under any of the statuses a server or proxy fails it with (no status, 400, 408, 413, 422, 424,
    a 5xx other than 501, 503 and 529): LiteLLM's proxy relays vLLM's in-stream 400 for it as "code": "500".
    """
    if status is not None and 300 <= status < 400 and not in_stream:
        return redirect_error(status, headers, url=url, url_source=url_source)
    said = redact(upstream_message(body), key.value)
    quoted = snippet(said)
    if in_stream:
        # the URL ends the phrase: a caller reads it as "the model server" (orchestrator/addresses.py), and "upstream
        # the model server sent ..." read as a slip
        where = f"upstream error inside the stream from {url}" if url else "upstream error inside the stream"
        head = f"{where}{f' (status {status})' if status else ''}: {quoted}"
    else:
        head = f"upstream {status} from {url} (upstream said {quoted})"
    refused_or_failed = status is None or status in (400, 408, 413, 422, 424) or (
        status >= 500 and status not in (501, *OVERLOADED_STATUSES))
    if refused_or_failed and too_long_for_context(body):
        # the request's own fault whatever status it came with: LiteLLM's proxy relays every error inside a stream
        # as "code": "500" (a broken stream, retried and sent to the fallback model); a 5xx proxy page says so too
        return ContextWindowExceeded(
            f"{head}: the request does not fit model {model!r}'s context window; shorten the prompt or lower "
            "max_tokens; not retried", server_prompt_tokens(body), model
        )
    if in_stream and (status is None or status == 408 or (status >= 500 and status not in OVERLOADED_STATUSES)):
        return UpstreamStreamError(head)
    refused_key = key_refused_as(status, body)
    if refused_key:
        meaning, fix = refused_key
        return UpstreamAuthError(f"{head}: {meaning}, and refused the key from {key.describe()}; "
                                 f"{fix.format(env=key.env)}")
    if status in (401, 403):
        challenge = headers.get("www-authenticate", "")
        if _EXPIRED.search(said) or _EXPIRED.search(challenge):
            return UpstreamAuthError(
                f"{head}: the OAuth token has expired; re-authenticate to get a fresh token, or use an API key in "
                f"{key.env}"
            )
        if key.value:
            what = "rejected the key" if status == 401 else "refused access with the key"
            detail = f"it {what} from {key.describe()}; check that {key.env} holds a valid key for this base URL and " \
                     f"model {model!r}"
        else:  # no key was sent (model_gateway.api_key_required false): the server wants one
            detail = (f"it refused a call sent without a key; it wants one: export {key.env}=<its key> "
                      "(model_gateway.api_key_env)")
        auth = UpstreamAuthError(f"{head}: {detail}")
        if status == 403:  # a known key without the right: gRPC's own mapping of HTTP 403
            auth.code = grpc.StatusCode.PERMISSION_DENIED
        return auth
    # Each status by what it says (RFC 9110, section 15, unless named): only the request's own fault is
    # INVALID_ARGUMENT, which blames the caller; the account's, the set-up's and the server's are told apart.
    if status == 402 or (status == 429 and _NO_QUOTA.search(body)):
        # 402 Payment Required (section 15.5.3, reserved; DeepSeek and OpenRouter answer it for an account out of
        # credit), and OpenAI's 429 insufficient_quota: a top-up fixes it, not a retry, nor a slower rate
        whose = f"the key from {key.describe()}" if key.value else "the account this server bills"
        return UpstreamQuotaExhausted(
            f"{head}: the account behind {whose} has no credit or quota left for model {model!r}; add credit or "
            f"raise its spending limit with the provider, or use another key in {key.env}; not retried"
        )
    if status == 407:  # Proxy Authentication Required (section 15.5.8): the proxy's, not the server's
        return ProxyAuthRequired(
            f"{head}: a proxy between here and the model server wants credentials; put them in the proxy "
            "variable's URL (HTTPS_PROXY or HTTP_PROXY=http://user:password@host:port), or add the host to NO_PROXY"
        )
    if status in (404, 405) and not in_stream:  # 405 Method Not Allowed (15.5.6): that URL takes no POST
        said_how = "" if status == 404 else ": the server there takes no POST at this path"
        return EndpointNotFound(f"{head}{said_how}; {wrong_root(_root_of(url), body, url_source)}")
    if status == 409:  # Conflict (15.5.10): the request met the server's state; gRPC's ABORTED, retried
        return UpstreamConflict(
            f"{head}: the request conflicts with a state of the server (a request id it still holds?); retried "
            "under a request id of its own"
        )
    if status in (421, 425):
        # 421 Misdirected Request (15.5.20: the client MAY retry over a different connection); 425 Too Early
        # (RFC 8470, section 5.2: sent in TLS early data, to be retried once the handshake is complete)
        why = "over another connection" if status == 421 else "once the connection's TLS handshake is complete"
        return UpstreamRetryLater(f"{head}: the server asks for the request again, {why}; retried")
    if status == 410:  # Gone (15.5.11): for good, a retired model or route
        return UpstreamGone(f"{head}: what the request for model {model!r} named is gone for good (a retired "
                            "model?); not retried")
    if status == 501:  # Not Implemented (15.6.2): the server lacks what the request needs
        return UpstreamNotImplemented(
            f"{head}: the server does not implement what the request for model {model!r} needs (a feature it "
            "serves only when started with it?); not retried"
        )
    retry_after = retry_after_s(headers)
    if status == 429:
        wait = f"; it asked to retry after {retry_after:g} s" if retry_after is not None else ""
        error: GatewayError = UpstreamRateLimited(
            f"{head}: a rate limit for model {model!r}{wait}; the dispatcher's adaptive concurrency limit backs off; "
            "raise the key's quota or lower model_gateway.concurrency.max_limit"
        )
        error.retry_after_s = retry_after
        return error
    # the request's own fault (400, 413, 422, ...); 408 Request Timeout and 424 Failed Dependency (RFC 4918,
    # section 11.4: Azure ML online endpoints answer it when the model behind them failed) are the server's
    if status is not None and 400 <= status < 500 and status not in (408, 424):
        error = BadUpstreamRequest(f"{head}: the request for model {model!r} was rejected, not retried")
        if status == 404:  # in a stream: what the request named was not found
            error.code = grpc.StatusCode.NOT_FOUND
        return error
    if status is not None and (status >= 500 or status == 424):
        error = UpstreamServerError(f"{head}: the model server failed for model {model!r}; retry later or check its logs")
        if status in OVERLOADED_STATUSES:  # overloaded: it refuses load, and may say when to come back
            error.retry_after_s, error.refuses_load = retry_after, True
            error.overloaded_status = status
        return error
    if status == 408:  # Request Timeout (section 15.5.9): the server gave up waiting on the request; retried as a 5xx
        return UpstreamServerError(f"{head}: the server timed the request for model {model!r} out; retried")
    return UpstreamServerError(f"{head}: a status that is no known answer to a chat request; retried")


def redirected_root(location: str, url: str) -> str:
    """The root a redirect of a request for ``url`` points at: its ``location`` (resolved against ``url`` where it
    is relative) without the path ``url`` asked for below the root (``/chat/completions``, ``/models``), else
    ``location`` itself."""
    location = urljoin(url, location)
    for path in ("/chat/completions", "/models"):
        if url.endswith(path) and location.rstrip("/").endswith(path):
            return location.rstrip("/")[: -len(path)]
    return location


def redirect_error(status: int, headers: Mapping[str, str], *, url: str, url_source: str = BASE_URL_KEY) -> GatewayError:
    """The error of a redirect (3xx) answering a request for ``url``: the URL in the set-up is not where the
    server serves (an ``http://`` URL of a server that redirects to ``https://``, a path it moved); the gateway
    follows no redirect (the key would go where the set-up did not send it), and names where to point
    ``url_source`` instead. NOT_FOUND, as the base URL's other faults: not retried, no fallback. A redirect read
    as an answer failed INTERNAL "asked for a stream but it answered text/html", the new URL not named."""
    location = (headers.get("location") or "").strip()
    where = (f"redirects to {snippet(urljoin(url, location))}; set {url_source} to "
             f"{snippet(redirected_root(location, url))}"
             if location else f"redirects, naming no location; correct {url_source}")
    return EndpointNotFound(f"upstream {status} from {url}: the server {where} (redirects are not followed: the "
                            "key would go to a URL the set-up did not name)")


_NOT_TLS = re.compile(r"WRONG_VERSION_NUMBER|wrong version number|packet length too long|record layer failure")
"""OpenSSL's words for a server that answered a TLS handshake in plain text."""


def plain_http_behind_https(exc: BaseException, url: str) -> bool:
    """``url`` is https:// and the server there answered the TLS handshake in plain HTTP (a model server started
    without TLS): the fix is http://, not starting the server, which runs."""
    return url.startswith("https://") and bool(_NOT_TLS.search(str(exc)))


def error_for_transport(exc: httpx.HTTPError, *, url: str, proxy: ProxyRoute | None, key: ApiKey,
                        url_source: str = BASE_URL_KEY) -> GatewayError:
    """The error for an httpx failure (no HTTP status): proxy, connect, timeout, cut connection. ``url_source``:
    what names ``url`` in the set-up (:func:`url_key`), for the fix of a server that cannot be reached."""
    detail = redact(f"{type(exc).__name__}: {exc}".rstrip(": "), key.value)
    if isinstance(exc, httpx.ProxyError) or (
        proxy is not None and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    ):
        where = f"{proxy.variable}={proxy.address}" if proxy else "the configured proxy"
        return ProxyUnavailable(
            f"local proxy failed: {where} did not answer ({detail}) while calling {url}; start the proxy, fix "
            f"{proxy.variable if proxy else 'the proxy variable'}, or add the host to NO_PROXY"
        )
    if isinstance(exc, httpx.ConnectError) and plain_http_behind_https(exc, url):
        return UpstreamUnavailable(
            f"model gateway upstream at {url} answers plain HTTP, not TLS ({detail}); use http:// in {url_source}"
        )
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return UpstreamUnavailable(
            f"model gateway upstream unavailable at {url} ({detail}); start the model server "
            f"(e.g. `switchyard serve sim-openai`) or fix {url_source}"
        )
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)):
        return UpstreamTimeout(
            f"upstream at {url} timed out ({type(exc).__name__}); raise model_gateway."
            f"{_timeout_key(exc)} or check the model server's load"
        )
    if isinstance(exc, httpx.RemoteProtocolError) and _NOT_HTTP1_ANSWER.search(str(exc)):
        return UpstreamUnavailable(
            f"model gateway upstream at {url} answered, not in HTTP/1.1 ({detail[:160]}): something listens there "
            "that is no HTTP server (a gRPC port, such as a Switchyard service's, or another protocol's); point "
            f"{url_source} at the model server's OpenAI-compatible root"
        )
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return StreamBroken(f"connection to {url} closed mid-response ({detail}); the upstream or a proxy cut it")
    return UpstreamUnavailable(f"request to {url} failed ({detail})")


_NOT_HTTP1_ANSWER = re.compile(r"illegal request line|illegal status line|Bad status line|invalid HTTP version")
"""The HTTP parsers' words (h11 for httpx, aiohttp's) for an answer whose first line is no HTTP status line: a gRPC
server's SETTINGS frame, a Redis's error line."""


def _timeout_key(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.WriteTimeout):
        return "write_timeout_s"
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout_s (or max_connections)"
    return "read_timeout_s"
