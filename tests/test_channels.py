"""common/channels.py: internal channels ignore proxies, spread over addresses, and carry deadlines."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proxy_fixtures import refusing_proxy  # noqa: F401 - fixture
from switchyard.common.channels import (
    bounded_timeout,
    channel_options,
    deadline_scope,
    open_channel,
    open_sync_channel,
    remaining_s,
)
from switchyard.common.config import ServerConfig
from switchyard.launcher import healthy

SLOW = "/test.Slow/Sleep"


async def _health_server(status: health_pb2.HealthCheckResponse.ServingStatus,
                         port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)

    async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(float(request.decode()))
        return b"slept"

    async def sleep_stream(request: bytes, context: grpc.aio.ServicerContext):
        await asyncio.sleep(float(request.decode()))
        yield b"slept"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Slow", {
        "Sleep": grpc.unary_unary_rpc_method_handler(sleep),
        "SleepStream": grpc.unary_stream_rpc_method_handler(sleep_stream),
    })])
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def test_internal_channels_never_use_the_http_proxy(refusing_proxy):
    server, port = await _health_server(health_pb2.HealthCheckResponse.SERVING)
    try:
        # A plain channel honours the proxy variables: the proxy sees CONNECT and answers 503.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert any(line.startswith(f"CONNECT 127.0.0.1:{port}") for line in refusing_proxy.requests)
        refusing_proxy.requests.clear()

        async with open_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        def sync_check() -> int:  # blocking: off the loop that serves it
            with open_sync_channel(f"127.0.0.1:{port}") as channel:
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status

        assert await asyncio.to_thread(sync_check) == health_pb2.HealthCheckResponse.SERVING
        assert await asyncio.to_thread(healthy, f"127.0.0.1:{port}", "", 10)  # the launcher's health check
        assert refusing_proxy.requests == []
    finally:
        await server.stop(None)


async def test_a_new_channel_reaches_a_server_on_an_address_another_channel_is_backing_off_from():
    """A server went away and another now listens at its address (a restarted replica; in the suite, a port
    given out again): a channel opened to it calls it at once, whatever an older channel to the gone server is
    doing. grpc core shared one subchannel per address among a process's channels, its reconnect backoff too:
    the new channel's calls failed UNAVAILABLE "connections to all backends failing ... Connection refused"
    until the old channel's backoff ran out (an orchestrator's RunTask failed so in the suite)."""
    gone, port = await _health_server(health_pb2.HealthCheckResponse.SERVING)
    async with open_channel(f"127.0.0.1:{port}") as old:
        await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=10)
        await gone.stop(None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the old channel's connection fails: it backs off
            await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        server, _ = await _health_server(health_pb2.HealthCheckResponse.SERVING, port)
        try:
            async with open_channel(f"127.0.0.1:{port}") as new:
                reply = await health_pb2_grpc.HealthStub(new).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)


async def test_multi_address_target_reaches_every_address(refusing_proxy):
    """``ipv4:a,b`` is spread over both servers (round_robin), and is never sent to the proxy as one CONNECT."""
    a, port_a = await _health_server(health_pb2.HealthCheckResponse.SERVING)
    b, port_b = await _health_server(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        async with open_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await channel.channel_ready()
            statuses = [(await stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)).status
                        for _ in range(20)]
        assert set(statuses) == {health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING}
        assert refusing_proxy.requests == []
    finally:
        await a.stop(None)
        await b.stop(None)


async def test_deadline_scope_bounds_every_call_started_in_it():
    server, port = await _health_server(health_pb2.HealthCheckResponse.SERVING)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            sleep = channel.unary_unary(SLOW)
            assert await sleep(b"0", timeout=30) == b"slept"
            stream = channel.unary_stream(SLOW + "Stream")
            with deadline_scope(time.monotonic() + 0.3):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await sleep(b"5", timeout=30)  # asks for 30 s, the scope leaves 0.3 s
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in stream(b"5", timeout=30)]  # server streaming too
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await sleep(b"0", timeout=30) == b"slept"  # outside the scope: no bound
    finally:
        await server.stop(None)


def test_deadline_scopes_nest_to_the_earlier_deadline():
    assert remaining_s() is None and bounded_timeout(5.0) == 5.0 and bounded_timeout(None) is None
    now = time.monotonic()
    with deadline_scope(now + 10):
        with deadline_scope(now + 100):  # later: the outer deadline stays
            assert 9 < remaining_s() <= 10
        with deadline_scope(now + 1):
            assert remaining_s() <= 1 and bounded_timeout(5.0) <= 1 and bounded_timeout(None) <= 1
        assert bounded_timeout(0.5) == 0.5
    assert remaining_s() is None


def test_channel_options_disable_the_proxy_and_ping_no_faster_than_servers_accept():
    options = dict(channel_options(ServerConfig()))
    assert options["grpc.enable_http_proxy"] == 0
    assert options["grpc.keepalive_time_ms"] >= 10_000  # servers' min_ping_interval_without_data_ms
    assert options["grpc.max_receive_message_length"] == ServerConfig().max_message_bytes
    with pytest.raises(ValueError, match="keepalive_time_s"):
        ServerConfig(keepalive_time_s=1)


async def test_goaways_for_the_connections_age_and_the_reconnects_are_counted_per_peer():
    from switchyard.common.metrics import CHANNEL_DISCONNECTS, CHANNEL_RECONNECTS
    from switchyard.common.server import server_options

    # A grace of 2 s: a Check in flight when the GOAWAY comes finishes on the old connection
    # (with none the server cancels it, "max connection age", and the test raced the age).
    config = ServerConfig(max_connection_age_s=1, max_connection_age_grace_s=2)
    server = grpc.aio.server(options=server_options(config))
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    lost = CHANNEL_DISCONNECTS.labels("retrieval")._value.get
    back = CHANNEL_RECONNECTS.labels("retrieval")._value.get
    before = (lost(), back())
    try:
        async with open_channel(f"127.0.0.1:{port}", config, peer="retrieval") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert (lost(), back()) == before  # the first connection is no reconnect
            # a call every 0.1 s until the age (1 s, +10 % jitter) has closed a connection and a call has made
            # another; the bound (10 s) is on a hang, not a speed
            for _ in range(100):
                await asyncio.sleep(0.1)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                if lost() >= before[0] + 1 and back() >= before[1] + 1:
                    break
            assert lost() >= before[0] + 1 and back() >= before[1] + 1
    finally:
        await server.stop(0)
    assert CHANNEL_DISCONNECTS.labels("other")._value.get() >= 0  # every peer exported from 0


STALLING_SERVER = """
import asyncio, sys
import grpc
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import ServerConfig
from switchyard.common.server import server_options

class Slow(agent_pb2_grpc.InferenceServiceServicer):
    async def Generate(self, request, context):
        for i in range(100_000):
            yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text="x", index=i))
            await asyncio.sleep(0.2)

async def main():
    server = grpc.aio.server(options=server_options(ServerConfig()))
    agent_pb2_grpc.add_InferenceServiceServicer_to_server(Slow(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.mark.slow
async def test_a_peer_stopped_mid_stream_fails_the_stream_unavailable_at_its_keepalive():
    """A peer that stops answering without closing its connection (SIGSTOP, a hung host): the keepalive ping
    goes unanswered and the stream fails UNAVAILABLE after keepalive_time_s + keepalive_timeout_s. grpc core
    waited a minute or more for the ping's ack (its ping timeout, not the keepalive timeout), and the stream
    hung: an orchestrator's tasks on a stopped dispatcher waited for their whole time limit."""
    import os
    import signal
    import subprocess
    import sys

    from switchyard.api import agent_pb2, agent_pb2_grpc

    peer = subprocess.Popen([sys.executable, "-c", STALLING_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        # keepalive_time_s and keepalive_timeout_s 1 s, below the 10 s and 2 s a config may hold (the interval
        # servers accept, gRFC A8; this peer is stopped before its first ping, and never acks one): the channel's
        # options come from the fields whatever their value, and the old ping-ack wait (grpc core's minute) still
        # runs past the bound below, where 1 + 1 s do not
        config = ServerConfig().model_copy(update={"keepalive_time_s": 1.0, "keepalive_timeout_s": 1.0})
        async with open_channel(f"127.0.0.1:{port}", config) as channel:
            stream = agent_pb2_grpc.InferenceServiceStub(channel).Generate(agent_pb2.GenerateRequest(request_id="r"))
            await stream.read()  # streaming: the peer is alive
            os.kill(peer.pid, signal.SIGSTOP)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                # the bound only lets the old behaviour fail rather than hang: expected at about 2 s
                await asyncio.wait_for(_read_to_end(stream), 45)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value.details()
    finally:
        peer.kill()
        peer.wait()


async def _read_to_end(stream) -> None:
    while await stream.read() is not grpc.aio.EOF:
        pass
