"""The whole stack in front of a real continuous-batching model server: stock ``transformers serve``.

Orchestrator, retrieval and dispatcher run as real gRPC servers on 127.0.0.1; the dispatcher's
``openai`` engine streams from ``transformers serve --continuous-batching --device cpu`` serving a
tiny random-weight Llama (``switchyard_harness.testing.transformers_serve``). The server ends every stream
with a finish chunk and no ``data: [DONE]``, refuses unknown body fields (``priority``) with 422
and answers a model it does not serve with 400 "Server is pinned to ...".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import grpc
import pytest
from gateway_fixtures import clean_proxy_env  # noqa: F401
from redis_fixtures import redis_db, redis_server  # noqa: F401

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.dispatcher.engines import make_engine
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Finished

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def stack(base_url: str, model: str, index_dir: Path | None = None, overrides: dict | None = None,
                dispatchers: list | None = None, **gateway: object):
    """Dispatcher (openai engine on ``base_url``), retrieval (with ``index_dir``) and orchestrator, with the
    config ``overrides`` given (``{"limits.default_context_window_tokens": 4096}``); yields a stub. The
    DispatcherService is appended to ``dispatchers`` when given."""
    extra = overrides or {}
    from switchyard.common.server import running
    from switchyard.dispatcher.service import DispatcherService
    from switchyard.orchestrator.service import OrchestratorService
    from switchyard.retrieval.service import RetrievalService

    overrides = {"dispatcher.engine": "openai", "upstream.base_url": base_url, "upstream.default_model": model,
                 "upstream.fallback_model": "", "upstream.api_key_required": False,
                 "upstream.retry_backoff_initial_s": 0.01, "upstream.retry_backoff_max_s": 0.02}
    overrides.update({f"upstream.{k}": v for k, v in gateway.items()})
    overrides.update(extra)
    cfg = load_config("config").with_overrides(**overrides)
    async with contextlib.AsyncExitStack() as stack:
        dispatcher = DispatcherService(cfg, engine=make_engine(cfg))
        if dispatchers is not None:
            dispatchers.append(dispatcher)
        disp = await stack.enter_async_context(running([dispatcher], cfg.server))
        # CPU work on the event loop: a spawn pool costs seconds per stack, and no test here is of the executor
        orch_overrides = {"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}", "orchestrator.cpu_executor": "loop"}
        if index_dir is not None:
            rcfg = cfg.with_overrides(**{"retrieval.index_dir": str(index_dir)})
            retrieval = await stack.enter_async_context(running([RetrievalService(rcfg)], cfg.server))
            orch_overrides["orchestrator.retrieval_addr"] = f"127.0.0.1:{retrieval.port}"
        orch = await stack.enter_async_context(
            running([OrchestratorService(cfg.with_overrides(**orch_overrides))], cfg.server))
        channel = await stack.enter_async_context(open_channel(f"127.0.0.1:{orch.port}"))
        yield agent_pb2_grpc.AgentServiceStub(channel)


async def run(stub, **fields) -> list:
    return [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(**fields))]


# Greedy decoding of the random-weight model: this prompt streams words (" even even ..."); many others
# stream byte-level pieces that never complete a UTF-8 character, which the server holds back.
WORDY = "Write a long story."


def answered(events: list, max_tokens: int) -> list[str]:
    """The streamed token texts, after checking the task finished with them and the server's usage."""
    tokens = [e.token.text for e in events if e.HasField("token")]
    final = events[-1].final
    assert final.output == "".join(tokens)
    assert 0 < final.usage.completion_tokens <= max_tokens
    return tokens


@pytest.mark.timeout(900)  # the first user of pydoc_index_dir builds it (minutes on a loaded machine)
async def test_chat_rag_answer_and_react_loop_are_served(clean_proxy_env, transformers_server, pydoc_index_dir):
    """Every stream ends without [DONE]; each task finishes with its tokens and the server's usage."""
    async with stack(transformers_server.base_url, transformers_server.model, pydoc_index_dir) as stub:
        for task_type in ("chat", "rag_answer", "react_loop"):
            events = await run(stub, task_id=f"tf-{task_type}", payload=WORDY, task_type=task_type, max_tokens=12)
            tokens = answered(events, 12 * 4)  # react_loop may take several turns of 12
            if task_type == "chat":
                assert "even" in "".join(tokens)


async def test_forward_priority_against_a_server_without_one(clean_proxy_env, transformers_server):
    """Detected as transformers serve: no priority field is sent; named as vLLM by mistake, the 422
    "Unexpected fields in the request: {'priority'}" drops the field and the task is still served."""
    for server in ("auto", "vllm"):
        async with stack(transformers_server.base_url, transformers_server.model,
                         forward_priority=True, server=server) as stub:
            events = await run(stub, payload=WORDY, task_type="chat", max_tokens=4, priority=agent_pb2.CORE)
            assert answered(events, 4)


async def test_a_model_the_server_does_not_serve_is_not_found_naming_what_it_serves(clean_proxy_env,
                                                                                    transformers_server):
    """Refused before accepted, from the server's GET /v1/models (no event, no call): it was accepted and failed
    NOT_FOUND after, from the server's 400 "Server is pinned to ...", where the sim engine refused it at once."""
    events: list = []
    async with stack(transformers_server.base_url, transformers_server.model) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", max_tokens=4,
                                                                     model="gpt-4o")):
                events.append(event)
        with pytest.raises(grpc.aio.AioRpcError) as submitted:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", model="gpt-4o"))
    assert events == []  # not even accepted
    for refused in (caught.value, submitted.value):
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        details = refused.details()
        assert "'gpt-4o' is not served here: the dispatcher serves " in details, details
        assert repr(transformers_server.model) in details, details


async def test_a_core_and_a_batch_task_are_both_served(clean_proxy_env, transformers_server):
    async with stack(transformers_server.base_url, transformers_server.model) as stub:
        core, batch = await asyncio.gather(
            run(stub, task_id="prio-core", payload=WORDY, task_type="chat", max_tokens=8, priority=agent_pb2.CORE),
            run(stub, task_id="prio-batch", payload=WORDY, task_type="chat", max_tokens=8, priority=agent_pb2.BATCH),
        )
    assert answered(core, 8) and answered(batch, 8)


async def test_a_core_task_sent_after_waiting_batch_tasks_reaches_the_server_before_them(clean_proxy_env,
                                                                                         transformers_server):
    """Priority in front of a first-come-first-served server: the dispatcher holds the upstream at its limit (here
    pinned to one stream) and orders what waits beyond it. A BATCH task holds the one stream; two BATCH tasks and
    then a CORE task wait in the dispatcher. When the slot frees, the CORE task goes to the server first, then the
    BATCH ones in their order: the server's log of requests that finished says so. Passed to the server at once,
    as before admission at the limit, the server ran them in their order of arrival, the CORE one last.

    What waits is read from the dispatcher's scheduler, not from ``switchyard_waiting_sequences``: that gauge is a
    report the busy loop publishes at most every ``STATS_INTERVAL_S``, and one published as the holder arrived
    counted it waiting until the next, after its admission; so c was sent before b had reached the dispatcher,
    and the server saw d, c, b."""
    server = transformers_server
    limits = {"concurrency.max_limit": 1, "concurrency.initial_limit": 1}
    dispatchers: list = []
    async with stack(server.base_url, server.model, dispatchers=dispatchers, **limits) as stub:
        scheduler = dispatchers[0].scheduler

        def waiting() -> list[str]:  # buffered and queued, by arrival: the order each class is served in
            return [req.request_id for req in sorted((*scheduler.queue, *scheduler.intake), key=lambda r: r.arrival)]

        holder = stub.RunTask(agent_pb2.RunTaskRequest(task_id="order-a", payload=WORDY, task_type="chat",
                                                       max_tokens=2000, priority=agent_pb2.BATCH))
        async for event in holder:
            if event.HasField("token"):
                break
        waits = []
        for task_id, priority in (("order-b", agent_pb2.BATCH), ("order-c", agent_pb2.BATCH),
                                  ("order-d", agent_pb2.CORE)):
            waits.append(asyncio.ensure_future(run(stub, task_id=task_id, payload=WORDY, task_type="chat",
                                                   max_tokens=4, priority=priority)))
            for _ in range(3000):  # in the dispatcher's queue, in this order, while the holder streams on
                if any(request_id.startswith(task_id) for request_id in waiting()):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail(f"{task_id} never waited in the dispatcher: {server.log_tail()}")
        queued = waiting()
        holder.cancel()
        for events in await asyncio.gather(*waits):
            answered(events, 4)
    assert [request_id.split(":")[0] for request_id in queued] == ["order-b", "order-c", "order-d"], queued
    finished = re.compile(r"Request (order-\w):0 finished")
    for _ in range(200):  # the log line may trail the last chunk by a moment
        order = finished.findall(server.log_tail(200_000))
        if len(order) == 3:
            break
        await asyncio.sleep(0.05)
    assert order == ["order-d", "order-b", "order-c"], (queued, server.log_tail())


async def test_a_task_cut_at_max_tokens_says_so(clean_proxy_env, transformers_server):
    """transformers serve ends a stream cut at max_tokens with finish_reason "length"; the task's final event
    carries it (it was dropped at the orchestrator: a cut answer read as a finished one)."""
    async with stack(transformers_server.base_url, transformers_server.model) as stub:
        events = await run(stub, payload=WORDY, task_type="chat", max_tokens=4)
    assert answered(events, 4) and events[-1].final.finish_reason == "length"


TINY_WINDOW = {"limits.default_context_window_tokens": 4096}
"""The tiny Llama's max_position_embeddings (transformers serve reports no window)."""


async def test_a_prompt_the_servers_tokenizer_counts_past_its_window_is_caught_by_switchyard(clean_proxy_env,
                                                                                        transformers_server):
    """The tiny Llama's BPE counts ``"word " * n`` as about twice the tokens of Switchyard's cl100k count. After one
    call the dispatcher has measured that (the server's usage.prompt_tokens beside the count sent), and the
    orchestrator checks prompts against the model's 4,096 positions in the server's tokens: a prompt that fits
    as cl100k counts it but not as the server does is refused by Switchyard, naming the payload (it went to the
    server and failed there), a max_tokens that does not fit beside a prompt is named, and one that fits is
    served."""
    async with stack(transformers_server.base_url, transformers_server.model, overrides=TINY_WINDOW) as stub:
        events = await run(stub, task_id="ratio-learn", payload="word " * 400, task_type="chat", max_tokens=2)
        served = events[-1].final.usage.prompt_tokens
        assert served > 2 * 400  # the server's count: what the window must hold

        with pytest.raises(grpc.aio.AioRpcError) as refused:  # 3,000 cl100k tokens: about 6,000 of the server's
            await run(stub, task_id="ratio-past", payload="word " * 3000, task_type="chat", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        message = refused.value.details()
        assert message.startswith("payload: expected a prompt of at most ")
        assert "of the model server's" in message and "tokens per token of Switchyard's count" in message

        with pytest.raises(grpc.aio.AioRpcError) as refused:  # fits beside the default, not beside 1,000 more
            await run(stub, task_id="ratio-max", payload="word " * 1700, task_type="chat", max_tokens=1000)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("max_tokens: expected 0 (the default, 128) to ")

        events = await run(stub, task_id="ratio-fits", payload="word " * 1500, task_type="chat", max_tokens=2)
        assert 2 * 1500 < events[-1].final.usage.prompt_tokens <= 4096 - 2


async def test_an_agents_memory_the_server_would_count_past_its_window_is_left_out(clean_proxy_env,
                                                                               transformers_server, redis_db):
    """An agent's second task recalls its first (its payload cut to memory's 4,000 characters): about 2,350
    tokens as cl100k counts them, fitting 4,096 beside max_tokens, about 4,650 as the tiny Llama counts them.
    With the ratio measured on the first task, memory is left out and the task is served within the model's
    positions (it was sent whole, past them)."""
    overrides = {**TINY_WINDOW, **redis_db.overrides}
    async with stack(transformers_server.base_url, transformers_server.model, overrides=overrides) as stub:
        first = await run(stub, task_id="mem-1", payload="word " * 1500, task_type="chat", agent_id="tf-mem",
                          max_tokens=2)
        assert 2 * 1500 < first[-1].final.usage.prompt_tokens <= 4096 - 2
        second = await run(stub, task_id="mem-2", payload="word " * 1500, task_type="chat", agent_id="tf-mem",
                           max_tokens=2)
    assert "recall" in {e.stage.name for e in second if e.HasField("stage")}
    assert first[-1].final.usage.prompt_tokens == second[-1].final.usage.prompt_tokens  # served without memory


async def test_a_cancelled_run_task_cancels_the_upstream_request(clean_proxy_env, transformers_server):
    """Task A (max_tokens N) is cancelled after its first token; task B (N + 32) then runs to its end.

    The server decodes A and B one token per step in the same batch, and A started first: had A kept
    generating, it would have finished at least 32 steps before B, logging "Request cancel-a:0 finished".
    When B's finish is logged, A's is absent: the server stopped generating A (the session's server logs
    each request that ends by itself: tests/conftest.py).
    """
    server = transformers_server
    n = 200
    async with stack(server.base_url, server.model) as stub:
        call = stub.RunTask(agent_pb2.RunTaskRequest(task_id="cancel-a", payload=WORDY, task_type="chat",
                                                     max_tokens=n))
        async for event in call:
            if event.HasField("token"):
                break
        call.cancel()
        events = await run(stub, task_id="cancel-b", payload=WORDY, task_type="chat", max_tokens=n + 32)
    assert events[-1].final.usage.completion_tokens == n + 32
    finished = re.compile(r"Request (\S+) finished: .*decode_len = (\d+)")
    for _ in range(200):  # the log line may trail the last chunk by a moment
        done = {m.group(1): int(m.group(2)) for m in finished.finditer(server.log_tail(200_000))}
        if "cancel-b:0" in done:
            break
        await asyncio.sleep(0.05)
    assert done.get("cancel-b:0") == n + 32, server.log_tail()
    assert "cancel-a:0" not in done, done


def test_doctor_against_transformers_serve(clean_proxy_env, transformers_server, tmp_path, capsys, monkeypatch):
    """Detected as transformers serve; the stream without [DONE] passes; forward_priority with the server
    named vllm by mistake is named as a refused field."""
    import json
    import shutil

    from switchyard.gateway import doctor

    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")  # the gateway in use: its checks decide the exit code

    config = tmp_path / "config"
    shutil.copytree(Path(__file__).resolve().parents[1] / "config", config)
    queue = json.loads((config / "queue.json").read_text())
    queue["model_gateway"].update(base_url=transformers_server.base_url, default_model=transformers_server.model,
                                  fallback_model="", model_map={}, api_key_required=False)
    (config / "queue.json").write_text(json.dumps(queue))
    code, out = doctor.main(["--config-dir", str(config)]), capsys.readouterr().out
    assert code == 0, out
    assert "transformers (detected from GET /models)" in out
    assert "ended after its finish_reason without data: [DONE] (a finished stream)" in out
    assert re.search(r"^ok +tools +a request offering a tool is accepted", out, re.M), out  # react_loop's calls
    queue["model_gateway"].update(forward_priority=True, server="vllm")
    (config / "queue.json").write_text(json.dumps(queue))
    code, out = doctor.main(["--config-dir", str(config)]), capsys.readouterr().out
    assert code == 1 and "FAIL  request field priority" in out and "Unexpected fields" not in out.split("FAIL")[0]


def _requests_waiting(port: int) -> int:
    """Connections to the server on ``port`` holding request bytes it has not read (Linux ``/proc/net/tcp``):
    a stopped server reads nothing, so each request sent to it since it stopped is one of them."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, state, rx_queue = int(fields[1].split(":")[1], 16), fields[3], int(fields[4].split(":")[1], 16)
        if local_port == port and state != "0A" and rx_queue > 0:  # 0A: the listening socket
            count += 1
    return count


async def test_a_retry_the_stalled_server_still_holds_the_first_attempt_of_is_served(clean_proxy_env,
                                                                                   transformers_server):
    """The server stalls past read_timeout_s before the first token (stopped: a pause, a swap storm): the first
    attempt times out and the retry is sent while the server still holds the first. transformers serve keys a
    request by its X-Request-Id; each attempt had the same one, and once the server ran again one of the two
    got no more output (the retry failed 'timed out ... after 1 streamed item(s)') or took the other's tokens
    too (202 tokens of a max_tokens 200 call). Each attempt has its own id: the retry streams its own answer."""
    import os
    import signal

    from gateway_fixtures import gateway_config
    from switchyard.common.priority import PriorityClass
    from switchyard.gateway.client import GatewayClient
    from switchyard.gateway.events import Token

    server = transformers_server
    cfg = gateway_config(server.base_url, default_model=server.model, fallback_model="", max_retries=1,
                         read_timeout_s=2.0)
    request = ChatRequest(messages=[{"role": "user", "content": WORDY}], max_tokens=64,
                          priority=PriorityClass.NORMAL, agent_id="stalled", request_id="stalled-task:0")
    async with GatewayClient(cfg) as client:
        await _collect(client.stream_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=1)))
        await asyncio.gather(*client.pool._tasks)  # its one /metrics read done: no request but the call's waits
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            call = asyncio.ensure_future(_collect(client.stream_chat(request)))
            while _requests_waiting(server.port) < 2 and not call.done():  # both attempts sent to it
                await asyncio.sleep(0.05)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        events = await call
    tokens = [e for e in events if isinstance(e, Token)]
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
    assert len(tokens) == 64 and events[-1].usage.completion_tokens == 64


async def test_calls_beside_the_probe_of_a_server_back_from_a_stall_are_served(clean_proxy_env, transformers_server):
    """The server stalls (stopped), a call times out and opens the circuit; once the server runs again and the open
    period is over, three calls arrive at once with no fallback model: one is the half-open probe, and the other
    two wait for its outcome and are served. They were refused UNAVAILABLE ("half-open with its 1 probe(s) in
    flight") while the probe beside them was served, the server back."""
    cooldown = {"enabled": True, "failures": 1, "first_cooldown_s": 0.5, "cooldown_s": 0.5, "half_open_probes": 1}
    async with _stalled_once(transformers_server, cooldown) as (client, endpoint, model):
        while endpoint.cooldowns.refusing(model):  # the open period (0.5 s) ends; no call meanwhile
            await asyncio.sleep(0.05)
        answers = await asyncio.gather(*(_collect(client.stream_chat(_short())) for _ in range(3)),
                                       return_exceptions=True)
    assert all(isinstance(a, list) and isinstance(a[-1], Finished) for a in answers), answers
    assert endpoint.cooldowns.state(model) == "closed"


async def test_the_first_calls_after_a_stalled_server_runs_again_are_served(clean_proxy_env, transformers_server):
    """The server stalls (stopped) and a call times out: the circuit opens for 60 s. Once the server runs again,
    with no call arriving, its health check half-opens the circuit, and the first three calls sent are served.
    The check started only on a refused call: the calls arriving first after the server's return were refused
    "cooling down ... skipped for N s more, or until it answers again", the server back."""
    cooldown = {"enabled": True, "failures": 1, "first_cooldown_s": 60.0, "cooldown_s": 60.0,
                "health_check_interval_s": 0.2}
    async with _stalled_once(transformers_server, cooldown) as (client, endpoint, model):
        for _ in range(600):  # checked every 0.2 s: half-open once one answers (60 s open period otherwise)
            if endpoint.cooldowns.state(model) != "open":
                break
            await asyncio.sleep(0.05)
        assert endpoint.cooldowns.state(model) == "half_open"
        answers = await asyncio.gather(*(_collect(client.stream_chat(_short())) for _ in range(3)),
                                       return_exceptions=True)
    assert all(isinstance(a, list) and isinstance(a[-1], Finished) for a in answers), answers
    assert endpoint.cooldowns.state(model) == "closed"


def _short() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": WORDY}], max_tokens=8)


@contextlib.asynccontextmanager
async def _stalled_once(server, cooldown: dict):
    """A gateway client in front of ``server`` (no fallback, no retry, 1 s read timeout, ``cooldown``) whose one call
    timed out while the server was stopped (SIGSTOP): the circuit opened. Yields (client, its endpoint, the
    model) once the server runs again (SIGCONT)."""
    import os
    import signal

    from gateway_fixtures import gateway_config
    from switchyard.gateway.client import GatewayClient

    cfg = gateway_config(server.base_url, default_model=server.model, fallback_model="", max_retries=0,
                         read_timeout_s=1.0, cooldown=cooldown)
    async with GatewayClient(cfg) as client:
        await _collect(client.stream_chat(_short()))
        await asyncio.gather(*client.pool._tasks)  # its one /metrics read done
        endpoint = next(iter(client.pool.endpoints.values()))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(GatewayError, match="timed out"):
                await _collect(client.stream_chat(_short()))
            assert endpoint.cooldowns.state(server.model) == "open"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        yield client, endpoint, server.model


async def _collect(events) -> list:
    return [e async for e in events]
