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
import math
import subprocess
import sys
import time

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


# The server's one event loop is held by a handler that blocks it, so the calls that arrive meanwhile are not
# handed to a servicer: grpc core holds them unrequested, and cancels those that waited past
# server.max_unrequested_time_s once the loop asks for the next call.
_BUSY_SERVER = r"""
import asyncio, sys, time, grpc
from switchyard.common.config import ServerConfig
from switchyard.common.server import server_options

async def main():
    config = ServerConfig(**({"max_unrequested_time_s": int(sys.argv[1])} if sys.argv[1] != "default" else {}))
    server = grpc.aio.server(options=server_options(config))

    async def call(request, context):
        if request == b"block":
            print("busy", flush=True)
            time.sleep(float(sys.argv[2]))  # blocks the event loop: no other call is picked up meanwhile
        return b"x"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Busy", {"Call": grpc.unary_unary_rpc_method_handler(call)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def _unrequested(limit: str, busy_s: float, calls: int) -> tuple[collections.Counter, float]:
    """Codes of ``calls`` calls sent while the server's loop is busy for ``busy_s``, and the shortest
    time one of them took to end CANCELLED (inf when none did)."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_SERVER, limit, str(busy_s)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(await asyncio.to_thread(proc.stdout.readline))
        codes: collections.Counter = collections.Counter()
        cancelled_after = math.inf
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
            call = channel.unary_unary("/t.Busy/Call")

            async def one(request: bytes) -> str:
                nonlocal cancelled_after
                sent = time.monotonic()
                try:
                    await call(request, timeout=120)
                    return "OK"
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.CANCELLED:
                        cancelled_after = min(cancelled_after, time.monotonic() - sent)
                    return err.code().name

            blocker = asyncio.create_task(one(b"block"))
            assert await asyncio.to_thread(proc.stdout.readline) == "busy\n"
            codes.update(await asyncio.gather(*(one(b"") for _ in range(calls))))
            assert await blocker == "OK"
        return codes, cancelled_after
    finally:
        proc.kill()
        proc.wait()


async def test_calls_left_unrequested_past_the_configured_time_are_cancelled():
    """server.max_unrequested_time_s reaches grpc core: at 1 s, calls that a 3 s busy loop left waiting end
    CANCELLED (never sooner than 1 s); at the default (an hour) the same calls are served. The aio server asks
    core for one call ahead, so one of them may still be served."""
    (short, cancelled_after), (default, _) = await asyncio.gather(
        _unrequested("1", 3.0, 8), _unrequested("default", 3.0, 8))
    assert default == {"OK": 8}, default
    assert short["CANCELLED"] >= 6 and short["OK"] + short["CANCELLED"] == 8, short
    assert cancelled_after >= 1.0
