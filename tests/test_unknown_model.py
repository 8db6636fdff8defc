"""A request naming a model the dispatcher does not serve is refused NOT_FOUND before it is accepted, by one rule
for every engine: a step engine's one model, or the ids an ``openai`` engine's upstream lists (and each
``model_map`` alias of one). In front of an upstream it was accepted (HTTP 200, SubmitTask) and failed NOT_FOUND
afterwards. An upstream whose list was not read refuses nothing: the call decides, as before."""

from __future__ import annotations

import contextlib
import socket

import grpc
import httpx
import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig, load_config
from switchyard.common.server import running
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.http_face import HttpFace
from switchyard.orchestrator.service import OrchestratorService

MODEL = "acme/served-8b"
OTHER = "acme/other-8b"
UNKNOWN = "acme/not-served-70b"


def config_for(engine: str, base_url: str = "", **upstream: object) -> SwitchyardConfig:
    overrides: dict[str, object] = {"dispatcher.engine": engine, "orchestrator.cpu_executor": "loop"}
    if engine == "openai":
        overrides.update({"upstream.base_url": base_url, "upstream.default_model": MODEL,
                          "upstream.fallback_model": "", "upstream.api_key_required": False})
        overrides.update({f"upstream.{k}": v for k, v in upstream.items()})
    return load_config("config").with_overrides(**overrides)


@contextlib.asynccontextmanager
async def stack(cfg: SwitchyardConfig):
    """(gRPC AgentService stub, httpx client on the HTTP face) of an orchestrator before a dispatcher of ``cfg``."""
    async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as disp:
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        orch = OrchestratorService(orch_cfg)
        face = HttpFace(orch, orch_cfg, port=0)
        async with running([orch, face], cfg.server) as srv:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
                yield agent_pb2_grpc.AgentServiceStub(channel), client


async def refused(stub, client, model: str) -> str:
    """The NOT_FOUND details of SubmitTask naming ``model``, after checking the HTTP face answers 404 too."""
    reply = await client.post("/api/v1/agent/submit", json={"agent_id": "a1", "payload": "hi", "task_type": "chat", "model": model})
    assert reply.status_code == 404, reply.text
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", model=model))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    assert model in reply.json()["error"]["message"], reply.text
    return caught.value.details()


async def accepted(stub, model: str) -> None:
    reply = await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", model=model))
    assert reply.task_id


@pytest.mark.parametrize("engine", ["sim", "openai"])
async def test_a_model_not_served_is_refused_before_accepted_by_either_engine(clean_proxy_env, engine):
    with start_sim(models=[MODEL, OTHER]) as sim:
        cfg = config_for(engine, sim.base_url)
        async with stack(cfg) as (stub, client):
            details = await refused(stub, client, UNKNOWN)
        if engine == "openai":
            assert sim.state.requests == []  # nothing reached the upstream
    assert UNKNOWN in details and "is not served here" in details
    if engine == "openai":
        assert f"the dispatcher serves {OTHER!r}, {MODEL!r}" in details, details
    else:
        assert "the dispatcher serves 'sim" in details, details


@pytest.mark.parametrize("engine", ["sim", "openai"])
async def test_the_dispatchers_generate_refuses_it_before_queueing_in_the_same_words(clean_proxy_env, engine):
    """A caller of the dispatcher itself (the orchestrator racing a list change, a direct client) meets the same
    rule: the openai engine queued the request and relayed the upstream's 404 after."""
    with start_sim(models=[MODEL, OTHER]) as sim:
        cfg = config_for(engine, sim.base_url)
        async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as disp:
            async with open_channel(f"127.0.0.1:{disp.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="r1", prompt="hi",
                                                                           model=UNKNOWN, max_tokens=4)):
                        pass
                if engine == "openai":  # a served one still goes through
                    async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="r2", prompt="hi",
                                                                           model=OTHER, max_tokens=4)):
                        pass
                    assert [body["model"] for body in sim.state.requests] == [OTHER]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details().startswith(f"model: {UNKNOWN!r} is not served here: the dispatcher serves "), \
        caught.value.details()


async def test_a_served_id_a_model_map_alias_of_one_and_the_fallback_are_accepted(clean_proxy_env):
    with start_sim(models=[MODEL, OTHER, "llama3:latest"]) as sim:
        cfg = config_for("openai", sim.base_url, fallback_model=OTHER,
                         model_map={"short": OTHER, "gone": "acme/unloaded"})
        async with stack(cfg) as (stub, client):
            for model in (MODEL, OTHER, "short", "llama3", "llama3:latest"):
                await accepted(stub, model)
            details = await refused(stub, client, "gone")  # an alias of a model the server does not list
    assert "'gone'" in details and "'short'" in details


async def test_the_configured_default_and_fallback_are_accepted_though_the_server_does_not_list_them(
        clean_proxy_env):
    """A server that serves a model it does not list (llama.cpp's server answers any name) keeps serving the names
    the set-up chose; whether it serves them is the call's to decide (and doctor's, and the start's warning)."""
    with start_sim(models=[OTHER]) as sim:
        cfg = config_for("openai", sim.base_url, fallback_model="fast", model_map={"fast": "acme/fast-1b"})
        async with stack(cfg) as (stub, client):
            for model in (MODEL, "fast", "acme/fast-1b", OTHER):
                await accepted(stub, model)
            await refused(stub, client, UNKNOWN)


async def test_an_upstream_whose_list_cannot_be_read_refuses_no_model(clean_proxy_env):
    """Nothing answers at the upstream's address: every model is accepted, and the call decides."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with stack(config_for("openai", f"http://127.0.0.1:{port}/v1")) as (stub, _):
        await accepted(stub, UNKNOWN)


async def test_a_model_loaded_after_the_list_was_read_is_not_refused(clean_proxy_env, monkeypatch):
    """The server loads another model: a name not in the list read before has the list read again (at most every
    DESCRIBE_RETRY_S at the dispatcher, MODEL_INFO_RETRY_S at the orchestrator) before it is refused."""
    from switchyard.dispatcher.engines import openai as openai_engine
    from switchyard.orchestrator import clients

    with start_sim(models=[MODEL]) as sim:
        async with stack(config_for("openai", sim.base_url)) as (stub, client):
            await refused(stub, client, OTHER)
            sim.sim.options.models.append(OTHER)  # loaded now; the lists read so far do not name it
            await refused(stub, client, OTHER)  # within the retry intervals: the list read before stands
            monkeypatch.setattr(openai_engine, "DESCRIBE_RETRY_S", 0.0)
            monkeypatch.setattr(clients, "MODEL_INFO_RETRY_S", 0.0)
            await accepted(stub, OTHER)


async def test_tasks_naming_a_model_loaded_since_that_come_together_are_all_accepted(clean_proxy_env, monkeypatch):
    """Several tasks name a model the server loaded after the orchestrator's list was read, at once (an agent
    fleet switched to it): the first asks the dispatcher again, and the others wait for that answer. They read
    the answer kept before, and were refused NOT_FOUND naming the models of before while the first, asking, was
    accepted (1 of 6 refused on a stack in front of sim-openai)."""
    import asyncio

    from switchyard.dispatcher.engines import openai as openai_engine
    from switchyard.orchestrator import clients

    with start_sim(models=[MODEL]) as sim:
        async with stack(config_for("openai", sim.base_url)) as (stub, client):
            await refused(stub, client, OTHER)
            sim.sim.options.models.append(OTHER)  # loaded now; the lists read so far do not name it
            monkeypatch.setattr(openai_engine, "DESCRIBE_RETRY_S", 0.0)
            monkeypatch.setattr(clients, "MODEL_INFO_RETRY_S", 0.05)
            await asyncio.sleep(0.1)  # the orchestrator's answer is older than MODEL_INFO_RETRY_S: asked again

            async def submit() -> str:
                try:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", model=OTHER))
                except grpc.aio.AioRpcError as err:
                    return f"{err.code().name}: {err.details()}"
                return "accepted"

            outcomes = await asyncio.gather(*(submit() for _ in range(8)))
    assert outcomes == ["accepted"] * 8, outcomes


@pytest.mark.parametrize("call", ["Generate", "DescribeModel"])
async def test_each_of_the_dispatchers_checks_reads_the_list_again_for_a_model_loaded_since(clean_proxy_env,
                                                                                          monkeypatch, call):
    """A request's check (Generate) and DescribeModel each read the upstream's list again for a name it did not
    list, at most every DESCRIBE_RETRY_S, through one function (StreamEngine.await_model_list); each had a copy of
    that read, with different first waits and a wait of its own for each read."""
    from switchyard.dispatcher.engines import openai as openai_engine

    async def ask(stub) -> bool:
        """Whether ``call`` finds OTHER served."""
        if call == "DescribeModel":
            return OTHER in (await stub.DescribeModel(agent_pb2.DescribeModelRequest(model=OTHER))).models
        try:
            async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id=f"r{len(sim.state.requests)}",
                                                                   prompt="hi", model=OTHER, max_tokens=4)):
                pass
        except grpc.aio.AioRpcError as refused:
            assert refused.code() == grpc.StatusCode.NOT_FOUND, refused.details()
            return False
        return True

    with start_sim(models=[MODEL]) as sim:
        cfg = config_for("openai", sim.base_url)
        engine = make_engine(cfg)
        async with running([DispatcherService(cfg, engine=engine)], cfg.server) as disp:
            await engine.await_model_list("", 5.0)  # the read the dispatcher's start began
            async with open_channel(f"127.0.0.1:{disp.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                assert not await ask(stub)
                sim.sim.options.models.append(OTHER)  # loaded now; the list read so far does not name it
                assert not await ask(stub)  # within DESCRIBE_RETRY_S: the list read before stands
                monkeypatch.setattr(openai_engine, "DESCRIBE_RETRY_S", 0.0)
                assert await ask(stub)
    assert [body["model"] for body in sim.state.requests] == ([OTHER] if call == "Generate" else [])


async def test_a_model_server_restarted_with_another_model_has_it_served_at_once(clean_proxy_env):
    """The server comes back serving another model: the first call to the old one ends NOT_FOUND, its message naming
    what the server serves now (the dispatcher read the list again for it), and the orchestrator asks the dispatcher
    again on that NOT_FOUND: the new model is accepted at once. It was refused for up to MODEL_INFO_RETRY_S more,
    its message naming the models of before as the dispatcher's."""
    with start_sim(models=[MODEL]) as sim:
        async with stack(config_for("openai", sim.base_url)) as (stub, client):
            await refused(stub, client, OTHER)
            sim.sim.options.models[:] = [OTHER]  # restarted with another model
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", max_tokens=4)):
                    pass
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
            assert f"model {MODEL!r} not found upstream" in caught.value.details()
            assert f"the server serves {OTHER!r}" in caught.value.details()
            await accepted(stub, OTHER)
            reply = await client.post("/api/v1/agent/submit", json={"agent_id": "a1", "payload": "hi",
                                                                     "task_type": "chat", "model": OTHER})
            assert reply.status_code == 200, reply.text


def test_served_names_follow_the_gateways_resolution():
    from switchyard.gateway.models import served_names

    assert served_names(["m", "llama3:latest"], {"alias": "m", "gone": "x", "m2": "m"}) == [
        "alias", "llama3", "llama3:latest", "m", "m2"]
    assert served_names(["m", "n"], {"n": "x"}) == ["m"]  # n is sent as x, which the server does not list


async def test_the_served_names_are_built_when_a_list_is_read_with_other_ids_not_per_request(clean_proxy_env):
    """The dispatcher reads the served names for every request naming a model (its check, and whether the list
    must be read again for it): they were built anew each time (the union of the endpoints' lists, the
    ``model_map`` resolution, a sort). The gateway client, which reads the lists, keeps them: the same names
    while the lists are, a list read again with the same ids included, and built again once one is read with
    other ids."""
    from gateway_fixtures import gateway_config
    from switchyard.gateway.client import GatewayClient

    with start_sim(models=[MODEL]) as sim:
        cfg = gateway_config(sim.base_url, default_model=MODEL, fallback_model="", model_map={"alias": MODEL})
        async with GatewayClient(cfg) as client:
            assert client.served_names() == ()  # no list read: not known
            await client.list_models_everywhere()
            names = client.served_names()
            assert names == (MODEL, "alias") and client.served_names() is names
            await client.list_models_everywhere()  # read again, the same ids: the same names, not built again
            assert client.served_names() is names
            sim.sim.options.models[:] = [MODEL, OTHER]  # the server loaded another model
            (endpoint,) = client.pool.endpoints.values()
            await client.list_models(endpoint)
            assert client.served_names() == (OTHER, MODEL, "alias")


async def test_a_task_naming_a_model_the_kept_answer_serves_does_not_wait_for_an_ask_under_way(monkeypatch):
    """An upstream that reports no context window (``transformers serve``, TGI) leaves the kept answer's window
    unread, so the orchestrator asks the dispatcher again (at most every MODEL_INFO_RETRY_S). A task naming a model
    the kept answer lists goes on with it while that ask runs; every task that came during each ask had waited for
    it (up to its 1 s bound). One naming a model the answer does not list still waits (the model may be new)."""
    import asyncio

    from switchyard.orchestrator import clients

    asked = 0
    hang = asyncio.Event()

    class Dispatcher(agent_pb2_grpc.InferenceServiceServicer):
        async def DescribeModel(self, request, context):  # noqa: N802 - gRPC's name
            nonlocal asked
            asked += 1
            if asked > 1:  # asked again: no answer until the test lets it go
                await hang.wait()
            return agent_pb2.ModelInfo(model=MODEL, engine="openai", models=[MODEL])  # no window reported

    server = grpc.aio.server()
    agent_pb2_grpc.add_InferenceServiceServicer_to_server(Dispatcher(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = clients.InferenceClient(f"127.0.0.1:{port}", SwitchyardConfig().server)
    try:
        monkeypatch.setattr(clients, "MODEL_INFO_RETRY_S", 0.0)
        await client.model_info()
        asking = asyncio.create_task(client.model_info(model=MODEL))  # the window unread: asked again
        while asked < 2:
            await asyncio.sleep(0.01)
        served = await client.model_info(model=MODEL)  # served by the kept answer: no wait for the ask
        assert served.models == [MODEL]
        refresh = client._model_info_refresh
        assert refresh is not None and not refresh.done()  # answered while the ask was still under way
        waiting = asyncio.create_task(client.model_info(model=OTHER))  # not listed: waits for the ask's answer
        await asyncio.sleep(0.05)
        assert not waiting.done()
        hang.set()
        await asyncio.gather(asking, waiting)
    finally:
        hang.set()
        await client.close()
        await server.stop(None)
