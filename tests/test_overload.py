"""A burst larger than grpc core's pending-call limits reaches the servicers (none is lost unseen).

grpc core cancels calls that no servicer has picked up yet, at random, once more
than 1,000 wait (all past 3,000), and any that waited 30 s: a bare CANCELLED
that no Switchyard metric counts. Servers started with ``server_options`` raise
those limits (the waiting time to ``server.max_unrequested_time_s``), so
overload is refused by Switchyard's own queues, by name.
The server runs in its own process, as in production, so the burst arrives
faster than its event loop picks calls up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import subprocess
import sys
import time
from typing import AsyncIterator

import grpc
import pytest

pytestmark = pytest.mark.slow

_SERVER = r"""
import asyncio, sys, time, grpc, uvloop
from switchyard.common.config import ServerConfig
from switchyard.common.server import server_options

async def main():
    # argv: grpc-defaults, or switchyard [server.max_unrequested_time_s]
    overrides = {"max_unrequested_time_s": int(sys.argv[2])} if len(sys.argv) > 2 else {}
    options = server_options(ServerConfig(**overrides)) if sys.argv[1] == "switchyard" else []
    server = grpc.aio.server(options=options)

    async def stream(request, context):
        for _ in range(3):
            await asyncio.sleep(0.01)
            yield b"x"

    async def block(request, context):
        print("busy", flush=True)
        time.sleep(float(request))  # holds the event loop: no other call is handed to a servicer meanwhile
        return b"x"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Burst", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Block": grpc.unary_unary_rpc_method_handler(block),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

uvloop.run(main())
"""


@contextlib.asynccontextmanager
async def _server(*argv: str) -> AsyncIterator[tuple[subprocess.Popen, grpc.aio.Channel]]:
    """The server above in its own process (``argv``: see its main), and a channel to it."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, *argv], stdout=subprocess.PIPE, text=True)
    try:
        port = int(await asyncio.to_thread(proc.stdout.readline))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
            yield proc, channel
    finally:
        proc.kill()
        proc.wait()


async def _stream_code(channel: grpc.aio.Channel) -> str:
    """One Stream call read to its end: "OK" or the status code's name."""
    try:
        [m async for m in channel.unary_stream("/t.Burst/Stream")(b"", timeout=120)]
        return "OK"
    except grpc.aio.AioRpcError as err:
        return err.code().name


async def _burst(options: str, calls: int) -> collections.Counter:
    async with _server(options) as (_, channel):
        return collections.Counter(await asyncio.gather(*(_stream_code(channel) for _ in range(calls))))


async def test_a_5000_call_burst_reaches_the_servicer_every_time():
    assert await _burst("switchyard", 5000) == {"OK": 5000}


async def test_grpc_defaults_cancel_part_of_the_same_burst():
    """The control: without server_options the same burst loses calls to bare CANCELLED."""
    codes = await _burst("grpc-defaults", 5000)
    assert codes["CANCELLED"] > 0 and codes["OK"] + codes["CANCELLED"] == 5000, codes


# A Block call holds the server's one event loop, so the calls that arrive meanwhile are not handed to a
# servicer: grpc core holds them unrequested, and cancels those that waited past server.max_unrequested_time_s
# once the loop asks for the next call.


async def _unrequested(limit: str, busy_s: float, calls: int) -> tuple[collections.Counter, float]:
    """Codes of ``calls`` Stream calls sent while the server's loop is busy for ``busy_s``, and the shortest
    time one of them took to end CANCELLED (inf when none did)."""
    async with _server("switchyard", *([limit] if limit != "default" else [])) as (proc, channel):
        blocker = channel.unary_unary("/t.Burst/Block")(str(busy_s).encode(), timeout=120)  # sent at once
        assert await asyncio.to_thread(proc.stdout.readline) == "busy\n"

        async def timed() -> tuple[str, float]:
            sent = time.monotonic()
            return await _stream_code(channel), time.monotonic() - sent

        ended = await asyncio.gather(*(timed() for _ in range(calls)))
        assert await blocker == b"x"
    return (collections.Counter(code for code, _ in ended),
            min((took for code, took in ended if code == "CANCELLED"), default=math.inf))


async def test_calls_left_unrequested_past_the_configured_time_are_cancelled():
    """server.max_unrequested_time_s reaches grpc core: at 1 s, calls that a 3 s busy loop left waiting end
    CANCELLED (never sooner than 1 s); at the default (an hour) the same calls are served. The aio server asks
    core for one call ahead, so one of them may still be served."""
    (short, cancelled_after), (default, _) = await asyncio.gather(
        _unrequested("1", 3.0, 8), _unrequested("default", 3.0, 8))
    assert default == {"OK": 8}, default
    assert short["CANCELLED"] >= 6 and short["OK"] + short["CANCELLED"] == 8, short
    assert cancelled_after >= 1.0
