"""``switchyard bench http`` (:mod:`switchyard_harness.bench.http_bench`): its submit and stream
phases against a real HTTP face (the face itself is tested in tests/test_http_face.py)."""

from __future__ import annotations

import pytest

from switchyard_harness.bench import http_bench
from switchyard_harness.bench.report import percentile
from test_http_face import http_stack

pytestmark = pytest.mark.no_gpu


async def test_bench_http_counts_every_submit_and_stream_of_a_short_run():
    async with http_stack() as (client, _, down):
        base = str(client.base_url).rstrip("/")
        calls = await http_bench.submit_phase(base, rps=40, concurrency=4, duration_s=0.5, task_type="chat",
                                              max_tokens=16)
        assert len(calls.latencies) == 20 and not calls.failures
        assert calls.summary()["p95_ms"] == round(1000 * percentile(calls.latencies, 95), 3)
        over_grpc = await http_bench.submit_phase(base, rps=40, concurrency=4, duration_s=0.25, task_type="chat",
                                                  max_tokens=16, grpc_addr=down.orchestrator_address)
        assert len(over_grpc.latencies) == 10 and not over_grpc.failures
        streams = await http_bench.stream_phase(base, down.orchestrator_address, streams=2, seconds=0.3, rounds=1)
        for kind in ("sse", "grpc"):
            assert streams[kind].latencies and not streams[kind].failures, (kind, streams[kind].failures)
