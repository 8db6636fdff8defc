"""``switchyard bench upstream``: the figures computed from phases of calls (synthetic calls, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard_harness.bench.upstream import Call, Phase, figures, summary

pytestmark = pytest.mark.no_gpu


def phase(name: str, mode: str, streams: int, calls_per_s: float, ttft_s: float = 0.02, cls: str = "BATCH",
          samples: list[tuple[float, float, float, float]] | None = None, seconds: float = 10.0) -> Phase:
    p = Phase(name, mode, streams, 0.0, seconds, samples=samples or [])
    n = round(calls_per_s * seconds)
    p.calls = [Call(cls, 0.0, end=seconds * (i + 1) / (n + 1), ttft_s=ttft_s, tokens=16) for i in range(n)]
    return p


def test_knee_plateau_and_ratios_come_from_the_phases() -> None:
    sweep = [phase("sweep", "direct", n, v, ttft_s=0.01 * n) for n, v in
             [(1, 10), (2, 20), (4, 40), (8, 55), (16, 60), (32, 62)]]
    steady = [(float(t), 10.0, 8.0, 9.0) for t in range(8)]
    turns = [phase("turns", "direct", 8, 50), phase("turns", "through", 8, 46),
             phase("turns", "direct", 32, 60), phase("turns", "through", 32, 57, samples=steady)]
    core = [phase("core unloaded", "direct", 1, 30, ttft_s=0.010, cls="CORE"),
            phase("core unloaded", "through", 1, 25, ttft_s=0.020, cls="CORE")]
    loaded_through = phase("core + 32 batch", "through", 32, 55, samples=steady)
    loaded_through.calls += phase("x", "through", 1, 5, ttft_s=0.030, cls="CORE").calls
    loaded_direct = phase("core + 32 batch", "direct", 32, 61)
    loaded_direct.calls += phase("x", "direct", 1, 2, ttft_s=0.100, cls="CORE").calls
    f = figures([*sweep, *turns, *core, loaded_through, loaded_direct])
    assert f["direct_plateau_calls_per_s"] == pytest.approx(63)  # the direct phase beside CORE: 61 + 2
    assert f["direct_knee_streams"] == 16  # 0.9 x the sweep's 62 = 55.8: 8 streams (55) fall short
    assert f["through_over_direct_8"] == pytest.approx(46 / 50)
    assert f["through_over_direct_32"] == pytest.approx(57 / 60)
    assert f["core_ttft_p95_loaded_over_unloaded"] == pytest.approx(1.5)
    assert f["direct_core_ttft_p95_loaded_over_unloaded"] == pytest.approx(10)
    assert f["batch_through_over_direct_plateau"] == pytest.approx(55 / 63)
    assert f["limit_steady_32"] == 10.0 and f["dispatcher_knee_estimate"] == 8.0
    assert f["errors"] == 0
    text = summary({"base_url": "http://127.0.0.1:1/v1", "model": "m", "phases": [*sweep, *turns], "figures": f})
    assert "through / direct calls/s: 8 streams 0.92, 32 streams 0.95" in text


def test_a_failed_call_is_counted_and_not_in_the_throughput() -> None:
    p = phase("turns", "direct", 8, 5)
    p.calls.append(Call("BATCH", 0.0, end=1.0, error="HTTP 500: boom"))
    assert p.errors == 1 and p.calls_per_s() == pytest.approx(5.0)  # 50 good calls in 10 s, the failure not among them


def test_stack_cpu_per_call_is_the_through_turns_cpu_over_their_calls() -> None:
    first, second = phase("turns", "through", 8, 40), phase("turns", "through", 32, 60)  # 400 and 600 calls
    first.cpu_s = {"dispatcher": 1.0, "orchestrator": 0.5}
    second.cpu_s = {"dispatcher": 2.0, "orchestrator": 1.5}
    f = figures([phase("turns", "direct", 8, 50), first, second])
    assert f["stack_cpu_ms_per_call"] == pytest.approx({"dispatcher": 3.0, "orchestrator": 2.0})
    text = summary({"base_url": "http://127.0.0.1:1/v1", "model": "m", "phases": [first, second], "figures": f})
    assert "stack CPU per call, through turns: dispatcher 3.00 ms, orchestrator 2.00 ms" in text
    assert figures([phase("turns", "direct", 8, 50)])["stack_cpu_ms_per_call"] == {}


def test_set_takes_the_keys_docs_configuration_md_names() -> None:
    """model_gateway.* as docs/configuration.md names the section (before: 'is in no section'), flush.*,
    TOML tables and scheduler_config.json's bare keys; the attribute paths still work."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard_harness.bench.settings import parse_settings

    overrides = parse_settings(["model_gateway.concurrency.initial_limit=2", "flush.max_batch_size=16",
                                "hbm.capacity_ratio=0.5", "time_slice_ms=10", "queues.inference.capacity=64",
                                "upstream.concurrency.core_reserved_slots=3", 'model_gateway.http_transport="httpx"'])
    assert overrides == {"upstream.concurrency.initial_limit": 2, "batching.max_batch_size": 16,
                         "memory.hbm.capacity_ratio": 0.5, "scheduler.time_slice_ms": 10,
                         "queues.inference.capacity": 64, "upstream.concurrency.core_reserved_slots": 3,
                         "upstream.http_transport": "httpx"}
    config = SwitchyardConfig().with_overrides(**overrides)
    assert config.upstream.concurrency.initial_limit == 2 and config.batching.max_batch_size == 16
    assert config.memory.hbm.capacity_ratio == 0.5 and config.scheduler.time_slice_ms == 10


@pytest.mark.parametrize(("item", "says"), [
    ("model_gateway.concurency.initial_limit=2", "model_gateway has no key 'concurency'; did you mean 'concurrency'?"),
    ("modelgateway.base_url=x", "no config key of that name"),
    ("model_gateway.base_url.x=1", "model_gateway.base_url is a value, not a table"),
    ("model_gateway.concurrency.initial_limit=0", "initial_limit"),
    # the key as the caller wrote it (the documented name), not the section's attribute path (upstream.*)
    ("model_gateway.concurrency.initial_limit=abc", "key 'model_gateway.concurrency.initial_limit' has value 'abc'"),
    ("nothing", "expected KEY=VALUE"),
])
def test_a_bad_set_is_a_usage_error_naming_it(item: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from switchyard_harness.bench import upstream

    assert upstream.main(["--set", item, "--config-dir", "config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("switchyard bench upstream: ") and says in err, err


@pytest.mark.parametrize("item", ["model_gateway.base_url=http://127.0.0.1:1/v1", "model_gateway.default_model=x",
                                  "dispatcher.engine=sim"])
def test_a_set_of_what_the_run_sets_itself_is_refused(item: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--set model_gateway.base_url beside --base-url pointed the stack at port 1 while the report named the
    server measured directly: every through phase failed, and the ratios compared two servers."""
    from switchyard_harness.bench import upstream

    with pytest.raises(SystemExit) as caught:
        upstream.main(["--set", item, "--config-dir", "config"])
    assert caught.value.code == 2 and f"--set: {item.partition('=')[0]} is the run's own" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--phase-s", "nan"], "--phase-s: expected a finite number of seconds > 0, got nan"),
    (["--phase-s", "inf"], "--phase-s: expected a finite number of seconds > 0, got inf"),
    (["--settle-s", "nan"], "--settle-s: expected a finite number of seconds >= 0, got nan"),
    (["--max-tokens", "0"], "--max-tokens: expected at least 1, got 0"),
    (["--kv-blocks", "0"], "--kv-blocks: expected at least 1, got 0"),  # a server with no KV: every call failed
])
def test_a_time_out_of_range_is_refused_naming_its_flag_and_value(argv, words, capsys) -> None:
    """nan passed the old `<= 0` checks (and inf, a phase that never ended); the refusal named every flag at once."""
    from switchyard_harness.bench import upstream

    with pytest.raises(SystemExit) as caught:
        upstream.main([*argv, "--config-dir", "config"])
    assert caught.value.code == 2 and words in capsys.readouterr().err


def test_a_base_url_that_is_not_an_http_url_is_refused_naming_it(capsys) -> None:
    """--base-url nohost: an httpx UnsupportedProtocol traceback, exit 1."""
    from switchyard_harness.bench import upstream

    with pytest.raises(SystemExit) as caught:
        upstream.main(["--base-url", "nohost", "--config-dir", "config"])
    assert caught.value.code == 2
    assert "argument --base-url: expected an http:// or https:// URL" in capsys.readouterr().err


def test_a_base_url_whose_models_cannot_be_listed_is_named_with_what_to_do(capsys) -> None:
    """Nothing listening, or a server without GET /models: an httpx traceback (ConnectError, or a KeyError on
    the 404's JSON) before anything was measured."""
    import socket

    from switchyard_harness.bench import upstream

    with socket.socket() as unused:  # bound, never listening: connections to it are refused
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}/v1"
        assert upstream.main(["--base-url", url + "/", "--phase-s", "1", "--config-dir", "config"]) == 1
    err = capsys.readouterr().err
    assert f"--base-url {url}: its models could not be listed (GET /models ConnectError" in err, err
    assert "name the model with --model" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_stack_gets_its_own_redis_and_takes_documented_set_keys(tmp_path) -> None:
    """A short run against sim-openai with --set model_gateway.concurrency.initial_limit=2 (before: refused,
    'is in no section'): the stack's DRAM tier is a private redis-server (before: the default 127.0.0.1:6379,
    which this run does not start: 'DRAM tier unavailable', or worse another stack's Redis)."""
    import json
    import os
    import subprocess
    import sys

    from gateway_fixtures import start_sim

    env = {k: v for k, v in os.environ.items() if k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    with start_sim() as sim:
        run = subprocess.run(
            [sys.executable, "-m", "switchyard.cli", "bench", "upstream", "--base-url", sim.base_url, "--model",
             "sim-7b", "--phase-s", "0.2", "--rounds", "1", "--settle-s", "0.1", "--max-tokens", "4",
             "--config-dir", str(Path(__file__).resolve().parents[2] / "config"),
             "--set", "model_gateway.concurrency.initial_limit=2",
             # the orchestrator's CPU work on its event loop, as orchestrator_config's: its spawn pool is not
             # what this run checks, and cost seconds of its start
             "--set", "orchestrator.cpu_executor=loop", "--json"],
            capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode in (0, 1), run.stderr  # 1: some call failed, which a loaded 2-core machine may see
    figures = json.loads(run.stdout)
    assert figures["dram"].startswith("embedded redis-server at 127.0.0.1:")
    assert not figures["dram"].endswith(":6379")
    assert "DRAM tier unavailable" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert figures["direct_calls_per_s"] and figures["through_over_direct_8"] is not None


def test_the_stack_config_points_at_the_runs_own_redis_and_task_store(tmp_path) -> None:
    import argparse

    from switchyard.common.config import DramTierConfig, SwitchyardConfig
    from switchyard_harness.bench.upstream import stack_config

    args = argparse.Namespace(api_key_env="", overrides={"upstream.concurrency.initial_limit": 2})
    own = DramTierConfig(embedded=False, host="127.0.0.1", port=41234)
    config = stack_config(SwitchyardConfig(), args, "http://127.0.0.1:1/v1", "m", own, str(tmp_path))
    dram = config.memory.dram
    assert (dram.host, dram.port, dram.embedded) == ("127.0.0.1", 41234, False)
    assert config.orchestrator.task_store.sqlite_path == str(tmp_path / "tasks.sqlite3")
    assert config.upstream.concurrency.initial_limit == 2 and config.dispatcher.engine == "openai"
    off = stack_config(SwitchyardConfig(), args, "http://127.0.0.1:1/v1", "m", None, str(tmp_path))
    assert not off.memory.agent_memory.enabled and not off.memory.dram.kv_swap  # nothing asks a Redis


_FAKE_SERVE = """
import pathlib, sys
from switchyard_harness.testing import transformers_serve as ts

root, mark = sys.argv[1], pathlib.Path(sys.argv[2])
ts.build_tiny_llama = lambda out_dir, **kw: pathlib.Path(out_dir)
# a stand-in for transformers serve: an HTTP server whose /health answers 200
ts.TransformersServer.command = lambda self: [sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                                              "--directory", root, str(self.port)]
ts.TransformersServer._warm_up = lambda self: mark.write_text(str(self.proc.pid))
from switchyard_harness.bench import upstream
sys.exit(upstream.main(["--config-dir", "config", "--dram", "off", "--phase-s", "60", "--rounds", "1"]))
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_the_model_server_the_run_started_ends_with_the_run(tmp_path: Path, how: str) -> None:
    """`switchyard bench upstream` starts `transformers serve` in a session of its own; killed (SIGTERM), the
    run ended at once and left the server running. SIGTERM and Ctrl-C now stop the run, which stops the
    server (exit status 143 and 130), and a run killed outright (SIGKILL) takes it along (the parent-death
    signal, asked for from the thread that launched it: the main one)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from switchyard.common.children import pid_alive

    (tmp_path / "health").write_text("ok")
    mark = tmp_path / "server.pid"
    repo = Path(__file__).resolve().parents[2]
    bench = subprocess.Popen([sys.executable, "-c", _FAKE_SERVE, str(tmp_path), str(mark)], cwd=repo,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not mark.exists() or not mark.read_text():  # the server serves: the run goes on to its stack
            assert bench.poll() is None, bench.communicate()
            time.sleep(0.05)
        server = int(mark.read_text())
        assert pid_alive(server)
        bench.send_signal(getattr(signal, how))
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    try:
        if how != "SIGKILL":
            assert not pid_alive(server), "the run ended and left its model server running"
            assert bench.returncode == {"SIGTERM": 143, "SIGINT": 130}[how], err
            assert "Traceback" not in err, err
        for _ in range(200):  # SIGKILL: the kernel sends the server its parent-death signal
            if not pid_alive(server):
                break
            time.sleep(0.05)
        assert not pid_alive(server), "the run was killed and left its model server running"
    finally:
        if pid_alive(server):
            os.kill(server, signal.SIGKILL)


async def test_the_direct_client_counts_the_answers_choice_wherever_it_sits() -> None:
    """The direct client read ``choices[0]``: a server that sends another choice first (ordered as it likes) had
    that choice's text counted as the answer's tokens and its first piece as the first token, where the gateway
    reads the choice of index 0 (decode.answer_choice, the one owner). Here the other choice's two pieces were
    counted: 3 tokens, the first before the answer's."""
    from switchyard_harness.bench.upstream import DirectClient
    from test_upstream_streams import Recorded, replay_server

    chunks = [
        [{"index": 1, "delta": {"role": "assistant", "content": "Other"}},
         {"index": 0, "delta": {"role": "assistant"}}],
        [{"index": 0, "delta": {"content": "Hello"}}],
        [{"index": 1, "delta": {"content": " words"}}, {"index": 0, "delta": {}, "finish_reason": "stop"}],
    ]
    body = b"".join(b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                                             "choices": c}).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    recorded = Recorded("inline", {"status": "HTTP/1.1 200 OK", "content-type": "text/event-stream",
                                   "framing": "chunked"}, body)
    async with replay_server(recorded) as (base, _):
        async with DirectClient(base, "m", 8) as client:
            call = await client.call("BATCH")
    assert (call.error, call.tokens) == ("", 1)
    assert call.ttft_s is not None
