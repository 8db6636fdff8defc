"""``switchyard.json`` ``limits``: what one request may ask for."""

from __future__ import annotations

import math
from typing import NamedTuple

from pydantic import Field, field_validator, model_validator

from switchyard.common.config.base import _Strict


DEFAULT_WINDOW_SOURCE = "limits.default_context_window_tokens"
"""A :class:`ContextWindow`'s ``source`` where neither the config lists the model nor its server reports a window."""


class ContextWindow(NamedTuple):
    """A model's context window (``tokens``, the model server's tokens) and where it was taken from
    (``source``, for an error message: the config key, or the model server's report), with ``ratio``: the model
    server's prompt tokens per token of Switchyard's count, as the dispatcher measured it for that model on its
    recent calls (1.0: none measured; :mod:`switchyard.dispatcher.engines.token_ratio`). Every check of a prompt
    against the window goes through :meth:`model_tokens`, :meth:`room` or :meth:`left`, so a prompt is measured
    in the server's tokens wherever it is checked."""

    tokens: int
    source: str
    ratio: float = 1.0

    def model_tokens(self, counted: int) -> int:
        """The model server's tokens of a prompt Switchyard counted ``counted`` tokens (its count scaled by
        :attr:`ratio`, rounded up)."""
        return counted if self.ratio == 1.0 else math.ceil(counted * self.ratio)

    def room(self, completion: int) -> int:
        """The most tokens of Switchyard's count a prompt may have beside ``completion`` completion tokens
        (negative: none fits)."""
        return self.tokens - completion if self.ratio == 1.0 else math.floor((self.tokens - completion) / self.ratio)

    def left(self, counted: int) -> int:
        """Completion tokens left beside a prompt Switchyard counted ``counted`` tokens (negative: the prompt
        alone is past the window)."""
        return self.tokens - self.model_tokens(counted)

    def counted(self, counted: int) -> str:
        """A prompt's size for a message: ``"N tokens"``, with the server's tokens where they differ."""
        served = self.model_tokens(counted)
        return f"{counted} tokens" if served == counted else f"{counted} tokens (about {served} of the model server's)"

    def described(self) -> str:
        """The window for a message: ``"W tokens (source)"``, with the ratio where one was measured."""
        if self.ratio == 1.0:
            return f"{self.tokens} tokens ({self.source})"
        return (f"{self.tokens} tokens ({self.source}), its server counting {self.ratio:.2f} tokens per token of "
                "Switchyard's count (measured on its recent calls)")


class RequestLimitsConfig(_Strict):
    """What one request may ask for: the one source of limits, checked by the orchestrator before
    ``accepted`` and again by the dispatcher for callers that reach it directly: ``switchyard.json``
    ``limits``, read by both (and by retrieval, for ``max_query_chars``)."""

    max_tokens: int = Field(8192, ge=1, le=1_000_000, description="Largest max_tokens a task or Generate may ask for, tokens.")
    default_max_tokens: int = Field(
        128, ge=1, le=1_000_000,
        description="Completion tokens of a model call whose task or Generate sends max_tokens = 0, tokens (at most "
        "max_tokens): the one default, read by the orchestrator for a task's calls and by the dispatcher for a "
        "Generate's. It never takes more than half the model's context window (the prompt keeps the rest).",
    )
    context_window_tokens: dict[str, int] = Field(
        default_factory=lambda: {"sim-7b": 4096, "torch-tiny": 8192, "claude-sonnet-4-5": 200_000, "gpt-4o-mini": 128_000},
        description="Context window per model id, tokens: prompt + max_tokens must fit. A model not listed takes "
        "the window its model server reports (vLLM's and SGLang's max_model_len in GET /v1/models), else "
        "default_context_window_tokens.",
    )
    default_context_window_tokens: int = Field(
        8192, ge=16, le=10_000_000, description="Context window of a model missing from context_window_tokens whose "
        "model server reports none, tokens."
    )
    max_payload_chars: int = Field(200_000, ge=1, le=100_000_000, description="Longest task payload, characters.")
    max_query_chars: int = Field(
        10_000, ge=1, le=10_000_000,
        description="Longest query a Retrieve call may send, characters; the retrieval service answers a longer one "
        "INVALID_ARGUMENT, and the orchestrator queries with a task's payload cut to this length (the embedding "
        "model reads its first 256 tokens, about 1,000 characters, and lexical search gains little past it).",
    )
    max_prompt_chars: int = Field(
        1_000_000, ge=1, le=100_000_000,
        description="Longest prompt a Generate may carry, characters: the prompt, the messages' contents and tool "
        "calls, and the tools offered (names, descriptions, parameter schemas), which a model server renders into "
        "the prompt.",
    )
    max_task_id_chars: int = Field(128, ge=1, le=4096, description="Longest task_id, characters.")
    max_id_chars: int = Field(256, ge=1, le=4096, description="Longest agent_id, model or request_id, characters.")
    max_metadata_entries: int = Field(64, ge=0, le=100_000, description="Most metadata entries per task, entries.")
    max_metadata_bytes: int = Field(16_384, ge=0, le=100_000_000, description="Most metadata bytes (keys + values, UTF-8), bytes.")
    max_messages: int = Field(1024, ge=1, le=1_000_000, description="Most chat messages per Generate, messages.")
    max_tools: int = Field(128, ge=0, le=100_000, description="Most tools offered per Generate, tools.")
    max_tool_schema_chars: int = Field(
        65_536, ge=2, le=100_000_000,
        description="Longest parameter schema (parameters_json) of one tool a Generate offers, characters; the "
        "dispatcher answers a longer one INVALID_ARGUMENT naming tools[i].parameters_json before checking it "
        "against the JSON Schema metaschema, a check whose CPU time grows with the schema (about 0.2 s for "
        "64 KiB). A real tool's schema is a few hundred characters to a few KiB.",
    )
    max_tool_schemas_chars: int = Field(
        262_144, ge=2, le=100_000_000,
        description="Most characters of parameter schemas (parameters_json) all the tools of one Generate offer "
        "together; the dispatcher answers more INVALID_ARGUMENT naming tools before checking any of them: each "
        "schema within limits.max_tool_schema_chars, 128 of them would still cost seconds of CPU to check.",
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> "RequestLimitsConfig":
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must be at most max_tokens "
                             f"({self.max_tokens})")
        return self

    @field_validator("context_window_tokens")
    @classmethod
    def _windows(cls, value: dict[str, int]) -> dict[str, int]:
        bad = {model: tokens for model, tokens in value.items() if tokens < 16}
        if bad:
            raise ValueError(f"expected windows of at least 16 tokens, got {bad}")
        return value

    def default_for(self, window_tokens: int) -> int:
        """The completion tokens a call that names none gets in a context window of ``window_tokens``:
        ``default_max_tokens``, at most half the window (the prompt keeps the rest; a default larger than a
        model's window refused every call that named none), at least 1."""
        return max(1, min(self.default_max_tokens, window_tokens // 2))

    def context_window(self, model: str, reported: int = 0, ratio: float = 1.0) -> ContextWindow:
        """Context window of ``model``: the one ``context_window_tokens`` lists for it (the operator's word
        wins); else ``reported``, what its model server reports (> 0: vLLM's and SGLang's ``max_model_len`` in
        ``GET /v1/models``, read by the gateway); else ``default_context_window_tokens``; with its source, and
        ``ratio``, the server's prompt tokens per counted one the dispatcher measured (1.0: none; a ratio not
        positive and finite is taken as 1.0)."""
        ratio = ratio if math.isfinite(ratio) and ratio > 0 else 1.0
        listed = self.context_window_tokens.get(model)
        if listed is not None:
            return ContextWindow(listed, "limits.context_window_tokens", ratio)
        if reported > 0:
            return ContextWindow(reported, "as its model server reports it", ratio)
        return ContextWindow(self.default_context_window_tokens, DEFAULT_WINDOW_SOURCE, ratio)
