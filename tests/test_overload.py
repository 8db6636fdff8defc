"""A burst larger than grpc core's pending-call limits reaches the servicers (none is lost unseen).

grpc core cancels calls that no servicer has picked up yet, at random, once more
than 1,000 wait (all past 3,000), and any that waited 30 s: a bare CANCELLED
that no Switchyard metric counts. Servers started with ``server_options`` raise
those limits, so overload is refused by Switchyard's own queues, by name.
The server runs in its own process, as in production, so the burst arrives
faster than its event loop picks calls up.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys

import grpc
import pytest

pytestmark = pytest.mark.slow

_SERVER = r"""
import asyncio, sys, grpc, uvloop
from switchyard.common.config import ServerConfig
from switchyard.common.server import server_options

async def main():
    options = server_options(ServerConfig()) if sys.argv[1] == "switchyard" else []
    server = grpc.aio.server(options=options)

    async def stream(request, context):
        for _ in range(3):
            await asyncio.sleep(0.01)
            yield b"x"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Burst", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

uvloop.run(main())
"""


async def _burst(options: str, calls: int) -> collections.Counter:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, options], stdout=subprocess.PIPE, text=True)
    try:
        port = int(await asyncio.to_thread(proc.stdout.readline))
        codes: collections.Counter = collections.Counter()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
            stream = channel.unary_stream("/t.Burst/Stream")

            async def one() -> None:
                try:
                    [m async for m in stream(b"", timeout=120)]
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    codes[err.code().name] += 1

            await asyncio.gather(*(one() for _ in range(calls)))
        return codes
    finally:
        proc.kill()
        proc.wait()


async def test_a_5000_call_burst_reaches_the_servicer_every_time():
    assert await _burst("switchyard", 5000) == {"OK": 5000}


async def test_grpc_defaults_cancel_part_of_the_same_burst():
    """The control: without server_options the same burst loses calls to bare CANCELLED."""
    codes = await _burst("grpc-defaults", 5000)
    assert codes["CANCELLED"] > 0 and codes["OK"] + codes["CANCELLED"] == 5000, codes
