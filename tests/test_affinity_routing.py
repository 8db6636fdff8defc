"""The orchestrator routes an agent's calls to one dispatcher replica, and survives that replica going away.

Three real sim dispatchers on 127.0.0.1:0 behind one ``ipv4:`` target; each
records which agents' requests it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from typing import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import ORIGIN_KEY, DispatcherNotServing
from switchyard.common.server import RunningServer, running, start_server
from switchyard.dispatcher.processor import NOT_STARTED, RequestProcessor
from switchyard.dispatcher.scheduler.core import SHUTTING_DOWN
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.addresses import HIDDEN
from switchyard.orchestrator.service import OrchestratorService
from fast_sim import FAST

pytestmark = pytest.mark.no_gpu



class RecordingProcessor(RequestProcessor):
    """A dispatcher's request processor that records (its label, agent_id) of every request it receives."""

    label: str
    served: list[tuple[str, str]]
    started: asyncio.Event | None

    async def open_request(self, request, timeout_s, span, arrived=None):
        self.served.append((self.label, request.agent_id))
        return await super().open_request(request, timeout_s, span, arrived)

    def chunk(self, req, item):
        chunk = super().chunk(req, item)
        if self.started is not None and chunk.HasField("token"):
            self.started.set()
        return chunk


class Recording(DispatcherService):
    """A sim dispatcher that records (its label, agent_id) of every request it receives."""

    def __init__(self, config: SwitchyardConfig, label: str, served: list[tuple[str, str]],
                 started: asyncio.Event | None = None) -> None:
        super().__init__(config)
        self.processor = RecordingProcessor(config, self.engine)
        self.processor.label, self.processor.served, self.processor.started = label, served, started
        self.label, self.served, self.started = label, served, started


@contextlib.asynccontextmanager
async def fleet(n: int = 3, orchestrators: list[OrchestratorService] | None = None,
                **overrides: object) -> AsyncIterator[tuple[list[RunningServer], list, object]]:
    dispatcher_cfg = SwitchyardConfig().with_overrides(**{**FAST, **overrides})
    served: list[tuple[str, str]] = []
    started = asyncio.Event()
    servers = [await start_server([Recording(dispatcher_cfg, f"d{i}", served, started)], "127.0.0.1", 0,
                                  dispatcher_cfg.server) for i in range(n)]
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    cfg = SwitchyardConfig().with_overrides(**{
        "orchestrator.dispatcher_addr": target,
        "orchestrator.retrieval_addr": "127.0.0.1:1",
        "orchestrator.default_task_type": "chat",
        "orchestrator.cpu_executor": "loop",
    })
    orchestrator = OrchestratorService(cfg)
    if orchestrators is not None:
        orchestrators.append(orchestrator)
    try:
        async with running([orchestrator], cfg.server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                yield servers, served, (agent_pb2_grpc.AgentServiceStub(channel), started)
    finally:
        for srv in servers:
            await srv.stop(0)


async def chat(stub, agent: str, i: int, max_tokens: int = 4) -> agent_pb2.FinalEvent:
    request = agent_pb2.RunTaskRequest(task_id=f"{agent}-{i}", agent_id=agent, payload="say hello",
                                       task_type="chat", max_tokens=max_tokens)
    events = [e async for e in stub.RunTask(request, timeout=60)]
    return events[-1].final


def replicas_by_agent(served: list[tuple[str, str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for label, agent in served:
        out[agent].add(label)
    return out


async def test_each_agent_stays_on_one_replica_and_agents_spread():
    async with fleet() as (_, served, (stub, _started)):
        agents = [f"agent-{i}" for i in range(24)]
        for round_ in range(3):
            await asyncio.gather(*(chat(stub, agent, round_) for agent in agents))
    by_agent = replicas_by_agent(served)
    assert set(by_agent) == set(agents)
    assert all(len(labels) == 1 for labels in by_agent.values()), by_agent
    used = {label for labels in by_agent.values() for label in labels}
    assert used == {"d0", "d1", "d2"}  # 24 agents, load bound 1.2: no replica may take more than 9


async def test_two_tenants_agents_of_one_id_are_placed_as_two_agents():
    """An agent is its tenant's and its id's: 24 tenants each running an agent ``planner`` are 24 agents, placed
    over the replicas by the bounded-load rule as any 24 agents are. The replicas were picked by the bare agent
    id, so they were one key: every tenant's planner on one replica (one calls at a time: no overflow spreads
    them), the others idle, and each tenant's agent state on the replica of another's."""
    async with fleet() as (_, served, (stub, _started)):
        for round_ in range(2):
            for t in range(24):
                request = agent_pb2.RunTaskRequest(task_id=f"t{t}-{round_}", agent_id="planner", payload="say hello",
                                                   task_type="chat", max_tokens=4)
                events = [e async for e in stub.RunTask(request, timeout=60, metadata=(("x-tenant-id", f"t{t}"),))]
                assert events[-1].HasField("final")
    labels = [label for label, _agent in served]
    assert len(labels) == 48
    by_tenant = [{labels[t], labels[24 + t]} for t in range(24)]  # its two calls, one per round
    assert all(len(placed) == 1 for placed in by_tenant), by_tenant  # each tenant's planner stays home
    assert set(labels) == {"d0", "d1", "d2"}  # 24 agents, load bound 1.2: no replica may take more than 9


async def test_a_replica_going_away_moves_only_its_agents_and_no_call_fails():
    async with fleet() as (servers, served, (stub, _started)):
        agents = [f"agent-{i}" for i in range(12)]
        await asyncio.gather(*(chat(stub, agent, 0) for agent in agents))
        home = {agent: labels.pop() for agent, labels in replicas_by_agent(served).items()}
        victim = home["agent-0"]
        await servers[int(victim[1])].stop(0)
        served.clear()
        # one call at a time: the ring bounds calls in flight, and calls overlapping by chance (a loaded machine)
        # could spill an agent whose replica stayed, by the load bound's own legal rule, not by the move
        finals = [await chat(stub, agent, 1) for agent in agents]  # retried before any token
        assert all(f.output for f in finals)
        after = replicas_by_agent(served)
        for agent in agents:
            labels = after[agent] - {victim}
            assert len(labels) == 1
            if home[agent] != victim:
                assert labels == {home[agent]}, f"{agent} moved although its replica stayed"
            else:
                assert labels != {victim}


async def test_a_replica_dying_mid_stream_fails_unavailable_naming_it_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="switchyard.orchestrator.service")
    async with fleet(1, **{"sim.decode_base_ms": 50.0}) as (servers, _served, (stub, started)):
        # one replica in an ipv4: list of one: the call goes to it; kill it once it has streamed a token
        task = asyncio.create_task(chat(stub, "agent-x", 0, max_tokens=200))
        await asyncio.wait_for(started.wait(), 60)
        await servers[0].stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await task
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # the caller reads the replica's failure, its address hidden (orchestrator.show_addresses_to_callers); the
    # operator's log names the replica. Its server's stop (grace 0) ends the request in the dispatcher's words,
    # with the chunks it had streamed (it read 'stream cut after 1 chunk(s): Cancelling all calls; is it running?')
    assert f"127.0.0.1:{servers[0].port}" not in err.value.details() and HIDDEN in err.value.details()
    assert "dispatcher is stopping: " in err.value.details(), err.value.details()
    assert "streamed chunk(s): not tried again" in err.value.details(), err.value.details()
    assert f"127.0.0.1:{servers[0].port}" in caplog.text and "dispatcher is stopping: " in caplog.text


@pytest.mark.parametrize("state", ["stopped", "draining"])
async def test_a_replica_that_serves_no_request_refuses_by_name_and_its_calls_go_to_another(state):
    """A dispatcher whose engine loop is gone (stopped, or not started yet) and one that drains refuse alike:
    DispatcherNotServing, UNAVAILABLE from the dispatcher itself, naming why and what to do; the orchestrator
    tries each such call on another replica, and every task ends well. The two states were refused by two
    errors built in two places, in two wordings."""
    async with fleet(2) as (servers, served, (stub, _started)):
        d0: DispatcherService = servers[0].services[0]  # type: ignore[assignment]
        if state == "stopped":
            await d0.stop()  # its gRPC server still answers: the window between the loop's end and the server's
        else:
            await d0.begin_drain()
        async with open_channel(f"127.0.0.1:{servers[0].port}") as channel:
            call = agent_pb2_grpc.InferenceServiceStub(channel).Generate(
                agent_pb2.GenerateRequest(request_id="direct", prompt="say hello", max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
        reason = NOT_STARTED if state == "stopped" else SHUTTING_DOWN
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == str(DispatcherNotServing(reason))
        assert "retry on another replica" in refused.value.details()
        assert dict(refused.value.trailing_metadata() or ())[ORIGIN_KEY] == "dispatcher"
        # (a draining replica's stream may also end before it reads a start: UNAVAILABLE, retried the same way)
        retried = REGISTRY.get_sample_value("switchyard_dispatcher_retries_total") or 0.0
        for i in range(32):  # until an agent homed on d0 was tried there first (each is, with chance 1/2)
            final = await chat(stub, f"agent-{i}", 0)
            assert final.finish_reason in ("stop", "length") and final.output
            if (REGISTRY.get_sample_value("switchyard_dispatcher_retries_total") or 0.0) > retried:
                break
        else:
            raise AssertionError(f"no call was tried on d0 first: {served}")


async def test_a_hot_agent_spills_past_the_in_flight_bound_and_uninvolved_agents_stay_home():
    # one agent sends 60 % of 30 concurrent calls; each call decodes 32 modelled 10 ms steps, so they overlap
    orchestrators: list[OrchestratorService] = []
    async with fleet(orchestrators=orchestrators, **{"sim.decode_base_ms": 10.0}) as (_, served, (stub, _started)):
        replica_set = orchestrators[0]._deps.inference.replicas
        snapshots: list[dict[str, int]] = []
        started = replica_set.started

        def record(address: str) -> None:
            started(address)
            snapshots.append(dict(replica_set.in_flight))

        replica_set.started = record  # type: ignore[method-assign]
        others = [f"agent-{i}" for i in range(12)]
        await asyncio.gather(*(chat(stub, agent, 0) for agent in others))  # homes placed
        home = {agent: labels.pop() for agent, labels in replicas_by_agent(served).items()}
        served.clear()
        snapshots.clear()
        calls = [chat(stub, "hot", i, max_tokens=32) for i in range(18)]
        calls += [chat(stub, agent, 1, max_tokens=32) for agent in others]
        finals = await asyncio.gather(*calls)
    assert all(f.output for f in finals)
    peak = max(snapshots, key=lambda s: sum(s.values()))
    total = sum(peak.values())
    assert total >= 15, f"calls did not overlap: {peak}"
    assert max(peak.values()) / (total / 3) <= 1.25, peak
    by_agent = replicas_by_agent(served)
    assert len(by_agent["hot"]) >= 2, "the hot agent's overflow spilled"
    assert sum(1 for agent in others if by_agent[agent] == {home[agent]}) >= 9, by_agent


class Refusing(Recording):
    """A dispatcher that records each request's time left, then refuses it UNAVAILABLE (as a draining one does)."""

    def __init__(self, config: SwitchyardConfig, label: str, seen: list[tuple[str, float, float | None]]) -> None:
        super().__init__(config, label, [])
        refuse = label == "d0"

        async def open_request(request, timeout_s, span, arrived=None):
            seen.append((label, request.task_time_left_s, timeout_s))
            if refuse:
                raise DispatcherNotServing(SHUTTING_DOWN)
            return await RecordingProcessor.open_request(self.processor, request, timeout_s, span, arrived)

        self.processor.open_request = open_request


async def test_a_call_tried_again_on_another_replica_carries_the_time_left_then_not_when_first_sent():
    """The second attempt carried the first's task_time_left_s and gRPC deadline: its dispatcher ordered it by
    slack the task no longer had, and it could run past the task's deadline by the first attempt's time."""
    seen: list[tuple[str, float, float | None]] = []
    dispatcher_cfg = SwitchyardConfig().with_overrides(**FAST)
    servers = [await start_server([Refusing(dispatcher_cfg, f"d{i}", seen)], "127.0.0.1", 0, dispatcher_cfg.server)
               for i in range(2)]
    cfg = SwitchyardConfig().with_overrides(**{
        "orchestrator.dispatcher_addr": "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers),
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.default_task_type": "chat",
        "orchestrator.cpu_executor": "loop",
    })
    try:
        async with running([OrchestratorService(cfg)], cfg.server) as orch:
            async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                for i in range(32):  # until an agent homed on d0 was moved to d1 (each is, with chance 1/2)
                    final = await chat(stub, f"agent-{i}", 0)
                    assert final.finish_reason in ("stop", "length")
                    if [label for label, _, _ in seen][-2:] == ["d0", "d1"]:
                        break
    finally:
        for srv in servers:
            await srv.stop(0)
    (_, first_left, first_timeout), (_, second_left, second_timeout) = seen[-2:]
    assert 0 < second_left < first_left
    assert first_timeout is not None and second_timeout is not None and 0 < second_timeout < first_timeout
