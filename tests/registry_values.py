"""Read a sample of the process's Prometheus registry, as a test compares before and after."""

from __future__ import annotations

from prometheus_client import REGISTRY


def metric(name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` (0 when the series does not exist yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
