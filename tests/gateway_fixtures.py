"""Fixtures for tests that talk to an OpenAI-compatible upstream.

Import what you use into the test module::

    from gateway_fixtures import clean_proxy_env, sim_openai  # noqa: F401

``sim_openai`` is a ``switchyard serve sim-openai`` server on 127.0.0.1, port 0,
in a background thread (no latency model, no key check); its ``base_url`` goes
into ``model_gateway.base_url``, its ``state`` shows the request bodies it got.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from switchyard.common.config import UpstreamConfig
from switchyard_harness.faults import Fault
from switchyard_harness.sim_openai import RunningSimOpenAI, SimOpenAIOptions, run_in_thread

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
TEST_KEY = "sk-test-0123456789abcdefSECRET"


@pytest.fixture
def clean_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy variable in either case, so calls to 127.0.0.1 go direct."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def start_sim(faults: dict[str, Fault] | None = None, api_key: str | None = None, **options: Any):
    """Context manager: a sim-openai server with these faults/key (see SimOpenAIOptions)."""
    options.setdefault("latency", False)
    return run_in_thread(SimOpenAIOptions(faults=faults or {}, api_key=api_key, **options))


@pytest.fixture
def sim_openai(clean_proxy_env: None) -> Iterator[RunningSimOpenAI]:
    """A sim-openai server on a free port; yields it (``.base_url``, ``.state``)."""
    with start_sim() as server:
        yield server


def gateway_config(base_url: str, **overrides: Any) -> UpstreamConfig:
    """``model_gateway`` for tests: no key required, fast retries, then ``overrides``."""
    values: dict[str, Any] = {
        "base_url": base_url,
        "api_key_env": "SWITCHYARD_TEST_API_KEY",
        "api_key_required": False,
        "retry_backoff_initial_s": 0.01,
        "retry_backoff_max_s": 0.02,
        "read_timeout_s": 10.0,
        "total_timeout_s": 30.0,
    }
    values.update(overrides)
    return UpstreamConfig(**values)
