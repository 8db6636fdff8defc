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


def check_tenant(value: str, field: str) -> str:
    """``value`` when it is a well-formed tenant id (:data:`EXPECTED`).

    Raises:
        InvalidArgument: naming ``field``, with what was expected.
    """
    if not TENANT_PATTERN.fullmatch(value):
        raise InvalidArgument(field, EXPECTED, value[:80])
    return value
