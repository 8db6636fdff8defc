"""The request ids of one client's calls in flight, none of them shared: the orchestrator's dispatcher client
and the gateway's upstream client keep one each.

Two tasks under one task_id at once (the field's ghz command sends task_id bench-001 from every worker) make
calls under one id. Servers key a request by it: ``transformers serve``'s batching worker died of two live
requests under one X-Request-Id (every request after it answered 503 'CB worker is dead'), and vLLM refuses the
second 400 'already running'. So a call takes its own id while no call in flight holds it, else ``<id>~<n>``
(``n`` counts every repeat this client made).
"""

from __future__ import annotations


class LiveRequestIds:
    """Ids of calls in flight: :meth:`claim` one as a call starts, :meth:`release` it as the call ends."""

    __slots__ = ("_live", "_repeats")

    def __init__(self) -> None:
        self._live: set[str] = set()
        self._repeats = 0

    def claim(self, request_id: str) -> str:
        """``request_id``, or ``<request_id>~<n>`` while a call in flight holds it; held from now on. An empty
        id names no request: it is answered as it is and not held."""
        claimed = request_id
        while claimed in self._live:
            self._repeats += 1
            claimed = f"{request_id}~{self._repeats}"
        if claimed:
            self._live.add(claimed)
        return claimed

    def release(self, request_id: str) -> None:
        """The call under ``request_id`` (as :meth:`claim` answered it) ended."""
        self._live.discard(request_id)
