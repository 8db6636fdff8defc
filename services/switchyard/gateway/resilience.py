"""Retries and fallback, both only before the first streamed item.

- :func:`with_retries`: tenacity, exponential backoff with jitter
  (``wait = initial x 2^(attempt-1) + uniform(0, initial)``, capped at
  ``backoff_max_s``; the Google Cloud retry strategy tenacity implements),
  retrying only errors marked ``retryable``. When the upstream said how long
  to wait (``Retry-After`` delta-seconds or HTTP-date, ``retry-after-ms``, on a
  429 or 503), the wait is at least that and is never shortened: a wait longer
  than ``retry_after_max_s`` is not taken and the upstream's error is raised at
  once, naming the model and the wait (the fallback model is then asked when
  one is set). Any retry (after a requested wait or a backoff) must also leave,
  once it has waited, the time an attempt is expected to take to its first item
  before the call's deadline (the model's fastest recent TTFT, which the
  gateway's limit keeps per endpoint; 0 before one was measured): a retry that
  would be cut at once is not started, and the upstream's error is raised
  naming the wait, that time, the time left and who set the deadline (the
  gateway's ``total_timeout_s`` or its caller, and where the caller's came
  from: ``orchestrator.task_time_limit_s.<type>`` or its caller's gRPC
  deadline), rather than a bare DEADLINE_EXCEEDED a moment later.
  The model's cooldown (:mod:`switchyard.gateway.cooldown`) records the wait,
  so no other call reaches the model before it has passed either.
- :func:`with_fallback`: each model of the chain in turn (primary, then
  fallback) while the error is marked ``fallback_ok``; the primary's error is
  the one raised, with what the fallback did appended.

A call that already streamed an item marks its error ``after_tokens`` (neither
flag set) and so is never retried nor sent to the fallback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Sequence, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from switchyard.common.config import UpstreamConfig
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.metrics import GATEWAY_FALLBACKS, GATEWAY_RETRIES
from switchyard.gateway.models import model_label

log = logging.getLogger(__name__)
T = TypeVar("T")


async def sleep_out(seconds: float) -> None:
    """Wait until ``time.monotonic()`` has advanced ``seconds``: the clock a model's cooldown keeps a
    Retry-After by (:mod:`switchyard.gateway.cooldown`). ``asyncio.sleep`` on uvloop, which every service
    runs on, rounds the delay to whole milliseconds from the loop's cached millisecond time, so it may
    return up to a millisecond or two (more on a busy loop) before that clock has advanced as far: a retry
    that waited out the asked wait was then refused for the fraction left."""
    end = time.monotonic() + seconds
    await asyncio.sleep(seconds)
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(max(left, 0.001))


async def with_retries(
    model: str, once: Callable[[str], Awaitable[T]], config: UpstreamConfig, deadline: float | None = None,
    sleep: Callable[[float], Awaitable[None]] = sleep_out, *, deadline_set_by: str = "",
    attempt_s: Callable[[str], float] | None = None,
) -> T:
    """``await once(model)``, retried up to ``config.max_retries`` times on retryable GatewayErrors.

    ``deadline``: event-loop time after which no retry is started; ``deadline_set_by``: who set it, named by a
    refusal (``model_gateway.total_timeout_s = 60``, ``its caller, from orchestrator.task_time_limit_s.chat =
    600``; "" names no one); ``attempt_s``: seconds an attempt of a model is expected to take to its first item
    (the pool's :meth:`~switchyard.gateway.pool.EndpointPool.expected_ttft_s`; None: 0), which a retry must leave
    before the deadline after its wait; ``sleep``: how
    to wait between attempts (tests record the waits). The first attempt runs before any
    retry machinery is built: most calls succeed there, and building tenacity's retrying
    object and its attempt chain for each call cost the dispatcher 0.1-0.5 ms of CPU per call;
    tenacity takes over from the first attempt's failure.

    Raises:
        GatewayError: the last attempt's error, or the first non-retryable one,
            or the one whose Retry-After is longer than ``retry_after_max_s``, or
            whose wait would not leave ``attempt_s`` before the deadline (its status kept:
            RESOURCE_EXHAUSTED for a 429, UNAVAILABLE for a 503). Where the first attempt failed otherwise, its error is noted in the
            message: a server whose first failure broke it (``transformers serve``'s batching worker, killed by
            a request past its KV cache, then answers every call 503 "CB worker is dead") had its real cause
            hidden behind the retries' 503.
    """
    try:
        return await once(model)
    except GatewayError as exc:
        if not exc.retryable or config.max_retries == 0:
            raise
        first_failure: GatewayError | None = exc
        first_message = str(exc)
    backoff = wait_exponential_jitter(
        multiplier=config.retry_backoff_initial_s, max=config.retry_backoff_max_s,
        jitter=config.retry_backoff_initial_s,
    )

    def wait(state: RetryCallState) -> float:
        seconds = backoff(state)
        exc = state.outcome.exception() if state.outcome else None
        asked = exc.retry_after_s if isinstance(exc, GatewayError) else None
        if asked is not None and isinstance(exc, GatewayError):
            if asked > config.retry_after_max_s:
                raise exc.with_note(
                    f"not retried: model {model!r} asked to wait {asked:.1f} s, longer than "
                    f"model_gateway.retry_after_max_s ({config.retry_after_max_s:g} s); a requested wait is never "
                    "shortened"
                )
            seconds = max(seconds, asked)
        if deadline is not None and isinstance(exc, GatewayError):
            left = deadline - asyncio.get_running_loop().time()
            needed = attempt_s(model) if attempt_s is not None else 0.0
            if seconds + needed >= left:
                what = f"asked to wait {asked:.1f} s" if asked is not None and asked >= seconds else \
                    f"would wait {seconds:.2f} s before a retry"
                whose = f" (set by {deadline_set_by})" if deadline_set_by else ""
                if seconds >= left:
                    why = f"longer than the {max(left, 0.0):.1f} s left before the call's deadline{whose}"
                else:  # its wait ends before the deadline, too late for an attempt to reach a first token
                    why = (f"leaving {left - seconds:.2f} s of the {left:.2f} s left before the call's "
                           f"deadline{whose}, less than the {needed:.2f} s an attempt takes to its first token "
                           "(the model server's fastest recent time to first token)")
                raise exc.with_note(f"not retried: model {model!r} {what}, {why} (it would outlast the call's "
                                    "deadline)")
        return seconds

    def before_sleep(state: RetryCallState) -> None:
        GATEWAY_RETRIES.labels(model_label(model, config)).inc()
        exc = state.outcome.exception() if state.outcome else None
        log.info("retrying model %r (attempt %d failed: %s)", model, state.attempt_number, exc)

    retrying = AsyncRetrying(
        stop=stop_after_attempt(config.max_retries + 1),
        wait=wait,
        retry=retry_if_exception(lambda exc: isinstance(exc, GatewayError) and exc.retryable),
        before_sleep=before_sleep,
        reraise=True,
        sleep=sleep,
    )

    async def attempt() -> T:
        nonlocal first_failure
        if first_failure is not None:  # attempt 1, which already ran: its failure is what tenacity decides on
            failure, first_failure = first_failure, None
            raise failure
        return await once(model)

    try:
        return await retrying(attempt)
    except GatewayError as last:
        if not str(last).startswith(first_message):  # the first's own error (noted or not): nothing to add
            raise last.with_note(f"the first attempt failed otherwise: {first_message}") from None
        raise


async def with_fallback(
    chain: Sequence[str],
    once: Callable[[str], Awaitable[T]],
    config: UpstreamConfig,
    *,
    deadline: float,
    on_deadline: Callable[[str], GatewayError],
    deadline_set_by: str = "",
    attempt_s: Callable[[str], float] | None = None,
) -> tuple[T, str]:
    """Try each model of ``chain`` (with retries) until one succeeds; returns (result, model).

    ``deadline`` is an event-loop time bounding all attempts; when it passes,
    ``on_deadline(model)`` is the error, and no later model of the chain is tried (none is sent a request
    for a call whose deadline has passed). ``deadline_set_by`` and ``attempt_s``: as :func:`with_retries`'s.

    Raises:
        GatewayError: the primary's error (with the fallback's appended) when
            no model succeeded or the error does not allow a fallback.
    """
    primary_error: GatewayError | None = None
    for position, model in enumerate(chain):
        try:
            async with asyncio.timeout_at(deadline):
                result = await with_retries(model, once, config, deadline, deadline_set_by=deadline_set_by,
                                            attempt_s=attempt_s)
        except TimeoutError:
            error = on_deadline(model)
        except GatewayError as exc:
            error = exc
        else:
            if primary_error is not None:
                GATEWAY_FALLBACKS.labels(model_label(chain[0], config), model_label(model, config)).inc()
                log.warning("served by fallback model %r after: %s", model, primary_error)
            return result, model
        if primary_error is None:
            primary_error = error
        else:
            primary_error.with_note(f"fallback model {model!r} failed too: {error}")
        if not error.fallback_ok or position == len(chain) - 1:
            raise primary_error
        if asyncio.get_running_loop().time() >= deadline:
            # Nothing is left of the call for the next model: tried anyway, its request went out before the
            # timeout's cancel came (at the first suspension), reached the server for a call no one waited for
            # any more, and the call's error and its caller's message named that model, waited on for no time.
            raise primary_error.with_note(f"fallback model {chain[position + 1]!r} not tried: the call's deadline "
                                          "had passed")
        log.warning("model %r failed before its first token (%s); trying fallback model %r", model, error,
                    chain[position + 1])
    raise ValueError("chain: expected at least one model")
