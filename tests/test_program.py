"""The orchestrator's view of a task's program, against real gRPC servers on 127.0.0.1 port 0: tool
durations and the ToolWait announcement, tenants, deadline budgets and early refusal, rag_answer's
early prefill, and the dispatcher's side of the contract (ToolWait field checks, prefill_only; ToolWait's
decisions: test_tool_wait_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import httpx
import grpc
import numpy as np
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.auth import AuthConfigError, load_tokens
from switchyard.common.channels import open_channel
from switchyard.common.config import AuthConfig, ConfigError, ProgramConfig, SwitchyardConfig, load_config
from switchyard.common.server import running
from switchyard.dispatcher.metrics import PREFIX_CACHE_BLOCKS, REFUSED_EARLY
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator import prompts
from switchyard.orchestrator.http_face import HttpFace
from switchyard.orchestrator.metrics import EARLY_PREFILLS, TOOL_WAIT_HINTS
from switchyard.orchestrator.program import (
    TASKS_REFUSED_EARLY, TOOL_DURATION, TOOL_WAIT_ESTIMATE, Program, ToolDurations,
)
from switchyard.orchestrator.service import OrchestratorService
from switchyard.orchestrator.tokens import count_added_messages, count_messages
from test_orchestrator import Downstream
from fast_sim import FAST
from orchestrator_fixtures import orchestrator_config


def _value(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


def _hist_count(metric, **labels) -> float:
    return next(s.value for m in metric.collect() for s in m.samples
                if s.name.endswith("_count") and s.labels == labels)


async def _until(predicate, what: str = "condition") -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


class Recording(Downstream):
    """The fixed downstream of test_orchestrator, with ToolWait answered (or held on ``tool_wait_gate``)
    and DescribeModel saying whether its engine shares prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.tool_waits: list[agent_pb2.ToolWaitRequest] = []
        self.tool_wait_gate: asyncio.Event | None = None
        self.shares_prefixes = False
        self.generate_delay_s = 0.0

    async def DescribeModel(self, request, context):
        self.described += 1
        return agent_pb2.ModelInfo(model=self.model, engine="sim", shares_prefixes=self.shares_prefixes)

    async def ToolWait(self, request, context):
        self.tool_waits.append(request)
        if self.tool_wait_gate is not None:
            await self.tool_wait_gate.wait()
        return agent_pb2.ToolWaitReply(decision=agent_pb2.KEEP)

    async def Generate(self, request, context):
        if self.generate_delay_s:
            await asyncio.sleep(self.generate_delay_s)
        async for chunk in super().Generate(request, context):
            yield chunk


class WithoutToolWait(Downstream):
    """A dispatcher from before ToolWait: the RPC is UNIMPLEMENTED."""


@contextlib.asynccontextmanager
async def stack(down: Downstream | None = None, env: dict[str, str] | None = None, http: bool = False, **overrides):
    base = load_config("config", service="orchestrator")
    down = down or Recording()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base, **overrides) as cfg:
            orchestrator = down.orchestrator = OrchestratorService(cfg)
            services = [orchestrator]
            if http:
                down.http = HttpFace(orchestrator, cfg, port=0)
                services.append(down.http)
            async with running(services, cfg.server) as orch:
                down.orchestrator_port = orch.port
                channel = open_channel(f"127.0.0.1:{orch.port}")
                try:
                    yield agent_pb2_grpc.AgentServiceStub(channel), down
                finally:
                    await channel.close()


async def collect(stub, metadata=None, timeout=None, **fields):
    return [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(**fields), metadata=metadata, timeout=timeout)]


# --------------------------------------------------------------------------- 1. tool durations


def test_tool_estimate_is_the_configured_quantile_of_a_bounded_window_and_cold_tools_take_the_default():
    config = ProgramConfig(tool_wait_estimate_quantile=0.75, tool_wait_samples_kept=4, tool_wait_cold_estimate_s=2.5)
    durations = ToolDurations(config, ["calculator", "search_docs"])
    assert durations.expected_s("calculator") == 2.5 and durations.expected_s("search_docs") == 2.5
    assert _value(TOOL_WAIT_ESTIMATE, tool="search_docs") == 2.5
    before = _hist_count(TOOL_DURATION, tool="calculator")
    for seconds in (9.0, 1.0, 2.0, 3.0, 4.0):  # the first falls out of the 4-call window
        durations.observe("calculator", seconds)
    assert durations.expected_s("calculator") == pytest.approx(float(np.quantile([1.0, 2.0, 3.0, 4.0], 0.75)))
    assert _value(TOOL_WAIT_ESTIMATE, tool="calculator") == durations.expected_s("calculator")
    assert _hist_count(TOOL_DURATION, tool="calculator") == before + 5
    durations.observe("invented_by_the_model", 7.0)  # labels stay the registered set plus "other"
    assert durations.label("invented_by_the_model") == "other" and durations.expected_s("another_invention") == 7.0
    assert durations.expected_s("search_docs") == 2.5


# --------------------------------------------------------------------------- 2. ToolWait at tool start


async def test_a_tool_call_is_announced_to_the_agents_dispatcher_with_its_expected_wait():
    ok = _value(TOOL_WAIT_HINTS, outcome="ok")
    async with stack(**{"orchestrator.program.tool_wait_cold_estimate_s": 3.0}) as (stub, down):
        events = await collect(stub, task_id="tw-1", agent_id="agent-7", payload="with?", task_type="react_loop",
                               priority=agent_pb2.CORE, metadata=(("x-tenant-id", "acme"),))
        assert events[-1].HasField("final")
        await _until(lambda: len(down.tool_waits) == 2, "two ToolWait announcements")
        first, second = down.tool_waits
        assert (first.agent_id, first.tool, first.tenant_id, first.priority) == ("agent-7", "search_docs", "acme",
                                                                                  agent_pb2.CORE)
        assert first.expected_wait_s == 3.0 and second.tool == "calculator" and second.expected_wait_s == 3.0
        program = down.orchestrator._deps.program
        assert program.tools.expected_s("search_docs") < 3.0  # measured now: a fixed downstream answers at once
        # the next task's announcement carries the measured estimate
        await collect(stub, task_id="tw-2", agent_id="agent-7", payload="with?", task_type="react_loop")
        await _until(lambda: len(down.tool_waits) == 4, "the second task's announcements")
        assert down.tool_waits[2].expected_wait_s == program.tools.expected_s("search_docs") or \
            down.tool_waits[2].expected_wait_s < 3.0
    assert _value(TOOL_WAIT_HINTS, outcome="ok") >= ok + 4


class OneRoundOfSeveralCalls(Recording):
    """A model that asks for several tools in one step (parallel tool calls), then answers."""

    calls = (("search_docs", {"query": "with statement"}), ("invented_tool", {}), ("calculator", {"expression": "1+1"}))

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.tools and not any(m.role == "tool" for m in request.messages):
            for i, (name, arguments) in enumerate(self.calls):
                yield agent_pb2.GenerateChunk(tool_call=agent_pb2.ToolCall(
                    call_id=f"c{i}", name=name, arguments_json=json.dumps(arguments)))
        else:
            yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text="Done.", index=0))
        yield agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=1, total_tokens=11)))


async def test_each_call_of_a_round_announces_the_wait_until_the_agents_next_step():
    """The calls of one round run one after another and the agent's next step comes after the last: the wait
    each announcement tells the dispatcher is its call's expected duration plus those of the calls after it (an
    unknown tool none: answered at once). Each call announced its own alone, so the first call of a round had
    its swapped KV planned back in HBM at its own return, ahead of a turn that came after the others too, and
    its measured returns (announcement to turn) counted the other calls against its estimate."""
    async with stack(OneRoundOfSeveralCalls()) as (stub, down):
        durations = down.orchestrator._deps.program.tools
        durations.observe("search_docs", 2.0)
        durations.observe("calculator", 3.0)
        # the calls' own (quick) durations must not move the estimates between the announcements
        durations.observe = lambda *args: None
        events = await collect(stub, task_id="round", payload="with?", task_type="react_loop")
        assert events[-1].final.output == "Done."
        assert [e.tool_result.name for e in events if e.HasField("tool_result")] == [
            "search_docs", "invented_tool", "calculator"]
        await _until(lambda: len(down.tool_waits) == 2, "the two known tools' announcements")
        assert [(w.tool, w.expected_wait_s) for w in down.tool_waits] == [("search_docs", 5.0), ("calculator", 3.0)]


async def test_a_dispatcher_that_never_answers_the_announcement_does_not_delay_the_tool():
    timeouts = _value(TOOL_WAIT_HINTS, outcome="deadline_exceeded")
    down = Recording()
    down.tool_wait_gate = asyncio.Event()  # never set: ToolWait hangs
    async with stack(down, **{"orchestrator.program.tool_wait_hint_timeout_ms": 50}) as (stub, down):
        events = await collect(stub, task_id="hang", payload="with?", task_type="react_loop")
        assert events[-1].final.output == "The answer."
        results = [e.tool_result for e in events if e.HasField("tool_result")]
        assert [r.name for r in results] == ["search_docs", "calculator"] and not any(r.is_error for r in results)
        assert down.tool_waits  # announced, while the tool ran on
        await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="deadline_exceeded") >= timeouts + 2, "timeouts counted")
        down.tool_wait_gate.set()


async def test_a_dispatcher_without_tool_wait_is_counted_unimplemented_and_the_task_succeeds(caplog):
    unimplemented = _value(TOOL_WAIT_HINTS, outcome="unimplemented")
    async with stack(WithoutToolWait()) as (stub, down):
        for task_id in ("old-1", "old-2"):
            events = await collect(stub, task_id=task_id, payload="with?", task_type="react_loop")
            assert events[-1].final.output == "The answer."
        await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="unimplemented") >= unimplemented + 4, "counted")
    logged = [r for r in caplog.records if "ToolWait to the dispatcher" in r.getMessage()]
    assert len(logged) == 1 and "unimplemented" in logged[0].getMessage()  # logged once


# --------------------------------------------------------------------------- 3. tenants


async def test_tenant_from_the_header_else_default_on_every_generate_request_and_task_status():
    async with stack() as (stub, down):
        await collect(stub, task_id="t-acme", payload="hi", task_type="chat", metadata=(("x-tenant-id", "acme.eu-1"),))
        await collect(stub, task_id="t-none", payload="hi", task_type="chat")
        assert [r.tenant_id for r in down.requests] == ["acme.eu-1", "default"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload="hi", metadata=(("x-tenant-id", "no spaces/allowed"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-tenant-id" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload="hi", metadata=(("x-tenant-id", "a" * 65),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-tenant-id" in err.value.details()
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="bg-t", payload="hi", task_type="chat"),
                              metadata=(("x-tenant-id", "beta"),))
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="bg-t"))
        assert status.tenant_id == "beta"
        for _ in range(500):
            status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="bg-t"))
            if status.state == agent_pb2.SUCCEEDED:
                break
            await asyncio.sleep(0.02)
        assert status.state == agent_pb2.SUCCEEDED and status.tenant_id == "beta"
        assert down.orchestrator.tasks is not None
        record = await down.orchestrator.tasks.get("bg-t")
        assert record.tenant_id == "beta" and record.to_status().tenant_id == "beta"  # the store keeps it


async def test_a_bearer_tokens_tenant_wins_and_a_header_cannot_change_it(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "tok-acme tenant=acme,tok-plain")
    async with stack(http=True, **{"orchestrator.auth.enabled": True}) as (stub, down):
        await collect(stub, task_id="a1", payload="hi", task_type="chat", metadata=(("authorization", "Bearer tok-acme"),))
        await collect(stub, task_id="a2", payload="hi", task_type="chat",
                      metadata=(("authorization", "Bearer tok-acme"), ("x-tenant-id", "acme")))
        await collect(stub, task_id="a3", payload="hi", task_type="chat",
                      metadata=(("authorization", "Bearer tok-plain"), ("x-tenant-id", "gamma")))
        assert [r.tenant_id for r in down.requests] == ["acme", "acme", "gamma"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload="hi", metadata=(("authorization", "Bearer tok-acme"), ("x-tenant-id", "other")))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "x-tenant-id" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a malformed header is malformed, with a token too
            await collect(stub, payload="hi", metadata=(("authorization", "Bearer tok-acme"), ("x-tenant-id", "b b")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("x-tenant-id")
        for name, values in (("x-tenant-id", ("acme", "beta")), ("x-agent-id", ("a", "b")),
                             ("x-priority", ("core", "batch"))):  # twice, saying different things: refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, payload="hi", task_type="chat",
                              metadata=(("authorization", "Bearer tok-plain"), *((name, v) for v in values)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{name} header: expected one value"), err.value.details()
        await collect(stub, task_id="a5", payload="hi", task_type="chat",  # the same class, however written
                      metadata=(("authorization", "Bearer tok-plain"), ("x-priority", "core"), ("x-priority", " CORE")))
        await collect(stub, task_id="a4", payload="hi", task_type="chat",  # twice the same: one value
                      metadata=(("authorization", "Bearer tok-plain"), ("x-tenant-id", "zeta"), ("x-tenant-id", "zeta")))
        assert down.requests[-1].tenant_id == "zeta"
        # the HTTP face: the same rule, X-Tenant-Id any case
        url = f"http://127.0.0.1:{down.http.port}/api/v1/agent/run"
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": "Bearer tok-plain", "X-Tenant-Id": "delta"}
            async with session.post(url, json={"payload": "hi", "task_type": "chat", "agent_id": "agent-1"}, headers=headers) as response:
                assert response.status == 200
                await response.read()
            twice = [("Authorization", "Bearer tok-plain"), ("X-Tenant-Id", "delta"), ("x-tenant-id", "omega")]
            async with httpx.AsyncClient() as client:  # aiohttp's client keeps one of two same-named headers
                response = await client.post(url, json={"payload": "hi", "task_type": "chat", "agent_id": "agent-1"},
                                             headers=twice)
            assert response.status_code == 400
            assert response.json()["error"]["message"].startswith("x-tenant-id header: expected one value")
            headers["X-Tenant-Id"] = "bad tenant"
            async with session.post(url, json={"payload": "hi", "task_type": "chat", "agent_id": "agent-1"}, headers=headers) as response:
                assert response.status == 400
                assert "x-tenant-id" in (await response.json())["error"]["message"]
        assert down.requests[-1].tenant_id == "delta"


async def test_a_tenants_token_reads_only_its_own_tasks_status(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "tok-acme tenant=acme,tok-beta tenant=beta,tok-plain")
    acme, beta, plain = ((("authorization", f"Bearer tok-{t}"),) for t in ("acme", "beta", "plain"))
    async with stack(http=True, **{"orchestrator.auth.enabled": True}) as (stub, down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-acme", agent_id="ag-acme", payload="hi",
                                                       task_type="chat", max_tokens=4), metadata=acme)
        for key in ({"task_id": "t-acme"}, {"agent_id": "ag-acme"}):
            # its tenant, and a token that names none (an agent is its tenant's: looked up in the tenant named)
            for own in (acme, plain + (("x-tenant-id", "acme"),)):
                status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(**key), metadata=own)
                assert status.task_id == "t-acme" and status.tenant_id == "acme"
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(**key), metadata=beta)
            missing = {"task_id": "t-none"} if "task_id" in key else {"agent_id": "ag-none"}
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(**missing), metadata=beta)
            assert other.value.code() == unknown.value.code() == grpc.StatusCode.NOT_FOUND
            # another tenant's task reads exactly as one that does not exist
            assert other.value.details() == unknown.value.details().replace("-none'", "-acme'")
        with pytest.raises(grpc.aio.AioRpcError) as other:  # nor cancel it
            await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="t-acme"), metadata=beta)
        assert other.value.code() == grpc.StatusCode.NOT_FOUND and "'t-acme'" in other.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as taken:  # nor learn of it by submitting under its id
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-acme", agent_id="ag-acme", payload="hi",
                                                           task_type="chat", max_tokens=4), metadata=beta)
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "is taken" in taken.value.details() and "different request" not in taken.value.details()
        again = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-acme", agent_id="ag-acme", payload="hi",
                                                               task_type="chat", max_tokens=4), metadata=acme)
        assert again.task_id == "t-acme"  # its own tenant's identical request still answers the task
        with pytest.raises(grpc.aio.AioRpcError) as other:  # a token naming no tenant sees acme's: says whose
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-acme", agent_id="ag-acme", payload="hi",
                                                           task_type="chat", max_tokens=4), metadata=plain)
        assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "under tenant 'acme'" in other.value.details() and "x-tenant-id: acme" in other.value.details()
        async with aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{down.http.port}/api/v1"
            async with session.post(base + "/tasks/t-acme/cancel", headers={"Authorization": "Bearer tok-beta"}) as response:
                assert response.status == 404
            for path in ("/tasks/t-acme", "/agent/ag-acme/status"):
                async with session.get(base + path, headers={"Authorization": "Bearer tok-beta"}) as response:
                    assert response.status == 404
                async with session.get(base + path, headers={"Authorization": "Bearer tok-acme"}) as response:
                    assert response.status == 200 and (await response.json())["task_id"] == "t-acme"


async def test_a_lookup_by_task_id_refuses_an_x_tenant_id_submit_would_refuse(monkeypatch):
    """GetTaskStatus and CancelTask by task_id never read the header: 'bad/tenant', or 'a' and 'b' at once,
    answered the task (200 over HTTP) where SubmitTask and an agent's lookup answered 400; a tenant's token
    with a header naming another tenant read the task where SubmitTask answered PERMISSION_DENIED."""
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "tok-acme tenant=acme,tok-plain")
    acme = (("authorization", "Bearer tok-acme"),)
    plain = (("authorization", "Bearer tok-plain"),)
    async with stack(http=True, **{"orchestrator.auth.enabled": True}) as (stub, down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="t-look", payload="hi", task_type="chat",
                                                       max_tokens=4), metadata=acme)
        for metadata, code in ((plain + (("x-tenant-id", "bad/tenant"),), grpc.StatusCode.INVALID_ARGUMENT),
                               (plain + (("x-tenant-id", "a"), ("x-tenant-id", "b")), grpc.StatusCode.INVALID_ARGUMENT),
                               (acme + (("x-tenant-id", "beta"),), grpc.StatusCode.PERMISSION_DENIED)):
            for call, request in ((stub.GetTaskStatus, agent_pb2.GetTaskStatusRequest(task_id="t-look")),
                                  (stub.CancelTask, agent_pb2.CancelTaskRequest(task_id="t-look"))):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request, metadata=metadata)
                assert refused.value.code() == code, refused.value.details()
                assert "x-tenant-id" in refused.value.details()
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{down.http.port}/api/v1/tasks/t-look"
            headers = [("Authorization", "Bearer tok-plain"), ("X-Tenant-Id", "a"), ("X-Tenant-Id", "b")]
            async with session.get(url, headers=headers) as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"].startswith("x-tenant-id header: expected one value")
            async with session.post(url + "/cancel", headers=headers) as response:
                assert response.status == 400
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="t-look"), metadata=acme)
        assert status.task_id == "t-look" and status.state != agent_pb2.FAILED  # the refused cancels did nothing


def test_token_lines_name_at_most_one_well_formed_tenant(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("tok-a tenant=acme agent.AgentService/RunTask\ntok-b\n")
    tokens = load_tokens(AuthConfig(enabled=True, tokens_file=str(path), tokens_env=""))
    assert [(t.tenant, t.methods) for t in tokens] == [("acme", ("agent.AgentService/RunTask",)), ("", ())]
    for bad in ("tok tenant=a tenant=b", "tok tenant=has/slash", "tok tenant="):
        path.write_text(bad + "\n")
        with pytest.raises(AuthConfigError, match="line 1: expected at most one tenant"):
            load_tokens(AuthConfig(enabled=True, tokens_file=str(path), tokens_env=""))


# --------------------------------------------------------------------------- 4. deadline budgets


async def test_each_model_step_carries_time_left_and_the_measured_work_after_it():
    async with stack(**{"orchestrator.task_time_limit_s": {"chat": 120, "rag_answer": 180, "react_loop": 600}}) \
            as (stub, down):
        await collect(stub, task_id="r1", payload="with?", task_type="react_loop")
        first = [r for r in down.requests if r.request_id.startswith("r1:")]
        assert len(first) == 3 and all(0 < r.task_time_left_s <= 600 for r in first)
        assert all(r.expected_remaining_work_s == 0 for r in first)  # nothing measured yet: no guess
        program = down.orchestrator._deps.program
        assert program.steps.mean_turns() == 3 and program.steps.mean("react_loop", "model") > 0
        assert program.steps.mean("react_loop", "tool") > 0 and program.steps.mean("react_loop", "retrieval") > 0
        # r2's own steps would move the means between its steps (wall-clock times): hold them at r1's
        step = program.steps.mean("react_loop", "model") + program.steps.mean("react_loop", "tool")
        program.steps.observe = lambda *args: None
        await collect(stub, task_id="r2", payload="with?", task_type="react_loop")
        second = [r for r in down.requests if r.request_id.startswith("r2:")]
        work = [r.expected_remaining_work_s for r in second]
        assert work == pytest.approx([2 * step, step, 0])  # two steps left, then one, then none
        await collect(stub, task_id="c1", payload="hi", task_type="chat")
        assert down.requests[-1].expected_remaining_work_s == 0 and 0 < down.requests[-1].task_time_left_s <= 120


async def test_a_task_that_cannot_make_its_deadline_on_the_measured_means_is_refused_early_by_name():
    refused = _value(TASKS_REFUSED_EARLY, task_type="chat")
    async with stack() as (stub, down):
        program = down.orchestrator._deps.program
        program.steps.observe("chat", "model", 100.0)  # a measured chat model step takes 100 s
        generates = len(down.requests)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, task_id="doomed", payload="hi", task_type="chat", timeout=30)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = err.value.details()
        assert "task 'doomed' refused early" in details and "s left" in details and "100.000 s of work expected" in details
        assert "before its deadline (the caller's gRPC deadline)" in details  # what to give more time: named
        assert len(down.requests) == generates  # never sent to the dispatcher
        assert _value(TASKS_REFUSED_EARLY, task_type="chat") == refused + 1
        # within 50 ms of its deadline the refusal was reported as "ran out of time after 0.0008 s"
        # (a busy machine may let the 40 ms pass before the refusal is made: then it did run out of time)
        said = []
        for attempt in range(5):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, task_id=f"close-{attempt}", payload="hi", task_type="chat", timeout=0.04)
            said.append(err.value.details() or "")
            if "refused early" in said[-1]:
                break
        assert "refused early" in said[-1], said
        # a task with time for it runs (the chat limit is 120 s; the measured step 100 s)
        events = await collect(stub, task_id="fits", payload="hi", task_type="chat", timeout=200)
        assert events[-1].HasField("final")
    async with stack(**{"orchestrator.program.refuse_early": False}) as (stub, down):
        down.orchestrator._deps.program.steps.observe("chat", "model", 100.0)
        events = await collect(stub, task_id="served", payload="hi", task_type="chat", timeout=30)
        assert events[-1].HasField("final")


async def test_a_refusal_names_the_time_limit_key_that_set_the_deadline():
    """A caller with no deadline of its own (the HTTP face's, a gRPC call without one) has its task type's time
    limit as its deadline: the refusal said only "s left before its deadline", and an operator whose agents were
    refused could not tell whether to raise orchestrator.task_time_limit_s or the callers' deadlines (the task
    that ran out of time named it: TaskDeadlineExceeded). Each workflow's refusal names the key and its value."""
    limits = {"chat": 10, "rag_answer": 11, "react_loop": 12}
    down = Recording()
    down.shares_prefixes = True  # rag_answer's refusal at its start, beside its warm-up
    async with stack(down, **{"orchestrator.task_time_limit_s": limits}) as (stub, down):
        program = down.orchestrator._deps.program
        for task_type in limits:
            program.steps.observe(task_type, "model", 100.0)  # a measured model step takes 100 s
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, task_id=f"limited-{task_type}", payload="with?", task_type=task_type)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            details = err.value.details()
            assert f"task 'limited-{task_type}' refused early" in details, details
            assert f"before its deadline (orchestrator.task_time_limit_s.{task_type} = {limits[task_type]})" in details


async def test_each_generate_names_what_set_its_tasks_deadline():
    """A model step's upstream refusals that cite the call's deadline (a retry after a 429 that would outlast it)
    said only "the call's deadline": the dispatcher's gateway did not know whether the task's time limit or its
    caller's deadline had set it. Each GenerateRequest carries it, as the task's own out-of-time errors name it."""
    down = Recording()
    limits = {"chat": 30, "rag_answer": 31, "react_loop": 32}
    async with stack(down, **{"orchestrator.task_time_limit_s": limits}) as (stub, down):
        await collect(stub, task_id="by-limit", payload="hi", task_type="chat")
        await collect(stub, task_id="by-caller", payload="hi", task_type="chat", timeout=20)
    sources = {r.request_id.split(":")[0]: r.deadline_source for r in down.requests}
    assert sources == {"by-limit": "orchestrator.task_time_limit_s.chat = 30",
                       "by-caller": "the caller's gRPC deadline"}, sources


async def test_a_rag_answer_task_that_cannot_make_its_deadline_is_refused_before_its_retrieval_and_warm_up():
    """rag_answer's work is its retrieval and its model step: a task whose time left is below them was let
    start its retrieval (and its prefill-only warm-up, sent with no refusal check) and was refused only at its
    model step, after the retrieval had run, or ran out of time in the retrieval (the caller's gRPC deadline,
    not a refusal by name). It is refused at its start now, before any of that work."""
    refused = _value(TASKS_REFUSED_EARLY, task_type="rag_answer")
    down = Recording()
    down.shares_prefixes = True
    async with stack(down) as (stub, down):
        program = down.orchestrator._deps.program
        program.steps.observe("rag_answer", "retrieval", 100.0)  # a measured retrieval takes 100 s
        queries, generates = len(down.queries), len(down.requests)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, task_id="doomed-rag", payload="with?", task_type="rag_answer", timeout=30)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "task 'doomed-rag' refused early" in err.value.details()
        assert "100.000 s of work expected" in err.value.details()
        await asyncio.sleep(0.05)  # a warm-up would have been sent by now
        assert len(down.queries) == queries  # no retrieval was run for it
        assert len(down.requests) == generates  # nor any request (warm-up or answer) sent to the dispatcher
        assert _value(TASKS_REFUSED_EARLY, task_type="rag_answer") == refused + 1
        # one with time for it runs, its warm-up carrying the retrieval and the model step as its work after it
        events = await collect(stub, task_id="fits-rag", payload="with?", task_type="rag_answer", timeout=200)
        assert events[-1].HasField("final")
        warm = [r for r in down.requests if r.request_id.startswith("fits-rag") and r.prefill_only]
        assert len(warm) == 1 and warm[0].expected_remaining_work_s >= 100.0
        assert 0 < warm[0].task_time_left_s <= 200


async def test_a_short_answer_is_not_refused_on_the_measured_time_of_long_ones():
    """A model step's time grows with the tokens it makes: a chat asking 5 tokens was refused DEADLINE_EXCEEDED
    with 0.5 s left because the mean chat step, taken over earlier 3,000-token answers, was 0.57 s (in front of
    a real model server, where a 3-token step takes 60 ms). A measured step counts at most the share of its
    time that the step about to start could take (its max_tokens of the tokens the measured one made), for each
    workflow (chat, rag_answer's model step after its retrieval); a step asking as many tokens is still refused."""
    for task_type in ("chat", "rag_answer"):
        async with stack() as (stub, down):
            program = down.orchestrator._deps.program
            program.steps.observe(task_type, "model", 100.0, 1000)  # a 1,000-token answer took 100 s
            events = await collect(stub, task_id=f"short-{task_type}", payload="with?", task_type=task_type,
                                   max_tokens=5, timeout=30)
            assert events[-1].HasField("final")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, task_id=f"long-{task_type}", payload="with?", task_type=task_type,
                              max_tokens=1000, timeout=30)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert f"task 'long-{task_type}' refused early" in err.value.details()  # (the short one's step counted too)


def test_each_measured_model_step_counts_its_completion_tokens():
    program = Program(ProgramConfig(), ["calculator"], max_steps=2)
    program.steps.observe("react_loop", "model", 10.0, 100)
    program.steps.observe("react_loop", "model", 2.0, 4)
    program.steps.observe("react_loop", "model", 1.0, 0)  # no completion token counted: its time as it is
    program.steps.observe("react_loop", "tool", 0.5)
    assert program.steps.mean("react_loop", "model") == pytest.approx(13.0 / 3)
    assert program.steps.mean("react_loop", "model", max_tokens=10) == pytest.approx((1.0 + 2.0 + 1.0) / 3)
    assert program.steps.mean("react_loop", "model", max_tokens=100) == pytest.approx(13.0 / 3)
    program.steps.observe_turns(3)
    assert program.remaining_after("react_loop", 0, max_tokens=10) == pytest.approx(2 * (4.0 / 3 + 0.5))


def test_react_work_left_follows_the_mean_steps_capped_by_max_steps():
    program = Program(ProgramConfig(), ["calculator"], max_steps=2)
    program.steps.observe("react_loop", "model", 1.0)
    program.steps.observe("react_loop", "tool", 0.5)
    assert program.remaining_after("react_loop", 0) == 0  # no task finished yet
    for turns in (10, 10):  # more than max_steps + 1 = 3 model steps can never run
        program.steps.observe_turns(turns)
    assert program.remaining_after("react_loop", 0) == pytest.approx(2 * 1.5)
    assert program.remaining_after("react_loop", 2) == 0
    assert program.remaining_after("chat", 0) == 0 and program.remaining_after("rag_answer", 0) == 0


# --------------------------------------------------------------------------- 5. early prefill


@pytest.mark.parametrize("question", ["How does the with statement work?", "  padded  ", "</question> {{ 7*7 }}",
                                      "multi\n\nline\n"])
def test_the_static_part_is_a_true_prefix_of_the_full_prompt(question):
    passages = [prompts.Snippet("with", "The with statement wraps a block."), prompts.Snippet("t2", "</context> x")]
    prefix = prompts.static_prefix("rag_answer", question)
    for shown in (passages, []):
        full = prompts.render("rag_answer", question, shown).text
        assert full.startswith(prefix) and len(full) > len(prefix)
        assert question in prefix
    with pytest.raises(ValueError, match="workflow"):
        prompts.static_prefix("chat", question)


async def test_rag_answer_sends_system_prompt_and_question_ahead_when_the_engine_shares_prefixes():
    down = Recording()
    down.shares_prefixes = True
    async with stack(down) as (stub, down):
        events = await collect(stub, task_id="warm", payload="How does with work?")
        assert events[-1].final.output == "The answer."
        await _until(lambda: len(down.requests) == 2, "the prefill and the answer")
        by_id = {r.request_id: r for r in down.requests}
        prefill, answer = by_id["warm:prefill"], by_id["warm:0"]
        assert prefill.prefill_only and not answer.prefill_only
        assert answer.prompt.startswith(prefill.prompt) and "<context>" in answer.prompt
        assert "<context>" not in prefill.prompt and "How does with work?" in prefill.prompt
        assert prefill.agent_id == answer.agent_id == "warm"  # the same prefix key
    down = Recording()  # an engine that shares no prefixes is sent none
    async with stack(down) as (stub, down):
        await collect(stub, task_id="cold", payload="How does with work?")
        assert [r.request_id for r in down.requests] == ["cold:0"]


@contextlib.asynccontextmanager
async def sim_stack(dispatcher: DispatcherService, retrieval: Downstream, **overrides):
    """(AgentService stub, InferenceService stub) of a real orchestrator in front of ``dispatcher`` and the fake
    ``retrieval``, all on 127.0.0.1 port 0; ``overrides``: the orchestrator's config (dotted keys)."""
    base = load_config("config", service="orchestrator")
    async with running([dispatcher], base.server) as disp, running([retrieval], base.server) as retr:
        with orchestrator_config(f"127.0.0.1:{retr.port}", f"127.0.0.1:{disp.port}", base, **overrides) as cfg:
            async with running([OrchestratorService(cfg)], cfg.server) as orch:
                channel, direct = open_channel(f"127.0.0.1:{orch.port}"), open_channel(f"127.0.0.1:{disp.port}")
                try:
                    yield agent_pb2_grpc.AgentServiceStub(channel), agent_pb2_grpc.InferenceServiceStub(direct)
                finally:
                    await channel.close()
                    await direct.close()


async def test_against_the_sim_dispatcher_the_answer_extends_the_prefix_the_prefill_left_warm():
    """The real dispatcher with the sim engine's prefix cache: retrieval answers only once the prefill is
    done, and the answer's prompt then finds the system prompt + question blocks cached."""
    ok = _value(EARLY_PREFILLS, outcome="ok")
    dispatcher = DispatcherService(SwitchyardConfig().with_overrides(**FAST))

    class SlowRetrieval(Downstream):
        async def Retrieve(self, request, context):
            await _until(lambda: _value(EARLY_PREFILLS, outcome="ok") > ok, "the prefill finished")
            return await super().Retrieve(request, context)

    async with sim_stack(dispatcher, SlowRetrieval()) as (stub, _):
        question = "How does the with statement work in Python, and what does it call on the manager?"
        hits = _value(PREFIX_CACHE_BLOCKS, result="hit")
        events = await collect(stub, task_id="sim-warm", payload=question)
    assert events[-1].HasField("final") and events[-1].final.output
    static_blocks = len(prompts.static_prefix("rag_answer", question).split()) // 16
    assert static_blocks >= 2 and _value(PREFIX_CACHE_BLOCKS, result="hit") >= hits + static_blocks


@pytest.mark.parametrize("program, refused", [
    ({}, True),
    ({"orchestrator.program.refuse_early": False}, False),
    ({"orchestrator.program.refuse_early_margin_s": 1000.0}, False),  # short by 740 s: within the margin
    ({"orchestrator.program.refuse_early_margin_s": 500.0}, True),
])
async def test_the_orchestrators_refusal_settings_hold_at_the_fair_dispatcher_too(program, refused):
    """orchestrator.program.refuse_early off says: serve a task whatever the estimates of its work say (its time
    limit still ends it); refuse_early_margin_s: tolerate that much shortfall. The orchestrator followed them, but
    the fair dispatcher refused the same step on its own estimate at any negative slack (DEADLINE_EXCEEDED
    "cannot meet its task's deadline"), so the keys changed only who refused. Each request now carries them
    (GenerateRequest.no_early_refusal, early_refusal_margin_s): ordered by its slack still, refused only as the
    orchestrator's settings say."""
    dispatcher = DispatcherService(SwitchyardConfig().with_overrides(**FAST, **{"scheduler.policy": "fair"}))
    async with sim_stack(dispatcher, Downstream(), **program) as (stub, _):
        await collect(stub, task_id="warm", payload="hi", task_type="chat", max_tokens=8)
        dispatcher.loop.scheduler._step_s = 100.0  # a measured decode step of 100 s: 8 tokens take 800 s
        before = _value(REFUSED_EARLY, priority_class="normal")
        if refused:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, task_id="late", payload="hi", task_type="chat", max_tokens=8, timeout=60)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # whose deadline: the caller's (60 s), below the task type's time limit
            assert "cannot meet its task's deadline (the caller's gRPC deadline)" in err.value.details()
        else:
            events = await collect(stub, task_id="late", payload="hi", task_type="chat", max_tokens=8, timeout=60)
            assert events[-1].HasField("final")
        assert _value(REFUSED_EARLY, priority_class="normal") == before + refused


def test_a_direct_callers_refusal_margin_is_checked_naming_the_field():
    from switchyard.common.errors import InvalidArgument
    from switchyard.dispatcher.processor import to_request

    config = SwitchyardConfig()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as err:
            to_request(agent_pb2.GenerateRequest(request_id="r", prompt="hi", early_refusal_margin_s=bad), config,
                       "sim-7b")
        assert str(err.value).startswith("early_refusal_margin_s"), str(err.value)


# --------------------------------------------------------------------------- the dispatcher's side


@pytest.fixture
async def dispatcher_stub():
    service = DispatcherService(SwitchyardConfig().with_overrides(**FAST, **{"sim.prefix_caching": False}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            yield agent_pb2_grpc.InferenceServiceStub(channel), service
        finally:
            await channel.close()


async def test_tool_wait_validates_each_field_and_decides_nothing_for_an_agent_with_nothing_parked(dispatcher_stub):
    stub, service = dispatcher_stub
    reply = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="a", tool="search_docs", expected_wait_s=1.5,
                                                          tenant_id="acme", priority=agent_pb2.CORE))
    assert reply.decision == agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED and reply.restore_at_s == 0
    good = {"agent_id": "a", "tool": "t", "expected_wait_s": 1.0}
    for field, value in [("agent_id", ""), ("tool", ""), ("tool", "x" * 300), ("expected_wait_s", -1.0),
                         ("expected_wait_s", float("nan")), ("tenant_id", "a b"), ("priority", 9)]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ToolWait(agent_pb2.ToolWaitRequest(**{**good, field: value}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), field


async def test_generate_checks_the_new_fields_and_a_prefill_only_request_without_prefix_sharing_ends_at_once(
        dispatcher_stub):
    stub, service = dispatcher_stub
    info = await stub.DescribeModel(agent_pb2.DescribeModelRequest())
    assert not info.shares_prefixes
    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
        request_id="p", prompt="You are a precise assistant. <question>q</question>", prefill_only=True,
        tenant_id="acme", task_time_left_s=5.0, expected_remaining_work_s=1.0))]
    assert [c.WhichOneof("chunk") for c in chunks] == ["done"] and chunks[0].done.usage.completion_tokens == 0
    for field, value in [("tenant_id", "bad tenant"), ("task_time_left_s", -1.0),
                         ("expected_remaining_work_s", float("inf")), ("deadline_source", "x" * 400),
                         ("deadline_source", "limit\nforged line")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(agent_pb2.GenerateRequest(prompt="hi", **{field: value})):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), field
    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(prompt="hi there", max_tokens=4,
                                                                       tenant_id="acme", task_time_left_s=9.0))]
    assert chunks[-1].done.usage.completion_tokens > 0


async def test_a_prefill_only_request_on_an_engine_that_shares_prefixes_streams_no_token():
    """agent.proto promises a prefill_only request no tokens; on an engine that shares prefixes its step's one
    token was streamed ("No", completion_tokens 1)."""
    service = DispatcherService(SwitchyardConfig().with_overrides(**FAST))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            assert (await stub.DescribeModel(agent_pb2.DescribeModelRequest())).shares_prefixes
            chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
                request_id="warm", prompt="You are a precise assistant. <question>q</question>", prefill_only=True,
                agent_id="a"))]
        finally:
            await channel.close()
    assert [c.WhichOneof("chunk") for c in chunks] == ["done"], chunks
    assert chunks[0].done.usage.completion_tokens == 0 and chunks[0].done.usage.prompt_tokens > 0


async def test_a_model_the_sim_dispatcher_does_not_serve_is_refused_before_the_task_is_accepted():
    """RunTask and SubmitTask with model "gpt-99" were accepted, and the task then failed NOT_FOUND at the
    dispatcher (max_tokens 8000 passed too, checked against the default window instead of sim-7b's). The
    dispatcher says its engine serves one model alone; the edge refuses another before accepting."""
    async with sim_stack(DispatcherService(SwitchyardConfig().with_overrides(**FAST)), Downstream()) as (stub, direct):
        info = await direct.DescribeModel(agent_pb2.DescribeModelRequest())
        assert info.serves_only_model and info.model
        request = agent_pb2.RunTaskRequest(payload="hi", task_type="chat", model="gpt-99", max_tokens=8000)
        with pytest.raises(grpc.aio.AioRpcError) as submitted:
            await stub.SubmitTask(request)
        assert submitted.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"serves {info.model!r}" in submitted.value.details()
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as run:
            async for event in stub.RunTask(request):
                events.append(event)
        assert run.value.code() == grpc.StatusCode.NOT_FOUND and events == []  # nothing accepted
        served = await collect(stub, task_id="named", payload="hi", task_type="chat", model=info.model, max_tokens=4)
        assert served[-1].HasField("final")


async def test_a_request_the_fair_dispatcher_refuses_early_is_counted_on_its_metrics():
    """The fair policy's refusal of a request whose task cannot make its deadline (by name, DEADLINE_EXCEEDED)
    was counted nowhere: not in the dispatcher's metrics, and not in the orchestrator's
    switchyard_tasks_refused_early_total (its own refusals only), so an operator could not tell it from a
    request that ran out of time. Counted by class in switchyard_requests_refused_early_total."""
    from prometheus_client import REGISTRY

    def refused(cls: str) -> float:
        return REGISTRY.get_sample_value("switchyard_requests_refused_early_total", {"priority_class": cls}) or 0.0

    service = DispatcherService(SwitchyardConfig().with_overrides(**FAST, **{"scheduler.policy": "fair"}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            before = {cls: refused(cls) for cls in ("core", "normal", "batch")}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(agent_pb2.GenerateRequest(
                        request_id="doomed:0", prompt="hi", max_tokens=4, priority=agent_pb2.CORE,
                        task_time_left_s=1.0, expected_remaining_work_s=5.0)):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "request 'doomed:0' cannot meet its task's deadline" in err.value.details()
            assert refused("core") == before["core"] + 1
            assert refused("normal") == before["normal"] and refused("batch") == before["batch"]
            chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
                request_id="fits:0", prompt="hi", max_tokens=4, task_time_left_s=60.0, expected_remaining_work_s=5.0))]
            assert chunks[-1].HasField("done") and refused("normal") == before["normal"]
        finally:
            await channel.close()


async def test_the_fair_dispatcher_counts_each_tenants_service_under_a_bounded_label():
    """The fair policy orders tenants by the service it charged them, and nothing showed that service: an
    operator whose quiet tenant complained could not read whether it was served its share beside a noisy one.
    switchyard_tenant_service_tokens_total counts it per tenant, the tenants scheduler.tenant_weights names
    and default under their own label (from 0 at start) and every other tenant as other."""
    from prometheus_client import REGISTRY

    def served(tenant: str) -> float | None:
        return REGISTRY.get_sample_value("switchyard_tenant_service_tokens_total", {"tenant": tenant})

    service = DispatcherService(SwitchyardConfig().with_overrides(
        **FAST, **{"scheduler.policy": "fair", "scheduler.tenant_weights": {"acme-weighted": 2.0}}))
    async with running([service], service.config.server) as srv:
        before = {tenant: served(tenant) for tenant in ("acme-weighted", "default", "other")}
        assert None not in before.values()  # every label of the config's set is there before any request
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            usage = {}
            for tenant, label in (("acme-weighted", "acme-weighted"), ("zeta-unnamed", "other"), ("", "default")):
                chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
                    request_id=f"{label}:0", prompt=f"tell {label} about the with statement", max_tokens=4,
                    tenant_id=tenant))]
                done = chunks[-1].done
                # its prompt prefilled, and one per decode step (the first token comes with the prefill)
                usage[label] = done.usage.prompt_tokens + done.usage.completion_tokens - 1
            await _until(lambda: all(served(label) == before[label] + usage[label] for label in usage),
                         "each tenant's service counted")
            assert served("zeta-unnamed") is None  # an unnamed tenant gets no series of its own
        finally:
            await channel.close()


async def test_a_react_loop_step_after_a_tool_round_counts_the_conversation_it_sends():
    """A react_loop step after a tool round sends the conversation so far: the first prompt, the model's tool
    calls and the tools' results. Its prompt_tokens was the first prompt's count on every step, however much
    the tools had returned: the dispatcher reserved KV, checked the context window and budgeted the step on a
    prompt a fraction of its size, and refused a long result's step INVALID_ARGUMENT naming prompt_tokens
    ("expected at least 3909 for a prompt of 500409 characters ... (got 94)"). Each step now counts what it
    adds."""
    down = Recording()
    down.passages = [agent_pb2.Passage(text="The with statement wraps a block. " * 300, score=0.9, source="t:with",
                                       title="with")]
    async with stack(down) as (stub, down):
        events = await collect(stub, task_id="long-result", payload="How does the with statement work?",
                               task_type="react_loop")
    assert events[-1].HasField("final")
    steps = [r for r in down.requests if r.request_id.startswith("long-result:")]
    assert len(steps) == 3  # search_docs, then calculator, then the answer
    for before, after in zip(steps, steps[1:]):
        grown = [(m.role, m.content + "".join(c.name + c.arguments_json for c in m.tool_calls))
                 for m in after.messages[len(before.messages):]]
        assert after.prompt_tokens == before.prompt_tokens + count_added_messages(grown)
    assert steps[1].prompt_tokens > steps[0].prompt_tokens + 300 * 7  # the passage's tokens are in its count
    assert steps[0].prompt_tokens == count_messages([(m.role, m.content) for m in steps[0].messages])


def test_a_refusal_margin_with_early_refusal_off_is_refused_at_load_naming_both_keys():
    """orchestrator.program.refuse_early_margin_s is read only by the early refusal; with refuse_early off it
    loaded and did nothing. At its default (0) it loads either way."""
    with pytest.raises(ConfigError) as caught:
        SwitchyardConfig().with_overrides(**{"orchestrator.program.refuse_early": False,
                                              "orchestrator.program.refuse_early_margin_s": 2.0})
    assert "refuse_early_margin_s: expected refuse_early true" in str(caught.value)
    assert "got refuse_early false" in str(caught.value)
    on = SwitchyardConfig().with_overrides(**{"orchestrator.program.refuse_early_margin_s": 2.0})
    assert on.orchestrator.program.refuse_early_margin_s == 2.0
    assert not SwitchyardConfig().with_overrides(**{"orchestrator.program.refuse_early": False}).orchestrator.program.refuse_early


async def test_the_dispatcher_client_takes_its_hint_deadline_and_task_affinity_from_the_program_settings() -> None:
    """The ToolWait deadline and the workflows routed by task id come from orchestrator.program, given to the
    client when it is made; left out, the settings' own defaults (the client kept its own 0.25 s beside the
    config's 250 ms, and the service wrote both into it after it was made)."""
    from switchyard.orchestrator.clients import InferenceClient

    server = SwitchyardConfig().server
    tuned = InferenceClient("127.0.0.1:1", server, program=ProgramConfig(tool_wait_hint_timeout_ms=40,
                                                                          rag_early_prefill=False))
    default = InferenceClient("127.0.0.1:1", server)
    try:
        assert (tuned.hint_timeout_s, tuned.task_affinity) == (0.04, frozenset({"react_loop"}))
        assert default.hint_timeout_s == ProgramConfig().tool_wait_hint_timeout_ms / 1000
        assert default.task_affinity == frozenset({"react_loop", "rag_answer"})  # rag_early_prefill's default: on
    finally:
        await tuned.close()
        await default.close()
