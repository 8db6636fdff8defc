"""The tools' and benchmarks' number and address flags: refused before a run, naming the flag (exit status 2).

Each case was, before ``switchyard_harness.arg_types``: a run that never ended (a zero concurrency or stream
count), a traceback (``--calls 0``, ``--windows 0``, ``--http nohost``), a run of nothing reported ``ok``
(``soak.py --minutes -1``), or a whole run of refused calls printed as its result (``--max-tokens -5``,
``--task-type foo``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard_harness import arg_types
from switchyard_harness.bench import http_bench

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}


@pytest.mark.parametrize(("tool", "argv", "says"), [
    ("soak.py", ["--minutes", "-1"], "argument --minutes: expected a finite number > 0, got '-1'"),  # 'ok': true
    ("soak.py", ["--concurrency", "0"], "argument --concurrency: expected a whole number >= 1, got '0'"),  # a hang
    ("upstream_soak.py", ["--calls", "0"], "argument --calls: expected a whole number >= 1, got '0'"),  # traceback
    ("upstream_soak.py", ["--max-tokens", "-1"], "argument --max-tokens: expected a whole number of tokens >= 0"),
    ("upstream_soak.py", ["--base-url", "nohost"], "argument --base-url: expected an http:// or https:// URL"),
    ("pool_server_queue.py", ["--streams", "0"], "argument --streams: expected a whole number >= 1, got '0'"),
    ("limit_noise.py", ["--windows", "0"], "argument --windows: expected a whole number >= 1, got '0'"),
    ("limit_noise.py", ["--spreads", "0", "-1"], "argument --spreads: expected a fraction in [0, 1), got '-1'"),
    ("operator_view_cost.py", ["--frames", "0"], "argument --frames: expected a whole number >= 1, got '0'"),
    ("request_path.py", ["--repeat", "0"], "argument --repeat: expected a whole number >= 1, got '0'"),
    ("completion_rate.py", ["--http", "nohost"], "argument --http: expected an http:// or https:// URL"),
    ("completion_rate.py", ["--http", "http://127.0.0.1:1", "--interval", "nan"],
     "argument --interval: expected a finite number > 0, got 'nan'"),
    ("completion_rate.py", ["--http", "http://127.0.0.1:1", "--task-type", "foo"],
     "argument --task-type: invalid choice: 'foo'"),
])
def test_a_tool_refuses_a_flag_it_cannot_run_naming_it(tool, argv, says):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *argv], capture_output=True, text=True,
                         timeout=120, env=ENV, cwd=ROOT)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]


def test_operator_view_cost_imports_top_from_the_harness():
    """``from switchyard import top`` failed (ImportError) once top moved to the harness: the tool never ran."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "operator_view_cost.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert run.returncode == 0 and "--frames" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize(("module", "argv", "says"), [
    ("switchyard_harness.testing.transformers_serve", ["--model-dir", "unused", "--port", "70000"],
     "argument --port: expected a TCP port, 0 (a free one) to 65535, got '70000'"),  # 'ready' at :70000
    ("switchyard_harness.testing.transformers_serve", ["--model-dir", "unused", "--kv-blocks", "0"],
     "argument --kv-blocks: expected a whole number >= 1, got '0'"),  # a server with no KV cache
    ("switchyard_harness.bench.retrieval_batcher", ["--queries", "0"],
     "argument --queries: expected a whole number >= 1, got '0'"),  # a StatisticsError traceback
])
def test_a_harness_main_refuses_a_flag_it_cannot_run_naming_it(module, argv, says, tmp_path):
    run = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                         env=ENV, cwd=tmp_path)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "unused").exists()  # refused before the model was built


@pytest.mark.parametrize(("argv", "says"), [
    (["--http", "nohost"], "argument --http: expected an http:// or https:// URL"),  # a yarl traceback
    (["--http", "http://127.0.0.1:99999"], "argument --http: expected an http:// or https:// URL"),
    (["--orchestrator-metrics", "127.0.0.1:9101/metrics"], "argument --orchestrator-metrics: expected an http"),
    (["--grpc", "nohost"], "argument --grpc: expected a gRPC target"),  # every call UNAVAILABLE
    (["--task-type", "foo"], "argument --task-type: invalid choice: 'foo'"),  # every submit 400
])
def test_bench_http_refuses_an_address_or_task_type_it_cannot_use(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        http_bench.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("parse", "text", "value"), [
    (arg_types.positive, "2.5", 2.5),
    (arg_types.non_negative, "0", 0.0),
    (arg_types.fraction, "0.2", 0.2),
    (arg_types.count, "3", 3),
    (arg_types.max_tokens, "0", 0),
    (arg_types.http_url, "http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    (arg_types.http_url, "https://gateway.example", "https://gateway.example"),
    (arg_types.model_server_url, "http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
    (arg_types.grpc_address, "127.0.0.1:50051", "127.0.0.1:50051"),
    (arg_types.port, "0", 0),
    (arg_types.port, "65535", 65535),
])
def test_each_type_takes_what_its_flag_means(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(("parse", "text"), [
    (arg_types.positive, "0"), (arg_types.positive, "nan"), (arg_types.positive, "inf"), (arg_types.positive, "x"),
    (arg_types.non_negative, "-0.5"), (arg_types.non_negative, "nan"),
    (arg_types.fraction, "1"), (arg_types.fraction, "-0.1"),
    (arg_types.count, "0"), (arg_types.count, "1.5"), (arg_types.max_tokens, "-1"),
    (arg_types.http_url, "localhost:8080"), (arg_types.http_url, "ftp://h:21"), (arg_types.http_url, "http://h:0"),
    (arg_types.grpc_address, "host"), (arg_types.port, "70000"), (arg_types.port, "-1"),
    (arg_types.model_server_url, "http://h:8000/v1/chat/completions"), (arg_types.model_server_url, "http://h/v1/models"),
    (arg_types.model_server_url, "http://u:key@h:8000/v1"), (arg_types.model_server_url, "h:8000"),
])
def test_each_type_refuses_what_its_flag_cannot_mean_quoting_it(parse, text):
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace("(", r"\(").replace(".", r"\.")
                       if parse is not arg_types.grpc_address else "no port"):
        parse(text)
