"""``switchyard doctor`` output for good and bad set-ups, against a real sim-openai server."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from gateway_fixtures import TEST_KEY, clean_proxy_env, start_sim  # noqa: F401

from switchyard.cli import main as cli_main
from switchyard.gateway import doctor

CONFIG = str(Path(__file__).resolve().parents[1] / "config")
KEY_ENV = "TAOTOKEN_API_KEY"  # config/queue.json model_gateway.api_key_env


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def keyed_sim(clean_proxy_env, monkeypatch):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(api_key=TEST_KEY) as server:
        yield server


def run_doctor(capsys, *argv: str) -> tuple[int, str]:
    code = doctor.main(["--config-dir", CONFIG, "--timeout", "3", *argv])
    return code, capsys.readouterr().out


def test_good_setup_passes_every_check(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--probe")
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert f"{KEY_ENV} (length {len(TEST_KEY)}, no whitespace) is set" in out
    assert "model claude-sonnet-4-5" in out and "stream probe" in out
    assert TEST_KEY not in out


def test_a_server_that_refuses_tools_is_a_warning_naming_react_loop(clean_proxy_env, monkeypatch, capsys):
    """A react_loop call offers its tools; vLLM started without --enable-auto-tool-choice answers each 400
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'. Doctor passed such
    a server (its probe offers none) and every react_loop task then failed INVALID_ARGUMENT."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(api_key=TEST_KEY, refuse_fields=frozenset({"tools"})) as server:
        code, out = run_doctor(capsys, "--base-url", server.base_url, "--probe")
        offered = [body for body in server.state.requests if "tools" in body]
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("warn  tools"))
    assert "refused a request offering a tool" in line and "react_loop task" in line and "INVALID_ARGUMENT" in line
    assert "--enable-auto-tool-choice" in out
    assert len(offered) == 1 and "tool_choice" not in offered[0], "offered as the engine offers them"


def test_a_server_that_takes_tools_passes_the_tools_check(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--probe")
    assert code == 0 and re.search(r"^ok +tools +a request offering a tool is accepted", out, re.M), out


def test_cli_routes_to_doctor(keyed_sim, capsys):
    assert cli_main(["doctor", "--config-dir", CONFIG, "--base-url", keyed_sim.base_url]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_key_with_trailing_newline_fails_with_fix(keyed_sim, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY + "\n")
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url)
    assert code == 1
    assert f"FAIL  api key" in out and "trailing '\\n'" in out and "fix: " in out and "tr -d" in out
    assert TEST_KEY not in out


def test_missing_key_fails_with_fix(keyed_sim, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV)
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url)
    assert code == 1 and f"{KEY_ENV} is not set; export {KEY_ENV}=<your key>" in out
    assert "refuses the key: 401" in out


def test_unknown_model_suggests_nearest(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--model", "claude-sonnet-4.5")
    assert code == 1
    assert "FAIL  model claude-sonnet-4.5" in out and "fix: use 'claude-sonnet-4-5'" in out


def test_a_default_model_a_variable_set_is_fixed_in_that_variable(keyed_sim, monkeypatch, capsys):
    """SWITCHYARD_UPSTREAM_MODEL naming an id the server does not serve: the fixes said to set
    model_gateway.default_model, which the variable overrides, so a fix made there changed nothing."""
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "claude-sonnet-4.5")
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url)
    assert code == 1, out
    assert ("fix: use 'claude-sonnet-4-5' (in the request, SWITCHYARD_UPSTREAM_MODEL (it overrides "
            "model_gateway.default_model) or model_gateway.model_map)") in out, out
    assert "fix: set SWITCHYARD_UPSTREAM_MODEL (it overrides model_gateway.default_model) (or model_gateway.model_map)" \
        " to one of: " in out, out
    assert "set model_gateway.default_model" not in out, out
    monkeypatch.delenv("SWITCHYARD_UPSTREAM_MODEL")  # the file's own default_model: the key is the fix
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--model", "claude-sonnet-4.5")
    assert "SWITCHYARD_UPSTREAM_MODEL" not in out, out


def test_dead_base_url_fails_with_fix(clean_proxy_env, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    code, out = run_doctor(capsys, "--base-url", f"http://127.0.0.1:{closed_port()}/v1")
    assert code == 1 and "does not answer" in out and "switchyard serve sim-openai" in out


def test_an_https_url_of_a_plain_http_server_says_to_use_http(keyed_sim, capsys):
    """https:// in front of a server that speaks plain HTTP read '[SSL: WRONG_VERSION_NUMBER] wrong version number',
    with the fix 'start the model server', which runs."""
    url = keyed_sim.base_url.replace("http://", "https://", 1)
    code, out = run_doctor(capsys, "--base-url", url, "--no-probe")
    assert code == 1 and "FAIL  base url" in out, out
    assert "answers plain HTTP, not TLS: use http:// in model_gateway.base_url" in out, out


def test_a_base_url_at_a_port_that_speaks_no_http_says_so(clean_proxy_env, monkeypatch, capsys):
    """A base URL at a gRPC port (a Switchyard service's) or a Redis read 'does not answer (RemoteProtocolError:
    illegal request line)' with the fix 'start the model server': something runs there, and it is not one."""
    import threading

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_garbage() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame, as gRPC sends

    threading.Thread(target=answer_garbage, daemon=True).start()
    try:
        code, out = run_doctor(capsys, "--base-url", f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "--no-probe")
    finally:
        listener.close()
    assert code == 1 and "FAIL  base url" in out, out
    assert "something listens there but does not answer HTTP/1.1" in out, out


def test_wrong_path_fails_naming_v1(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url.removesuffix("/v1"))
    assert code == 1 and "answers 404" in out and "ending in /v1" in out


def test_dead_proxy_fails_with_fix(keyed_sim, monkeypatch, capsys):
    proxy = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HTTP_PROXY", proxy)
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url)
    assert code == 1
    assert f"FAIL  proxy HTTP_PROXY  HTTP_PROXY={proxy} does not answer" in out
    assert "NO_PROXY" in out and f"via HTTP_PROXY={proxy}" in out


def test_bad_config_exits_2(tmp_path, capsys):
    (tmp_path / "queue.json").write_text('{"model_gateway": {"base_url": "ftp://x"}}')
    assert doctor.main(["--config-dir", str(tmp_path)]) == 2
    assert "model_gateway.base_url" in capsys.readouterr().err


def test_probe_skipped_for_a_bad_key_is_reported_with_the_reason(keyed_sim, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY + " ")
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--probe")
    assert code == 1
    assert "skip  stream probe" in out and "skipped: the api key check failed" in out
    assert out.rstrip().endswith("check(s) failed, 1 skipped")


def test_probe_skipped_when_the_server_does_not_answer(clean_proxy_env, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    code, out = run_doctor(capsys, "--base-url", f"http://127.0.0.1:{closed_port()}/v1", "--probe")
    assert code == 1 and "skipped: the base url check failed" in out


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        doctor.main(["--help"])
    out = capsys.readouterr().out
    assert "switchyard doctor: check the model gateway" in out and "GET /models" in out
    assert "``" not in out and "`" not in out


# --------------------------------------------------------------------------- the streamed probe (on by default)


def config_with(tmp_path: Path, **gateway: object) -> str:
    """A copy of config/ whose model_gateway has ``gateway`` set."""
    import json
    import shutil

    out = tmp_path / "config"
    shutil.copytree(CONFIG, out)
    queue = json.loads((out / "queue.json").read_text())
    queue["model_gateway"].update(gateway)
    (out / "queue.json").write_text(json.dumps(queue))
    return str(out)


def test_the_probe_runs_by_default_and_no_probe_skips_it(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url)
    assert code == 0 and "ok    stream probe" in out and "ended by data: [DONE]" in out, out
    assert "server" in out and "unknown (detected from GET /models)" in out
    assert keyed_sim.state.requests and keyed_sim.state.requests[-1]["max_tokens"] == 1
    requests = len(keyed_sim.state.requests)
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--no-probe")
    assert code == 0 and "stream probe" not in out and len(keyed_sim.state.requests) == requests
    assert "unknown (detected from GET /models)" in out  # the server's flavour is read without the probe too


def test_a_stream_without_done_after_its_finish_reason_passes(clean_proxy_env, monkeypatch, capsys):
    """`switchyard serve sim-openai --fault no_done`: transformers serve's ending is a finished stream."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    from switchyard_harness.faults import Fault

    with start_sim(faults={"*": Fault(no_done=True)}) as server:
        code, out = run_doctor(capsys, "--base-url", server.base_url)
    assert code == 0, out
    assert "ended after its finish_reason without data: [DONE] (a finished stream)" in out


@pytest.mark.parametrize("stream_type, named", [("application/x-ndjson", "Content-Type 'application/x-ndjson'"),
                                                 ("none", "no Content-Type")])
def test_a_stream_labelled_other_than_event_stream_passes_with_a_warning_naming_the_label(
        clean_proxy_env, monkeypatch, capsys, stream_type, named):
    """`switchyard serve sim-openai --fault stream_type=application/x-ndjson` (LitServe's label): the stream is
    served, as its body is events; the label is named with its fix, and the exit code stays 0."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    from switchyard_harness.faults import Fault

    with start_sim(faults={"*": Fault(stream_type=stream_type)}) as server:
        code, out = run_doctor(capsys, "--base-url", server.base_url)
    assert code == 0, out
    assert "ended by data: [DONE]" in out
    line = next(line for line in out.splitlines() if "stream content type" in line)
    assert f"the server labels its stream {named}, not text/event-stream" in line, out
    assert "send Content-Type: text/event-stream" in out


def test_a_cut_stream_is_named_a_missing_end_marker(clean_proxy_env, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    from switchyard_harness.faults import Fault

    with start_sim(faults={"*": Fault(no_finish=True)}) as server:
        code, out = run_doctor(capsys, "--base-url", server.base_url)
    assert code == 1
    assert "FAIL  stream probe" in out and "missing end marker" in out and "fix: the stream was cut" in out


@pytest.mark.parametrize("fault, says, fix", [
    ("stream_error", "the server failed the request inside its stream: upstream ", "look for it in the server's logs"),
    ("cut_after", "connection cut: connection to ", "closed the connection before the answer ended"),
    ("close_before_headers", "connection cut: connection to ", "closed the connection before the answer ended"),
])
def test_a_stream_the_server_failed_or_a_connection_cut_is_not_named_a_missing_end_marker(
        clean_proxy_env, monkeypatch, capsys, fault, says, fix):
    """An error object inside the stream and a connection closed mid-answer (or before its headers) were all
    reported 'missing end marker' with the fix for a stream ended without one (a proxy's read timeout or
    buffering)."""
    import asyncio
    import threading

    from switchyard_harness.faults import Fault

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    if fault == "close_before_headers":
        loop = asyncio.new_event_loop()

        async def hang_up(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)  # closed with the probe's body unread, the close would be an RST
            if head.startswith(b"GET"):  # the model list: the probe is what hangs up
                body = b'{"object": "list", "data": [{"id": "claude-sonnet-4-5"}, {"id": "gpt-4o-mini"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
                await writer.drain()
            writer.close()

        server = loop.run_until_complete(asyncio.start_server(hang_up, "127.0.0.1", 0))
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            code, out = run_doctor(capsys, "--base-url", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1")
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            server.close()
    else:
        with start_sim(faults={"*": Fault(**{fault: 500 if fault == "stream_error" else 1})}) as sim:
            code, out = run_doctor(capsys, "--base-url", sim.base_url)
    assert code == 1
    assert "FAIL  stream probe" in out and says in out and fix in out, out
    assert "missing end marker" not in out and "fix: the stream was cut" not in out, out


def test_a_refused_priority_field_is_named_with_its_fix(clean_proxy_env, monkeypatch, capsys, tmp_path):
    """transformers serve answers forward_priority's field with 422 "Unexpected fields in the request"."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(refuse_fields=frozenset({"priority"})) as server:
        code, out = doctor.main(["--config-dir", config_with(tmp_path, forward_priority=True), "--timeout", "3",
                                 "--base-url", server.base_url]), capsys.readouterr().out
    assert code == 1, out
    assert "ok    stream probe" in out  # served once the field was dropped
    assert "FAIL  request field priority" in out and "the server refused 'priority'" in out
    assert "model_gateway.forward_priority to false" in out


def test_vllm_without_priority_scheduling_is_named_with_its_flag(clean_proxy_env, monkeypatch, capsys, tmp_path):
    """vLLM without --scheduling-policy priority takes priority 0 (CORE's) and refuses any other inside its
    stream: the probe was CORE's and passed, and every NORMAL and BATCH task failed INVALID_ARGUMENT."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(owned_by="vllm", priority_scheduling=False) as server:
        code, out = doctor.main(["--config-dir", config_with(tmp_path, forward_priority=True), "--timeout", "3",
                                 "--base-url", server.base_url]), capsys.readouterr().out
    assert code == 1, out
    assert "ok    stream probe" in out  # served once the field was dropped
    assert "FAIL  request field priority" in out and "Priority scheduling is not enabled" not in out.split("FAIL")[0]
    assert "--scheduling-policy priority" in out


def test_an_unknown_model_names_the_ids_the_server_serves(clean_proxy_env, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(models=["served-a", "served-b"]) as server:
        code, out = run_doctor(capsys, "--base-url", server.base_url)
    assert code == 1
    assert "FAIL  stream probe" in out and "unknown model" in out
    assert "the server serves 'served-a', 'served-b'" in out and "one of: served-a, served-b" in out


def test_with_the_sim_engine_the_gateway_is_reported_not_in_use_and_its_failures_do_not_fail_doctor(
        clean_proxy_env, monkeypatch, capsys):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv("SWITCHYARD_ENGINE", raising=False)
    code, out = run_doctor(capsys, "--no-probe")  # the shipped config: engine sim, nothing on base_url
    assert code == 0, out
    assert "not in use: dispatcher.engine is 'sim'" in out and "FAIL  api key" in out
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    code, out = run_doctor(capsys, "--no-probe")
    assert code == 1 and "not in use" not in out and "FAIL  api key" in out


def test_a_pool_is_checked_endpoint_by_endpoint_not_by_a_stale_base_url(clean_proxy_env, monkeypatch, capsys, tmp_path):
    """pool.endpoints replace base_url: doctor checks each replica (before, it checked base_url alone and
    failed on a stale one while the pool served), and names the one that does not answer."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    with start_sim() as one, start_sim() as two:
        pool = {"endpoints": [one.base_url, two.base_url]}
        config = config_with(tmp_path, base_url=dead, pool=pool)
        code, out = doctor.main(["--config-dir", config, "--timeout", "3"]), capsys.readouterr().out
        assert code == 0, out
        for server in (one, two):
            assert f"ok    base url [{server.base_url}]" in out and f"stream probe [{server.base_url}]" in out
            assert server.state.requests  # each replica streamed the probe
        assert dead not in out and out.count("api key") == 1
        config = config_with(tmp_path / "again", pool={"endpoints": [one.base_url, dead]})
        code, out = doctor.main(["--config-dir", config, "--timeout", "3"]), capsys.readouterr().out
    assert code == 1, out
    assert f"FAIL  base url [{dead}]" in out and f"ok    base url [{one.base_url}]" in out
    assert "model_gateway.pool.endpoints in queue.json" in out  # the key that names it, not base_url


@pytest.mark.parametrize("argv, says", [
    (["--timeout", "0"], "argument --timeout: expected seconds above 0"),  # timed every check out, blamed the server
    (["--timeout", "-1"], "argument --timeout: expected seconds above 0"),
    (["--base-url", "garbage"], "--base-url: expected an http:// or https:// URL (got 'garbage')"),
])
def test_a_bad_flag_exits_2_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as caught:
        doctor.main(["--config-dir", CONFIG, *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "pydantic" not in err


def test_a_server_set_by_environment_alone_passes_and_aliases_it_lacks_are_warnings(clean_proxy_env, monkeypatch,
                                                                                   capsys):
    """The documented set-up for a real server (SWITCHYARD_UPSTREAM_BASE_URL and _MODEL) failed doctor on the
    shipped model_map's aliases, whose targets only requests naming them need: exit 1 for a stack that works."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(models=["acme/served-8b"]) as server:
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", server.base_url)
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "acme/served-8b")
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_FALLBACK_MODEL", "none")
        monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")  # the gateway's checks decide the exit code
        code, out = run_doctor(capsys)
    assert code == 0, out
    assert re.search(r"ok +model acme/served-8b +default_model: listed by /models", out), out
    assert "warn  model claude-sonnet-4-5" in out and "a request naming 'sonnet' will be NOT_FOUND" in out
    assert "or remove the alias" in out and "FAIL" not in out
    assert "all checks passed, 2 warning(s)" in out


@pytest.mark.parametrize("max_model_len, says", [
    # transformers serve, TGI, llama.cpp, Ollama: no window listed; a tiny Llama of 4,096 positions was checked
    # against the 8,192 default unsaid, and transformers serve generated 8,000 tokens past its positions
    (0, "acme/served-8b: 8192 tokens (limits.default_context_window_tokens); a prompt plus max_tokens past it is "
           "refused; the server reports no window for it (max_model_len in GET /models): if the model's is another, "
           "list it in limits.context_window_tokens in switchyard.json"),
    (4096, "acme/served-8b: 4096 tokens (as its model server reports it)"),  # vLLM's, SGLang's max_model_len
])
def test_the_default_models_context_window_is_stated_with_where_it_comes_from(clean_proxy_env, monkeypatch, capsys,
                                                                             max_model_len, says):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(models=["acme/served-8b"], max_model_len=max_model_len) as server:
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", server.base_url)
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "acme/served-8b")
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_FALLBACK_MODEL", "none")
        monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
        code, out = run_doctor(capsys, "--no-probe")
    assert code == 0, out
    assert re.search(r"^ok +context window +" + re.escape(says), out, re.M), out


def test_a_context_window_the_config_lists_is_named_as_the_configs(keyed_sim, capsys):
    code, out = run_doctor(capsys, "--base-url", keyed_sim.base_url, "--no-probe")
    assert code == 0, out
    assert re.search(r"^ok +context window +claude-sonnet-4-5: 200000 tokens \(limits.context_window_tokens\)", out,
                     re.M), out


def test_a_fallback_model_the_server_lacks_says_how_to_have_no_fallback(clean_proxy_env, monkeypatch, capsys):
    """A server of one model (transformers serve, llama.cpp) with the shipped fallback_model: the fix read
    "pick one of: <the default model>", a fallback that is the model that just failed; the way out is no
    fallback, which the fix did not name."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(models=["acme/served-8b"]) as server:
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", server.base_url)
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "acme/served-8b")
        monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
        code, out = run_doctor(capsys, "--no-probe")
    assert code == 1, out
    assert re.search(r"FAIL +model gpt-4o-mini +fallback_model: 'gpt-4o-mini' is not listed by /models", out), out
    assert "SWITCHYARD_UPSTREAM_FALLBACK_MODEL=none" in out


def test_a_server_that_takes_the_connection_and_never_answers_is_named_hung_not_down(clean_proxy_env, monkeypatch,
                                                                                     capsys):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")  # the gateway's checks decide the exit code
    with socket.socket() as listener:  # listens, accepts into its backlog, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", url)
        code = doctor.main(["--config-dir", CONFIG, "--timeout", "0.5"])
        out = capsys.readouterr().out
    assert code == 1
    assert "took the connection but sent no answer within 0.5 s (ReadTimeout)" in out, out
    assert "hung or overloaded" in out and "SWITCHYARD_UPSTREAM_BASE_URL (it overrides model_gateway.base_url)" in out


def test_a_server_trickling_its_model_list_is_named_hung_within_the_timeout(clean_proxy_env, monkeypatch, capsys):
    """httpx's timeout bounds each read: a server sending GET /models's answer a byte at a time held doctor (and the
    dispatcher's first read of the list, every request waiting its bound on it) for as long as it went on."""
    import asyncio

    from switchyard.common.config import UpstreamConfig
    from switchyard.gateway.client import GatewayClient
    from switchyard.gateway.errors import GatewayError

    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            with contextlib.suppress(OSError):
                for _ in range(50):  # 5 s of it at most: past the 0.5 s bound, the test fails, not hangs
                    if stop.wait(0.1):
                        break
                    conn.sendall(b"1\r\n \r\n")
                conn.sendall(b"0\r\n\r\n")

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"

        def accept() -> None:
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    threading.Thread(target=trickle, args=(listener.accept()[0],), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        try:
            monkeypatch.setenv(KEY_ENV, TEST_KEY)
            monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
            monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", url)
            code = doctor.main(["--config-dir", CONFIG, "--timeout", "0.5", "--no-probe"])
            out = capsys.readouterr().out
            assert code == 1
            assert "took the connection but sent no answer within 0.5 s (ReadTimeout)" in out, out

            async def list_models() -> GatewayError:
                config = UpstreamConfig(base_url=url, api_key_env=KEY_ENV, read_timeout_s=0.5)
                async with GatewayClient(config) as client:
                    with pytest.raises(GatewayError) as caught:
                        await asyncio.wait_for(client.list_models(), 30)
                return caught.value

            error = asyncio.run(list_models())
            assert "ReadTimeout" in str(error), error
        finally:
            stop.set()


def test_a_server_that_lists_its_models_but_never_streams_is_named_within_the_timeout(clean_proxy_env, monkeypatch,
                                                                                       capsys):
    """The probe waited the gateway's own read timeout (60 s) whatever --timeout said, and named no hang."""
    from switchyard_harness.faults import Fault

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    with start_sim(faults={"*": Fault(slow_ms=30_000)}) as server:
        code = doctor.main(["--config-dir", CONFIG, "--timeout", "0.5", "--base-url", server.base_url])
        out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  stream probe" in out and "sent no answer within 0.5 s" in out, out
    assert "hung or overloaded" in out and "raise --timeout" in out


class QuietHandler(BaseHTTPRequestHandler):
    """An http.server handler that logs nothing, with :meth:`reply` for a whole answer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 (http.server in a thread); yields its base URL (``.../v1``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    # a 10 ms poll: shutdown() waits for the next one (0.5 s by default)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def stalling_server():
    """A model server (http.server in a thread) that lists the shipped models and streams one token of every
    answer, then nothing more until it is stopped; yields its base URL."""
    stop = threading.Event()

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.reply(200, "application/json", json.dumps({"object": "list", "data": [
                {"id": m, "object": "model"} for m in ("claude-sonnet-4-5", "gpt-4o-mini")]}).encode())

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "claude-sonnet-4-5",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            stop.wait(60)
            self.close_connection = True

    with serving(Handler) as url:
        try:
            yield url
        finally:
            stop.set()


def test_a_server_that_stalls_mid_answer_is_named_as_stalled_not_as_silent(clean_proxy_env, monkeypatch, capsys):
    """The probe read 'the server took the request but sent no answer within 0.5 s' beside '(after 1 streamed
    item(s)': the server had answered, and went silent before the answer's end."""
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    with stalling_server() as url:
        code = doctor.main(["--config-dir", CONFIG, "--timeout", "0.5", "--base-url", url])
        out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  stream probe" in out and "sent no answer" not in out, out
    assert "began its answer and then sent nothing for 0.5 s before the answer's end" in out, out
    assert "stalled mid-answer" in out and "response buffering" in out


def test_a_server_that_lists_no_models_but_streams_is_served_with_a_warning(clean_proxy_env, monkeypatch, capsys):
    """A model server without GET /v1/models (TGI before 2.3, a gateway that lists none) serves the engine's calls;
    doctor failed its base url ('answers 404 ... must be the root ending in /v1') and skipped the probe that would
    have shown it streams. The probe decides: it streams, so the base url is a warning (no ids or window to
    check); a wrong root fails the probe too (test_wrong_path_fails_naming_v1)."""

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.reply(404, "application/json", b'{"detail":"Not Found"}')

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.reply(200, "text/event-stream",
                       b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"length"}]}\n\n'
                       b"data: [DONE]\n\n")

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with serving(Handler) as url:
        code, out = run_doctor(capsys, "--base-url", url)
    assert code == 0, out
    assert "the server lists no models, but it streams chat completions" in out, out
    assert "stream probe" in out and "FAIL" not in out, out


def test_a_proxy_refusing_the_key_under_400_is_named_a_key_refusal_with_its_fix(clean_proxy_env, monkeypatch, capsys):
    """LiteLLM's proxy run without a database answers every key but its master key 400 'No connected db.'
    (tests/data/upstream_streams/litellm_key_without_db.sse), on GET /models too: doctor said only "answers 400 ...
    check the model server's logs". It is the key's refusal, with the fix: the master key, or the proxy's database."""
    recorded = (Path(__file__).parent / "data" / "upstream_streams" / "litellm_key_without_db.sse").read_bytes()
    body = recorded.split(b"---\n", 1)[1]

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.reply(400, "application/json", body)

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with serving(Handler) as base_url:
        code, out = run_doctor(capsys, "--base-url", base_url)
    assert code == 1 and "refuses the key: 400 'No connected db.'" in out, out
    assert f"fix: set {KEY_ENV} to its master key" in out and TEST_KEY not in out


async def test_a_base_url_at_switchyards_own_http_face_is_named_so_not_told_to_end_in_v1(clean_proxy_env, monkeypatch,
                                                                                      capsys):
    """TGI and llama.cpp's server listen on 8080 by default, as Switchyard's HTTP face does: a base URL of
    http://127.0.0.1:8080/v1 where the face answered read 'answers 404; fix: ... must be the OpenAI-compatible root
    ending in /v1', of a URL ending in /v1, in doctor's check and in the probe's (the engine's) error alike."""
    import asyncio

    from test_http_face import http_stack

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    async with http_stack() as (client, _, _down):
        base = f"{str(client.base_url).rstrip('/')}/v1"
        code, out = await asyncio.to_thread(run_doctor, capsys, "--base-url", base, "--probe")
    assert code == 1, out
    assert "ending in /v1" not in out, out
    base_line, probe_line = (next(line for line in out.splitlines() if line.startswith(f"FAIL  {check}"))
                             for check in ("base url", "stream probe"))
    assert f"{base}/models answers 404: \"path: no route '/v1/models' (see /openapi.json)\"" in base_line, out
    face = "is Switchyard's own HTTP face (an orchestrator's orchestrator.http.port), not a model server"
    assert face in out.split(base_line, 1)[1].splitlines()[1], out  # the base url's fix
    assert face in probe_line, out


def test_a_root_ending_in_v1_whose_server_serves_no_openai_api_is_not_told_to_end_in_v1(clean_proxy_env, monkeypatch,
                                                                                        capsys):
    """A server that answers 404 to everything under a root ending in /v1 already (not an OpenAI-compatible
    server, or its API under another root): the fix said to end the root in /v1."""

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.reply(404, "text/plain", b"404 page not found")

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.reply(404, "text/plain", b"404 page not found")

    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with serving(Handler) as base_url:
        code, out = run_doctor(capsys, "--base-url", base_url, "--probe")
    assert code == 1 and "ending in /v1" not in out, out
    assert "ends in /v1 already, but the server there serves no OpenAI-compatible API under it" in out, out
