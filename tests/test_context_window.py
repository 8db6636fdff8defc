"""The context window a model server reports (vLLM's and SGLang's ``max_model_len`` in ``GET /v1/models``) is the
model's window where the config lists none: a server with a longer window than the default is not refused
work it takes, and one with a shorter window refuses at the edge, by name, what it would refuse upstream."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig, load_config
from switchyard.common.server import running
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.service import DispatcherService
from switchyard.gateway import servers
from switchyard.orchestrator.service import OrchestratorService

MODEL = "acme/served-8b"
"""A model the shipped config does not list in limits.context_window_tokens."""
OTHER = "acme/other-8b"
"""Another such model the same server serves."""

VLLM_MODELS = {  # vLLM 0.x GET /v1/models (ModelCard), as served
    "object": "list",
    "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "created": 1733400000, "owned_by": "vllm",
              "root": "meta-llama/Llama-3.1-8B-Instruct", "parent": None, "max_model_len": 131072,
              "permission": [{"id": "modelperm-1", "object": "model_permission", "allow_sampling": True}]}],
}


@pytest.mark.parametrize(("body", "model", "window"), [
    (VLLM_MODELS, "meta-llama/Llama-3.1-8B-Instruct", 131072),
    (VLLM_MODELS, "another-model", 0),  # not the listed one
    ({"data": [{"id": "qwen", "owned_by": "sglang", "max_model_len": 32768}]}, "qwen", 32768),  # SGLang
    ({"data": [{"id": "m", "owned_by": "llamacpp", "meta": {"n_ctx_train": 4096}}]}, "m", 0),  # training window only
    ({"data": [{"id": "/m", "owned_by": "local", "status": {"value": "loaded"}}]}, "/m", 0),  # transformers serve
    ({"data": [{"id": "gpt-4o-mini", "owned_by": "system"}]}, "gpt-4o-mini", 0),  # the OpenAI API
    ({"data": [{"id": "m", "max_model_len": True}]}, "m", 0),  # not a count
    ({"data": [{"id": "m", "max_model_len": 32768.0}]}, "m", 32768),  # a serializer's float: the same number
    ({"data": [{"id": "m", "max_model_len": 4096.5}]}, "m", 0),  # no whole number
    ({"data": [{"id": "m", "max_model_len": 8}]}, "m", 0),  # below any usable window
    ({"data": [{"id": "m", "max_model_len": 2**32}]}, "m", 0),  # past int32 (it took the whole stack down)
    ({"data": "nope"}, "m", 0),
])
def test_the_window_is_read_from_the_model_list_where_the_server_reports_one(body, model, window):
    assert servers.reported_context_window(body, model) == window


def test_a_window_the_config_lists_wins_then_the_servers_then_the_default():
    limits = SwitchyardConfig().with_overrides(**{"limits.context_window_tokens": {"listed": 1000},
                                                  "limits.default_context_window_tokens": 8192}).limits
    assert limits.context_window("listed", reported=131072) == (1000, "limits.context_window_tokens", 1.0)
    assert limits.context_window("other", reported=131072) == (131072, "as its model server reports it", 1.0)
    assert limits.context_window("other") == (8192, "limits.default_context_window_tokens", 1.0)


def config_for(base_url: str) -> SwitchyardConfig:
    return load_config("config").with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": base_url, "upstream.default_model": MODEL,
        "upstream.fallback_model": "", "upstream.api_key_required": False,
        "orchestrator.cpu_executor": "loop"})  # a spawn pool costs seconds per orchestrator; not tested here


@contextlib.asynccontextmanager
async def dispatcher_before(max_model_len: int, models_delay_s: float = 0.0, **gateway: object):
    with start_sim(models=[MODEL, OTHER], owned_by="vllm", max_model_len=max_model_len,
                   models_delay_s=models_delay_s) as sim:
        cfg = config_for(sim.base_url).with_overrides(**{f"upstream.{k}": v for k, v in gateway.items()})
        async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as server:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                yield cfg, server, agent_pb2_grpc.InferenceServiceStub(channel), sim


async def test_a_servers_longer_window_takes_a_prompt_past_the_default(clean_proxy_env):
    """vLLM serving 32k: a 9,000-token prompt is past the default window (8,192), and was refused before."""
    async with dispatcher_before(32768) as (_, _, stub, _):
        assert (await stub.DescribeModel(agent_pb2.DescribeModelRequest())).context_window_tokens == 32768
        chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
            request_id="long", prompt="tell me about lists", prompt_tokens=9000, max_tokens=8))]
    assert chunks[-1].WhichOneof("chunk") == "done" and chunks[-1].done.finish_reason in ("stop", "length")


@pytest.mark.parametrize("models_delay_s", [0.0, 0.3], ids=["list-read", "list-read-under-way"])
async def test_a_servers_shorter_window_is_refused_at_the_dispatcher_by_name(clean_proxy_env, models_delay_s):
    """With the model list slow to answer (0.3 s), the Generate arrives while the dispatcher's first read of it is
    under way: it waits for it and is checked against the server's window, not the default one (it was
    accepted, then failed upstream)."""
    async with dispatcher_before(2048, models_delay_s=models_delay_s) as (_, _, stub, sim):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="over", prompt="hi",
                                                                    prompt_tokens=3000, max_tokens=8)):
                pass
        assert sim.state.requests == []
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2048 tokens (as its model server reports it)" in caught.value.details()


async def test_a_prompt_counted_here_is_never_counted_below_the_floor_a_callers_count_is_held_to(clean_proxy_env):
    """prompt_tokens 0 asks the dispatcher to count: 200,000 characters without a space were one word piece, so
    one token, and went upstream past a 1,024-token window; a caller's own count of 1 was refused (at least
    chars / 128). The dispatcher's count takes the same floor."""
    async with dispatcher_before(1024) as (_, _, stub, sim):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="dense", prompt="w" * 200_000,
                                                                    max_tokens=1)):
                pass
        assert sim.state.requests == []
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("prompt_tokens: expected fewer than the context window"), \
        caught.value.details()


async def test_the_orchestrator_refuses_before_accepting_what_the_servers_window_cannot_hold(clean_proxy_env):
    """A 64-token window: a question of about 100 tokens is refused by SubmitTask naming the server's report,
    and nothing reaches the upstream."""
    async with dispatcher_before(64) as (cfg, disp, _, sim):
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        async with running([OrchestratorService(orch_cfg)], cfg.server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(
                        payload="how do Python lists, tuples and dicts differ " * 10, task_type="chat", max_tokens=16))
        assert sim.state.requests == []
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context window of acme/served-8b is 64 tokens (as its model server reports it)" in caught.value.details()


async def test_a_server_down_at_the_dispatchers_start_has_its_window_learnt_once_it_answers(clean_proxy_env,
                                                                                            monkeypatch):
    """The model list is read at the dispatcher's start; a server not up then is read again (at most every
    DESCRIBE_RETRY_S) from the requests that follow, so its window is learnt without a DescribeModel."""
    import asyncio
    import socket

    from switchyard.dispatcher.engines import openai as openai_engine
    from switchyard_harness.sim_openai import SimOpenAIOptions, run_in_thread

    monkeypatch.setattr(openai_engine, "DESCRIBE_RETRY_S", 0.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config_for(f"http://127.0.0.1:{port}/v1")
    engine = make_engine(cfg)
    async with running([DispatcherService(cfg, engine=engine)], cfg.server) as server:
        await asyncio.sleep(0.2)  # the start-up read failed: nothing listens yet
        assert engine.reported_context_window("") == 0
        options = SimOpenAIOptions(models=[MODEL], owned_by="vllm", max_model_len=2048, latency=False)
        with run_in_thread(options, port=port):
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                for attempt in range(50):
                    async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id=f"r{attempt}", prompt="hi",
                                                                            max_tokens=4)):
                        pass
                    if engine.reported_context_window("") == 2048:
                        break
                    await asyncio.sleep(0.05)
                assert engine.reported_context_window("") == 2048


async def test_the_orchestrator_asks_again_while_the_upstream_reported_no_window(clean_proxy_env, monkeypatch):
    """The orchestrator keeps the dispatcher's ModelInfo; one without a window (its upstream was down) is
    asked again (at most every MODEL_INFO_RETRY_S), so the server's window reaches the edge once known."""
    import asyncio
    import socket

    from switchyard.orchestrator import clients
    from switchyard_harness.sim_openai import SimOpenAIOptions, run_in_thread

    monkeypatch.setattr(clients, "MODEL_INFO_RETRY_S", 0.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config_for(f"http://127.0.0.1:{port}/v1")
    long_question = "how do Python lists, tuples and dicts differ " * 10
    async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as disp:
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        async with running([OrchestratorService(orch_cfg)], cfg.server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                await stub.SubmitTask(agent_pb2.RunTaskRequest(payload=long_question, task_type="chat", max_tokens=16))
                options = SimOpenAIOptions(models=[MODEL], owned_by="vllm", max_model_len=64, latency=False)
                with run_in_thread(options, port=port):
                    for _ in range(50):
                        try:
                            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload=long_question, task_type="chat",
                                                                           max_tokens=16))
                        except grpc.aio.AioRpcError as refused:
                            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
                            assert "64 tokens (as its model server reports it)" in refused.details()
                            break
                        await asyncio.sleep(0.05)
                    else:
                        raise AssertionError("the server's window never reached the orchestrator")


@pytest.mark.parametrize("named", [OTHER, "short-name"], ids=["another-served-model", "a-model_map-alias"])
async def test_a_request_naming_another_model_is_checked_against_that_models_reported_window(clean_proxy_env,
                                                                                             named):
    """ModelInfo carries every reported window (and each model_map alias of one): a request naming a model
    other than the default was checked against the 8,192 default at the orchestrator, accepted, and failed at
    the dispatcher."""
    async with dispatcher_before(2048, model_map={"short-name": OTHER}) as (cfg, disp, stub, sim):
        info = await stub.DescribeModel(agent_pb2.DescribeModelRequest())
        assert dict(info.context_windows) == {MODEL: 2048, OTHER: 2048, "short-name": 2048}
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        async with running([OrchestratorService(orch_cfg)], cfg.server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await agent_pb2_grpc.AgentServiceStub(channel).SubmitTask(agent_pb2.RunTaskRequest(
                        payload="hi", task_type="chat", max_tokens=4000, model=named))
        assert sim.state.requests == []
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2048 tokens" in caught.value.details() and named in caught.value.details()


@pytest.mark.parametrize("fallback", ["gpt-4o-mini", OTHER])
async def test_an_upstream_that_does_not_list_the_fallback_model_is_a_warning_at_start(clean_proxy_env, caplog,
                                                                                       fallback):
    """The shipped fallback_model (gpt-4o-mini) in front of a server that does not serve it (transformers serve,
    vLLM with one model) started with no word of it: every call whose model failed before its first token was sent
    there and failed NOT_FOUND. A warning names the setting; a listed fallback is none."""
    import logging

    caplog.set_level(logging.INFO, logger="switchyard.dispatcher.engines.openai")
    with start_sim(models=[MODEL, OTHER]) as sim:
        cfg = config_for(sim.base_url).with_overrides(**{"upstream.fallback_model": fallback})
        engine = make_engine(cfg)
        async with running([DispatcherService(cfg, engine=engine)], cfg.server):
            await engine.await_model_list("", 5.0)  # the read its start began
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if fallback == OTHER:
        assert warned == [], warned
    else:
        assert len(warned) == 1 and f"does not list model {fallback!r}, model_gateway.fallback_model" in warned[0]
        assert "SWITCHYARD_UPSTREAM_FALLBACK_MODEL=none" in warned[0] and repr(MODEL) in warned[0], warned


async def test_an_upstream_that_does_not_list_the_default_model_or_does_not_answer_is_a_warning_at_start(
        clean_proxy_env, caplog):
    """`switchyard up` reports the stack healthy whatever the model server does (it may come up later); the
    dispatcher's log said why every request would fail only at INFO. A server that answers with no model list
    (404) was said to fail every request until it answered, though it answers and serves them."""
    import logging
    import socket

    caplog.set_level(logging.INFO, logger="switchyard.dispatcher.engines.openai")
    with start_sim(models=[OTHER]) as sim:
        cfg = config_for(sim.base_url)
        engine = make_engine(cfg)
        async with running([DispatcherService(cfg, engine=engine)], cfg.server):
            await engine.await_model_list("", 5.0)  # the read its start began
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"does not list model {MODEL!r}" in r.getMessage() and repr(OTHER) in r.getMessage()
               and "SWITCHYARD_UPSTREAM_MODEL" in r.getMessage() for r in warned), [r.getMessage() for r in warned]
    caplog.clear()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config_for(f"http://127.0.0.1:{port}/v1")
    engine = make_engine(cfg)
    async with running([DispatcherService(cfg, engine=engine)], cfg.server):
        await engine.await_model_list("", 5.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not list the upstream's models" in m and "requests fail until it answers" in m
               for m in warned), warned
    # a server that answers but has no GET /models (TGI before 2.3): its requests are served, not "fail until it
    # answers" (it answers)
    caplog.clear()
    with start_sim() as sim:
        engine = make_engine(config_for(sim.base_url + "/no-model-list"))
        await engine.describe_upstream()
        await engine.aclose()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("upstream 404" in m and "requests are sent all the same" in m for m in warned), warned
    assert not any("requests fail until it answers" in m for m in warned), warned


@pytest.mark.parametrize("order", ["long_first", "short_first"])
async def test_a_pools_window_is_the_smallest_its_replicas_report(clean_proxy_env, order):
    """Two vLLM replicas of one model, one at --max-model-len 32768 and one at 4096 (a rollout changing it): the
    window was the first endpoint's alone (32768 when it came first), so a 9,000-token prompt was accepted and,
    sent to the 4,096 replica, refused 400 there after the task was accepted (not sent to the other: a
    request's own error). Every endpoint's model list is read; the window is the smallest."""
    with start_sim(models=[MODEL], owned_by="vllm", max_model_len=32768) as long, \
            start_sim(models=[MODEL], owned_by="vllm", max_model_len=4096) as short:
        urls = [long.base_url, short.base_url] if order == "long_first" else [short.base_url, long.base_url]
        cfg = config_for(urls[0]).with_overrides(**{"upstream.pool": {"endpoints": urls, "scrape_interval_s": 60.0}})
        async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as server:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                info = await stub.DescribeModel(agent_pb2.DescribeModelRequest())
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in stub.Generate(agent_pb2.GenerateRequest(
                            request_id="long", prompt="tell me about lists", prompt_tokens=9000, max_tokens=8)):
                        pass
    assert info.context_window_tokens == 4096 and dict(info.context_windows)[MODEL] == 4096
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in caught.value.details()
    assert not long.state.requests and not short.state.requests, "refused at the edge, sent to no replica"
