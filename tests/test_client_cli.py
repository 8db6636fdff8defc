"""``switchyard run``: what it says when its own deadline, not the server, ends the call."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.client import main as run_main


@contextlib.asynccontextmanager
async def serving(servicer: agent_pb2_grpc.AgentServiceServicer) -> AsyncIterator[str]:
    """``servicer`` on a real gRPC server on 127.0.0.1 port 0 for the body; yields its address for --addr."""
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


class _Slow(agent_pb2_grpc.AgentServiceServicer):
    async def RunTask(self, request, context):
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))
        await asyncio.sleep(30)


async def test_its_own_timeout_running_out_is_named_with_the_flag_to_raise(capsys):
    """grpc's bare "Deadline Exceeded" named nothing: the command's own --timeout had run out."""
    async with serving(_Slow()) as addr:
        code = await asyncio.to_thread(run_main, ["--addr", addr, "--timeout", "0.3", "hello"])
    err = capsys.readouterr().err
    assert code == 1 and "DEADLINE_EXCEEDED" in err
    assert "this command's --timeout (0.3 s) ran out before the task ended; raise it" in err, err


class _Quick(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.time_left: list[float | None] = []
        self.authorization: list[str] = []
        self.tenant_and_agent: list[tuple[str | None, str]] = []

    async def RunTask(self, request, context):
        self.time_left.append(context.time_remaining())
        self.authorization.append(dict(context.invocation_metadata()).get("authorization", ""))
        self.tenant_and_agent.append((dict(context.invocation_metadata()).get("x-tenant-id"), request.agent_id))
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))
        yield agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(finish_reason="stop"))


async def test_a_timeout_past_what_a_grpc_deadline_holds_is_refused_before_the_call(capsys):
    """gRPC's deadline overflows past about 7e9 s from now, and the call failed at once DEADLINE_EXCEEDED ('this
    command's --timeout (1e+10 s) ran out'); at most MAX_CALL_TIMEOUT_S is taken, and serves."""
    from switchyard.common.channels import MAX_CALL_TIMEOUT_S

    servicer = _Quick()
    async with serving(servicer) as addr:
        code = await asyncio.to_thread(run_main, ["--addr", addr, "--timeout", f"{MAX_CALL_TIMEOUT_S:g}", "hello"])
        assert code == 0, capsys.readouterr().err
        assert servicer.time_left[0] > 1e7  # a deadline went out (gRPC's wire form caps what the server sees)
        for huge in ("1e10", "1e300"):
            with pytest.raises(SystemExit) as caught:
                await asyncio.to_thread(run_main, ["--addr", addr, "--timeout", huge, "hello"])
            assert caught.value.code == 2
            assert f"--timeout: expected seconds > 0, at most 1e+09 (gRPC's deadline overflows past it), got " \
                   f"{float(huge):g}" in capsys.readouterr().err
    assert len(servicer.time_left) == 1  # the refused ones never called


async def test_token_file_sends_the_files_token_over_the_variable(tmp_path, monkeypatch, capsys):
    """switchyard run takes --token-file as profile, bench http and the locustfile do (the README said so; it
    answered 'unrecognized arguments: --token-file')."""
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "tok-from-variable")
    (tmp_path / "token").write_bytes(b"\xef\xbb\xbftok-from-file\n")  # an editor's BOM is no part of it
    servicer = _Quick()
    async with serving(servicer) as addr:
        for extra in ([], ["--token-file", str(tmp_path / "token")]):
            assert await asyncio.to_thread(run_main, ["--addr", addr, *extra, "hello"]) == 0
        assert await asyncio.to_thread(run_main, ["--addr", addr, "--token-file", str(tmp_path / "absent"),
                                                  "hello"]) == 2
    assert servicer.authorization == ["Bearer tok-from-variable", "Bearer tok-from-file"]
    assert f"--token-file {tmp_path / 'absent'}: cannot read it" in capsys.readouterr().err


_ESC = "\x1b]0;owned\x07\x1b[2J"
"""An OSC window title and a clear-screen: what a model's output (or a quoted document) can carry."""


class _Hostile(agent_pb2_grpc.AgentServiceServicer):
    async def RunTask(self, request, context):
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))
        yield agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=f"line one\n\tand{_ESC} two\x9b31m"))
        yield agent_pb2.TaskEvent(tool_call=agent_pb2.ToolCallEvent(name=f"calc{_ESC}", arguments_json="{}"))
        yield agent_pb2.TaskEvent(tool_result=agent_pb2.ToolResultEvent(name="calc", content=f"4{_ESC}", attempts=1))
        yield agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(task_id="t", passages=[
            agent_pb2.Passage(title=f"with{_ESC}", source="x\rY", score=0.5)]))
        await context.abort(grpc.StatusCode.INTERNAL, f"upstream said {_ESC}")


async def test_control_characters_the_task_sends_back_never_reach_the_terminal(capsys):
    """A token holding ESC reached the terminal as is: the model's output could retitle the window, clear the
    screen or hide text. Each control character but a token's newline and tab is printed as \\xNN."""
    async with serving(_Hostile()) as addr:
        code = await asyncio.to_thread(run_main, ["--addr", addr, "hello"])
    captured = capsys.readouterr()
    assert code == 1
    for stream in (captured.out, captured.err):
        assert not any(c in stream for c in "\x1b\x07\x9b\r"), repr(stream)
    assert "line one\n\tand\\x1b]0;owned\\x07\\x1b[2J two\\x9b31m" in captured.out, captured.out
    assert "tool call   calc\\x1b]0;owned" in captured.out and "[1] with\\x1b]0;owned" in captured.out
    assert "(x\\x0dY)" in captured.out
    assert "upstream said \\x1b]0;owned\\x07" in captured.err, captured.err


def test_doctor_prints_what_a_model_server_answered_without_its_control_characters():
    """A check's detail quotes the server (the model ids it lists, its error text): printed as it came, a
    server's ESC reached the operator's terminal."""
    from switchyard.common.config import UpstreamConfig
    from switchyard.gateway.doctor import Check, format_report

    report = format_report(UpstreamConfig(), [
        Check("models", False, f"the server lists evil{_ESC}", fix=f"set model{_ESC}"),
        Check("stream", True, "a token in 0.1 s"),
    ])
    assert not any(c in report for c in "\x1b\x07"), repr(report)
    assert "lists evil\\x1b]0;owned\\x07\\x1b[2J" in report and "fix: set model\\x1b]0;owned" in report
    assert report.count("\n") == 4  # the report's own lines are kept: set-up, FAIL, fix, ok, summary


@pytest.mark.parametrize("addr", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:5x", "nohost"])
def test_an_addr_with_no_port_a_client_can_dial_is_refused_naming_it(capsys, addr):
    """--addr 127.0.0.1:99999 passed its check (up to five digits) and grpc dialled 127.0.0.1:34463: the port
    modulo 65536, another server's perhaps."""
    with pytest.raises(SystemExit) as refused:
        run_main(["--addr", addr, "hello"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"--addr: expected host:port such as 127.0.0.1:50051, a port in 1-65535, got {addr!r}" in err, err


@pytest.mark.parametrize("addr", ["http://127.0.0.1:8080", "https://orchestrator:443", "HTTP://127.0.0.1:8080/"])
def test_an_addr_given_as_a_url_is_refused_naming_the_scheme_at_once(capsys, addr):
    """The HTTP face's URL that switchyard up prints, pasted into --addr, read after a call 'errors resolving
    http://127.0.0.1:37991: ... Misformatted domain name' (its host taken for 'http://127.0.0.1'), and bench run's
    target waited 10 s to say it 'cannot reach the orchestrator'."""
    with pytest.raises(SystemExit) as refused:
        run_main(["--addr", addr, "hello"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"got {addr!r} ({addr!r} is a URL: give host:port, no scheme; the orchestrator's gRPC port, not " \
           "its HTTP face's)" in err, err


class _Cut(agent_pb2_grpc.AgentServiceServicer):
    """Streams ``accepted``, then waits for its connection to be cut (the orchestrator killed mid-stream)."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()

    async def RunTask(self, request, context):
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t"))
        self.accepted.set()
        await asyncio.sleep(30)


@contextlib.asynccontextmanager
async def cutting_proxy(target: str) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A TCP proxy to ``target`` on 127.0.0.1 port 0; setting the event aborts every connection it carries (RST),
    as the death of the process behind it does."""
    cut = asyncio.Event()
    host, port = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        pipes = [asyncio.ensure_future(pipe(reader, up_writer)), asyncio.ensure_future(pipe(up_reader, writer))]
        await cut.wait()
        for p in pipes:
            p.cancel()
        writer.transport.abort()
        up_writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", cut
    finally:
        cut.set()
        server.close()


async def test_a_connection_cut_mid_stream_is_named_with_the_orchestrators_address(capsys):
    """An orchestrator killed mid-stream read 'error: UNAVAILABLE: Stream removed (Socket closed)' and nothing
    more: not whose socket, nor that the task's outcome is unknown."""
    servicer = _Cut()
    async with serving(servicer) as addr, cutting_proxy(addr) as (proxied, cut):
        run = asyncio.ensure_future(asyncio.to_thread(run_main, ["--addr", proxied, "--timeout", "30", "hello"]))
        await asyncio.wait_for(servicer.accepted.wait(), 30)
        await asyncio.sleep(0.2)  # the accepted event on its way through the proxy
        cut.set()
        code = await asyncio.wait_for(run, 60)
    err = capsys.readouterr().err
    assert code == 1 and "UNAVAILABLE" in err, err
    assert f"the connection to the orchestrator at {proxied} broke before the task ended" in err, err


async def test_the_agent_and_its_tenant_are_named_from_the_command_line(capsys):
    """An agent program's user tries tenants and agents from the command line: switchyard run had no way to name
    either (a tenant only through a token whose line names one). --tenant goes as x-tenant-id, --agent-id as the
    request's agent; a tenant the edge would refuse is refused before the call, naming the flag."""
    servicer = _Quick()
    async with serving(servicer) as addr:
        assert await asyncio.to_thread(run_main, ["--addr", addr, "--tenant", "acme", "--agent-id", "planner",
                                                  "hello"]) == 0
        assert await asyncio.to_thread(run_main, ["--addr", addr, "hello"]) == 0
        with pytest.raises(SystemExit) as caught:
            await asyncio.to_thread(run_main, ["--addr", addr, "--tenant", "acme corp", "hello"])
        assert caught.value.code == 2
    assert servicer.tenant_and_agent == [("acme", "planner"), (None, "")]
    assert "--tenant: expected 1 to 64 characters of A-Z a-z 0-9 . _ -, got 'acme corp'" in capsys.readouterr().err


async def test_a_task_refused_on_its_own_timeout_names_the_flag_to_raise(capsys):
    """A real orchestrator refuses a task whose measured work does not fit in the caller's deadline, naming that
    deadline as the caller's: for switchyard run, its --timeout; the command says so."""
    from test_program import stack

    async with stack() as (stub, down):
        down.orchestrator._deps.program.steps.observe("chat", "model", 100.0)  # a measured chat step takes 100 s
        addr = f"127.0.0.1:{down.orchestrator_port}"
        code = await asyncio.to_thread(run_main, ["--addr", addr, "--task-type", "chat", "--timeout", "30", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "refused early" in err and "(the caller's gRPC deadline)" in err, err
    assert "this command's --timeout (30 s) is the task's deadline, and its measured work does not fit in it" in err
