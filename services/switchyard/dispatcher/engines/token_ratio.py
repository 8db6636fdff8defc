"""How many of a model server's prompt tokens one prompt token of Switchyard's count is, per served model.

Switchyard counts a prompt with tiktoken's cl100k_base (:mod:`switchyard.orchestrator.tokens`) to keep
prompt + max_tokens inside the model's context window; the model server counts with its own tokenizer,
which can count twice as many (a Llama BPE over repeated words) or fewer. The ``openai`` engine sees both
numbers on every call that the server reports usage for: the count the caller sent
(``GenerateRequest.prompt_tokens``) and the server's ``usage.prompt_tokens``. :class:`PromptTokenRatios`
learns their ratio per model; the dispatcher reports it (``ModelInfo.prompt_token_ratios``, and on each
``GenerateDone``), and the window checks scale a count by it
(:meth:`switchyard.common.config.limits.ContextWindow.model_tokens`).

The estimate is a high quantile (:data:`QUANTILE`) of the last :data:`WINDOW_CALLS` ratios of that model:
robust to one odd call, quick to follow a model replaced behind the same name, and on the side of refusing
a prompt near the window rather than sending one the server fails. With no call measured it is 1 (the
count taken as it is); it goes below 1 only where the server counted fewer tokens than Switchyard did.
Calls with a prompt under :data:`MIN_PROMPT_TOKENS` of Switchyard's tokens are not learnt from: the chat
template's fixed tokens (role headers, a default system prompt) swamp the ratio of a short prompt, and the
window is only at stake for long ones.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW_CALLS = 64
"""Ratios kept per model: the most recent calls, the estimate's memory."""

QUANTILE = 0.9
"""The quantile of the kept ratios taken as the estimate (nearest rank): one call in ten may count more."""

MIN_PROMPT_TOKENS = 256
"""Least prompt, in the caller's tokens, a call is learnt from: a chat template's fixed tokens (a Llama 3.1
system header is about 25) move the ratio of a 256-token prompt by some 10 %, of a 32-token one by 80 %, and
a high quantile of short calls' ratios would refuse long prompts at a fraction of the window. A prompt near
the window is long: the ratio of long calls is the one that matters."""

MAX_MODELS = 64
"""Most models a ratio is kept for (each a label value of ``switchyard_prompt_token_ratio``): a model is
learnt only from a call its server answered with usage, so these are models the upstream serves; past this
many, a new model is not learnt (its count taken as it is)."""


class PromptTokenRatios:
    """Per model, the model server's prompt tokens per prompt token of the caller's count (bounded memory:
    :data:`WINDOW_CALLS` ratios for each of at most :data:`MAX_MODELS` models)."""

    def __init__(self, window_calls: int = WINDOW_CALLS, quantile: float = QUANTILE,
                 min_prompt_tokens: int = MIN_PROMPT_TOKENS, max_models: int = MAX_MODELS) -> None:
        if window_calls < 1 or not 0 < quantile <= 1 or max_models < 1:
            raise ValueError(f"expected window_calls >= 1, 0 < quantile <= 1 and max_models >= 1, got "
                             f"{window_calls}, {quantile}, {max_models}")
        self._window, self._quantile = window_calls, quantile
        self._min_prompt, self._max_models = min_prompt_tokens, max_models
        self._ratios: dict[str, deque[float]] = {}
        self._estimates: dict[str, float] = {}

    def observe(self, model: str, counted: int, served: int) -> float | None:
        """Learn from one call of ``model`` whose prompt the caller counted ``counted`` tokens and the server
        ``served`` (its ``usage.prompt_tokens``). Returns the model's new estimate, or None where the call
        taught nothing: a count missing or 0 on either side, a prompt under :data:`MIN_PROMPT_TOKENS`, or a
        new model past :data:`MAX_MODELS`."""
        if counted < max(1, self._min_prompt) or served <= 0 or not model:
            return None
        ratios = self._ratios.get(model)
        if ratios is None:
            if len(self._ratios) >= self._max_models:
                return None
            ratios = self._ratios[model] = deque(maxlen=self._window)
        ratios.append(served / counted)
        ranked = sorted(ratios)
        estimate = ranked[max(0, math.ceil(self._quantile * len(ranked)) - 1)]
        self._estimates[model] = estimate
        return estimate

    def ratio(self, model: str, unmeasured: float = 1.0) -> float:
        """The estimate for ``model``: server tokens per counted token; ``unmeasured`` where none was measured."""
        return self._estimates.get(model, unmeasured)

    def ratios(self) -> dict[str, float]:
        """Every model measured, with its estimate (a copy)."""
        return dict(self._estimates)
