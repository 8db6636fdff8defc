"""``switchyard doctor``: check the model gateway's three-piece set-up and print a fix for each failure.

Checks, in order: proxy variables (each set proxy accepts a TCP connection;
every NO_PROXY entry parses);
the API key (present, non-empty, no whitespace); the base URL (``GET /models``
answers, and accepts the key; one answering 404 or 405 there, a server with no model list such as TGI before
2.3, is still probed, and passes with a warning if the probe streams); the model ids (default, fallback and every
``model_map`` target, plus ``--model`` names, are listed by ``/models``; the
nearest listed id is suggested); the default model's context window, which every prompt plus
``max_tokens`` is checked against, and where it comes from (``limits.context_window_tokens``, the
server's ``max_model_len``, or ``limits.default_context_window_tokens`` where the server reports none:
``transformers serve``, TGI, llama.cpp and Ollama report none); with ``server.tls`` on, the certificates of
the addresses the stack dials (:func:`certificate_checks`); the server's flavour
(``model_gateway.server``, or what ``/models`` says); then, unless ``--no-probe``, one
streamed one-token completion of the default model, sent as the engine sends it
(priority class normal, so a forwarded priority field goes too, with the value 1 on either
polarity: vLLM without ``--scheduling-policy priority`` takes 0 only, CORE's on its scale). The probe names what is
wrong: a missing end marker (the stream ended before any ``finish_reason`` and without
``data: [DONE]``: cut), a connection closed before the answer ended, an error the server
sent inside the stream, a request field the server refused (400/422 naming it; the
gateway drops it, but what it carried is lost), an unknown model with the ids the server
serves; a stream the server labels other than ``text/event-stream`` (served: the body decides) is a warning
naming the label. After a probe that streamed, one more one-token request offers a tool, as every
react_loop call does: a server that refuses it (400/422: vLLM without
``--enable-auto-tool-choice``, llama.cpp's server without ``--jinja``) is a warning, since
every react_loop task then fails INVALID_ARGUMENT while chat and rag_answer are served.
With a pool of replicas (``model_gateway.pool.endpoints``), the base URL, model,
server and probe checks run against each endpoint (named in brackets), as the
gateway calls them; ``pool.dns_url`` is checked as one base URL.
Exit code 0 when every check passes, 1 otherwise, 2 on a bad config. With a
dispatcher engine other than ``openai`` (the shipped ``sim``) and no
``--base-url``, the stack calls no model server: the gateway checks still run
and print, as what ``SWITCHYARD_ENGINE=openai`` would meet, but only the
certificate checks decide the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import dataclass, replace
from typing import Any, Iterable

import httpx
from pydantic import ValidationError

from switchyard.common.priority import PriorityClass
from switchyard.common import tls_check
from switchyard.common.config import ConfigError, RequestLimitsConfig, SwitchyardConfig, UpstreamConfig, load_config
from switchyard.common.config.limits import DEFAULT_WINDOW_SOURCE
from switchyard.gateway.servers import listed_ids, reported_context_window
from switchyard.gateway import models as model_names
from switchyard.gateway.classify import (
    key_refused_as,
    model_key,
    plain_http_behind_https,
    redirected_root,
    upstream_message,
    url_key,
    wrong_root,
)
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import (
    BadUpstreamRequest,
    GatewayError,
    ModelNotFound,
    NoEndMarker,
    StreamBroken,
    UpstreamStreamError,
    UpstreamTimeout,
    snippet,
)
from switchyard.gateway.events import ChatRequest, Finished
from switchyard.gateway.keys import ApiKey, load_api_key
from switchyard.gateway.proxy import ProxyRoute, client_settings, configured_proxies, no_proxy, proxy_for
from switchyard.gateway.redact import redact
from switchyard.gateway.transport import get_whole
from switchyard.common.cli_text import parser_for
from switchyard.common.untrusted import terminal_safe


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, whether it passed, what was seen, and the fix.

    ``skipped``: the check was asked for but not run (``detail`` says why); it neither
    passes nor fails on its own, the check that stopped it does. ``warning``: it passes (the exit code is
    not its to decide) but names what will fail later, with its fix: a ``model_map`` alias whose target the
    server does not list fails only the requests that name the alias.
    """

    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False
    warning: bool = False
    no_model_list: bool = False
    """A base url check only: ``GET /models`` answered 404 (or 405), so the stream probe decides whether the URL is
    a model server's root that serves no model list (TGI before 2.3, some gateways) or a wrong one."""


async def _proxy_answers(route: ProxyRoute, timeout_s: float) -> Check:
    host, port = route.host_port()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        reason = type(exc).__name__ if isinstance(exc, asyncio.TimeoutError) else (exc.strerror or str(exc))
        return Check(
            f"proxy {route.variable}", False, f"{route.variable}={route.address} does not answer ({reason})",
            f"start the proxy at {route.address}, correct {route.variable}, unset it (unset {route.variable} "
            f"{route.variable.lower()}), or add the model host to NO_PROXY",
        )
    writer.close()
    return Check(f"proxy {route.variable}", True, f"{route.variable}={route.address} accepts connections")


def no_proxy_check() -> Check | None:
    """A failed check naming the NO_PROXY entries that cannot be parsed (they are skipped), or None."""
    parsed = no_proxy()
    if not parsed.invalid:
        return None
    return Check(
        parsed.variable, False,
        f"{len(parsed.invalid)} entr{'y' if len(parsed.invalid) == 1 else 'ies'} skipped, cannot be parsed: "
        + ", ".join(repr(e) for e in parsed.invalid),
        "write each entry as a host name (example.com, .example.com), an IP address (10.0.0.1, ::1, "
        "[::1]:8080) or a CIDR block (10.0.0.0/8, fd00::/8)",
    )


def _key_check(key: ApiKey, required: bool) -> Check:
    problem = key.problem()
    if problem is None:
        return Check("api key", True, f"{key.describe()} is set")
    if not key.present and not required:
        return Check("api key", True, f"{key.env} not set; allowed because model_gateway.api_key_required is false")
    return Check("api key", False, key.describe(), problem)


async def _list_models(cfg: UpstreamConfig, key: ApiKey, timeout_s: float,
                       url_key: str = "model_gateway.base_url") -> tuple[Check, list[str] | None, Any]:
    """The base url check, the model ids ``GET /models`` lists (None: not read) and its parsed body (None)."""
    url = f"{cfg.base_url}/models"
    headers = {"accept": "application/json"}
    if key.present and not key.has_whitespace:
        headers["authorization"] = f"Bearer {key.value}"
    route = proxy_for(url)
    via = f" via {route.variable}={route.address}" if route else ""
    try:
        async with httpx.AsyncClient(timeout=timeout_s, **client_settings(url)) as http:
            # the whole answer: httpx's timeout bounds each read; a server sending a byte at a time hung it
            response = await get_whole(http, url, timeout_s, "--timeout", headers=headers)
    except httpx.HTTPError as exc:
        where = f"{url_key}{' in queue.json' if url_key.startswith('model_gateway.') else ''}"
        fix = f"start the model server (e.g. `switchyard serve sim-openai --port <port>`) or correct {where}"
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            # connected (or was sending): something listens there and did not answer in time
            return Check("base url", False, f"{url}{via} took the connection but sent no answer within "
                         f"{timeout_s:g} s ({type(exc).__name__})",
                         f"the server there is hung or overloaded: check its logs, or raise --timeout; else correct "
                         f"{where}"), None, None
        if route:
            fix = (
                f"the request went through {route.variable}={route.address}: start that proxy or add the host "
                f"to NO_PROXY; else {fix}"
            )
        elif isinstance(exc, httpx.RemoteProtocolError):  # connected, and what came back was no HTTP/1.1 answer
            return Check("base url", False, f"{url} does not answer ({type(exc).__name__}: {exc})",
                         "something listens there but does not answer HTTP/1.1 (a gRPC port, such as a Switchyard "
                         f"service's, or another protocol's): correct {where} to the model server's "
                         "OpenAI-compatible root"), None, None
        elif plain_http_behind_https(exc, url):
            return Check("base url", False, f"{url} answers plain HTTP, not TLS ({type(exc).__name__}: {exc})",
                         f"the server there answers plain HTTP, not TLS: use http:// in {where}"), None, None
        return Check("base url", False, f"{url}{via} does not answer ({type(exc).__name__}: {exc})", fix), None, None
    said = snippet(redact(upstream_message(response.text), key.value))
    refused_key = key_refused_as(response.status_code, response.text)
    if response.status_code in (401, 403) or refused_key:
        return Check(
            "base url", False, f"{url} answers but refuses the key: {response.status_code} {said}"
            f"{f' ({refused_key[0]})' if refused_key else ''}",
            refused_key[1].format(env=key.env) if refused_key else
            f"check that {key.env} holds a valid key for this server; re-authenticate if it is an OAuth token",
        ), None, None
    if 300 <= response.status_code < 400:
        location = response.headers.get("location", "")
        return Check(
            "base url", False, f"{url} answers {response.status_code}, a redirect to {snippet(location) or 'nowhere'}",
            f"set {url_key} to {snippet(redirected_root(location, url))} (redirects are not followed: the key would go "
            "to a URL the set-up did not name)" if location else f"correct {url_key}",
        ), None, None
    if response.status_code in (404, 405):
        return Check(
            "base url", False, f"{url} answers {response.status_code}: {said}",
            wrong_root(cfg.base_url, response.text, url_key),
            no_model_list=True,
        ), None, None
    if response.status_code >= 400:
        return Check("base url", False, f"{url} answers {response.status_code}: {said}",
                     "check the model server's logs"), None, None
    try:
        body = response.json()
        ids = listed_ids(body)
    except ValueError:
        return Check("base url", False, f"{url} answers, but not with OpenAI's model list: {said}",
                     f"point {url_key} at an OpenAI-compatible /v1 root"), None, None
    return Check("base url", True, f"{url}{via} answers; {len(ids)} model(s) listed"), ids, body


def _window_check(cfg: UpstreamConfig, limits: RequestLimitsConfig, models_body: Any) -> Check:
    """The default model's context window and its source, as the dispatcher takes it
    (:meth:`RequestLimitsConfig.context_window`). A server that reports none was checked against the 8,192-token
    default unsaid: ``transformers serve`` then generated a tiny Llama's answer of 8,000 tokens past its 4,096
    positions without an error. Informational (it passes): the default may be the model's window."""
    model = model_names.resolve(cfg.default_model, cfg.model_map, cfg.default_model)
    window = limits.context_window(model, reported_context_window(models_body, model))
    detail = f"{model}: {window.tokens} tokens ({window.source}); a prompt plus max_tokens past it is refused"
    if window.source == DEFAULT_WINDOW_SOURCE:
        detail += ("; the server reports no window for it (max_model_len in GET /models): if the model's is "
                   "another, list it in limits.context_window_tokens in switchyard.json (a Hugging Face model's "
                   "is max_position_embeddings in its config.json)")
    return Check("context window", True, detail)


def _model_checks(cfg: UpstreamConfig, known: list[str], extra: Iterable[str]) -> list[Check]:
    wanted: dict[str, str] = {}
    wanted[model_names.resolve(cfg.default_model, cfg.model_map, cfg.default_model)] = "default_model"
    if cfg.fallback_model:
        wanted.setdefault(model_names.resolve(cfg.fallback_model, cfg.model_map, cfg.default_model), "fallback_model")
    for name, target in cfg.model_map.items():
        wanted.setdefault(target, f"model_map[{name!r}]")
    for name in extra:
        wanted.setdefault(model_names.resolve(name, cfg.model_map, cfg.default_model), f"--model {name}")
    checks = []
    for model, source in wanted.items():
        if model_names.listed(model, known):
            checks.append(Check(f"model {model}", True, f"{source}: listed by /models"))
            continue
        near = model_names.nearest(model, known)
        setting = model_key(source) if source in ("default_model", "fallback_model") else source
        fix = f"use {near!r} (in the request, {setting} or model_gateway.model_map)" if near else (
            f"pick one of: {', '.join(known[:10])}" if known else
            f"the server lists no model: load {model!r} into it (Ollama: `ollama pull {model}`), or name one it serves")
        if source == "fallback_model":  # a server of one model has no other to fall back on
            fix += ", or no fallback: model_gateway.fallback_model \"\" (SWITCHYARD_UPSTREAM_FALLBACK_MODEL=none)"
        if source.startswith("model_map["):  # only the requests naming the alias fail: a warning
            alias = source.removeprefix("model_map[").removesuffix("]")
            checks.append(Check(f"model {model}", True, f"{source}: {model!r} is not listed by /models; a request "
                                f"naming {alias} will be NOT_FOUND", f"{fix}, or remove the alias",
                                warning=True))
            continue
        checks.append(Check(f"model {model}", False, f"{source}: {model!r} is not listed by /models", fix))
    return checks


_FIELD_FIXES = {
    "priority": "set model_gateway.forward_priority to false, or model_gateway.server to this server's flavour "
                "(transformers, tgi, llama_cpp, ollama, openai send none); only vLLM and SGLang order by priority, "
                "vLLM when started with --scheduling-policy priority",
    "stream_options": "set model_gateway.include_usage to false; token counts then come from the streamed items",
}


_PROBE_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
"""The tool the tools probe offers, in the shape the openai engine sends a react_loop's tools."""

_TOOLS_FIX = ("turn tool calling on in the server (vLLM: --enable-auto-tool-choice --tool-call-parser <the model's "
              "parser>; llama.cpp server: --jinja), or send no react_loop tasks to this model")


_LABEL_FIX = ("have the server, or the proxy in front of it, send Content-Type: text/event-stream with a streamed "
              "answer (LitServe's OpenAI spec did from its fix of application/x-ndjson; a proxy: pass the server's "
              "header on)")


async def _tools_check(client: GatewayClient) -> Check:
    """One one-token request offering a tool without ``tool_choice``, as the engine sends every react_loop call:
    refused for its body (400/422, BadUpstreamRequest) is a warning naming what react_loop tasks will meet."""
    request = ChatRequest(messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=1,
                          tools=[_PROBE_TOOL], priority=PriorityClass.CORE, request_id="switchyard-doctor-tools")
    try:
        [event async for event in client.stream_chat(request)]
    except BadUpstreamRequest as exc:
        return Check("tools", True, f"the server refused a request offering a tool: {exc}; every react_loop task "
                                    "(its calls offer its tools) will fail INVALID_ARGUMENT, chat and rag_answer "
                                    "are served", _TOOLS_FIX, warning=True)
    except GatewayError as exc:
        return Check("tools", True, f"not checked: a request offering a tool failed ({exc.code.name}: {exc})",
                     "see the message above", warning=True)
    return Check("tools", True, "a request offering a tool is accepted (react_loop); whether the model calls it "
                                "is the model's")


def _probe_client(cfg: UpstreamConfig, timeout_s: float) -> GatewayClient:
    """A gateway client that tries the configured model once (no fallback, no retry): what it meets is told.
    Each of its waits is bounded by ``timeout_s`` (doctor's ``--timeout``, per network check), the whole probe
    by three of them, not by the gateway's own (a minute of silence before a read times out)."""
    return GatewayClient(cfg.model_copy(update={
        "fallback_model": "", "max_retries": 0,
        "connect_timeout_s": min(cfg.connect_timeout_s, timeout_s), "read_timeout_s": min(cfg.read_timeout_s, timeout_s),
        "write_timeout_s": min(cfg.write_timeout_s, timeout_s), "pool_timeout_s": min(cfg.pool_timeout_s, timeout_s),
        "total_timeout_s": min(cfg.total_timeout_s, 3 * timeout_s),
    }))


async def _server_check(cfg: UpstreamConfig, timeout_s: float) -> Check:
    """The server's flavour (``model_gateway.server``, or what ``/models`` says) and the priority field it
    is sent."""
    async with _probe_client(cfg, timeout_s) as client:
        flavour = await client.server_flavour()
    how = "model_gateway.server" if cfg.server != "auto" else "detected from GET /models"
    field = f"priority sent as '{flavour.priority_field}'" if flavour.priority_field else "no priority field"
    return Check("server", True, f"{flavour.name} ({how}); {field}"
                                 f"{'' if cfg.forward_priority else ' when forward_priority is on'}")


async def _probe(cfg: UpstreamConfig, timeout_s: float) -> list[Check]:
    """The streamed one-token probe: its own check and any refused request field."""
    checks: list[Check] = []
    async with _probe_client(cfg, timeout_s) as client:
        request = ChatRequest(messages=[{"role": "user", "content": "Say ok."}], max_tokens=1,
                              priority=PriorityClass.NORMAL, request_id="switchyard-doctor")
        try:
            items = [event async for event in client.stream_chat(request)]
        except NoEndMarker as exc:
            checks.append(Check(
                "stream probe", False, f"missing end marker: {exc}",
                "the stream was cut: look for a proxy or load balancer with a short read timeout or response "
                "buffering between here and the server, and at the server's logs",
            ))
        except UpstreamStreamError as exc:
            checks.append(Check(
                "stream probe", False, f"the server failed the request inside its stream: {exc}",
                "the server answered and then reported an error for this request (X-Request-Id "
                f"{request.request_id}, {request.request_id}-2 ... for its retries): look for it in the server's logs",
            ))
        except StreamBroken as exc:
            checks.append(Check(
                "stream probe", False, f"connection cut: {exc}",
                "the server, or a proxy or load balancer between here and it, closed the connection before the "
                "answer ended: look at the server's logs (a crash or restart) and at what sits between",
            ))
        except UpstreamTimeout as exc:
            if exc.tokens_sent:  # it answered, then went silent before the answer's end
                checks.append(Check(
                    "stream probe", False, f"the server began its answer and then sent nothing for {timeout_s:g} s "
                    f"before the answer's end: {exc}",
                    "the server stalled mid-answer, or a proxy between here and it holds the rest of the stream "
                    "back (response buffering): check the server's logs and what sits between, or raise --timeout",
                ))
            else:
                checks.append(Check(
                    "stream probe", False,
                    f"the server took the request but sent no answer within {timeout_s:g} s: {exc}",
                    "the server is hung or overloaded, or slow to answer its first request (one that sizes its KV "
                    "cache then): check its logs, or raise --timeout",
                ))
        except ModelNotFound as exc:
            served = ", ".join(exc.served or []) or "(none listed)"
            checks.append(Check("stream probe", False, f"unknown model: {exc}",
                                f"set {model_key('default_model')} (or model_gateway.model_map) to one of: "
                                f"{served}"))
        except GatewayError as exc:
            checks.append(Check("stream probe", False, f"{exc.code.name}: {exc}", "see the message above"))
        else:
            finished = items[-1] if items and isinstance(items[-1], Finished) else None
            ending = {"done_marker": "ended by data: [DONE]",
                      "finish_reason": "ended after its finish_reason without data: [DONE] (a finished stream)",
                      "whole_answer": "answered with the whole completion as JSON, not a stream (the server or a "
                                      "proxy ignores stream=true: no token arrives before the last)"}.get(
                finished.ending if finished else None, "ended")
            checks.append(Check("stream probe", True, f"{cfg.default_model}: streamed {len(items)} item(s), {ending}"))
            checks.append(await _tools_check(client))
        for endpoint in client.pool.endpoints.values():
            if endpoint.stream_label is not None:
                label = f"Content-Type {endpoint.stream_label!r}" if endpoint.stream_label else "no Content-Type"
                checks.append(Check(
                    "stream content type", True,
                    f"the server labels its stream {label}, not text/event-stream; the gateway reads it as the event "
                    "stream its body is (as the OpenAI SDK does), but a client that checks the type (a browser's "
                    "EventSource, some SDKs) refuses it", _LABEL_FIX, warning=True,
                ))
        for name in sorted(client.refused_fields):
            checks.append(Check(
                f"request field {name}", False,
                f"the server refused '{name}' (400/422 naming it); the gateway drops it and resends, "
                "so what it carries is lost", _FIELD_FIXES.get(name, "stop sending it"),
            ))
    return checks


async def run_checks(
    cfg: UpstreamConfig, *, models: Iterable[str] = (), probe: bool = True, timeout_s: float = 5.0,
    url_key: str = "model_gateway.base_url", limits: RequestLimitsConfig | None = None,
) -> list[Check]:
    """Every check of the set-up, in report order (see the module docstring); ``url_key``: the config key
    that names ``cfg.base_url``, for the fixes; ``limits``: the request limits whose context window the report
    states (None: not stated)."""
    checks = [await _proxy_answers(route, timeout_s) for route in configured_proxies()]
    if skipped := no_proxy_check():
        checks.append(skipped)
    key = load_api_key(cfg.api_key_env)
    key_check = _key_check(key, cfg.api_key_required)
    checks.append(key_check)
    url_check, known, models_body = await _list_models(cfg, key, timeout_s, url_key)
    checks.append(url_check)
    if known is not None:
        checks.extend(_model_checks(cfg, known, models))
        if limits is not None:
            checks.append(_window_check(cfg, limits, models_body))
        if key_check.ok:
            checks.append(await _server_check(cfg, timeout_s))
    if probe:
        if not key_check.ok:
            checks.append(_skipped_probe("the api key check failed; fix the key first"))
        elif known is None and not url_check.no_model_list:
            checks.append(_skipped_probe("the base url check failed; the server must answer GET /models first"))
        else:
            probed = await _probe(cfg, timeout_s)
            if known is None and probed[0].ok:
                # a server with chat completions and no model list (TGI before 2.3, a gateway that lists none):
                # served, as the engine serves it, though nothing can be checked against its list
                checks[checks.index(url_check)] = Check(
                    "base url", True, f"{url_check.detail}: the server lists no models, but it streams chat "
                    "completions (the stream probe below); the model ids cannot be checked and no context window "
                    "is reported", "set limits.context_window_tokens for its model if the default is not its "
                    "window", warning=True)
            checks.extend(probed)
    return checks


async def certificate_checks(config: SwitchyardConfig, timeout_s: float = 5.0) -> list[Check]:
    """With ``server.tls`` on, one check per address the stack dials (the orchestrator at
    ``server.host``:``orchestrator.port`` for ``switchyard run``, ``orchestrator.retrieval_addr``,
    ``orchestrator.dispatcher_addr``): the certificate every service presents (``server.tls.cert_file``)
    must be issued by ``ca_file``, be valid now and hold the name dialled there (``server_name`` or the
    address's host); where something answers at the address, the certificate it presents is checked the
    same way, by a TLS handshake. Nothing with TLS off.
    """
    tls = config.server.tls
    if not tls.enabled:
        return []
    orch = config.orchestrator
    targets = (("orchestrator", f"{config.server.host}:{orch.port}"), ("retrieval", orch.retrieval_addr),
               ("dispatcher", orch.dispatcher_addr))
    checks = []
    fix = ("issue the certificate (server.tls.cert_file) for the names dialled, signed by server.tls.ca_file, or "
           "set server.tls.server_name to a name it holds")
    for service, address in targets:
        name = f"tls {service}"
        try:
            dialled = tls_check.dialled_name(address, tls)
        except ValueError as exc:
            checks.append(Check(name, False, str(exc), "give the address as host:port"))
            continue
        offline = tls_check.check_certificate_file(tls, dialled, address)
        if not offline.ok:
            checks.append(Check(name, False, offline.describe(), fix))
            continue
        live = await tls_check.check_certificate(address, tls, timeout_s)
        if live.ok:
            checks.append(Check(name, True, live.describe()))
        elif live.unreachable:
            checks.append(Check(name, True, f"{offline.describe()} (nothing answers at {address} yet: the "
                                            "certificate file was checked)"))
        else:
            checks.append(Check(name, False, live.describe(), fix))
    return checks


def _skipped_probe(why: str) -> Check:
    return Check("stream probe", True, f"skipped: {why}", skipped=True)


def endpoint_configs(cfg: UpstreamConfig) -> list[UpstreamConfig]:
    """One config per endpoint the gateway calls, each its own base URL with no pool: ``pool.endpoints``, else
    ``pool.dns_url`` (as one name), else ``base_url``."""
    urls = list(cfg.pool.endpoints) or ([cfg.pool.dns_url] if cfg.pool.dns_url else [cfg.base_url])
    alone = cfg.pool.model_copy(update={"endpoints": [], "dns_url": ""})
    return [cfg.model_copy(update={"base_url": url.rstrip("/"), "pool": alone}) for url in urls]


async def run_endpoint_checks(cfg: UpstreamConfig, *, models: Iterable[str] = (), probe: bool = True,
                              timeout_s: float = 5.0, limits: RequestLimitsConfig | None = None) -> list[Check]:
    """:func:`run_checks` against each endpoint of :func:`endpoint_configs`; with more than one, the checks of
    an endpoint are named with it in brackets and the ones that do not depend on it (proxies, key) listed once."""
    targets, key = endpoint_configs(cfg), url_key(cfg)
    if len(targets) == 1:
        return await run_checks(targets[0], models=models, probe=probe, timeout_s=timeout_s, url_key=key,
                                limits=limits)
    checks: list[Check] = []
    seen: set[tuple[str, str]] = set()
    for target in targets:
        for check in await run_checks(target, models=models, probe=probe, timeout_s=timeout_s, url_key=key,
                                      limits=limits):
            if check.name == "api key" or check.name.startswith(("proxy", "NO_PROXY", "no_proxy")):
                if (check.name, check.detail) in seen:
                    continue
                seen.add((check.name, check.detail))
            else:
                check = replace(check, name=f"{check.name} [{target.base_url}]")
            checks.append(check)
    return checks


def format_report(cfg: UpstreamConfig, checks: list[Check], unused_engine: str = "") -> str:
    """The text ``switchyard doctor`` prints: the set-up, one line per check, a fix under each failure.
    ``unused_engine``: the dispatcher's engine when it is not ``openai`` (the gateway is not in use)."""
    where = (f"endpoints {', '.join(c.base_url for c in endpoint_configs(cfg))}" if cfg.pool.endpoints or cfg.pool.dns_url
             else f"base_url {cfg.base_url}")
    lines = [
        f"model gateway: {where}, key from {cfg.api_key_env}, "
        f"default_model {cfg.default_model}, fallback_model {cfg.fallback_model or '(none)'}",
    ]
    if unused_engine:
        lines.append(f"  not in use: dispatcher.engine is {unused_engine!r}, which calls no model server; the gateway "
                     "checks below are what SWITCHYARD_ENGINE=openai would meet, and do not decide the exit code")
    width = max((len(c.name) for c in checks), default=0)
    for check in checks:
        mark = "skip" if check.skipped else "warn" if check.warning else "ok  " if check.ok else "FAIL"
        # a detail quotes what the model server answered (its model ids, its error body): never the terminal's
        lines.append(terminal_safe(f"{mark}  {check.name.ljust(width)}  {check.detail}", frozenset()))
        if (not check.ok or check.warning) and check.fix:
            lines.append(terminal_safe(f"      {' ' * width}  fix: {check.fix}", frozenset()))
    failed = sum(not c.ok for c in checks)
    skipped = sum(c.skipped for c in checks)
    warned = sum(c.warning for c in checks)
    summary = "all checks passed" if not failed else f"{failed} check(s) failed"
    summary += f", {warned} warning(s)" if warned else ""
    if unused_engine and failed:
        summary += f" (of the gateway, not in use with engine {unused_engine}: exit code 0 unless a certificate failed)"
    lines.append(summary + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def _seconds(raw: str) -> float:
    """``--timeout``: a number of seconds above 0 (0 would time every check out at once and blame the server)."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, at most 3600, got {raw!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``switchyard doctor``: 0 all good, 1 a check failed, 2 the config is invalid."""
    parser = parser_for("switchyard doctor", __doc__)
    parser.add_argument("--config-dir", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--base-url", help="check this base URL instead of model_gateway.base_url")
    parser.add_argument("--model", action="append", default=[], help="also check this model id (repeatable)")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                        help="stream a one-token completion of the default model (default: on; --no-probe skips it)")
    parser.add_argument("--timeout", type=_seconds, default=5.0, help="seconds per network check (default 5)")
    args = parser.parse_args(argv)
    try:
        full = load_config(args.config_dir)
    except (ConfigError, ValueError) as exc:
        print(f"switchyard doctor: {exc}", file=sys.stderr)
        return 2
    cfg = full.upstream
    if args.base_url:  # that one URL alone, whatever pool the config names
        try:
            cfg = UpstreamConfig.model_validate({**cfg.model_dump(), "base_url": args.base_url,
                                                 "pool": {**cfg.pool.model_dump(), "endpoints": [], "dns_url": ""}})
        except ValidationError as exc:
            reasons = "; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors(include_url=False))
            parser.error(f"--base-url: {reasons} (got {args.base_url!r})")
    unused_engine = "" if args.base_url or full.dispatcher.engine == "openai" else full.dispatcher.engine
    gateway = asyncio.run(run_endpoint_checks(cfg, models=args.model, probe=args.probe, timeout_s=args.timeout,
                                              limits=full.limits))
    certificates = asyncio.run(certificate_checks(full, args.timeout))
    print(format_report(cfg, gateway + certificates, unused_engine))
    return 0 if all(c.ok for c in (certificates if unused_engine else gateway + certificates)) else 1
