"""sim-openai answers a chat completions body of the wrong shape as the OpenAI API does: 400 naming the field,
never a 500, and never serving a max_tokens a real server refuses as if it were no limit."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from switchyard_harness import sim_openai
from switchyard_harness.sim_openai import SimOpenAIOptions, run_in_thread

HELLO = [{"role": "user", "content": "hello"}]


def post(base_url: str, body: object, **headers: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def sim():
    with run_in_thread(SimOpenAIOptions(latency=False)) as server:
        yield server


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": [5]}, "messages[0]", "expected an object, but got an integer"),  # was a 500
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "expected a string, but got null"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0]", "part"),
    ({"messages": HELLO, "tools": "x"}, "tools", "expected an array, but got a string"),  # was a 500
    ({"messages": HELLO, "tools": [5]}, "tools[0]", "expected a function tool"),  # was a 500
    ({"messages": HELLO, "stream": True, "stream_options": 5}, "stream_options", "expected an object"),  # cut stream
    ({"messages": HELLO, "max_tokens": -1}, "max_tokens", "Expected a value >= 1, but got -1"),  # was no limit
    ({"messages": HELLO, "max_tokens": "3"}, "max_tokens", "expected an integer, but got a string"),  # no limit
    ({"messages": HELLO, "max_completion_tokens": True}, "max_completion_tokens", "expected an integer"),
    ({"messages": HELLO, "stream": "yes"}, "stream", "expected a boolean, but got a string"),
])
def test_a_body_of_the_wrong_shape_is_400_naming_the_field(sim, body, param, says):
    status, reply = post(sim.base_url, {"model": "sim-7b", **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and says in reply["error"]["message"], reply


def test_a_body_that_is_no_object_is_400_and_a_good_one_is_served(sim):
    status, reply = post(sim.base_url, [HELLO])
    assert status == 400 and "expected an object, but got an array" in reply["error"]["message"], reply
    status, reply = post(sim.base_url, {"model": "sim-7b", "messages": HELLO, "max_tokens": 2, "priority": 0})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply


def test_a_fault_status_no_http_server_sends_is_400_naming_it(sim):
    """x-sim-fault: status=999 closed the connection unanswered (KeyError in the HTTP server's status lines)."""
    status, reply = post(sim.base_url, {"model": "sim-7b", "messages": HELLO}, **{"x-sim-fault": "status=999"})
    assert status == 400 and reply["error"]["param"] == "x-sim-fault", reply
    assert "expected status=<an HTTP error status, 400 to 599>, got '999'" in reply["error"]["message"], reply


@pytest.mark.parametrize("model", ["", "gpt#4"])
def test_a_model_id_no_request_can_name_is_refused_at_start(model, capsys):
    """--model '' served a model no request names; --model gpt#4 one whose name reads as gpt with fault '4'."""
    with pytest.raises(SystemExit) as caught:
        sim_openai.main(["--host", "256.0.0.1", "--model", model])  # an address it cannot bind: no server starts
    assert caught.value.code == 2
    assert "--model: expected a model id, not blank and without '#'" in capsys.readouterr().err


def test_the_fault_option_s_help_names_every_fault_key():
    """The --fault help listed its keys by hand and left out retry_after, retry_after_ms, retry_after_date and
    stream_type: a user reading --help could not find how to send a Retry-After."""
    from dataclasses import fields

    from switchyard_harness.faults import Fault

    text = " ".join(sim_openai._parser().format_help().split())
    keys = text.split("(keys: ", 1)[1].split(")", 1)[0].split()
    assert keys == [f.name for f in fields(Fault)]
