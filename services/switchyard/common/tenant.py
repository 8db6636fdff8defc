"""A task's tenant: who it is served for, carried from the edge to the dispatcher.

The orchestrator's edge takes it from the caller's bearer token (a token line may
name its tenant, see common/auth.py), else from the ``x-tenant-id`` gRPC metadata
key or HTTP header, else :data:`DEFAULT_TENANT`. It travels on every
``GenerateRequest.tenant_id`` and ``ToolWaitRequest.tenant_id`` and is answered on
``TaskStatus.tenant_id``.
"""

from __future__ import annotations

import re

from switchyard.common.errors import InvalidArgument

DEFAULT_TENANT = "default"
"""The tenant of a task whose caller names none."""
TENANT_HEADER = "x-tenant-id"
"""The gRPC metadata key (and HTTP header, any case) naming a task's tenant."""
MAX_TENANT_CHARS = 64
TENANT_PATTERN = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TENANT_CHARS}}}")
EXPECTED = f"1 to {MAX_TENANT_CHARS} characters of A-Z a-z 0-9 . _ -"


AGENT_KEY_SEPARATOR = "\x1f"
"""Between a tenant and an agent id in :func:`agent_key`: a control character, which no id the edge accepts
holds (agent ids refuse control characters, tenant ids take :data:`EXPECTED`), so keys never collide."""


PROGRAM_KEY_SEPARATOR = "\x1e"
"""Between an agent's key and its task's id in :func:`program_key` (a control character no id holds)."""


def program_key(tenant: str, agent_id: str, task_id: str) -> str:
    """The one key of one task (one program run) of agent ``agent_id`` of ``tenant``: what a dispatcher keeps a
    task's parked prefix state, tool-wait plan, DRAM copy and warm-up prefix under, so that two tasks of one
    agent running at once (the field's load test draws its agent ids from 1,000 for every task) never take or
    release each other's. :func:`agent_key` when ``task_id`` is "" (a caller that names no task)."""
    key = agent_key(tenant, agent_id)
    if not key or not task_id:
        return key
    return f"{key}{PROGRAM_KEY_SEPARATOR}{task_id}"


def agent_key(tenant: str, agent_id: str) -> str:
    """The one key of agent ``agent_id`` of ``tenant``: two tenants may each run an agent of the same id, and
    each has its own memory, parked KV, tool-wait plans and attained service. The default tenant's agents
    (``tenant`` :data:`DEFAULT_TENANT` or "") keep their bare id, so state written before tenants existed is
    still found; another tenant's is ``tenant`` + :data:`AGENT_KEY_SEPARATOR` + ``agent_id``. "" when
    ``agent_id`` is "" (no agent)."""
    if not agent_id or not tenant or tenant == DEFAULT_TENANT:
        return agent_id
    return f"{tenant}{AGENT_KEY_SEPARATOR}{agent_id}"


def check_tenant(value: str, field: str) -> str:
    """``value`` when it is a well-formed tenant id (:data:`EXPECTED`).

    Raises:
        InvalidArgument: naming ``field``, with what was expected.
    """
    if not TENANT_PATTERN.fullmatch(value):
        raise InvalidArgument(field, EXPECTED, value[:80])
    return value
