"""``switchyard.json`` ``slo``: the service-level objectives the Prometheus alert rules are generated from."""

from __future__ import annotations


from pydantic import Field, field_validator

from switchyard.common.config.base import _Strict
from switchyard.common.priority import ClassLabel


# The dispatcher's switchyard_ttft_seconds bucket bounds (switchyard.common.metrics.TTFT_BUCKETS):
# a threshold must be one of them, or the good-event count has no bucket to read.
_TTFT_BUCKET_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 30, 60)


class TtftSloConfig(_Strict):
    """The TTFT service-level objective: a share of first tokens that must come within a threshold.

    The services do not read it: ``deploy/prometheus/rules.py`` generates the
    recording rules and burn-rate alerts of ``deploy/prometheus/`` from it.
    The good events are ``switchyard_ttft_seconds_bucket{le=threshold}``, so
    the threshold must be one of that histogram's bucket bounds.
    """

    threshold_s: float = Field(
        1.0, gt=0, description="A first token within this many seconds of Generate is good (a TTFT bucket bound)."
    )
    objective: float = Field(
        0.99, gt=0, lt=1, description="Share of first tokens that must be good over period_days, a fraction (0.99 = 99 %)."
    )
    period_days: int = Field(30, ge=1, le=366, description="The SLO window whose error budget the alerts protect, days.")
    priority_classes: list[ClassLabel] = Field(
        ["core", "normal"], min_length=1, description="Priority classes (names) the objective covers (batch has none by default)."
    )

    @field_validator("threshold_s")
    @classmethod
    def _threshold_is_a_bucket(cls, value: float) -> float:
        if value not in _TTFT_BUCKET_BOUNDS:
            raise ValueError(
                f"one of the switchyard_ttft_seconds bucket bounds {list(_TTFT_BUCKET_BOUNDS)} (got {value})"
            )
        return value


class SloConfig(_Strict):
    """Service-level objectives the Prometheus alert rules are generated from (``deploy/prometheus/rules.py``)."""

    ttft: TtftSloConfig = Field(TtftSloConfig(), description="The time-to-first-token objective.")
