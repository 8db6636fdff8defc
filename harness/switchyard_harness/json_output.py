"""JSON that scripts read: every non-finite number written as ``null``.

Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default,
which no strict JSON parser accepts (``jq``, JavaScript's ``JSON.parse``, Go's
``encoding/json``). A NaN reaches the harness's figures from a gauge that is not
read (``switchyard_gpu_utilization_ratio`` on a machine without NVML) or from a
ratio of nothing; :func:`dumps` writes it as ``null``, the value a figure that is
not known has everywhere else in these outputs.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite replaced by None, through dicts, lists and tuples
    (tuples become lists, as JSON writes them); everything else unchanged."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(finite(value), allow_nan=False, **kwargs)``: valid JSON, NaN and infinities as null.

    Raises:
        TypeError: a value JSON cannot hold (as ``json.dumps``).
    """
    return json.dumps(finite(value), allow_nan=False, **kwargs)
