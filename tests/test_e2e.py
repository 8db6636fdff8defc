"""End to end: `switchyard up` starts three separate processes; tasks stream through them."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from google.protobuf import json_format

from proxy_fixtures import proxied_environment
from stack_fixtures import UpStack
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from token_events import token_count

pytestmark = pytest.mark.slow

GHZ_JSON = '{"task_id":"bench-001","payload":"summarize this doc"}'


@pytest.fixture(scope="module")
def proxy():
    """Every proxy variable, here and in the stack, points at a proxy that answers 503 (as a
    corporate proxy would for internal addresses): internal traffic must not go through it."""
    with proxied_environment() as proxy:
        yield proxy


@pytest.fixture(scope="module")
def up(pydoc_index_dir, proxy):
    """One stack for the module, started under the refusing proxy; the SIGTERM test, last, stops it."""
    stack = UpStack(pydoc_index_dir)
    stack.wait_ready()
    yield stack
    stack.stop()


async def test_ghz_json_streams_through_three_processes(up):
    pids = [int(m.group(1)) for line in up.lines if (m := re.search(r"\(pid (\d+)\)", line))]
    assert len(set(pids)) == 3 and up.proc.pid not in pids
    request = json_format.Parse(GHZ_JSON, agent_pb2.RunTaskRequest())
    async with open_channel(up.address("orchestrator")) as channel:
        events = [e async for e in agent_pb2_grpc.AgentServiceStub(channel).RunTask(request, timeout=60)]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "accepted" and events[0].accepted.task_id == "bench-001"
    stages = {e.stage.name for e in events if e.HasField("stage")}
    assert {"retrieve", "render_prompt", "infer"} <= stages
    assert kinds.count("token") >= 1
    final = events[-1].final
    assert kinds[-1] == "final" and final.task_id == "bench-001"
    assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0


async def test_agent_memory_carries_across_tasks_in_the_embedded_redis(up):
    import redis.asyncio as aioredis

    host, _, port = up.redis_address().rpartition(":")
    finals = []
    async with open_channel(up.address("orchestrator")) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for payload in ("My name is Ada.", "What is my name?"):
            request = agent_pb2.RunTaskRequest(payload=payload, agent_id="e2e-agent", task_type="chat")
            events = [e async for e in stub.RunTask(request, timeout=60)]
            assert {"recall", "remember"} <= {e.stage.name for e in events if e.HasField("stage")}
            finals.append(events[-1].final)
    # the second prompt carries the first task's question and answer
    assert finals[1].usage.prompt_tokens > finals[0].usage.prompt_tokens + 5
    client = aioredis.Redis(host=host, port=int(port))
    try:
        memory = await client.lrange("switchyard:agent:e2e-agent:memory", 0, -1)
        ttl = await client.ttl("switchyard:agent:e2e-agent:memory")
    finally:
        await client.aclose()
    assert [m.count(b'"role": "user"') for m in memory] == [1, 0, 1, 0] and 0 < ttl <= 3600


def test_cli_run_prints_stages_and_answer(up):
    out = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "run", "--addr", up.address("orchestrator"),
         "How does the with statement work?"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for stage in ("retrieve", "render_prompt", "infer"):
        assert f"stage {stage}" in out.stdout
    assert "final:" in out.stdout and "(pydoc_data.topics:with)" in out.stdout
    # --json: one event a line, in the HTTP face's shape (agent.proto's field names, every field, int64 numbers)
    out = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "run", "--addr", up.address("orchestrator"), "--json",
         "--priority", "core", "--task-type", "chat", "--max-tokens", "4", "Say hi"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert "accepted" in events[0] and "queue_position" in events[0]["accepted"]
    final = events[-1]["final"]
    assert isinstance(final["memory_peak_bytes"], int) and "compute_score_used" in final


def test_cli_run_with_nothing_listening_says_so(capsys):
    from switchyard import client

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and f"nothing answers at 127.0.0.1:{port}" in err and "switchyard up" in err


def test_cli_run_with_nothing_listening_names_the_stack_the_up_file_records(tmp_path, monkeypatch, capsys):
    """After `switchyard up --free-ports`, `switchyard run` (config's 127.0.0.1:50051) said only 'nothing answers
    ... is the stack running?' while the stack ran on the ports its up file records, which switchyard top and
    switchyard profile read; it now names that orchestrator's address and the --addr to give."""
    import os

    from switchyard import client

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    up = tmp_path / "up.json"
    up.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": {
        "address": "127.0.0.1:45111", "metrics_url": "http://127.0.0.1:44329/metrics", "pid": os.getpid()}}}))
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(up))
    assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1
    err = capsys.readouterr().err
    assert f"nothing answers at 127.0.0.1:{port}" in err
    assert (f"the stack that switchyard up started serves its orchestrator at 127.0.0.1:45111 (its up file {up}): "
            "switchyard run --addr 127.0.0.1:45111 ...") in err, err
    up.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": {"address": f"127.0.0.1:{port}"}}}))
    assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1
    assert "the stack that switchyard up started" not in capsys.readouterr().err  # the address tried: nothing new


def test_cli_run_given_its_address_runs_from_a_folder_without_config(tmp_path, monkeypatch, capsys):
    """From outside the repository, `switchyard run --addr` refused: "config folder not found"; a client given its
    address needs the config only for TLS, and says it uses the built-in (plaintext) defaults."""
    from switchyard import client

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SWITCHYARD_CONFIG_DIR", raising=False)
    assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1  # it tried: nothing there
    err = capsys.readouterr().err
    assert "no config folder at" in err and "over plaintext" in err and f"nothing answers at 127.0.0.1:{port}" in err
    assert client.main(["--timeout", "5", "hello"]) == 2  # no address: the config says where, and is missing
    assert "config folder not found" in capsys.readouterr().err


def test_cli_run_pointed_at_an_http_server_says_what_answers(capsys):
    """`switchyard run --addr` at the HTTP face's port said "nothing answers", though something did."""
    import asyncio
    import threading

    from aiohttp import web

    from switchyard import client

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(web.Application())  # aiohttp, as the HTTP face
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
    err = capsys.readouterr().err
    assert f"an HTTP/1.x server answers at 127.0.0.1:{port}, not gRPC" in err and "nothing answers" not in err


def test_bench_client_then_no_internal_call_went_through_the_proxy(up, proxy):
    """`switchyard up` became healthy, RunTask and `switchyard run` streamed (tests above), and
    the bench client runs: all with every proxy variable set, none through the proxy."""
    out = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "bench", "run", "-d", GHZ_JSON, "-n", "4", "-c", "2", "--procs", "1",
         "-O", "json", "--host", up.address("orchestrator")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["statusCodeDistribution"] == {"OK": 4}, out.stdout[-2000:]
    assert proxy.requests == [], proxy.requests


async def test_sigterm_drains_in_flight_stream_then_exits_zero(up):
    request = agent_pb2.RunTaskRequest(payload="Explain the with statement in detail.", task_type="chat",
                                       max_tokens=300)
    async with open_channel(up.address("orchestrator")) as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).RunTask(request, timeout=60)
        events = []
        async for event in call:
            events.append(event)
            if event.HasField("token") and event.token.index <= 2 < event.token.index + max(1, event.token.count):
                up.proc.send_signal(signal.SIGTERM)  # mid-stream
        stopped_at = time.monotonic()
    assert events[-1].HasField("final"), "stream cut by shutdown"
    tokens = [e for e in events if e.HasField("token")]
    assert token_count(e.token for e in tokens) == events[-1].final.usage.completion_tokens
    code = await asyncio.to_thread(up.proc.wait, 60)
    assert code == 0, "".join(up.lines)
    assert "stopping" in "".join(up.lines)
    assert time.monotonic() - stopped_at < 60
