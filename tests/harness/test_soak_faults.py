"""``tools/soak.py``'s fault kinds reach the upstream through the stack, as each is meant to end.

The soak named its faults by sim-openai's ``MODEL#SPEC`` suffix (``claude-sonnet-4-5#status=503``), a name the
upstream does not list; once the orchestrator refused such names NOT_FOUND before accepting them, every 5xx and
cut-stream task of the soak ended NOT_FOUND, no fault was exercised, and the soak still reported ``ok``. Here the
soak's own requests go through a real orchestrator and dispatcher (``openai`` engine) to a sim-openai started as
the soak starts it (its models and ``--fault`` flags), on 127.0.0.1 port 0.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401
from test_unknown_model import stack

from switchyard.api import agent_pb2
from switchyard.common.config import load_config
from switchyard_harness.faults import parse_flag

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "tools" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def outcome(stub, request: agent_pb2.RunTaskRequest) -> tuple[str, str]:
    """("final", "") or ("error:<CODE>", details) of one RunTask."""
    try:
        async for event in stub.RunTask(request, timeout=60):
            if event.HasField("final"):
                return "final", ""
    except grpc.aio.AioRpcError as err:
        return f"error:{err.code().name}", err.details()
    return "unaccounted", ""


async def test_the_soaks_fault_kinds_end_as_they_are_meant_to(clean_proxy_env):
    soak = load_soak()
    faults = dict(parse_flag(flag) for flag in soak.UPSTREAM_FAULTS)
    with start_sim(models=list(soak.UPSTREAM_MODELS), faults=faults) as sim:
        cfg = load_config("config").with_overrides(**{
            "dispatcher.engine": "openai", "upstream.base_url": sim.base_url, "upstream.api_key_required": False,
            "upstream.retry_backoff_initial_s": 0.01, "upstream.retry_backoff_max_s": 0.02,
            "orchestrator.cpu_executor": "loop"})
        async with stack(cfg) as (stub, _client):
            ended = {kind: await outcome(stub, soak.request_for(kind, number))
                     for number, kind in enumerate(("ok_chat", "upstream_5xx", "stream_cut"))}
    for kind, (got, details) in ended.items():
        assert got == soak.MEANT[kind], (kind, got, details)
    assert "after 3 streamed item(s)" in ended["stream_cut"][1]
    served = [body["model"] for body in sim.state.requests]
    assert soak.FLAKY_MODEL in served and soak.CUT_MODEL in served  # the faults were met upstream, not refused
    assert "gpt-4o-mini" in served  # the 503s' task was served by the fallback model
