"""``switchyard run``: what it says when its own deadline, not the server, ends the call."""

from __future__ import annotations

import asyncio

import grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.client import main as run_main


class _Slow(agent_pb2_grpc.AgentServiceServicer):
    async def RunTask(self, request, context):
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))
        await asyncio.sleep(30)


async def test_its_own_timeout_running_out_is_named_with_the_flag_to_raise(capsys):
    """grpc's bare "Deadline Exceeded" named nothing: the command's own --timeout had run out."""
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(_Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        code = await asyncio.to_thread(run_main, ["--addr", f"127.0.0.1:{port}", "--timeout", "0.3", "hello"])
    finally:
        await server.stop(None)
    err = capsys.readouterr().err
    assert code == 1 and "DEADLINE_EXCEEDED" in err
    assert "this command's --timeout (0.3 s) ran out before the task ended; raise it" in err, err
