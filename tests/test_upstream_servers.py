"""Server flavours: the priority in each server's own field and polarity, refused fields dropped,
and X-Agent-Id / X-Priority on every upstream request, against sim-openai recording what it got."""

from __future__ import annotations

import asyncio
import logging
from typing import get_args

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.common.config.model_gateway import UpstreamConfig
from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2
from switchyard.gateway import servers
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Finished, Token
from switchyard_harness.faults import Fault


def ask(priority: str, agent: str = "agent-1", request_id: str = "r-1", tenant: str = "") -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello"}], priority=PriorityClass[priority.upper()],
                       agent_id=agent, request_id=request_id, tenant_id=tenant)


async def stream(client: GatewayClient, request: ChatRequest) -> list:
    return [e async for e in client.stream_chat(request)]


# --------------------------------------------------------------------------- priority field and polarity


@pytest.mark.parametrize(("owned_by", "server", "polarity", "expected"), [
    ("vllm", "auto", "server_default", {"core": 0, "normal": 1, "batch": 2}),  # vLLM: lower first
    ("sglang", "auto", "server_default", {"core": 2, "normal": 1, "batch": 0}),  # SGLang: higher first
    ("sglang", "auto", "lower_first", {"core": 0, "normal": 1, "batch": 2}),  # --schedule-low-priority-values-first
    ("switchyard-sim", "sglang", "server_default", {"core": 2, "normal": 1, "batch": 0}),  # named, not detected
    ("switchyard-sim", "auto", "server_default", {"core": 0, "normal": 1, "batch": 2}),  # unknown: vLLM's field
])
async def test_the_priority_goes_in_the_servers_field_with_its_polarity(clean_proxy_env, owned_by, server, polarity,
                                                                         expected):
    with start_sim(owned_by=owned_by) as sim:
        cfg = gateway_config(sim.base_url, forward_priority=True, server=server, priority_polarity=polarity)
        async with GatewayClient(cfg) as client:
            for cls in expected:
                await stream(client, ask(cls))
    assert [body["priority"] for body in sim.state.requests] == list(expected.values())


@pytest.mark.parametrize("server", ["tgi", "llama_cpp", "transformers", "ollama", "openai"])
async def test_servers_without_a_priority_get_no_priority_field(clean_proxy_env, server):
    with start_sim() as sim:
        async with GatewayClient(gateway_config(sim.base_url, forward_priority=True, server=server)) as client:
            await stream(client, ask("core"))
    assert "priority" not in sim.state.requests[0]
    assert sim.state.headers[0]["x-priority"] == "core"  # the header still carries it


def test_every_server_the_config_accepts_has_its_flavour() -> None:
    """``model_gateway.server`` is checked against the config's list, and the gateway looks the name up in
    ``FLAVOURS``: a name in one list only is a KeyError at the first request (a third copy of the names, in
    ``servers``, had gone out of use)."""
    accepted = set(get_args(UpstreamConfig.model_fields["server"].annotation))
    assert accepted - {"auto"} == set(servers.FLAVOURS) - {"unknown"}


@pytest.mark.parametrize(("body", "headers", "flavour"), [
    ({"data": [{"id": "m", "owned_by": "vllm"}]}, {}, "vllm"),
    ({"data": [{"id": "m", "owned_by": "sglang"}]}, {}, "sglang"),
    ({"data": [{"id": "m", "owned_by": "llamacpp", "meta": {"n_ctx_train": 4096}}]}, {}, "llama_cpp"),
    ({"data": [{"id": "qwen2.5:7b", "owned_by": "library"}]}, {}, "ollama"),
    ({"data": [{"id": "gpt-4o-mini", "owned_by": "system"}]}, {}, "openai"),
    ({"data": [{"id": "/m", "owned_by": "local", "status": {"value": "loaded"}}]}, {"server": "uvicorn"},
     "transformers"),
    ({"data": [{"id": "tgi", "owned_by": "meta-llama/Llama-3.1-8B"}]}, {"server": "text-generation-inference"}, "tgi"),
    ({"data": [{"id": "m", "owned_by": "acme"}]}, {"server": "nginx"}, "unknown"),
])
def test_the_flavour_is_read_from_the_model_list_and_the_server_header(body, headers, flavour):
    assert servers.detect(body, headers) == flavour


# --------------------------------------------------------------------------- refused fields


async def test_a_refused_field_is_dropped_logged_once_and_the_request_retried_without_it(clean_proxy_env, caplog):
    """transformers serve answers 422 "Unexpected fields in the request: {'priority'}": the request is sent
    again without the field (no token had streamed), and later requests never carry it."""
    caplog.set_level(logging.WARNING, logger="switchyard.gateway.client")
    with start_sim(refuse_fields=frozenset({"priority"})) as sim:
        async with GatewayClient(gateway_config(sim.base_url, forward_priority=True, max_retries=0,
                                                fallback_model="")) as client:
            first = await stream(client, ask("core"))
            second = await stream(client, ask("batch"))
            assert client.refused_fields == {"priority"}
    assert any(isinstance(e, Token) for e in first) and any(isinstance(e, Token) for e in second)
    assert ["priority" in body for body in sim.state.requests] == [True, False, False]
    assert [h["x-request-id"] for h in sim.state.headers] == ["r-1", "r-1-2", "r-1"]  # the resend is an attempt
    refusals = [r for r in caplog.records if "refused the request field 'priority'" in r.getMessage()]
    assert len(refusals) == 1 and "forward_priority" in refusals[0].getMessage()


async def test_a_field_refused_to_calls_in_flight_together_is_logged_once(clean_proxy_env, caplog):
    """Six first calls at once each carry the field and are each refused: one warning, not one per call."""
    caplog.set_level(logging.WARNING, logger="switchyard.gateway.client")
    with start_sim(refuse_fields=frozenset({"priority"})) as sim:
        async with GatewayClient(gateway_config(sim.base_url, forward_priority=True, max_retries=0,
                                                fallback_model="")) as client:
            results = await asyncio.gather(*(stream(client, ask("core", request_id=f"r{i}")) for i in range(6)))
    assert all(isinstance(events[-1], Finished) for events in results)
    assert sum("priority" in body for body in sim.state.requests) >= 2, "the calls were in flight together"
    refusals = [r for r in caplog.records if "refused the request field 'priority'" in r.getMessage()]
    assert len(refusals) == 1


async def test_vllm_without_priority_scheduling_drops_the_priority_and_serves_every_class(clean_proxy_env, caplog):
    """vLLM started without --scheduling-policy priority takes priority 0 and answers any other with one error
    inside its stream ("Got priority 1 but Priority scheduling is not enabled.", code 400): with
    forward_priority on, every NORMAL and BATCH task failed INVALID_ARGUMENT (CORE is 0 on vLLM's scale, and
    so was doctor's probe). The refusal drops the field for the endpoint, as an answered one does."""
    caplog.set_level(logging.WARNING, logger="switchyard.gateway.client")
    with start_sim(owned_by="vllm", priority_scheduling=False) as sim:
        async with GatewayClient(gateway_config(sim.base_url, forward_priority=True, max_retries=0,
                                                fallback_model="")) as client:
            results = [await stream(client, ask(cls, request_id=f"r-{cls}")) for cls in ("core", "batch", "normal")]
            assert client.refused_fields == {"priority"}
    assert all(any(isinstance(e, Token) for e in events) and isinstance(events[-1], Finished) for events in results)
    assert [body.get("priority") for body in sim.state.requests] == [0, 2, None, None]
    refusals = [r.getMessage() for r in caplog.records if "refused the request field 'priority'" in r.getMessage()]
    assert len(refusals) == 1 and "--scheduling-policy priority" in refusals[0], refusals


async def test_max_tokens_refused_for_max_completion_tokens_is_sent_under_that_name(clean_proxy_env, caplog):
    """The OpenAI API answers max_tokens for its reasoning models (o1, o3, gpt-5) 400 "Unsupported parameter:
    'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.": every call failed
    INVALID_ARGUMENT. The endpoint gets the value as max_completion_tokens from then on, logged once; the cut
    at max_tokens still holds."""
    caplog.set_level(logging.WARNING, logger="switchyard.gateway.client")
    with start_sim(max_completion_tokens_only=True) as sim:
        async with GatewayClient(gateway_config(sim.base_url, max_retries=0, fallback_model="")) as client:
            first = await stream(client, ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=2))
            second = await stream(client, ChatRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=3))
            assert client.refused_fields == set(), "nothing was lost: not a refused field"
    assert first[-1].usage.completion_tokens == 2 and first[-1].finish_reason == "length"
    assert second[-1].usage.completion_tokens == 3
    sent = [(body.get("max_tokens"), body.get("max_completion_tokens")) for body in sim.state.requests]
    assert sent == [(2, None), (None, 2), (None, 3)]
    said = [r.getMessage() for r in caplog.records if "refused the request field 'max_tokens'" in r.getMessage()]
    assert len(said) == 1 and "max_completion_tokens is sent instead" in said[0], said


async def test_max_tokens_refused_for_its_value_is_the_requests_error(clean_proxy_env):
    """A refusal naming max_tokens without naming its replacement is no rename: the replacement would be refused
    too (a value out of range; here a server that takes neither)."""
    with start_sim(refuse_fields=frozenset({"max_tokens"})) as sim:
        async with GatewayClient(gateway_config(sim.base_url, max_retries=0, fallback_model="")) as client:
            with pytest.raises(GatewayError) as caught:
                await stream(client, ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=10**6))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [body.get("max_tokens") for body in sim.state.requests] == [10**6]


@pytest.mark.parametrize(("status", "message", "field"), [
    (422, "Unexpected fields in the request: {'priority'}", "priority"),  # transformers serve
    (400, "Unrecognized request argument supplied: priority", "priority"),  # OpenAI API
    (422, "Failed to deserialize the JSON body into the target type: unknown field `stream_options`",
     "stream_options"),  # TGI (serde)
    (422, '{"detail":[{"type":"extra_forbidden","loc":["body","priority"],"msg":"Extra inputs are not permitted"}]}',
     "priority"),  # pydantic extra=forbid
    (400, '{"error": {"message": "Got priority 2 but Priority scheduling is not enabled.", "type": '
          '"BadRequestError", "param": null, "code": 400}}', "priority"),  # vLLM, inside its stream
    (400, "Got lora_request None but LoRA is not enabled!", None),  # names no field sent
    (400, "This model's maximum context length is 4096 tokens", None),  # not a refused field
    (500, "Unexpected fields in the request: {'priority'}", None),  # only 400/422
])
def test_refused_field_messages_of_each_server(status, message, field):
    assert servers.refused_field(status, message, ("priority", "stream_options")) == field


# --------------------------------------------------------------------------- X-Agent-Id and X-Priority


async def test_every_upstream_request_carries_agent_and_priority_headers_through_retries_and_fallback(
        clean_proxy_env):
    """Each attempt carries them: retried 503s, the fallback model's call, every call; each attempt's
    X-Request-Id is its own (the request's id, then ``-2``, ``-3``...): a server keys its requests by it, and
    a retry sent while it still held the attempt before had shared that attempt's id."""
    with start_sim(faults={"claude-sonnet-4-5": Fault(status=503), "gpt-4o-mini": Fault(status=503, fail_first=1)}) as sim:
        async with GatewayClient(gateway_config(sim.base_url, max_retries=1)) as client:
            await stream(client, ask("batch", agent="agent-42", request_id="req-9"))
            await stream(client, ask("core", agent="", request_id="req-10"))
    assert len(sim.state.headers) == 2 + 2 + 1 + 2  # primary twice, fallback twice then once; then the second call
    seen = [(h.get("x-agent-id"), h.get("x-priority"), h.get("x-request-id")) for h in sim.state.headers]
    assert seen[:4] == [("agent-42", "batch", r) for r in ("req-9", "req-9-2", "req-9-3", "req-9-4")]
    assert seen[4:] == [("req-10", "core", r) for r in ("req-10", "req-10-2", "req-10-3")]  # no agent: its own


async def test_the_tenant_goes_upstream_beside_the_agent(clean_proxy_env):
    """An agent is its tenant's and its id's: tenants acme and zeta each running ``planner`` are two agents, and
    a gateway or scheduler in front of the model server that keys sessions by agent saw one (only X-Agent-Id
    went up). A request that names no tenant sends no header."""
    with start_sim() as sim:
        async with GatewayClient(gateway_config(sim.base_url)) as client:
            for tenant in ("acme", "zeta", ""):
                await stream(client, ask("normal", agent="planner", tenant=tenant))
    assert [(h.get("x-agent-id"), h.get("x-tenant-id")) for h in sim.state.headers] == [
        ("planner", "acme"), ("planner", "zeta"), ("planner", None)]


async def test_two_calls_in_flight_under_one_request_id_go_upstream_under_two(clean_proxy_env):
    """Two RunTasks under one task_id at once (the field's ghz command sends task_id bench-001 from 64 workers)
    reach the engine under one request id when the orchestrator's stream to the dispatcher has rotated between
    them; the second is sent under an id of its own (``<id>~<n>``), and the id is free again once the first
    ends. ``transformers serve`` keys its paged KV cache by X-Request-Id: two live requests under one id killed
    its batching worker ('CB worker is dead', IndexError), and vLLM refuses the second (400 already running)."""
    with start_sim() as sim:
        async with GatewayClient(gateway_config(sim.base_url)) as client:
            first = client.stream_chat(ask("core", request_id="bench-001:0"))
            assert isinstance(await anext(first), Token)  # the first call's request is in flight upstream
            second = await stream(client, ask("core", request_id="bench-001:0"))
            rest = [e async for e in first]
            third = await stream(client, ask("core", request_id="bench-001:0"))
    assert isinstance(second[-1], Finished) and isinstance(rest[-1], Finished) and isinstance(third[-1], Finished)
    assert [h.get("x-request-id") for h in sim.state.headers] == ["bench-001:0", "bench-001:0~1", "bench-001:0"]


@pytest.mark.parametrize("agent, request_id, sent_agent, sent_request_id", [
    ("agent-é", "tâche-1:0", "agent-%C3%A9", "t%C3%A2che-1:0"),
    ("\u200b", "日本:2", "%E2%80%8B", "%E6%97%A5%E6%9C%AC:2"),  # a zero-width space; CJK
    ("an agent", "r 1", "an agent", "r 1"),  # visible ASCII and inner spaces go as they are
    ("a%C3%A9", "100%", "a%25C3%25A9", "100%25"),  # a '%' is encoded: 'aé' and 'a%C3%A9' stay two agents
    (" lead", "trail ", "%20lead", "trail%20"),  # a space at an end would be stripped by the receiver
    ("ü\x7f", "r", "%C3%BC%7F", "r"),  # DEL is no header character
])
async def test_ids_that_are_not_ascii_go_upstream_percent_encoded_and_the_call_succeeds(
        agent, request_id, sent_agent, sent_request_id, clean_proxy_env):
    """The edge takes any Unicode id; header values are ASCII: each id was put in as it was, and httpx refused
    the call (INTERNAL: UnicodeEncodeError) for every such task."""
    with start_sim() as sim:
        async with GatewayClient(gateway_config(sim.base_url)) as client:
            events = await stream(client, ask("core", agent=agent, request_id=request_id))
    assert isinstance(events[-1], Finished)
    assert [(h.get("x-agent-id"), h.get("x-request-id")) for h in sim.state.headers] == [(sent_agent, sent_request_id)]


@pytest.mark.slow
async def test_every_upstream_request_of_the_stack_carries_x_agent_id_x_priority_and_x_tenant_id(
        clean_proxy_env, pydoc_index_dir):
    """Through orchestrator, retrieval and dispatcher: chat, rag_answer and react_loop tasks of every class, of
    tenants named by x-tenant-id or of none; 100 % of the upstream requests carry the three headers with the
    task's agent, class and tenant (``default`` where the caller named none)."""
    from test_openai_engine import run_task

    classes = {agent_pb2.CORE: "core", agent_pb2.NORMAL: "normal", agent_pb2.BATCH: "batch"}
    with start_sim() as sim:
        expected = []
        for i, (task_type, priority, tenant) in enumerate([("chat", agent_pb2.CORE, "acme"),
                                                           ("rag_answer", agent_pb2.BATCH, ""),
                                                           ("react_loop", agent_pb2.NORMAL, "zeta")]):
            before = len(sim.state.headers)
            await run_task(sim.base_url, agent_pb2.RunTaskRequest(
                task_id=f"hdr-{i}", agent_id=f"agent-{i}", payload="What does the with statement do?",
                task_type=task_type, priority=priority), index_dir=pydoc_index_dir,
                metadata=(("x-tenant-id", tenant),) if tenant else ())
            expected += [(f"agent-{i}", classes[priority], tenant or "default")] * (len(sim.state.headers) - before)
    got = [(h.get("x-agent-id"), h.get("x-priority"), h.get("x-tenant-id")) for h in sim.state.headers]
    assert len(got) >= 4 and got == expected


async def test_an_unknown_model_is_not_found_naming_the_ids_served(clean_proxy_env):
    with start_sim(models=["served-a", "served-b"]) as sim:
        async with GatewayClient(gateway_config(sim.base_url, default_model="served-a", fallback_model="")) as client:
            with pytest.raises(GatewayError) as caught:
                await stream(client, ChatRequest(messages=[{"role": "user", "content": "hi"}], model="other-model"))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert "the server serves 'served-a', 'served-b'" in str(caught.value)


async def test_an_unknown_default_model_names_the_setting_that_named_it(clean_proxy_env, monkeypatch):
    """A task that leaves ``model`` empty calls the default model: with SWITCHYARD_UPSTREAM_MODEL naming an id the
    server does not serve, every such task failed NOT_FOUND saying "set it in the request or in
    model_gateway.model_map", naming neither the variable that chose the model nor the key it overrides."""
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "served-c")
    with start_sim(models=["served-a", "served-b"]) as sim:
        async with GatewayClient(gateway_config(sim.base_url, default_model="served-c", fallback_model="")) as client:
            with pytest.raises(GatewayError) as caught:
                await stream(client, ChatRequest(messages=[{"role": "user", "content": "hi"}], model=""))
            with pytest.raises(GatewayError) as named:  # the request named it: the request is the fix
                await stream(client, ChatRequest(messages=[{"role": "user", "content": "hi"}], model="served-d"))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert ("set it in SWITCHYARD_UPSTREAM_MODEL (it overrides model_gateway.default_model) (or name it in the "
            "request)") in str(caught.value), str(caught.value)
    assert "set it in the request or in model_gateway.model_map" in str(named.value), str(named.value)


async def test_ollama_with_no_model_pulled_lists_none_and_is_not_called_no_model_list(clean_proxy_env):
    """Ollama answers ``GET /v1/models`` with ``{"object": "list", "data": null}`` while no model is pulled (its
    ListCompletion marshals an empty Go slice as null). Read as no model list at all, the gateway failed
    "did not return OpenAI's model list" and doctor said to point the URL at an OpenAI-compatible root, which it
    was. It lists none: the one reader (servers.listed_ids) reads it so for both, and doctor names the model as
    not listed."""
    from switchyard.gateway import doctor
    from test_upstream_streams import Recorded, replay_server

    empty = Recorded("ollama_no_model", {"status": "HTTP/1.1 200 OK", "content-type": "application/json",
                                         "framing": "close"}, b'{"object":"list","data":null}\n')
    async with replay_server(empty) as (base, _):
        config = gateway_config(base, default_model="llama3.2", fallback_model="")
        async with GatewayClient(config) as client:
            assert await client.list_models() == []
        checks = {c.name: c for c in await doctor.run_endpoint_checks(config, probe=False)}
    assert checks["base url"].ok and "0 model(s) listed" in checks["base url"].detail
    model = checks["model llama3.2"]
    assert not model.ok and "the server lists no model: load 'llama3.2'" in model.fix
