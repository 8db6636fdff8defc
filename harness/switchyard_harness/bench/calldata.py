"""Call data in ghz's format, turned into ``RunTaskRequest`` messages.

ghz takes the request as JSON (``-d``/``--data`` or ``-D``/``--data-file``): one
object, or an array of objects used round-robin, one per call in order
(https://ghz.sh/docs/calldata). Field names and enum values follow the proto3
JSON mapping, e.g. ``{"task_id": "bench-001", "payload": "summarize this doc",
"priority": "CORE"}``. Of ghz's template actions this module expands
``{{.RequestNumber}}`` (0-based call number), which is what keeps task ids unique.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from switchyard.api import agent_pb2
from switchyard.common.priority import PriorityClass

REQUEST_NUMBER = "{{.RequestNumber}}"


class CallDataError(ValueError):
    """Call data is not a JSON object or a non-empty array of objects, or a field is unknown."""


def parse_calldata(data: Any, source: str = "data") -> list[dict[str, Any]]:
    """Validate ghz call data and return it as a list of message objects.

    Args:
        data: a JSON string, or already-decoded JSON (an object or an array of objects).
        source: where the data came from, for error messages.

    Raises:
        CallDataError: not JSON, not an object / non-empty array of objects, or a
            field that ``agent.RunTaskRequest`` does not have.
    """
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise CallDataError(f"{source}: not valid JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(item, dict) for item in items):
        raise CallDataError(f"{source}: expected a JSON object or a non-empty array of objects, got {data!r:.80}")
    for i, item in enumerate(items):
        try:
            json_format.ParseDict(_expand(item, 0), agent_pb2.RunTaskRequest())
        except json_format.ParseError as exc:
            raise CallDataError(f"{source}[{i}]: not an agent.RunTaskRequest: {exc}") from None
    return items


def load_calldata_file(path: str | Path) -> list[dict[str, Any]]:
    """Read a ghz data file.

    Raises:
        CallDataError: the file cannot be read (missing, a folder, not UTF-8: the message names the path and why),
            or its data is bad (see :func:`parse_calldata`).
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")  # an editor's BOM is no error
    except OSError as exc:
        raise CallDataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise CallDataError(f"{path}: expected UTF-8 JSON ({exc})") from None
    return parse_calldata(text, source=str(path))


def request_for(items: list[dict[str, Any]], number: int) -> agent_pb2.RunTaskRequest:
    """The request for call ``number`` (0-based): item ``number % len(items)``, templates expanded."""
    item = _expand(items[number % len(items)], number)
    return json_format.ParseDict(item, agent_pb2.RunTaskRequest())


def priority_name(request: agent_pb2.RunTaskRequest) -> str:
    """Priority class as reported: CORE, NORMAL or BATCH (unset counts as NORMAL)."""
    return PriorityClass.from_proto(request.priority).name


def _expand(value: Any, number: int) -> Any:
    if isinstance(value, str):
        return value.replace(REQUEST_NUMBER, str(number))
    if isinstance(value, dict):
        return {k: _expand(v, number) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, number) for v in value]
    return value
