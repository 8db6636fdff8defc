"""The model server's prompt tokens per token of Switchyard's count: learnt per model by the dispatcher's
``openai`` engine (:class:`PromptTokenRatios`), applied to every window check through :class:`ContextWindow`."""

from __future__ import annotations

import math

import grpc
import pytest
from gateway_fixtures import clean_proxy_env  # noqa: F401

from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.common.config.limits import ContextWindow
from switchyard.common.errors import InvalidArgument
from switchyard.dispatcher.engines.token_ratio import MIN_PROMPT_TOKENS, PromptTokenRatios
from switchyard.dispatcher.processor import to_request


def test_a_model_never_measured_takes_its_count_as_it_is():
    ratios = PromptTokenRatios()
    assert ratios.ratio("m") == 1.0
    assert ratios.ratios() == {}


def test_one_call_teaches_its_ratio_and_each_model_keeps_its_own():
    ratios = PromptTokenRatios()
    assert ratios.observe("llama", 5003, 10042) == pytest.approx(10042 / 5003)
    assert ratios.observe("gpt", 1000, 1000) == 1.0
    assert ratios.ratio("llama") == pytest.approx(2.007, abs=1e-3)
    assert ratios.ratio("gpt") == 1.0
    assert ratios.ratio("other") == 1.0


def test_the_estimate_is_a_high_quantile_of_recent_calls_not_one_odd_call():
    ratios = PromptTokenRatios(window_calls=20, quantile=0.9)
    for _ in range(18):
        ratios.observe("m", 1000, 1200)
    ratios.observe("m", 1000, 2000)  # two odd calls of 20: above the 90th percentile's rank
    ratios.observe("m", 1000, 3000)
    assert ratios.ratio("m") == pytest.approx(1.2)
    ratios.observe("m", 1000, 2500)  # a third: the 18th of 20 ranked now
    assert ratios.ratio("m") == pytest.approx(2.0)


def test_a_server_that_counts_fewer_is_measured_below_one():
    ratios = PromptTokenRatios()
    ratios.observe("m", 1000, 800)
    assert ratios.ratio("m") == pytest.approx(0.8)


def test_memory_is_bounded_and_follows_a_model_replaced_behind_its_name():
    ratios = PromptTokenRatios(window_calls=8)
    for _ in range(100):
        ratios.observe("m", 1000, 3000)
    for _ in range(8):  # a window of calls later, the old model's ratios are gone
        ratios.observe("m", 1000, 1100)
    assert ratios.ratio("m") == pytest.approx(1.1)


def test_calls_that_teach_nothing_are_not_learnt_from():
    ratios = PromptTokenRatios(max_models=2)
    assert ratios.observe("m", MIN_PROMPT_TOKENS - 1, 300) is None  # the chat template's overhead swamps it
    assert ratios.observe("m", 0, 300) is None
    assert ratios.observe("m", 1000, 0) is None  # no usage reported
    assert ratios.observe("", 1000, 3000) is None
    assert ratios.ratios() == {}
    ratios.observe("a", 1000, 2000)
    ratios.observe("b", 1000, 2000)
    assert ratios.observe("c", 1000, 2000) is None  # past max_models: a bounded label set
    assert set(ratios.ratios()) == {"a", "b"}
    assert ratios.observe("a", 1000, 1500) is not None  # a model kept goes on learning


@pytest.mark.parametrize("bad", [{"window_calls": 0}, {"quantile": 0.0}, {"quantile": 1.5}, {"max_models": 0}])
def test_a_bad_setting_is_refused_naming_what_was_expected(bad):
    with pytest.raises(ValueError, match="expected window_calls >= 1"):
        PromptTokenRatios(**bad)


def test_the_window_measures_a_prompt_in_the_servers_tokens():
    window = ContextWindow(4096, "limits.context_window_tokens", 2.0)
    assert window.model_tokens(1000) == 2000
    assert window.room(96) == 2000  # (4096 - 96) / 2 of Switchyard's tokens beside 96 completion tokens
    assert window.left(2000) == 96
    assert window.model_tokens(window.room(96)) + 96 <= 4096 < window.model_tokens(window.room(96) + 1) + 96
    assert window.counted(1000) == "1000 tokens (about 2000 of the model server's)"
    assert "2.00 tokens per token of Switchyard's count" in window.described()
    plain = ContextWindow(4096, "limits.context_window_tokens")
    assert (plain.model_tokens(1000), plain.room(96), plain.left(1000)) == (1000, 4000, 3096)
    assert plain.counted(1000) == "1000 tokens" and plain.described() == "4096 tokens (limits.context_window_tokens)"


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_a_ratio_not_positive_and_finite_is_taken_as_one(ratio):
    assert SwitchyardConfig().limits.context_window("m", 0, ratio).ratio == 1.0


def test_the_dispatcher_refuses_a_prompt_its_server_would_count_past_the_window():
    config = SwitchyardConfig().with_overrides(**{"limits.context_window_tokens": {"m": 4096}})
    request = agent_pb2.GenerateRequest(request_id="r", prompt="word " * 3000, prompt_tokens=3000, max_tokens=64,
                                        model="m")
    assert to_request(request, config, "m").prompt_tokens_sent  # fits as counted: 3000 + 64 <= 4096
    with pytest.raises(InvalidArgument) as refused:
        to_request(request, config, "m", prompt_token_ratio=2.0)
    assert refused.value.field == "prompt_tokens"
    assert "its server counts this prompt about 6000 tokens (got 3000)" in str(refused.value)
    request.prompt_tokens, request.max_tokens = 2000, 128  # 4000 of the server's and 128: max_tokens does not fit
    with pytest.raises(InvalidArgument) as refused:
        to_request(request, config, "m", prompt_token_ratio=2.0)
    assert refused.value.field == "max_tokens" and "so at most 96" in str(refused.value)


async def test_the_dispatcher_learns_from_the_servers_usage_beside_the_callers_count_and_reports_it(clean_proxy_env):
    """A real dispatcher in front of the sim OpenAI server (2,048-token window): a Generate whose prompt the
    dispatcher counted itself teaches nothing (its word pieces are not the orchestrator's count); one that sent
    its count teaches the server's usage.prompt_tokens per counted token, which DescribeModel, the done chunk and
    the gauge report, and which the dispatcher's admission then applies: a prompt whose count fits but whose
    server count would not is refused naming prompt_tokens, and the server never sees it."""
    from prometheus_client import REGISTRY
    from test_context_window import MODEL, dispatcher_before

    prompt = "word " * 600
    async with dispatcher_before(2048) as (_, _, stub, sim):
        chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(request_id="own", prompt=prompt,
                                                                          max_tokens=2))]
        assert chunks[-1].done.prompt_token_ratio == 0  # counted here: nothing measured
        assert not (await stub.DescribeModel(agent_pb2.DescribeModelRequest())).prompt_token_ratios
        counted = 300  # as if a tokenizer packed two words a token: the server counts more
        chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(request_id="sent", prompt=prompt,
                                                                          prompt_tokens=counted, max_tokens=2))]
        ratio = chunks[-1].done.usage.prompt_tokens / counted
        assert ratio > 1 and chunks[-1].done.prompt_token_ratio == pytest.approx(ratio)
        described = await stub.DescribeModel(agent_pb2.DescribeModelRequest())
        assert dict(described.prompt_token_ratios) == pytest.approx({MODEL: ratio})
        assert REGISTRY.get_sample_value("switchyard_prompt_token_ratio", {"model": MODEL}) == pytest.approx(ratio)
        sent = len(sim.state.requests)
        assert 1900 * ratio > 2048  # 1,900 + 100 fit 2,048 as counted; the server's count of 1,900 does not
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="past", prompt=prompt,
                                                                    prompt_tokens=1900, max_tokens=100)):
                pass
        assert len(sim.state.requests) == sent
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("prompt_tokens: expected fewer than the context window"), \
        refused.value.details()


def test_a_call_the_fallback_model_answered_teaches_nothing_of_the_model_asked(clean_proxy_env):
    """``model_gateway.fallback_model`` served the call: its tokenizer is not the requested model's."""
    from switchyard.dispatcher.engines.openai import OpenAIEngine
    from switchyard.dispatcher.request import Request

    config = SwitchyardConfig().with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": "http://127.0.0.1:9/v1", "upstream.default_model": "big",
        "upstream.fallback_model": "small", "upstream.api_key_required": False})
    engine = OpenAIEngine(config)
    call = Request(request_id="r", prompt="p", prompt_tokens=1000, prompt_tokens_sent=True, model="big")
    engine._learn_prompt_tokens(call, 3000, "small")
    assert engine.prompt_token_ratios() == {} and call.prompt_token_ratio == 0.0
    engine._learn_prompt_tokens(call, 2000, "big")
    assert engine.prompt_token_ratio("big") == 2.0 and call.prompt_token_ratio == 2.0
    counted_here = Request(request_id="r", prompt="p", prompt_tokens=1000, model="big")  # the dispatcher's count
    engine._learn_prompt_tokens(counted_here, 5000, "big")
    assert engine.prompt_token_ratio("big") == 2.0 and counted_here.prompt_token_ratio == 2.0


async def test_a_first_call_past_the_servers_count_of_the_window_is_named_and_teaches_the_ratio(clean_proxy_env):
    """No ratio measured yet (the model's first call): a prompt that fits the 2,048-token window at the caller's
    count (300 tokens, beside max_tokens 1,700) but not at the server's (its 600 words) goes to the server, which
    refuses it 400 in vLLM's words. The refusal is INVALID_ARGUMENT naming the server's words, the caller's count
    that the dispatcher's check let by and why (no ratio measured), and the server's count; that count teaches the
    ratio, as a usage does, so the same call again is refused by the dispatcher, naming prompt_tokens and the
    server's count, and the server never sees it."""
    from test_context_window import MODEL, dispatcher_before

    prompt = "word " * 600
    call = agent_pb2.GenerateRequest(request_id="first", prompt=prompt, prompt_tokens=300, max_tokens=1700)
    async with dispatcher_before(2048) as (_, _, stub, sim):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(call):
                pass
        assert len(sim.state.requests) == 1  # the server refused it
        first = refused.value.details()
        described = await stub.DescribeModel(agent_pb2.DescribeModelRequest())
        sent = len(sim.state.requests)
        call.request_id = "again"
        with pytest.raises(grpc.aio.AioRpcError) as again:
            async for _ in stub.Generate(call):
                pass
        assert len(sim.state.requests) == sent  # refused here, not sent
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "This model's maximum context length is 2048 tokens" in first, first  # the server's words
    assert "does not fit model 'acme/served-8b''s context window" in first
    assert ("the dispatcher's window check let it by at prompt_tokens 300 (the caller's count) beside max_tokens 1700 "
            "(no ratio of the server's tokens to the count was measured for 'acme/served-8b' yet)") in first
    assert "the server counted the prompt 601 tokens, 2.00 per counted token, now measured" in first, first
    assert dict(described.prompt_token_ratios) == pytest.approx({MODEL: 601 / 300})
    assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert again.value.details().startswith("max_tokens: expected prompt_tokens + max_tokens within the context "
                                            "window of acme/served-8b"), again.value.details()
    assert "the prompt is 300 tokens (about 601 of the model server's)" in again.value.details()
