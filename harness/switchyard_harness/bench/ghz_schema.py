"""JSON Schema of ghz's JSON report (``ghz -O json``), as ghz documents and writes it.

Written from ghz's documentation (https://ghz.sh/docs/output) and the ``Report``,
``LatencyDistribution``, ``Bucket`` and ``ResultDetail`` types in
``runner/reporter.go`` of github.com/bojand/ghz: durations are Go
``time.Duration`` values, i.e. integer nanoseconds; histogram marks are seconds
and frequencies fractions 0-1; ``date`` is RFC 3339 and detail timestamps RFC
3339 with nanoseconds; latency percentiles are 10, 25, 50, 75, 90, 95 and 99.
``latencyDistribution`` and ``histogram`` are null when no call succeeded (a nil
Go slice). Extra top-level keys are allowed: Switchyard puts its streaming
figures under ``switchyard`` (see :data:`STREAMING_SCHEMA`).
"""

from __future__ import annotations

from typing import Any

PERCENTILES = (10, 25, 50, 75, 90, 95, 99)

_NS = {"type": "integer", "minimum": 0, "description": "nanoseconds"}
_RFC3339 = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$"

_LATENCY_DISTRIBUTION: dict[str, Any] = {
    "type": ["array", "null"],
    "prefixItems": [
        {
            "type": "object",
            "required": ["percentage", "latency"],
            "properties": {"percentage": {"const": p}, "latency": _NS},
        }
        for p in PERCENTILES
    ],
    "minItems": len(PERCENTILES),
    "maxItems": len(PERCENTILES),
}

GHZ_REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "ghz JSON report",
    "type": "object",
    "required": [
        "date",
        "count",
        "total",
        "average",
        "fastest",
        "slowest",
        "rps",
        "errorDistribution",
        "statusCodeDistribution",
        "latencyDistribution",
        "histogram",
        "details",
    ],
    "properties": {
        "name": {"type": "string"},
        "endReason": {"enum": ["normal", "cancel", "timeout"]},
        "options": {
            "type": "object",
            "required": ["insecure", "binary", "CPUs"],
            "properties": {
                "call": {"type": "string"},
                "host": {"type": "string"},
                "proto": {"type": "string"},
                "import-paths": {"type": "array", "items": {"type": "string"}},
                "insecure": {"type": "boolean"},
                "binary": {"type": "boolean"},
                "rps": {"type": "integer", "minimum": 0},
                "concurrency": {"type": "integer", "minimum": 0},
                "total": {"type": "integer", "minimum": 0},
                "connections": {"type": "integer", "minimum": 0},
                "duration": _NS,
                "timeout": _NS,
                "CPUs": {"type": "integer", "minimum": 0},
                "data": {"type": ["object", "array"]},
            },
        },
        "date": {"type": "string", "pattern": _RFC3339},
        "count": {"type": "integer", "minimum": 0},
        "total": _NS,
        "average": _NS,
        "fastest": _NS,
        "slowest": _NS,
        "rps": {"type": "number", "minimum": 0},
        "errorDistribution": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
        "statusCodeDistribution": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
        "latencyDistribution": _LATENCY_DISTRIBUTION,
        "histogram": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "required": ["mark", "count", "frequency"],
                "properties": {
                    "mark": {"type": "number", "minimum": 0, "description": "seconds"},
                    "count": {"type": "integer", "minimum": 0},
                    "frequency": {"type": "number", "minimum": 0, "maximum": 1},
                },
            },
        },
        "details": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "required": ["timestamp", "latency", "error", "status"],
                "properties": {
                    "timestamp": {"type": "string", "pattern": _RFC3339},
                    "latency": _NS,
                    "error": {"type": "string"},
                    "status": {"type": "string"},
                },
            },
        },
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

_GROUP: dict[str, Any] = {
    "type": "object",
    "required": ["count", "errors", "average", "latencyDistribution", "ttftDistribution"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "errors": {"type": "integer", "minimum": 0},
        "average": _NS,
        "latencyDistribution": _LATENCY_DISTRIBUTION,
        "ttftDistribution": _LATENCY_DISTRIBUTION,
    },
}

STREAMING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["ttftDistribution", "ttftAverage", "tokens", "tokensPerSecond", "byPriority", "byTaskType", "client"],
    "properties": {
        "ttftDistribution": _LATENCY_DISTRIBUTION,
        "ttftAverage": _NS,
        "tokens": {"type": "integer", "minimum": 0},
        "tokensPerSecond": {"type": "number", "minimum": 0},
        "failedCallTokens": {"type": "integer", "minimum": 0},
        "errorGroups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["kind", "count", "example"],
                "properties": {
                    "kind": {"type": "string"},
                    "count": {"type": "integer", "minimum": 1},
                    "example": {"type": "string"},
                },
            },
        },
        "byPriority": {
            "type": "object",
            "propertyNames": {"enum": ["CORE", "NORMAL", "BATCH"]},
            "additionalProperties": _GROUP,
        },
        "byTaskType": {"type": "object", "additionalProperties": _GROUP},
        "queueWait": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["average", "p95"],
                "properties": {"average": _NS, "p95": _NS},
            },
        },
        "client": {
            "type": "object",
            "required": ["processes", "cpuSeconds", "wallSeconds", "cores", "saturation"],
            "properties": {
                "processes": {"type": "integer", "minimum": 1},
                "cpuSeconds": {"type": "number", "minimum": 0},
                "wallSeconds": {"type": "number", "minimum": 0},
                "cores": {"type": "integer", "minimum": 1},
                "saturation": {"type": "number", "minimum": 0},
            },
        },
    },
}

SWITCHYARD_REPORT_SCHEMA: dict[str, Any] = {
    **GHZ_REPORT_SCHEMA,
    "title": "switchyard bench report (ghz JSON report + streaming figures)",
    "required": [*GHZ_REPORT_SCHEMA["required"], "switchyard"],
    "properties": {**GHZ_REPORT_SCHEMA["properties"], "switchyard": STREAMING_SCHEMA},
}
