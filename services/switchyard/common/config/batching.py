"""``queue.json`` ``flush``: how the dispatcher batches Generate calls (dispatcher/double_buffer.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from switchyard.common.config.base import _Strict


class BatchingConfig(_Strict):
    """How the dispatcher batches Generate calls (double buffer, dispatcher/double_buffer.py):
    ``queue.json`` ``flush``."""

    max_batch_size: int = Field(
        32, ge=1, le=4096, description="Flush when the active buffer holds this many requests, requests."
    )
    flush_interval_ms: float | Literal["auto"] = Field(
        20.0,
        description='Flush a non-empty buffer this often, milliseconds; "auto" adapts the window to the arrival rate and '
        "the engine's batch time within p95_budget_ms (dispatcher/adaptive_flush.py).",
    )
    p95_budget_ms: float = Field(
        1000, gt=0, le=600_000, description='"auto" only: P95 budget for buffer wait + batch service time, milliseconds.'
    )
    min_interval_ms: float = Field(1, gt=0, le=10_000, description='"auto" only: shortest window, milliseconds.')
    max_interval_ms: float = Field(100, gt=0, le=10_000, description='"auto" only: longest window, milliseconds.')

    @field_validator("flush_interval_ms", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> float | str:
        # strict as every key is (base.py): a number, or the string "auto"; "20" and true are not numbers
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 10_000:  # NaN too
            raise ValueError(f'expected milliseconds, a number in (0, 10000], or "auto" (got {value!r})')
        return float(value)

    @model_validator(mode="after")
    def _window(self) -> "BatchingConfig":
        if self.min_interval_ms > self.max_interval_ms:
            raise ValueError(
                f"min_interval_ms ({self.min_interval_ms}) must not exceed max_interval_ms ({self.max_interval_ms})"
            )
        return self

    @property
    def adaptive(self) -> bool:
        """True when ``flush_interval_ms`` is ``"auto"``."""
        return self.flush_interval_ms == "auto"
