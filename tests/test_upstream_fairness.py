"""The upstream admission queue of the ``openai`` engine ordered by the configured policy: a real dispatcher
(127.0.0.1 port 0) in front of sim-openai with the upstream concurrency limit at one stream. Requests that
wait for the upstream's slot are the scheduler's waiting queue, so the fair policy (least attained service
per tenant, then per agent session) sends a light session's request ahead of a heavy session's queued ones,
and first come, first served sends them in arrival order; the order is the one the upstream saw."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401

from switchyard.common.tenant import agent_key
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import start_server
from switchyard.dispatcher.engines.base import StepBatch, StepResult, SeqOutput, Usage
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.fair import service_tokens
from switchyard.dispatcher.service import DispatcherService
from switchyard_harness.faults import Fault
from test_program import _until

pytestmark = pytest.mark.no_gpu

SLOW_MODEL = "gpt-4o-mini"  # the blocker's model: sim-openai streams it slowly, holding the one slot


def _generate(rid: str, agent: str, model: str = "", max_tokens: int = 16) -> agent_pb2.GenerateRequest:
    return agent_pb2.GenerateRequest(request_id=rid, agent_id=agent, prompt=f"<question>{rid}: what is a list?</question>",
                                     max_tokens=max_tokens, model=model)


def _seen(upstream) -> list[str]:
    """Request ids in the order the upstream received them (each prompt names its request)."""
    ids = []
    for body in upstream.state.requests:
        text = " ".join(str(m.get("content", "")) for m in body["messages"])
        ids.append(text.split("<question>", 1)[1].split(":", 1)[0] if "<question>" in text else "?")
    return ids


async def _upstream_order(policy: str) -> list[str]:
    """heavy-0 runs to its end (its session has received service), a slow blocker takes the one upstream
    slot, then heavy-1, heavy-2 and light-1 queue in that order; the blocker's caller goes away and the
    queue drains through the slot: the upstream's arrival order of the three queued requests."""
    with start_sim(faults={SLOW_MODEL: Fault(slow_ms=200.0)}) as upstream:
        config = load_config("config").with_overrides(**{
            "dispatcher.engine": "openai",
            "upstream.base_url": upstream.base_url,
            "upstream.api_key_required": False,
            "upstream.fallback_model": "",
            "upstream.concurrency": {"initial_limit": 1, "min_limit": 1, "max_limit": 1, "core_reserved_slots": 0},
            "scheduler.policy": policy,
        })
        service = DispatcherService(config)
        srv = await start_server([service], "127.0.0.1", 0, config.server)
        try:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)

                async def call(request: agent_pb2.GenerateRequest) -> list[agent_pb2.GenerateChunk]:
                    return [c async for c in stub.Generate(request, timeout=60)]

                assert (await call(_generate("heavy-0", "heavy", max_tokens=64)))[-1].HasField("done")
                scheduler = service.loop.scheduler
                blocker = asyncio.create_task(call(_generate("blocker", "blocker", SLOW_MODEL, max_tokens=256)))
                await _until(lambda: len(upstream.state.requests) == 2, "the blocker streaming from the upstream")
                queued = []
                for rid, agent in (("heavy-1", "heavy"), ("heavy-2", "heavy"), ("light-1", "light")):
                    queued.append(asyncio.create_task(call(_generate(rid, agent))))
                    # in the waiting queue (flushed from the intake buffer), each joining at its own time
                    await _until(lambda n=len(queued): len(scheduler.waiting) == n, f"{rid} waiting for the slot")
                assert scheduler.num_running == 1  # the blocker holds the one slot
                blocker.cancel()  # its caller goes away: the slot frees
                await asyncio.gather(blocker, return_exceptions=True)
                results = await asyncio.gather(*queued)
        finally:
            await srv.stop(1.0)
    assert all(chunks[-1].HasField("done") for chunks in results)
    seen = _seen(upstream)
    assert seen[:2] == ["heavy-0", "blocker"]
    return seen[2:]


async def test_with_the_fair_policy_a_light_sessions_request_goes_to_the_upstream_before_a_heavy_sessions(
        clean_proxy_env):
    assert await _upstream_order("fair") == ["light-1", "heavy-1", "heavy-2"]


async def test_first_come_first_served_sends_the_queued_requests_in_arrival_order(clean_proxy_env):
    assert await _upstream_order("fifo") == ["heavy-1", "heavy-2", "light-1"]


def test_a_stream_is_charged_its_streamed_tokens_and_the_upstreams_prompt_and_unstreamed_completion():
    """What the fair policy credits a session from an upstream's stream (the stream loop hands each item to
    ``update_from_output`` as a one-request decode): one per token text, none for a tool call, and at the
    end the usage's prompt tokens plus its completion tokens not streamed as text."""
    config = load_config("config").with_overrides(**{"dispatcher.engine": "openai"})
    scheduler = make_scheduler(config, None, policy="fair")
    req = Request(request_id="s1", agent_id="session", tenant_id="t", prompt="hi", prompt_tokens=4, max_tokens=16)
    batch = StepBatch(decode=[req])
    assert service_tokens(req, StepResult({req.seq_id: SeqOutput(texts=["a"])})) == 1
    req.output_tokens.extend(["a", "b", "c"])  # three streamed so far
    assert service_tokens(req, StepResult({req.seq_id: SeqOutput(tool_calls=[object()])})) == 0  # type: ignore[list-item]
    usage = SeqOutput(eos=True, usage=Usage(prompt_tokens=40, completion_tokens=9))
    assert service_tokens(req, StepResult({req.seq_id: usage})) == 40 + 6
    assert service_tokens(req, StepResult()) == 1  # a step engine's decode step: one token
    scheduler.update_from_output(batch, StepResult({req.seq_id: SeqOutput(texts=["d"])}), now=1.0)
    assert scheduler.ledger.sessions.service(agent_key("t", "session"), 1.0) == pytest.approx(1)
